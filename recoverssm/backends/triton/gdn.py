"""Gated DeltaNet recurrence kernel: verify, native decode and snapshot in one source.

One program owns one (batch row, value head, BV-slice of V) state tile and walks the row's window
token by token with the tile in fp32 registers. The three modes are a *runtime* switch of one
compiled kernel, and the per-token step is one ``@triton.jit`` helper, so verify's records hold
exactly the ``c_t`` the native paths compute (same machine code, same reduction tree) and a commit
of them is bit-identical.

The tile is held as ``[K_CHUNKS, BV, K_INNER]`` (``K = K_CHUNKS * K_INNER``): each thread keeps
``K_CHUNKS`` chunks of its rows, the lanes spread over ``K_INNER`` and the rows. The compiler
lays the step out like the per-token k/q loads (converting the state tile once, before the loop),
so those loads' shape and alignment decide how a reduction over K splits between in-thread adds
and lane shuffles.

Kernels are compiled with ``enable_fp_fusion=False`` (see ``launch.py``): every fused multiply-add
is an explicit ``tl.fma`` and no other multiply is contracted, which keeps the rounding order of
contract section 2 on every compiler.
"""
import triton
import triton.language as tl

from .numerics import to_storage

MODE_VERIFY = tl.constexpr(0)
MODE_DECODE = tl.constexpr(1)
MODE_SNAPSHOT = tl.constexpr(2)

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def sum_over_k(x):
    """Sum a ``[K_CHUNKS, BV, K_INNER]`` tile over both K axes -> ``[BV]``."""
    return tl.sum(tl.sum(x, axis=2), axis=0)


@triton.jit
def l2_normalize(x):
    """``x / sqrt(sum(x^2) + eps)`` over K of a ``[K_CHUNKS, 1, K_INNER]`` vector.

    The hardware's fast sqrt and divide (a few ulp) rather than IEEE ``sqrt_rn``/``div_rn``: those
    are subroutines that cost the kernel 26 to 80 registers (measured with ci/compile_kernels.py),
    hence occupancy; the normalized key is recorded, so the commit replays it exactly either way."""
    norm = tl.sqrt(sum_over_k(x * x) + L2NORM_EPS)
    return x / norm[None, :, None]


@triton.jit
def softplus(x):
    """``x if x > 20 else log1p(exp(x))``, with log1p written out so tiny ``exp(x)`` keeps its digits."""
    y = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    one_plus = 1.0 + y
    rounded_away = one_plus == 1.0
    log1p = tl.where(rounded_away, y, tl.log(one_plus) * (y / tl.where(rounded_away, 1.0, one_plus - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def delta_rule_step(S, k_hat, q_hat, v, beta, decay):
    """One token of the gated delta rule on a ``[K_CHUNKS, BV, K_INNER]`` fp32 state tile.

    ``k_hat``, ``q_hat``: ``[K_CHUNKS, 1, K_INNER]``; ``v``: ``[BV]``; ``beta``, ``decay``: scalars.
    Returns the new tile, the correction ``c_t`` ``[BV]`` (the replay record) and the output.

    The output uses ``S_new q = S' q + c (k . q)``: both reductions then read ``S'`` and run side
    by side instead of one after the other. Verify and the native paths share this function, so
    ``c_t`` is bit-identical between them; the output differs from ``S_new q`` by rounding only.
    """
    S = S * decay
    predicted = sum_over_k(S * k_hat)
    partial_out = sum_over_k(S * q_hat)
    correction = beta * (v - predicted)
    S = tl.fma(correction[None, :, None], k_hat, S)
    k_dot_q = sum_over_k(k_hat * q_hat)
    out = tl.fma(correction, k_dot_q, partial_out)
    return S, correction, out


@triton.jit
def load_token(tok, ready, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, neg_A, dt_bias,
               stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head, v_head,
               hv, offs_k, mask_k, offs_v, mask_v, scale,
               GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, ALIGNED: tl.constexpr):
    """One token's inputs, ready for the step: ``k^``, ``q^`` (normalized, scaled), ``v``, decay and
    beta. Masked by ``ready``. (Loading one token ahead of the step was tried: the second copy of
    ``k^`` and ``q^`` pushed the kernel into register spills and it ran slower on the H200.)"""
    tok = tok.to(tl.int64)
    mk = tl.where(ready, mask_k, False)
    mv = tl.where(ready, mask_v, False)
    k_ptrs = k_ptr + tok * stride_k_t + k_head + offs_k
    q_ptrs = q_ptr + tok * stride_q_t + q_head + offs_k
    v_ptrs = v_ptr + tok * stride_v_t + v_head + offs_v
    if ALIGNED:   # the launcher guarantees 16-byte aligned rows: allow 16-byte vector loads
        k_ptrs = tl.multiple_of(k_ptrs, [16, 16, 16])
        q_ptrs = tl.multiple_of(q_ptrs, [16, 16, 16])
        v_ptrs = tl.multiple_of(v_ptrs, 16)
    k_hat = tl.load(k_ptrs, mask=mk, other=0.0).to(tl.float32)
    q_hat = tl.load(q_ptrs, mask=mk, other=0.0).to(tl.float32)
    v_t = tl.load(v_ptrs, mask=mv, other=0.0).to(tl.float32)
    a_t = tl.load(a_ptr + tok * stride_a_t + hv, mask=ready, other=0.0).to(tl.float32)
    b_t = tl.load(b_ptr + tok * stride_b_t + hv, mask=ready, other=0.0).to(tl.float32)
    if USE_L2NORM:
        k_hat = l2_normalize(k_hat)
        q_hat = l2_normalize(q_hat) * scale
    else:
        q_hat = q_hat * scale
    if GATES_PRECOMPUTED:
        decay = tl.exp(a_t)
        beta = b_t
    else:
        decay = tl.exp(neg_A * softplus(a_t + dt_bias))
        beta = 1.0 / (1.0 + tl.exp(-b_t))
    return k_hat, q_hat, v_t, decay, beta


# Everything that may differ between a verify call and the native call it must match (token
# inputs, records, outputs, index tensors, scalars, the mode itself) is kept out of Triton's
# specialization, so verify, decode and snapshot run the *same compiled kernel*: only the state
# (shared by both paths) and the constexprs select the binary. The layout the step computes in
# follows the layout of the k/q loads, which follows their alignment: had Triton specialized on an
# alignment or a stride that is a multiple of 16 in one call and not in the other, the two calls
# could reduce over K in different orders (seen for K = 32 and 64). Alignment is instead the
# constexpr ALIGNED, which the launcher makes true for every call it can (see launch.py).
_TOKEN_POINTERS = ["q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "out_ptr",
                   "state_indices_ptr", "qsl_ptr", "corr_ptr", "key_ptr", "decay_ptr", "snapshot_ptr"]
_RUNTIME_SCALARS = ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h",
                    "stride_a_t", "stride_b_t", "stride_o_t", "stride_o_h", "stride_snap_row",
                    "num_tokens", "num_slots", "null_slot", "max_window", "scale", "mode"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_TOKEN_POINTERS)
def gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr,
    state_ptr, state_indices_ptr, qsl_ptr,
    corr_ptr, key_ptr, decay_ptr, snapshot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_a_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_v, stride_snap_row,
    num_tokens, num_slots, null_slot, max_window, scale, mode,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    K_PAD: tl.constexpr, K_CHUNKS: tl.constexpr, BV: tl.constexpr,
    GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, ALIGNED: tl.constexpr,
):
    i_v = tl.program_id(0)
    hv = tl.program_id(1)
    row = tl.program_id(2)
    h = hv // (HV // H)
    K_INNER: tl.constexpr = K_PAD // K_CHUNKS

    # The row's tokens, clamped so that no index value can take a load out of bounds.
    start = tl.maximum(tl.load(qsl_ptr + row), 0)
    end = tl.minimum(tl.load(qsl_ptr + row + 1), num_tokens)
    length = tl.minimum(tl.maximum(end - start, 0), max_window)
    slot = tl.load(state_indices_ptr + row)
    live = (slot > null_slot) & (slot < num_slots)

    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    offs_k = (tl.arange(0, K_CHUNKS)[:, None, None] * K_INNER
              + tl.arange(0, K_INNER)[None, None, :])          # [K_CHUNKS, 1, K_INNER]
    mask_k = offs_k < K
    tile = offs_v[None, :, None] * stride_s_v + offs_k          # [K_CHUNKS, BV, K_INNER]
    mask_tile = mask_v[None, :, None] & mask_k
    q_head = h * stride_q_h
    k_head = h * stride_k_h
    v_head = hv * stride_v_h

    if live:
        state_tile = state_ptr + slot.to(tl.int64) * stride_s_slot + hv * stride_s_h
        S = tl.load(state_tile + tile, mask=mask_tile, other=0.0).to(tl.float32)
        if GATES_PRECOMPUTED:
            neg_A = 0.0
            dt_bias = 0.0
        else:
            neg_A = -tl.exp(tl.load(A_log_ptr + hv))
            dt_bias = tl.load(dt_bias_ptr + hv)
        for t in range(0, length):
            k_hat, q_hat, v_t, decay, beta = load_token(
                start + t, t < length, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, neg_A, dt_bias,
                stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head, v_head,
                hv, offs_k, mask_k, offs_v, mask_v, scale, GATES_PRECOMPUTED, USE_L2NORM, ALIGNED)

            S, correction, o_t = delta_rule_step(S, k_hat, q_hat, v_t, beta, decay)

            tok = (start + t).to(tl.int64)
            out_ptrs = out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v
            if ALIGNED:
                out_ptrs = tl.multiple_of(out_ptrs, 16)
            tl.store(out_ptrs, o_t.to(out_ptr.dtype.element_ty), mask=mask_v)
            if mode == MODE_VERIFY:  # replay records, by batch row and window position
                rec = (row * HV + hv).to(tl.int64) * max_window + t
                tl.store(corr_ptr + rec * V + offs_v, correction, mask=mask_v)
                if i_v == 0:
                    tl.store(decay_ptr + rec, decay)
                    if hv % (HV // H) == 0:   # one program per q/k head writes its key
                        key_rec = (row * H + h).to(tl.int64) * max_window + t
                        tl.store(key_ptr + key_rec * K + offs_k, k_hat, mask=mask_k)
            if mode == MODE_SNAPSHOT:  # the state after every position gets its own slot
                dst = tl.load(snapshot_ptr + row * stride_snap_row + t)
                if (dst > null_slot) & (dst < num_slots):
                    dst_tile = state_ptr + dst.to(tl.int64) * stride_s_slot + hv * stride_s_h
                    tl.store(dst_tile + tile, to_storage(S, state_ptr.dtype.element_ty), mask=mask_tile)
        if mode == MODE_DECODE:  # native decode: the final state back into the row's slot
            tl.store(state_tile + tile, to_storage(S, state_ptr.dtype.element_ty), mask=mask_tile)
    else:
        zeros = tl.zeros([BV], dtype=out_ptr.dtype.element_ty)
        for t in range(0, tl.maximum(end - start, 0)):
            tok = (start + t).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v, zeros, mask=mask_v)
