"""Sweep the recurrence kernel's launch spec (``RecurrenceSpec``) on a GPU: verify and snapshot time.

    python benchmarks/tune_verify.py [--quick] [--state-dtype fp32|bf16] [--repeat N]
    python benchmarks/tune_verify.py --grid "rows=4,small_grid_programs=0;lanes_k=16"
    python benchmarks/tune_verify.py --sweep rows=2,4,8 --sweep l2_hints=0,1
    python benchmarks/tune_verify.py --batch 1,8 --sweep small_grid_rows=1,2,4   # the small-batch shapes only
    python benchmarks/tune_verify.py --tiny          # CPU tensors, Triton's interpreter, tiny shapes
    python benchmarks/tune_verify.py --compile [--grid ...]   # no GPU: registers and spills per configuration
    python benchmarks/tune_verify.py --family mamba2 --state-dtype bf16   # Nemotron-H-8B's Mamba2 layer

Each configuration replaces some fields of the cuda backend's spec for the state dtype
(``recoverssm/backends/cuda/launch_table.py``; ``--base default`` starts from ``RecurrenceSpec()``
instead) and runs inside ``recoverssm.backends.triton.tuning.launch_table``. Fields:
``lanes_k``, ``rows``, ``warps``, ``small_grid_programs``, ``small_grid_rows``,
``small_grid_max_registers``, ``ptx_widen_bf16``, ``l2_hints`` (``config.RecurrenceSpec``).

Per configuration and shape: the median device time of ``gdn_verify`` (or
``gdn_spec_decode_snapshot``) at H=16, K=V=128 (CUDA graph replays, input sets rotated out of L2)
and its ratio to a device copy of the same bytes (verify: the state read; snapshot: the state read
and T states written). ``--family mamba2``: ``mamba2_verify`` (or ``mamba2_spec_decode_snapshot``)
on the Mamba2 benchmark's Nemotron-H-8B layer (``recoverssm/bench/mamba2.py``: 128 heads, headdim
64, dstate 128, 8 groups) instead. Prints a table and writes ``$OUT/tune_verify.json`` when
``OUT`` is set.
``--compile`` compiles each configuration for an NVIDIA target without a GPU (verify at N=64 and
N=1, T=4, HV=48: the large-grid and the small-grid tile) and prints registers and spilled bytes:
a configuration that spills is not worth GPU time.
"""
import argparse
import dataclasses
import functools
import itertools

import torch

import common

H, K, V = 16, 128, 128
SHAPES = [(64, 4, 48, "verify"), (64, 8, 48, "verify"), (256, 4, 48, "verify"), (8, 4, 48, "verify"),
          (1, 4, 48, "verify"), (8, 8, 48, "verify"), (1, 8, 48, "verify"), (1, 2, 32, "verify"),
          (1, 2, 48, "verify"), (64, 4, 32, "verify"), (64, 8, 32, "verify"),
          (64, 4, 48, "snapshot"), (64, 8, 32, "snapshot")]
TINY = dict(H=2, K=16, V=16, shapes=[(2, 2, 4, "verify"), (3, 4, 4, "verify"), (2, 2, 4, "snapshot")])
MAMBA2_HV = 128     # Nemotron-H-8B's heads (recoverssm.bench.mamba2.GEOMETRIES[0])
MAMBA2_SHAPES = [(64, 2, MAMBA2_HV, "verify"), (64, 4, MAMBA2_HV, "verify"), (64, 8, MAMBA2_HV, "verify"),
                 (256, 4, MAMBA2_HV, "verify"), (8, 4, MAMBA2_HV, "verify"), (1, 4, MAMBA2_HV, "verify"),
                 (1, 2, MAMBA2_HV, "verify"), (64, 4, MAMBA2_HV, "snapshot")]


def default_configs(base) -> list[dict]:
    return [{}, {"small_grid_programs": 0}, {"rows": 4, "small_grid_programs": 0}, {"lanes_k": 16},
            {"l2_hints": not base.l2_hints}, {"ptx_widen_bf16": not base.ptx_widen_bf16}]


def of_batch(shapes: list, batch: str) -> list:
    """The shapes whose N is listed in ``batch`` ("1,8"); all of them for an empty string."""
    return [s for s in shapes if s[0] in {int(n) for n in batch.split(",")}] if batch else shapes


def shape_name(N, T, HV, mode) -> str:
    return f"{mode[:4]}_N{N}T{T}HV{HV}"


def call_of(w, mode: str, device: str):
    """One call of ``mode`` over window ``w``, writing into an output allocated here."""
    import recoverssm as rs

    out = torch.empty_like(w.v)
    if mode == "verify":
        return functools.partial(rs.gdn_verify, w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                                 query_start_loc=w.query_start_loc, records=w.records, out=out, backend="cuda",
                                 **w.gates())
    # one snapshot slot per position, past the N slots the rows read (window(extra_slots=N * T))
    snap = (torch.arange(w.N * w.T, dtype=torch.int32, device=device).view(w.N, w.T) + w.N)
    return functools.partial(rs.gdn_spec_decode_snapshot, w.q, w.k, w.v, state=w.state,
                             state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                             snapshot_slots=snap, out=out, backend="cuda", **w.gates())


def mamba2_call_of(w, mode: str, device: str):
    """One Mamba2 call of ``mode`` over window ``w`` (``recoverssm.bench.mamba2.Mamba2Window``)."""
    if mode == "verify":
        return w.verify
    snap = torch.arange(w.N * w.T, dtype=torch.int32, device=device).view(w.N, w.T) + w.N
    return functools.partial(w.snapshot, snap)


def problem(family: str, tiny: bool):
    """``(K, V, shapes, make_window(N, T, HV, state dtype, device, seed), make_call(window, mode,
    device))`` of the family's windows."""
    if family == "mamba2":
        from recoverssm.bench.mamba2 import GEOMETRIES, mamba2_window

        g = GEOMETRIES[0]
        return (g.dstate, g.headdim, MAMBA2_SHAPES,
                lambda N, T, HV, dtype, device, seed: mamba2_window(g, N, T, dtype, seed=seed, device=device),
                mamba2_call_of)
    from recoverssm.bench.problems import window

    h, k, v, shapes = (TINY["H"], TINY["K"], TINY["V"], TINY["shapes"]) if tiny else (H, K, V, SHAPES)
    return (k, v, shapes,
            lambda N, T, HV, dtype, device, seed: window(N, T, h, HV, k, v, state_dtype=dtype, extra_slots=N * T,
                                                         device=device, seed=seed),
            call_of)


def compile_configs(configs, base, dtype, table, arch: int) -> None:
    from recoverssm.backends.triton import launch
    from recoverssm.backends.triton.recurrence import recurrence_kernel
    from recoverssm.core.backend import GateInputs

    types = {**common.RECURRENCE_TYPES, "state_ptr": common.POINTER_TYPES[dtype]}
    rows = []
    for config in configs:
        spec = dataclasses.replace(base, **config)
        row = {"config": common.label(config)}
        for N in (64, 1):
            try:
                tile, constexprs, options = launch.recurrence_specialization(
                    common.table_with(table, "recurrence", dtype, spec), dtype, H, 48, K, V, K, GateInputs(a=1),
                    True, True, 48 * N)
                regs, spills = common.compile_for_gpu(recurrence_kernel, constexprs, types, options, arch)
                row[f"N{N}: rows x row lanes"] = f"{tile.rows} x {tile.row_lanes}"
                row[f"N{N}: registers, spilled bytes"] = f"{regs}, {spills}"
            except Exception as exc:  # noqa: BLE001 - report every configuration
                row[f"N{N}: registers, spilled bytes"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
        print(row, flush=True)
    print(f"\nrecurrence kernel, sm_{arch}, verify at T=4, HV=48, state {common.TRITON_NAMES[dtype]}")
    common.print_table(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    common.add_config_args(ap, "the spec the fields replace: the cuda table's, or RecurrenceSpec()'s defaults")
    ap.add_argument("--state-dtype", choices=list(common.DTYPES), default="fp32")
    ap.add_argument("--family", choices=["gdn", "mamba2"], default="gdn",
                    help="gdn: H=16, K=V=128 windows; mamba2: the Mamba2 benchmark's Nemotron-H-8B layer")
    ap.add_argument("--quick", action="store_true", help="the first three configurations only")
    ap.add_argument("--batch", default="", help="only the shapes of these N, comma-separated (e.g. 1,8)")
    common.add_tiny_arg(ap)
    common.add_compile_arg(ap)
    args = ap.parse_args()
    device = None if args.compile else common.setup_device(args.tiny)

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import RecurrenceSpec

    dtype = common.DTYPES[args.state_dtype]
    base = LAUNCH_TABLE.recurrence_for(dtype) if args.base == "table" else RecurrenceSpec()
    configs = common.parse_configs(RecurrenceSpec, args.grid, args.sweep, default_configs(base))
    if args.quick:
        configs = configs[:3]
    if args.compile:
        return compile_configs(configs, base, dtype, LAUNCH_TABLE, args.compile)

    from recoverssm.backends.triton.tuning import launch_table
    from recoverssm.bench.timing import CopyCeiling, copies_for

    k, v, shapes, make_window, make_call = problem(args.family, args.tiny)
    shapes = of_batch(shapes, args.batch)
    ceiling = None if args.tiny else CopyCeiling("cuda")
    element = torch.tensor([], dtype=dtype).element_size()
    wins = {}
    for N, T, HV, _ in shapes:
        if (N, T, HV) not in wins:
            n = 1 if args.tiny else copies_for(N * HV * v * k * element)
            wins[(N, T, HV)] = [make_window(N, T, HV, dtype, device, i) for i in range(n)]
    results = []
    for _, config in itertools.product(range(args.repeat), configs):
        spec = dataclasses.replace(base, **config)
        row = dict(config=common.label(config), spec=dataclasses.asdict(spec))
        try:
            with launch_table("cuda", common.table_with(LAUNCH_TABLE, "recurrence", dtype, spec)):
                for N, T, HV, mode in shapes:
                    us = common.device_us([make_call(w, mode, device) for w in wins[(N, T, HV)]], device, iters=20)
                    state_bytes = N * HV * v * k * element
                    moved = state_bytes * (1 + T) if mode == "snapshot" else state_bytes
                    name = shape_name(N, T, HV, mode)
                    row[name] = round(us, 1)
                    row[f"{name}_vs_copy"] = round(ceiling.us(moved) / us, 3) if ceiling else None
        except Exception as exc:  # noqa: BLE001 - a configuration that fails to compile or launch
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(row)
        print(common.label(config), {key: val for key, val in row.items()
                                     if key not in ("config", "spec") and val is not None}, flush=True)

    names = [shape_name(*s) for s in shapes]
    table = []
    for r in results:
        cells = {"config": r["config"], "error": r.get("error")}
        for name in names:
            if name in r:
                ratio = r[f"{name}_vs_copy"]
                cells[name] = f"{r[name]}" + (f" ({ratio})" if ratio is not None else "")
        table.append(cells)
    print(f"\nus per call ({'interpreted' if args.tiny else 'vs copy in parentheses'}); "
          f"state {args.state_dtype}, base spec: {base}")
    common.print_table(table, ["config", *names] + (["error"] if any(r.get("error") for r in results) else []))
    ok = [r for r in results if "error" not in r]
    if ok:
        print(f"\nbest by {names[0]}:", min(ok, key=lambda r: r[names[0]])["config"])
    common.write_json("tune_verify.json", dict(family=args.family, state_dtype=args.state_dtype,
                                               base=dataclasses.asdict(base),
                                               results=results))


if __name__ == "__main__":
    main()
