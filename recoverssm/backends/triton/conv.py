"""Causal depthwise conv kernels: ``conv_verify`` (a window per row) and ``conv_decode`` (one
token per row, the history shifted in place).

One program owns one (batch row, BD-block of channels). Window position ``p``'s output reads the
``WIDTH`` inputs ``seq[p + j * DILATION]``, ``j < WIDTH``, where ``seq = history columns ++
window inputs``: the first ``HISTORY = (WIDTH - 1) * DILATION`` come from ``conv_state``, the
rest straight from ``x``. Both kernels
accumulate with ``conv_output`` (bias, then ``j = 0 .. WIDTH-1``, a multiply and an add each:
the kernels are compiled without contraction), so a token's output is the same bits whichever
op computed it. Conv states are rounded to their dtype with ``to_storage`` (to nearest even on
every target, the interpreter included).
"""
import triton
import triton.language as tl

from .numerics import is_slot, row_window, to_storage
from .pending import count_replay, pending_commit


@triton.jit
def conv_output(acc, w_ptr, offs_d, mask_d, stride_w_d, stride_w_j, j, value):
    """``acc + weight[:, j] * value``, in fp32."""
    w = tl.load(w_ptr + offs_d * stride_w_d + j * stride_w_j, mask=mask_d, other=0.0).to(tl.float32)
    return acc + w * value


@triton.jit
def conv_start(bias_ptr, offs_d, mask_d, HAS_BIAS: tl.constexpr, BD: tl.constexpr):
    if HAS_BIAS:
        return tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        return tl.zeros([BD], dtype=tl.float32)


@triton.jit
def activate(acc, SILU: tl.constexpr):
    if SILU:
        return acc / (1.0 + tl.exp(-acc))
    else:
        return acc


@triton.jit
def compact_pending(conv_ptr, stride_c_slot, stride_c_dim, stride_c_col, offs_d, mask_d, source, final, boundary, n,
                    boundary_len, null_slot, HISTORY: tl.constexpr):
    """A pending step's conv compaction for this program's channels, as the commit does it:
    ``final[:, :history] = source[:, n : n + history]`` and ``boundary[:, :history] =
    source[:, boundary_len : boundary_len + history]``, every source column read before any
    store (the destinations may be the source slot)."""
    COLS: tl.constexpr = triton.next_power_of_2(HISTORY) if HISTORY > 0 else 1
    cols = tl.arange(0, COLS)[None, :]
    chan = offs_d[:, None] * stride_c_dim
    keep = mask_d[:, None] & (cols < HISTORY)
    source_row = conv_ptr + source.to(tl.int64) * stride_c_slot + chan
    final_cols = tl.load(source_row + (cols + n) * stride_c_col, mask=keep, other=0.0)
    boundary_cols = tl.load(source_row + (cols + boundary_len) * stride_c_col,
                            mask=tl.where(boundary > null_slot, keep, False), other=0.0)
    tl.debug_barrier()
    if boundary > null_slot:
        tl.store(conv_ptr + boundary.to(tl.int64) * stride_c_slot + chan + cols * stride_c_col, boundary_cols,
                 mask=keep)
    tl.store(conv_ptr + final.to(tl.int64) * stride_c_slot + chan + cols * stride_c_col, final_cols, mask=keep)
    tl.debug_barrier()       # the window below reads the final slot's history back


@triton.jit
def conv_verify_kernel(
    x_ptr, conv_ptr, w_ptr, bias_ptr, out_ptr, state_indices_ptr, qsl_ptr, pending_rows_ptr, plan_ptr,
    stride_x_t, stride_c_slot, stride_c_dim, stride_c_col, stride_w_d, stride_w_j, stride_o_t,
    dim, num_tokens, num_slots, null_slot, max_window, plan_rows, has_pending,
    WIDTH: tl.constexpr, DILATION: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """A window per row. Where ``has_pending``, a row that continues a deferred step
    (``pending_rows``) first compacts its history into the step's final (and boundary) slot
    (``compact_pending``), and its window goes to the final slot."""
    HISTORY: tl.constexpr = (WIDTH - 1) * DILATION
    i_d = tl.program_id(0)
    row = tl.program_id(1)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < dim
    start, span, length = row_window(qsl_ptr, row, num_tokens, max_window)
    slot = tl.load(state_indices_ptr + row)
    if is_slot(slot, null_slot, num_slots):
        if has_pending:
            prev, n, source, final, boundary, boundary_len = pending_commit(
                pending_rows_ptr, plan_ptr, plan_rows, row, True, null_slot, num_slots, max_window)
            if n > 0:
                compact_pending(conv_ptr, stride_c_slot, stride_c_dim, stride_c_col, offs_d, mask_d, source, final,
                                boundary, n, boundary_len, null_slot, HISTORY)
                slot = final
                if i_d == 0:
                    count_replay(plan_ptr, plan_rows, prev)
        conv_row = conv_ptr + slot.to(tl.int64) * stride_c_slot + offs_d * stride_c_dim
        for p in range(0, length):
            acc = conv_start(bias_ptr, offs_d, mask_d, HAS_BIAS, BD)
            for j in tl.static_range(WIDTH):
                col = p + j * DILATION           # position in history ++ window
                in_history = col < HISTORY
                # tl.where builds the masks so they stay int1 tensors even where the
                # condition folds to a Python bool (the interpreter runs loops in Python).
                from_state = tl.load(conv_row + col * stride_c_col,
                                     mask=tl.where(in_history, mask_d, False), other=0.0)
                tok = (start + col - HISTORY).to(tl.int64)
                from_x = tl.load(x_ptr + tok * stride_x_t + offs_d,
                                 mask=tl.where(in_history, False, mask_d), other=0.0)
                seq = tl.where(in_history, from_state.to(tl.float32), from_x.to(tl.float32))
                acc = conv_output(acc, w_ptr, offs_d, mask_d, stride_w_d, stride_w_j, j, seq)
            tok = (start + p).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + offs_d,
                     to_storage(activate(acc, SILU), out_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)
            x_p = tl.load(x_ptr + tok * stride_x_t + offs_d, mask=mask_d, other=0.0)
            tl.store(conv_row + (HISTORY + p) * stride_c_col,
                     to_storage(x_p, conv_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)
    else:
        zeros = tl.zeros([BD], dtype=out_ptr.dtype.element_ty)
        for p in range(0, span):
            tok = (start + p).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + offs_d, zeros, mask=mask_d)


@triton.jit
def conv_decode_kernel(
    x_ptr, conv_ptr, w_ptr, bias_ptr, out_ptr, state_indices_ptr,
    stride_x_t, stride_c_slot, stride_c_dim, stride_c_col, stride_w_d, stride_w_j, stride_o_t,
    dim, num_slots, null_slot,
    WIDTH: tl.constexpr, DILATION: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Row ``r``'s one token: the output of a one-token window, then the history shifted left by
    one with the token last. Every history column is loaded before any is stored."""
    HISTORY: tl.constexpr = (WIDTH - 1) * DILATION
    COLS: tl.constexpr = triton.next_power_of_2(HISTORY + 1)
    i_d = tl.program_id(0)
    row = tl.program_id(1)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < dim
    row64 = row.to(tl.int64)
    slot = tl.load(state_indices_ptr + row)
    if is_slot(slot, null_slot, num_slots):
        conv_row = conv_ptr + slot.to(tl.int64) * stride_c_slot + offs_d * stride_c_dim
        x_t = tl.load(x_ptr + row64 * stride_x_t + offs_d, mask=mask_d, other=0.0)
        # The whole history, loaded before anything is stored (as [BD, COLS]; columns >= HISTORY
        # unused), then the output from it column by column, as conv_verify computes it.
        cols = tl.arange(0, COLS)[None, :]
        in_history = (cols < HISTORY) & mask_d[:, None]
        history = tl.load(conv_row[:, None] + cols * stride_c_col, mask=in_history, other=0.0)
        acc = conv_start(bias_ptr, offs_d, mask_d, HAS_BIAS, BD)
        for j in tl.static_range(WIDTH):
            if j < WIDTH - 1:
                value = tl.load(conv_row + j * DILATION * stride_c_col, mask=mask_d, other=0.0).to(tl.float32)
            else:
                value = x_t.to(tl.float32)
            acc = conv_output(acc, w_ptr, offs_d, mask_d, stride_w_d, stride_w_j, j, value)
        tl.store(out_ptr + row64 * stride_o_t + offs_d,
                 to_storage(activate(acc, SILU), out_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)
        # Shift by addressing: stored column c (1 <= c < HISTORY) goes to column c - 1, and the
        # token, rounded to the state's dtype, to column HISTORY - 1.
        shifted = tl.where(cols == HISTORY, to_storage(x_t, conv_ptr.dtype.element_ty, INTERPRETED)[:, None],
                           history)
        keep = (cols >= 1) & (cols <= HISTORY) & mask_d[:, None]
        tl.debug_barrier()
        tl.store(conv_row[:, None] + (cols - 1) * stride_c_col, shifted, mask=keep)
    else:
        zeros = tl.zeros([BD], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + row64 * stride_o_t + offs_d, zeros, mask=mask_d)
