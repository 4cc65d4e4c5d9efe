"""Bit-reproducible fp32 building blocks of the reference.

Everything here is written so that a value depends only on the operands of its own token and head,
never on how many rows share the call. PyTorch's CPU kernels may round a transcendental function
differently in the vectorised body and in the scalar tail of a loop, and the order of a reduction
may follow the tensor's shape; so the reference

* sums with an explicit pairwise tree of elementwise adds (:func:`tree_sum`),
* fuses multiply-adds with one rounding through an exact float64 emulation (:func:`fma`),
* evaluates transcendental gates one token at a time, on vectors padded to a multiple of
  ``VECTOR_PAD`` so that every element takes the vectorised loop body (:func:`on_vector_path`):
  then a head's gates do not depend on how many heads share the call either (tensor-parallel
  shards compute the same bits as the full layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
VECTOR_PAD = 64   # a multiple of every SIMD width PyTorch's CPU kernels use (AVX512: 16 fp32)


def on_vector_path(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a 1-D fp32 ``x``, evaluated on a copy padded with zeros to a multiple of
    ``VECTOR_PAD`` elements, so no element lands in a loop's scalar tail (which may round a
    transcendental function differently)."""
    n = x.shape[-1]
    padded = F.pad(x, (0, -n % VECTOR_PAD))
    return fn(padded)[..., :n]


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by halving: ``x[..., :n/2] + x[..., n/2:]`` until one column is left.

    Each step is an elementwise fp32 add (exactly rounded on every code path), so the result is
    independent of batch shape and threading. Non-power-of-two lengths are padded with zeros.
    """
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def as_stored(S: torch.Tensor, dtype: torch.dtype, round_each_token: bool) -> torch.Tensor:
    """The fp32 running state after a token: with ``round_each_token``, as a pool of ``dtype``
    holds it (rounded to ``dtype``, to nearest even, and widened back), so that a window run in
    one call gives the bits of one call per token, each of which stores its state; else ``S``."""
    return S if dtype == torch.float32 or not round_each_token else S.to(dtype).float()


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` with a single rounding (IEEE fused multiply-add), broadcasting.

    The product of two fp32 values is exact in float64; the float64 sum is corrected to
    round-to-odd with its exact error term (TwoSum), and rounding a round-to-odd float64
    (53 >= 24 + 2 bits) to fp32 gives the correctly rounded fused result. This is the one helper
    every fused multiply-add of the reference goes through.
    """
    a64, b64, c64 = a.double(), b.double(), c.double()
    prod = a64 * b64
    total = prod + c64
    c_part = total - prod
    err = (prod - (total - c_part)) + (c64 - c_part)
    inexact_even = (err != 0) & ((total.view(torch.int64) & 1) == 0) & torch.isfinite(total)
    toward = torch.where(err > 0, torch.full_like(total, float("inf")), torch.full_like(total, float("-inf")))
    total = torch.where(inexact_even, torch.nextafter(total, toward), total)
    return total.float()


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, fp32."""
    x = x.float()
    return x / torch.sqrt(tree_sum(x * x) + L2NORM_EPS)[..., None]


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``x if x > 20 else log1p(exp(x))``."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay ``d = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``.

    ``a``, ``b``: ``[T, HV]`` (any float dtype); ``A_log``, ``dt_bias``: ``[HV]`` fp32.
    Returns two fp32 ``[T, HV]`` tensors. Evaluated one token (one ``[HV]`` vector) at a time so
    that a token's gates never depend on the batch it arrived in.
    """
    neg_a = -on_vector_path(torch.exp, A_log.float())
    dt_bias = dt_bias.float()
    decay = torch.empty(a.shape, dtype=torch.float32)
    beta = torch.empty(b.shape, dtype=torch.float32)
    for t in range(a.shape[0]):
        g_t = neg_a * on_vector_path(softplus, a[t].float() + dt_bias)
        decay[t] = on_vector_path(torch.exp, g_t)
        beta[t] = on_vector_path(torch.sigmoid, b[t].float())
    return decay, beta


def kda_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's per-channel decay and ``beta = sigmoid(b)``.

    ``a``: ``[T, HV, K]``; ``b``: ``[T, HV]``; ``A_log``: ``[HV]``; ``dt_bias``: ``[HV, K]`` fp32.
    ``d = exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)``, or with ``lower_bound``
    ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``. Returns fp32 ``[T, HV, K]`` and
    ``[T, HV]``; one token's ``[HV * K]`` gates at a time, as :func:`gdn_gates`.
    """
    T, HV, K = a.shape
    A = on_vector_path(torch.exp, A_log.float())[:, None]            # [HV, 1]
    dt_bias = dt_bias.float()
    decay = torch.empty(a.shape, dtype=torch.float32)
    beta = torch.empty(b.shape, dtype=torch.float32)
    for t in range(T):
        x = a[t].float() + dt_bias                                     # [HV, K]
        if lower_bound is None:
            g_t = -A * on_vector_path(softplus, x.reshape(-1)).view(HV, K)
        else:
            g_t = lower_bound * on_vector_path(torch.sigmoid, (A * x).reshape(-1)).view(HV, K)
        decay[t] = on_vector_path(torch.exp, g_t.reshape(-1)).view(HV, K)
        beta[t] = on_vector_path(torch.sigmoid, b[t].float())
    return decay, beta


def mamba2_gates(dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor | None, A: torch.Tensor | None,
                 dt_limit: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's decay ``d = exp(dt * A)`` and step ``dt = softplus(dt_raw + dt_bias)``, clamped to
    ``dt_limit``. ``dt``: ``[T, HV]`` (any float dtype); ``dt_bias``, ``A_log`` or ``A`` (``A =
    -exp(A_log)``): ``[HV]`` fp32. Returns two fp32 ``[T, HV]`` tensors, one token at a time
    (as :func:`gdn_gates`)."""
    A = -on_vector_path(torch.exp, A_log.float()) if A is None else A.float()
    dt_bias = dt_bias.float()
    decay = torch.empty(dt.shape, dtype=torch.float32)
    step = torch.empty(dt.shape, dtype=torch.float32)
    for t in range(dt.shape[0]):
        dt_t = on_vector_path(softplus, dt[t].float() + dt_bias)
        if dt_limit is not None:
            dt_t = torch.clamp(dt_t, min=dt_limit[0], max=dt_limit[1])
        step[t] = dt_t
        decay[t] = on_vector_path(torch.exp, dt_t * A)
    return decay, step


def precomputed_gates(g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay ``exp(g)`` and ``beta`` from precomputed gates (``g``: ``[T, HV]``, or ``[T, HV, K]``
    for KDA), one token at a time."""
    decay = torch.empty(g.shape, dtype=torch.float32)
    for t in range(g.shape[0]):
        decay[t] = on_vector_path(torch.exp, g[t].float().reshape(-1)).view(g.shape[1:])
    return decay, beta.float().clone()


def silu_rows(x: torch.Tensor) -> torch.Tensor:
    """SiLU applied one row (``x[i]``) at a time on the vector path, for the same reason as
    :func:`gdn_gates`."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = on_vector_path(F.silu, x[i])
    return out
