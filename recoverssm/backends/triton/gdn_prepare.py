"""Token preparation for the Gated DeltaNet recurrence: normalized keys and queries, gates.

What a token needs before it meets the state (``k^``, ``q^``, ``k^ . q^``, ``d_t``, ``beta_t``) is
written here once, as ``@triton.jit`` helpers that two places run on the same token vectors
(``[ROW_LANES, 1, K_INNER, K_CHUNKS]``, the recurrence tile's layout):

* ``gdn_prepare_kernel``, a small kernel that prepares every token of a call once per q/k head
  into a scratch buffer, which the recurrence kernel then reads (``PREPARED``). At HV = 48 and
  four tiles per head the recurrence kernel otherwise repeats this work 12 times per token, a
  fifth of its instructions (docs/BENCHMARKS.md);
* the recurrence kernel itself (``PREPARED`` off), for grids too small to fill the GPU, where the
  second launch costs more than it saves (docs/DESIGN.md).

Both compute a token's sums with the same functions on the same tile shape, so a request gets the
same bits whichever way its batch went; ``test_verify_is_batch_invariant`` and
``test_prepared_tokens_match_in_kernel_preparation`` hold that line.

Scratch layout: one fp32 buffer of ``T * (2 * H * K_PAD + H + 2 * HV)`` values holding, one after
the other (``prepared_parts``), by token index, not by window position, so the kernel needs no
``query_start_loc`` (every token of the call is prepared, also tokens no row reads):

=============  ====================  ===========================================================
``k_hat``      ``[T, H, K_PAD]``     ``k_t / sqrt(sum k_t^2 + eps)``; columns ``K..K_PAD`` are 0
``q_hat``      ``[T, H, K_PAD]``     ``q_t / sqrt(sum q_t^2 + eps) * scale``; padding 0
``k_dot_q``    ``[T, H]``            ``sum k^ * q^`` (the output's ``S_new q = S' q + c (k^ . q^)``)
``decay``      ``[T, HV]``           ``d_t = exp(g_t)``
``beta``       ``[T, HV]``           ``beta_t``
=============  ====================  ===========================================================

``K_PAD`` rows make every row 16-byte aligned whatever ``K`` is, so the recurrence kernel loads
them unmasked and four wide.
"""
import triton
import triton.language as tl

from .grid_dependency import gdc_launch_dependents
from .tile_ops import load_masked, token_dot

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
    """``1 / sqrt(sum(x^2) + eps)`` over K of a token vector: a scalar. The hardware's reciprocal
    square root (about 2 ulp) rather than IEEE ``sqrt_rn``/``div_rn``: those are subroutines
    that cost registers in the recurrence kernel's in-kernel path; the normalized key is
    recorded, so the commit replays it exactly either way."""
    return tl.rsqrt(token_dot(x, x) + L2NORM_EPS)


@triton.jit
def token_vector_offsets(ROW_LANES: tl.constexpr, K_INNER: tl.constexpr, K_CHUNKS: tl.constexpr):
    """Offsets ``chunk * K_INNER + inner`` of a token vector ``[ROW_LANES, 1, K_INNER, K_CHUNKS]``,
    broadcast over the row lanes (the recurrence tile's layout, gdn.py)."""
    lane_v = tl.arange(0, ROW_LANES)
    chunk = tl.arange(0, K_CHUNKS)
    return (tl.arange(0, K_INNER)[None, None, :, None] + chunk[None, None, None, :] * K_INNER
            + 0 * lane_v[:, None, None, None])


@triton.jit
def fetch_raw_token(tok, q_ptr, k_ptr, a_ptr, b_ptr, stride_q_t, stride_k_t, stride_a_t, stride_b_t, q_head,
                    k_head, hv, offs_k, mask_k, ALIGNED: tl.constexpr, EXACT_K: tl.constexpr):
    """Issue the loads of one token's ``k``, ``q`` (token vectors) and gate inputs of value head
    ``hv``, as stored."""
    tok = tok.to(tl.int64)
    k_ptrs = k_ptr + tok * stride_k_t + k_head + offs_k
    q_ptrs = q_ptr + tok * stride_q_t + q_head + offs_k
    if ALIGNED:   # the launcher guarantees 16-byte aligned rows; 4-element groups match the tile
        k_ptrs = tl.max_contiguous(tl.multiple_of(k_ptrs, [1, 1, 8, 8]), [1, 1, 4, 1])
        q_ptrs = tl.max_contiguous(tl.multiple_of(q_ptrs, [1, 1, 8, 8]), [1, 1, 4, 1])
    k_t = load_masked(k_ptrs, mask_k, EXACT_K)
    q_t = load_masked(q_ptrs, mask_k, EXACT_K)
    a_t = tl.load(a_ptr + tok * stride_a_t + hv)
    b_t = tl.load(b_ptr + tok * stride_b_t + hv)
    return k_t, q_t, a_t, b_t


@triton.jit
def head_gate_parameters(A_log_ptr, dt_bias_ptr, hv, GATES_PRECOMPUTED: tl.constexpr):
    """``-exp(A_log)`` and ``dt_bias`` of value head ``hv`` (zeros when the gates come precomputed)."""
    if GATES_PRECOMPUTED:
        return 0.0, 0.0
    else:
        return -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)), tl.load(dt_bias_ptr + hv).to(tl.float32)


@triton.jit
def token_gates(a_t, b_t, neg_A, dt_bias, GATES_PRECOMPUTED: tl.constexpr):
    """``(d_t, beta_t)`` from one token's gate inputs (``g_t``, ``beta_t`` when precomputed)."""
    a_t = a_t.to(tl.float32)
    b_t = b_t.to(tl.float32)
    if GATES_PRECOMPUTED:
        return tl.exp(a_t), b_t
    else:
        return tl.exp(neg_A * softplus(a_t + dt_bias)), 1.0 / (1.0 + tl.exp(-b_t))


@triton.jit
def normalized_token(k_t, q_t, scale, USE_L2NORM: tl.constexpr):
    """``(k^, q^, k^ . q^)`` from one token's ``k``, ``q`` (token vectors, as stored)."""
    k_hat = k_t.to(tl.float32)
    q_hat = q_t.to(tl.float32)
    if USE_L2NORM:
        k_hat = k_hat * inverse_l2_norm(k_hat)
        q_hat = q_hat * (inverse_l2_norm(q_hat) * scale)
    else:
        q_hat = q_hat * scale
    return k_hat, q_hat, token_dot(k_hat, q_hat)


@triton.jit
def prepared_parts(prepared_ptr, num_tokens, H: tl.constexpr, HV: tl.constexpr, K_PAD: tl.constexpr):
    """Pointers to the five parts of the scratch buffer (layout above)."""
    heads = num_tokens.to(tl.int64) * H
    k_hat_ptr = prepared_ptr
    q_hat_ptr = k_hat_ptr + heads * K_PAD
    k_dot_q_ptr = q_hat_ptr + heads * K_PAD
    decay_ptr = k_dot_q_ptr + heads
    beta_ptr = decay_ptr + num_tokens.to(tl.int64) * HV
    return k_hat_ptr, q_hat_ptr, k_dot_q_ptr, decay_ptr, beta_ptr


# Token inputs and scratch pointers are kept out of Triton's specialization for the same reason as
# the recurrence kernel's (gdn.py): every call with the same shapes must run one binary.
_POINTERS = ["q_ptr", "k_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "prepared_ptr"]
_RUNTIME_SCALARS = ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_a_t", "stride_b_t", "num_tokens",
                    "scale"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_POINTERS)
def gdn_prepare_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, prepared_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_a_t, stride_b_t, num_tokens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, K_INNER: tl.constexpr,
    ROW_LANES: tl.constexpr, GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, ALIGNED: tl.constexpr,
    LET_DEPENDENT_START: tl.constexpr,
):
    """One program per (token, q/k head): the head's ``k^``, ``q^``, ``k^ . q^``, and the gates of
    the ``HV / H`` value heads that read it. Grid ``(T, H)``. ``K_INNER`` and ``ROW_LANES`` are
    those of the recurrence kernel's tile, so the sums are taken exactly as it would take them.

    ``LET_DEPENDENT_START``: the recurrence kernel is launched as a programmatic dependent launch
    (grid_dependency.py) and may start as soon as every program here has begun."""
    if LET_DEPENDENT_START:
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    K_CHUNKS: tl.constexpr = K_PAD // K_INNER
    GROUP: tl.constexpr = HV // H
    k_hat_ptr, q_hat_ptr, k_dot_q_ptr, decay_ptr, beta_ptr = prepared_parts(prepared_ptr, num_tokens, H, HV, K_PAD)
    offs_k = token_vector_offsets(ROW_LANES, K_INNER, K_CHUNKS)
    mask_k = offs_k < K
    k_t, q_t, a_t, b_t = fetch_raw_token(tok, q_ptr, k_ptr, a_ptr, b_ptr, stride_q_t, stride_k_t, stride_a_t,
                                         stride_b_t, h * stride_q_h, h * stride_k_h, h * GROUP, offs_k, mask_k,
                                         ALIGNED, K == K_PAD)
    k_hat, q_hat, k_dot_q = normalized_token(k_t, q_t, scale, USE_L2NORM)
    # every lane group holds the whole vector: lane group j writes chunks j, j + ROW_LANES, ...
    lane_v = tl.arange(0, ROW_LANES)
    writer = (tl.arange(0, K_CHUNKS)[None, None, None, :] % ROW_LANES) == lane_v[:, None, None, None]
    head = (tok * H + h) * K_PAD
    tl.store(k_hat_ptr + head + offs_k, k_hat, mask=writer)
    tl.store(q_hat_ptr + head + offs_k, q_hat, mask=writer)
    tl.store(k_dot_q_ptr + tok * H + h, k_dot_q)
    for g in tl.static_range(GROUP):
        hv = h * GROUP + g
        if g > 0:
            a_t = tl.load(a_ptr + tok * stride_a_t + hv)
            b_t = tl.load(b_ptr + tok * stride_b_t + hv)
        neg_A, dt_bias = head_gate_parameters(A_log_ptr, dt_bias_ptr, hv, GATES_PRECOMPUTED)
        decay, beta = token_gates(a_t, b_t, neg_A, dt_bias, GATES_PRECOMPUTED)
        tl.store(decay_ptr + tok * HV + hv, decay)
        tl.store(beta_ptr + tok * HV + hv, beta)
