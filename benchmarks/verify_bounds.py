"""How fast could verify be if its state tile arrived sooner? (GPU, one device call)

    python benchmarks/verify_bounds.py [--repeat 2]
    python benchmarks/verify_bounds.py --ncu no_load   # two launches of one variant, for ncu

Compiles the library's recurrence kernel a second time from its own source with the state tile's
load replaced, and times it beside the library's kernel on the bench's verify shapes:

* ``l2``: every row reads the state tiles of slot 0 (3 MiB at HV = 48, so served from L2): the
  kernel without HBM traffic for the state, the load's latency that of L2;
* ``no_load``: the tile is computed from its offsets and the row's slot (no memory at all): the
  token loop, the gates, the stores and the launch, plus the few instructions that make the tile.
  No staging of the state could make verify faster than this, less those instructions.

Only verify mode is timed; the variants' outputs are meaningless and not checked. Prints one row per
(variant, shape) and writes verify_bounds.json under $OUT when set.
"""
import argparse
import itertools
import json
import os

import torch

from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.backends.triton import gdn as gdn_module
from recoverssm.backends.triton import launch
from recoverssm.backends.triton.direct_launch import DirectLauncher
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us

from kernel_variant import compile_variant, replace_once  # noqa: E402  (same directory)
from tune_verify import H, K, V, run, window  # noqa: E402

STATE_BASE = "state_tile = state_ptr + slot.to(tl.int64) * stride_s_slot + hv * stride_s_h"
STATE_LOAD = "S = load_masked(state_tile + tile, mask_tile, EXACT, STATE_EVICTION).to(tl.float32)"
VARIANTS = {
    "library": None,
    "l2": (STATE_BASE, "state_tile = state_ptr + hv * stride_s_h"),
    "no_load": (STATE_LOAD, "S = (tile + slot).to(tl.float32) * 1e-9"),
}


def variant_kernel(name: str):
    if VARIANTS[name] is None:
        return gdn_module.gdn_recurrent_kernel
    old, new = VARIANTS[name]
    source = replace_once(open(gdn_module.__file__).read(), old, new, "gdn.py")
    source = replace_once(source, "from .numerics import", "from recoverssm.backends.triton.numerics import", "gdn.py")
    return compile_variant(source, f"recoverssm_gdn_{name}").gdn_recurrent_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--ncu", choices=list(VARIANTS), help="launch this variant twice at N=64, T=4, HV=48 and exit")
    args = ap.parse_args()
    cfg = CudaBackend.launch_table[None]
    if args.ncu:
        if args.ncu != "library":
            launch._RECURRENCE = DirectLauncher(variant_kernel(args.ncu))
        w = window(64, 4, H, 48, K, V)
        for _ in range(2):
            run(cfg, w)
            torch.cuda.synchronize()
        return
    ceiling = CopyCeiling("cuda")
    shapes = [(64, 2, 48), (64, 4, 48), (64, 8, 48), (64, 4, 32), (64, 8, 32), (256, 4, 48), (8, 4, 48), (1, 4, 48)]
    wins = {s: [window(s[0], s[1], H, s[2], K, V, seed=i) for i in range(copies_for(s[0] * s[2] * V * K * 4))]
            for s in shapes}
    kernels = {name: variant_kernel(name) for name in VARIANTS}
    library_launcher = launch._RECURRENCE
    results = []
    try:
        for _, name in itertools.product(range(args.repeat), VARIANTS):
            launch._RECURRENCE = library_launcher if name == "library" else DirectLauncher(kernels[name])
            row = {"variant": name}
            for N, T, HV in shapes:
                us = median_us([lambda w=w: run(cfg, w) for w in wins[(N, T, HV)]], warmup=3, iters=20)
                key = f"N{N}T{T}HV{HV}"
                row[key] = round(us, 1)
                row[f"{key}_vs_copy"] = round(ceiling.us(N * HV * V * K * 4) / us, 3)
            results.append(row)
            print(row, flush=True)
    finally:
        launch._RECURRENCE = library_launcher
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "verify_bounds.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
