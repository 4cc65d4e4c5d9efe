"""The public ops: allocate what the caller did not pass and call ``torch.ops.recoverssm.*``.

Nothing here computes or validates beyond argument *types* (so that a wrong type is a
``TypeError`` naming the argument rather than a schema error): every other check runs inside the
op (``core/ops.py`` -> ``core/arguments.py``), and the math lives in the backends
(``recoverssm/backends/cpu_ref`` is the readable reference, ``recoverssm/backends/triton`` the
kernels). These functions trace under ``torch.compile`` without graph breaks.
"""
from __future__ import annotations

from typing import Optional

import torch

from .ops import BackendArg, op, resolve_name
from .repeats import REPEATS
from .types import FAMILIES, Pending, ReplayRecords
from .validation import check_int, check_real, check_types

CONV_ACTIVATIONS = {"silu": True, None: False, "none": False, "identity": False}


def _silu(op_name: str, activation) -> bool:
    if not (activation is None or isinstance(activation, str)) or activation not in CONV_ACTIVATIONS:
        raise ValueError(f"{op_name}: activation must be 'silu' or None, got {activation!r}")
    return CONV_ACTIVATIONS[activation]


def _out_like(x: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``out``, or a new tensor of ``x``'s shape and dtype. Every token of every row is written
    (padding rows with zeros); tokens past ``query_start_loc[-1]`` are left as they are."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out


def _as_float(value):
    """An int as the float the op's schema receives; anything else as it is (checked later)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1023:
        return float(value)
    return value


def _records(op_name: str, records) -> ReplayRecords:
    if not isinstance(records, ReplayRecords):
        raise TypeError(f"{op_name}: records must be a ReplayRecords, got {type(records).__name__}")
    return records


def _pending(op_name: str, pending, pending_rows) -> tuple:
    """``(plan, pending_rows, parity)`` of a verify's ``pending`` step (``(None, None, None)``
    without one); the plan must be one group's view."""
    if pending is None:
        if pending_rows is not None:
            raise ValueError(f"{op_name}: pending_rows is given without pending")
        return None, None, None
    if not isinstance(pending, Pending):
        raise TypeError(f"{op_name}: pending must be a recoverssm.Pending (CommitContext.pending), "
                        f"got {type(pending).__name__}")
    if pending.num_groups != 1:
        raise ValueError(f"{op_name}: pending holds {pending.num_groups} KV-cache groups; pass the layer's "
                         "group, pending[g]")
    check_types(op_name, pending_rows=pending_rows)
    return pending.plan, pending_rows, pending.parity


# ------------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------------
def conv_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], *, state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, activation: Optional[str] = "silu", dilation: int = 1,
                null_slot: int = -1, out: Optional[torch.Tensor] = None,
                pending: Optional[Pending] = None, pending_rows: Optional[torch.Tensor] = None,
                backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """Causal depthwise conv of each row's window, reading the history from ``conv_state``.

    ``x``: ``[T_total, conv_dim]`` (last dim contiguous), the window inputs of all rows.
    ``conv_state``: ``[num_slots, conv_dim, history + window]`` with ``history = (width - 1) *
    dilation``: the last ``history`` inputs before the window at columns ``[0, history)`` (read
    only); the window's inputs are stored at ``[history, history + len)``. ``weight``:
    ``[conv_dim, width]`` (``weight[:, -1]`` multiplies the current token); ``bias``:
    ``[conv_dim]`` or None. ``y_p = act(bias + sum_j weight[:, j] * seq[p + j * dilation])`` with
    ``seq = history ++ window``, accumulated in fp32; ``activation``: ``"silu"`` or ``None``;
    ``dilation``: how many tokens apart the taps are (1: the plain short conv).
    ``state_indices``: int32 ``[B]``; ``query_start_loc``: int32 ``[B + 1]``, each row at most
    ``window`` tokens. Returns ``out``: ``[T_total, conv_dim]`` in ``x.dtype`` (padding rows: zeros).

    ``pending``, ``pending_rows``: the step before this one deferred its commit
    (:meth:`CommitContext.defer`): row ``r`` continues deferred row ``pending_rows[r]`` (a value
    ``<= null_slot``: none) and first compacts that row's history into its final (and
    boundary) slot, as the commit would have; ``state_indices[r]`` is that final slot.
    """
    name = "conv_verify"
    silu = _silu(name, activation)
    result = _out_like(x, out) if isinstance(x, torch.Tensor) else out
    plan, rows, _ = _pending(name, pending, pending_rows)
    args = (x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation, null_slot, result, plan,
            rows, resolve_name(backend), check)
    if not REPEATS.run(name, args, check):
        check_types(name, x=x, conv_state=conv_state, weight=weight, bias=bias, state_indices=state_indices,
                    query_start_loc=query_start_loc, out=out)
        check_int(name, "null_slot", null_slot)
        check_int(name, "dilation", dilation, minimum=1)
        op(name)(*args)
    return result


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], *, state_indices: torch.Tensor,
                activation: Optional[str] = "silu", dilation: int = 1, null_slot: int = -1,
                out: Optional[torch.Tensor] = None, backend: BackendArg = None,
                check: Optional[bool] = None) -> torch.Tensor:
    """One decode token per row: the conv output, and the row's history shifted by one in place.

    ``x``: ``[B, conv_dim]``, row ``r``'s token; ``conv_state``: the layout of
    :func:`conv_verify` (only the ``history = (width - 1) * dilation`` columns ``[0, history)`` are used; a
    decode-only pool may have exactly ``history`` columns). The output is the same arithmetic as
    :func:`conv_verify` for a window of one token, and afterwards the history holds its last
    ``history - 1`` inputs followed by ``x[r]`` (rounded to ``conv_state.dtype``): ``n`` calls
    leave the conv state as :func:`conv_verify` of the ``n`` tokens and a commit of all of them,
    bit for bit, and give :func:`conv_verify`'s outputs where ``conv_state`` holds ``x`` exactly
    (verify reads a window's earlier tokens from ``x``, decode from the rounded history).
    Returns ``out`` ``[B, conv_dim]`` in ``x.dtype`` (padding rows: zeros, history untouched).
    """
    name = "conv_decode"
    silu = _silu(name, activation)
    result = _out_like(x, out) if isinstance(x, torch.Tensor) else out
    args = (x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, result, resolve_name(backend),
            check)
    if not REPEATS.run(name, args, check):
        check_types(name, x=x, conv_state=conv_state, weight=weight, bias=bias, state_indices=state_indices,
                    out=out)
        check_int(name, "null_slot", null_slot)
        check_int(name, "dilation", dilation, minimum=1)
        op(name)(*args)
    return result


# ------------------------------------------------------------------------------------------------
# the recurrences
# ------------------------------------------------------------------------------------------------
_GATE_DOC = """
    Gates, one of two forms. Raw: ``a`` and ``b`` ``[T_total, HV]``, ``A_log`` and ``dt_bias``
    ``[HV]`` fp32; then ``g = -exp(A_log) * softplus(a + dt_bias)`` (``softplus(x) = x`` for
    ``x > 20``, else ``log1p(exp(x))``) and ``beta = sigmoid(b)``. Precomputed: ``g`` (the gate in
    log space, ``<= 0``) and ``beta`` (already a sigmoid) ``[T_total, HV]``. The decay of a token
    is ``exp(g)``.
"""

_KDA_GATE_DOC = """
    Gates, one of two forms. Raw: ``a`` ``[T_total, HV, K]`` (the gate input per K channel),
    ``dt_bias`` ``[HV, K]`` fp32, ``A_log`` ``[HV]`` fp32, ``b`` ``[T_total, HV]``; then
    ``g = -exp(A_log) * softplus(a + dt_bias)`` per channel, or with ``lower_bound`` given
    ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``; ``beta = sigmoid(b)``.
    Precomputed: ``g`` ``[T_total, HV, K]`` (log space) and ``beta`` ``[T_total, HV]``. The decay
    of a token is the K-vector ``exp(g)``: column ``j`` of the state is scaled by ``exp(g[j])``.
"""

_RECURRENCE_DOC = """
    ``q``, ``k``: ``[T_total, H, K]``; ``v``: ``[T_total, HV, V]`` (``HV`` a multiple of ``H``;
    last dims contiguous, other strides free, so views into a fused projection are read in
    place). ``state``: ``[num_slots, HV, V, K]`` fp32 or bf16, K contiguous.
    ``state_indices``: int32 ``[B]``, each row's slot; a value ``<= null_slot`` makes a padding
    row (reads nothing, writes nothing, outputs zeros). ``query_start_loc``: int32 ``[B + 1]``,
    row ``r`` owns tokens ``[qsl[r], qsl[r + 1])``.
    Per token: ``k^ = k / sqrt(sum(k^2) + 1e-6)``, ``q^ = q / sqrt(sum(q^2) + 1e-6) * scale``
    (with ``use_qk_l2norm``; else ``k^ = k``, ``q^ = q * scale``; ``scale`` defaults to
    ``K ** -0.5``), ``S' = S * decay``, ``c = beta * (v - S' k^)``, ``S = fma(c, k^, S')``,
    ``o = S q^``; the state is fp32 within a call, and with ``round_each_token`` (the records'
    mode in verify, an argument of decode and snapshot; default ``True``) a bf16 pool's is
    rounded to bf16 after every token, the output taken before (so a window in one call gives the
    bits of one call per token); without it, only where it is stored. Returns ``out``
    ``[T_total, HV, V]`` in ``v.dtype``. ``check``: run the checks of index values on device
    tensors (a host sync).
"""


def _recurrence(kind: str, mode: str, q, k, v, state, state_indices, query_start_loc, records, snapshot_slots,
                gates: dict, scale, use_qk_l2norm, null_slot, out, backend, check, pending=None,
                pending_rows=None, round_each_token=True) -> torch.Tensor:
    name = f"{kind}_{'spec_decode_snapshot' if mode == 'snapshot' else mode}"
    family = FAMILIES[kind]
    scale = _as_float(scale)           # the op receives floats; an int would key its repeats apart
    scalars = tuple(_as_float(gates.pop(name)) for name in family.scalars)
    # A repeat of an earlier call's layout is tried first: its key holds every argument, so it
    # only matches arguments of the types that call passed its checks with.
    result = _out_like(v, out) if isinstance(v, torch.Tensor) else out
    head = (q, k, v, state, state_indices, query_start_loc)
    if mode == "verify":
        rec = _records(name, records)
        round_each_token = rec.round_each_token       # the records' mode, which the commit replays with
    options = (scale, use_qk_l2norm) if family.options else ()
    tail = (*options, null_slot, round_each_token, result)
    end = (resolve_name(backend), check)
    gate_args = tuple(gates[g] for g in family.gates)
    if mode == "verify":
        plan, rows, parity = _pending(name, pending, pending_rows)
        if (rec.buffers == 2) != (plan is not None):
            raise ValueError(f"{name}: records have {rec.buffers} buffer(s); double-buffered records (buffers=2) "
                             "go with pending= (the CommitContext's that defers its commits), and only they")
        records_args = (rec.correction, rec.key, rec.decay)
        if plan is None:
            args = (*head, *records_args, *gate_args, *scalars, *tail, *end)
        else:
            name = f"{kind}_verify_pending"
            args = (*head, *records_args, *gate_args, *scalars, *tail, plan, rows, parity, *end)
    elif mode == "decode":
        args = (*head, *gate_args, *scalars, *tail, *end)
    else:
        args = (*head, snapshot_slots, *gate_args, *scalars, *tail, *end)
    if REPEATS.run(name, args, check):
        return result
    check_types(name, **dict(zip(family.tokens, (q, k, v))), state=state, state_indices=state_indices,
                query_start_loc=query_start_loc, snapshot_slots=snapshot_slots, out=out, **gates)
    check_int(name, "null_slot", null_slot)
    check_real(name, "scale", scale)
    for scalar, value in zip(family.scalars, scalars):
        check_real(name, scalar, value)
    for flag, value in (("use_qk_l2norm", use_qk_l2norm), ("round_each_token", round_each_token)):
        if not isinstance(value, bool):
            where = "records.round_each_token" if flag == "round_each_token" and mode == "verify" else flag
            raise TypeError(f"{name}: {where} must be a bool, got {type(value).__name__}")
    if result is None:
        result = _out_like(v, out)       # v is not a tensor: this raises as before the checks above
    op(name)(*args)
    return result


def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor, records: ReplayRecords,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               scale: Optional[float] = None, use_qk_l2norm: bool = True, null_slot: int = -1,
               out: Optional[torch.Tensor] = None, pending: Optional[Pending] = None,
               pending_rows: Optional[torch.Tensor] = None, backend: BackendArg = None,
               check: Optional[bool] = None) -> torch.Tensor:
    """Verify a window per row from its read-only checkpoint; write outputs and replay records.

    The state is read, never written. Each row's length is at most ``records.max_window`` and
    ``B <= records.max_batch``; the records of row ``r`` land at ``records.*[r, :, t]`` for
    ``t < len`` (correction ``c``, key ``k^``, decay), for :meth:`CommitContext.commit`.

    ``pending``, ``pending_rows`` (a context that defers its commits, :meth:`CommitContext.defer`;
    ``records`` then double-buffered): row ``r`` first does what the commit of deferred row
    ``pending_rows[r]`` would have done to this layer (replays its records from the other
    buffer, stores its boundary and final states), then verifies from that final state, which
    ``state_indices[r]`` names; a value ``<= null_slot`` (or ``pending_rows=None``): nothing to
    replay. This step's records go to the buffer ``pending.parity`` names.
    """
    return _recurrence("gdn", "verify", q, k, v, state, state_indices, query_start_loc, records, None,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta), scale, use_qk_l2norm,
                       null_slot, out, backend, check, pending, pending_rows)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               scale: Optional[float] = None, use_qk_l2norm: bool = True, null_slot: int = -1,
               out: Optional[torch.Tensor] = None, round_each_token: bool = True,
               backend: BackendArg = None,
               check: Optional[bool] = None) -> torch.Tensor:
    """The native per-token path: run each row's tokens and store its final state back into
    its slot. No two rows may write one slot. ``round_each_token``: as the layer's records."""
    return _recurrence("gdn", "decode", q, k, v, state, state_indices, query_start_loc, None, None,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta), scale, use_qk_l2norm,
                       null_slot, out, backend, check,
                       round_each_token=round_each_token)


def gdn_spec_decode_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             state: torch.Tensor, state_indices: torch.Tensor,
                             query_start_loc: torch.Tensor, snapshot_slots: torch.Tensor,
                             a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
                             A_log: Optional[torch.Tensor] = None,
                             dt_bias: Optional[torch.Tensor] = None,
                             g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                             scale: Optional[float] = None, use_qk_l2norm: bool = True,
                             null_slot: int = -1, out: Optional[torch.Tensor] = None,
                             round_each_token: bool = True,
                             backend: BackendArg = None,
                             check: Optional[bool] = None) -> torch.Tensor:
    """The snapshot method (engines' usual speculative path, the baseline): verify from
    ``state[state_indices[r]]`` and store the state after every position ``t`` of row ``r`` into
    ``state[snapshot_slots[r, t]]`` (skipped where that entry is padding).

    ``snapshot_slots``: int32 ``[B, T_max]``; each row's length at most ``T_max``. A bf16 state is
    rounded per stored position, and with ``round_each_token`` after every token.
    """
    return _recurrence("gdn", "snapshot", q, k, v, state, state_indices, query_start_loc, None, snapshot_slots,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta), scale, use_qk_l2norm,
                       null_slot, out, backend, check,
                       round_each_token=round_each_token)


def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor, records: ReplayRecords,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               lower_bound: Optional[float] = None, scale: Optional[float] = None,
               use_qk_l2norm: bool = True, null_slot: int = -1, out: Optional[torch.Tensor] = None,
               pending: Optional[Pending] = None, pending_rows: Optional[torch.Tensor] = None,
               backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """KDA (Kimi Delta Attention) verify: :func:`gdn_verify` with a decay per K channel.

    ``records`` must be allocated with ``vector_decay=True`` (decay ``[max_batch, HV,
    max_window, K]``); the commit replays them like GDN's."""
    return _recurrence("kda", "verify", q, k, v, state, state_indices, query_start_loc, records, None,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta, lower_bound=lower_bound),
                       scale, use_qk_l2norm, null_slot, out, backend, check, pending, pending_rows)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               lower_bound: Optional[float] = None, scale: Optional[float] = None,
               use_qk_l2norm: bool = True, null_slot: int = -1, out: Optional[torch.Tensor] = None,
               round_each_token: bool = True,
               backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """KDA's native per-token path (:func:`gdn_decode` with a decay per K channel)."""
    return _recurrence("kda", "decode", q, k, v, state, state_indices, query_start_loc, None, None,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta, lower_bound=lower_bound),
                       scale, use_qk_l2norm, null_slot, out, backend, check,
                       round_each_token=round_each_token)


def kda_spec_decode_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             state: torch.Tensor, state_indices: torch.Tensor,
                             query_start_loc: torch.Tensor, snapshot_slots: torch.Tensor,
                             a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
                             A_log: Optional[torch.Tensor] = None,
                             dt_bias: Optional[torch.Tensor] = None,
                             g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                             lower_bound: Optional[float] = None, scale: Optional[float] = None,
                             use_qk_l2norm: bool = True, null_slot: int = -1,
                             out: Optional[torch.Tensor] = None, round_each_token: bool = True,
                             backend: BackendArg = None,
                             check: Optional[bool] = None) -> torch.Tensor:
    """KDA's snapshot method (:func:`gdn_spec_decode_snapshot` with a decay per K channel)."""
    return _recurrence("kda", "snapshot", q, k, v, state, state_indices, query_start_loc, None, snapshot_slots,
                       dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta, lower_bound=lower_bound),
                       scale, use_qk_l2norm, null_slot, out, backend, check,
                       round_each_token=round_each_token)


for _f in (gdn_verify, gdn_decode, gdn_spec_decode_snapshot):
    _f.__doc__ += _RECURRENCE_DOC + _GATE_DOC
for _f in (kda_verify, kda_decode, kda_spec_decode_snapshot):
    _f.__doc__ += _RECURRENCE_DOC + _KDA_GATE_DOC


# ------------------------------------------------------------------------------------------------
# Mamba2
# ------------------------------------------------------------------------------------------------
_MAMBA2_DOC = """
    Mamba2 (Nemotron-H, Granite 4.0-H, Falcon-H1, Zamba2, Bamba). ``x``: ``[T_total, nheads,
    headdim]``; ``B``, ``C``: ``[T_total, ngroups, dstate]`` (``nheads`` a multiple of
    ``ngroups``; head ``h`` reads group ``h // (nheads // ngroups)``; last dims contiguous, other
    strides free, so views into the conv output are read in place). ``state``: ``[num_slots,
    nheads, headdim, dstate]`` fp32 or bf16, dstate contiguous (the layout engines use).
    ``dt``: the raw ``[T_total, nheads]`` (any float dtype); ``dt_bias``: ``[nheads]`` fp32; one
    of ``A_log`` (then ``A = -exp(A_log)``) and ``A``: ``[nheads]`` fp32; ``D``: ``[nheads]`` or
    ``[nheads, headdim]`` fp32 or None; ``z``: ``[T_total, nheads, headdim]`` or None;
    ``dt_limit``: ``(dt_min, dt_max)`` or None (either end may be None or infinite).
    Per token and head: ``dt = softplus(dt_raw + dt_bias)`` (``x`` for ``x > 20``, else
    ``log1p(exp(x))``), clamped to ``dt_limit``; ``d = exp(dt * A)``; ``c = dt * x`` (one rounding
    per element); ``S = fma(c, B, S * d)``; ``y = S C + D * x``, then ``y * silu(z)`` where ``z``
    is given. The state is fp32 within a call; with ``round_each_token`` a bf16 pool's is rounded
    after every token, the output taken before. Returns ``out`` ``[T_total, nheads, headdim]`` in
    ``x.dtype``. ``state_indices``, ``query_start_loc``, ``null_slot``, ``check``: as
    :func:`gdn_verify`.

    Records: ``ReplayRecords.allocate(max_batch, max_window, H=ngroups, HV=nheads, K=dstate,
    V=headdim)``: ``correction = dt * x`` (``headdim``), ``key = B`` (``dstate``, per group),
    ``decay = d``; the commit (:class:`CommitContext`) replays them like GDN's, in the same
    context as GDN and KDA layers.
"""


def _dt_limit(op_name: str, dt_limit) -> tuple:
    """``(dt_min, dt_max)`` of ``dt_limit`` (None: no clamp; a None end: unbounded)."""
    if dt_limit is None:
        return None, None
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        raise TypeError(f"{op_name}: dt_limit must be a (dt_min, dt_max) pair or None, got {dt_limit!r}")
    for which, value in zip(("dt_limit[0]", "dt_limit[1]"), dt_limit):
        check_real(op_name, which, value)
    return tuple(None if v is None else float(v) for v in dt_limit)


def _mamba2(mode: str, x, B, C, dt, state, state_indices, query_start_loc, records, snapshot_slots, dt_bias, A_log,
            A, D, z, dt_limit, null_slot, out, backend, check, pending=None, pending_rows=None,
            round_each_token=True) -> torch.Tensor:
    name = f"mamba2_{'spec_decode_snapshot' if mode == 'snapshot' else mode}"
    dt_min, dt_max = _dt_limit(name, dt_limit)
    gates = dict(dt=dt, dt_bias=dt_bias, A_log=A_log, A=A, D=D, z=z, dt_min=dt_min, dt_max=dt_max)
    return _recurrence("mamba2", mode, C, B, x, state, state_indices, query_start_loc, records, snapshot_slots,
                       gates, None, False, null_slot, out, backend, check, pending, pending_rows, round_each_token)


def mamba2_verify(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, *, state: torch.Tensor,
                  state_indices: torch.Tensor, query_start_loc: torch.Tensor, records: ReplayRecords,
                  dt_bias: torch.Tensor, A_log: Optional[torch.Tensor] = None, A: Optional[torch.Tensor] = None,
                  D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                  dt_limit: Optional[tuple] = None, null_slot: int = -1, out: Optional[torch.Tensor] = None,
                  pending: Optional[Pending] = None, pending_rows: Optional[torch.Tensor] = None,
                  backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """Mamba2 verify: :func:`gdn_verify`'s contract (the state read, never written; outputs and
    replay records written; ``pending`` replays a deferred step first) for a Mamba2 layer."""
    return _mamba2("verify", x, B, C, dt, state, state_indices, query_start_loc, records, None, dt_bias, A_log, A,
                   D, z, dt_limit, null_slot, out, backend, check, pending, pending_rows)


def mamba2_decode(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, *, state: torch.Tensor,
                  state_indices: torch.Tensor, query_start_loc: torch.Tensor, dt_bias: torch.Tensor,
                  A_log: Optional[torch.Tensor] = None, A: Optional[torch.Tensor] = None,
                  D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                  dt_limit: Optional[tuple] = None, null_slot: int = -1, out: Optional[torch.Tensor] = None,
                  round_each_token: bool = True, backend: BackendArg = None,
                  check: Optional[bool] = None) -> torch.Tensor:
    """Mamba2's native per-token path (:func:`gdn_decode`): each row's tokens, the final state
    stored back into its slot."""
    return _mamba2("decode", x, B, C, dt, state, state_indices, query_start_loc, None, None, dt_bias, A_log, A, D,
                   z, dt_limit, null_slot, out, backend, check, round_each_token=round_each_token)


def mamba2_spec_decode_snapshot(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, *,
                                state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                                snapshot_slots: torch.Tensor, dt_bias: torch.Tensor,
                                A_log: Optional[torch.Tensor] = None, A: Optional[torch.Tensor] = None,
                                D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                                dt_limit: Optional[tuple] = None, null_slot: int = -1,
                                out: Optional[torch.Tensor] = None, round_each_token: bool = True,
                                backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """Mamba2's snapshot method (:func:`gdn_spec_decode_snapshot`): the state after every position
    ``t`` of row ``r`` stored into ``state[snapshot_slots[r, t]]``."""
    return _mamba2("snapshot", x, B, C, dt, state, state_indices, query_start_loc, None, snapshot_slots, dt_bias,
                   A_log, A, D, z, dt_limit, null_slot, out, backend, check, round_each_token=round_each_token)


for _f in (mamba2_verify, mamba2_decode, mamba2_spec_decode_snapshot):
    _f.__doc__ += _MAMBA2_DOC
