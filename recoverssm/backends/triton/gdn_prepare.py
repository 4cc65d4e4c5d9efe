"""Token preparation for the Gated DeltaNet recurrence: normalized keys and queries, gates.

Everything of a token that does not depend on the state is computed here once per token and q/k
head, by its own small kernel, instead of once per state tile in the recurrence kernel (which at
HV = 48 and 4 tiles per head repeated it 12 times per token, and spent a fifth of its
instructions on it: loading and unpacking ``k`` and ``q``, three sums over K, square roots, the
gates). The recurrence kernel then reads ``k^``, ``q^``, ``k^ . q^``, ``d_t`` and ``beta_t`` as
fp32 from a scratch buffer that the launcher allocates per call (``launch.py``).

Verify, decode and snapshot all run this kernel, so the values they feed to the per-token step
are the same bits: that is what keeps a commit of verify's records equal to native decode.

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
def l2_normalized(x):
    """``x / sqrt(sum(x^2) + eps)`` with IEEE square root and division, as the contract writes it
    (one program holds the whole vector, so this costs nothing that matters)."""
    return tl.div_rn(x, tl.sqrt_rn(tl.sum(x * x, axis=0) + L2NORM_EPS))


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


# Token inputs and scratch pointers are kept out of Triton's alignment specialization for the
# same reason as the recurrence kernel's (gdn.py): verify and the native paths must run one binary.
_POINTERS = ["q_ptr", "k_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "prepared_ptr"]
_RUNTIME_SCALARS = ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_a_t", "stride_b_t", "num_tokens",
                    "scale"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_POINTERS)
def gdn_prepare_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, prepared_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_a_t, stride_b_t, num_tokens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, LET_DEPENDENT_START: tl.constexpr,
):
    """One program per (token, q/k head): the head's ``k^``, ``q^``, ``k^ . q^``, and the gates of
    the ``HV / H`` value heads that read it. Grid ``(T, H)``.

    ``LET_DEPENDENT_START``: the recurrence kernel is launched as a programmatic dependent launch
    (grid_dependency.py) and may start as soon as every program here has begun."""
    if LET_DEPENDENT_START:
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k_hat_ptr, q_hat_ptr, k_dot_q_ptr, decay_ptr, beta_ptr = prepared_parts(prepared_ptr, num_tokens, H, HV, K_PAD)
    offs_k = tl.arange(0, K_PAD)
    mask_k = offs_k < K
    k = tl.load(k_ptr + tok * stride_k_t + h * stride_k_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + tok * stride_q_t + h * stride_q_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if USE_L2NORM:
        k_hat = l2_normalized(k)
        q_hat = l2_normalized(q) * scale
    else:
        k_hat = k
        q_hat = q * scale
    row = (tok * H + h) * K_PAD
    tl.store(k_hat_ptr + row + offs_k, k_hat)
    tl.store(q_hat_ptr + row + offs_k, q_hat)
    tl.store(k_dot_q_ptr + tok * H + h, tl.sum(k_hat * q_hat, axis=0))

    GROUP: tl.constexpr = HV // H
    hv = h * GROUP + tl.arange(0, GROUP_PAD)
    mask_g = tl.arange(0, GROUP_PAD) < GROUP
    a = tl.load(a_ptr + tok * stride_a_t + hv, mask=mask_g, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * stride_b_t + hv, mask=mask_g, other=0.0).to(tl.float32)
    if GATES_PRECOMPUTED:        # a = g_t, b = beta_t
        decay = tl.exp(a)
        beta = b
    else:
        neg_A = -tl.exp(tl.load(A_log_ptr + hv, mask=mask_g, other=0.0).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv, mask=mask_g, other=0.0).to(tl.float32)
        decay = tl.exp(neg_A * softplus(a + dt_bias))
        beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(decay_ptr + tok * HV + hv, decay, mask=mask_g)
    tl.store(beta_ptr + tok * HV + hv, beta, mask=mask_g)
