"""Python launchers of the shared Triton kernels: tensors and scalars in, named tensors written.

Both GPU backends call these with their own :class:`LaunchConfig` table; nothing here allocates
device memory except the commit tables (once per commit context, and the tiny per-group table
when a step brings new index tensors).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton

from ...core.backend import CommitLayer, Committer, GateInputs, GroupStep
from ...core.pointers import PointerEncoding
from . import commit as commit_kernels
from .config import LaunchConfig, interpreting  # noqa: F401  (re-exported)
from .commit import grouped_commit_kernel, plan_commit_kernel
from .conv import conv_verify_kernel
from .direct_launch import DirectLauncher
from .gdn import MODE_DECODE, MODE_SNAPSHOT, MODE_VERIFY, gdn_recurrent_kernel

MODES = {"verify": MODE_VERIFY.value, "decode": MODE_DECODE.value, "snapshot": MODE_SNAPSHOT.value}
# The two launches on every speculative step (verify per layer, one commit for all layers) skip
# Triton's per-call specialization work once compiled (see direct_launch.py).
_RECURRENCE = DirectLauncher(gdn_recurrent_kernel)
_GROUPED_COMMIT = DirectLauncher(grouped_commit_kernel)
INT32_MAX = 2**31 - 1


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def conv_verify(cfg: LaunchConfig, x, conv_state, weight, bias, state_indices, query_start_loc,
                silu, null_slot, out) -> None:
    dim = x.shape[1]
    width = weight.shape[1]
    window = conv_state.shape[2] - (width - 1)
    B = state_indices.shape[0]
    if B == 0 or x.shape[0] == 0:
        return
    grid = (triton.cdiv(dim, cfg.conv_block), B)
    conv_verify_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, state_indices, query_start_loc,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0),
        dim, x.shape[0], conv_state.shape[0], null_slot, window,
        WIDTH=width, BD=cfg.conv_block, HAS_BIAS=bias is not None, SILU=bool(silu),
        **cfg.options(cfg.conv_warps))


def _rows_aligned(t: torch.Tensor) -> bool:
    """Every row (last dim) of ``t`` starts on a 16-byte boundary."""
    vec = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1])


def _aligned_token_inputs(q, k, v, out):
    """Return ``(q, k, v, kernel_out, aligned)`` such that every call with the same shapes and
    dtypes compiles to the same kernel: inputs whose rows are not 16-byte aligned are copied into
    packed tensors (small next to the state), and a misaligned ``out`` is written through a packed
    buffer. ``aligned`` is False only where packing cannot align rows (odd head sizes)."""
    q, k, v = (t if _rows_aligned(t) else t.contiguous() for t in (q, k, v))
    kernel_out = out if _rows_aligned(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
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


def recurrence_tile(cfg: LaunchConfig, K: int, V: int, heads_times_rows: Optional[int] = None) -> RecurrenceTile:
    """Fit the configured lanes along K and rows per thread to the problem: K is padded to a power
    of two (at least 4), 4 elements per lane along K (16-byte fp32 loads), and no more rows than V
    has. ``heads_times_rows`` (``HV x`` batch rows of the call) selects fewer rows per thread when
    the grid would have fewer than ``cfg.gdn_small_grid_programs`` programs. The lanes along K, and
    with them every row's arithmetic, stay the same: each row's reductions over K are one chain of
    fused multiply-adds per thread in a fixed order, then the same lanes (gdn.py), so the rows a thread
    holds never change a bit (tested: ``test_rows_per_thread_do_not_change_the_bits``)."""
    k_pad = max(4, _pow2(K))
    # At most 16 lanes along K, so a warp always has at least 2 row lanes: with all 32 lanes along
    # K (one row lane) the H200 build's committed state differed from native decode in the last
    # bit (2.7% of elements, Triton 3.6; docs/DESIGN.md), and that tile was also the slowest.
    lanes_k = max(1, min(cfg.gdn_lanes_k, MAX_LANES_K, k_pad // 4))
    k_inner = min(4 * lanes_k, k_pad)
    row_lanes = (32 // lanes_k) * cfg.gdn_warps
    rows = max(1, min(cfg.gdn_rows, _pow2(V) // row_lanes))
    max_registers = cfg.gdn_max_registers
    if (heads_times_rows is not None and rows > cfg.gdn_small_grid_rows
            and triton.cdiv(V, rows * row_lanes) * heads_times_rows < cfg.gdn_small_grid_programs):
        rows, max_registers = max(1, cfg.gdn_small_grid_rows), cfg.gdn_small_grid_max_registers
    return RecurrenceTile(k_pad, k_inner, rows, row_lanes, max_registers)


def ptx_widening(cfg: LaunchConfig, state_dtype: torch.dtype) -> bool:
    """Whether the recurrence widens bf16 token inputs with PTX (``numerics.to_fp32``): where the
    launch table asks for it and the state is fp32 (over bf16 states the default tile spilled),
    never under Triton's interpreter."""
    return cfg.gdn_ptx_widen_bf16 and state_dtype == torch.float32 and not interpreting()


def gdn_recurrent(cfg: LaunchConfig, mode: str, q, k, v, state, state_indices, query_start_loc,
                  gates: GateInputs, scale: float, use_qk_l2norm: bool, null_slot: int, out,
                  records, snapshot_slots) -> None:
    q, k, v, kernel_out, aligned = _aligned_token_inputs(q, k, v, out)
    _launch_recurrent(cfg, mode, q, k, v, state, state_indices, query_start_loc, gates, scale,
                      use_qk_l2norm, null_slot, kernel_out, records, snapshot_slots, aligned)
    if kernel_out is not out:
        out.copy_(kernel_out)


def _launch_recurrent(cfg: LaunchConfig, mode: str, q, k, v, state, state_indices, query_start_loc,
                      gates: GateInputs, scale: float, use_qk_l2norm: bool, null_slot: int, out,
                      records, snapshot_slots, aligned: bool) -> None:
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = state_indices.shape[0]
    if B == 0 or T == 0:
        return
    tile = recurrence_tile(cfg, K, V, HV * B)
    if mode == "verify":
        corr, key, decay = records
        max_window = corr.shape[2]
    else:
        corr = key = decay = out           # unused by these modes; any valid pointer will do
        max_window = snapshot_slots.shape[1] if mode == "snapshot" else INT32_MAX
    snap = snapshot_slots if snapshot_slots is not None else state_indices
    if gates.precomputed:
        a, b, A_log, dt_bias = gates.g, gates.beta, gates.g, gates.g
    else:
        a, b, A_log, dt_bias = gates.a, gates.b, gates.A_log, gates.dt_bias
    grid = (triton.cdiv(V, tile.block_v), HV, B)
    _RECURRENCE(
        grid,
        (q, k, v, a, b, A_log, dt_bias, out, state, state_indices, query_start_loc,
         corr, key, decay, snap,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         a.stride(0), b.stride(0), out.stride(0), out.stride(1),
         state.stride(0), state.stride(1), snap.stride(0),
         T, state.shape[0], null_slot, max_window, scale, MODES[mode]),
        dict(H=H, HV=HV, K=K, V=V, STRIDE_S_V=state.stride(2), K_PAD=tile.k_pad, K_INNER=tile.k_inner, ROWS=tile.rows,
             ROW_LANES=tile.row_lanes, GATES_PRECOMPUTED=gates.precomputed,
             USE_L2NORM=bool(use_qk_l2norm), ALIGNED=aligned,
             PTX_WIDEN_BF16=ptx_widening(cfg, state.dtype), L2_HINTS=cfg.gdn_l2_hints),
        cfg.options(cfg.gdn_warps, cfg.gdn_stages, tile.max_registers))


def plan_commit(cfg: LaunchConfig, num_accepted, state_indices, query_start_loc, request_indices,
                block_table, num_computed_tokens, block_size, null_slot, num_slots, out) -> None:
    B = state_indices.shape[0]
    if B == 0:
        return
    commit_len, final, boundary, boundary_len = out
    align = block_table is not None
    plan_commit_kernel[(triton.cdiv(B, cfg.plan_block),)](
        num_accepted, query_start_loc, state_indices,
        request_indices if request_indices is not None else state_indices,
        block_table if align else state_indices,
        num_computed_tokens if align else state_indices,
        commit_len, final, boundary, boundary_len,
        B, int(request_indices is not None), int(align),
        block_table.stride(0) if align else 0, block_table.shape[1] if align else 1,
        block_size if align else 1, num_accepted.shape[0], null_slot, min(num_slots, INT32_MAX),
        INT32_MAX, BLOCK=cfg.plan_block, **cfg.options(4))


_TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class TritonCommitter(Committer):
    """Grouped commit in one launch through device pointer tables.

    The per-layer table (pointers and strides of state, records and conv state) is built and
    uploaded once, here. The per-group table points at the step's index tensors; it is cached by
    those tensors' addresses, so an engine that reuses persistent index buffers (as it must under
    CUDA graphs) uploads it once and then launches nothing but the commit kernel.
    """

    def __init__(self, cfg: LaunchConfig, encoding: PointerEncoding, device_guard,
                 layers: Sequence[CommitLayer], num_groups: int, max_batch: int, null_slot: int):
        self.device_guard = device_guard
        self.encoding = encoding
        self.null_slot = null_slot
        self.num_groups = num_groups
        first = layers[0]
        self.H, self.HV = first.key.shape[1], first.correction.shape[1]
        self.K, self.V = first.key.shape[3], first.correction.shape[3]
        self.device = first.state.device
        for i, layer in enumerate(layers):
            dims = (layer.key.shape[1], layer.correction.shape[1], layer.key.shape[3], layer.correction.shape[3])
            if dims != (self.H, self.HV, self.K, self.V):
                raise ValueError(f"CommitContext: layer {i} has (H, HV, K, V) = {dims}; the Triton commit "
                                 f"needs every layer alike, layer 0 has {(self.H, self.HV, self.K, self.V)}")
            if layer.state.dtype != first.state.dtype:
                raise ValueError(f"CommitContext: layer {i} state is {layer.state.dtype}, layer 0 is "
                                 f"{first.state.dtype}; the Triton commit needs one state dtype")
            if layer.decay.dim() != 3:
                raise ValueError(f"CommitContext: layer {i} records a vector decay; the Triton commit "
                                 "supports the scalar decay (GDN) only")
        conv_layers = [l for l in layers if l.conv_state is not None]
        conv_dtypes = {l.conv_state.dtype for l in conv_layers}
        if len(conv_dtypes) > 1:
            raise ValueError(f"CommitContext: conv states have several dtypes {sorted(map(str, conv_dtypes))}; "
                             "the Triton commit needs one")
        self.state_dtype = _TORCH_TO_TRITON[first.state.dtype]
        self.conv_dtype = _TORCH_TO_TRITON[conv_dtypes.pop()] if conv_dtypes else "fp32"
        self.conv_cols = _pow2(max((l.conv_history for l in conv_layers), default=1))
        self.max_conv_dim = max((l.conv_state.shape[1] for l in conv_layers), default=0)
        self.num_layers = len(layers)
        self.aligned = all(_vector_aligned(l) for l in layers)
        self._keepalive = list(layers)
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
                layer.conv_history, layer.group])
        self.layer_table = self._upload(rows, (commit_kernels.LAYER_FIELDS.value,), pointer_columns=commit_kernels.LAYER_POINTER_COLUMNS)
        self.set_config(cfg)
        self._group_key = None
        self._group_table = None
        self._group_steps = None

    def set_config(self, cfg: LaunchConfig) -> None:
        """Fix the launch for ``cfg``: everything but the step's tensors is constant for the
        context, so each commit reuses it (benchmarks/tune_commit.py switches configs here)."""
        self.cfg = cfg
        tile_items, self.constexprs, self.options = commit_specialization(
            cfg, self.state_dtype, self.conv_dtype, self.H, self.HV, self.K, self.V, self.conv_cols, self.aligned)
        self.items = tile_items + triton.cdiv(self.max_conv_dim, cfg.conv_block)
        self._repeat = None

    def _upload(self, rows, shape, pointer_columns) -> torch.Tensor:
        """Encode a table on the host (pointer columns with the backend's encoding) and copy it over."""
        flat = []
        for r in rows:
            for j, v in enumerate(r):
                flat.append((j in pointer_columns, int(v)))
        pointers = self.encoding.encode([v for is_ptr, v in flat if is_ptr])
        plain = torch.tensor([v for is_ptr, v in flat if not is_ptr], dtype=torch.int64)
        table = torch.empty(len(flat), dtype=torch.int64)
        is_ptr = torch.tensor([p for p, _ in flat], dtype=torch.bool)
        table[is_ptr] = pointers
        table[~is_ptr] = plain
        table = table.view(len(rows), *shape)
        if self.device.type == "cpu":
            return table
        return table.pin_memory().to(self.device, non_blocking=True)

    def _group_table_for(self, groups: Sequence[GroupStep]) -> torch.Tensor:
        if groups is self._group_steps:      # CommitContext passes back the steps it checked last
            return self._group_table
        rows = []
        for g in groups:
            bt = g.block_table
            rows.append([
                g.state_indices.data_ptr(),
                g.request_indices.data_ptr() if g.request_indices is not None else 0,
                bt.data_ptr() if bt is not None else 0,
                bt.stride(0) if bt is not None else 0,
                bt.shape[1] if bt is not None else 1,
                g.num_computed_tokens.data_ptr() if bt is not None else 0,
                g.block_size if bt is not None else 1])
        key = tuple(map(tuple, rows))
        if key != self._group_key:
            self._group_table = self._upload(rows, (commit_kernels.GROUP_FIELDS.value,), pointer_columns=commit_kernels.GROUP_POINTER_COLUMNS)
            self._group_key = key
        self._group_steps = groups
        return self._group_table

    def commit(self, num_accepted, query_start_loc, groups: Sequence[GroupStep]) -> None:
        B = groups[0].state_indices.shape[0]
        if B == 0:
            return
        with self.device_guard(self.device):
            _GROUPED_COMMIT(*self._launch_args(num_accepted, query_start_loc, groups, B))

    def commit_again(self, num_accepted, query_start_loc, groups: Sequence[GroupStep]) -> None:
        # The step's tensors are those of the last call, unchanged but for their values: the
        # launch bound to them last time is still right (only the stream is read again).
        repeat = self._repeat
        if repeat is not None and repeat[0] is groups and repeat[1] is num_accepted and repeat[2] is query_start_loc:
            with self.device_guard(self.device):
                repeat[3]()
            return
        self.commit(num_accepted, query_start_loc, groups)
        B = groups[0].state_indices.shape[0]
        launch = _GROUPED_COMMIT.bind(*self._launch_args(num_accepted, query_start_loc, groups, B)) if B else None
        self._repeat = (groups, num_accepted, query_start_loc, launch) if launch is not None else None

    def _launch_args(self, num_accepted, query_start_loc, groups: Sequence[GroupStep], B: int) -> tuple:
        """``(grid, runtime arguments, constexprs, options)`` of the commit kernel for one step."""
        return ((self.items, B, self.num_layers),
                (self.layer_table, self._group_table_for(groups), num_accepted, query_start_loc,
                 num_accepted.shape[0], self.null_slot),
                self.constexprs, self.options)


def commit_specialization(cfg: LaunchConfig, state_dtype: str, conv_dtype: str, H: int, HV: int, K: int, V: int,
                          conv_cols: int, aligned: bool) -> tuple[int, dict, dict]:
    """The grouped commit kernel's specialization for one commit context: ``(work items of state
    tiles per row and layer, constexprs, compile options)``. ``ci/compile_kernels.py`` compiles
    through it too, so CI builds the kernel that runs."""
    tile = cfg.commit_tile(state_dtype == "bf16")
    block_v = min(tile.block_v, _pow2(V))
    tiles = HV * triton.cdiv(V, block_v)
    tiles_per_program = max(1, min(tile.tiles_per_program, tiles))
    constexprs = dict(H=H, HV=HV, K=K, V=V, K_PAD=_pow2(K), BV=block_v, BD=cfg.conv_block, CONV_COLS=conv_cols,
                      STATE_DTYPE=_dtype(state_dtype), CONV_DTYPE=_dtype(conv_dtype), ALIGNED=aligned,
                      TILES_PER_PROGRAM=tiles_per_program,
                      # The hints are PTX, which Triton's interpreter cannot run.
                      PREFETCH_RECORDS=tile.prefetch_records and not interpreting(),
                      PREFETCH_NEXT_TILE=tile.prefetch_next_tile and tiles_per_program > 1 and not interpreting(),
                      REPLAY_PAIRS=tile.replay_pairs)
    return triton.cdiv(tiles, tiles_per_program), constexprs, cfg.options(tile.warps, max_registers=tile.max_registers)


def _vector_aligned(layer: CommitLayer) -> bool:
    """True when every row of every state and record tile starts on a 16-byte boundary, so the
    commit kernel may use 16-byte vector accesses (it is told so through ``tl.multiple_of``)."""
    st = layer.state
    vec = 16 // st.element_size()
    return (st.data_ptr() % 16 == 0 and all(s % vec == 0 for s in st.stride()[:3])
            and all(t.data_ptr() % 16 == 0 for t in (layer.correction, layer.key))
            and layer.correction.shape[3] % 4 == 0 and layer.key.shape[3] % 4 == 0)


def _dtype(name: str):
    import triton.language as tl
    return {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[name]
