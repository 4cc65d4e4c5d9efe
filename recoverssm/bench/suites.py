"""The benchmark cases of ``recoverssm bench``: commit, verify (GDN), KDA, Mamba2 (``mamba2.py``), CUDA graphs,
host time, memory, the cost of ``round_each_token`` (``rounding.py``), and the model-level step (``model.py``)."""
from __future__ import annotations

import datetime
import functools
from typing import Callable

import torch

import recoverssm as rs
from recoverssm.build_info import package_version, source_commit
from recoverssm.console import ProgressBar
from recoverssm.console import format_table

from ..core.repeats import REPEATS
from . import kda, mamba2, model, rounding
from .problems import DeferredLayer, align_step, commit_context, per_group_indices, spread_accepted, window
from .rows import peer_row, row
from .timing import CopyCeiling, copies_for, host_times, kernel_launches, median_us

H, K, V = 16, 128, 128


def _state_bytes(N: int, HV: int, dtype=torch.float32) -> int:
    return N * HV * V * K * torch.tensor([], dtype=dtype).element_size()


def bench_commit(ceiling: CopyCeiling, quick: bool, progress: ProgressBar) -> list[dict]:
    rows = []
    configs = [("12 layers x 8 req x 48 heads fp32 align", 1, 12, 8, 48, torch.float32)]
    if not quick:
        configs += [("3 groups x 6 layers, 8 req, bf16 align", 3, 6, 8, 48, torch.bfloat16),
                    ("3 groups x 6 layers, 64 req, bf16 align", 3, 6, 64, 48, torch.bfloat16),
                    ("3 groups x 6 layers, 64 req, fp32 align", 3, 6, 64, 48, torch.float32)]
    T = 4
    for name, G, L, R, HV, dtype in configs:
        step = align_step(R, T)
        ctx, caches = commit_context(G, L, R, T, H, HV, K, V, step.num_slots, dtype)
        kw = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                  block_size=step.block_size)
        call = functools.partial(ctx.commit, step.num_accepted, step.state_indices, step.query_start_loc, **kw)
        us = median_us([call], iters=60)
        layers = G * L
        accepted = step.num_accepted.sum().item()
        state = _state_bytes(1, HV, dtype)
        traffic = layers * (state * (2 * R + step.boundaries)
                            + accepted * (HV * V + H * K + HV) * 4)
        launches, names = kernel_launches(call)
        rows.append(row("commit", name, us, traffic, ceiling, layers=layers, requests=R,
                         boundary_rows=step.boundaries, launches=launches))
        progress.update(1, name[:40])
        del ctx, caches
        torch.cuda.empty_cache()
    return rows


def _fla_call(w, fla_fn) -> Callable[[], object]:
    N, T = w.N, w.T
    q4, k4 = w.q.view(N, T, H, K), w.k.view(N, T, H, K)
    v4 = w.v.view(N, T, -1, V)
    a4, b4 = w.a.view(N, T, -1), w.b.view(N, T, -1)
    state = w.state[:N]

    def call():
        return fla_fn(q4, k4, v4, g=a4, beta=b4, initial_state=state, output_final_state=False,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=w.A_log,
                      dt_bias=w.dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    return call


def bench_verify(ceiling: CopyCeiling, quick: bool, fla: bool, progress: ProgressBar) -> list[dict]:
    fla_fn = None
    if fla:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
        except ImportError:
            fla_fn = None
    rows = []
    Ns = [1, 8, 64, 256] if not quick else [8, 64]
    for HV in ([32, 48] if not quick else [48]):
        for T in [2, 4, 8]:
            for N in Ns:
                state = _state_bytes(N, HV)
                copies = copies_for(state)
                wins = [window(N, T, H, HV, K, V, extra_slots=N * T, seed=i) for i in range(copies)]
                case = f"N={N} T={T} HV={HV}"
                t_verify = median_us([w.verify for w in wins])
                rows.append(row("verify", case, t_verify, state, ceiling, N=N, T=T, HV=HV,
                                 note="traffic = state bytes read"))
                snap = [torch.arange(N * T, dtype=torch.int32, device="cuda").view(N, T) + N for _ in wins]
                snap_calls = [lambda w=w, s=s: rs.gdn_spec_decode_snapshot(
                    w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                    query_start_loc=w.query_start_loc, snapshot_slots=s, backend="cuda", **w.gates())
                    for w, s in zip(wins, snap)]
                t_snap = median_us(snap_calls)
                rows.append(row("snapshot", case, t_snap, state * (1 + T), ceiling, N=N, T=T, HV=HV))
                accepted = spread_accepted(N, T)
                ctxs = [rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N, backend="cuda")
                        for w in wins]
                commit_calls = [lambda w=w, c=c: c.commit(accepted, w.state_indices, w.query_start_loc)
                                for w, c in zip(wins, ctxs)]
                t_commit = median_us(commit_calls)
                step_calls = [lambda w=w, c=c: (w.verify(), c.commit(accepted, w.state_indices, w.query_start_loc))
                              for w, c in zip(wins, ctxs)]
                t_step = median_us(step_calls)
                rows.append(dict(kind="spec_step", case=case, N=N, T=T, HV=HV, us=round(t_step, 2),
                                 verify_us=round(t_verify, 2), commit_us=round(t_commit, 2),
                                 snapshot_us=round(t_snap, 2), speedup_vs_snapshot=round(t_snap / t_step, 3)))
                # the deferred step: every row replays the step before inside its verify, then defers
                deferred = [DeferredLayer(w, accepted, H, K, V).warm() for w in wins]
                t_dverify = median_us([d.verify for d in deferred])
                t_dstep = median_us([d.step for d in deferred])
                rows.append(dict(kind="deferred_step", case=case, N=N, T=T, HV=HV, us=round(t_dstep, 2),
                                 verify_us=round(t_dverify, 2), verify_vs_plain=round(t_dverify / t_verify, 3),
                                 snapshot_us=round(t_snap, 2), speedup_vs_snapshot=round(t_snap / t_dstep, 3),
                                 speedup_vs_step=round(t_step / t_dstep, 3)))
                if fla_fn is not None:
                    rows.append(peer_row("fla", case, lambda ws=wins: [_fla_call(w, fla_fn) for w in ws],
                                         t_verify, state, ceiling, N=N, T=T, HV=HV))
                    fla_fn = None if "error" in rows[-1] else fla_fn
                progress.update(1, case)
                del wins, ctxs, deferred
                torch.cuda.empty_cache()
    return rows


def bench_graph(ceiling: CopyCeiling, progress: ProgressBar) -> list[dict]:
    """Verify + commit of one layer captured in a CUDA graph, N = 1 and 8, T = 4."""
    rows = []
    T, HV = 4, 48
    s = torch.cuda.Stream()
    # Launch cost: a graph of two tiny kernels (what verify + commit cost beyond their bytes).
    tiny = torch.zeros(32, device="cuda")
    with torch.cuda.stream(s):
        tiny.add_(1)
        tiny.mul_(1)
    torch.cuda.synchronize()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0):
        tiny.add_(1)
        tiny.mul_(1)
    launch_us = median_us([g0.replay], iters=100, graph=False)
    for N in (1, 8):
        state = _state_bytes(N, HV)
        graphs = []
        keep = []
        for i in range(copies_for(2 * state)):
            w = window(N, T, H, HV, K, V, seed=i)
            ctx = rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N, backend="cuda")
            acc = torch.full((N,), 3, dtype=torch.int32, device="cuda")
            step = lambda w=w, ctx=ctx, acc=acc: (w.verify(), ctx.commit(acc, w.state_indices, w.query_start_loc))  # noqa: E731
            with torch.cuda.stream(s):
                step()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            graphs.append(g)
            keep.append((w, ctx, acc))
        t = median_us([g.replay for g in graphs], iters=100, graph=False)
        floor = ceiling.us(2 * state) + launch_us
        rows.append(dict(kind="graph_step", case=f"N={N} T={T} HV={HV}", N=N, us=round(t, 2),
                         floor_us=round(floor, 2), launch_us=round(launch_us, 2),
                         copy_rw_us=round(ceiling.us(2 * state), 2), ratio_to_floor=round(t / floor, 3)))
        progress.update(1, f"graph N={N}")
    return rows


def bench_host(progress: ProgressBar) -> list[dict]:
    """Host time of one commit call (3 groups x 6 layers, each group with its own index tensors,
    the same every call) and of one call of each per-layer op (``us``: wall, ``cpu_us``: the
    thread's CPU time), the kernels each launches, and two references: the host time of
    ``torch.empty(8)`` on the GPU and of one small PyTorch kernel launch. The per-layer ops
    repeat one layout, as an engine's eager steps do (a repeated launch, ``core/repeats.py``);
    the "new layout" row is a verify call whose layout the library has not seen (the cache
    emptied before each call): the dispatcher, the checks and the launcher; one verify row runs
    inside ``torch.inference_mode()``."""
    T, R = 4, 8
    step = align_step(R, T)
    ctx, caches = commit_context(3, 6, R, T, H, 48, K, V, step.num_slots)
    commit = functools.partial(ctx.commit, step.num_accepted, query_start_loc=step.query_start_loc,
                               **per_group_indices(step, 3))
    w = window(R, T, H, 48, K, V)
    decode = functools.partial(rs.gdn_decode, w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                               query_start_loc=w.query_start_loc, out=torch.empty_like(w.v), **w.gates())
    conv_dim = 2 * H * K + 48 * V
    x = torch.randn(R * T, conv_dim, device="cuda", dtype=torch.bfloat16)
    conv_state = torch.randn(step.num_slots, conv_dim, 3 + T, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(conv_dim, 4, device="cuda", dtype=torch.bfloat16)
    conv = functools.partial(rs.conv_verify, x, conv_state, weight, None, state_indices=step.state_indices,
                             query_start_loc=step.query_start_loc, out=torch.empty_like(x))
    conv_dec = functools.partial(rs.conv_decode, x[:R], conv_state, weight, None, state_indices=step.state_indices,
                                 out=torch.empty_like(x[:R]))
    verify = functools.partial(rs.gdn_verify, w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                               query_start_loc=w.query_start_loc, records=w.records, out=torch.empty_like(w.v),
                               **w.gates())

    def verify_new_layout():
        REPEATS.clear()
        verify()

    def verify_in_inference_mode():      # how engines run their model (no version counters to bump)
        with torch.inference_mode():
            verify()

    rows = []
    for case, call in (("CommitContext.commit, 3 groups x 6 layers", commit), ("gdn_verify, 1 layer", verify),
                       ("gdn_decode, 1 layer", decode), ("conv_verify, 1 layer", conv),
                       ("conv_decode, 1 layer", conv_dec), ("gdn_verify, 1 layer, new layout", verify_new_layout),
                       ("gdn_verify, 1 layer, inside torch.inference_mode()", verify_in_inference_mode)):
        times = host_times(call)
        rows.append(dict(kind="host", case=case, us=round(times["wall_us"], 2), cpu_us=round(times["cpu_us"], 2),
                         launches=kernel_launches(call)[0]))
    # The lent machines' CPUs differ in speed by up to ~2x between runs; plain PyTorch calls timed
    # the same way in the same run put the rows above in proportion (docs/BENCHMARKS.md): an
    # allocation, and one kernel launch through PyTorch's dispatcher.
    small = torch.zeros(8, device="cuda")
    for case, call in (("reference: torch.empty(8, device='cuda')", functools.partial(torch.empty, 8, device="cuda")),
                       ("reference: a PyTorch kernel, x.add_(1) on 8 floats", functools.partial(small.add_, 1))):
        times = host_times(call)
        rows.append(dict(kind="host", case=case, us=round(times["wall_us"], 2), cpu_us=round(times["cpu_us"], 2)))
    progress.update(1, "host")
    return rows


def bench_memory() -> list[dict]:
    rows = []
    for HV in (32, 48):
        for T in (2, 4, 8):
            state = HV * V * K * 4
            records = T * (HV * V + H * K + HV) * 4
            rows.append(dict(kind="memory", case=f"T={T} HV={HV} fp32", snapshot_bytes=state * T,
                             recoverssm_bytes=state + records, ratio=round(state * T / (state + records), 3),
                             records_pct_of_state=round(100 * records / state, 2)))
    return rows


def run_all(quick: bool = False, fla: bool = True, only: list[str] = (), geometries: list[str] = ()) -> dict:
    torch.manual_seed(0)
    ceiling = CopyCeiling("cuda")
    want = lambda s: not only or s in only  # noqa: E731
    n_verify = (2 if quick else 2 * 3 * 4) if want("verify") else 0
    n_model = len(model.grid(quick, geometries)) if want("model") else 0
    n_kda = len(kda.grid(quick)) if want("kda") else 0
    n_rounding = len(rounding.grid(quick)) if want("rounding") else 0
    n_mamba2 = len(mamba2.grid(quick)) if want("mamba2") else 0
    cases = ((1 if quick else 4) * want("commit") + n_verify + n_kda + n_mamba2 + n_rounding + 2 * want("graph")
             + want("host") + n_model)
    progress = ProgressBar(cases, "bench")
    props = torch.cuda.get_device_properties(0)
    result = dict(date=datetime.date.today().isoformat(), version=package_version(), commit=source_commit(),
                  gpu=props.name, torch=torch.__version__, triton=__import__("triton").__version__,
                  copy_tbps_1GiB=round(ceiling.tbps(2**30), 3), rows=[])
    with progress:
        if want("commit"):
            result["rows"] += bench_commit(ceiling, quick, progress)
        if want("verify"):
            result["rows"] += bench_verify(ceiling, quick, fla, progress)
        if want("kda"):
            result["rows"] += kda.bench_kda(ceiling, quick, fla, progress)
        if want("mamba2"):
            result["rows"] += mamba2.bench_mamba2(ceiling, quick, progress)
        if want("rounding"):
            result["rows"] += rounding.bench_rounding(quick, progress)
        if want("graph"):
            result["rows"] += bench_graph(ceiling, progress)
        if want("host"):
            result["rows"] += bench_host(progress)
        if want("model"):
            result["model"] = model.bench_model(ceiling, quick, progress, geometries=geometries)
    if want("memory"):
        result["rows"] += bench_memory()
    return result


#: the extra fields a row may carry, shown as ``key=value`` in the notes column
NOTE_KEYS = ("cpu_us", "launches", "verify_speedup", "speedup_vs_snapshot", "speedup_vs_step", "verify_us",
             "verify_vs_plain", "commit_us", "snapshot_us", "ratio_to_floor", "floor_us", "ratio",
             "records_pct_of_state", "deferred_step_us", "verify_off_us", "commit_off_us", "snapshot_off_us",
             "deferred_step_off_us", "verify_cost", "commit_cost", "snapshot_cost", "deferred_step_cost",
             "decode_us", "decode_speedup")


def _cells(r: dict) -> list[object]:
    """One row of the table: kind, case, us, TB/s, copy TB/s, vs copy, notes."""
    if "error" in r:
        return [r["kind"], r["case"], "-", "-", "-", "-", r["error"][:80]]
    notes = " ".join(f"{key}={r[key]}" for key in NOTE_KEYS if key in r)
    if r["kind"] == "memory":
        return [r["kind"], r["case"], "-", "-", "-", "-",
                f"snapshot {r['snapshot_bytes']} B vs {r['recoverssm_bytes']} B; " + notes]
    return [r["kind"], r["case"], r.get("us", "-"), r.get("tbps", "-"), r.get("copy_tbps", "-"),
            r.get("vs_copy", "-"), notes]


def stamp(results: dict) -> str:
    """Which recoverssm was measured: the version, and the commit where it ran from a checkout
    (results written before the version was recorded have only the commit)."""
    version = results.get("version")
    commit = results.get("commit")
    parts = ([f"recoverssm {version}"] if version else []) + ([f"commit {commit}"] if commit else [])
    return "  ".join(parts) or "recoverssm (version not recorded)"


def render(results: dict) -> str:
    lines = [f"recoverssm bench  {results['date']}  {stamp(results)}  {results['gpu']}  "
             f"torch {results['torch']}  triton {results['triton']}  copy {results['copy_tbps_1GiB']} TB/s (1 GiB)"]
    if results["rows"]:
        lines += format_table(["kind", "case", "us", "TB/s", "copy TB/s", "vs copy", "notes"],
                              [_cells(r) for r in results["rows"]], align="<<>>>><")
    if "model" in results:
        lines += model.render(results["model"])
    return "\n".join(lines)


def plot_model(results: dict, path: str) -> None:
    """The model suite's plot (``bench_model.png``), titled like ``bench.png``."""
    model.plot(results["model"], path, f"recoverssm model step on {results['gpu']} "
                                       f"({results['date']}, {stamp(results)})")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    for ax, T in zip(axes, (2, 4, 8)):
        for kind, style in (("verify", "o-"), ("snapshot", "s-"), ("fla", "^--")):
            pts = sorted((r["N"], r["tbps"]) for r in results["rows"]
                         if r.get("kind") == kind and r.get("T") == T and r.get("HV") == 48 and "tbps" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
        ax.axhline(results["copy_tbps_1GiB"], color="k", lw=1, ls=":", label="device copy")
        commits = [r for r in results["rows"] if r.get("kind") == "commit"]
        for r in commits:
            ax.plot([r["requests"]], [r["tbps"]], "D", label=f"commit {r['case'][:22]}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"T = {T}, HV = 48 (state fp32)")
        ax.set_xlabel("batch rows N")
    axes[0].set_ylabel("TB/s (bytes read + written)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"recoverssm on {results['gpu']} ({results['date']}, {stamp(results)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
