# session 11: token-prep variants, prep alone, recurrence alone (new tree)
from dataclasses import replace
from functools import partial
import torch
from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.backends.triton import launch
from recoverssm.bench.problems import window
from recoverssm.bench.timing import median_us, copies_for
from recoverssm.core.backend import GateInputs
base = CudaBackend.launch_table[None]
K = V = 128
shapes = [(64, 4, 48), (64, 8, 48), (64, 4, 32), (256, 4, 48), (8, 4, 48), (1, 4, 48), (1, 2, 32)]
wins = {s: [window(s[0], s[1], 16, s[2], K, V, seed=i) for i in range(copies_for(s[0] * s[2] * K * V * 4))] for s in shapes}
def run(cfg, w):
    launch.gdn_recurrent(cfg, "verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                         GateInputs(**w.gates()), K ** -0.5, True, -1, torch.empty_like(w.v),
                         (w.records.correction, w.records.key, w.records.decay), None)
for bt, warps in [(16, 4), (8, 4), (32, 4), (64, 8)]:
    cfg = replace(base, prep_block_t=bt, prep_warps=warps)
    row = {}
    for s in shapes:
        ws = wins[s]
        row[f"full{s}"] = round(median_us([partial(run, cfg, w) for w in ws], warmup=3, iters=20), 1)
        row[f"prep{s}"] = round(median_us([partial(launch.prepare_tokens, cfg, w.q, w.k, s[2], GateInputs(**w.gates()), K ** -0.5, True, 128) for w in ws], warmup=3, iters=20), 1)
    print("prep_block_t", bt, "warps", warps, row, flush=True)
# recurrence alone: the workspace prepared once per window
orig = launch.prepare_tokens
cache = {}
def cached(cfg, q, *a):
    if id(q) not in cache:
        cache[id(q)] = orig(cfg, q, *a)
    return cache[id(q)]
launch.prepare_tokens = cached
row = {}
for s in shapes:
    ws = wins[s]
    for w in ws:
        run(base, w)
    row[f"rec{s}"] = round(median_us([partial(run, base, w) for w in ws], warmup=3, iters=20), 1)
print("recurrence alone", row, flush=True)
