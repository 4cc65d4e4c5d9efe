# session 11: cache hints on the state traffic (recurrence and commit), A/B in one call
import sys
from dataclasses import replace
from functools import partial
import torch
sys.path.insert(0, "benchmarks")
from tune_verify import run
import tune_commit as tc
from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.bench.problems import window
from recoverssm.bench.timing import CopyCeiling, median_us, copies_for
base = CudaBackend.launch_table[None]
ceiling = CopyCeiling("cuda")
K = V = 128
HINTS = [("", "", ""), ("evict_first", "", ""), ("evict_first", "", ".cs"), ("", "", ".cs"),
         ("evict_first", "evict_first", ""), ("", "", "")]
what = sys.argv[1]
if what == "verify":
    shapes = [(64, 4, 48, "verify"), (64, 8, 48, "verify"), (256, 4, 48, "verify"), (64, 4, 32, "verify"),
              (64, 4, 48, "snapshot"), (64, 8, 32, "snapshot"), (256, 4, 48, "snapshot")]
    wins = {}
    for N, T, HV, _ in shapes:
        if (N, T, HV) not in wins:
            wins[(N, T, HV)] = [window(N, T, 16, HV, K, V, extra_slots=N * T, seed=i) for i in range(copies_for(N * HV * K * V * 4))]
    for hints in HINTS:
        cfg = replace(base, gdn_state_hints=hints)
        row = {"hints": hints}
        for N, T, HV, mode in shapes:
            row[f"{mode[:4]}N{N}T{T}HV{HV}"] = round(median_us([partial(run, cfg, w, mode) for w in wins[(N, T, HV)]], warmup=3, iters=20), 1)
        print(row, flush=True)
else:
    cases = [("12L x 8req fp32", partial(tc.align_case, 1, 12, 8, torch.float32)),
             ("3x6L x 64req bf16", partial(tc.align_case, 3, 6, 64, torch.bfloat16)),
             ("3x6L x 8req bf16", partial(tc.align_case, 3, 6, 8, torch.bfloat16)),
             ("3x6L x 64req fp32", partial(tc.align_case, 3, 6, 64, torch.float32)),
             ("spec 1L N64 T4 HV32", partial(tc.spec_step_case, 64, 4, 32)),
             ("spec 1L N64 T4 HV48", partial(tc.spec_step_case, 64, 4, 48))]
    for name, build in cases:
        contexts, calls, traffic = build()
        for hints in HINTS:
            for ctx in contexts:
                ctx._committer.set_config(replace(base, commit_state_hints=hints))
            us = median_us(calls, iters=40)
            print(dict(case=name, hints=hints, us=round(us, 1), vs_copy=round(ceiling.us(traffic) / us, 3)), flush=True)
        del contexts, calls
        torch.cuda.empty_cache()
