"""Experiment: the recurrence kernel hints the state tile of the program DIST ahead into L2, on
top of the library's L2 eviction hints (the state's demand loads evict_first). The eleventh
session measured the prefetch without those hints (at best 1%); with the state's own lines
marked to go first, prefetched lines may now survive until their program reads them.

    python benchmarks/exp_state_prefetch.py [--repeat 2]

Variants are the library's kernel source with the prefetch inserted after the tile's load
(kernel_variant.py); DIST and the prefetch's own L2 policy are baked into each variant. Times
verify and snapshot (the snapshot kernel is the same binary) beside the library's kernel, in one
run; writes exp_state_prefetch.json under $OUT when set.
"""
import argparse
import itertools
import json
import os
from functools import partial

import torch

from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.backends.triton import gdn as gdn_module
from recoverssm.backends.triton import launch
from recoverssm.backends.triton.direct_launch import DirectLauncher
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us

from kernel_variant import compile_variant, replace_once  # noqa: E402  (same directory)
from tune_verify import H, K, V, run, window  # noqa: E402

STATE_LOAD = "        S = load_masked(state_tile + tile, mask_tile, EXACT, STATE_EVICTION).to(tl.float32)\n"
PREFETCH = """        AHEAD_TILES: tl.constexpr = (V + BV - 1) // BV
        ahead = i_v + AHEAD_TILES * (hv + HV * row) + {dist}
        ahead_row = ahead // (AHEAD_TILES * HV)
        if ahead_row < tl.num_programs(2):
            ahead_slot = tl.load(state_indices_ptr + ahead_row)
            if (ahead_slot > null_slot) & (ahead_slot < num_slots):
                ahead_tile = ahead % (AHEAD_TILES * HV)
                ahead_base = state_ptr + ahead_slot.to(tl.int64) * stride_s_slot + (ahead_tile // AHEAD_TILES) * stride_s_h
                LINE: tl.constexpr = 1024 // state_ptr.dtype.element_ty.primitive_bitwidth
                ROW_LINES: tl.constexpr = (K_PAD + LINE - 1) // LINE
                i_line = tl.arange(0, BV * ROW_LINES)
                v_line = (ahead_tile % AHEAD_TILES) * BV + i_line // ROW_LINES
                k_line = (i_line % ROW_LINES) * LINE
                wanted = (v_line < V) & (k_line < K)
                tl.inline_asm_elementwise("prefetch.global.L2{policy} [$1];\\n\\tmov.u32 $0, 0;", "=r,l",
                                          [tl.where(wanted, ahead_base + v_line * STRIDE_S_V + k_line, state_ptr)],
                                          dtype=tl.int32, is_pure=False, pack=1)
"""
VARIANTS = {"library": None}
for dist in (264, 528, 1056):
    VARIANTS[f"ahead{dist}"] = (dist, "")
VARIANTS["ahead528_evict_last"] = (528, "::evict_last")


def variant_kernel(name: str):
    if VARIANTS[name] is None:
        return gdn_module.gdn_recurrent_kernel
    dist, policy = VARIANTS[name]
    source = open(gdn_module.__file__).read()
    source = replace_once(source, STATE_LOAD, STATE_LOAD + PREFETCH.format(dist=dist, policy=policy), "gdn.py")
    source = replace_once(source, "from .numerics import", "from recoverssm.backends.triton.numerics import", "gdn.py")
    return compile_variant(source, f"recoverssm_gdn_{name}").gdn_recurrent_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    cfg = CudaBackend.launch_table[None]
    ceiling = CopyCeiling("cuda")
    shapes = [(64, 4, 48, "verify"), (64, 8, 48, "verify"), (64, 4, 32, "verify"), (256, 4, 48, "verify"),
              (8, 4, 48, "verify"), (1, 2, 32, "verify"), (64, 4, 48, "snapshot"), (64, 8, 32, "snapshot")]
    wins = {}
    for N, T, HV, _ in shapes:
        if (N, T, HV) not in wins:
            wins[(N, T, HV)] = [window(N, T, H, HV, K, V, extra_slots=N * T, seed=i)
                                for i in range(copies_for(N * HV * V * K * 4))]
    kernels = {name: variant_kernel(name) for name in VARIANTS}
    library_launcher = launch._RECURRENCE
    results = []
    try:
        for _, name in itertools.product(range(args.repeat), VARIANTS):
            launch._RECURRENCE = library_launcher if name == "library" else DirectLauncher(kernels[name])
            row = {"variant": name}
            for N, T, HV, mode in shapes:
                us = median_us([partial(run, cfg, w, mode) for w in wins[(N, T, HV)]], warmup=3, iters=20)
                state_bytes = N * HV * V * K * 4
                moved = state_bytes * (1 + T) if mode == "snapshot" else state_bytes
                key = f"{mode[:4]}_N{N}T{T}HV{HV}"
                row[key] = round(us, 1)
                row[f"{key}_vs_copy"] = round(ceiling.us(moved) / us, 3)
            results.append(row)
            print(row, flush=True)
    finally:
        launch._RECURRENCE = library_launcher
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "exp_state_prefetch.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
