"""Causal depthwise conv over each row's window (conv_verify).

One program owns one (batch row, BD-block of channels). For window position ``p`` it reads the
``WIDTH`` inputs ``seq[p .. p + WIDTH - 1]`` where ``seq = history columns ++ window inputs``: the
first ``HISTORY`` come from ``conv_state`` (read only), the rest straight from ``x``. The window's
inputs are appended to ``conv_state`` at ``[HISTORY, HISTORY + len)``; nothing is read back.
"""
import triton
import triton.language as tl


@triton.jit
def conv_verify_kernel(
    x_ptr, conv_ptr, w_ptr, bias_ptr, out_ptr, state_indices_ptr, qsl_ptr,
    stride_x_t, stride_c_slot, stride_c_dim, stride_c_col, stride_w_d, stride_w_j, stride_o_t,
    dim, num_tokens, num_slots, null_slot, max_window,
    WIDTH: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    HISTORY: tl.constexpr = WIDTH - 1
    i_d = tl.program_id(0)
    row = tl.program_id(1)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < dim
    start = tl.maximum(tl.load(qsl_ptr + row), 0)
    end = tl.minimum(tl.load(qsl_ptr + row + 1), num_tokens)
    slot = tl.load(state_indices_ptr + row)
    live = (slot > null_slot) & (slot < num_slots)
    if live:
        length = tl.minimum(tl.maximum(end - start, 0), max_window)
        conv_row = conv_ptr + slot.to(tl.int64) * stride_c_slot + offs_d * stride_c_dim
        for p in range(0, length):
            if HAS_BIAS:
                acc = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros([BD], dtype=tl.float32)
            for j in tl.static_range(WIDTH):
                col = p + j                      # position in history ++ window
                in_history = col < HISTORY
                # tl.where builds the masks so they stay int1 tensors even where the
                # condition folds to a Python bool (the interpreter runs loops in Python).
                from_state = tl.load(conv_row + col * stride_c_col,
                                     mask=tl.where(in_history, mask_d, False), other=0.0)
                tok = (start + col - HISTORY).to(tl.int64)
                from_x = tl.load(x_ptr + tok * stride_x_t + offs_d,
                                 mask=tl.where(in_history, False, mask_d), other=0.0)
                seq = tl.where(in_history, from_state.to(tl.float32), from_x.to(tl.float32))
                w = tl.load(w_ptr + offs_d * stride_w_d + j * stride_w_j, mask=mask_d, other=0.0).to(tl.float32)
                acc = acc + w * seq
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tok = (start + p).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)
            x_p = tl.load(x_ptr + tok * stride_x_t + offs_d, mask=mask_d, other=0.0)
            tl.store(conv_row + (HISTORY + p) * stride_c_col, x_p.to(conv_ptr.dtype.element_ty), mask=mask_d)
    else:
        zeros = tl.zeros([BD], dtype=out_ptr.dtype.element_ty)
        for p in range(0, tl.maximum(end - start, 0)):
            tok = (start + p).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + offs_d, zeros, mask=mask_d)
