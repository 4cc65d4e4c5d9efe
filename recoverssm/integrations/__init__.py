"""Integrations of RecoverSSM with model libraries (optional extras).

* :mod:`.transformers`: speculative ``generate`` (assistant models, prompt lookup) for Hugging
  Face transformers' hybrid models, ``pip install "recoverssm[transformers]"``.
"""
