"""The cost of ``round_each_token`` (``recoverssm bench --only rounding``): one GDN layer over a
bf16 state pool, Qwen3-Next's layer at TP = 1 (HV = 32, K = V = 128), each op timed with the
state rounded after every token (the default: a speculative step gives the bits of one-token
decoding) and rounded only where it is stored. One row per case: both times of verify, the
commit, the snapshot method's verify and the deferred step, and their ratios (on / off)."""
from __future__ import annotations

import torch

import recoverssm as rs
from recoverssm.console import ProgressBar

from .problems import DeferredLayer, spread_accepted, window
from .timing import copies_for, median_us

H, HV, K, V = 16, 32, 128, 128
STATE = torch.bfloat16


def grid(quick: bool) -> list[tuple[int, int]]:
    """``(N, T)`` cases."""
    return [(64, 4)] if quick else [(N, T) for T in (2, 4, 8) for N in (8, 64)]


def _times(N: int, T: int, round_each_token: bool, device: str, dims=(H, HV, K, V)) -> dict:
    """One mode's device times (us) of verify, commit, snapshot and deferred step."""
    h, hv, k, v = dims
    state_bytes = N * hv * v * k * 2
    wins = [window(N, T, h, hv, k, v, state_dtype=STATE, extra_slots=N * T, seed=i, device=device,
                   round_each_token=round_each_token) for i in range(copies_for(state_bytes))]
    accepted = spread_accepted(N, T, device=device)
    ctxs = [rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N) for w in wins]
    snap = [torch.arange(N * T, dtype=torch.int32, device=device).view(N, T) + N for _ in wins]
    deferred = [DeferredLayer(w, accepted, h, k, v).warm() for w in wins]
    return dict(
        verify=median_us([w.verify for w in wins]),
        commit=median_us([lambda w=w, c=c: c.commit(accepted, w.state_indices, w.query_start_loc)
                          for w, c in zip(wins, ctxs)]),
        snapshot=median_us([lambda w=w, s=s: rs.gdn_spec_decode_snapshot(
            w.q, w.k, w.v, state=w.state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
            snapshot_slots=s, round_each_token=round_each_token, **w.gates()) for w, s in zip(wins, snap)]),
        deferred_step=median_us([d.step for d in deferred]))


def bench_rounding(quick: bool, progress: ProgressBar, device: str = "cuda", dims=(H, HV, K, V)) -> list[dict]:
    rows = []
    for N, T in grid(quick):
        on, off = (_times(N, T, mode, device, dims) for mode in (True, False))
        case = f"bf16 N={N} T={T} HV={dims[1]}"
        rows.append(dict(kind="rounding", case=case, N=N, T=T, HV=dims[1], us=round(on["verify"], 2),
                         **{f"{op}_us": round(on[op], 2) for op in on},
                         **{f"{op}_off_us": round(off[op], 2) for op in off},
                         **{f"{op}_cost": round(on[op] / off[op], 3) for op in on}))
        progress.update(1, case)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
