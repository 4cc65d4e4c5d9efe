"""Sweep the recurrence kernel's launch configuration on a GPU (one device call).

    python benchmarks/tune_verify.py [--quick]
    python benchmarks/tune_verify.py --ncu-case   # one verify launch, for ncu

Prints, per configuration, verify time at the issue's shapes and the ratio to a copy of the state
bytes; writes tune_verify.json under $OUT when set.
"""
import argparse
import itertools
import json
import os

import torch

from recoverssm.backends.triton import launch
from recoverssm.backends.triton.launch import LaunchConfig
from recoverssm.bench.problems import window
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us
from recoverssm.core.backend import GateInputs

H, K, V = 16, 128, 128


def run(cfg: LaunchConfig, w, mode="verify"):
    launch.gdn_recurrent(cfg, mode, w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                         GateInputs(**w.gates()), K ** -0.5, True, -1, torch.empty_like(w.v),
                         (w.records.correction, w.records.key, w.records.decay), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ncu-case", action="store_true")
    args = ap.parse_args()
    if args.ncu_case:
        w = window(64, 4, H, 48, K, V)
        cfg = LaunchConfig()
        run(cfg, w)
        torch.cuda.synchronize()
        run(cfg, w)
        torch.cuda.synchronize()
        return
    ceiling = CopyCeiling("cuda")
    shapes = [(64, 4, 48), (64, 8, 48), (256, 4, 48), (8, 4, 48)]
    wins = {}
    for N, T, HV in shapes:
        n = copies_for(N * HV * V * K * 4)
        wins[(N, T, HV)] = [window(N, T, H, HV, K, V, seed=i) for i in range(n)]
    grid = dict(bv=[8, 16, 32], kc=[1, 2, 4, 8], warps=[1, 2], stages=[None], fusion=[False, True])
    if args.quick:
        grid = dict(bv=[8, 16, 32], kc=[1, 2], warps=[1], stages=[None], fusion=[False])
    results = []
    for bv, kc, warps, stages, fusion in itertools.product(*grid.values()):
        per_thread = bv * K // (32 * warps)
        if per_thread < 16 or per_thread > 128:
            continue
        cfg = LaunchConfig(gdn_block_v=bv, gdn_k_chunks=kc, gdn_warps=warps, gdn_stages=stages,
                           gdn_fp_fusion=fusion)
        row = dict(bv=bv, kc=kc, warps=warps, stages=stages, fusion=fusion)
        try:
            for (N, T, HV), ws in wins.items():
                us = median_us([lambda w=w: run(cfg, w) for w in ws], warmup=3, iters=20)
                row[f"N{N}T{T}"] = round(us, 1)
                row[f"N{N}T{T}_vs_copy"] = round(ceiling.us(N * HV * V * K * 4) / us, 3)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(row)
        print(row, flush=True)
    best = sorted((r for r in results if "error" not in r), key=lambda r: r["N64T4"])[:8]
    print("best by N64T4:")
    for r in best:
        print(r)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune_verify.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
