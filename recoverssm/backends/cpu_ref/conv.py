"""Short causal depthwise conv over each row's window, and conv-window compaction (reference).

``conv_state[slot]`` is ``[conv_dim, history + T_max]``: the last ``history`` inputs before the
window at columns ``[0, history)``; verify appends the window's inputs at ``[history, history + len)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .numerics import silu_rows


def conv_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, silu: bool, null_slot: int, out: torch.Tensor) -> None:
    """``x``, ``out``: ``[T_total, conv_dim]``; ``weight``: ``[conv_dim, width]``; ``bias``: ``[conv_dim]``.

    ``y_p = act(bias + sum_j weight[:, j] * seq[p + j])`` with ``seq = history ++ window``,
    accumulated in fp32 in the order ``j = 0 .. width-1``.
    """
    width = weight.shape[1]
    history = width - 1
    w = weight.float()
    qsl = query_start_loc.tolist()
    for r, slot in enumerate(state_indices.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        if slot <= null_slot:
            out[start:end] = 0
            continue
        window = x[start:end]
        seq = torch.cat([conv_state[slot, :, :history].float(), window.float().t()], dim=1)
        acc = torch.zeros(end - start, x.shape[1], dtype=torch.float32)
        if bias is not None:
            acc += bias.float()
        for j in range(width):
            acc = acc + w[:, j] * seq[:, j:j + end - start].t()
        out[start:end] = (silu_rows(acc) if silu else acc).to(out.dtype)
        conv_state[slot, :, history:history + end - start] = window.t().to(conv_state.dtype)


def conv_compact(conv_state: torch.Tensor, history: int, src: int, final: int, boundary: int,
                 commit_len: int, boundary_len: int, null_slot: int) -> None:
    """Move the ``history`` inputs that end at the last committed token to the front of the
    destination slots: ``dst[:, :history] = src[:, n : n + history]`` (and ``boundary_len`` for the
    boundary slot). The source is read in full before anything is written, since either
    destination may be the source itself."""
    if commit_len <= 0:
        return
    window = conv_state[src].clone()
    if boundary > null_slot:
        conv_state[boundary, :, :history] = window[:, boundary_len:boundary_len + history]
    if final > null_slot:
        conv_state[final, :, :history] = window[:, commit_len:commit_len + history]
