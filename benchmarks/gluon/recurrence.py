"""Gated DeltaNet recurrence in Gluon for Hopper (sm_90): verify, native decode and snapshot in one binary.

An experiment beside the library's Triton kernel (``recoverssm/backends/triton/gdn.py``), with the
same runtime interface: the mode (0 verify, 1 decode, 2 snapshot) is a runtime argument, the
per-token step is one ``@gluon.jit`` helper, and everything that may differ between a verify call
and the native call it must match is kept out of the specialization. Verify's records therefore
hold exactly the ``c_t`` that decode and snapshot compute, and a commit of them is bit-identical.

**Tile.** A program owns ``BV`` rows of V of one value head of one batch row, the state tile in
fp32 registers as ``[ROW_LANES * WARPS, LANES_K, SLOTS, K_CHUNKS, 4]`` ("physical" indices: row
lane, K lane, register slot, K chunk, 4 K-contiguous elements). Lane ``(rl, j)`` holds, in slot
``i``, V row ``rl * SLOTS + (i ^ (j % SLOTS))`` and K columns ``chunk * 4 * LANES_K + 4 * j +
(0..3)``. The XOR of the slot with the K lane is the point of the layout: it makes the reduction
over K end as a *reduce-scatter* without a single select instruction (``reduce_rows``).

**Per token and warp** (defaults: 8 lanes along K, 8 slots, K = 128; 128 state values a thread):

* one multiply per element for ``S' = S * d``; per row and thread one chain of fused
  multiply-adds over the thread's 16 elements for each of ``S' k^`` and ``S' q^``;
* each of those ends as a reduce-scatter: 4 + 2 + 1 shuffles and adds, after which lane ``j``
  holds the full sum of row ``j`` (a butterfly, the Triton kernel's reduction, costs 3 shuffles
  and adds for each of the 8 rows: 24). ``c = beta (v - S' k^)`` and the output are then
  computed once per row, by one lane, and written by it: the correction records and outputs of
  a warp are one coalesced store each;
* ``c`` goes back to every lane of its row by an all-gather (4 + 2 + 1 shuffles, no arithmetic),
  and the update ``S = fma(c, k^, S')`` is one fused multiply-add per element.

The shuffles are inline PTX (``shfl.sync.bfly``) and the order of every addition is written
out, so nothing depends on how the compiler lays out a reduction (see docs/DESIGN.md for the
bit-identity failures that motivated ``token_dot`` in the Triton kernel: here every sum over K
is an explicit chain plus explicit shuffles, identical in every mode).

**Rounding.** Compile with ``enable_fp_fusion=False`` (the launcher does): every fused multiply-add
is an explicit ``gl.fma``. ``S' = S * d`` is one multiply whose result is both reduced and updated.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

MODE_VERIFY = gl.constexpr(0)
MODE_DECODE = gl.constexpr(1)
MODE_SNAPSHOT = gl.constexpr(2)

L2NORM_EPS = gl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = gl.constexpr(20.0)
WARP_SIZE = gl.constexpr(32)


# ---------------------------------------------------------------------------------------------
# Layout helpers (compile-time)
# ---------------------------------------------------------------------------------------------

@gluon.constexpr_function
def tile_layout(lanes_k, slots, k_chunks, num_warps):
    """The state tile's layout ``[ROW_LANES * WARPS, LANES_K, SLOTS, K_CHUNKS, 4]``: 4
    K-contiguous elements per access (16-byte fp32 loads), then the K chunks and the slots in
    registers; lanes along K first (lane bits 0..log2(LANES_K)-1), then row lanes; warps along
    rows."""
    return gl.BlockedLayout(size_per_thread=[1, 1, slots, k_chunks, 4],
                            threads_per_warp=[32 // lanes_k, lanes_k, 1, 1, 1],
                            warps_per_cta=[num_warps, 1, 1, 1, 1],
                            order=[4, 3, 2, 1, 0])


@gluon.constexpr_function
def sliced(layout, rank, keep):
    """``layout`` (of rank ``rank``) with every dimension not in ``keep`` sliced away, highest
    first, so the kept dimensions keep their relative order."""
    for d in reversed(range(rank)):
        if d not in keep:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def index_along(N: gl.constexpr, DIM: gl.constexpr, LAYOUT: gl.constexpr):
    """``arange(N)`` along dimension ``DIM`` of a tensor in ``LAYOUT``, size 1 along the others."""
    RANK: gl.constexpr = LAYOUT.rank
    x = gl.arange(0, N, layout=sliced(LAYOUT, RANK, [DIM]))
    for d in gl.static_range(RANK):
        if d != DIM:
            x = gl.expand_dims(x, d)
    return x


# ---------------------------------------------------------------------------------------------
# Warp shuffles and fixed-order sums
# ---------------------------------------------------------------------------------------------

@gluon.constexpr_function
def _shfl_bfly_asm(offset):
    return f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;"


@gluon.jit
def shuffle_xor(x, OFFSET: gl.constexpr):
    """Each lane receives the same element of lane ``lane ^ OFFSET`` (fp32, any layout; every
    lane of the warp must execute it, which the kernel's warp-uniform control flow guarantees).
    Not marked pure, so the compiler neither removes nor moves it into a branch."""
    return gl.inline_asm_elementwise(_shfl_bfly_asm(OFFSET), "=r,r", [x], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def fma_fold(x, y, acc, HAS_ACC: gl.constexpr):
    """``acc + sum of x * y`` over the last axis (held by one thread), one fused multiply-add
    after another in a fixed order (even half first, recursively): M instructions for M
    elements. Without ``HAS_ACC`` the first product starts the chain (a multiply)."""
    M: gl.constexpr = x.shape[len(x.shape) - 1]
    if M == 1:
        xs = gl.reshape(x, x.shape[:-1])
        ys = gl.reshape(y, y.shape[:-1])
        if HAS_ACC:
            return gl.fma(xs, ys, acc)
        else:
            return xs * ys
    else:
        x_even, x_odd = gl.split(gl.reshape(x, x.shape[:-1] + [M // 2, 2]))
        y_even, y_odd = gl.split(gl.reshape(y, y.shape[:-1] + [M // 2, 2]))
        return fma_fold(x_odd, y_odd, fma_fold(x_even, y_even, acc, HAS_ACC), True)


@gluon.jit
def lane_allreduce(x, OFFSET: gl.constexpr, LANES: gl.constexpr):
    """Butterfly sum over lane bits ``OFFSET .. LANES/2``: every lane ends with the same bits
    (``a + b`` and ``b + a`` round alike)."""
    if OFFSET >= LANES:
        return x
    else:
        return lane_allreduce(x + shuffle_xor(x, OFFSET), OFFSET * 2, LANES)


@gluon.jit
def reduce_rows(p, OFFSET: gl.constexpr, LANES_K: gl.constexpr):
    """Reduce-scatter of per-thread row sums ``p`` ``[RLW, LANES_K, n]`` over the lanes along K.

    Slot ``i`` of lane ``j`` holds row ``i ^ j'`` (``j' = j % SLOTS``, the tile's swizzle). At
    lane offset ``o`` (1, 2, ...), the even slots hold the rows whose bit ``log2 o`` equals the
    lane's own and stay; the odd slots hold the partner's and go: ``even + shuffle(odd)``. After
    ``log2 SLOTS`` steps lane ``j`` holds row ``j'``, summed over the ``SLOTS`` lanes that differ in
    the low bits; lanes along K beyond ``SLOTS`` are then added by a butterfly. Returns
    ``[RLW, LANES_K, 1]``."""
    n: gl.constexpr = p.shape[2]
    if n == 1:
        return lane_allreduce(p, OFFSET, LANES_K)
    else:
        even, odd = gl.split(gl.reshape(p, [p.shape[0], p.shape[1], n // 2, 2]))
        return reduce_rows(even + shuffle_xor(odd, OFFSET), OFFSET * 2, LANES_K)


@gluon.jit
def gather_rows(c, OFFSET: gl.constexpr):
    """All-gather, the inverse movement of :func:`reduce_rows`: ``c`` ``[RLW, LANES_K, 1]`` (lane
    ``j`` holds row ``j'``) -> ``[RLW, LANES_K, SLOTS]`` with slot ``i`` holding row ``i ^ j'``.
    Offsets go from ``SLOTS / 2`` down to 1; each step appends the partner's values as the new
    lowest slot bit. Shuffles only, no arithmetic."""
    if OFFSET == 0:
        return c
    else:
        both = gl.join(c, shuffle_xor(c, OFFSET))
        return gather_rows(gl.reshape(both, [c.shape[0], c.shape[1], c.shape[2] * 2]), OFFSET // 2)


# ---------------------------------------------------------------------------------------------
# Token inputs
# ---------------------------------------------------------------------------------------------

@gluon.jit
def to_fp32(x, PTX_WIDEN_BF16: gl.constexpr):
    """Widen token inputs to fp32 (exact). With ``PTX_WIDEN_BF16`` a bf16 pair held in one 32-bit
    register becomes two fp32 values with one shift and one mask (the same bits as the cast,
    fewer instructions; recoverssm/backends/triton/numerics.py::to_fp32)."""
    if PTX_WIDEN_BF16 and x.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=gl.float32, is_pure=True, pack=2)
    else:
        return x.to(gl.float32)


@gluon.jit
def softplus(x):
    """``x if x > 20 else log1p(exp(x))``, log1p written out so a tiny ``exp(x)`` keeps its digits
    (the same formula as the Triton kernel)."""
    y = gl.exp(gl.minimum(x, SOFTPLUS_THRESHOLD))
    one_plus = 1.0 + y
    rounded_away = one_plus == 1.0
    log1p = gl.where(rounded_away, y, gl.log(one_plus) * (y / gl.where(rounded_away, 1.0, one_plus - 1.0)))
    return gl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@gluon.jit
def fetch_token(tok, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, stride_q_t, stride_k_t, stride_v_t, stride_a_t,
                stride_b_t, q_head, k_head, v_head, hv, k_cols, mask_k, v_rows, mask_v,
                ALIGNED: gl.constexpr, EXACT_K: gl.constexpr, EXACT_V: gl.constexpr, QK_EVICTION: gl.constexpr):
    """Issue the loads of one token's inputs as stored: ``k``, ``q`` ``[LANES_K, K_CHUNKS, 4]``
    (each lane its own K columns, replicated over row lanes and warps), ``v`` ``[RLW, LANES_K]``
    (one row per lane) and the two gate inputs. The token loop fetches token ``t + 1`` before it
    works on token ``t``, so the loads' latency hides behind a token's arithmetic."""
    tok = tok.to(gl.int64)
    k_ptrs = k_ptr + tok * stride_k_t + k_head + k_cols
    q_ptrs = q_ptr + tok * stride_q_t + q_head + k_cols
    if ALIGNED:   # the launcher guarantees 16-byte aligned rows; each lane reads 4 contiguous values
        k_ptrs = gl.max_contiguous(gl.multiple_of(k_ptrs, [4, 1, 4]), [1, 1, 4])
        q_ptrs = gl.max_contiguous(gl.multiple_of(q_ptrs, [4, 1, 4]), [1, 1, 4])
    if EXACT_K:
        k_t = gl.load(k_ptrs, eviction_policy=QK_EVICTION)
        q_t = gl.load(q_ptrs, eviction_policy=QK_EVICTION)
    else:
        k_t = gl.load(k_ptrs, mask=mask_k, other=0.0, eviction_policy=QK_EVICTION)
        q_t = gl.load(q_ptrs, mask=mask_k, other=0.0, eviction_policy=QK_EVICTION)
    if EXACT_V:
        v_t = gl.load(v_ptr + tok * stride_v_t + v_head + v_rows)
    else:
        v_t = gl.load(v_ptr + tok * stride_v_t + v_head + v_rows, mask=mask_v, other=0.0)
    a_t = gl.load(a_ptr + tok * stride_a_t + hv)
    b_t = gl.load(b_ptr + tok * stride_b_t + hv)
    return k_t, q_t, v_t, a_t, b_t


@gluon.jit
def expand_token(x, L5: gl.constexpr):
    """``[LANES_K, K_CHUNKS, 4]`` -> ``[1, LANES_K, 1, K_CHUNKS, 4]`` in the tile's layout (no data
    movement)."""
    return gl.expand_dims(gl.expand_dims(x, 0), 2)


@gluon.jit
def per_lane_to_token(x, LK3: gl.constexpr):
    """A per-lane value ``[LANES_K]`` (from a fold over a token vector) -> ``[LANES_K, 1, 1]``,
    broadcastable against a token vector. The conversion is asserted to move no data."""
    x = gl.convert_layout(x, gl.SliceLayout(1, gl.SliceLayout(2, LK3)), assert_trivial=True)
    return gl.expand_dims(gl.expand_dims(x, 1), 2)


@gluon.jit
def prepare_token(k_t, q_t, v_t, a_t, b_t, neg_A, dt_bias, scale, L5: gl.constexpr, L2: gl.constexpr,
                  GATES_PRECOMPUTED: gl.constexpr, USE_L2NORM: gl.constexpr, PTX_WIDEN_BF16: gl.constexpr):
    """One fetched token, ready for the step: ``k^``, ``q^`` ``[LANES_K, K_CHUNKS, 4]`` (normalized;
    ``q^`` scaled), ``k^ . q^`` ``[1, LANES_K]`` (every lane the same bits), ``v`` ``[RLW, LANES_K]``,
    decay and beta (scalars), all fp32.

    ``k . k``, ``q . q`` and ``k . q`` are three independent chains and butterflies; ``k^ . q^`` is
    ``(k . q) * rk * rq * scale``, equal to the dot of the normalized vectors up to rounding
    (only the output uses it; the recorded key is ``k * rk``, which the commit replays exactly).
    The norm uses the hardware's reciprocal square root, as the Triton kernel does."""
    LK3: gl.constexpr = sliced(L5, 5, [1, 3, 4])
    LANES_K: gl.constexpr = k_t.shape[0]
    k_f = to_fp32(k_t, PTX_WIDEN_BF16)
    q_f = to_fp32(q_t, PTX_WIDEN_BF16)
    per_thread: gl.constexpr = k_t.shape[1] * k_t.shape[2]
    k_2 = gl.reshape(k_f, [LANES_K, per_thread])
    q_2 = gl.reshape(q_f, [LANES_K, per_thread])
    kq = lane_allreduce(fma_fold(k_2, q_2, k_2, False), 1, LANES_K)
    if USE_L2NORM:
        kk = lane_allreduce(fma_fold(k_2, k_2, k_2, False), 1, LANES_K)
        qq = lane_allreduce(fma_fold(q_2, q_2, q_2, False), 1, LANES_K)
        rk = gl.rsqrt(kk + L2NORM_EPS)
        rq = gl.rsqrt(qq + L2NORM_EPS) * scale
        k_hat = k_f * per_lane_to_token(rk, LK3)
        q_hat = q_f * per_lane_to_token(rq, LK3)
        kq = kq * (rk * rq)
    else:
        k_hat = k_f
        q_hat = q_f * scale
        kq = kq * scale
    kq = gl.expand_dims(gl.convert_layout(kq, gl.SliceLayout(0, L2), assert_trivial=True), 0)
    a_t = a_t.to(gl.float32)
    b_t = b_t.to(gl.float32)
    if GATES_PRECOMPUTED:
        decay = gl.exp(a_t)
        beta = b_t
    else:
        decay = gl.exp(neg_A * softplus(a_t + dt_bias))
        beta = 1.0 / (1.0 + gl.exp(-b_t))
    return k_hat, q_hat, kq, to_fp32(v_t, PTX_WIDEN_BF16), decay, beta


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

@gluon.jit
def reduce_over_k(S, y5, L2: gl.constexpr, LANES_K: gl.constexpr):
    """``sum over K of S * y`` for the tile ``S`` and a token vector ``y5`` ``[1, LANES_K, 1, KC, 4]``:
    ``[RLW, LANES_K]``, lane ``j`` holding row ``j'``. One chain per row and thread, then the
    reduce-scatter."""
    RLW: gl.constexpr = S.shape[0]
    SLOTS: gl.constexpr = S.shape[2]
    per_thread: gl.constexpr = S.shape[3] * S.shape[4]
    S_b, y_b = gl.broadcast(S, y5)
    partial = fma_fold(gl.reshape(S_b, [RLW, LANES_K, SLOTS, per_thread]),
                       gl.reshape(y_b, [RLW, LANES_K, SLOTS, per_thread]), S_b, False)
    rows = reduce_rows(partial, 1, LANES_K)
    return gl.convert_layout(gl.reshape(rows, [RLW, LANES_K]), L2, assert_trivial=True)


@gluon.jit
def delta_rule_step(S, k_hat, q_hat, kq, v, beta, decay, L5: gl.constexpr):
    """One token of the gated delta rule on the fp32 tile ``S`` ``[RLW, LANES_K, SLOTS, KC, 4]``.

    ``k_hat``, ``q_hat``: ``[LANES_K, KC, 4]``; ``kq``: ``[1, LANES_K]``; ``v``: ``[RLW, LANES_K]``;
    ``beta``, ``decay``: scalars. Returns the new tile, the correction ``c_t`` and the output
    ``[RLW, LANES_K]`` (lane ``j`` of row lane ``rl``: V row ``rl * SLOTS + j % SLOTS``).

    The output is ``S' q^ + c (k^ . q^)`` (equal to ``S_new q^`` up to rounding): both reductions
    read ``S'`` and run side by side. Verify, decode and snapshot share this function, so ``c_t``
    is bit-identical between them."""
    LANES_K: gl.constexpr = S.shape[1]
    L3: gl.constexpr = sliced(L5, 5, [0, 1, 2])
    L2: gl.constexpr = sliced(L5, 5, [0, 1])
    k5 = expand_token(k_hat, L5)
    q5 = expand_token(q_hat, L5)
    S = S * decay
    predicted = reduce_over_k(S, k5, L2, LANES_K)
    partial_out = reduce_over_k(S, q5, L2, LANES_K)
    correction = beta * (v - predicted)
    out = gl.fma(correction, kq, partial_out)
    c_slots = gl.convert_layout(gather_rows(gl.expand_dims(correction, 2), S.shape[2] // 2), L3,
                                assert_trivial=True)
    S = gl.fma(gl.expand_dims(gl.expand_dims(c_slots, 3), 4), k5, S)
    return S, correction, out


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------

# Everything that may differ between a verify call and the native call it must match (token
# inputs, records, outputs, index tensors, scalars, the mode itself) is kept out of the
# specialization, so verify, decode and snapshot run the same compiled kernel; alignment of the
# token inputs is the constexpr ALIGNED, which the launcher makes true for every call it can.
_TOKEN_POINTERS = ["q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "out_ptr",
                   "state_indices_ptr", "qsl_ptr", "corr_ptr", "key_ptr", "decay_ptr", "snapshot_ptr"]
_RUNTIME_SCALARS = ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h",
                    "stride_a_t", "stride_b_t", "stride_o_t", "stride_o_h", "stride_snap_row",
                    "num_tokens", "num_slots", "null_slot", "max_window", "scale", "mode"]


@gluon.jit
def slot_is_live(slot, null_slot, num_slots):
    """A slot index that may be read or written: ``> null_slot`` and inside ``[0, num_slots)``,
    whatever the values."""
    return (slot > null_slot) & (slot >= 0) & (slot < num_slots)


@gluon.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_TOKEN_POINTERS)
def gdn_recurrent_gluon(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr,
    state_ptr, state_indices_ptr, qsl_ptr,
    corr_ptr, key_ptr, decay_ptr, snapshot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_a_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_snap_row,
    num_tokens, num_slots, null_slot, max_window, scale, mode,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STRIDE_S_V: gl.constexpr,
    K_PAD: gl.constexpr, LANES_K: gl.constexpr, SLOTS: gl.constexpr,
    GATES_PRECOMPUTED: gl.constexpr, USE_L2NORM: gl.constexpr, ALIGNED: gl.constexpr,
    PTX_WIDEN_BF16: gl.constexpr, L2_HINTS: gl.constexpr,
):
    """Grid ``(cdiv(V, BV), HV, B)``; ``BV = (32 / LANES_K) * num_warps * SLOTS``.

    ``q``, ``k``: ``[T, H, K]``; ``v``, ``out``: ``[T, HV, V]``; gates ``[T, HV]`` (+ ``A_log``,
    ``dt_bias`` ``[HV]``); ``state``: ``[num_slots, HV, V, K]`` fp32/bf16 (row stride
    ``STRIDE_S_V``, K contiguous); records (verify): ``corr [B, HV, max_window, V]``, ``key [B, H,
    max_window, K]``, ``decay [B, HV, max_window]`` fp32, contiguous; ``snapshot_slots [B, *]``
    (row stride ``stride_snap_row``). Padding rows write zeros to their outputs and nothing else.
    """
    WARPS: gl.constexpr = gl.num_warps()
    ROW_LANES: gl.constexpr = WARP_SIZE // LANES_K
    RLW: gl.constexpr = ROW_LANES * WARPS
    K_CHUNKS: gl.constexpr = K_PAD // (4 * LANES_K)
    BV: gl.constexpr = RLW * SLOTS
    GROUP: gl.constexpr = HV // H
    EXACT_K: gl.constexpr = K == K_PAD
    EXACT_V: gl.constexpr = V % BV == 0
    EXACT: gl.constexpr = EXACT_K and EXACT_V
    DEDUP_ROWS: gl.constexpr = SLOTS < LANES_K   # lanes j and j + SLOTS hold the same row
    gl.static_assert(SLOTS <= LANES_K, "each lane ends the reduce-scatter with at most one row")
    gl.static_assert(K_CHUNKS >= 1, "K_PAD must be at least 4 * LANES_K")
    # L2 hints (no effect on any value): the state tile is read once, so its lines go first; k and
    # q are read again by every V tile and value head of their q/k head, so theirs go last.
    STATE_EVICTION: gl.constexpr = "evict_first" if L2_HINTS else ""
    QK_EVICTION: gl.constexpr = "evict_last" if L2_HINTS else ""

    L5: gl.constexpr = tile_layout(LANES_K, SLOTS, K_CHUNKS, WARPS)
    L2: gl.constexpr = sliced(L5, 5, [0, 1])          # [RLW, LANES_K]: one row per lane
    LK3: gl.constexpr = sliced(L5, 5, [1, 3, 4])      # [LANES_K, K_CHUNKS, 4]: token vectors

    i_v = gl.program_id(0)
    hv = gl.program_id(1)
    row = gl.program_id(2)
    h = hv // GROUP

    # The row's tokens, clamped so that no index value can take a load out of bounds.
    start = gl.maximum(gl.load(qsl_ptr + row), 0)
    end = gl.minimum(gl.load(qsl_ptr + row + 1), num_tokens)
    length = gl.minimum(gl.maximum(end - start, 0), max_window)
    slot = gl.load(state_indices_ptr + row)
    live = slot_is_live(slot, null_slot, num_slots)

    # State tile offsets: row rl * SLOTS + (slot ^ j'), column chunk * 4 * LANES_K + 4 * j + e.
    rl5 = index_along(RLW, 0, L5)
    j5 = index_along(LANES_K, 1, L5)
    s5 = index_along(SLOTS, 2, L5)
    v_rows5 = i_v * BV + rl5 * SLOTS + (s5 ^ (j5 % SLOTS))                                 # [RLW, KL, SLOTS, 1, 1]
    k_cols5 = index_along(K_CHUNKS, 3, L5) * (4 * LANES_K) + j5 * 4 + index_along(4, 4, L5)  # [1, KL, 1, KC, 4]
    # The state's row stride is a constexpr: the tile's offsets are constants from one base address.
    tile = v_rows5 * STRIDE_S_V + k_cols5
    mask_tile = (v_rows5 < V) & (k_cols5 < K)
    # Token vectors and per-row values.
    k_cols = (index_along(K_CHUNKS, 1, LK3) * (4 * LANES_K) + index_along(LANES_K, 0, LK3) * 4
              + index_along(4, 2, LK3))                                                     # [KL, KC, 4]
    mask_k = k_cols < K
    j2 = index_along(LANES_K, 1, L2)
    v_rows = i_v * BV + index_along(RLW, 0, L2) * SLOTS + j2 % SLOTS                        # [RLW, KL]
    mask_v = v_rows < V
    if DEDUP_ROWS:
        mask_row_store = mask_v & (j2 < SLOTS)
    else:
        mask_row_store = mask_v
    q_head = h * stride_q_h
    k_head = h * stride_k_h
    v_head = hv * stride_v_h

    if live:
        state_tile = state_ptr + slot.to(gl.int64) * stride_s_slot + hv * stride_s_h
        if EXACT:
            S = gl.load(state_tile + tile, eviction_policy=STATE_EVICTION).to(gl.float32)
        else:
            S = gl.load(state_tile + tile, mask=mask_tile, other=0.0, eviction_policy=STATE_EVICTION).to(gl.float32)
        if GATES_PRECOMPUTED:
            neg_A = 0.0
            dt_bias = 0.0
        else:
            neg_A = -gl.exp(gl.load(A_log_ptr + hv))
            dt_bias = gl.load(dt_bias_ptr + hv)
        fetched = fetch_token(gl.minimum(start, num_tokens - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                              stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                              v_head, hv, k_cols, mask_k, v_rows, mask_v, ALIGNED, EXACT_K, EXACT_V, QK_EVICTION)
        for t in range(0, length):
            k_t, q_t, v_t, a_t, b_t = fetched
            # the next token's loads go out now (the last iteration fetches its own token again)
            fetched = fetch_token(start + gl.minimum(t + 1, length - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                                  stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                                  v_head, hv, k_cols, mask_k, v_rows, mask_v, ALIGNED, EXACT_K, EXACT_V,
                                  QK_EVICTION)
            k_hat, q_hat, kq, v_f, decay, beta = prepare_token(k_t, q_t, v_t, a_t, b_t, neg_A, dt_bias, scale,
                                                               L5, L2, GATES_PRECOMPUTED, USE_L2NORM,
                                                               PTX_WIDEN_BF16)

            S, correction, o_t = delta_rule_step(S, k_hat, q_hat, kq, v_f, beta, decay, L5)

            tok = (start + t).to(gl.int64)
            gl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + v_rows, o_t.to(out_ptr.dtype.element_ty),
                     mask=mask_row_store)
            if mode == MODE_VERIFY:  # replay records, by batch row and window position
                rec = (row * HV + hv).to(gl.int64) * max_window + t
                gl.store(corr_ptr + rec * V + v_rows, correction, mask=mask_row_store)
                if i_v == 0:
                    gl.store(decay_ptr + rec, decay)
                    if hv % GROUP == 0:   # one program per q/k head writes its key
                        key_rec = (row * H + h).to(gl.int64) * max_window + t
                        # k^ is replicated over row lanes and warps; the store writes each element once
                        gl.store(key_ptr + key_rec * K + k_cols, k_hat, mask=mask_k)
            # State stores, both from inside the loop: the snapshot after every position, and native
            # decode's final state after the last one (into the row's own slot). Keeping decode's store
            # in the loop, behind a per-token slot index, spares the registers that a store after the
            # loop would hold its addresses in for the whole window.
            if mode == MODE_SNAPSHOT:
                dst = gl.load(snapshot_ptr + row * stride_snap_row + t)
            else:
                dst = gl.where((mode == MODE_DECODE) & (t == length - 1), slot, null_slot)
            if slot_is_live(dst, null_slot, num_slots):
                dst_tile = state_ptr + dst.to(gl.int64) * stride_s_slot + hv * stride_s_h
                if EXACT:
                    gl.store(dst_tile + tile, S.to(state_ptr.dtype.element_ty))
                else:
                    gl.store(dst_tile + tile, S.to(state_ptr.dtype.element_ty), mask=mask_tile)
    else:
        zeros = gl.zeros([RLW, LANES_K], out_ptr.dtype.element_ty, L2)
        for t in range(0, gl.maximum(end - start, 0)):
            tok = (start + t).to(gl.int64)
            gl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + v_rows, zeros, mask=mask_row_store)
