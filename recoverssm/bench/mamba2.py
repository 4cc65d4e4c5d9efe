"""The Mamba2 cases of ``recoverssm bench`` (``--only mamba2``): one layer's verify, snapshot
method, commit and speculative step, and a peer kernel on the same inputs.

Geometries: Nemotron-H-like (``nheads`` 128, ``headdim`` 64, ``dstate`` 128, ``ngroups`` 8: the
Nemotron-H 8B layer) and Granite-4.0-H-1B-like (``nheads`` 64, ``ngroups`` 1); bf16 activations,
fp32 or bf16 states, ``D`` per head, raw ``dt`` (softplus in the kernels).

The peer is mamba-ssm's Triton ``selective_state_update`` (the one-token update that vLLM's and
SGLang's Mamba2 kernels derive from). It has no multi-token form, so a window of ``T`` tokens is
``T`` calls of it, each updating the state in place: the cost of decoding the window token by
token, which our ``mamba2_decode`` does in one launch. It is not bundled: it is imported from an
installed ``mamba_ssm``, or from the folder that ``RECOVERSSM_MAMBA_SSM`` names (an unpacked
mamba-ssm source tree; only ``mamba_ssm/ops/triton/`` is imported, not the package's
``__init__``, which needs its compiled extension). Without it the peer rows report the error.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

import recoverssm as rs
from recoverssm.console import ProgressBar

from .problems import spread_accepted
from .rows import peer_row, row
from .timing import CopyCeiling, copies_for, median_us

#: a time limit for the suite (it shares a 10-minute device call); cases past it are not run
TIME_LIMIT_S = {False: 150.0, True: 60.0}
STATE_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class Mamba2Geometry(NamedTuple):
    name: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int


GEOMETRIES = (Mamba2Geometry("nemotron-h-8b", 128, 64, 128, 8), Mamba2Geometry("granite-4.0-h-1b", 64, 64, 128, 1))


def grid(quick: bool) -> list[tuple[Mamba2Geometry, torch.dtype, int, int]]:
    """``(geometry, state dtype, N, T)`` cases."""
    if quick:
        return [(GEOMETRIES[0], dtype, 64, 4) for dtype in STATE_DTYPES]
    return [(g, dtype, N, T) for g in GEOMETRIES for dtype in STATE_DTYPES for T in (2, 4, 8)
            for N in (1, 8, 64, 256)]


@dataclass
class Mamba2Window:
    """One Mamba2 layer's inputs for ``N`` rows of ``T`` tokens, its state pool (``N`` slots for
    the rows, ``N * T`` more for the snapshot method) and records."""

    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    state: torch.Tensor
    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    records: rs.ReplayRecords
    N: int
    T: int

    def inputs(self) -> dict:
        return dict(state=self.state, state_indices=self.state_indices, query_start_loc=self.query_start_loc,
                    dt_bias=self.dt_bias, A_log=self.A_log, D=self.D)

    def verify(self):
        return rs.mamba2_verify(self.x, self.B, self.C, self.dt, records=self.records, **self.inputs())

    def snapshot(self, slots: torch.Tensor):
        return rs.mamba2_spec_decode_snapshot(self.x, self.B, self.C, self.dt, snapshot_slots=slots,
                                              **self.inputs())

    def decode(self):
        return rs.mamba2_decode(self.x, self.B, self.C, self.dt, **self.inputs())


def mamba2_window(g: Mamba2Geometry, N: int, T: int, state_dtype: torch.dtype, *, seed: int = 0,
                  device: str = "cuda") -> Mamba2Window:
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    total, bf16 = N * T, torch.bfloat16
    return Mamba2Window(
        x=torch.randn(total, g.nheads, g.headdim, **kw).to(bf16),
        B=torch.randn(total, g.ngroups, g.dstate, **kw).to(bf16),
        C=torch.randn(total, g.ngroups, g.dstate, **kw).to(bf16),
        dt=torch.randn(total, g.nheads, **kw).to(bf16),
        dt_bias=torch.randn(g.nheads, **kw) * 0.5 - 1.0, A_log=torch.randn(g.nheads, **kw) * 0.5,
        D=torch.randn(g.nheads, **kw),
        state=(torch.randn(N * (T + 1), g.nheads, g.headdim, g.dstate, **kw) * 0.1).to(state_dtype),
        state_indices=torch.arange(N, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=device),
        records=rs.ReplayRecords.allocate(N, T, g.ngroups, g.nheads, g.dstate, g.headdim, device=device),
        N=N, T=T)


# ------------------------------------------------------------------------------------------------
# the peer
# ------------------------------------------------------------------------------------------------
def load_peer() -> Callable:
    """mamba-ssm's ``selective_state_update``: from an installed ``mamba_ssm``, else from the
    source tree ``RECOVERSSM_MAMBA_SSM`` names, importing only its Triton ops (a namespace module
    stands in for the package, whose ``__init__`` imports the compiled extension)."""
    name = "mamba_ssm.ops.triton.selective_state_update"
    try:
        return importlib.import_module(name).selective_state_update
    except ImportError:
        root = os.environ.get("RECOVERSSM_MAMBA_SSM")
        if not root:
            raise
    package = types.ModuleType("mamba_ssm")
    package.__path__ = [os.path.join(root, "mamba_ssm")]
    sys.modules["mamba_ssm"] = package
    return importlib.import_module(name).selective_state_update


def peer_calls(w: Mamba2Window, peer: Callable) -> list[Callable[[], object]]:
    """``T`` calls of the one-token peer over the window's rows, as an engine that decodes each
    token would make them: per head ``dt``, ``dt_bias``, ``A`` and ``D`` broadcast over
    ``headdim`` (and ``A`` over ``dstate``) with stride 0, the form its kernel reads once per head."""
    N, T = w.N, w.T
    _, H, P = w.x.shape
    Nst = w.B.shape[2]
    A = (-torch.exp(w.A_log))[:, None, None].expand(H, P, Nst)
    D = w.D[:, None].expand(H, P)
    dt_bias = w.dt_bias[:, None].expand(H, P)
    x, B, C = (t.view(N, T, *t.shape[1:]) for t in (w.x, w.B, w.C))
    dt = w.dt.view(N, T, H)
    state = w.state

    def call():
        for t in range(T):
            peer(state, x[:, t], dt[:, t, :, None].expand(N, H, P), A, B[:, t], C[:, t], D=D, dt_bias=dt_bias,
                 dt_softplus=True, state_batch_indices=w.state_indices)
    return [call]


# ------------------------------------------------------------------------------------------------
# the suite
# ------------------------------------------------------------------------------------------------
def commit_traffic(state_bytes: int, g: Mamba2Geometry, replayed: int) -> int:
    """Bytes a one-layer commit moves: the state read and written, and the records of the
    ``replayed`` tokens (per token a correction of ``headdim`` floats and a decay per head, a key
    of ``dstate`` floats per group)."""
    return 2 * state_bytes + replayed * (g.nheads * (g.headdim + 1) + g.ngroups * g.dstate) * 4


def bench_mamba2(ceiling: CopyCeiling, quick: bool, progress: ProgressBar, device: str = "cuda") -> list[dict]:
    try:
        peer = load_peer()
        peer_error = None
    except Exception as exc:  # noqa: BLE001 - reported in the peer rows
        peer, peer_error = None, f"{type(exc).__name__}: {exc}"[:200]
    rows, start = [], time.monotonic()
    for g, dtype, N, T in grid(quick):
        case = f"{g.name} {DTYPE_NAMES[dtype]} N={N} T={T}"
        if time.monotonic() - start > TIME_LIMIT_S[quick]:
            rows.append(dict(kind="mamba2", case=case, error=f"not run: past the suite's {TIME_LIMIT_S[quick]:.0f} s"))
            progress.update(1, case)
            continue
        state_bytes = N * g.nheads * g.headdim * g.dstate * torch.empty((), dtype=dtype).element_size()
        wins = [mamba2_window(g, N, T, dtype, seed=i, device=device) for i in range(copies_for(state_bytes))]
        accepted = spread_accepted(N, T, device=device)
        ctxs = [rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N) for w in wins]
        snap = torch.arange(N * T, dtype=torch.int32, device=device).view(N, T) + N
        t_verify = median_us([w.verify for w in wins])
        t_snap = median_us([lambda w=w: w.snapshot(snap) for w in wins])
        t_decode = median_us([w.decode for w in wins])
        t_commit = median_us([lambda w=w, c=c: c.commit(accepted, w.state_indices, w.query_start_loc)
                              for w, c in zip(wins, ctxs)])
        t_step = median_us([lambda w=w, c=c: (w.verify(), c.commit(accepted, w.state_indices, w.query_start_loc))
                            for w, c in zip(wins, ctxs)])
        shape = dict(geometry=g.name, state=DTYPE_NAMES[dtype], N=N, T=T)
        rows.append(row("mamba2_verify", case, t_verify, state_bytes, ceiling, **shape,
                        note="traffic = state bytes read"))
        rows.append(row("mamba2_commit", case, t_commit, commit_traffic(state_bytes, g, int(accepted.sum())),
                        ceiling, **shape))
        rows.append(dict(kind="mamba2_step", case=case, **shape, us=round(t_step, 2), verify_us=round(t_verify, 2),
                         commit_us=round(t_commit, 2), snapshot_us=round(t_snap, 2), decode_us=round(t_decode, 2),
                         speedup_vs_snapshot=round(t_snap / t_step, 3)))
        if peer is None:
            rows.append(dict(kind="mamba_ssm", case=case, error=peer_error))
        else:
            rows.append(peer_row("mamba_ssm", case, lambda ws=wins: [c for w in ws for c in peer_calls(w, peer)],
                                 t_verify, 2 * state_bytes * T, ceiling, **shape, decode_us=round(t_decode, 2),
                                 note=f"{T} one-token calls, the state read and written each"))
            if "error" not in rows[-1]:
                rows[-1]["decode_speedup"] = round(rows[-1]["us"] / t_decode, 3)
        progress.update(1, case)
        del wins, ctxs
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
