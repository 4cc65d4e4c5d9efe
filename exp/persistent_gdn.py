"""Experiment: persistent recurrence kernel whose state-tile loads Triton's pipeliner may stage
through shared memory while the previous tile's token loop runs."""
import triton
import triton.language as tl

from recoverssm.backends.triton.gdn import (MODE_DECODE, MODE_SNAPSHOT, MODE_VERIFY, delta_rule_step,
                                            fetch_token, load_masked, prepare_token, store_masked,
                                            _RUNTIME_SCALARS, _TOKEN_POINTERS)
from recoverssm.backends.triton.numerics import to_storage


@triton.jit(do_not_specialize=_RUNTIME_SCALARS + ["num_tiles"], do_not_specialize_on_alignment=_TOKEN_POINTERS)
def persistent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr,
    state_ptr, state_indices_ptr, qsl_ptr,
    corr_ptr, key_ptr, decay_ptr, snapshot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_a_t, stride_b_t, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_snap_row,
    num_tokens, num_slots, null_slot, max_window, scale, mode, num_tiles,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, STRIDE_S_V: tl.constexpr,
    K_PAD: tl.constexpr, K_INNER: tl.constexpr, ROWS: tl.constexpr, ROW_LANES: tl.constexpr,
    GATES_PRECOMPUTED: tl.constexpr, USE_L2NORM: tl.constexpr, ALIGNED: tl.constexpr,
    TILE_STAGES: tl.constexpr,
):
    K_CHUNKS: tl.constexpr = K_PAD // K_INNER
    BV: tl.constexpr = ROWS * ROW_LANES
    V_TILES: tl.constexpr = (V + BV - 1) // BV
    EXACT_K: tl.constexpr = K == K_PAD
    EXACT_V: tl.constexpr = V % BV == 0
    EXACT: tl.constexpr = EXACT_K and EXACT_V
    lane_v = tl.arange(0, ROW_LANES)
    chunk = tl.arange(0, K_CHUNKS)
    offs_k = (tl.arange(0, K_INNER)[None, None, :, None] + chunk[None, None, None, :] * K_INNER
              + 0 * lane_v[:, None, None, None])
    mask_k = offs_k < K
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=TILE_STAGES):
        i_v = tile_id % V_TILES
        hv = (tile_id // V_TILES) % HV
        row = tile_id // (V_TILES * HV)
        h = hv // (HV // H)
        start = tl.maximum(tl.load(qsl_ptr + row), 0)
        end = tl.minimum(tl.load(qsl_ptr + row + 1), num_tokens)
        length = tl.minimum(tl.maximum(end - start, 0), max_window)
        slot = tl.load(state_indices_ptr + row)
        live = (slot > null_slot) & (slot < num_slots)
        offs_v = i_v * BV + lane_v[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
        mask_v = offs_v < V
        tile = offs_v[:, :, None, None] * STRIDE_S_V + offs_k
        slot_b = offs_k * 0 + slot
        mask_tile = mask_v[:, :, None, None] & mask_k & (slot_b > null_slot) & (slot_b < num_slots)
        q_head = h * stride_q_h
        k_head = h * stride_k_h
        v_head = hv * stride_v_h
        safe_slot = tl.where(live, slot, 0)
        state_tile = state_ptr + safe_slot.to(tl.int64) * stride_s_slot + hv * stride_s_h
        S = tl.load(state_tile + tile, mask=mask_tile, other=0.0).to(tl.float32)
        if live:
            if GATES_PRECOMPUTED:
                neg_A = 0.0
                dt_bias = 0.0
            else:
                neg_A = -tl.exp(tl.load(A_log_ptr + hv))
                dt_bias = tl.load(dt_bias_ptr + hv)
            fetched = fetch_token(tl.minimum(start, num_tokens - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                                  stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                                  v_head, hv, offs_k, mask_k, offs_v, mask_v, ALIGNED, EXACT_K, EXACT_V)
            for t in range(0, length):
                k_t, q_t, v_t, a_t, b_t = fetched
                fetched = fetch_token(start + tl.minimum(t + 1, length - 1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                                      stride_q_t, stride_k_t, stride_v_t, stride_a_t, stride_b_t, q_head, k_head,
                                      v_head, hv, offs_k, mask_k, offs_v, mask_v, ALIGNED, EXACT_K, EXACT_V)
                k_hat, q_hat, v_t, decay, beta = prepare_token(k_t, q_t, v_t, a_t, b_t, neg_A, dt_bias, scale,
                                                               GATES_PRECOMPUTED, USE_L2NORM)
                S, correction, o_t = delta_rule_step(S, k_hat, q_hat, v_t, beta, decay)
                tok = (start + t).to(tl.int64)
                store_masked(out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v,
                             o_t.to(out_ptr.dtype.element_ty), mask_v, EXACT_V)
                if mode == MODE_VERIFY:
                    rec = (row * HV + hv).to(tl.int64) * max_window + t
                    store_masked(corr_ptr + rec * V + offs_v, correction, mask_v, EXACT_V)
                    if i_v == 0:
                        tl.store(decay_ptr + rec, decay)
                        if hv % (HV // H) == 0:
                            key_rec = (row * H + h).to(tl.int64) * max_window + t
                            writer = (chunk[None, None, None, :] % ROW_LANES) == lane_v[:, None, None, None]
                            tl.store(key_ptr + key_rec * K + offs_k, k_hat, mask=mask_k & writer)
                if mode == MODE_SNAPSHOT:
                    dst = tl.load(snapshot_ptr + row * stride_snap_row + t)
                else:
                    dst = tl.where((mode == MODE_DECODE) & (t == length - 1), slot, null_slot)
                if (dst > null_slot) & (dst < num_slots):
                    dst_tile = state_ptr + dst.to(tl.int64) * stride_s_slot + hv * stride_s_h
                    store_masked(dst_tile + tile, to_storage(S, state_ptr.dtype.element_ty), mask_tile, EXACT)
        else:
            zeros = tl.zeros([ROW_LANES, ROWS], dtype=out_ptr.dtype.element_ty)
            for t in range(0, tl.maximum(end - start, 0)):
                tok = (start + t).to(tl.int64)
                tl.store(out_ptr + tok * stride_o_t + hv * stride_o_h + offs_v, zeros, mask=mask_v)
