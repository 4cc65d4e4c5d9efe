"""Per-token inputs of the Gated DeltaNet recurrence, prepared once per call.

Every token of a window enters the recurrence as a normalized key ``k^``, a normalized, scaled
query ``q^``, their product ``k^ . q^`` (the output's correction term), a decay ``d_t`` and a
``beta_t``. They depend on the token and its head only, not on the state, yet the recurrence
kernel is launched with one program per (batch row, value head, tile of V rows), so computing
them inside it repeats the work ``HV / H x V / BV x (lanes along V)`` times per token: on the
H200's default tile that was about 180 of the token loop's 1051 instructions per warp
(normalizations, two reductions over K, bf16 widening, the two divisions of the gates).

This kernel computes them once, in fp32, into a workspace the recurrence reads (``gdn.py``):
one program per (block of ``BLOCK_T`` tokens, q/k head). Verify, native decode and snapshot all
read the same workspace written by the same compiled kernel, so the values their steps use are
identical, and the replay records hold exactly those values. The tile shape is a constant of the
launch table, never of the batch, so a token's values do not depend on the batch it came in
(the reduction order over K is fixed by the tile).

Workspace layout (fp32, contiguous, ``T`` tokens): ``k^`` and ``q^`` ``[T, H, K_PAD]`` with the
padding columns zero (the recurrence loads whole 16-byte aligned rows, no mask), ``k^ . q^``
``[T, H]``, ``d_t`` and ``beta_t`` ``[T, HV]``.
"""
import triton
import triton.language as tl

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def softplus(x):
    """``x if x > 20 else log1p(exp(x))``, with log1p written out so tiny ``exp(x)`` keeps its digits."""
    y = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    one_plus = 1.0 + y
    rounded_away = one_plus == 1.0
    log1p = tl.where(rounded_away, y, tl.log(one_plus) * (y / tl.where(rounded_away, 1.0, one_plus - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def inverse_l2_norm(x):
    """``1 / sqrt(sum(x^2) + eps)`` of each row of a ``[BLOCK_T, K_PAD]`` tile -> ``[BLOCK_T, 1]``.
    The hardware's reciprocal square root (about 2 ulp) rather than IEEE ``sqrt_rn``/``div_rn``:
    the normalized key is recorded, so the commit replays it exactly either way."""
    return tl.rsqrt(tl.sum(x * x, axis=1) + L2NORM_EPS)[:, None]


# No specialization on the inputs' strides or alignment: Triton's layouts follow what it knows of
# them, a reduction's order follows the layout, and a token's values must not depend on the call.
@triton.jit(do_not_specialize=["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_a_t",
                               "stride_b_t", "num_tokens", "scale"],
            do_not_specialize_on_alignment=["q_ptr", "k_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr",
                                            "khat_ptr", "qhat_ptr", "kq_ptr", "decay_ptr", "beta_ptr"])
def gdn_token_prep_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    khat_ptr, qhat_ptr, kq_ptr, decay_ptr, beta_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_a_t, stride_b_t,
    num_tokens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    G_PAD: tl.constexpr, GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    block = tl.program_id(0)
    h = tl.program_id(1)
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < num_tokens
    tok = tok.to(tl.int64)
    offs_k = tl.arange(0, K_PAD)
    mask = live[:, None] & (offs_k < K)[None, :]
    k = tl.load(k_ptr + tok[:, None] * stride_k_t + h * stride_k_h + offs_k[None, :], mask=mask, other=0.0)
    q = tl.load(q_ptr + tok[:, None] * stride_q_t + h * stride_q_h + offs_k[None, :], mask=mask, other=0.0)
    k_hat = k.to(tl.float32)
    q_hat = q.to(tl.float32)
    if USE_L2NORM:
        k_hat = k_hat * inverse_l2_norm(k_hat)
        q_hat = q_hat * (inverse_l2_norm(q_hat) * scale)
    else:
        q_hat = q_hat * scale
    row = tok[:, None] * H + h
    tl.store(khat_ptr + row * K_PAD + offs_k[None, :], k_hat, mask=live[:, None])
    tl.store(qhat_ptr + row * K_PAD + offs_k[None, :], q_hat, mask=live[:, None])
    tl.store(kq_ptr + tok * H + h, tl.sum(k_hat * q_hat, axis=1), mask=live)

    # the gates of the value heads that share this q/k head, as one [BLOCK_T, G] tile: their
    # loads go out together instead of one head after another
    G: tl.constexpr = HV // H
    hv = h * G + tl.arange(0, G_PAD)
    mask_g = live[:, None] & (tl.arange(0, G_PAD) < G)[None, :]
    a_t = tl.load(a_ptr + tok[:, None] * stride_a_t + hv[None, :], mask=mask_g, other=0.0).to(tl.float32)
    b_t = tl.load(b_ptr + tok[:, None] * stride_b_t + hv[None, :], mask=mask_g, other=0.0).to(tl.float32)
    if GATES_PRECOMPUTED:
        decay = tl.exp(a_t)
        beta = b_t
    else:
        neg_A = -tl.exp(tl.load(A_log_ptr + hv, mask=hv < HV, other=0.0))
        dt_bias = tl.load(dt_bias_ptr + hv, mask=hv < HV, other=0.0)
        decay = tl.exp(neg_A[None, :] * softplus(a_t + dt_bias[None, :]))
        beta = 1.0 / (1.0 + tl.exp(-b_t))
    gate = tok[:, None] * HV + hv[None, :]
    tl.store(decay_ptr + gate, decay, mask=mask_g)
    tl.store(beta_ptr + gate, beta, mask=mask_g)
