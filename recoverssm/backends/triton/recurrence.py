"""The recurrence kernel of GDN, KDA and Mamba2: verify, native decode and snapshot in one source.

One program owns one (batch row, value head, BV rows of V) state tile and walks the row's window
token by token with the tile in fp32 registers. The three modes are a *runtime* switch of one
compiled kernel, and the per-token step is one ``@triton.jit`` helper, so verify's records hold
exactly the ``c_t`` the native paths compute (same machine code, same reduction order) and a
commit of them is bit-identical.

**Tile layout.** The tile is ``[ROW_LANES, ROWS, K_INNER, K_CHUNKS]``: V row
``lane * ROWS + row`` and K column ``chunk * K_INNER + inner``. Loads are 4 elements wide along
``K_INNER``, so a warp's lanes split into ``K_INNER / 4`` lanes along K and ``ROW_LANES`` lanes
along V (the dimension order makes Triton's default layout put the lanes exactly there, and
``k``/``q`` share it: they are loaded broadcast over ``ROW_LANES``, ``offs_k``), and every thread
keeps ``ROWS x K_CHUNKS`` groups of 4 K-contiguous elements; with the chunks last, a row's
elements in one thread are adjacent in-thread axes, which ``dot_over_k`` merges into one. The
launch table chooses the split (``RecurrenceSpec.lanes_k``, ``.rows``). On the H200 the best is
8 lanes along K and 8 rows per thread: 128 state elements per thread, so each token's fixed work
(loading and normalizing ``k`` and ``q``, the gates, 3 shuffle steps per reduction) is spread
over many elements; with 16 lanes
along K (the most ``launch.recurrence_tile`` allows) the two reductions need 4 shuffle steps for
every row a thread holds (docs/BENCHMARKS.md).

**Latency.** Each token's inputs are fetched one token ahead (``fetch_token``), so their loads
are in flight while the previous token is computed; with few warps per SM (one program holds 128
state values per thread) nothing else would hide them.

**Rounding.** The kernels are compiled without automatic contraction (``config.py``); every fused
multiply-add is explicit: the update ``S = fma(c, k^, S')`` and each thread's chain of products
in ``dot_over_k``. ``S' = S * d`` is one multiply whose result is both reduced and
updated. Verify, decode and snapshot execute the same instructions on the same values.

**GDN and KDA.** KDA (``VECTOR_DECAY``) differs only in its gates: the gate input ``a``, the
bias and the decay are K-vectors. They are loaded and the gates computed on a flat ``[K_PAD]``
vector spread over the program's lanes (each channel once; in ``k``'s layout every row lane
would compute every channel again: KDA's token loop is 1249 instructions per token and warp this
way, 2009 that way), then moved into ``k``'s layout (``tile_vector``), so ``S * decay``
scales column ``j`` by ``decay[j]``; its replay record holds that vector. Everything else, the
step included, is the same code.

**Mamba2** (``MAMBA2``) has no delta rule: ``q``, ``k``, ``v`` are its ``C``, ``B``, ``x``, its
step (``mamba2_step``) computes the correction ``dt * x`` without reading the state and its
output from the updated state, plus ``D * x`` and the ``silu(z)`` gate; the gate is
``exp(A * dt)`` with ``dt = softplus(dt_raw + dt_bias)`` clamped to ``[dt_min, dt_max]``. Records,
replay, rounding and stores are the shared code.

**Indices.** Whatever the values: a slot that is not a slot (``numerics.is_slot``) makes a
padding row (its outputs zero over its whole span, nothing else read or written), a snapshot
entry that is not a slot is skipped, and ``query_start_loc`` is clamped (``numerics.row_window``).
"""
import triton
import triton.language as tl

from .numerics import as_stored, is_slot, row_window, to_fp32, to_storage
from .pending import count_replay, verify_rows

MODE_VERIFY = tl.constexpr(0)
MODE_DECODE = tl.constexpr(1)
MODE_SNAPSHOT = tl.constexpr(2)

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


# cache eviction policies of a load (hints: they never change a value)
EVICT_NORMAL = tl.constexpr(0)
EVICT_FIRST = tl.constexpr(1)
EVICT_LAST = tl.constexpr(2)


@triton.jit
def load_masked(ptrs, mask, EXACT: tl.constexpr, EVICTION: tl.constexpr = EVICT_NORMAL):
    """``tl.load`` that skips the mask when the tile is known to be exactly in bounds (saves the
    predicate registers and instructions of the common K = V = 128 case), with the cache
    eviction policy ``EVICTION``."""
    POLICY: tl.constexpr = ("evict_first" if EVICTION == EVICT_FIRST else
                            "evict_last" if EVICTION == EVICT_LAST else "")
    if EXACT:
        return tl.load(ptrs, eviction_policy=POLICY)
    else:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)


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


@triton.jit
def inverse_l2_norm(x):
    """``1 / sqrt(sum(x^2) + eps)`` over K of a token vector: a scalar. The hardware's reciprocal
    square root (about 2 ulp) rather than IEEE ``sqrt_rn``/``div_rn``: those are subroutines
    that cost registers, hence occupancy; the normalized key is recorded, so the commit replays
    it exactly either way."""
    return tl.rsqrt(token_dot(x, x) + L2NORM_EPS)


@triton.jit
def softplus(x):
    """``x if x > 20 else log1p(exp(x))``, with log1p written out so tiny ``exp(x)`` keeps its digits."""
    y = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    one_plus = 1.0 + y
    rounded_away = one_plus == 1.0
    log1p = tl.where(rounded_away, y, tl.log(one_plus) * (y / tl.where(rounded_away, 1.0, one_plus - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def delta_rule_step(S, k_hat, q_hat, v, beta, decay):
    """One token of the gated delta rule on a ``[ROW_LANES, R, K_INNER, K_CHUNKS]`` fp32 tile.

    ``k_hat``, ``q_hat``: ``[ROW_LANES, 1, K_INNER, K_CHUNKS]``; ``v``: ``[ROW_LANES, R]``;
    ``beta``: a scalar; ``decay``: a scalar (GDN) or laid out like ``k_hat`` (KDA). Returns the new
    tile, the correction ``c_t`` ``[ROW_LANES, R]``
    (the replay record) and the output.

    The output uses ``S_new q = S' q + c (k . q)``: both reductions then read ``S'`` and run side
    by side instead of one after the other. Verify and the native paths share this function, so
    ``c_t`` is bit-identical between them; the output differs from ``S_new q`` by rounding only.
    """
    S = S * decay
    predicted = dot_over_k(S, k_hat)
    partial_out = dot_over_k(S, q_hat)
    correction = beta * (v - predicted)
    S = tl.fma(correction[:, :, None, None], k_hat, S)
    out = tl.fma(correction, token_dot(k_hat, q_hat), partial_out)
    return S, correction, out


@triton.jit
def mamba2_step(S, B, C, x, dt, decay):
    """One Mamba2 token on the tile: ``c = dt * x`` (the replay record), ``S = fma(c, B, S * d)``,
    and the output ``S C`` of the updated state (``D * x`` and the gate are added by the caller).
    ``B``, ``C`` are laid out like ``k_hat``; ``x``: ``[ROW_LANES, R]``; ``dt``, ``decay``: scalars."""
    correction = dt * x
    S = tl.fma(correction[:, :, None, None], B, S * decay)
    return S, correction, dot_over_k(S, C)


@triton.jit
def mamba2_skip(D_ptr, hv, offs_v, mask_v, V: tl.constexpr, EXACT_V: tl.constexpr, HAS_D: tl.constexpr,
                D_PER_CHANNEL: tl.constexpr):
    """The head's ``D`` of Mamba2's skip term ``D * x``: a scalar, or the program's rows of a
    per-channel ``D`` (0 without ``D``; unused then)."""
    if HAS_D:
        if D_PER_CHANNEL:
            return load_masked(D_ptr + hv * V + offs_v, mask_v, EXACT_V)
        else:
            return tl.load(D_ptr + hv)
    else:
        return 0.0


@triton.jit
def mamba2_output(y, x, skip, z_ptrs, mask_v, EXACT_V: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """Mamba2's output of a token: ``y + D * x``, then times ``silu(z)`` where ``z`` is given."""
    if HAS_D:
        y = y + skip * x
    if HAS_Z:
        z = load_masked(z_ptrs, mask_v, EXACT_V).to(tl.float32)
        y = y * (z * sigmoid(z))
    return y


@triton.jit
def fetch_token(tok, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, stride_q_t, stride_k_t, stride_v_t, stride_a_t,
                stride_b_t, q_head, k_head, v_head, a_head, hv, offs_k, mask_k, offs_v, mask_v, offs_g, mask_g,
                present, ALIGNED: tl.constexpr, EXACT_K: tl.constexpr, EXACT_V: tl.constexpr,
                QK_EVICTION: tl.constexpr, VECTOR_DECAY: tl.constexpr, CHECKED: tl.constexpr,
                MAMBA2: tl.constexpr):
    """Issue the loads of one token's inputs, as stored (``k``, ``q`` broadcast over the row
    lanes, ``v``, the two gate inputs: ``a`` a K-vector in the flat gate layout ``offs_g`` under
    ``VECTOR_DECAY``). The token loop fetches token ``t + 1`` before it works on token ``t``, so
    the loads' latency hides behind a token's arithmetic. ``CHECKED``: every load is masked by
    ``present`` (the first token's fetch, issued before the kernel knows the row has a token:
    a call may have no token inputs at all). ``MAMBA2``: no ``b`` (0 is returned in its place)."""
    tok = tok.to(tl.int64)
    k_ptrs = k_ptr + tok * stride_k_t + k_head + offs_k
    q_ptrs = q_ptr + tok * stride_q_t + q_head + offs_k
    if ALIGNED:   # the launcher guarantees 16-byte aligned rows; 4-element groups match the tile
        k_ptrs = tl.max_contiguous(tl.multiple_of(k_ptrs, [1, 1, 8, 8]), [1, 1, 4, 1])
        q_ptrs = tl.max_contiguous(tl.multiple_of(q_ptrs, [1, 1, 8, 8]), [1, 1, 4, 1])
    if CHECKED:
        k_t = load_masked(k_ptrs, tl.where(present, mask_k, False), False, QK_EVICTION)
        q_t = load_masked(q_ptrs, tl.where(present, mask_k, False), False, QK_EVICTION)
        v_t = load_masked(v_ptr + tok * stride_v_t + v_head + offs_v, tl.where(present, mask_v, False), False)
        if VECTOR_DECAY:
            a_t = load_masked(a_ptr + tok * stride_a_t + a_head + offs_g, tl.where(present, mask_g, False), False)
        else:
            a_t = load_masked(a_ptr + tok * stride_a_t + a_head, present, False)
        if MAMBA2:
            b_t = 0.0
        else:
            b_t = load_masked(b_ptr + tok * stride_b_t + hv, present, False)
    else:
        k_t = load_masked(k_ptrs, mask_k, EXACT_K, QK_EVICTION)
        q_t = load_masked(q_ptrs, mask_k, EXACT_K, QK_EVICTION)
        v_t = load_masked(v_ptr + tok * stride_v_t + v_head + offs_v, mask_v, EXACT_V)
        if VECTOR_DECAY:
            a_t = load_masked(a_ptr + tok * stride_a_t + a_head + offs_g, mask_g, EXACT_K)
        else:
            a_t = tl.load(a_ptr + tok * stride_a_t + a_head)
        if MAMBA2:
            b_t = 0.0
        else:
            b_t = tl.load(b_ptr + tok * stride_b_t + hv)
    return k_t, q_t, v_t, a_t, b_t


@triton.jit
def tile_vector(x, ROW_LANES: tl.constexpr, K_INNER: tl.constexpr, K_CHUNKS: tl.constexpr):
    """A flat K-vector ``[K_PAD]`` (element ``chunk * K_INNER + inner``) laid out like ``k``:
    ``[ROW_LANES, 1, K_INNER, K_CHUNKS]``, broadcast over the row lanes (Triton moves it between
    the two layouts; no value changes)."""
    x = tl.permute(tl.reshape(x, [K_CHUNKS, K_INNER]), [1, 0])
    return tl.broadcast_to(x[None, None, :, :], [ROW_LANES, 1, K_INNER, K_CHUNKS])


@triton.jit
def prepare_token(k_t, q_t, v_t, a_t, b_t, gate_scale, dt_bias, scale, lower_bound, dt_min, dt_max,
                  GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, PTX_WIDEN_BF16: tl.constexpr,
                  LOWER_BOUND: tl.constexpr, MAMBA2: tl.constexpr, DT_LIMIT: tl.constexpr):
    """One fetched token, ready for the step: ``k^``, ``q^`` (normalized, scaled), ``v``, decay
    and beta, all fp32. The decay is ``exp(gate_scale * softplus(a + dt_bias))`` with
    ``gate_scale = -exp(A_log)``, or with ``LOWER_BOUND`` (KDA's bounded gate)
    ``exp(lower_bound * sigmoid(gate_scale * (a + dt_bias)))`` with ``gate_scale = exp(A_log)``,
    or ``exp(g)`` for precomputed gates (a scalar, or for KDA a K-vector in the flat gate layout:
    each channel's gate computed once per program, not once per row lane). ``MAMBA2``: ``k``, ``q``
    as they are (``B``, ``C``), decay ``exp(gate_scale * dt)`` with ``gate_scale = A`` and ``dt =
    softplus(a + dt_bias)`` clamped to ``[dt_min, dt_max]`` under ``DT_LIMIT``; ``dt`` is returned
    in beta's place."""
    k_hat = to_fp32(k_t, PTX_WIDEN_BF16)
    q_hat = to_fp32(q_t, PTX_WIDEN_BF16)
    a_t = a_t.to(tl.float32)
    if MAMBA2:
        dt = softplus(a_t + dt_bias)
        if DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        return k_hat, q_hat, to_fp32(v_t, PTX_WIDEN_BF16), tl.exp(gate_scale * dt), dt
    b_t = b_t.to(tl.float32)
    if USE_L2NORM:
        k_hat = k_hat * inverse_l2_norm(k_hat)
        q_hat = q_hat * (inverse_l2_norm(q_hat) * scale)
    else:
        q_hat = q_hat * scale
    if GATES_PRECOMPUTED:
        decay = tl.exp(a_t)
        beta = b_t
    else:
        if LOWER_BOUND:
            decay = tl.exp(lower_bound * sigmoid(gate_scale * (a_t + dt_bias)))
        else:
            decay = tl.exp(gate_scale * softplus(a_t + dt_bias))
        beta = sigmoid(b_t)
    return k_hat, q_hat, to_fp32(v_t, PTX_WIDEN_BF16), decay, beta


@triton.jit
def store_records(corr_ptr, key_ptr, decay_ptr, row64, i_v, hv, h, t, max_window, correction, k_hat, decay,
                  offs_v, mask_v, offs_k, mask_k, offs_g, mask_g, chunk, lane_v, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, ROW_LANES: tl.constexpr, EXACT_V: tl.constexpr,
                  VECTOR_DECAY: tl.constexpr):
    """Verify's replay record of window position ``t``, by batch row: the program's rows of the
    correction; the decay (a scalar, or KDA's K-vector in the flat gate layout) from the first V
    tile of each value head; the key from the first V tile of the first value head of each q/k head."""
    rec = (row64 * HV + hv) * max_window + t
    store_masked(corr_ptr + rec * V + offs_v, correction, mask_v, EXACT_V)
    if i_v == 0:
        # every lane group holds the whole key: lane group j writes chunks j, j + RL, ...
        writer = (chunk[None, None, None, :] % ROW_LANES) == lane_v[:, None, None, None]
        if VECTOR_DECAY:
            tl.store(decay_ptr + rec * K + offs_g, decay, mask=mask_g)
        else:
            tl.store(decay_ptr + rec, decay)
        if hv % (HV // H) == 0:
            key_rec = (row64 * H + h) * max_window + t
            tl.store(key_ptr + key_rec * K + offs_k, k_hat, mask=mask_k & writer)


@triton.jit
def gate_constants(A_log_ptr, dt_bias_ptr, hv, offs_g, mask_g, K: tl.constexpr, EXACT_K: tl.constexpr,
                   GATES_PRECOMPUTED: tl.constexpr, VECTOR_DECAY: tl.constexpr, LOWER_BOUND: tl.constexpr,
                   A_GIVEN: tl.constexpr):
    """The value head's constants of the raw gates: ``(gate_scale, dt_bias)`` (``prepare_token``);
    ``A_GIVEN`` (Mamba2 given ``A``, not ``A_log``): ``gate_scale`` is ``A`` as it is."""
    if A_GIVEN:
        gate_scale = tl.load(A_log_ptr + hv)
        dt_bias = tl.load(dt_bias_ptr + hv)
    elif GATES_PRECOMPUTED:
        gate_scale = 0.0
        dt_bias = 0.0
    else:
        gate_scale = tl.exp(tl.load(A_log_ptr + hv))
        if not LOWER_BOUND:
            gate_scale = -gate_scale
        if VECTOR_DECAY:
            dt_bias = load_masked(dt_bias_ptr + hv * K + offs_g, mask_g, EXACT_K)
        else:
            dt_bias = tl.load(dt_bias_ptr + hv)
    return gate_scale, dt_bias


@triton.jit
def replay_records(S, corr_row, key_row, decay_row, first, last, offs_v, mask_v, offs_k, mask_k, offs_g, mask_g,
                   K: tl.constexpr, V: tl.constexpr, ROW_LANES: tl.constexpr, K_INNER: tl.constexpr,
                   K_CHUNKS: tl.constexpr, EXACT_K: tl.constexpr, EXACT_V: tl.constexpr, VECTOR_DECAY: tl.constexpr,
                   STATE_DTYPE: tl.constexpr, ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """``S = fma(c_t, k^_t, S * d_t)`` for window positions ``first <= t < last`` (with
    ``ROUND_EACH_TOKEN``, rounded to the pool's dtype after each, ``as_stored``): the commit's
    step, elementwise, so the tile's layout changes no bit."""
    for t in range(first, last):
        correction = load_masked(corr_row + t * V + offs_v, mask_v, EXACT_V)
        k_hat = load_masked(key_row + t * K + offs_k, mask_k, EXACT_K)
        if VECTOR_DECAY:
            decay = tile_vector(load_masked(decay_row + t * K + offs_g, mask_g, EXACT_K), ROW_LANES, K_INNER, K_CHUNKS)
        else:
            decay = tl.load(decay_row + t)
        S = as_stored(tl.fma(correction[:, :, None, None], k_hat, S * decay), STATE_DTYPE, ROUND_EACH_TOKEN,
                      INTERPRETED, False)
    return S


@triton.jit
def replay_pending(S, corr_ptr, key_ptr, decay_ptr, rec_row, hv, h, max_window, n, boundary, boundary_len, final,
                   state_ptr, stride_s_slot, stride_s_h, tile, mask_tile, offs_v, mask_v, offs_k, mask_k, offs_g,
                   mask_g, null_slot, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   ROW_LANES: tl.constexpr, K_INNER: tl.constexpr, K_CHUNKS: tl.constexpr, EXACT: tl.constexpr,
                   EXACT_K: tl.constexpr, EXACT_V: tl.constexpr, VECTOR_DECAY: tl.constexpr,
                   ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """What the commit of a deferred row does to this program's tile, in registers: replay its
    ``n`` records (records row ``rec_row``), store the boundary state after ``boundary_len``
    tokens and the final state after ``n``; returns the final state as the next verify reads it
    back from the pool (rounded to the pool's dtype). With ``n = 0`` it stores nothing and
    returns ``S``: the kernel runs it for every row, so that no branch joins two versions of the
    tile (for bf16 pools that cost spills in the token loop). Compiled only into the ``REPLAY``
    binary (in every binary, its registers made the bf16 variants spill)."""
    corr_row = corr_ptr + (rec_row * HV + hv) * max_window * V
    key_row = key_ptr + (rec_row * H + h) * max_window * K
    DECAY_SIZE: tl.constexpr = K if VECTOR_DECAY else 1
    decay_row = decay_ptr + (rec_row * HV + hv) * max_window * DECAY_SIZE
    head = hv * stride_s_h
    S = replay_records(S, corr_row, key_row, decay_row, 0, boundary_len, offs_v, mask_v, offs_k, mask_k, offs_g,
                       mask_g, K, V, ROW_LANES, K_INNER, K_CHUNKS, EXACT_K, EXACT_V, VECTOR_DECAY,
                       state_ptr.dtype.element_ty, ROUND_EACH_TOKEN, INTERPRETED)
    if boundary > null_slot:
        store_masked(state_ptr + boundary.to(tl.int64) * stride_s_slot + head + tile,
                     to_storage(S, state_ptr.dtype.element_ty, INTERPRETED), mask_tile, EXACT)
    S = replay_records(S, corr_row, key_row, decay_row, boundary_len, n, offs_v, mask_v, offs_k, mask_k, offs_g,
                       mask_g, K, V, ROW_LANES, K_INNER, K_CHUNKS, EXACT_K, EXACT_V, VECTOR_DECAY,
                       state_ptr.dtype.element_ty, ROUND_EACH_TOKEN, INTERPRETED)
    stored = to_storage(S, state_ptr.dtype.element_ty, INTERPRETED)
    tl.store(state_ptr + final.to(tl.int64) * stride_s_slot + head + tile, stored,
             mask=tl.where(n > 0, mask_tile, False))
    return tl.where(n > 0, stored.to(tl.float32), S)


# Everything that may differ between a verify call and the native call it must match (token
# inputs, records, outputs, index tensors, scalars, the mode itself) is kept out of Triton's
# specialization, so verify, decode and snapshot run the *same compiled kernel*: only the state
# (shared by both paths) and the constexprs select the binary. Had Triton specialized on an
# alignment or a stride that is a multiple of 16 in one call and not in the other, the two calls
# could have compiled to different instruction sequences (seen for K = 32 and 64 with an earlier
# tile). Alignment is instead the constexpr ALIGNED, which the launcher makes true for every call
# it can (see launch.py). The one exception is REPLAY, a verify that replays a deferred commit
# first: the same token-loop source in a binary of its own, compared bit for bit with the eager
# path by the tests (docs/DESIGN.md, "Deferred commits").
_TOKEN_POINTERS = ["q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "D_ptr", "z_ptr", "out_ptr",
                   "state_indices_ptr", "qsl_ptr", "corr_ptr", "key_ptr", "decay_ptr", "snapshot_ptr",
                   "pending_rows_ptr", "plan_ptr", "parity_ptr"]
_RUNTIME_SCALARS = ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h",
                    "stride_a_t", "stride_a_h", "stride_b_t", "stride_z_t", "stride_z_h", "stride_o_t", "stride_o_h",
                    "stride_snap_row", "num_tokens", "num_slots", "null_slot", "max_window", "scale", "lower_bound",
                    "dt_min", "dt_max", "mode",
                    "plan_rows", "record_rows"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_TOKEN_POINTERS)
def recurrence_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, D_ptr, z_ptr, out_ptr,
    state_ptr, state_indices_ptr, qsl_ptr,
    corr_ptr, key_ptr, decay_ptr, snapshot_ptr, pending_rows_ptr, plan_ptr, parity_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_a_t, stride_a_h, stride_b_t, stride_z_t, stride_z_h, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_snap_row,
    num_tokens, num_slots, null_slot, max_window, scale, lower_bound, dt_min, dt_max, mode, plan_rows, record_rows,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, STRIDE_S_V: tl.constexpr,
    K_PAD: tl.constexpr, K_INNER: tl.constexpr, ROWS: tl.constexpr, ROW_LANES: tl.constexpr,
    GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, ALIGNED: tl.constexpr,
    PTX_WIDEN_BF16: tl.constexpr, L2_HINTS: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    LOWER_BOUND: tl.constexpr, INTERPRETED: tl.constexpr, REPLAY: tl.constexpr, ROUND_EACH_TOKEN: tl.constexpr,
    MAMBA2: tl.constexpr, A_GIVEN: tl.constexpr, DT_LIMIT: tl.constexpr, HAS_D: tl.constexpr,
    D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
):
    i_v = tl.program_id(0)
    hv = tl.program_id(1)
    row = tl.program_id(2)
    h = hv // (HV // H)
    K_CHUNKS: tl.constexpr = K_PAD // K_INNER
    BV: tl.constexpr = ROWS * ROW_LANES
    EXACT_K: tl.constexpr = K == K_PAD
    EXACT_V: tl.constexpr = V % BV == 0
    EXACT: tl.constexpr = EXACT_K and EXACT_V
    # L2 hints (no effect on any value): the state tile is read once, so its lines go first; k
    # and q are read again by every V tile and value head of their q/k head, so theirs go last.
    STATE_EVICTION: tl.constexpr = EVICT_FIRST if L2_HINTS else EVICT_NORMAL
    QK_EVICTION: tl.constexpr = EVICT_LAST if L2_HINTS else EVICT_NORMAL

    start, span, length = row_window(qsl_ptr, row, num_tokens, max_window)
    slot = tl.load(state_indices_ptr + row)
    live = is_slot(slot, null_slot, num_slots)
    # Double-buffered records (deferred commits; runtime values): this call writes buffer
    # ``parity``; under ``REPLAY`` a row with a pending step first replays its records from the
    # other buffer.
    write_row, read_row, prev, replay_len, source, final, boundary, boundary_len = verify_rows(
        row, slot, live, parity_ptr, pending_rows_ptr, plan_ptr, plan_rows, record_rows, REPLAY, null_slot,
        num_slots, max_window)

    lane_v = tl.arange(0, ROW_LANES)
    chunk = tl.arange(0, K_CHUNKS)
    # KDA's per-channel gates are computed on a flat K-vector spread over the whole program (in
    # the layout k has, every row lane would compute all of them again: 4x the exponentials and
    # logarithms at the default tile) and moved to k's layout for the step (``tile_vector``).
    offs_g = tl.arange(0, K_PAD)
    mask_g = offs_g < K
    offs_v = i_v * BV + lane_v[:, None] * ROWS + tl.arange(0, ROWS)[None, :]          # [RL, R]
    mask_v = offs_v < V
    offs_k = (tl.arange(0, K_INNER)[None, None, :, None] + chunk[None, None, None, :] * K_INNER
              + 0 * lane_v[:, None, None, None])                # [RL, 1, KI, KC], broadcast over RL
    mask_k = offs_k < K
    # The state's row stride is a constexpr: the tile's offsets are then constants from one base
    # address rather than addresses held in registers across the token loop (the state is the one
    # tensor verify and decode share, so specializing on it keeps them one binary).
    tile = offs_v[:, :, None, None] * STRIDE_S_V + offs_k       # [RL, R, KI, KC]
    mask_tile = mask_v[:, :, None, None] & mask_k
    q_head = h * stride_q_h
    k_head = h * stride_k_h
    v_head = hv * stride_v_h
    a_head = hv * stride_a_h
    row64 = row.to(tl.int64)

    if live:
        state_tile = state_ptr + source.to(tl.int64) * stride_s_slot + hv * stride_s_h
        S = load_masked(state_tile + tile, mask_tile, EXACT, STATE_EVICTION).to(tl.float32)
        gate_scale, dt_bias = gate_constants(A_log_ptr, dt_bias_ptr, hv, offs_g, mask_g, K, EXACT_K, GATES_PRECOMPUTED,
                                             VECTOR_DECAY, LOWER_BOUND, A_GIVEN)
        skip = mamba2_skip(D_ptr, hv, offs_v, mask_v, V, EXACT_V, HAS_D, D_PER_CHANNEL)
        # The first token's loads go out with the state's, before the replay: the replay's select
        # waits for the state, and a fetch behind it would add a second memory latency to every
        # program (a row without tokens, which may still replay its pending step, loads nothing).
        fetched = fetch_token(tl.maximum(tl.minimum(start, num_tokens - 1), 0), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                              stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                              v_head, a_head, hv, offs_k, mask_k, offs_v, mask_v, offs_g, mask_g, length > 0, ALIGNED,
                              EXACT_K, EXACT_V, QK_EVICTION, VECTOR_DECAY, True, MAMBA2)
        if REPLAY:
            S = replay_pending(S, corr_ptr, key_ptr, decay_ptr, read_row, hv, h, max_window, replay_len, boundary,
                               boundary_len, final, state_ptr, stride_s_slot, stride_s_h, tile, mask_tile, offs_v,
                               mask_v, offs_k, mask_k, offs_g, mask_g, null_slot, H, HV, K, V, ROW_LANES, K_INNER,
                               K_CHUNKS, EXACT, EXACT_K, EXACT_V, VECTOR_DECAY, ROUND_EACH_TOKEN, INTERPRETED)
            if (replay_len > 0) & (i_v == 0) & (hv == 0):
                count_replay(plan_ptr, plan_rows, prev)
        for t in range(0, length):
            k_t, q_t, v_t, a_t, b_t = fetched
            # the next token's loads go out now (the last iteration fetches its own token again)
            fetched = fetch_token(start + tl.minimum(t + 1, length - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                                  stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                                  v_head, a_head, hv, offs_k, mask_k, offs_v, mask_v, offs_g, mask_g, True,
                                  ALIGNED, EXACT_K, EXACT_V, QK_EVICTION, VECTOR_DECAY, False, MAMBA2)
            k_hat, q_hat, v_t, decay, beta = prepare_token(k_t, q_t, v_t, a_t, b_t, gate_scale, dt_bias, scale,
                                                           lower_bound, dt_min, dt_max, GATES_PRECOMPUTED, USE_L2NORM,
                                                           PTX_WIDEN_BF16, LOWER_BOUND, MAMBA2, DT_LIMIT)
            if MAMBA2:
                S, correction, o_t = mamba2_step(S, k_hat, q_hat, v_t, beta, decay)
                o_t = mamba2_output(o_t, v_t, skip, z_ptr + (start + t).to(tl.int64) * stride_z_t + hv * stride_z_h
                                    + offs_v, mask_v, EXACT_V, HAS_D, HAS_Z)
            elif VECTOR_DECAY:
                S, correction, o_t = delta_rule_step(S, k_hat, q_hat, v_t, beta,
                                                     tile_vector(decay, ROW_LANES, K_INNER, K_CHUNKS))
            else:
                S, correction, o_t = delta_rule_step(S, k_hat, q_hat, v_t, beta, decay)
            # with ROUND_EACH_TOKEN a non-fp32 pool's state is rounded after every token, as one
            # call per token would store it (the output above came from the state before that
            # rounding, as there). The compiler's cast, not the commit's PTX pairs: those made
            # Mamba2's tile spill here (verify 3x slower on the H200) and left GDN's within 2%.
            S = as_stored(S, state_ptr.dtype.element_ty, ROUND_EACH_TOKEN, INTERPRETED, False)

            tok = (start + t).to(tl.int64)
            store_masked(out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v,
                         to_storage(o_t, out_ptr.dtype.element_ty, INTERPRETED), mask_v, EXACT_V)
            if mode == MODE_VERIFY:
                store_records(corr_ptr, key_ptr, decay_ptr, write_row, i_v, hv, h, t, max_window, correction, k_hat,
                              decay, offs_v, mask_v, offs_k, mask_k, offs_g, mask_g, chunk, lane_v, H, HV, K, V,
                              ROW_LANES, EXACT_V, VECTOR_DECAY)
            # State stores, both from inside the loop: the snapshot after every position, and
            # native decode's final state after the last one (into the row's own slot). Keeping
            # decode's store in the loop, behind a per-token slot index, spares the registers
            # that a store after the loop would hold its addresses in for the whole window.
            if mode == MODE_SNAPSHOT:
                dst = tl.load(snapshot_ptr + row64 * stride_snap_row + t)
            else:
                dst = tl.where((mode == MODE_DECODE) & (t == length - 1), slot, null_slot)
            if is_slot(dst, null_slot, num_slots):
                dst_tile = state_ptr + dst.to(tl.int64) * stride_s_slot + hv * stride_s_h
                store_masked(dst_tile + tile, to_storage(S, state_ptr.dtype.element_ty, INTERPRETED), mask_tile,
                             EXACT)
    else:
        zeros = tl.zeros([ROW_LANES, ROWS], dtype=out_ptr.dtype.element_ty)
        for t in range(0, span):
            tok = (start + t).to(tl.int64)
            tl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v, zeros, mask=mask_v)
