"""One grouped commit launch (after a warm-up) for ncu: python benchmarks/ncu_commit.py fp32|bf16 [ROWS WARPS [MAXNREG]]

fp32: the issue's 12 layers x 8 requests; bf16: 3 groups x 6 layers x 64 requests; both H=16,
HV=48, K=V=128, the align-mode mix of benchmarks (recoverssm/bench/problems.py).
"""
import sys

import torch

sys.path.insert(0, ".")
from recoverssm.backends.triton.launch import LaunchConfig  # noqa: E402
from recoverssm.bench.problems import align_step, commit_context  # noqa: E402

dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
groups, layers, requests = (1, 12, 8) if dtype == torch.float32 else (3, 6, 64)
step = align_step(requests, 4)
ctx, caches = commit_context(groups, layers, requests, 4, 16, 48, 128, 128, step.num_slots, dtype)
if len(sys.argv) > 3:
    rows, warps, cap = (list(map(int, sys.argv[2:5])) + [0])[:3]
    ctx._committer.set_config(LaunchConfig(commit_block_v=rows, commit_warps=warps,
                                           commit_max_registers=cap or None))
for _ in range(2):
    ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, block_table=step.block_table,
               num_computed_tokens=step.num_computed_tokens, block_size=step.block_size)
    torch.cuda.synchronize()
