"""The argument checks of every op, one function per op family.

The ops (``core/ops.py``) call these before their backend does anything, so a call that raises
has written nothing. Shapes are taken from the persistent buffers first (the state pool, the
records workspace, the conv state), so that when a per-step tensor disagrees with them the error
names the per-step tensor and says where the expected size came from.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .backend import GateInputs
from .indices import INT32_MAX, is_request, is_slot
from .plan import plan_rows
from .types import FAMILIES, PLAN_FIELDS, conv_history
from .validation import FLOAT_DTYPES, STATE_DTYPES, Checker, PassedLayouts

F32 = (torch.float32,)


class RecordDims(NamedTuple):
    """The sizes a records workspace was allocated for."""
    max_batch: int
    H: int
    HV: int
    max_window: int
    K: int
    V: int
    vector_decay: bool


def check_records(c: Checker, name: str, correction, key, decay,
                  vector_decay: Optional[bool] = None, buffers: int = 1) -> RecordDims:
    """``correction [rows, HV, max_window, V]``, ``key [rows, H, max_window, K]``,
    ``decay [rows, HV, max_window]`` (scalar decay) or ``[..., K]`` (vector decay), all fp32
    and contiguous, ``rows = buffers * max_batch``. ``vector_decay``: the kind the caller needs
    (``None``: either)."""
    c.tensor(f"{name}.correction", correction, dims=4, dtypes=F32, contiguous=True)
    c.tensor(f"{name}.key", key, dims=4, dtypes=F32, contiguous=True)
    mb, HV, T, V = correction.shape
    H, K = key.shape[1], key.shape[3]
    for what, size in (("max_batch", mb), ("HV", HV), ("max_window", T), ("V", V), ("H", H), ("K", K)):
        c.size(name, size, what)
    c.tensor(f"{name}.key", key, shape=(mb, H, T, K), why=f" (max_batch, max_window from {name}.correction)")
    if not isinstance(decay, torch.Tensor) or decay.dim() not in (3, 4):
        c.tensor(f"{name}.decay", decay, dims=3)
    vector = decay.dim() == 4
    if vector_decay is not None and vector != vector_decay:
        scalar, per_channel = "a scalar decay (GDN, Mamba2)", "a vector decay (KDA)"
        have, want = (per_channel, scalar) if vector else (scalar, per_channel)
        c.fail(name, f"hold {have}; this op records {want}: allocate them with "
                     f"vector_decay={not vector}")
    c.tensor(f"{name}.decay", decay, dtypes=F32, contiguous=True,
             shape=(mb, HV, T, K) if vector else (mb, HV, T), why=f" (from {name}.correction and .key)")
    if HV % H:
        c.fail(name, f"have {HV} value heads, not a multiple of their {H} key heads")
    if mb % buffers:
        c.fail(name, f"have {mb} rows, not {buffers} buffers of equal size: allocate them with buffers={buffers}")
    return RecordDims(mb // buffers, H, HV, T, K, V, vector)


# ------------------------------------------------------------------------------------------------
# a verify's pending step (deferred commits)
# ------------------------------------------------------------------------------------------------
def check_pending(c: Checker, plan, rows, parity, B: int) -> int:
    """``plan`` int32 ``[1, 6, max_batch]`` (one group's view of ``Pending.plan``), ``rows`` int32
    ``[B]`` or ``None``, ``parity`` int32 ``[1]`` (``None`` where the op takes no records).
    Returns the plan's rows."""
    c.tensor("pending.plan", plan, dims=3, dtypes=(torch.int32,), contiguous=True)
    if plan.shape[0] != 1 or plan.shape[1] != len(PLAN_FIELDS):
        c.fail("pending.plan", f"has shape {list(plan.shape)}; expected [1, {len(PLAN_FIELDS)}, max_batch]: pass "
                               "the view of the layer's KV-cache group, pending[g]")
    if parity is not None:
        c.tensor("pending.parity", parity, dtypes=(torch.int32,), shape=(1,), contiguous=True)
    if rows is not None:
        c.index("pending_rows", rows, B)
    return c.size("pending.plan", plan.shape[2], "max_batch")


def pending_rows_values(c: Checker, plan, rows, state_indices, null_slot: int, num_slots: int) -> list:
    """Host-side value checks of a verify's pending step. ``pending_rows``: each entry padding
    (``<= null_slot``) or a row of the plan, no row twice; a row with a commit pending must name
    the pending commit's final slot in ``state_indices`` (where it continues) and the plan's
    slots must be slots. Returns ``(row, plan row)`` of the rows that replay a pending commit."""
    plan_rows = plan.shape[2]
    fields = plan[0].tolist()
    prev = rows.tolist()
    slots = state_indices.tolist()
    seen: dict[int, int] = {}
    replaying = []
    for r, p in enumerate(prev):
        if p <= null_slot or not is_slot(slots[r], null_slot, num_slots):
            continue
        if not is_request(p, plan_rows):
            c.fail("pending_rows", f"entry {r} = {p} is neither a padding value (<= null_slot = {null_slot}) "
                                   f"nor a row of the pending step in [0, {plan_rows})")
        if p in seen:
            c.fail("pending_rows", f"makes rows {seen[p]} and {r} both replay row {p} of the pending step")
        seen[p] = r
        n, src, final, boundary = fields[0][p], fields[1][p], fields[2][p], fields[3][p]
        if n <= 0:
            continue
        for what, slot in (("source_slot", src), ("final_slot", final)):
            if not is_slot(slot, null_slot, num_slots):
                c.fail("pending.plan", f"{what} of row {p} = {slot} is not a slot in [0, {num_slots})")
        if boundary > null_slot and not is_slot(boundary, null_slot, num_slots):
            c.fail("pending.plan", f"boundary_slot of row {p} = {boundary} is not a slot in [0, {num_slots})")
        if slots[r] != final:
            c.fail("state_indices", f"entry {r} = {slots[r]}, but its row replays the pending commit of row {p}, "
                                    f"whose final slot is {final}: a continuing row verifies from that slot")
        replaying.append((r, p))
    # The replays write the final (and boundary) slots while every row reads its source: one
    # writer per slot, and no slot written that another row reads.
    writes = [(r, slot) for r, p in replaying for slot in (fields[2][p], fields[3][p]) if slot > null_slot]
    replayed = dict(replaying)
    sources = [(r, fields[1][replayed[r]] if r in replayed else s) for r, s in enumerate(slots)
               if is_slot(s, null_slot, num_slots)]
    c.distinct_writes("pending.plan", writes, sources)
    return replaying


# ------------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------------
_PASSED = PassedLayouts()


def _dilated(dilation: int) -> str:
    return f" with taps {dilation} tokens apart" if dilation != 1 else ""


def check_conv(op: str, x, conv_state, weight, bias, state_indices, query_start_loc, dilation: int,
               null_slot: int, out, check: Optional[bool], static: bool = False, pending_plan=None,
               pending_rows=None) -> None:
    """``conv_verify`` (``query_start_loc`` given) and ``conv_decode`` (``None``: one token per row);
    ``pending_plan``, ``pending_rows``: a verify's pending step (:func:`check_pending`)."""
    c = Checker(op, x.device if isinstance(x, torch.Tensor) else torch.device("cpu"), static)
    key = None if static else _PASSED.key(op, (null_slot, dilation, x, conv_state, weight, bias, state_indices,
                                               query_start_loc, out, pending_plan, pending_rows))
    if key is None or key not in _PASSED:
        _conv_layout(c, x, conv_state, weight, bias, state_indices, query_start_loc, dilation, null_slot, out)
        if pending_plan is not None:
            check_pending(c, pending_plan, pending_rows, None, state_indices.shape[0])
            c.writes([("pending.plan", pending_plan), ("out", out), ("conv_state", conv_state)],
                     [("pending_rows", pending_rows), ("x", x), ("weight", weight), ("bias", bias),
                      ("state_indices", state_indices), ("query_start_loc", query_start_loc)])
        elif pending_rows is not None:
            c.fail("pending_rows", "is given without pending")
        if key is not None:
            _PASSED.add(key)
    if c.values(check):
        _conv_values(c, x, conv_state, weight, state_indices, query_start_loc, dilation, null_slot)
        if pending_plan is not None and pending_rows is not None:
            pending_rows_values(c, pending_plan, pending_rows, state_indices, null_slot, conv_state.shape[0])


def _conv_layout(c: Checker, x, conv_state, weight, bias, state_indices, query_start_loc, dilation, null_slot,
                 out) -> None:
    c.tensor("conv_state", conv_state, dims=3, dtypes=FLOAT_DTYPES)
    num_slots, dim, cols = conv_state.shape
    c.size("conv_state", dim, "conv_dim")
    c.tensor("weight", weight, dims=2, dtypes=FLOAT_DTYPES)
    c.tensor("weight", weight, shape=(dim, None), why=" (conv_dim from conv_state)")
    width = c.size("weight", weight.shape[1], "width (taps)")
    if dilation < 1:                        # (an int: the API checks the type, the schema for the op)
        c.fail("dilation", f"must be at least 1, got {dilation}")
    history = conv_history(width, dilation)
    window = cols - history
    decoding = query_start_loc is None
    if window < (0 if decoding else 1):
        c.fail("conv_state", f"has {cols} columns, fewer than {'the' if decoding else 'room for a window after the'} "
                             f"{history} history columns of a width-{width} conv{_dilated(dilation)}")
    c.tensor("x", x, dims=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    c.tensor("x", x, shape=(None, dim), why=" (conv_dim from conv_state)")
    T = x.shape[0]
    if bias is not None:
        c.tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(dim,), why=" (conv_dim from conv_state)")
    c.index("state_indices", state_indices)
    B = state_indices.shape[0]
    if decoding:
        c.tensor("x", x, shape=(B, dim), why=" (one token per row of state_indices)")
    else:
        c.index("query_start_loc", query_start_loc, B + 1)
    c.tensor("out", out, dtypes=FLOAT_DTYPES, shape=(T, dim), last_contiguous=True, why=" (the shape of x)")
    null_slot = c.null_slot(null_slot)
    c.writes([("out", out), ("conv_state", conv_state)],
             [("x", x), ("weight", weight), ("bias", bias), ("state_indices", state_indices),
              ("query_start_loc", query_start_loc)])


def _conv_values(c: Checker, x, conv_state, weight, state_indices, query_start_loc, dilation: int,
                 null_slot: int) -> None:
    null_slot = c.null_slot(null_slot)
    c.slots_in_range("state_indices", state_indices, conv_state.shape[0], null_slot)
    slots = state_indices.tolist()
    if query_start_loc is None:
        lengths = [1] * len(slots)
    else:
        window = conv_state.shape[2] - conv_history(weight.shape[1], dilation)
        qsl = c.query_start_loc("query_start_loc", query_start_loc, x.shape[0], window)
        lengths = [qsl[r + 1] - qsl[r] for r in range(len(slots))]
    c.distinct_writes("state_indices", [(r, s) for r, s in enumerate(slots) if s > null_slot and lengths[r] > 0], [])


# ------------------------------------------------------------------------------------------------
# the recurrences (GDN, KDA, Mamba2; verify, decode, snapshot)
# ------------------------------------------------------------------------------------------------
class RecurrenceArgs(NamedTuple):
    gates: GateInputs
    scale: float


def _is_real(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _check_delta_gates(c: Checker, kind: str, T: int, HV: int, K: int, V: int, a, b, A_log, dt_bias, g, beta,
                       lower_bound=None) -> GateInputs:
    """GDN's and KDA's gates: raw (``a``, ``b``, ``A_log``, ``dt_bias``) or precomputed (``g``,
    ``beta``); KDA's per K channel."""
    vector = FAMILIES[kind].vector_decay
    per_token = (T, HV, K) if vector else (T, HV)
    bias_shape = (HV, K) if vector else (HV,)
    raw = [x is not None for x in (a, b, A_log, dt_bias)]
    pre = [x is not None for x in (g, beta)]
    if any(raw) and any(pre):
        c.fail("g", "and beta cannot be given together with a, b, A_log, dt_bias; pass one gate form")
    if lower_bound is not None and not _is_real(lower_bound):
        c.fail("lower_bound", f"must be a float or None, got {type(lower_bound).__name__}", TypeError)
    why = " (HV and K from state)" if vector else " (HV from state)"
    if all(pre):
        if lower_bound is not None:
            c.fail("lower_bound", "selects a gate form of a and dt_bias; it cannot go with precomputed g")
        c.tensor("g", g, dtypes=FLOAT_DTYPES, shape=per_token, last_contiguous=True, why=why)
        c.tensor("beta", beta, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True, why=" (HV from state)")
        return GateInputs(g=g, beta=beta, kind=kind)
    if all(raw):
        c.tensor("a", a, dtypes=FLOAT_DTYPES, shape=per_token, last_contiguous=True, why=why)
        c.tensor("b", b, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True, why=" (HV from state)")
        c.tensor("A_log", A_log, dtypes=F32, shape=(HV,), contiguous=True, why=" (HV from state)")
        c.tensor("dt_bias", dt_bias, dtypes=F32, shape=bias_shape, contiguous=True, why=why)
        return _gate_inputs(kind, dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta,
                                       lower_bound=lower_bound))
    missing = [n for n, given in zip(("a", "b", "A_log", "dt_bias"), raw) if not given]
    if any(pre):
        missing = [n for n, given in zip(("g", "beta"), pre) if not given]
    c.fail(missing[0], "is missing: pass a, b, A_log and dt_bias, or g and beta")


def _check_mamba2_gates(c: Checker, kind: str, T: int, HV: int, K: int, V: int, dt, dt_bias, A_log, A, D, z,
                        dt_min=None, dt_max=None) -> GateInputs:
    """Mamba2's: ``dt`` ``[T, HV]``, ``dt_bias`` ``[HV]``, one of ``A_log`` and ``A`` ``[HV]``,
    ``D`` ``[HV]`` or ``[HV, V]`` (optional), ``z`` ``[T, HV, V]`` (optional), and the clamp of
    ``dt`` (``dt_min <= dt_max``, either may be None: unbounded on that side)."""
    for name, val in (("dt", dt), ("dt_bias", dt_bias)):
        if val is None:
            c.fail(name, "is missing: Mamba2 needs dt and dt_bias")
    if (A_log is None) == (A is None):
        c.fail("A_log", "and A: pass exactly one of them (A = -exp(A_log))")
    c.tensor("dt", dt, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True, why=" (HV = nheads from state)")
    c.tensor("dt_bias", dt_bias, dtypes=F32, shape=(HV,), contiguous=True, why=" (HV = nheads from state)")
    c.tensor("A_log" if A is None else "A", A if A_log is None else A_log, dtypes=F32, shape=(HV,), contiguous=True,
             why=" (HV = nheads from state)")
    if D is not None:
        c.tensor("D", D, dtypes=F32, contiguous=True, why=" (nheads and headdim from state)")
        if tuple(D.shape) not in ((HV,), (HV, V)):
            c.fail("D", f"must be [nheads] = [{HV}] or [nheads, headdim] = [{HV}, {V}] (from state), "
                        f"got {list(D.shape)}")
    if z is not None:
        c.tensor("z", z, dtypes=FLOAT_DTYPES, shape=(T, HV, V), last_contiguous=True,
                 why=" (the shape of x)")
    for name, val in (("dt_min", dt_min), ("dt_max", dt_max)):
        if val is not None and not _is_real(val):
            c.fail(name, f"must be a float or None, got {type(val).__name__}", TypeError)
        if val is not None and val != val:
            c.fail(name, "is NaN")
    if dt_min is not None and dt_max is not None and dt_min > dt_max:
        c.fail("dt_min", f"({dt_min}) is greater than dt_max ({dt_max})")
    return _gate_inputs(kind, dict(dt=dt, dt_bias=dt_bias, A_log=A_log, A=A, D=D, z=z, dt_min=dt_min, dt_max=dt_max))


#: each family's gate check (its arguments by the names of ``FAMILIES[kind].gates`` and ``.scalars``)
GATE_CHECKS = {"gdn": _check_delta_gates, "kda": _check_delta_gates, "mamba2": _check_mamba2_gates}


def _gate_inputs(kind: str, gate_args: dict) -> GateInputs:
    """The gates of a call whose layout has passed the checks."""
    a = gate_args
    if kind == "mamba2":
        limit = None
        if a["dt_min"] is not None or a["dt_max"] is not None:
            limit = (float("-inf") if a["dt_min"] is None else float(a["dt_min"]),
                     float("inf") if a["dt_max"] is None else float(a["dt_max"]))
        return GateInputs(a=a["dt"], dt_bias=a["dt_bias"], A_log=a["A_log"], A=a["A"], D=a["D"], z=a["z"],
                          dt_limit=limit, kind=kind)
    if a["g"] is not None:
        return GateInputs(g=a["g"], beta=a["beta"], kind=kind)
    lower_bound = a.get("lower_bound")
    return GateInputs(a=a["a"], b=a["b"], A_log=a["A_log"], dt_bias=a["dt_bias"], kind=kind,
                      lower_bound=None if lower_bound is None else float(lower_bound))


def _default_scale(kind: str, K: int, scale) -> float:
    """The scale of ``q^``: given, or ``K ** -0.5`` (GDN, KDA); 1 for Mamba2, which has none."""
    if not FAMILIES[kind].delta_rule:
        return 1.0
    return float(K ** -0.5 if scale is None else scale)


def check_recurrence(op: str, kind: str, mode: str, q, k, v, state, state_indices, query_start_loc,
                     gate_args: dict, scale, use_qk_l2norm, null_slot: int, round_each_token, out,
                     records: Optional[tuple], snapshot_slots,
                     check: Optional[bool], static: bool = False, pending: Optional[tuple] = None) -> RecurrenceArgs:
    """Every check of ``{family}_{verify,decode,spec_decode_snapshot}``. ``q``, ``k``, ``v``: the
    token inputs in those roles (the family names them, ``Family.tokens``); ``gate_args``: the
    family's gates and scalars by name; ``records``: ``(correction, key, decay)`` in verify, else
    ``None``; ``snapshot_slots`` in snapshot mode; ``pending``: a verify's ``(plan, rows,
    parity)`` (its records are then double-buffered)."""
    c = Checker(op, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), static)
    if not isinstance(round_each_token, bool):
        c.fail("round_each_token", f"must be a bool, got {type(round_each_token).__name__}", TypeError)
    key = None if static else _PASSED.key(op, (scale, use_qk_l2norm, null_slot, round_each_token, q, k, v, state,
                                               state_indices, query_start_loc, *gate_args.values(), out,
                                               snapshot_slots, *(records or ()), *(pending or ())))
    if key is not None and key in _PASSED:
        args = RecurrenceArgs(_gate_inputs(kind, gate_args), _default_scale(kind, q.shape[2], scale))
    else:
        args = _recurrence_layout(c, kind, q, k, v, state, state_indices, query_start_loc, gate_args, scale,
                                  use_qk_l2norm, null_slot, out, records, snapshot_slots, pending)
        if key is not None:
            _PASSED.add(key)
    if c.values(check):
        _recurrence_values(c, mode, state_indices, query_start_loc, snapshot_slots, state.shape[0], null_slot,
                           q.shape[0], records[0].shape[2] if records is not None else None)
        if pending is not None and pending[1] is not None:
            pending_rows_values(c, pending[0], pending[1], state_indices, null_slot, state.shape[0])
    return args


def _recurrence_layout(c: Checker, kind: str, q, k, v, state, state_indices, query_start_loc, gate_args: dict,
                       scale, use_qk_l2norm, null_slot, out, records, snapshot_slots, pending) -> RecurrenceArgs:
    if pending is not None and records is None:
        c.fail("pending", "is given to an op that does not verify: only verify replays a pending step")
    family = FAMILIES[kind]
    nq, nk, nv = family.tokens
    HV, V, K, rec = _state_and_records(c, kind, state, records, 2 if pending is not None else 1)
    H = rec.H if rec is not None else None
    c.tensor(nq, q, dims=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    T = q.shape[0]
    if H is None:
        H = c.size(nq, q.shape[1], "H (q/k heads)" if family.delta_rule else "ngroups")
    c.tensor(nq, q, shape=(T, H, K), why=f" (K = {K} from state" + (f", H = {H} from records)" if records else ")"))
    c.tensor(nk, k, dtypes=(q.dtype,), shape=(T, H, K), last_contiguous=True, why=f" (the shape of {nq})")
    c.tensor(nv, v, dtypes=(q.dtype,), shape=(T, HV, V), last_contiguous=True,
             why=f" (HV = {HV}, V = {V} from state; T from {nq})")
    if HV % H:
        c.fail(nq, f"has {H} {'q/k heads' if family.delta_rule else 'groups'}; the state's {HV} "
                   f"{'value ' if family.delta_rule else ''}heads are not a multiple of it")
    if T > INT32_MAX:
        c.fail(nq, f"has {T} tokens, more than the {INT32_MAX} a call can index")
    c.index("state_indices", state_indices)
    B = state_indices.shape[0]
    c.index("query_start_loc", query_start_loc, B + 1)
    if rec is not None and rec.max_batch < B:
        c.fail("records", f"have room for {rec.max_batch} rows, the batch has {B}")
    if pending is not None:
        plan_rows = check_pending(c, pending[0], pending[1], pending[2], B)
        if rec.max_batch < plan_rows:
            c.fail("records", f"have room for {rec.max_batch} rows per buffer, the pending plan has {plan_rows}")
    if snapshot_slots is not None:
        c.tensor("snapshot_slots", snapshot_slots, dims=2, dtypes=(torch.int32,), contiguous=True)
        c.tensor("snapshot_slots", snapshot_slots, shape=(B, None), why=" (one row per row of state_indices)")
    gates = GATE_CHECKS[kind](c, kind, T, HV, K, V, **gate_args)
    if family.delta_rule:
        scale = _check_scalars(c, K, scale, use_qk_l2norm, null_slot)
    else:
        c.null_slot(null_slot)
        scale = 1.0
    c.tensor("out", out, dtypes=FLOAT_DTYPES, shape=(T, HV, V), last_contiguous=True, why=f" (the shape of {nv})")
    written = [("out", out)]
    read = [(nq, q), (nk, k), (nv, v), ("state_indices", state_indices), ("query_start_loc", query_start_loc),
            *((name, x) for name, x in gate_args.items() if isinstance(x, torch.Tensor)),
            ("snapshot_slots", snapshot_slots)]
    if records is not None:
        written += [("records.correction", records[0]), ("records.key", records[1]), ("records.decay", records[2])]
        # a pending step's replay writes the state (its final and boundary slots)
        (written if pending is not None else read).append(("state", state))
    else:
        written.append(("state", state))
    if pending is not None:
        written.append(("pending.plan", pending[0]))
        read += [("pending_rows", pending[1]), ("pending.parity", pending[2])]
    c.writes(written, read)
    return RecurrenceArgs(gates, float(scale))


def _state_and_records(c: Checker, kind: str, state, records, buffers: int = 1) -> tuple:
    """The state pool's ``(HV, V, K)``, and the records' sizes (``None`` without records), which
    must agree with it (``buffers``: 2 for a verify that replays a pending step)."""
    c.tensor("state", state, dims=4, dtypes=STATE_DTYPES, last_contiguous=True)
    _, HV, V, K = state.shape
    for what, size in (("HV", HV), ("V", V), ("K", K)):
        c.size("state", size, what)
    if records is None:
        return HV, V, K, None
    rec = check_records(c, "records", *records, vector_decay=FAMILIES[kind].vector_decay, buffers=buffers)
    if (rec.HV, rec.V, rec.K) != (HV, V, K):
        c.fail("state", f"has HV={HV}, V={V}, K={K}, but the records were allocated for "
                        f"HV={rec.HV}, V={rec.V}, K={rec.K}")
    return HV, V, K, rec


def _check_scalars(c: Checker, K: int, scale, use_qk_l2norm, null_slot) -> float:
    """``scale`` (default ``K ** -0.5``), ``use_qk_l2norm`` and ``null_slot``; returns the scale."""
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        c.fail("scale", f"must be a float, got {type(scale).__name__}", TypeError)
    if not isinstance(use_qk_l2norm, bool):
        c.fail("use_qk_l2norm", f"must be a bool, got {type(use_qk_l2norm).__name__}", TypeError)
    c.null_slot(null_slot)
    return float(scale)


def _recurrence_values(c: Checker, mode: str, state_indices, query_start_loc, snapshot_slots, num_slots: int,
                       null_slot: int, T: int, max_window: Optional[int]) -> None:
    c.slots_in_range("state_indices", state_indices, num_slots, null_slot)
    window = snapshot_slots.shape[1] if snapshot_slots is not None else max_window
    qsl = c.query_start_loc("query_start_loc", query_start_loc, T, window)
    if mode == "verify":
        return
    slots = state_indices.tolist()
    live = [r for r, s in enumerate(slots) if s > null_slot and qsl[r + 1] > qsl[r]]
    if mode == "decode":
        c.distinct_writes("state_indices", [(r, slots[r]) for r in live], [])
        return
    c.slots_in_range("snapshot_slots", snapshot_slots, num_slots, null_slot)
    snaps = snapshot_slots.tolist()
    writes = [(r, s) for r in live for s in snaps[r][:qsl[r + 1] - qsl[r]] if s > null_slot]
    c.distinct_writes("snapshot_slots", writes, [(r, slots[r]) for r in live])


# ------------------------------------------------------------------------------------------------
# the commit plan and the commit step
# ------------------------------------------------------------------------------------------------
def check_step_shapes(c: Checker, num_accepted, state_indices, query_start_loc, request_indices,
                      block_table, num_computed_tokens, block_size, suffix: str = "",
                      checked: Optional[set] = None) -> tuple[int, Optional[int]]:
    """Shape/dtype checks of one KV-cache group's step metadata. Returns ``(B, block_size)``.

    ``checked``: ids of tensors this call has already passed through the same checks (groups
    usually share ``num_accepted``, ``query_start_loc`` and often their index tensors); they are
    skipped, and the ids of the tensors checked here are added."""
    checked = set() if checked is None else checked
    first_time = _first_time(checked)
    if first_time(num_accepted):
        c.index("num_accepted", num_accepted)
    num_requests = num_accepted.shape[0]
    if first_time(state_indices):
        c.index("state_indices" + suffix, state_indices)
    B = state_indices.shape[0]
    c.index("query_start_loc", query_start_loc, B + 1)
    if request_indices is not None:
        c.index("request_indices" + suffix, request_indices, B)
    elif num_requests < B:
        c.fail("num_accepted", f"has {num_requests} requests for a batch of {B} rows; "
                               "pass request_indices when the batch rows are not the requests")
    if (block_table is None) != (num_computed_tokens is None):
        c.fail("num_computed_tokens" + suffix if block_table is not None else "block_table" + suffix,
               "is required in align mode: pass block_table and num_computed_tokens together")
    if block_table is not None:
        block_size = _check_align_shapes(c, block_table, num_computed_tokens, block_size, num_requests, suffix,
                                         first_time)
    return B, block_size


def _first_time(checked: set):
    """A predicate: True the first time it sees a tensor (by id), recording it in ``checked``."""
    def first_time(x) -> bool:
        new = id(x) not in checked
        checked.add(id(x))
        return new
    return first_time


def _check_align_shapes(c: Checker, block_table, num_computed_tokens, block_size, num_requests: int, suffix: str,
                        first_time) -> int:
    if first_time(block_table):
        c.tensor("block_table" + suffix, block_table, dims=2, dtypes=(torch.int32,), last_contiguous=True)
    if block_table.shape[0] != num_requests:
        c.fail("block_table" + suffix, f"has {block_table.shape[0]} rows, num_accepted has {num_requests} requests")
    if block_table.shape[1] < 1:
        c.fail("block_table" + suffix, "has no columns")
    if first_time(num_computed_tokens):
        c.index("num_computed_tokens" + suffix, num_computed_tokens, num_requests)
    if block_size is None:
        c.fail("block_size" + suffix, "is required in align mode")
    return c.integer("block_size" + suffix, block_size, minimum=1)


def check_step_values(c: Checker, num_accepted, state_indices, query_start_loc, request_indices,
                      block_table, num_computed_tokens, block_size, null_slot: int, num_slots: int,
                      max_len: Optional[int], suffix: str = "") -> None:
    """Host-side value checks of one group's step (the index rule, ``core/indices.py``): slots,
    request rows, ``num_accepted`` within each live row's window, ``num_computed_tokens >= 0``,
    the final block within the table's width; and no two rows writing one slot, or writing a
    slot another row reads (that would race on a GPU)."""
    qsl = c.query_start_loc("query_start_loc", query_start_loc, INT32_MAX, max_len)
    c.slots_in_range("state_indices" + suffix, state_indices, num_slots, null_slot)
    srcs = state_indices.tolist()
    req = _request_rows(c, request_indices, len(srcs), num_accepted.shape[0], null_slot, suffix)
    accepted = num_accepted.tolist()
    # rows that commit: a slot and a request (padding rows and padding requests write nothing)
    live = [r for r, src in enumerate(srcs) if src > null_slot and req[r] > null_slot]
    _accepted_in_windows(c, accepted, live, req, qsl, suffix)
    nct = None
    if num_computed_tokens is not None:
        nct = num_computed_tokens.tolist()
        for r in live:
            if nct[req[r]] < 0:
                c.fail("num_computed_tokens" + suffix, f"entry {req[r]} = {nct[req[r]]} is negative "
                                                       f"(the request of batch row {r})")
        _block_entries(c, block_table.tolist(), live, accepted, qsl, req, nct, block_size, null_slot, num_slots,
                       suffix)
    plan = plan_rows(accepted, srcs, qsl, req if request_indices is not None else None,
                     None if block_table is None else block_table.tolist(), nct,
                     block_size or 1, null_slot, INT32_MAX)
    # every slot the plan writes is a slot here: sources were checked above, block entries by
    # _block_entries
    writes = [(r, slot) for r, (_, final, boundary, _) in enumerate(plan) for slot in (final, boundary)
              if slot > null_slot]
    live_sources = [(r, srcs[r]) for r, p in enumerate(plan) if p[0] > 0]
    c.distinct_writes("block_table" + suffix if block_table is not None else "state_indices" + suffix,
                      writes, live_sources)


def _request_rows(c: Checker, request_indices, B: int, num_requests: int, null_slot: int,
                  suffix: str) -> list[int]:
    """Each batch row's request row (``request_indices``, else the row itself): a request, or
    padding (``<= null_slot``, the index rule)."""
    if request_indices is None:
        return list(range(B))
    req = request_indices.tolist()
    for r, q in enumerate(req):
        if q > null_slot and not is_request(q, num_requests):
            c.fail("request_indices" + suffix, f"entry {r} = {q} is neither a padding value (<= null_slot = "
                                               f"{null_slot}) nor a request row in [0, {num_requests})")
    return req


def _accepted_in_windows(c: Checker, accepted: list, live: list, req: list, qsl: list, suffix: str) -> None:
    """Each live row's ``num_accepted`` lies in ``[0, len]`` of its window."""
    for r in live:
        length = qsl[r + 1] - qsl[r]
        if not 0 <= accepted[req[r]] <= length:
            c.fail("num_accepted", f"entry {req[r]} = {accepted[req[r]]} is outside [0, {length}], "
                                   f"the window of batch row {r}" + (f" of group{suffix}" if suffix else ""))


def _block_entries(c: Checker, table: list, live: list, accepted: list, qsl: list, req: list, nct: list,
                   block_size: int, null_slot: int, num_slots: int, suffix: str) -> None:
    """The block-table entries a commit reads (each live row's final block, and the block of its
    first token when the window crosses a block boundary) are padding or slots, and the final
    block lies within the table. Entries no row reads may hold anything."""
    width = len(table[0]) if table else 0
    for r in live:
        q = req[r]
        n = min(accepted[q], qsl[r + 1] - qsl[r])
        if n <= 0:
            continue
        last = (nct[q] + n - 1) // block_size
        if last >= width:
            c.fail("block_table" + suffix, f"has {width} columns; batch row {r} (request {q}, {nct[q]} tokens "
                                           f"computed, {n} accepted) ends in block {last}")
        first = nct[q] // block_size
        read = [last] + ([first] if nct[q] + n >= (first + 1) * block_size and first != last else [])
        for column in read:
            entry = table[q][column]
            if entry > null_slot and not is_slot(entry, null_slot, num_slots):
                c.fail("block_table" + suffix, f"entry [{q}, {column}] = {entry} is neither a padding value "
                                               f"(<= null_slot = {null_slot}) nor a slot in [0, {num_slots})")


def check_plan(op: str, num_accepted, state_indices, query_start_loc, request_indices, block_table,
               num_computed_tokens, block_size, null_slot, num_slots, check: Optional[bool],
               static: bool = False) -> tuple:
    """``plan_commit``: returns ``(B, block_size, null_slot, num_slots)``."""
    device = num_accepted.device if isinstance(num_accepted, torch.Tensor) else torch.device("cpu")
    c = Checker(op, device, static)
    B, block_size = check_step_shapes(c, num_accepted, state_indices, query_start_loc, request_indices,
                                      block_table, num_computed_tokens, block_size)
    null_slot = c.null_slot(null_slot)
    num_slots = INT32_MAX if num_slots is None else c.integer("num_slots", num_slots, minimum=0)
    if c.values(check):
        check_step_values(c, num_accepted, state_indices, query_start_loc, request_indices, block_table,
                          num_computed_tokens, block_size, null_slot, num_slots, None)
    return B, block_size, null_slot, num_slots


# ------------------------------------------------------------------------------------------------
# the layers of a commit
# ------------------------------------------------------------------------------------------------
class LayerTensors(NamedTuple):
    """One layer of a commit, as the commit op receives it."""
    state: torch.Tensor
    correction: torch.Tensor
    key: torch.Tensor
    decay: torch.Tensor
    conv_state: Optional[torch.Tensor]
    conv_width: int          # 0 without a conv state
    group: int
    record_buffers: int = 1  # 2: double-buffered records (a context that defers its commits)
    conv_dilation: int = 1   # the conv's taps are this many tokens apart
    round_each_token: bool = True   # the records' rounding mode (ReplayRecords.round_each_token)


def check_layers(c: Checker, layers: Sequence[LayerTensors], max_batch: int, capabilities: frozenset,
                 backend_name: str) -> None:
    """Every layer's tensors against each other and against every other layer's: no layer may
    share memory with another (the same layer or state listed twice would commit twice)."""
    names = layer_names(layers)
    for name, layer in zip(names, layers):
        _check_layer(c, name, layer, max_batch, capabilities, backend_name)
    # States and conv states are written; records are written by each layer's verify: all of
    # them must be disjoint, within a layer and across layers.
    fields = (("state", "state"), ("conv_state", "conv_state"), ("correction", "records.correction"),
              ("key", "records.key"), ("decay", "records.decay"))
    c.writes([(f"{name}.{label}", getattr(layer, field)) for name, layer in zip(names, layers)
              for field, label in fields], [])


def layer_names(layers: Sequence[LayerTensors]) -> list[str]:
    """``groups[g][j]``: how the caller of a :class:`~recoverssm.CommitContext` named each layer."""
    seen: dict[int, int] = {}
    names = []
    for layer in layers:
        j = seen.get(layer.group, 0)
        seen[layer.group] = j + 1
        names.append(f"groups[{layer.group}][{j}]")
    return names


def _check_layer(c: Checker, where: str, layer: LayerTensors, max_batch: int, capabilities: frozenset,
                 backend_name: str) -> None:
    rec = check_records(c, f"{where}.records", layer.correction, layer.key, layer.decay,
                        buffers=layer.record_buffers)
    if rec.vector_decay and "vector_decay" not in capabilities:
        c.fail(f"{where}.records", f"hold a vector decay (KDA), which backend {backend_name!r} cannot commit")
    c.tensor(f"{where}.state", layer.state, dims=4, dtypes=STATE_DTYPES, last_contiguous=True)
    c.tensor(f"{where}.state", layer.state, shape=(None, rec.HV, rec.V, rec.K),
             why=f" (HV, V, K of {where}.records)")
    if layer.state.dtype == torch.bfloat16 and "bf16_state" not in capabilities:
        c.fail(f"{where}.state", f"is bf16, which backend {backend_name!r} cannot commit")
    if rec.max_batch < max_batch:
        c.fail(f"{where}.records", f"have room for {rec.max_batch} rows, max_batch is {max_batch}")
    if not isinstance(layer.round_each_token, bool):
        c.fail(f"{where}.records.round_each_token", f"must be a bool, got {layer.round_each_token!r}", TypeError)
    if layer.conv_state is None:
        if layer.conv_width:
            c.fail(f"{where}.conv_width", "is given without a conv_state")
        return
    c.tensor(f"{where}.conv_state", layer.conv_state, dims=3, dtypes=FLOAT_DTYPES)
    slots, dim, cols = layer.conv_state.shape
    c.size(f"{where}.conv_state", dim, "conv_dim")
    if slots != layer.state.shape[0]:
        c.fail(f"{where}.conv_state", f"has {slots} slots, {where}.state has {layer.state.shape[0]}")
    width = layer.conv_width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        exc = TypeError if not isinstance(width, int) else ValueError
        c.fail(f"{where}.conv_width", f"must be the conv kernel's width (an int >= 1) when a conv_state "
                                      f"is given, got {width!r}", exc)
    dilation = layer.conv_dilation
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        exc = TypeError if not isinstance(dilation, int) else ValueError
        c.fail(f"{where}.conv_dilation", f"must be an int >= 1, got {dilation!r}", exc)
    history = conv_history(width, dilation)
    if cols < history + rec.max_window:
        c.fail(f"{where}.conv_state", f"has {cols} columns, fewer than the {history} history columns of a "
                                      f"width-{width} conv{_dilated(dilation)} plus the records' window of "
                                      f"{rec.max_window}")


def check_deferred_layers(c: Checker, layers: Sequence[LayerTensors], num_groups: int,
                          capabilities: frozenset, backend_name: str) -> list[tuple[int, int, int]]:
    """A context that defers its commits: the backend declares ``deferred``, and the layers of a
    group share one slot count and one records window (their group's plan is computed once).
    Returns per group ``(num_slots, max_window, replays)``: ``replays``, how many ops replay
    each pending row (every layer's verify, and its conv verify where it has a conv state)."""
    if "deferred" not in capabilities:
        c.fail("deferred", f"is set, but backend {backend_name!r} does not declare 'deferred'")
    names = layer_names(layers)
    out = []
    for g in range(num_groups):
        members = [(name, layer) for name, layer in zip(names, layers) if layer.group == g]
        first_name, first = members[0]
        for name, layer in members[1:]:
            if layer.state.shape[0] != first.state.shape[0]:
                c.fail(f"{name}.state", f"has {layer.state.shape[0]} slots, {first_name}.state has "
                                        f"{first.state.shape[0]}: layers of a group that defers its commits share one")
            if layer.correction.shape[2] != first.correction.shape[2]:
                c.fail(f"{name}.records", f"have a window of {layer.correction.shape[2]}, {first_name}.records "
                                          f"{first.correction.shape[2]}: layers of a group that defers share one")
        out.append((first.state.shape[0], first.correction.shape[2],
                    sum(1 + (layer.conv_state is not None) for _, layer in members)))
    return out
