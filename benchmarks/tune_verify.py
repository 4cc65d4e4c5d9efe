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
from dataclasses import replace
from functools import partial

import torch

from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.backends.triton import launch
from recoverssm.backends.triton.launch import LaunchConfig
from recoverssm.bench.problems import window
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us
from recoverssm.core.backend import GateInputs

H, K, V = 16, 128, 128
_SNAPSHOT_SLOTS: dict = {}   # built once per window, outside the timed graphs


def run(cfg: LaunchConfig, w, mode="verify"):
    if mode == "snapshot":   # window built with extra_slots = N * T: one slot per position
        records = None
        if id(w) not in _SNAPSHOT_SLOTS:
            _SNAPSHOT_SLOTS[id(w)] = torch.arange(w.N * w.T, dtype=torch.int32, device=w.q.device).view(w.N, w.T) + w.N
        snap = _SNAPSHOT_SLOTS[id(w)]
    else:
        records, snap = (w.records.correction, w.records.key, w.records.decay), None
    launch.gdn_recurrent(cfg, mode, w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                         GateInputs(**w.gates()), K ** -0.5, True, -1, torch.empty_like(w.v),
                         records, snap)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ncu-case", action="store_true")
    ap.add_argument("--grid", help="configurations to sweep, e.g. 8x4,8x4x128,8x8x0x0,8x8x0x1x0 "
                    "(lanes_k x rows [x register cap, 0: none [x PTX widening of bf16 inputs, 0 or 1 "
                    "[x L2 hints (gdn_l2_hints), 0 or 1]]]; the last two default to the launch table's)")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the grid (an A/B within one run)")
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
    shapes = [(64, 4, 48, "verify"), (64, 8, 48, "verify"), (256, 4, 48, "verify"), (8, 4, 48, "verify"),
              (1, 4, 48, "verify"), (8, 8, 48, "verify"), (1, 8, 48, "verify"), (1, 2, 32, "verify"),
              (1, 2, 48, "verify"), (64, 4, 32, "verify"), (64, 8, 32, "verify"),
              (64, 4, 48, "snapshot"), (64, 8, 32, "snapshot")]
    wins = {}
    for N, T, HV, _ in shapes:
        if (N, T, HV) not in wins:
            n = copies_for(N * HV * V * K * 4)
            wins[(N, T, HV)] = [window(N, T, H, HV, K, V, extra_slots=N * T, seed=i) for i in range(n)]
    # (lanes along K, rows per thread, register cap): check a cap compiles without spills
    # (`python ci/compile_kernels.py` with Triton 3.6 for sm_90) before spending GPU time on it.
    # Lanes along K above launch.MAX_LANES_K (16) run as 16, so the sweep stops there.
    # the cuda backend's table row (small-grid rule included) with the swept fields replaced
    base = CudaBackend.launch_table[None]
    widen, hints = int(base.gdn_ptx_widen_bf16), int(base.gdn_l2_hints)
    grid = [(8, 8, None, widen, hints), (8, 4, 168, widen, hints), (8, 4, None, widen, hints),
            (16, 8, 168, widen, hints), (16, 8, None, widen, hints)]
    if args.grid:
        grid = []
        for spec in args.grid.split(","):
            fields = list(map(int, spec.split("x")))
            lanes_k, rows, cap, widen_spec, hints_spec = fields + [0, 0, 0, widen, hints][len(fields):]
            grid.append((lanes_k, rows, cap or None, widen_spec, hints_spec))
    if args.quick:
        grid = grid[:3]
    results = []
    for _, (lanes_k, rows, max_registers, widen, hints) in itertools.product(range(args.repeat), grid):
        cfg = replace(base, gdn_lanes_k=lanes_k, gdn_rows=rows, gdn_max_registers=max_registers,
                      gdn_ptx_widen_bf16=bool(widen), gdn_l2_hints=bool(hints))
        row = dict(lanes_k=lanes_k, rows=rows, max_registers=max_registers, widen=widen, l2_hints=hints)
        try:
            for N, T, HV, mode in shapes:
                ws = wins[(N, T, HV)]
                us = median_us([partial(run, cfg, w, mode) for w in ws], warmup=3, iters=20)
                state_bytes = N * HV * V * K * 4
                moved = state_bytes * (1 + T) if mode == "snapshot" else state_bytes
                name = f"{mode[:4]}_N{N}T{T}" + ("" if HV == 48 else f"HV{HV}")
                row[name] = round(us, 1)
                row[f"{name}_vs_copy"] = round(ceiling.us(moved) / us, 3)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(row)
        print(row, flush=True)
    best = sorted((r for r in results if "error" not in r), key=lambda r: r["veri_N64T4"])[:8]
    print("best by verify N64T4:")
    for r in best:
        print(r)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune_verify.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
