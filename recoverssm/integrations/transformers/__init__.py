"""Speculative ``generate`` for Hugging Face transformers' hybrid models
(``pip install "recoverssm[transformers]"``).

transformers refuses assisted generation and prompt lookup for every model with recurrent
layers. :func:`speculative` lifts that for one model instance and makes it exact: the
linear-attention layers verify each window of candidates with RecoverSSM's ops and commit the
accepted tokens when generate rolls its cache back::

    from recoverssm.integrations.transformers import speculative

    with speculative(model):
        out = model.generate(input_ids, prompt_lookup_num_tokens=4, max_new_tokens=64)

* :mod:`.adapters`: the supported modules (Qwen3-Next, Qwen3.5, Qwen4Exp, OLMo-hybrid, Kimi-Linear)
  and how each maps onto the ops;
* :mod:`.ple`: Qwen4Exp's per-layer embeddings (a dilated conv and an n-gram id history);
* :mod:`.layer`: one layer's state, history, records and commits;
* :mod:`.context`: the context manager and the cache layers' rollback.
"""
from .adapters import supported_models
from .context import UnsupportedModelError, speculative

__all__ = ["UnsupportedModelError", "speculative", "supported_models"]
