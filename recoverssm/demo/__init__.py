"""``recoverssm demo``: a tiny GDN model decoded speculatively and checked bit for bit.

* :mod:`.model`: the model (weights from a fixed seed; every non-recurrent op one token at a time).
* :mod:`.draft`: the n-gram draft over each request's own history.
* :mod:`.spec`: the speculative path (verify windows, one grouped align-mode commit per step).
* :mod:`.reference`: the per-token path (``rs.gdn_decode``, one token per call).
* :mod:`.run`: the loop, the bit-identity checks and the command line.
"""
from .model import ModelConfig, TinyGDN
from .run import DemoConfig, DemoMismatch, DemoResult, run_demo

__all__ = ["DemoConfig", "DemoMismatch", "DemoResult", "ModelConfig", "TinyGDN", "run_demo"]
