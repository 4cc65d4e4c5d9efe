"""Tile helpers shared by the recurrence kernel and the token preparation kernel.

Tiles are ``[ROW_LANES, ROWS, K_INNER, K_CHUNKS]`` (gdn.py explains the layout); a token vector
over K is the same with one row, ``[ROW_LANES, 1, K_INNER, K_CHUNKS]``, broadcast over the row
lanes. Both kernels build their token vectors this way and reduce them with these functions, so a
token's sums come out of the same instructions in either kernel.
"""
import triton
import triton.language as tl


@triton.jit
def load_masked(ptrs, mask, EXACT: tl.constexpr):
    """``tl.load`` that skips the mask when the tile is known to be exactly in bounds (saves the
    predicate registers and instructions of the common K = V = 128 case)."""
    if EXACT:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def store_masked(ptrs, value, mask, EXACT: tl.constexpr):
    if EXACT:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def fma_chain(x, y, acc):
    """``acc`` plus the products of ``x`` and ``y`` ``[..., M]`` over their last axis (held by one
    thread), one fused multiply-add after another: a chain of M instructions. M is a power of
    two; the split into halves only renames registers."""
    M: tl.constexpr = x.shape[len(x.shape) - 1]
    if M == 1:
        return tl.fma(tl.reshape(x, x.shape[:-1]), tl.reshape(y, y.shape[:-1]), acc)
    else:
        x_even, x_odd = tl.split(tl.reshape(x, x.shape[:-1] + [M // 2, 2]))
        y_even, y_odd = tl.split(tl.reshape(y, y.shape[:-1] + [M // 2, 2]))
        return fma_chain(x_odd, y_odd, fma_chain(x_even, y_even, acc))


@triton.jit
def dot_over_k(x, y):
    """``sum over K of x * y`` for ``[ROW_LANES, R | 1, K_INNER, K_CHUNKS]`` tiles -> ``[ROW_LANES, R]``.

    Each thread folds all the K elements it holds of a row (``K_CHUNKS`` groups of 4) into one
    chain of fused multiply-adds (the kernels are compiled without automatic contraction, which
    would otherwise leave a multiply and an add per element), then the lanes are summed. One
    chain per row costs one instruction per element: folding each group of 4 on its own and
    adding the groups cost ``2 * (K_CHUNKS - 1)`` more per row (96 per token and warp at the
    default tile). The reshape to ``[..., K_INNER / 4 (lanes), 4 * K_CHUNKS (the thread's)]``
    merges two in-thread axes, so it only renames registers."""
    RL: tl.constexpr = x.shape[0]
    R: tl.constexpr = x.shape[1] if x.shape[1] > y.shape[1] else y.shape[1]
    KI: tl.constexpr = x.shape[2]
    KC: tl.constexpr = x.shape[3]
    xs = tl.reshape(tl.broadcast_to(x, [RL, R, KI, KC]), [RL, R, KI // 4, 4 * KC])
    ys = tl.reshape(tl.broadcast_to(y, [RL, R, KI, KC]), [RL, R, KI // 4, 4 * KC])
    return tl.sum(fma_chain(xs, ys, tl.zeros([RL, R, KI // 4], dtype=tl.float32)), axis=2)


@triton.jit
def token_dot(x, y):
    """``sum over K of x * y`` for two token vectors ``[ROW_LANES, 1, K_INNER, K_CHUNKS]`` (each
    broadcast over the row lanes): one scalar.

    A scalar has no layout. A reduction whose result had one could be recomputed by Triton in a
    second layout for a consumer that wants it (it did for ``k . k`` at 32 lanes along K), with
    the lanes summed in another order: the normalized key stored as the replay record then
    differed in the last bit from the key of the in-kernel update, and commit != decode. Every
    copy of ``k^`` computed from a scalar norm is the same elementwise product."""
    per_lane_group = dot_over_k(x, y)                              # [ROW_LANES, 1], all equal
    return tl.max(tl.max(per_lane_group, axis=1), axis=0)
