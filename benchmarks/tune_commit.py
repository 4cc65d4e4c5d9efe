"""Sweep the grouped commit kernel's tile (V rows per tile), warps, register cap, tiles per
program, L2 prefetch hints and replay-record pairs on a GPU.

    python benchmarks/tune_commit.py                           # V rows 16..128 x warps 1..8
    python benchmarks/tune_commit.py --grid 64x4,64x4x128,64x4x0x4,32x2x168x4x1,16x1x128x2x3x1
                                    # rows x warps [x cap [x tiles [x prefetch [x record pairs]]]]
"""
import argparse
import functools
import itertools
import json
import os

import torch

import recoverssm as rs
from recoverssm.backends.triton.launch import LaunchConfig
from recoverssm.bench.problems import align_step, commit_context, window
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us

H, K, V = 16, 128, 128
BLOCK_V, WARPS = [16, 32, 64, 128], [1, 2, 4, 8]


def configs(grid):
    if grid:
        for spec in grid.split(","):
            bv, warps, *rest = map(int, spec.split("x"))
            cap, tiles, prefetch, pairs = rest + [0, 1, 0, 0][len(rest):]
            yield bv, warps, cap or None, tiles, prefetch, pairs
        return
    for bv, warps in itertools.product(BLOCK_V, WARPS):
        if 4 <= bv * K // (32 * warps) <= 128:
            yield bv, warps, None, 1, 0, 0


def align_case(G, L, R, dtype):
    """The bench's align-mode commits: ``G`` groups x ``L`` layers, ``R`` requests, T = 4."""
    step = align_step(R, 4)
    ctx, caches = commit_context(G, L, R, 4, H, 48, K, V, step.num_slots, dtype)
    state = 48 * V * K * torch.tensor([], dtype=dtype).element_size()
    accepted = step.num_accepted.sum().item()
    traffic = G * L * (state * (2 * R + step.boundaries) + accepted * (48 * V + H * K + 48) * 4)
    call = functools.partial(ctx.commit, step.num_accepted, step.state_indices, step.query_start_loc,
                             block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                             block_size=step.block_size)
    del caches        # the context holds the layers
    return [ctx], [call], traffic


def spec_step_case(N, T, HV):
    """The commit of the bench's speculative step: one layer, ``N`` rows, fp32 state, no align
    mode, row r accepting ``1 + 7r mod T`` tokens, inputs rotated out of L2 as in the bench."""
    wins = [window(N, T, H, HV, K, V, seed=i) for i in range(copies_for(N * HV * V * K * 4))]
    accepted = torch.tensor([1 + (r * 7) % T for r in range(N)], dtype=torch.int32, device="cuda")
    for w in wins:
        w.verify()    # real records
    contexts = [rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N, backend="cuda") for w in wins]
    calls = [functools.partial(c.commit, accepted, w.state_indices, w.query_start_loc) for w, c in zip(wins, contexts)]
    traffic = 2 * N * HV * V * K * 4 + int(accepted.sum()) * (HV * V + H * K + HV) * 4
    return contexts, calls, traffic


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", help="comma-separated ROWSxWARPS[xMAXNREG[xTILES[xPREFETCH[xPAIRS]]]] (MAXNREG 0 = "
                                   "no cap; PREFETCH: 1 hints the records, 2 the next tile, 3 both; PAIRS: "
                                   "1 loads the replay records of two positions at a time, 0 one ahead)")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the grid (an A/B within one run)")
    ap.add_argument("--cases", help="run only the cases whose name contains one of these comma-separated words")
    args = ap.parse_args()
    ceiling = CopyCeiling("cuda")
    cases = [("12L x 8req fp32", functools.partial(align_case, 1, 12, 8, torch.float32)),
             ("3x6L x 64req bf16", functools.partial(align_case, 3, 6, 64, torch.bfloat16)),
             ("3x6L x 8req bf16", functools.partial(align_case, 3, 6, 8, torch.bfloat16)),
             ("spec step 1L x N64 T4 HV32 fp32", functools.partial(spec_step_case, 64, 4, 32)),
             ("spec step 1L x N64 T4 HV48 fp32", functools.partial(spec_step_case, 64, 4, 48))]
    if args.cases:
        cases = [c for c in cases if any(word in c[0] for word in args.cases.split(","))]
    results = []
    for name, build in cases:
        contexts, calls, traffic = build()
        for _, (bv, warps, cap, tiles, prefetch, pairs) in itertools.product(range(args.repeat),
                                                                            list(configs(args.grid))):
            cfg = LaunchConfig(commit_block_v=bv, commit_warps=warps, commit_max_registers=cap,
                               commit_tiles_per_program=tiles, commit_prefetch_records=bool(prefetch & 1),
                               commit_prefetch_next_tile=bool(prefetch & 2), commit_replay_pairs=bool(pairs))
            for ctx in contexts:
                ctx._committer.set_config(cfg)
            us = median_us(calls, iters=40)
            row = dict(case=name, bv=bv, warps=warps, maxnreg=cap, tiles=tiles, prefetch=prefetch, pairs=pairs,
                       us=round(us, 1), vs_copy=round(ceiling.us(traffic) / us, 3))
            results.append(row)
            print(row, flush=True)
        del contexts, calls
        torch.cuda.empty_cache()
    for name, _ in cases:
        best = max((r for r in results if r["case"] == name), key=lambda r: r["vs_copy"])
        print("best", best)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune_commit.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
