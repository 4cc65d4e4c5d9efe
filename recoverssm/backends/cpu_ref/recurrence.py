"""The GDN, KDA and Mamba2 recurrences, the readable reference.

One function, three modes, so that verify and the native per-token paths run the very same step:

* ``verify``: start from the row's read-only checkpoint, write outputs and replay records.
* ``decode``: the native per-token path; the final state goes back into the row's slot.
* ``snapshot``: the snapshot method; the state after every position goes into its own slot.

Vectorised over rows and heads, a Python loop over window positions. The running state is fp32;
with ``round_each_token`` (the default) a bf16 pool's is rounded to bf16 after every token
(``numerics.as_stored``; the token's output comes from the state before that rounding), so a
window of n tokens in one call gives the bits of n calls of one token, each of which stores its
state; without it, it is rounded only where it is stored. GDN decays a head's state by one scalar per
token, KDA by a K-vector (column ``j`` by ``decay[j]``); everything else is the same code.
Mamba2 (``mamba2_step``) has no delta rule: its correction ``dt * x`` does not read the state,
its key is ``B`` and its output reads ``C``; its records and its state stores are the same.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...core.backend import GateInputs, PendingInputs, RecurrenceCall
from ...core.indices import is_slot
from ...core.plan import plan_entry
from ...core.types import PLAN_FIELDS
from .numerics import (as_stored, fma, gdn_gates, kda_gates, l2_normalize, mamba2_gates, on_vector_path,
                       precomputed_gates, tree_sum)
from .replay import RowCommit, decayed, replay_commits


def delta_step(S: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the delta rule for a batch of (row, head) states.

    ``S``: fp32 ``[R, HV, V, K]``; ``k_hat``: ``[R, HV, K]`` (already per value head);
    ``v``: ``[R, HV, V]``; ``beta``: ``[R, HV]``; ``decay``: ``[R, HV]`` or ``[R, HV, K]``.
    Returns the new state and ``c_t`` ``[R, HV, V]``.
    """
    S_decayed = decayed(S, decay)
    predicted = tree_sum(S_decayed * k_hat[:, :, None, :])
    correction = beta[..., None] * (v - predicted)
    return fma(correction[..., None], k_hat[:, :, None, :], S_decayed), correction


def mamba2_step(S: torch.Tensor, B: torch.Tensor, C: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                decay: torch.Tensor, D: Optional[torch.Tensor],
                z: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Mamba2 token for a batch of (row, head) states: ``c = dt * x``, ``S = fma(c, B, S * d)``,
    ``y = S C + D * x``, then ``y * silu(z)``.

    ``S``: fp32 ``[R, HV, V, K]``; ``B``, ``C``: ``[R, HV, K]`` (already per head); ``x``: fp32
    ``[R, HV, V]``; ``dt``, ``decay``: ``[R, HV]``; ``D``: ``[HV]`` or ``[HV, V]`` or None; ``z``:
    ``[R, HV, V]`` or None. Returns the new state, ``c`` and ``y`` (fp32)."""
    correction = dt[..., None] * x
    S = fma(correction[..., None], B[:, :, None, :], decayed(S, decay))
    y = tree_sum(S * C[:, :, None, :])
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D).float() * x
    if z is not None:
        gate = torch.stack([on_vector_path(F.silu, z_r.float().reshape(-1)).view(z_r.shape) for z_r in z])
        y = y * gate
    return S, correction, y


def row_bounds(query_start_loc: torch.Tensor, num_tokens: int,
               max_len: Optional[int] = None) -> tuple[list[int], list[int], list[int]]:
    """Each row's first token, span and length, whatever the values: both ends clamped to
    ``[0, num_tokens]`` (the span: the tokens between them, at least 0), the length to
    ``[0, max_len]`` (the kernels' rule; validation has already refused such values wherever
    value checks run). A live row works on ``length`` tokens; a padding row zeroes its span."""
    qsl = [min(max(x, 0), num_tokens) for x in query_start_loc.tolist()]
    spans = [max(qsl[i + 1] - qsl[i], 0) for i in range(len(qsl) - 1)]
    lengths = spans if max_len is None else [min(n, max_len) for n in spans]
    return qsl[:-1], spans, lengths


def _token_inputs(q, k, gates: GateInputs, scale: float, use_qk_l2norm: bool):
    """Every token's ``(q^, k^, decay, beta)`` (Mamba2: ``(C, B, decay, dt)``), fp32."""
    if not gates.delta_rule:
        decay, dt = mamba2_gates(gates.a, gates.dt_bias, gates.A_log, gates.A, gates.dt_limit)
        return q.float(), k.float(), decay, dt
    if use_qk_l2norm:
        q_hat = l2_normalize(q) * scale
        k_hat = l2_normalize(k)
    else:
        q_hat = q.float() * scale
        k_hat = k.float()
    if gates.precomputed:
        decay, beta = precomputed_gates(gates.g, gates.beta)
    elif gates.vector_decay:
        decay, beta = kda_gates(gates.a, gates.b, gates.A_log, gates.dt_bias, gates.lower_bound)
    else:
        decay, beta = gdn_gates(gates.a, gates.b, gates.A_log, gates.dt_bias)
    return q_hat, k_hat, decay, beta


def replay_pending(state: torch.Tensor, records: tuple, pending: PendingInputs, slots: list, null_slot: int,
                   max_len: int, read_base: int, round_each_token: bool) -> dict[int, torch.Tensor]:
    """Each live row that continues a deferred row (``pending.rows``) first commits it: its
    records (buffer rows from ``read_base``) replayed into this layer, its boundary and final
    states stored (``replay.replay_commits``), one replay counted in the plan. Returns per such
    row its final state as the pool holds it (rounded to the pool's dtype), in fp32."""
    num_slots = state.shape[0]
    fields = pending.plan[0].tolist()
    commits, replaying = [], []
    for r, prev in enumerate(pending.rows.tolist()):
        if not is_slot(slots[r], null_slot, num_slots):
            continue
        n, source, final, boundary, boundary_len = plan_entry(fields, prev, null_slot, num_slots, max_len)
        if n > 0:
            commits.append(RowCommit(read_base + prev, n, source, final, boundary, boundary_len))
            replaying.append((r, prev))
    finals = replay_commits(state, *records, commits, null_slot, round_each_token)
    for r, prev in replaying:
        pending.plan[0, PLAN_FIELDS.index("replays"), prev] += 1
    return {r: finals[i] for i, (r, _) in enumerate(replaying)}


def _pending_first(state, records, pending: Optional[PendingInputs], slots: list, null_slot: int,
                   max_len: Optional[int], round_each_token: bool) -> tuple[int, dict]:
    """``(the first records row this call writes, the rows' replayed states)``: with ``pending``
    the records are double-buffered, this call writes buffer ``parity``, and continuing rows
    replay their deferred commit from the other buffer first (:func:`replay_pending`)."""
    if pending is None:
        return 0, {}
    buffer_rows = records[0].shape[0] // 2
    parity = int(pending.parity.item())
    if pending.rows is None:
        return parity * buffer_rows, {}
    return parity * buffer_rows, replay_pending(state, records, pending, slots, null_slot, max_len,
                                                (1 - parity) * buffer_rows, round_each_token)


def recurrence(call: RecurrenceCall) -> None:
    """See :meth:`recoverssm.core.backend.Backend.recurrence`.

    ``q``, ``k``: ``[T_total, H, K]``; ``v``, ``out``: ``[T_total, HV, V]``; ``state``:
    ``[num_slots, HV, V, K]``; ``records`` = (correction, key, decay) fp32 workspaces (with
    ``pending``: double-buffered, this call writing the buffer ``pending.parity``).
    """
    mode, q, k, v, state, gates = call.mode, call.q, call.k, call.v, call.state, call.gates
    records, snapshot_slots, null_slot, out = call.records, call.snapshot_slots, call.null_slot, call.out
    round_each_token = call.round_each_token
    H, HV = q.shape[1], v.shape[1]
    group = HV // H
    max_len = records[0].shape[2] if mode == "verify" else snapshot_slots.shape[1] if mode == "snapshot" else None
    starts, spans, lengths = row_bounds(call.query_start_loc, q.shape[0], max_len)
    num_slots = state.shape[0]
    slots = call.state_indices.tolist()
    write_base, replayed = _pending_first(state, records, call.pending, slots, null_slot, max_len, round_each_token)
    rows = [r for r in range(len(slots)) if is_slot(slots[r], null_slot, num_slots) and lengths[r] > 0]
    for r in range(len(slots)):
        if not is_slot(slots[r], null_slot, num_slots):    # padding: zero output, nothing else
            out[starts[r]:starts[r] + spans[r]] = 0
    if not rows:
        return
    q_hat, k_hat, decay, beta = _token_inputs(q, k, gates, call.scale, call.use_qk_l2norm)
    head_of = torch.arange(HV) // group
    S = torch.stack([replayed[r] if r in replayed else state[slots[r]].float() for r in rows])
    for t in range(max(lengths[r] for r in rows)):
        live = [i for i, r in enumerate(rows) if lengths[r] > t]
        tok = [starts[rows[i]] + t for i in live]
        k_t = k_hat[tok]                      # [R, H, K]
        if gates.delta_rule:
            S_live, c_t = delta_step(S[live], k_t[:, head_of], v[tok].float(), beta[tok], decay[tok])
            o_t = tree_sum(S_live * q_hat[tok][:, head_of, None, :])
        else:
            S_live, c_t, o_t = mamba2_step(S[live], k_t[:, head_of], q_hat[tok][:, head_of], v[tok].float(),
                                           beta[tok], decay[tok], gates.D, None if gates.z is None else gates.z[tok])
        S[live] = as_stored(S_live, state.dtype, round_each_token)
        out[tok] = o_t.to(out.dtype)
        if mode == "verify":
            correction, key, decay_rec = records
            live_rows = [write_base + rows[i] for i in live]
            correction[live_rows, :, t] = c_t
            key[live_rows, :, t] = k_t
            decay_rec[live_rows, :, t] = decay[tok]
        elif mode == "snapshot":
            for i in live:
                dst = int(snapshot_slots[rows[i], t])
                if is_slot(dst, null_slot, num_slots):
                    state[dst] = S[i].to(state.dtype)
    if mode == "decode":
        for i, r in enumerate(rows):
            state[slots[r]] = S[i].to(state.dtype)
