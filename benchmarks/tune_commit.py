"""Sweep the grouped commit kernel's launch spec (``CommitSpec``) on a GPU: commit time.

    python benchmarks/tune_commit.py                          # block_v 16..128 x warps 1..8
    python benchmarks/tune_commit.py --grid "block_v=16,tiles_per_program=2;block_v=32,max_registers=168"
    python benchmarks/tune_commit.py --sweep replay_pairs=0,1 --sweep prefetch_records=0,1 --cases bf16
    python benchmarks/tune_commit.py --sweep replay_pairs=0,1 --cases kda          # KDA's vector-decay records
    python benchmarks/tune_commit.py --tiny                   # CPU tensors, Triton's interpreter, tiny shapes
    python benchmarks/tune_commit.py --compile [--grid ...]   # no GPU: registers and spills per configuration

Each configuration replaces some fields of the cuda backend's commit spec for the case's state
dtype (``recoverssm/backends/cuda/launch_table.py``; ``--base default`` starts from ``CommitSpec()``)
inside ``recoverssm.backends.triton.tuning.launch_table``; the case's ``CommitContext`` is built
inside that block (a context fixes its launch when it is built). Fields: ``block_v``, ``warps``,
``max_registers``, ``tiles_per_program``, ``prefetch_records``, ``prefetch_next_tile``,
``replay_pairs``, ``ptx_round_bf16`` (``config.CommitSpec``).

Cases (H=16, K=V=128, T=4): the benchmark's align-mode commits (groups x layers, requests, state
dtype; ``recoverssm/bench/problems.py::align_step``) and the commit of its speculative step (one
layer, fp32 state, row r accepting ``1 + 7r mod T`` tokens, input sets rotated out of L2), and
the commit of the KDA benchmark's step (vector-decay records, HV = 32, N = 64 at T = 8 and N = 8
at T = 4), and the commit of the Mamba2 benchmark's step (Nemotron-H-8B's layer, fp32 and bf16
states, N = 64 at T = 2, 4, 8 and N = 256 at T = 8; ``--cases mamba2``). Per
configuration and case: the median device time of ``CommitContext.commit`` (CUDA graph replays)
and its ratio to a device copy of the same traffic (states read and written, records read).
Prints a table and writes ``$OUT/tune_commit.json`` when ``OUT`` is set. ``--compile`` compiles
each configuration for both state dtypes (and for fp32 states with KDA's vector-decay records)
for an NVIDIA target without a GPU and prints registers and spilled bytes.
"""
import argparse
import dataclasses
import functools
import itertools

import torch

import common

H, K, V = 16, 128, 128
BLOCK_V, WARPS = [16, 32, 64, 128], [1, 2, 4, 8]


class Case:
    """One commit case: its layers (built once) and how to build its contexts and calls."""

    def __init__(self, name, dtype, groups_per_context, max_batch, step_args, traffic):
        self.name, self.dtype, self.max_batch, self.traffic = name, dtype, max_batch, traffic
        self.groups_per_context = groups_per_context   # one list of LayerCache groups per context
        self.step_args = step_args                     # (args, kwargs) of each context's commit

    def calls(self):
        """Contexts over the case's layers, built now (under the launch table in force), and one
        commit call per context."""
        import recoverssm as rs

        contexts = [rs.CommitContext(groups, max_batch=self.max_batch, backend="cuda")
                    for groups in self.groups_per_context]
        return contexts, [functools.partial(ctx.commit, *a, **kw) for ctx, (a, kw) in zip(contexts, self.step_args)]


def align_case(G, L, R, dtype, dims, device):
    """The benchmark's align-mode commits: ``G`` groups x ``L`` layers, ``R`` requests, T = 4."""
    from recoverssm.bench.problems import align_step, commit_context

    h, hv, k, v = dims
    step = align_step(R, 4, device=device)
    _, caches = commit_context(G, L, R, 4, h, hv, k, v, step.num_slots, dtype, device=device)
    state = hv * v * k * torch.tensor([], dtype=dtype).element_size()
    accepted = step.num_accepted.sum().item()
    traffic = G * L * (state * (2 * R + step.boundaries) + accepted * (hv * v + h * k + hv) * 4)
    kw = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens, block_size=step.block_size)
    name = f"{G}x{L}L x {R}req {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    return Case(name, dtype, [caches], R, [((step.num_accepted, step.state_indices, step.query_start_loc), kw)],
                traffic)


def spec_step_case(N, T, dims, device, copies):
    """The commit of the benchmark's speculative step: one layer, ``N`` rows, fp32 state, no align
    mode, row r accepting ``1 + 7r mod T`` tokens; ``copies`` input sets (real verify records)."""
    import recoverssm as rs
    from recoverssm.bench.problems import spread_accepted, window

    h, hv, k, v = dims
    wins = [window(N, T, h, hv, k, v, device=device, seed=i) for i in range(copies(N * hv * v * k * 4))]
    accepted = spread_accepted(N, T, device)
    for w in wins:
        w.verify()
    traffic = 2 * N * hv * v * k * 4 + int(accepted.sum()) * (hv * v + h * k + hv) * 4
    return Case(f"spec step 1L x N{N} T{T} HV{hv} fp32", torch.float32,
                [[[rs.LayerCache(w.state, w.records)]] for w in wins], N,
                [((accepted, w.state_indices, w.query_start_loc), {}) for w in wins], traffic)


def kda_step_case(N, T, HV, device, copies):
    """The commit of the KDA benchmark's speculative step (``recoverssm/bench/kda.py``): one layer
    of vector-decay records, fp32 state, K = V = 128, row r accepting ``1 + 7r mod T`` tokens."""
    import recoverssm as rs
    from recoverssm.bench.kda import K as KDA_K, V as KDA_V, commit_traffic, kda_window
    from recoverssm.bench.problems import spread_accepted

    state = N * HV * KDA_V * KDA_K * 4
    wins = [kda_window(N, T, HV, seed=i, device=device) for i in range(copies(state))]
    accepted = spread_accepted(N, T, device)
    for w in wins:
        w.verify()
    return Case(f"kda step 1L x N{N} T{T} HV{HV} fp32", torch.float32,
                [[[rs.LayerCache(w.state, w.records)]] for w in wins], N,
                [((accepted, w.state_indices, w.query_start_loc), {}) for w in wins],
                commit_traffic(state, HV, int(accepted.sum())))


def mamba2_step_case(N, T, dtype, device, copies):
    """The commit of the Mamba2 benchmark's speculative step (``recoverssm/bench/mamba2.py``): one
    Nemotron-H-8B layer (128 heads, headdim 64, dstate 128, 8 groups), row r accepting
    ``1 + 7r mod T`` tokens (real verify records)."""
    import recoverssm as rs
    from recoverssm.bench.mamba2 import GEOMETRIES, commit_traffic, mamba2_window
    from recoverssm.bench.problems import spread_accepted

    g = GEOMETRIES[0]
    state = N * g.nheads * g.headdim * g.dstate * torch.tensor([], dtype=dtype).element_size()
    wins = [mamba2_window(g, N, T, dtype, seed=i, device=device) for i in range(copies(state))]
    accepted = spread_accepted(N, T, device)
    for w in wins:
        w.verify()
    return Case(f"mamba2 step N{N} T{T} {common.TRITON_NAMES[dtype]}", dtype,
                [[[rs.LayerCache(w.state, w.records)]] for w in wins], N,
                [((accepted, w.state_indices, w.query_start_loc), {}) for w in wins],
                commit_traffic(state, g, int(accepted.sum())))


def default_configs(k: int) -> list[dict]:
    """block_v x warps, where a thread holds 4 to 128 state elements."""
    return [dict(block_v=bv, warps=w) for bv, w in itertools.product(BLOCK_V, WARPS) if 4 <= bv * k // (32 * w) <= 128]


def compile_configs(configs, base_kind: str, table, arch: int) -> None:
    from recoverssm.backends.triton.commit import grouped_commit_kernel
    from recoverssm.backends.triton.config import CommitSpec
    from recoverssm.backends.triton.launch import commit_specialization

    rows = []
    for config in configs:
        row = {"config": common.label(config)}
        for dtype, vector_decay in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
            name = common.TRITON_NAMES[dtype]
            column = f"{name}{' KDA' if vector_decay else ''}: registers, spilled bytes"
            spec = dataclasses.replace(table.commit_for(dtype) if base_kind == "table" else CommitSpec(), **config)
            try:
                _, constexprs, options = commit_specialization(spec, table, name, "fp32", H, 48, K, V, 1, True,
                                                               vector_decay)
                regs, spills = common.compile_for_gpu(grouped_commit_kernel, constexprs, common.COMMIT_TYPES,
                                                      options, arch)
                row[column] = f"{regs}, {spills}"
            except Exception as exc:  # noqa: BLE001 - report every configuration
                row[column] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
        print(row, flush=True)
    print(f"\ngrouped commit kernel, sm_{arch}, H=16, HV=48, K=V=128 (KDA: vector-decay records), "
          f"base spec: {base_kind}")
    common.print_table(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    common.add_config_args(ap, "the spec the fields replace: the cuda table's for the case's state dtype, "
                               "or CommitSpec()")
    ap.add_argument("--cases", help="only the cases whose name contains one of these comma-separated words")
    common.add_tiny_arg(ap)
    common.add_compile_arg(ap)
    args = ap.parse_args()
    device = None if args.compile else common.setup_device(args.tiny)

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import CommitSpec

    if args.compile:
        configs = common.parse_configs(CommitSpec, args.grid, args.sweep, default_configs(K))
        return compile_configs(configs, args.base, LAUNCH_TABLE, args.compile)

    from recoverssm.backends.triton.tuning import launch_table
    from recoverssm.bench.timing import CopyCeiling, copies_for

    if args.tiny:
        dims = (2, 4, 16, 16)
        builders = [("2L x 3req fp32", functools.partial(align_case, 1, 2, 3, torch.float32, dims, device)),
                    ("2x2L x 3req bf16", functools.partial(align_case, 2, 2, 3, torch.bfloat16, dims, device)),
                    ("spec step", functools.partial(spec_step_case, 2, 4, dims, device, lambda nbytes: 1))]
        default = [{}, dict(block_v=8), dict(tiles_per_program=2, replay_pairs=True)]
    else:
        hv48, hv32 = (H, 48, K, V), (H, 32, K, V)
        builders = [("12L x 8req fp32", functools.partial(align_case, 1, 12, 8, torch.float32, hv48, device)),
                    ("3x6L x 64req bf16", functools.partial(align_case, 3, 6, 64, torch.bfloat16, hv48, device)),
                    ("3x6L x 8req bf16", functools.partial(align_case, 3, 6, 8, torch.bfloat16, hv48, device)),
                    ("spec step N64 HV32", functools.partial(spec_step_case, 64, 4, hv32, device, copies_for)),
                    ("spec step N64 HV48", functools.partial(spec_step_case, 64, 4, hv48, device, copies_for)),
                    ("kda step N64 T8", functools.partial(kda_step_case, 64, 8, 32, device, copies_for)),
                    ("kda step N8 T4", functools.partial(kda_step_case, 8, 4, 32, device, copies_for)),
                    *((f"mamba2 step N{N} T{T} {name}", functools.partial(mamba2_step_case, N, T, dtype, device,
                                                                           copies_for))
                      for name, dtype in common.DTYPES.items() for N, T in ((64, 2), (64, 4), (64, 8), (256, 8)))]
        default = default_configs(K)
    if args.cases:
        builders = [b for b in builders if any(word in b[0] for word in args.cases.split(","))]
    configs = common.parse_configs(CommitSpec, args.grid, args.sweep, default)
    ceiling = None if args.tiny else CopyCeiling("cuda")
    results, names = [], []
    for _, build in builders:
        case = build()
        names.append(case.name)
        base = LAUNCH_TABLE.commit_for(case.dtype) if args.base == "table" else CommitSpec()
        for run, (index, config) in itertools.product(range(args.repeat), enumerate(configs)):
            spec = dataclasses.replace(base, **config)
            row = dict(case=case.name, config=common.label(config), run=run, index=index,
                       spec=dataclasses.asdict(spec))
            try:
                with launch_table("cuda", common.table_with(LAUNCH_TABLE, "commit", case.dtype, spec)):
                    contexts, calls = case.calls()
                assert all(ctx.committer.table.commit_for(case.dtype) == spec for ctx in contexts)
                us = common.device_us(calls, device)
                row.update(us=round(us, 1), vs_copy=round(ceiling.us(case.traffic) / us, 3) if ceiling else None)
                del contexts, calls
            except Exception as exc:  # noqa: BLE001 - a configuration that fails to compile or launch
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            results.append(row)
            print({key: val for key, val in row.items() if key not in ("spec", "index") and val is not None},
                  flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()

    table = {}
    for r in results:
        cells = table.setdefault((r["run"], r["index"]), {"config": r["config"]})
        cells[r["case"]] = r.get("error", "error") if "us" not in r else (
            f"{r['us']}" + (f" ({r['vs_copy']})" if r["vs_copy"] is not None else ""))
    print(f"\nus per commit ({'interpreted' if args.tiny else 'vs copy in parentheses'}); base spec: {args.base}")
    common.print_table(list(table.values()), ["config", *names])
    for name in names:
        ok = [r for r in results if r["case"] == name and "us" in r]
        if ok:
            print(f"best for {name}:", min(ok, key=lambda r: r["us"])["config"])
    common.write_json("tune_commit.json", dict(base=args.base, results=results))


if __name__ == "__main__":
    main()
