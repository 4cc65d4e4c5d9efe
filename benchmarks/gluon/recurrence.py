"""Gated DeltaNet recurrence in Gluon for Hopper (sm_90): verify, native decode and snapshot in one binary.

An experiment beside the library's Triton kernel (``recoverssm/backends/triton/recurrence.py``), with the
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

from dataclasses import dataclass
from typing import Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

MODE_VERIFY = gl.constexpr(0)
MODE_DECODE = gl.constexpr(1)
MODE_SNAPSHOT = gl.constexpr(2)

# Triton 3.6 (the H200 machine) names the cp.async copy async_copy_global_to_shared; later Gluon
# renamed it async_load (same leading arguments: smem, pointers, mask, eviction_policy).
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

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
    if ALIGNED:
        # The launcher guarantees 16-byte aligned rows, and each lane's 4 contiguous values start
        # at a multiple of 4 elements: their address is a multiple of 4 * element bytes (pointer
        # divisibility is counted in bytes), so they load as one vector.
        GROUP_BYTES: gl.constexpr = 4 * (k_ptr.dtype.element_ty.primitive_bitwidth // 8)
        k_ptrs = gl.max_contiguous(gl.multiple_of(k_ptrs, [GROUP_BYTES, GROUP_BYTES, GROUP_BYTES]), [1, 1, 4])
        q_ptrs = gl.max_contiguous(gl.multiple_of(q_ptrs, [GROUP_BYTES, GROUP_BYTES, GROUP_BYTES]), [1, 1, 4])
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
                    "num_tokens", "num_slots", "null_slot", "max_window", "scale", "mode", "num_rows"]


@gluon.jit
def slot_is_live(slot, null_slot, num_slots):
    """A slot index that may be read or written: ``> null_slot`` and inside ``[0, num_slots)``,
    whatever the values."""
    return (slot > null_slot) & (slot >= 0) & (slot < num_slots)



@gluon.constexpr_function
def staging_layout():
    """Shared layout of a staged state tile ``[RLW, LANES_K, SLOTS, KC, 4]``: each thread's 4
    contiguous elements, then the lanes along K, then the row lanes, then chunks and slots. Every
    thread reads back exactly what it copied, and the 32 lanes of one access touch 32 adjacent
    16-byte pieces (no bank conflicts for the copy or the load)."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[4, 1, 0, 3, 2])


@gluon.jit
def stage_state_tile(smem, tile_id, num_tiles, state_ptr, state_indices_ptr, tile, rows5, k_cols5,
                     stride_s_slot, stride_s_h, null_slot, num_slots,
                     N_VT: gl.constexpr, HV: gl.constexpr, BV: gl.constexpr, V: gl.constexpr, K: gl.constexpr,
                     STRIDE_S_V: gl.constexpr, EXACT: gl.constexpr, STATE_EVICTION: gl.constexpr):
    """Start the asynchronous copy (``cp.async``) of work item ``tile_id``'s state tile into
    ``smem`` and close the copy group; nothing is copied for an item past the end or of a padding
    row (the group is then empty). The copy needs no registers while in flight."""
    if tile_id < num_tiles:
        i_v = tile_id % N_VT
        hv = (tile_id // N_VT) % HV
        row = tile_id // (N_VT * HV)
        slot = gl.load(state_indices_ptr + row)
        if slot_is_live(slot, null_slot, num_slots):
            base = state_ptr + slot.to(gl.int64) * stride_s_slot + hv * stride_s_h + (i_v * BV) * STRIDE_S_V
            if EXACT:
                async_load(smem, base + tile, eviction_policy=STATE_EVICTION)
            else:
                mask = ((i_v * BV + rows5) < V) & (k_cols5 < K)
                async_load(smem, base + tile, mask=mask, eviction_policy=STATE_EVICTION)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=_RUNTIME_SCALARS, do_not_specialize_on_alignment=_TOKEN_POINTERS)
def gdn_recurrent_gluon(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr,
    state_ptr, state_indices_ptr, qsl_ptr,
    corr_ptr, key_ptr, decay_ptr, snapshot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_a_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_snap_row,
    num_tokens, num_slots, null_slot, max_window, scale, mode, num_rows,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STRIDE_S_V: gl.constexpr,
    K_PAD: gl.constexpr, LANES_K: gl.constexpr, SLOTS: gl.constexpr,
    GATES_PRECOMPUTED: gl.constexpr, USE_L2NORM: gl.constexpr, ALIGNED: gl.constexpr,
    PTX_WIDEN_BF16: gl.constexpr, L2_HINTS: gl.constexpr, PERSISTENT: gl.constexpr, STAGED: gl.constexpr,
):
    """The recurrence over work items ``(V tile, value head, batch row)``, ``BV = (32 / LANES_K) *
    num_warps * SLOTS`` rows of V each.

    Grid: ``(cdiv(V, BV), HV, B)``, one item per program; or, with ``PERSISTENT``, ``(P,)``:
    program ``p`` takes items ``p, p + P, ...``. With ``STAGED`` (persistent only) the next item's
    state tile is copied into shared memory by ``cp.async`` while the current item's tokens run,
    and read back when its turn comes; the arithmetic is the same code either way.

    ``q``, ``k``: ``[T, H, K]``; ``v``, ``out``: ``[T, HV, V]``; gates ``[T, HV]`` (+ ``A_log``,
    ``dt_bias`` ``[HV]`` fp32); ``state``: ``[num_slots, HV, V, K]`` fp32/bf16 (row stride
    ``STRIDE_S_V``, K contiguous); verify's records: ``corr [B, HV, max_window, V]``, ``key [B, H,
    max_window, K]``, ``decay [B, HV, max_window]``, fp32 contiguous; ``snapshot_slots [B, *]``
    int32 (row stride ``stride_snap_row``); ``state_indices [B]``, ``query_start_loc [B + 1]`` int32.
    Padding rows (slot ``<= null_slot`` or outside ``[0, num_slots)``) write zeros to their
    outputs and nothing else.
    """
    WARPS: gl.constexpr = gl.num_warps()
    ROW_LANES: gl.constexpr = WARP_SIZE // LANES_K
    RLW: gl.constexpr = ROW_LANES * WARPS
    K_CHUNKS: gl.constexpr = K_PAD // (4 * LANES_K)
    BV: gl.constexpr = RLW * SLOTS
    N_VT: gl.constexpr = (V + BV - 1) // BV
    GROUP: gl.constexpr = HV // H
    EXACT_K: gl.constexpr = K == K_PAD
    EXACT_V: gl.constexpr = V % BV == 0
    EXACT: gl.constexpr = EXACT_K and EXACT_V
    DEDUP_ROWS: gl.constexpr = SLOTS < LANES_K   # lanes j and j + SLOTS hold the same row
    gl.static_assert(SLOTS <= LANES_K, "each lane ends the reduce-scatter with at most one row")
    gl.static_assert(K_CHUNKS >= 1, "K_PAD must be at least 4 * LANES_K")
    gl.static_assert(PERSISTENT or not STAGED, "staging the next tile needs a persistent grid")
    # L2 hints (no effect on any value): the state tile is read once, so its lines go first; k and
    # q are read again by every V tile and value head of their q/k head, so theirs go last.
    STATE_EVICTION: gl.constexpr = "evict_first" if L2_HINTS else ""
    QK_EVICTION: gl.constexpr = "evict_last" if L2_HINTS else ""

    L5: gl.constexpr = tile_layout(LANES_K, SLOTS, K_CHUNKS, WARPS)
    L2: gl.constexpr = sliced(L5, 5, [0, 1])          # [RLW, LANES_K]: one row per lane
    LK3: gl.constexpr = sliced(L5, 5, [1, 3, 4])      # [LANES_K, K_CHUNKS, 4]: token vectors

    # Offsets inside a work item (the item adds scalars): state row rl * SLOTS + (slot ^ j'),
    # column chunk * 4 * LANES_K + 4 * j + e.
    rl5 = index_along(RLW, 0, L5)
    j5 = index_along(LANES_K, 1, L5)
    rows5 = rl5 * SLOTS + (index_along(SLOTS, 2, L5) ^ (j5 % SLOTS))                          # [RLW, KL, SLOTS, 1, 1]
    k_cols5 = index_along(K_CHUNKS, 3, L5) * (4 * LANES_K) + j5 * 4 + index_along(4, 4, L5)  # [1, KL, 1, KC, 4]
    # The state's row stride is a constexpr: the tile's offsets are constants from one base address.
    tile = rows5 * STRIDE_S_V + k_cols5
    k_cols = (index_along(K_CHUNKS, 1, LK3) * (4 * LANES_K) + index_along(LANES_K, 0, LK3) * 4
              + index_along(4, 2, LK3))                                                     # [KL, KC, 4]
    mask_k = k_cols < K
    j2 = index_along(LANES_K, 1, L2)
    rows2 = index_along(RLW, 0, L2) * SLOTS + j2 % SLOTS                                    # [RLW, KL]

    if PERSISTENT:
        first = gl.program_id(0)
        step = gl.num_programs(0)
        num_items = N_VT * HV * num_rows
    else:
        first = (gl.program_id(2) * HV + gl.program_id(1)) * N_VT + gl.program_id(0)
        step = 1
        num_items = first + 1
    if STAGED:
        smem = gl.allocate_shared_memory(state_ptr.dtype.element_ty, [RLW, LANES_K, SLOTS, K_CHUNKS, 4],
                                         staging_layout())
        stage_state_tile(smem, first, num_items, state_ptr, state_indices_ptr, tile, rows5, k_cols5,
                         stride_s_slot, stride_s_h, null_slot, num_slots, N_VT, HV, BV, V, K, STRIDE_S_V, EXACT,
                         STATE_EVICTION)

    for item in range(first, num_items, step):
        i_v = item % N_VT
        hv = (item // N_VT) % HV
        row = item // (N_VT * HV)
        h = hv // GROUP
        if STAGED:   # this item's tile has arrived; the next item's copy goes out before its tokens run
            async_copy.wait_group(0)
            staged = smem.load(L5)
            stage_state_tile(smem, item + step, num_items, state_ptr, state_indices_ptr, tile, rows5, k_cols5,
                             stride_s_slot, stride_s_h, null_slot, num_slots, N_VT, HV, BV, V, K, STRIDE_S_V,
                             EXACT, STATE_EVICTION)

        # The row's tokens, clamped so that no index value can take a load out of bounds.
        start = gl.maximum(gl.load(qsl_ptr + row), 0)
        end = gl.minimum(gl.load(qsl_ptr + row + 1), num_tokens)
        length = gl.minimum(gl.maximum(end - start, 0), max_window)
        slot = gl.load(state_indices_ptr + row)
        v_rows = i_v * BV + rows2
        mask_v = v_rows < V
        if DEDUP_ROWS:
            mask_row_store = mask_v & (j2 < SLOTS)
        else:
            mask_row_store = mask_v
        item_rows = i_v * BV * STRIDE_S_V       # the item's first state row, as an offset
        q_head = h * stride_q_h
        k_head = h * stride_k_h
        v_head = hv * stride_v_h

        if slot_is_live(slot, null_slot, num_slots):
            mask_tile = ((i_v * BV + rows5) < V) & (k_cols5 < K)
            if STAGED:
                S = staged.to(gl.float32)
            else:
                state_tile = state_ptr + slot.to(gl.int64) * stride_s_slot + hv * stride_s_h + item_rows
                if EXACT:
                    S = gl.load(state_tile + tile, eviction_policy=STATE_EVICTION).to(gl.float32)
                else:
                    S = gl.load(state_tile + tile, mask=mask_tile, other=0.0,
                                eviction_policy=STATE_EVICTION).to(gl.float32)
            if GATES_PRECOMPUTED:
                neg_A = 0.0
                dt_bias = 0.0
            else:
                neg_A = -gl.exp(gl.load(A_log_ptr + hv))
                dt_bias = gl.load(dt_bias_ptr + hv)
            fetched = fetch_token(gl.minimum(start, num_tokens - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                                  stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                                  v_head, hv, k_cols, mask_k, v_rows, mask_v, ALIGNED, EXACT_K, EXACT_V,
                                  QK_EVICTION)
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
                        if hv % GROUP == 0:   # one work item per q/k head writes its key
                            key_rec = (row * H + h).to(gl.int64) * max_window + t
                            # k^ is replicated over row lanes and warps; the store writes each element once
                            gl.store(key_ptr + key_rec * K + k_cols, k_hat, mask=mask_k)
                # State stores, both from inside the loop: the snapshot after every position, and
                # native decode's final state after the last one (into the row's own slot). Keeping
                # decode's store in the loop, behind a per-token slot index, spares the registers that
                # a store after the loop would hold its addresses in for the whole window.
                if mode == MODE_SNAPSHOT:
                    dst = gl.load(snapshot_ptr + row * stride_snap_row + t)
                else:
                    dst = gl.where((mode == MODE_DECODE) & (t == length - 1), slot, null_slot)
                if slot_is_live(dst, null_slot, num_slots):
                    dst_tile = state_ptr + dst.to(gl.int64) * stride_s_slot + hv * stride_s_h + item_rows
                    if EXACT:
                        gl.store(dst_tile + tile, S.to(state_ptr.dtype.element_ty))
                    else:
                        gl.store(dst_tile + tile, S.to(state_ptr.dtype.element_ty), mask=mask_tile)
        else:
            zeros = gl.zeros([RLW, LANES_K], out_ptr.dtype.element_ty, L2)
            for t in range(0, gl.maximum(end - start, 0)):
                tok = (start + t).to(gl.int64)
                gl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + v_rows, zeros, mask=mask_row_store)
    if STAGED:
        async_copy.wait_group(0)   # no copy may outlive the program


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One launch configuration of :func:`gdn_recurrent_gluon`.

    ``lanes_k``: lanes of a warp along K (the rest along V); with ``K_PAD`` it fixes every row's
    order of additions, so calls that must agree bit for bit need the same ``lanes_k``.
    ``slots``: V rows a thread holds (at most ``lanes_k``); a work item covers ``slots * 32 /
    lanes_k * warps`` rows. Slots never change a row's arithmetic (the reduce-scatter's pairing of
    lanes is the butterfly's), so they may follow the batch. ``max_registers``: ``maxnreg``.
    ``persistent``: a grid of ``programs_per_sm`` programs per SM walking the work items;
    ``staged``: the next item's state tile is copied to shared memory (``cp.async``) while the
    current one runs. ``ptx_widen_bf16`` (fp32 states only, as in the library) and ``l2_hints``
    as in the library's launch table.
    """
    lanes_k: int = 8
    slots: int = 8
    warps: int = 1
    max_registers: Optional[int] = None
    persistent: bool = False
    staged: bool = False
    programs_per_sm: int = 8
    ptx_widen_bf16: bool = True
    l2_hints: bool = True


# The variants compile_check.py compiles and h200_check.py checks and times. Registers and spills
# (sm_90, Triton 3.6) are in NOTES.md.
VARIANTS = {
    # 128 state values a thread, one program per 32 rows of V: the library's default tile size.
    "rs8x8": Variant(),
    # 64 values a thread: twice the programs (small batches) and fewer registers (more warps per SM).
    "rs8x4": Variant(slots=4),
    # 16 lanes along K: half the token vector per thread (cheaper k/q preparation), longer
    # reduce-scatter (15 shuffles instead of 7). Not bit-compatible with lanes_k = 8.
    "rs16x16": Variant(lanes_k=16, slots=16),
    # Persistent grids that stage the next work item's state tile through shared memory.
    "rs8x8_staged": Variant(persistent=True, staged=True, programs_per_sm=8),
    "rs8x4_staged": Variant(slots=4, max_registers=168, persistent=True, staged=True, programs_per_sm=12),
}


def _pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def fit_tile(variant: Variant, K: int, V: int) -> dict:
    """The variant's tile fitted to the problem: K padded to a power of two (at least 4 values
    per lane), no more lanes along K than ``K_PAD / 4``, no more slots than lanes along K or than
    V needs."""
    k_pad = max(4, _pow2(K))
    lanes_k = max(1, min(variant.lanes_k, k_pad // 4, 32))
    row_lanes = (32 // lanes_k) * variant.warps
    slots = max(1, min(variant.slots, lanes_k, _pow2(V) // row_lanes or 1))
    return dict(K_PAD=k_pad, LANES_K=lanes_k, SLOTS=slots)


def block_v(variant: Variant, K: int, V: int) -> int:
    tile = fit_tile(variant, K, V)
    return (32 // tile["LANES_K"]) * variant.warps * tile["SLOTS"]


def launch(mode: str, q, k, v, state, state_indices, query_start_loc, gates, scale: float,
           use_qk_l2norm: bool, null_slot: int, out, records, snapshot_slots,
           variant: str | Variant = "rs8x8") -> None:
    """Run the Gluon recurrence on torch tensors, with the arguments of the library's
    ``recoverssm/backends/triton/launch.py::recurrence``.

    ``mode``: ``"verify"`` (``records`` = (correction, key, decay)), ``"decode"`` or
    ``"snapshot"`` (``snapshot_slots`` ``[B, T_max]`` int32). ``gates``: a
    ``recoverssm.core.backend.GateInputs`` (raw ``a, b, A_log, dt_bias`` or precomputed ``g,
    beta``). ``out`` ``[T, HV, V]`` is written. Token inputs whose rows are not 16-byte aligned
    are packed first (the library's rule), so every call with the same shapes and dtypes runs
    the same binary.
    """
    import torch
    from recoverssm.backends.triton.launch import MODES, INT32_MAX, _aligned_token_inputs

    var = VARIANTS[variant] if isinstance(variant, str) else variant
    q, k, v, kernel_out, aligned = _aligned_token_inputs(q, k, v, out)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = state_indices.shape[0]
    if B == 0 or T == 0:
        return
    tile = fit_tile(var, K, V)
    bv = (32 // tile["LANES_K"]) * var.warps * tile["SLOTS"]
    if mode == "verify":
        corr, key, decay = records
        max_window = corr.shape[2]
    else:
        corr = key = decay = kernel_out      # unused by these modes; any valid pointer will do
        max_window = snapshot_slots.shape[1] if mode == "snapshot" else INT32_MAX
    snap = snapshot_slots if snapshot_slots is not None else state_indices
    if gates.precomputed:
        a, b, A_log, dt_bias = gates.g, gates.beta, gates.g, gates.g
    else:
        a, b, A_log, dt_bias = gates.a, gates.b, gates.A_log, gates.dt_bias
    items = -(-V // bv) * HV * B
    if var.persistent:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (max(1, min(items, sms * var.programs_per_sm)),)
    else:
        grid = (-(-V // bv), HV, B)
    options = dict(num_warps=var.warps, enable_fp_fusion=False)
    if var.max_registers is not None:
        options["maxnreg"] = var.max_registers
    gdn_recurrent_gluon[grid](
        q, k, v, a, b, A_log, dt_bias, kernel_out, state, state_indices, query_start_loc,
        corr, key, decay, snap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), kernel_out.stride(0), kernel_out.stride(1),
        state.stride(0), state.stride(1), snap.stride(0),
        T, state.shape[0], null_slot, max_window, scale, MODES[mode], B,
        H=H, HV=HV, K=K, V=V, STRIDE_S_V=state.stride(2), **tile,
        GATES_PRECOMPUTED=bool(gates.precomputed), USE_L2NORM=bool(use_qk_l2norm), ALIGNED=aligned,
        PTX_WIDEN_BF16=var.ptx_widen_bf16 and state.dtype == torch.float32, L2_HINTS=var.l2_hints,
        PERSISTENT=var.persistent, STAGED=var.staged, **options)
    if kernel_out is not out:
        out.copy_(kernel_out)
