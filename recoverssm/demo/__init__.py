"""``recoverssm demo``: a tiny GDN, KDA or Mamba2-hybrid model decoded speculatively and checked bit
for bit.

* :mod:`.model`: the model, GDN, KDA or Mamba2 layers (weights from a fixed seed; every non-recurrent
  op one token at a time).
* :mod:`.attention`: the Mamba2 hybrid's attention layers (KV cache, one token's attention).
* :mod:`.draft`: the n-gram draft over each request's own history.
* :mod:`.spec`: the speculative path (verify windows, one grouped align-mode commit per step).
* :mod:`.reference`: the per-token path (``rs.gdn_decode``, ``rs.kda_decode`` or
  ``rs.mamba2_decode`` and ``rs.conv_decode``, one token per call).
* :mod:`.checks`: the bit-identity checks between the two paths.
* :mod:`.deferred`: when a step's slots are checked (``--deferred``: once its deferred commit has
  been replayed by the next verify or flushed).
* :mod:`.run`: the loop (prefill, then one checked step at a time).
* :mod:`.tp`: the same loop under tensor parallelism, one process per rank.
* :mod:`.report` and :mod:`.cli`: what the command prints, and the command line of both front ends.
"""
from .model import ModelConfig, TinyGDN, TinyModel, model_config
from .run import DemoConfig, DemoMismatch, DemoResult, run_demo

__all__ = ["DemoConfig", "DemoMismatch", "DemoResult", "ModelConfig", "TinyGDN", "TinyModel", "model_config",
           "run_demo"]
