"""How fast could verify be if its state tile arrived sooner? (GPU, one device call)

    python benchmarks/verify_bounds.py [--repeat 2]
    python benchmarks/verify_bounds.py --ncu no_load   # two launches of one variant, for ncu
    python benchmarks/verify_bounds.py --tiny          # CPU tensors, Triton's interpreter, tiny shapes
    python benchmarks/verify_bounds.py --compile       # no GPU: registers and spills of each variant (sm_90)

Compiles the library's recurrence kernel (``recoverssm/backends/triton/recurrence.py``) a second
time from its own source with the state tile's load replaced (``kernel_variant.py``), and times it
beside the library's kernel on the benchmark's verify shapes (H=16, K=V=128):

* ``l2``: every row reads the state tiles of slot 0 (3 MiB at HV = 48, so served from L2): the
  kernel without HBM traffic for the state, the load's latency that of L2;
* ``no_load``: the tile is computed from its offsets and the row's slot (no memory at all): the
  token loop, the gates, the stores and the launch, plus the few instructions that make the tile.
  No staging of the state could make verify faster than this, less those instructions.

Every variant, the library's included, is launched the same way: the specialization the library
would use (``launch.recurrence_specialization`` with the cuda backend's launch table) and the
kernel's runtime arguments in verify mode. ``--tiny`` checks that this launch of the library's
kernel gives ``gdn_verify``'s outputs and records bit for bit, and that the variants run. Only
verify mode is timed; the variants' outputs are meaningless and not checked. Prints a table (us,
ratio to a device copy of the state bytes) and writes ``$OUT/verify_bounds.json`` when ``OUT`` is set.
"""
import argparse
import itertools

import torch

import common
from kernel_variant import compile_variant, replace_once

H, K, V = 16, 128, 128
SHAPES = [(64, 2, 48), (64, 4, 48), (64, 8, 48), (64, 4, 32), (64, 8, 32), (256, 4, 48), (8, 4, 48), (1, 4, 48)]
TINY_SHAPES = [(2, 2, 4), (3, 4, 4)]
STATE_BASE = "state_tile = state_ptr + source.to(tl.int64) * stride_s_slot + hv * stride_s_h"
STATE_LOAD = "S = load_masked(state_tile + tile, mask_tile, EXACT, STATE_EVICTION).to(tl.float32)"
VARIANTS = {
    "library": None,
    "l2": (STATE_BASE, "state_tile = state_ptr + hv * stride_s_h"),
    "no_load": (STATE_LOAD, "S = (tile + slot).to(tl.float32) * 1e-9"),
}


def variant_kernel(name: str):
    from recoverssm.backends.triton import recurrence

    if VARIANTS[name] is None:
        return recurrence.recurrence_kernel
    old, new = VARIANTS[name]
    source = replace_once(open(recurrence.__file__).read(), old, new, "recurrence.py")
    for module in ("numerics", "pending"):
        source = replace_once(source, f"from .{module} import", f"from recoverssm.backends.triton.{module} import",
                              "recurrence.py")
    return compile_variant(source, f"recoverssm_recurrence_{name}").recurrence_kernel


def _rows_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def verify_launch(kernel, w, out, null_slot: int = -1):
    """A call that launches ``kernel`` (the library's recurrence kernel or a variant of it) in
    verify mode over window ``w``, specialized as the cuda backend's table specializes
    ``gdn_verify`` (raw gates, l2-normalized q and k, scale K^-0.5)."""
    import recoverssm as rs
    import triton
    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs

    T, H_, K_ = w.q.shape
    HV, V_ = w.v.shape[1], w.v.shape[2]
    B = w.state_indices.shape[0]
    gates = GateInputs(**w.gates())
    aligned = all(_rows_aligned(t) for t in (w.q, w.k, w.v, out))
    tile, constexprs, options = launch.recurrence_specialization(
        rs.get_backend("cuda").table, w.state.dtype, H_, HV, K_, V_, w.state.stride(2), gates, True, aligned, HV * B)
    rec = w.records
    snap = w.state_indices
    args = (w.q, w.k, w.v, w.a, w.b, w.A_log, w.dt_bias, out, w.state, w.state_indices, w.query_start_loc,
            rec.correction, rec.key, rec.decay, snap, snap, snap, snap,     # no pending step: rows, plan, parity unused
            w.q.stride(0), w.q.stride(1), w.k.stride(0), w.k.stride(1), w.v.stride(0), w.v.stride(1),
            w.a.stride(0), w.a.stride(1), w.b.stride(0), out.stride(0), out.stride(1),
            w.state.stride(0), w.state.stride(1), snap.stride(0),
            T, w.state.shape[0], null_slot, rec.correction.shape[2], K_ ** -0.5, 0.0, launch.MODES["verify"], 0, 0)
    grid = (triton.cdiv(V_, tile.block_v), HV, B)

    def call():
        kernel[grid](*args, **constexprs, **options)
    return call


def check_library_launch(kernel, w) -> None:
    """The library's kernel launched by :func:`verify_launch` writes what ``gdn_verify`` writes."""
    import recoverssm as rs

    ref_out = torch.empty_like(w.v)
    rs.gdn_verify(w.q, w.k, w.v, state=w.state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  records=w.records, out=ref_out, backend="cuda", **w.gates())
    ref = [ref_out.clone()] + [t.clone() for t in (w.records.correction, w.records.key, w.records.decay)]
    for t in (w.records.correction, w.records.key, w.records.decay):
        t.zero_()
    out = torch.zeros_like(w.v)
    verify_launch(kernel, w, out)()
    got = [out, w.records.correction, w.records.key, w.records.decay]
    for name, a, b in zip(("out", "correction", "key", "decay"), got, ref):
        if not torch.equal(a, b):
            raise SystemExit(f"verify_launch differs from gdn_verify in {name}: update verify_launch to the "
                             f"library's launcher (recoverssm/backends/triton/launch.py)")
    print(f"library kernel through verify_launch == gdn_verify, bit for bit (N={w.N}, T={w.T})")


def compile_variants(arch: int) -> None:
    """Compile every variant as verify launches it at N=64, T=4, HV=48 (fp32 state, bf16 inputs)."""
    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs

    N, HV = 64, 48
    _, constexprs, options = launch.recurrence_specialization(
        LAUNCH_TABLE, torch.float32, H, HV, K, V, K, GateInputs(a=1), True, True, HV * N)
    for name in VARIANTS:
        regs, spills = common.compile_for_gpu(variant_kernel(name), constexprs, common.RECURRENCE_TYPES, options,
                                              arch)
        print(f"{name:8s} sm_{arch}: {regs} registers, {spills} bytes spilled")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--repeat", type=int, default=1, help="passes over the variants (an A/B within one run)")
    ap.add_argument("--ncu", choices=list(VARIANTS), help="launch this variant twice at N=64, T=4, HV=48 and exit")
    common.add_tiny_arg(ap)
    common.add_compile_arg(ap)
    args = ap.parse_args()
    if args.compile:
        return compile_variants(args.compile)
    device = common.setup_device(args.tiny)

    from recoverssm.bench.problems import window
    from recoverssm.bench.timing import CopyCeiling, copies_for

    h, k, v = (2, 16, 16) if args.tiny else (H, K, V)
    if args.ncu:
        N, T, HV = TINY_SHAPES[0] if args.tiny else (64, 4, 48)
        w = window(N, T, h, HV, k, v, device=device)
        call = verify_launch(variant_kernel(args.ncu), w, torch.empty_like(w.v))
        for _ in range(2):
            call()
            if device == "cuda":
                torch.cuda.synchronize()
        return
    shapes = TINY_SHAPES if args.tiny else SHAPES
    wins = {s: [window(s[0], s[1], h, s[2], k, v, device=device, seed=i)
                for i in range(1 if args.tiny else copies_for(s[0] * s[2] * v * k * 4))] for s in shapes}
    kernels = {name: variant_kernel(name) for name in VARIANTS}
    if args.tiny:
        for s in shapes:
            check_library_launch(kernels["library"], wins[s][0])
    ceiling = None if args.tiny else CopyCeiling("cuda")
    results = []
    for run, name in itertools.product(range(args.repeat), VARIANTS):
        row = {"variant": name, "run": run}
        for N, T, HV in shapes:
            calls = [verify_launch(kernels[name], w, torch.empty_like(w.v)) for w in wins[(N, T, HV)]]
            us = common.device_us(calls, device, iters=20)
            key = f"N{N}T{T}HV{HV}"
            row[key] = round(us, 1)
            row[f"{key}_vs_copy"] = round(ceiling.us(N * HV * v * k * 4) / us, 3) if ceiling else None
        results.append(row)
        print({key: val for key, val in row.items() if val is not None}, flush=True)
    names = [f"N{N}T{T}HV{HV}" for N, T, HV in shapes]
    table = [{"variant": r["variant"], **{n: f"{r[n]}" + (f" ({r[n + '_vs_copy']})" if ceiling else "") for n in names}}
             for r in results]
    print(f"\nverify, us per call ({'interpreted' if args.tiny else 'vs copy in parentheses'})")
    common.print_table(table, ["variant", *names])
    common.write_json("verify_bounds.json", results)


if __name__ == "__main__":
    main()
