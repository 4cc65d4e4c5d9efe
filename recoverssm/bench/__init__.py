"""``recoverssm bench``: the GPU benchmark behind docs/BENCHMARKS.md.

One run times every case with CUDA events (median over many replays of a CUDA graph holding the
calls back to back, after warm-up, inputs rotated so they are not served from L2), and compares
each with a device-to-device copy of the same traffic (bytes read + bytes written), timed the same
way. Host time per call (Python, validation, launch) is measured separately. It prints one table,
and writes ``bench.json`` and ``bench.png``. The ``model`` suite (``bench/model.py``) times one
speculative decode step of a whole model's recurrent layers against the snapshot method; it adds
its tables to the printout, a ``"model"`` key to ``bench.json`` and ``bench_model.png``.

    recoverssm bench [--out DIR] [--quick] [--no-fla] [--only commit,verify,kda,mamba2,rounding,graph,host,memory,model]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch

from . import suites


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="recoverssm bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out", help="folder for bench.json, bench.png and bench_model.png")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    ap.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention even if installed")
    ap.add_argument("--only", default="",
                    help="comma-separated suites: commit,verify,kda,mamba2,rounding,graph,host,memory,model")
    ap.add_argument("--geometry", default="", help="comma-separated model geometries of the model suite (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("recoverssm bench needs a CUDA GPU (it times the cuda backend's kernels)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = suites.run_all(quick=args.quick, fla=not args.no_fla,
                             only=[s for s in args.only.split(",") if s],
                             geometries=[g for g in args.geometry.split(",") if g])
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(suites.render(results))
    plots = [(suites.plot, "bench.png")] if results["rows"] else []
    if "model" in results:
        plots.append((suites.plot_model, "bench_model.png"))
    for plot, name in plots:
        try:
            plot(results, os.path.join(args.out, name))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    return 0
