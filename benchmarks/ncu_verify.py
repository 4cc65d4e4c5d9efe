"""One verify launch (after a warm-up) for ncu: python benchmarks/ncu_verify.py ours LANES_K ROWS [MAXNREG] | fla

Used by benchmarks/ncu_run.sh; N=64, T=4, HV=48, the issue's headline verify case.
"""
import sys

import torch

sys.path.insert(0, ".")
from recoverssm.backends.triton import launch  # noqa: E402
from recoverssm.backends.triton.launch import LaunchConfig  # noqa: E402
from recoverssm.bench.problems import window  # noqa: E402
from recoverssm.core.backend import GateInputs  # noqa: E402

H, K, V, N, T, HV = 16, 128, 128, 64, 4, 48
w = window(N, T, H, HV, K, V)
out = torch.empty_like(w.v)
rec = (w.records.correction, w.records.key, w.records.decay)
kind = sys.argv[1]
if kind == "ours":
    cfg = LaunchConfig(gdn_lanes_k=int(sys.argv[2]), gdn_rows=int(sys.argv[3]),
                       gdn_max_registers=int(sys.argv[4]) if len(sys.argv) > 4 else None)
    def call():
        launch.gdn_recurrent(cfg, "verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                             GateInputs(**w.gates()), K ** -0.5, True, -1, out, rec, None)
else:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from recoverssm.bench.suites import _fla_call
    call = _fla_call(w, fused_recurrent_gated_delta_rule)
call()
torch.cuda.synchronize()
call()
torch.cuda.synchronize()
