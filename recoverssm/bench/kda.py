"""The KDA cases of ``recoverssm bench``: verify against flash-linear-attention's
``fused_recurrent_kda`` on the same windows and gates, the snapshot path, the commit of
vector-decay records against a device copy of the same bytes, and the speculative step.

Geometry: Kimi-Linear-like layers, ``H = HV`` (32 or 64), ``K = V = 128``, fp32 state, bf16
activations, raw per-channel gates computed in the kernels (``a`` ``[T, HV, K]``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import recoverssm as rs
from recoverssm.console import ProgressBar

from .problems import Window, spread_accepted
from .rows import peer_row, row
from .timing import CopyCeiling, copies_for, median_us

K = V = 128


def kda_window(N: int, T: int, HV: int, *, seed: int = 0, device: str = "cuda") -> Window:
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    total = N * T
    bf16 = torch.bfloat16
    return Window(
        q=torch.randn(total, HV, K, **kw).to(bf16), k=torch.randn(total, HV, K, **kw).to(bf16),
        v=torch.randn(total, HV, V, **kw).to(bf16), a=torch.randn(total, HV, K, **kw).to(bf16),
        b=torch.randn(total, HV, **kw).to(bf16), A_log=torch.randn(HV, **kw) * 0.5,
        dt_bias=torch.randn(HV, K, **kw) * 0.5,
        state=torch.randn(N * (T + 1), HV, V, K, **kw) * 0.1,
        state_indices=torch.arange(N, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=device),
        records=rs.ReplayRecords.allocate(N, T, HV, HV, K, V, device=device, vector_decay=True), N=N, T=T,
        family="kda")


def commit_traffic(state_bytes: int, HV: int, replayed: int) -> int:
    """Bytes a one-layer KDA commit moves: the state read and written, and the records of the
    ``replayed`` tokens (per token and head a correction of V floats, a key and a decay of K)."""
    return 2 * state_bytes + replayed * HV * (V + K + K) * 4


def _fla_kda_call(w: Window, fla_fn) -> Callable[[], object]:
    """flash-linear-attention's fused recurrent KDA on the same window: gates, l2 norm and beta's
    sigmoid in its kernel, the state ``[V, K]`` (``state_v_first``) read from the first N slots."""
    N, T, HV = w.N, w.T, w.q.shape[1]
    q4, k4, v4 = (t.view(N, T, HV, -1) for t in (w.q, w.k, w.v))
    a4, b4 = w.a.view(N, T, HV, K), w.b.view(N, T, HV)
    state = w.state[:N]
    dt_bias = w.dt_bias.reshape(-1)

    def call():
        return fla_fn(q4, k4, v4, g=a4, beta=b4, A_log=w.A_log, dt_bias=dt_bias, initial_state=state,
                      output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, state_v_first=True)
    return call


def _fla_kda() -> Optional[Callable]:
    try:
        from fla.ops.kda import fused_recurrent_kda
    except ImportError:
        return None
    return fused_recurrent_kda


def grid(quick: bool) -> list[tuple[int, int, int]]:
    """``(HV, T, N)`` of every case."""
    if quick:
        return [(32, 4, 64)]
    return [(HV, T, N) for HV in (32, 64) for T in (2, 4, 8) for N in (1, 8, 64, 256)]


def bench_kda(ceiling: CopyCeiling, quick: bool, fla: bool, progress: ProgressBar) -> list[dict]:
    fla_fn = _fla_kda() if fla else None
    rows = []
    for HV, T, N in grid(quick):
        state = N * HV * V * K * 4
        wins = [kda_window(N, T, HV, seed=i) for i in range(copies_for(state))]
        case = f"KDA N={N} T={T} HV={HV}"
        t_verify = median_us([w.verify for w in wins])
        rows.append(row("kda_verify", case, t_verify, state, ceiling, N=N, T=T, HV=HV))
        snaps = [torch.arange(N * T, dtype=torch.int32, device="cuda").view(N, T) + N for _ in wins]
        t_snap = median_us([lambda w=w, s=s: rs.kda_spec_decode_snapshot(
            w.q, w.k, w.v, state=w.state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
            snapshot_slots=s, **w.gates()) for w, s in zip(wins, snaps)])
        rows.append(row("kda_snapshot", case, t_snap, state * (1 + T), ceiling, N=N, T=T, HV=HV))
        accepted = spread_accepted(N, T)
        ctxs = [rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N) for w in wins]
        t_commit = median_us([lambda w=w, c=c: c.commit(accepted, w.state_indices, w.query_start_loc)
                              for w, c in zip(wins, ctxs)])
        rows.append(row("kda_commit", case, t_commit, commit_traffic(state, HV, int(accepted.sum())), ceiling,
                        N=N, T=T, HV=HV,
                        note="traffic = state read + written + records read"))
        t_step = median_us([lambda w=w, c=c: (w.verify(), c.commit(accepted, w.state_indices, w.query_start_loc))
                            for w, c in zip(wins, ctxs)])
        rows.append(dict(kind="kda_spec_step", case=case, N=N, T=T, HV=HV, us=round(t_step, 2),
                         verify_us=round(t_verify, 2), commit_us=round(t_commit, 2), snapshot_us=round(t_snap, 2),
                         speedup_vs_snapshot=round(t_snap / t_step, 3)))
        if fla_fn is not None:
            rows.append(peer_row("kda_fla", case, lambda ws=wins: [_fla_kda_call(w, fla_fn) for w in ws],
                                 t_verify, state, ceiling, N=N, T=T, HV=HV))
            fla_fn = None if "error" in rows[-1] else fla_fn
        progress.update(1, case)
        del wins, ctxs
        torch.cuda.empty_cache()
    return rows
