"""Python launchers of the shared Triton kernels: tensors and scalars in, named tensors written.

Both GPU backends call these with their own :class:`~.config.LaunchTable`; nothing here allocates
device memory except the commit tables (once per commit context, and the tiny per-group table
when a step brings new index tensors) and packed copies of misaligned token inputs.

The specializations (constexprs and compile options) of the recurrence and the commit are each
built by one function (:func:`recurrence_specialization`, :func:`commit_specialization`) that
``ci/compile_kernels.py`` calls too, so CI compiles exactly what runs.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton

from ...core.backend import CommitLayer, Committer, GateInputs, GroupStep, PendingInputs, RecurrenceCall
from ...core.pointers import PointerEncoding
from ...core.types import conv_history
from . import commit as commit_kernels
from .commit import grouped_commit_kernel, plan_commit_kernel
from .config import CommitSpec, LaunchTable, RecurrenceSpec, interpreting
from .conv import conv_decode_kernel, conv_verify_kernel
from .direct_launch import Bound, DirectLauncher
from .pending import clear_rows_kernel, defer_kernel
from .recurrence import MODE_DECODE, MODE_SNAPSHOT, MODE_VERIFY, recurrence_kernel

MODES = {"verify": MODE_VERIFY.value, "decode": MODE_DECODE.value, "snapshot": MODE_SNAPSHOT.value}
# The launches of every step (conv and the recurrence per layer, one commit for all layers) skip
# Triton's per-call specialization work once compiled, and can be bound to their tensors' addresses
# when the op asks (``bind``; see direct_launch.py).
_RECURRENCE = DirectLauncher(recurrence_kernel)
_GROUPED_COMMIT = DirectLauncher(grouped_commit_kernel)
_CONV_VERIFY = DirectLauncher(conv_verify_kernel)
_CONV_DECODE = DirectLauncher(conv_decode_kernel)
_DEFER = DirectLauncher(defer_kernel)
_CLEAR_ROWS = DirectLauncher(clear_rows_kernel)
INT32_MAX = 2**31 - 1
#: CUDA's limit on a grid's second and third axes: the batch rows (and commit layers) of one launch.
MAX_GRID_YZ = 65535


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _grid_axis(what: str, count: int) -> int:
    if count > MAX_GRID_YZ:
        raise ValueError(f"{what}: {count} exceeds the {MAX_GRID_YZ} one launch of the Triton backends can carry")
    return count


# ------------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------------
def _conv_args(x, conv_state, weight, bias, out):
    return ((x, conv_state, weight, bias if bias is not None else weight, out),
            (x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
             weight.stride(0), weight.stride(1), out.stride(0)))


def _conv_constexprs(table: LaunchTable, width: int, dilation: int, bias, silu) -> tuple[dict, dict]:
    spec = table.conv
    return (dict(WIDTH=width, DILATION=dilation, BD=spec.block, HAS_BIAS=bias is not None, SILU=bool(silu),
                 INTERPRETED=interpreting()),
            table.options(spec.warps))


def conv_verify(table: LaunchTable, x, conv_state, weight, bias, state_indices, query_start_loc,
                silu, dilation, null_slot, out, bind: bool = False,
                pending: Optional[PendingInputs] = None) -> Optional[Bound]:
    dim, width = x.shape[1], weight.shape[1]
    B = state_indices.shape[0]
    replays = pending is not None and pending.rows is not None
    if B == 0 or (x.shape[0] == 0 and not replays):
        return None
    tensors, strides = _conv_args(x, conv_state, weight, bias, out)
    grid = (triton.cdiv(dim, table.conv.block), _grid_axis("conv_verify: state_indices", B))
    rows, plan = (pending.rows, pending.plan) if replays else (state_indices, state_indices)   # unused otherwise
    args = (*tensors, state_indices, query_start_loc, rows, plan, *strides,
            dim, x.shape[0], conv_state.shape[0], null_slot, conv_state.shape[2] - conv_history(width, dilation),
            plan.shape[-1] if replays else 0, int(replays))
    return _CONV_VERIFY(grid, args, *_conv_constexprs(table, width, dilation, bias, silu), bind=bind)


def conv_decode(table: LaunchTable, x, conv_state, weight, bias, state_indices, silu, dilation, null_slot,
                out, bind: bool = False) -> Optional[Bound]:
    dim, width = x.shape[1], weight.shape[1]
    B = state_indices.shape[0]
    if B == 0:
        return None
    tensors, strides = _conv_args(x, conv_state, weight, bias, out)
    grid = (triton.cdiv(dim, table.conv.block), _grid_axis("conv_decode: state_indices", B))
    args = (*tensors, state_indices, *strides, dim, conv_state.shape[0], null_slot)
    return _CONV_DECODE(grid, args, *_conv_constexprs(table, width, dilation, bias, silu), bind=bind)


# ------------------------------------------------------------------------------------------------
# the recurrence
# ------------------------------------------------------------------------------------------------
def _rows_aligned(t: torch.Tensor) -> bool:
    """Every row (last dim) of ``t`` starts on a 16-byte boundary."""
    if t.data_ptr() % 16:
        return False
    vec = 16 // t.element_size()
    for s in t.stride()[:-1]:
        if s % vec:
            return False
    return True


def _aligned_token_inputs(q, k, v, out):
    """Return ``(q, k, v, kernel_out, aligned)`` such that every call with the same shapes and
    dtypes compiles to the same kernel: inputs whose rows are not 16-byte aligned are copied into
    packed tensors (small next to the state), and a misaligned ``out`` is written through a packed
    copy of itself (so that tokens no row covers keep their values when it is copied back).
    ``aligned`` is False only where packing cannot align rows (odd head sizes)."""
    q, k, v = (t if _rows_aligned(t) else t.contiguous() for t in (q, k, v))
    kernel_out = out if _rows_aligned(out) else out.clone(memory_format=torch.contiguous_format)
    aligned = all(_rows_aligned(t) for t in (q, k, v, kernel_out))
    return q, k, v, kernel_out, aligned


MAX_LANES_K = 16


class RecurrenceTile(NamedTuple):
    """The recurrence kernel's tile for one call: ``[row_lanes, rows, k_inner, k_pad / k_inner]``,
    and the register cap it compiles with."""
    k_pad: int
    k_inner: int
    rows: int
    row_lanes: int
    max_registers: Optional[int] = None

    @property
    def block_v(self) -> int:
        return self.rows * self.row_lanes


def recurrence_tile(spec: RecurrenceSpec, K: int, V: int, heads_times_rows: Optional[int] = None) -> RecurrenceTile:
    """Fit the spec's lanes along K and rows per thread to the problem: K is padded to a power of
    two (at least 4), 4 elements per lane along K (16-byte fp32 loads), and no more rows than V
    has. ``heads_times_rows`` (``HV x`` batch rows of the call) selects fewer rows per thread when
    the grid would have fewer than ``spec.small_grid_programs`` programs. The lanes along K, and
    with them every row's arithmetic, stay the same: each row's reductions over K are one chain of
    fused multiply-adds per thread in a fixed order, then the same lanes (recurrence.py), so the
    rows a thread holds never change a bit (tested: ``test_rows_per_thread_do_not_change_the_bits``)."""
    k_pad = max(4, _pow2(K))
    # At most 16 lanes along K, so a warp always has at least 2 row lanes: with all 32 lanes along
    # K (one row lane) the H200 build's committed state differed from native decode in the last
    # bit (2.7% of elements, Triton 3.6; docs/DESIGN.md), and that tile was also the slowest.
    lanes_k = max(1, min(spec.lanes_k, MAX_LANES_K, k_pad // 4))
    k_inner = min(4 * lanes_k, k_pad)
    row_lanes = (32 // lanes_k) * spec.warps
    rows = max(1, min(spec.rows, _pow2(V) // row_lanes))
    max_registers = None
    if (heads_times_rows is not None and rows > spec.small_grid_rows
            and triton.cdiv(V, rows * row_lanes) * heads_times_rows < spec.small_grid_programs):
        rows, max_registers = max(1, spec.small_grid_rows), spec.small_grid_max_registers
    return RecurrenceTile(k_pad, k_inner, rows, row_lanes, max_registers)


_SPECIALIZATIONS: dict = {}


def recurrence_specialization(table: LaunchTable, state_dtype: torch.dtype, H: int, HV: int, K: int, V: int,
                              state_row_stride: int, gates: GateInputs, use_qk_l2norm: bool, aligned: bool,
                              heads_times_rows: Optional[int] = None, replay: bool = False,
                              round_each_token: bool = True) -> tuple[RecurrenceTile, dict, dict]:
    """The recurrence kernel's ``(tile, constexprs, compile options)`` for one call. Nothing in
    it depends on the mode (verify, decode, snapshot), so the three modes run one binary;
    ``replay`` (a verify that replays a pending step first) compiles the replay in, a binary of
    its own (in every other binary the replay's code would cost registers: bf16 pools then
    spilled, and their verify, decode and snapshot ran 15% slower). Remembered per argument
    (every call asks; the answer is a few dicts)."""
    interpreted = interpreting()
    round_each_token = rounds_each_token(state_dtype, round_each_token)
    key = (id(table), state_dtype, H, HV, K, V, state_row_stride, gates.kind, gates.precomputed,
           gates.lower_bound is None, use_qk_l2norm, aligned, heads_times_rows, interpreted, replay, round_each_token,
           *_mamba2_flags(gates).values())
    hit = _SPECIALIZATIONS.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    answer = _specialize_recurrence(table, state_dtype, H, HV, K, V, state_row_stride, gates, use_qk_l2norm, aligned,
                                    heads_times_rows, interpreted, replay, round_each_token)
    if len(_SPECIALIZATIONS) > 256:
        _SPECIALIZATIONS.clear()
    _SPECIALIZATIONS[key] = (table, answer)
    return answer


def _mamba2_flags(gates: GateInputs) -> dict:
    """The constexprs of Mamba2's optional inputs (all false for the other families)."""
    mamba2 = gates.kind == "mamba2"
    has_d = mamba2 and gates.D is not None
    return dict(MAMBA2=mamba2, A_GIVEN=mamba2 and gates.A is not None, DT_LIMIT=mamba2 and gates.dt_limit is not None,
                HAS_D=has_d, D_PER_CHANNEL=has_d and gates.D.dim() == 2, HAS_Z=mamba2 and gates.z is not None)


def _specialize_recurrence(table: LaunchTable, state_dtype: torch.dtype, H: int, HV: int, K: int, V: int,
                           state_row_stride: int, gates: GateInputs, use_qk_l2norm: bool, aligned: bool,
                           heads_times_rows: Optional[int], interpreted: bool, replay: bool,
                           round_each_token: bool) -> tuple[RecurrenceTile, dict, dict]:
    spec = table.recurrence_for(state_dtype)
    tile = recurrence_tile(spec, K, V, heads_times_rows)
    constexprs = dict(
        H=H, HV=HV, K=K, V=V, STRIDE_S_V=state_row_stride, K_PAD=tile.k_pad, K_INNER=tile.k_inner, ROWS=tile.rows,
        ROW_LANES=tile.row_lanes, GATES_PRECOMPUTED=gates.precomputed, USE_L2NORM=bool(use_qk_l2norm),
        ALIGNED=aligned, PTX_WIDEN_BF16=spec.ptx_widen_bf16 and not interpreted,   # PTX: never interpreted
        L2_HINTS=spec.l2_hints, VECTOR_DECAY=gates.vector_decay,
        LOWER_BOUND=gates.lower_bound is not None and not gates.precomputed, INTERPRETED=interpreted,
        REPLAY=replay, ROUND_EACH_TOKEN=round_each_token, **_mamba2_flags(gates))
    return tile, constexprs, table.options(spec.warps, tile.max_registers)


def recurrence(table: LaunchTable, call: RecurrenceCall, bind: bool = False) -> Optional[Bound]:
    """Launch the recurrence (:class:`~recoverssm.core.backend.RecurrenceCall`); with ``bind``,
    return the launch bound to the caller's tensors' addresses (``None`` where it launched on
    packed copies of misaligned tensors, or did not launch)."""
    q, k, v, out, aligned = _aligned_token_inputs(call.q, call.k, call.v, call.out)
    packed = (q, k, v, out)
    same = all(x is y for x, y in zip(packed, (call.q, call.k, call.v, call.out)))
    launch = _launch_recurrence(table, call if same else call.replace(q=q, k=k, v=v, out=out), aligned, bind)
    if out is not call.out:
        call.out.copy_(out)
    return launch if same else None


def _launch_recurrence(table: LaunchTable, call: RecurrenceCall, aligned: bool,
                       bind: bool = False) -> Optional[Bound]:
    mode, q, k, v, state, gates, out = call.mode, call.q, call.k, call.v, call.state, call.gates, call.out
    records, snapshot_slots, pending = call.records, call.snapshot_slots, call.pending
    state_indices = call.state_indices
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = state_indices.shape[0]
    replay = mode == "verify" and pending is not None and pending.rows is not None
    if B == 0 or (T == 0 and not replay):
        return None
    tile, constexprs, options = recurrence_specialization(table, state.dtype, H, HV, K, V, state.stride(2), gates,
                                                          call.use_qk_l2norm, aligned, HV * B, replay,
                                                          call.round_each_token)
    plan_rows = record_rows = 0
    plan = parity = rows = state_indices                # unused without a pending step
    if mode == "verify":
        corr, key, decay = records
        max_window = corr.shape[2]
        if pending is not None:
            plan, parity = pending.plan, pending.parity
            plan_rows, record_rows = plan.shape[2], corr.shape[0] // 2
            if replay:
                rows = pending.rows
    else:
        corr = key = decay = out           # unused by these modes; any valid pointer will do
        max_window = snapshot_slots.shape[1] if mode == "snapshot" else INT32_MAX
    snap = snapshot_slots if snapshot_slots is not None else state_indices
    if gates.precomputed:
        a, b, A_log, dt_bias = gates.g, gates.beta, gates.g, gates.g
    elif gates.kind == "mamba2":     # no beta; A_log's pointer carries A where A is given (A_GIVEN)
        a, b, dt_bias = gates.a, gates.a, gates.dt_bias
        A_log = gates.A if gates.A is not None else gates.A_log
    else:
        a, b, A_log, dt_bias = gates.a, gates.b, gates.A_log, gates.dt_bias
    lower_bound = gates.lower_bound if gates.lower_bound is not None else 0.0
    dt_min, dt_max = gates.dt_limit if gates.dt_limit is not None else (0.0, 0.0)
    D = gates.D if gates.D is not None else dt_bias          # any valid pointer where unused
    z = gates.z if gates.z is not None else out
    grid = (triton.cdiv(V, tile.block_v), HV, _grid_axis(f"{mode}: state_indices", B))
    args = (q, k, v, a, b, A_log, dt_bias, D, z, out, state, state_indices, call.query_start_loc,
            corr, key, decay, snap, rows, plan, parity,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), a.stride(1), b.stride(0), z.stride(0), z.stride(1), out.stride(0), out.stride(1),
            state.stride(0), state.stride(1), snap.stride(0),
            T, state.shape[0], call.null_slot, max_window, call.scale, lower_bound, dt_min, dt_max, MODES[mode],
            plan_rows, record_rows)
    return _RECURRENCE(grid, args, constexprs, options, bind=bind)


# ------------------------------------------------------------------------------------------------
# the plan and the commit
# ------------------------------------------------------------------------------------------------
def plan_commit(table: LaunchTable, num_accepted, state_indices, query_start_loc, request_indices,
                block_table, num_computed_tokens, block_size, null_slot, num_slots, out) -> None:
    B = state_indices.shape[0]
    if B == 0:
        return
    commit_len, final, boundary, boundary_len = out
    align = block_table is not None
    plan_commit_kernel[(triton.cdiv(B, table.plan_block),)](
        num_accepted, query_start_loc, state_indices,
        request_indices if request_indices is not None else state_indices,
        block_table if align else state_indices,
        num_computed_tokens if align else state_indices,
        commit_len, final, boundary, boundary_len,
        B, int(request_indices is not None), int(align),
        block_table.stride(0) if align else 0, block_table.shape[1] if align else 1,
        block_size if align else 1, num_accepted.shape[0], null_slot, min(num_slots, INT32_MAX),
        INT32_MAX, BLOCK=table.plan_block, **table.options(4))


_TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _vector_aligned(layer: CommitLayer) -> bool:
    """True when every row of every state and record tile starts on a 16-byte boundary, so the
    commit kernel may use 16-byte vector accesses (it is told so through ``tl.multiple_of``)."""
    st = layer.state
    vec = 16 // st.element_size()
    return (st.data_ptr() % 16 == 0 and all(s % vec == 0 for s in st.stride()[:3])
            and all(t.data_ptr() % 16 == 0 for t in (layer.correction, layer.key))
            and layer.correction.shape[3] % 4 == 0 and layer.key.shape[3] % 4 == 0)


def rounds_each_token(state_dtype: torch.dtype, round_each_token: bool) -> bool:
    """The ``ROUND_EACH_TOKEN`` constexpr: the mode matters for pools narrower than fp32 only, so
    fp32 pools run one binary (and one commit launch) whatever their layers' modes."""
    return bool(round_each_token) and state_dtype != torch.float32


def _specialization_key(layer: CommitLayer) -> tuple:
    """What one commit launch's specialization depends on: layers that agree share a launch."""
    return (layer.state.dtype, layer.key.shape[1], layer.correction.shape[1], layer.key.shape[3],
            layer.correction.shape[3], layer.vector_decay, rounds_each_token(layer.state.dtype, layer.round_each_token))


class _Launch:
    """One launch of the grouped commit: a set of layers with one specialization and its table."""

    def __init__(self, committer: "TritonCommitter", layers: Sequence[CommitLayer]):
        first = layers[0]
        self.layers = list(layers)
        self.state_dtype = _TORCH_TO_TRITON[first.state.dtype]
        self.H, self.HV = first.key.shape[1], first.correction.shape[1]
        self.K, self.V = first.key.shape[3], first.correction.shape[3]
        self.vector_decay = first.vector_decay
        self.round_each_token = rounds_each_token(first.state.dtype, first.round_each_token)
        conv_layers = [layer for layer in layers if layer.conv_state is not None]
        conv_dtypes = {layer.conv_state.dtype for layer in conv_layers}
        if len(conv_dtypes) > 1:
            raise ValueError(f"CommitContext: conv states have several dtypes {sorted(map(str, conv_dtypes))}; "
                             "the Triton commit needs one per launch")
        self.conv_dtype = _TORCH_TO_TRITON[conv_dtypes.pop()] if conv_dtypes else "fp32"
        self.conv_cols = _pow2(max((layer.conv_history for layer in conv_layers), default=1))
        self.max_conv_dim = max((layer.conv_state.shape[1] for layer in conv_layers), default=0)
        self.aligned = all(_vector_aligned(layer) for layer in layers)
        rows = []
        for layer in layers:
            st, cs = layer.state, layer.conv_state
            rows.append([
                st.data_ptr(), st.stride(0), st.stride(1), st.stride(2), st.shape[0],
                layer.correction.data_ptr(), layer.key.data_ptr(), layer.decay.data_ptr(),
                layer.correction.shape[2],
                cs.data_ptr() if cs is not None else 0,
                cs.stride(0) if cs is not None else 0, cs.stride(1) if cs is not None else 0,
                cs.stride(2) if cs is not None else 0, cs.shape[1] if cs is not None else 0,
                layer.conv_history, layer.group,
                layer.correction.shape[0] // 2 if layer.record_buffers == 2 else 0])
        self.layer_table, self.host_table = committer.upload(rows, commit_kernels.LAYER_FIELDS.value,
                                                             commit_kernels.LAYER_POINTER_COLUMNS)
        table = committer.table
        tile_items, self.constexprs, self.options = commit_specialization(
            table.commit_for(first.state.dtype, self.V), table, self.state_dtype, self.conv_dtype, self.H, self.HV,
            self.K, self.V, self.conv_cols, self.aligned, self.vector_decay, self.round_each_token)
        self.items = tile_items + triton.cdiv(self.max_conv_dim, table.conv.block)


class TritonCommitter(Committer):
    """Grouped commit through device pointer tables: one launch per specialization (state dtype,
    head sizes, scalar or vector decay, rounding mode; one launch for a model whose layers all
    agree).

    The per-layer tables (pointers and strides of state, records and conv state) are built and
    uploaded once, here. The per-group table points at the step's index tensors; it is cached by
    those tensors' layouts, so an engine that reuses persistent index buffers (as it must under
    CUDA graphs) uploads it once and then launches nothing but the commit kernel. A bound step
    (``bind``) holds the group table it points at.
    """

    def __init__(self, table: LaunchTable, encoding: PointerEncoding, device_guard, launch_on,
                 layers: Sequence[CommitLayer], num_groups: int, max_batch: int, null_slot: int):
        self.device_guard = device_guard
        self.launch_on = launch_on
        self.encoding = encoding
        self.null_slot = null_slot
        self.num_groups = num_groups
        self.device = layers[0].state.device
        self.table = table
        self._keepalive = list(layers)
        by_key: dict = {}
        for layer in layers:
            by_key.setdefault(_specialization_key(layer), []).append(layer)
        self.launches = [_Launch(self, members) for members in by_key.values()]
        for launch in self.launches:
            _grid_axis("CommitContext: layers of one specialization", len(launch.layers))
        self._group_key = None
        self._group_table = None
        self._group_host = None

    def upload(self, rows, fields: int, pointer_columns) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode a table on the host (pointer columns with the backend's encoding) and copy it
        over: ``(device table, host table)``. Callers keep the pinned host copy as long as the
        device one: an upload made while a CUDA graph is captured becomes a copy node that reads
        it again at every replay."""
        flat = []
        for r in rows:
            for j, value in enumerate(r):
                flat.append((j in pointer_columns, int(value)))
        pointers = self.encoding.encode([value for is_ptr, value in flat if is_ptr])
        plain = torch.tensor([value for is_ptr, value in flat if not is_ptr], dtype=torch.int64)
        table = torch.empty(len(flat), dtype=torch.int64)
        is_ptr = torch.tensor([p for p, _ in flat], dtype=torch.bool)
        table[is_ptr] = pointers
        table[~is_ptr] = plain
        table = table.view(len(rows), fields)
        if self.device.type == "cpu":
            return table, table
        host = table.pin_memory()
        return host.to(self.device, non_blocking=True), host

    def _group_table_for(self, groups: Sequence[GroupStep]) -> torch.Tensor:
        rows = []
        for i, g in enumerate(groups):
            bt = g.block_table
            first = next(layer for layer in self._keepalive if layer.group == i)   # a deferring group's own
            rows.append([
                g.state_indices.data_ptr(),
                g.request_indices.data_ptr() if g.request_indices is not None else 0,
                bt.data_ptr() if bt is not None else 0,
                bt.stride(0) if bt is not None else 0,
                bt.shape[1] if bt is not None else 1,
                g.num_computed_tokens.data_ptr() if bt is not None else 0,
                g.block_size if bt is not None else 1,
                first.state.shape[0], first.correction.shape[2]])
        key = tuple(map(tuple, rows))
        if key != self._group_key:
            self._group_table, self._group_host = self.upload(rows, commit_kernels.GROUP_FIELDS.value,
                                                              commit_kernels.GROUP_POINTER_COLUMNS)
            self._group_key = key
        return self._group_table

    def commit(self, num_accepted, query_start_loc, groups: Sequence[GroupStep], *, bind: bool = False):
        B = groups[0].state_indices.shape[0]
        if B == 0:
            return None
        _grid_axis("CommitContext.commit: state_indices", B)
        with self.device_guard(self.device):
            launches = self._launch_args(num_accepted, query_start_loc, groups, B)
            bound = [_GROUPED_COMMIT(*args, bind=bind) for args in launches]
        if not bind or not all(bound):
            return None
        return self.launch_on(self.device, _BoundStep(bound, (self._group_table, self._group_host)))

    def _launch_args(self, num_accepted, query_start_loc, groups: Sequence[GroupStep], B: int) -> list[tuple]:
        """``(grid, runtime arguments, constexprs, options)`` of each launch of one step."""
        group_table = self._group_table_for(groups)
        unused = num_accepted        # the plan, parity and rows a flush reads
        return [((launch.items, B, len(launch.layers)),
                 (launch.layer_table, group_table, num_accepted, query_start_loc, unused, unused, unused,
                  num_accepted.shape[0], self.null_slot, 0),
                 launch.constexprs, launch.options) for launch in self.launches]

    def defer(self, plan, parity, num_accepted, query_start_loc, groups: Sequence[GroupStep], *, bind: bool = False):
        B, G, plan_rows = groups[0].state_indices.shape[0], plan.shape[0], plan.shape[2]
        with self.device_guard(self.device):
            group_table = self._group_table_for(groups)
            block = self.table.plan_block
            bound = _DEFER((triton.cdiv(plan_rows, block), G),
                           (group_table, num_accepted, query_start_loc, plan, parity, B, plan_rows,
                            num_accepted.shape[0], self.null_slot),
                           dict(BLOCK=block), self.table.options(4), bind=bind)
        if not bind or bound is None:
            return None
        return self.launch_on(self.device, _BoundStep([bound], (self._group_table, self._group_host)))

    def flush(self, plan, parity, rows, *, bind: bool = False):
        R = rows.shape[0]
        if R == 0:
            return None
        _grid_axis("CommitContext.flush: rows", R)
        with self.device_guard(self.device):
            launches = [((launch.items, R, len(launch.layers)),
                         (launch.layer_table, launch.layer_table, rows, rows, plan, parity, rows, 0, self.null_slot,
                          plan.shape[2]),
                         {**launch.constexprs, "FLUSH": True}, launch.options) for launch in self.launches]
            bound = [_GROUPED_COMMIT(*args, bind=bind) for args in launches]
            block = self.table.plan_block
            bound.append(_CLEAR_ROWS((triton.cdiv(R, block),), (plan, rows, R, plan.shape[2], plan.shape[0],
                                                                 self.null_slot),
                                     dict(BLOCK=block), self.table.options(4), bind=bind))
        if not bind or not all(bound):
            return None
        return self.launch_on(self.device, _BoundStep(bound, ()))


class _BoundStep:
    """A commit step's launches (a commit, a defer or a flush) bound to its tensors' addresses.
    It holds the group table they point at (and its pinned host copy), whatever table later
    steps upload."""

    __slots__ = ("launches", "tables")

    def __init__(self, launches: list, tables: tuple):
        self.launches, self.tables = launches, tables

    def __call__(self) -> bool:
        if not self.launches[0]():       # nothing launched: the caller takes the op path
            return False
        for launch in self.launches[1:]:     # the same launcher as the first: it launches these too
            if not launch():
                raise RuntimeError("CommitContext: a bound step launched only part of its launches")
        return True


def commit_specialization(spec: CommitSpec, table: LaunchTable, state_dtype: str, conv_dtype: str, H: int, HV: int,
                          K: int, V: int, conv_cols: int, aligned: bool,
                          vector_decay: bool = False, round_each_token: bool = True) -> tuple[int, dict, dict]:
    """The grouped commit kernel's specialization for one launch: ``(work items of state tiles
    per row and layer, constexprs, compile options)``."""
    block_v = min(spec.block_v, _pow2(V))
    tiles = HV * triton.cdiv(V, block_v)
    tiles_per_program = max(1, min(spec.tiles_per_program, tiles))
    interpreted = interpreting()
    constexprs = dict(H=H, HV=HV, K=K, V=V, K_PAD=_pow2(K), BV=block_v, BD=table.conv.block, CONV_COLS=conv_cols,
                      STATE_DTYPE=_dtype(state_dtype), CONV_DTYPE=_dtype(conv_dtype), ALIGNED=aligned,
                      TILES_PER_PROGRAM=tiles_per_program,
                      # The hints are PTX, which Triton's interpreter cannot run.
                      PREFETCH_RECORDS=spec.prefetch_records and not interpreted,
                      PREFETCH_NEXT_TILE=spec.prefetch_next_tile and tiles_per_program > 1 and not interpreted,
                      REPLAY_PAIRS=spec.replay_pairs, VECTOR_DECAY=vector_decay, FLUSH=False, INTERPRETED=interpreted,
                      ROUND_EACH_TOKEN=round_each_token,
                      PTX_ROUND_BF16=spec.ptx_round_bf16 and not interpreted)
    return triton.cdiv(tiles, tiles_per_program), constexprs, table.options(spec.warps, spec.max_registers)


def _dtype(name: str):
    import triton.language as tl
    return {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[name]
