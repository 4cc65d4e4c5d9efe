"""recoverssm: exact, cheap speculative decoding for the recurrent layers of hybrid LLMs.

Verify a draft window from a read-only checkpoint while recording a small fp32 replay record per
token, then commit only the accepted tokens with ``S = fma(c, k, S * decay)``, writing each state
once. The committed state is bit-identical to the per-token path. Every op is also a
``torch.library`` custom op, ``torch.ops.recoverssm.<name>``.
"""
from .core.api import (conv_decode, conv_verify, gdn_decode, gdn_spec_decode_snapshot, gdn_verify, kda_decode,
                       kda_spec_decode_snapshot, kda_verify, mamba2_decode, mamba2_spec_decode_snapshot,
                       mamba2_verify)
from .core.backend import Backend
from .core.commit import CommitContext, plan_commit
from .core.registry import BackendError, available_backends, get_backend
from .core.repeats import no_repeats
from .core.types import CommitPlan, LayerCache, Pending, ReplayRecords

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "CommitContext", "CommitPlan", "LayerCache", "Pending", "ReplayRecords",
    "available_backends", "conv_decode", "conv_verify", "gdn_decode", "gdn_spec_decode_snapshot", "gdn_verify",
    "get_backend", "kda_decode", "kda_spec_decode_snapshot", "kda_verify", "mamba2_decode",
    "mamba2_spec_decode_snapshot", "mamba2_verify", "no_repeats", "plan_commit",
    "__version__",
]
