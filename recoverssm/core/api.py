"""The public ops (contract section 5): validate, allocate outputs, pick a backend, launch.

Nothing here computes; the math lives in the backends (``recoverssm/backends/cpu_ref`` is the
readable reference, ``recoverssm/backends/triton`` the kernels).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .backend import Backend, GateInputs
from .registry import registry
from .types import ReplayRecords
from .validation import FLOAT_DTYPES, STATE_DTYPES, Checker, wants_value_checks

BackendArg = Union[str, Backend, None]
CONV_ACTIVATIONS = {"silu": True, None: False, "none": False, "identity": False}


def _resolve(backend: BackendArg, device: torch.device) -> Backend:
    return registry().resolve(backend, device)[0]


def _first_tensor(op: str, name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


# ------------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------------
def conv_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], *, state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, activation: Optional[str] = "silu",
                null_slot: int = -1, out: Optional[torch.Tensor] = None,
                backend: BackendArg = None, check: Optional[bool] = None) -> torch.Tensor:
    """Causal depthwise conv of each row's window, reading the history from ``conv_state``.

    ``x``: ``[T_total, conv_dim]`` (last dim contiguous), the window inputs of all rows.
    ``conv_state``: ``[num_slots, conv_dim, history + T_max]`` with ``history = width - 1``; the
    window's inputs are stored at columns ``[history, history + len)``; columns ``[0, history)``
    are read only. ``weight``: ``[conv_dim, width]``; ``bias``: ``[conv_dim]`` or None.
    Returns ``out``: ``[T_total, conv_dim]`` in ``x.dtype`` (padding rows: zeros).
    """
    op = "conv_verify"
    c = Checker(op, _first_tensor(op, "x", x).device)
    c.tensor("x", x, dims=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    T, dim = x.shape
    c.tensor("weight", weight, dims=2, dtypes=FLOAT_DTYPES)
    if weight.shape[0] != dim:
        c.fail("weight", f"has {weight.shape[0]} channels, x has {dim}")
    history = weight.shape[1] - 1
    c.tensor("conv_state", conv_state, dims=3, dtypes=FLOAT_DTYPES)
    if conv_state.shape[1] != dim:
        c.fail("conv_state", f"has {conv_state.shape[1]} channels, x has {dim}")
    window = conv_state.shape[2] - history
    if window < 1:
        c.fail("conv_state", f"has {conv_state.shape[2]} columns, no room for a window after "
                             f"the {history} history columns (weight width {weight.shape[1]})")
    if bias is not None:
        c.tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(dim,))
    if activation not in CONV_ACTIVATIONS:
        c.fail("activation", f"must be 'silu' or None, got {activation!r}")
    c.index("state_indices", state_indices)
    B = state_indices.shape[0]
    c.index("query_start_loc", query_start_loc, B + 1)
    null_slot = c.integer("null_slot", null_slot)
    if out is not None:
        c.tensor("out", out, dtypes=FLOAT_DTYPES, shape=(T, dim), last_contiguous=True)
        for name, t in (("x", x), ("conv_state", conv_state)):
            c.no_overlap("out", out, name, t)
    if wants_value_checks(check, x.device):
        c.slots_in_range("state_indices", state_indices, conv_state.shape[0], null_slot)
        c.query_start_loc("query_start_loc", query_start_loc, T, window)
    be = _resolve(backend, x.device)
    if out is None:
        out = torch.empty_like(x)
    be.conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc,
                   CONV_ACTIVATIONS[activation], null_slot, out)
    return out


# ------------------------------------------------------------------------------------------------
# GDN
# ------------------------------------------------------------------------------------------------
def _check_gdn(op, q, k, v, state, state_indices, query_start_loc, a, b, A_log, dt_bias, g, beta,
               scale, null_slot, out):
    """Checks shared by verify, decode and snapshot; returns (checker, dims, gates, scale)."""
    c = Checker(op, _first_tensor(op, "q", q).device)
    c.tensor("q", q, dims=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    T, H, K = q.shape
    c.tensor("k", k, dtypes=(q.dtype,), shape=(T, H, K), last_contiguous=True)
    c.tensor("v", v, dims=3, dtypes=(q.dtype,), last_contiguous=True)
    if v.shape[0] != T:
        c.fail("v", f"has {v.shape[0]} tokens, q has {T}")
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        c.fail("v", f"has {HV} value heads, not a multiple of the {H} q/k heads")
    c.tensor("state", state, dims=4, dtypes=STATE_DTYPES, shape=(None, HV, V, K), last_contiguous=True)
    c.index("state_indices", state_indices)
    B = state_indices.shape[0]
    c.index("query_start_loc", query_start_loc, B + 1)
    raw = [x is not None for x in (a, b, A_log, dt_bias)]
    pre = [x is not None for x in (g, beta)]
    if any(raw) and any(pre):
        c.fail("g", "and beta cannot be given together with a, b, A_log, dt_bias; pass one gate form")
    if all(pre):
        c.tensor("g", g, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True)
        c.tensor("beta", beta, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True)
        gates = GateInputs(g=g, beta=beta)
    elif all(raw):
        c.tensor("a", a, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True)
        c.tensor("b", b, dtypes=FLOAT_DTYPES, shape=(T, HV), last_contiguous=True)
        c.tensor("A_log", A_log, dtypes=(torch.float32,), shape=(HV,), contiguous=True)
        c.tensor("dt_bias", dt_bias, dtypes=(torch.float32,), shape=(HV,), contiguous=True)
        gates = GateInputs(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    else:
        missing = [n for n, given in zip(("a", "b", "A_log", "dt_bias"), raw) if not given]
        if any(pre):
            missing = [n for n, given in zip(("g", "beta"), pre) if not given]
        c.fail(missing[0], "is missing: pass a, b, A_log and dt_bias, or g and beta")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        c.fail("scale", f"must be a float, got {type(scale).__name__}", TypeError)
    null_slot = c.integer("null_slot", null_slot)
    if out is not None:
        c.tensor("out", out, dtypes=FLOAT_DTYPES, shape=(T, HV, V), last_contiguous=True)
        for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
            c.no_overlap("out", out, name, t)
    return c, (T, H, HV, K, V, B), gates, float(scale), null_slot


def _check_records(c: Checker, records, dims):
    T, H, HV, K, V, B = dims
    if not isinstance(records, ReplayRecords):
        c.fail("records", f"must be a ReplayRecords, got {type(records).__name__}", TypeError)
    for name in ("correction", "key", "decay"):     # ranks first: the shapes below index them
        c.tensor(f"records.{name}", getattr(records, name), dims=None if name == "decay" else 4)
    if records.vector_decay:
        c.fail("records", "hold a vector decay (KDA); GDN verify records a scalar decay per head")
    mb, tm = records.max_batch, records.max_window
    c.tensor("records.correction", records.correction, dtypes=(torch.float32,), shape=(mb, HV, tm, V), contiguous=True)
    c.tensor("records.key", records.key, dtypes=(torch.float32,), shape=(mb, H, tm, K), contiguous=True)
    c.tensor("records.decay", records.decay, dtypes=(torch.float32,), shape=(mb, HV, tm), contiguous=True)
    if mb < B:
        c.fail("records", f"have room for {mb} rows, the batch has {B}")


def _finish_out(out, v):
    # Every token of every row is written (padding rows with zeros), so no fill is needed; tokens
    # outside all rows (past query_start_loc[-1]) are left unwritten.
    return torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out


def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor, records: ReplayRecords,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               scale: Optional[float] = None, use_qk_l2norm: bool = True, null_slot: int = -1,
               out: Optional[torch.Tensor] = None, backend: BackendArg = None,
               check: Optional[bool] = None) -> torch.Tensor:
    """Verify a window per row from its read-only checkpoint; write outputs and replay records.

    ``q``, ``k``: ``[T_total, H, K]``; ``v``: ``[T_total, HV, V]`` (last dims contiguous, other
    strides free); ``a``, ``b`` (or ``g``, ``beta``): ``[T_total, HV]``; ``A_log``, ``dt_bias``:
    ``[HV]`` fp32. ``state``: ``[num_slots, HV, V, K]`` fp32/bf16, read only. ``state_indices``:
    int32 ``[B]`` (``<= null_slot``: padding row); ``query_start_loc``: int32 ``[B + 1]``; each
    row's length at most ``records.max_window``. Returns ``out`` ``[T_total, HV, V]`` (``v.dtype``).
    Records of row ``r`` land at ``records.*[r, :, t]`` for ``t < len``.
    """
    c, dims, gates, scale, null_slot = _check_gdn("gdn_verify", q, k, v, state, state_indices,
                                                  query_start_loc, a, b, A_log, dt_bias, g, beta,
                                                  scale, null_slot, out)
    _check_records(c, records, dims)
    if wants_value_checks(check, q.device):
        c.slots_in_range("state_indices", state_indices, state.shape[0], null_slot)
        c.query_start_loc("query_start_loc", query_start_loc, dims[0], records.max_window)
    be = _resolve(backend, q.device)
    out = _finish_out(out, v)
    be.gdn_recurrent("verify", q, k, v, state, state_indices, query_start_loc, gates, scale,
                     bool(use_qk_l2norm), null_slot, out,
                     (records.correction, records.key, records.decay), None)
    return out


def _written_slots_distinct(c: Checker, name: str, writes: list[tuple[int, int]],
                            sources: list[tuple[int, int]]):
    """Refuse two writes to one slot, or a write to a slot another row reads (a race on a GPU).

    ``writes`` and ``sources``: ``(row, slot)`` pairs (several rows may read one slot)."""
    readers: dict[int, list[int]] = {}
    for row, slot in sources:
        readers.setdefault(slot, []).append(row)
    seen: dict[int, int] = {}
    for row, slot in writes:
        if slot in seen and seen[slot] != row:
            c.fail(name, f"sends rows {seen[slot]} and {row} to the same slot {slot}")
        seen[slot] = row
    for row, slot in writes:
        others = [r for r in readers.get(slot, ()) if r != row]
        if others:
            c.fail(name, f"makes row {row} write slot {slot}, which row {others[0]} reads")


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: torch.Tensor,
               state_indices: torch.Tensor, query_start_loc: torch.Tensor,
               a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
               scale: Optional[float] = None, use_qk_l2norm: bool = True, null_slot: int = -1,
               out: Optional[torch.Tensor] = None, backend: BackendArg = None,
               check: Optional[bool] = None) -> torch.Tensor:
    """The native per-token path: run each row's tokens and write the final state back in place.

    Same arguments and layouts as :func:`gdn_verify`, without records. Rows with a token must
    have distinct slots.
    """
    c, dims, gates, scale, null_slot = _check_gdn("gdn_decode", q, k, v, state, state_indices,
                                                  query_start_loc, a, b, A_log, dt_bias, g, beta,
                                                  scale, null_slot, out)
    if wants_value_checks(check, q.device):
        c.slots_in_range("state_indices", state_indices, state.shape[0], null_slot)
        qsl = c.query_start_loc("query_start_loc", query_start_loc, dims[0], None)
        writes = [(r, s) for r, s in enumerate(state_indices.tolist())
                  if s > null_slot and qsl[r + 1] > qsl[r]]
        _written_slots_distinct(c, "state_indices", writes, [])
    be = _resolve(backend, q.device)
    out = _finish_out(out, v)
    be.gdn_recurrent("decode", q, k, v, state, state_indices, query_start_loc, gates, scale,
                     bool(use_qk_l2norm), null_slot, out, None, None)
    return out


def gdn_spec_decode_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             state: torch.Tensor, state_indices: torch.Tensor,
                             query_start_loc: torch.Tensor, snapshot_slots: torch.Tensor,
                             a: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
                             A_log: Optional[torch.Tensor] = None,
                             dt_bias: Optional[torch.Tensor] = None,
                             g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                             scale: Optional[float] = None, use_qk_l2norm: bool = True,
                             null_slot: int = -1, out: Optional[torch.Tensor] = None,
                             backend: BackendArg = None,
                             check: Optional[bool] = None) -> torch.Tensor:
    """The snapshot method (today's engine default, our baseline): verify from
    ``state[state_indices[r]]`` and store the state after every position ``t`` of row ``r`` into
    ``state[snapshot_slots[r, t]]`` (skipped where that entry ``<= null_slot``).

    ``snapshot_slots``: int32 ``[B, T_max]``; each row's length at most ``T_max``. A bf16 state is
    rounded once per stored position; the running state stays fp32.
    """
    c, dims, gates, scale, null_slot = _check_gdn("gdn_spec_decode_snapshot", q, k, v, state,
                                                  state_indices, query_start_loc, a, b, A_log,
                                                  dt_bias, g, beta, scale, null_slot, out)
    B = dims[5]
    c.tensor("snapshot_slots", snapshot_slots, dims=2, dtypes=(torch.int32,), contiguous=True)
    if snapshot_slots.shape[0] != B:
        c.fail("snapshot_slots", f"has {snapshot_slots.shape[0]} rows, the batch has {B}")
    if wants_value_checks(check, q.device):
        num_slots = state.shape[0]
        c.slots_in_range("state_indices", state_indices, num_slots, null_slot)
        c.slots_in_range("snapshot_slots", snapshot_slots, num_slots, null_slot)
        qsl = c.query_start_loc("query_start_loc", query_start_loc, dims[0], snapshot_slots.shape[1])
        srcs = state_indices.tolist()
        snaps = snapshot_slots.tolist()
        live = [r for r in range(B) if srcs[r] > null_slot and qsl[r + 1] > qsl[r]]
        writes = [(r, s) for r in live for s in snaps[r][:qsl[r + 1] - qsl[r]] if s > null_slot]
        _written_slots_distinct(c, "snapshot_slots", writes, [(r, srcs[r]) for r in live])
    be = _resolve(backend, q.device)
    out = _finish_out(out, v)
    be.gdn_recurrent("snapshot", q, k, v, state, state_indices, query_start_loc, gates, scale,
                     bool(use_qk_l2norm), null_slot, out, None, snapshot_slots)
    return out
