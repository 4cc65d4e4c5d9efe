# session 11: next-wave L2 prefetch of the state tile in the recurrence kernel, by distance (programs ahead)
import sys
from dataclasses import replace
from functools import partial
import torch
sys.path.insert(0, "benchmarks")
from tune_verify import run
from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.bench.problems import window
from recoverssm.bench.timing import CopyCeiling, median_us, copies_for
base = CudaBackend.launch_table[None]
K = V = 128
shapes = [(64, 4, 48, "verify"), (64, 8, 48, "verify"), (256, 4, 48, "verify"), (64, 4, 32, "verify"),
          (8, 4, 48, "verify"), (64, 4, 48, "snapshot"), (64, 8, 32, "snapshot")]
wins = {}
for N, T, HV, _ in shapes:
    if (N, T, HV) not in wins:
        wins[(N, T, HV)] = [window(N, T, 16, HV, K, V, extra_slots=N * T, seed=i) for i in range(copies_for(N * HV * K * V * 4))]
dists = [int(x) for x in sys.argv[1].split(",")]
for dist in dists:
    cfg = replace(base, gdn_prefetch_distance=dist)
    row = {"dist": dist}
    for N, T, HV, mode in shapes:
        row[f"{mode[:4]}N{N}T{T}HV{HV}"] = round(median_us([partial(run, cfg, w, mode) for w in wins[(N, T, HV)]], warmup=3, iters=20), 1)
    print(row, flush=True)
