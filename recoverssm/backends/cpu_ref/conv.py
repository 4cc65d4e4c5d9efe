"""Short causal depthwise conv (verify over a window, decode one token) and conv-window
compaction: the reference.

``conv_state[slot]`` is ``[conv_dim, history + window]``: the last ``history`` inputs before the
window at columns ``[0, history)``; verify appends the window's inputs at ``[history, history + len)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...core.backend import PendingInputs
from ...core.indices import is_slot
from ...core.plan import plan_entry
from ...core.types import PLAN_FIELDS, conv_history
from .recurrence import row_bounds
from .numerics import silu_rows


def conv_outputs(seq: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], count: int,
                 silu: bool, dilation: int = 1) -> torch.Tensor:
    """``count`` outputs ``[count, conv_dim]`` fp32 of the conv over ``seq`` ``[conv_dim, history +
    count]`` (fp32): ``y_p = act(bias + sum_j weight[:, j] * seq[:, p + j * dilation])``,
    accumulated in the order ``bias, j = 0 .. width-1``, each step one multiply and one add (no
    fused multiply-add)."""
    w = weight.float()
    acc = torch.zeros(count, seq.shape[0], dtype=torch.float32)
    if bias is not None:
        acc += bias.float()
    for j in range(w.shape[1]):
        acc = acc + w[:, j] * seq[:, j * dilation:j * dilation + count].t()
    return silu_rows(acc) if silu else acc


def conv_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, silu: bool, dilation: int, null_slot: int, out: torch.Tensor,
                pending: Optional[PendingInputs] = None) -> None:
    """``x``, ``out``: ``[T_total, conv_dim]``; ``weight``: ``[conv_dim, width]``; ``bias``: ``[conv_dim]``.
    ``pending``: a live row that continues a deferred row first compacts that row's history into
    its final (and boundary) slot, as the commit would have, and works on the final slot."""
    history = conv_history(weight.shape[1], dilation)
    num_slots, _, cols = conv_state.shape
    window_cols = cols - history
    starts, spans, lengths = row_bounds(query_start_loc, x.shape[0], window_cols)
    replays = pending is not None and pending.rows is not None
    fields = pending.plan[0].tolist() if replays else None
    prev_rows = pending.rows.tolist() if replays else None
    for r, (slot, start, span, length) in enumerate(zip(state_indices.tolist(), starts, spans, lengths)):
        if not is_slot(slot, null_slot, num_slots):     # padding: zero output over the span
            out[start:start + span] = 0
            continue
        if replays:
            n, source, final, boundary, boundary_len = plan_entry(fields, prev_rows[r], null_slot, num_slots,
                                                                  window_cols)
            if n > 0:
                conv_compact(conv_state, history, source, final, boundary, n, boundary_len, null_slot)
                pending.plan[0, PLAN_FIELDS.index("replays"), prev_rows[r]] += 1
                slot = final
        if length == 0:
            continue
        window = x[start:start + length]
        seq = torch.cat([conv_state[slot, :, :history].float(), window.float().t()], dim=1)
        out[start:start + length] = conv_outputs(seq, weight, bias, length, silu, dilation).to(out.dtype)
        conv_state[slot, :, history:history + length] = window.t().to(conv_state.dtype)


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], state_indices: torch.Tensor, silu: bool, dilation: int,
                null_slot: int, out: torch.Tensor) -> None:
    """``x``, ``out``: ``[B, conv_dim]``, one token per row: the output of a one-token window, then
    the history shifted left by one with the token (in the conv state's dtype) last."""
    history = conv_history(weight.shape[1], dilation)
    num_slots = conv_state.shape[0]
    for r, slot in enumerate(state_indices.tolist()):
        if not is_slot(slot, null_slot, num_slots):
            out[r] = 0
            continue
        seq = torch.cat([conv_state[slot, :, :history].float(), x[r:r + 1].float().t()], dim=1)
        out[r] = conv_outputs(seq, weight, bias, 1, silu, dilation)[0].to(out.dtype)
        shifted = torch.cat([conv_state[slot, :, 1:history], x[r:r + 1].t().to(conv_state.dtype)], dim=1)
        conv_state[slot, :, :history] = shifted[:, shifted.shape[1] - history:]


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
