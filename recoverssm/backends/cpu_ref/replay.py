"""The commit's replay, the reference: ``S = fma(c, k^, S * d)`` per accepted token (with
``round_each_token``, rounded to the pool's dtype after each, as verify rounds its running state).

The commit (``commit.py``), the flush of a deferred step and a verify that replays a pending
step first (``recurrence.py``) all go through :func:`replay_commits`, so the three are the same
arithmetic on the same records.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .numerics import as_stored, fma


class RowCommit(NamedTuple):
    """One row's commit: its records row (the batch row, plus the buffer's first row where the
    records are double-buffered), ``n`` tokens, and the slots it reads and writes."""
    record_row: int
    n: int
    source: int
    final: int
    boundary: int
    boundary_len: int


def decayed(S: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``S * d``, one rounding per element: ``d`` a scalar per head ``[R, HV]`` (GDN) or a
    K-vector per head ``[R, HV, K]`` (KDA, scaling column ``j`` by ``d[..., j]``)."""
    if decay.dim() == S.dim() - 2:
        return S * decay[..., None, None]
    return S * decay[..., None, :]


def replay_step(S: torch.Tensor, correction: torch.Tensor, k_hat: torch.Tensor,
                decay: torch.Tensor) -> torch.Tensor:
    """The commit's step: ``S = fma(c, k^, S * d)`` with ``d`` a scalar ``[R, HV]`` or a K-vector ``[R, HV, K]``."""
    return fma(correction[..., None], k_hat[:, :, None, :], decayed(S, decay))


def replay_commits(state: torch.Tensor, correction: torch.Tensor, key: torch.Tensor, decay: torch.Tensor,
                   commits: Sequence[RowCommit], null_slot: int, round_each_token: bool) -> torch.Tensor:
    """Replay each commit's first ``n`` records into its source state (every source read before
    any store), store the boundary state after ``boundary_len`` tokens and the final state after
    ``n``. Returns the final states as the pool holds them, fp32 ``[len(commits), HV, V, K]``."""
    if not commits:
        return state.new_zeros((0, *state.shape[1:]), dtype=torch.float32)
    H, HV = key.shape[1], correction.shape[1]
    head_of = torch.arange(HV) // (HV // H)
    S = state[[c.source for c in commits]].float()
    for t in range(max(c.n for c in commits)):
        live = [i for i, c in enumerate(commits) if c.n > t]
        rows = [commits[i].record_row for i in live]
        S[live] = as_stored(replay_step(S[live], correction[rows, :, t], key[rows][:, head_of, t], decay[rows, :, t]),
                            state.dtype, round_each_token)
        for i in live:
            c = commits[i]
            if c.boundary > null_slot and c.boundary_len == t + 1:
                state[c.boundary] = S[i].to(state.dtype)
    for i, c in enumerate(commits):
        state[c.final] = S[i].to(state.dtype)
    return S.to(state.dtype).float()
