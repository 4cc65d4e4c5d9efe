"""The commit plan and the one-launch grouped commit.

``plan_row`` is the plan rule in Triton (the twin of ``core/plan.py::plan_rows``); it runs on
scalars inside the commit kernel (no separate plan launch) and on vectors in ``plan_commit_kernel``.

``grouped_commit_kernel`` covers every layer of every KV-cache group in one launch. Grid axis 2 is
the layer, axis 1 the batch row, axis 0 the work item: the ``HV * cdiv(V, BV)`` state tiles,
``TILES_PER_PROGRAM`` per program, then the conv-compaction blocks of that layer and row. A
program computes the row's commit plan once, whatever the tiles it replays (``commit_state_tile``:
one tile, one pass), and may hint the records and its next tile into L2 first. Per-layer base
pointers and strides come from an int64 device table built once per commit context (``LAYER_*``
columns); per-group pointers to the step's index tensors come from a second small table
(``GROUP_*`` columns). One launch covers layers that share a specialization (state dtype, head
sizes, scalar or vector decay); the launcher groups a context's layers so.
"""
import triton
import triton.language as tl

from .numerics import as_stored, is_slot, to_storage

# Columns of the per-layer table (int64). Pointers are stored with the backend's encoding.
LAYER_STATE, LAYER_STATE_SLOT_STRIDE, LAYER_STATE_HEAD_STRIDE, LAYER_STATE_V_STRIDE, \
    LAYER_NUM_SLOTS, LAYER_CORRECTION, LAYER_KEY, LAYER_DECAY, LAYER_MAX_WINDOW, \
    LAYER_CONV, LAYER_CONV_SLOT_STRIDE, LAYER_CONV_DIM_STRIDE, LAYER_CONV_COL_STRIDE, \
    LAYER_CONV_DIM, LAYER_CONV_HISTORY, LAYER_GROUP, LAYER_RECORD_ROWS = map(tl.constexpr, range(17))
LAYER_FIELDS = tl.constexpr(17)
LAYER_POINTER_COLUMNS = tuple(c.value for c in (LAYER_STATE, LAYER_CORRECTION, LAYER_KEY, LAYER_DECAY, LAYER_CONV))

# Columns of the per-group table (int64); a zero pointer means "not given".
GROUP_STATE_INDICES, GROUP_REQUEST_INDICES, GROUP_BLOCK_TABLE, GROUP_BLOCK_TABLE_STRIDE, \
    GROUP_BLOCK_TABLE_WIDTH, GROUP_NUM_COMPUTED, GROUP_BLOCK_SIZE, GROUP_NUM_SLOTS, \
    GROUP_MAX_WINDOW = map(tl.constexpr, range(9))
GROUP_FIELDS = tl.constexpr(9)
GROUP_POINTER_COLUMNS = tuple(c.value for c in (GROUP_STATE_INDICES, GROUP_REQUEST_INDICES,
                                                GROUP_BLOCK_TABLE, GROUP_NUM_COMPUTED))

# Window positions whose replay records a commit program hints into L2 up front (PREFETCH_RECORDS).
PREFETCH_RECORD_TOKENS = tl.constexpr(8)

# The rows of a deferred step's plan (core.types.PLAN_FIELDS), ``[G, PLAN_FIELDS, plan_rows]`` int32.
PLAN_COMMIT_LEN, PLAN_SOURCE, PLAN_FINAL, PLAN_BOUNDARY, PLAN_BOUNDARY_LEN, PLAN_REPLAYS = map(tl.constexpr, range(6))
PLAN_FIELDS = tl.constexpr(6)


@triton.jit
def plan_row(row, in_batch, num_accepted_ptr, qsl_ptr, state_indices_ptr, request_indices_ptr,
             block_table_ptr, num_computed_ptr, has_request_indices, align,
             bt_stride, bt_width, block_size, num_requests, null_slot, num_slots, max_len):
    """The plan rule for ``row`` (a scalar or a vector of rows, ``in_batch`` masks the tail).

    ``has_request_indices`` and ``align`` are integers, nonzero meaning yes (in the grouped
    kernel they are the table's pointers themselves). Returns
    ``(commit_len, source, final, boundary, boundary_len)``; invalid rows get
    ``(0, null, null, null, 0)``. Whatever the values: a slot that is not a slot, a request
    that is not a request or a negative ``num_computed_tokens`` makes the row (or its boundary)
    null, and the arithmetic on token counts is 64-bit, so nothing reaches an address outside
    the tensors.
    """
    # tl.where keeps the flags int1 tensors whether they arrive as runtime values or as
    # constants (Triton specializes integer arguments equal to 1).
    has_request_indices = tl.where(has_request_indices != 0, in_batch, False)
    align = tl.where(align != 0, in_batch, False)
    src = tl.load(state_indices_ptr + row, mask=in_batch, other=null_slot)
    length = (tl.load(qsl_ptr + row + 1, mask=in_batch, other=0).to(tl.int64)
              - tl.load(qsl_ptr + row, mask=in_batch, other=0).to(tl.int64))
    length = tl.minimum(tl.maximum(length, 0), max_len)
    req = tl.load(request_indices_ptr + row, mask=has_request_indices, other=0)
    req = tl.where(has_request_indices, req, row)
    req_ok = (req >= 0) & (req < num_requests)
    accepted = tl.load(num_accepted_ptr + req, mask=in_batch & req_ok, other=0)
    n = tl.minimum(tl.maximum(accepted.to(tl.int64), 0), length)
    valid = in_batch & req_ok & is_slot(src, null_slot, num_slots) & (n > 0)

    in_align = valid & align
    computed = tl.load(num_computed_ptr + req, mask=in_align, other=0).to(tl.int64)   # int64 from here on
    last_block = tl.minimum((computed + n - 1) // block_size, bt_width - 1)
    bt_row = block_table_ptr + req.to(tl.int64) * bt_stride
    final = tl.load(bt_row + last_block, mask=in_align & (computed >= 0), other=null_slot)
    final = tl.where(align, final, src)
    valid = valid & is_slot(final, null_slot, num_slots) & (computed >= 0)

    first_block = computed // block_size
    next_boundary = (first_block + 1) * block_size
    crosses = valid & align & (computed + n >= next_boundary) & (first_block < bt_width)
    candidate = tl.load(bt_row + first_block, mask=crosses, other=null_slot)
    has_boundary = crosses & (candidate != final) & is_slot(candidate, null_slot, num_slots)

    commit_len = tl.where(valid, n, 0).to(tl.int32)
    final = tl.where(valid, final, null_slot)
    boundary = tl.where(has_boundary, candidate, null_slot)
    boundary_len = tl.where(has_boundary, next_boundary - computed, 0).to(tl.int32)
    return commit_len, src, final, boundary, boundary_len


@triton.jit
def plan_entry(plan_ptr, plan_rows, prev, ok, null_slot, num_slots, max_len):
    """Row ``prev`` of a deferred step's plan (one group's ``[PLAN_FIELDS, plan_rows]``), where
    ``ok``: ``(commit_len, source, final, boundary, boundary_len)`` under the index rule, whatever
    the values: nothing to commit (``commit_len = 0``) where the commit length is not positive or
    the source or final is not a slot; the length clamped to ``max_len``, the boundary length to
    ``[0, commit_len]``; a boundary that is not a slot is none."""
    entry = plan_ptr + tl.where(ok, prev, 0).to(tl.int64)
    n = tl.load(entry + PLAN_COMMIT_LEN * plan_rows, mask=ok, other=0)
    source = tl.load(entry + PLAN_SOURCE * plan_rows, mask=ok, other=null_slot)
    final = tl.load(entry + PLAN_FINAL * plan_rows, mask=ok, other=null_slot)
    boundary = tl.load(entry + PLAN_BOUNDARY * plan_rows, mask=ok, other=null_slot)
    boundary_len = tl.load(entry + PLAN_BOUNDARY_LEN * plan_rows, mask=ok, other=0)
    ok = ok & (n > 0) & is_slot(source, null_slot, num_slots) & is_slot(final, null_slot, num_slots)
    n = tl.where(ok, tl.minimum(n, max_len), 0)
    boundary_len = tl.where(ok & is_slot(boundary, null_slot, num_slots), tl.minimum(tl.maximum(boundary_len, 0), n),
                            0)
    boundary = tl.where(boundary_len > 0, boundary, null_slot)
    return n, source, final, boundary, boundary_len


@triton.jit
def plan_commit_kernel(num_accepted_ptr, qsl_ptr, state_indices_ptr, request_indices_ptr,
                       block_table_ptr, num_computed_ptr,
                       commit_len_ptr, final_ptr, boundary_ptr, boundary_len_ptr,
                       batch, has_request_indices, align, bt_stride, bt_width, block_size,
                       num_requests, null_slot, num_slots, max_len, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = rows < batch
    n, _, final, boundary, boundary_len = plan_row(
        rows, in_batch, num_accepted_ptr, qsl_ptr, state_indices_ptr, request_indices_ptr,
        block_table_ptr, num_computed_ptr, has_request_indices, align,
        bt_stride, bt_width, block_size, num_requests, null_slot, num_slots, max_len)
    tl.store(commit_len_ptr + rows, n, mask=in_batch)
    tl.store(final_ptr + rows, final, mask=in_batch)
    tl.store(boundary_ptr + rows, boundary, mask=in_batch)
    tl.store(boundary_len_ptr + rows, boundary_len, mask=in_batch)


@triton.jit
def table_entry(table_row, column, ALIGNED: tl.constexpr, MULTIPLE: tl.constexpr):
    """Load one int64 table entry (a stride); with ``ALIGNED`` promise the compiler it is a
    multiple of ``MULTIPLE`` (the committer checked it on the host)."""
    value = tl.load(table_row + column)
    if ALIGNED:
        value = tl.multiple_of(value, MULTIPLE)
    return value


@triton.jit
def table_pointer(table_row, column, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Cast one table entry back to a ``DTYPE`` pointer; with ``ALIGNED`` promise 16-byte
    alignment, which lets the compiler use 16-byte vector accesses."""
    pointer = tl.load(table_row + column).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def load_record(corr_row, key_row, decay_row, t, valid, offs_v, mask_v, offs_k, mask_k,
                V: tl.constexpr, K: tl.constexpr, VECTOR_DECAY: tl.constexpr):
    """Window position ``t``'s replay record; where not ``valid``, nothing past position 0 is read
    (the values are then unused). The decay is a scalar, or with ``VECTOR_DECAY`` (KDA) a
    K-vector."""
    correction = tl.load(corr_row + t * V + offs_v, mask=tl.where(valid, mask_v, False), other=0.0)
    k_hat = tl.load(key_row + t * K + offs_k, mask=tl.where(valid, mask_k, False), other=0.0)
    if VECTOR_DECAY:
        decay = tl.load(decay_row + t * K + offs_k, mask=tl.where(valid, mask_k, False), other=0.0)
    else:
        decay = tl.load(decay_row + tl.where(valid, t, 0))
    return correction, k_hat, decay


@triton.jit
def replay_step(S, correction, k_hat, decay, VECTOR_DECAY: tl.constexpr, STATE_DTYPE: tl.constexpr,
                ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr, PTX_ROUND_BF16: tl.constexpr):
    """``S = fma(c, k^, S * d)`` on a ``[BV, K_PAD]`` tile (with ``ROUND_EACH_TOKEN``, rounded to
    the pool's dtype, ``as_stored``, as verify rounds its running state); ``d`` scales every
    element (GDN) or column ``j`` by ``d[j]`` (KDA)."""
    if VECTOR_DECAY:
        decayed = S * decay[None, :]
    else:
        decayed = S * decay
    return as_stored(tl.fma(correction[:, None], k_hat[None, :], decayed), STATE_DTYPE, ROUND_EACH_TOKEN,
                     INTERPRETED, PTX_ROUND_BF16)


@triton.jit
def replay_tokens(S, corr_row, key_row, decay_row, first, last, offs_v, mask_v, offs_k, mask_k,
                  V: tl.constexpr, K: tl.constexpr, PAIRS: tl.constexpr, VECTOR_DECAY: tl.constexpr,
                  STATE_DTYPE: tl.constexpr, ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr,
                  PTX_ROUND_BF16: tl.constexpr):
    """``S = fma(c_t, k^_t, S * d_t)`` for window positions ``first <= t < last`` (``[BV, K_PAD]`` tile).

    A token waits for its replay record (a few hundred bytes) unless the load went out earlier:
    that wait, once per token, is a large part of a commit program's life (docs/BENCHMARKS.md).
    By default the next position's
    record is loaded while the current one is applied. With ``PAIRS`` the records of two
    positions are loaded together and then both applied: one wait per two tokens, and no record
    held across iterations (the one-ahead load of a pair needs more registers than a bf16 tile's
    cap leaves). The same products in the same order either way."""
    if PAIRS:
        for t in range(first, last, 2):
            c0, k0, d0 = load_record(corr_row, key_row, decay_row, t, True, offs_v, mask_v, offs_k, mask_k, V, K,
                                     VECTOR_DECAY)
            c1, k1, d1 = load_record(corr_row, key_row, decay_row, t + 1, t + 1 < last,
                                     offs_v, mask_v, offs_k, mask_k, V, K, VECTOR_DECAY)
            S = replay_step(S, c0, k0, d0, VECTOR_DECAY, STATE_DTYPE, ROUND_EACH_TOKEN, INTERPRETED, PTX_ROUND_BF16)
            if t + 1 < last:
                S = replay_step(S, c1, k1, d1, VECTOR_DECAY, STATE_DTYPE, ROUND_EACH_TOKEN, INTERPRETED, PTX_ROUND_BF16)
    else:
        correction, k_hat, decay = load_record(corr_row, key_row, decay_row, first, first < last,
                                               offs_v, mask_v, offs_k, mask_k, V, K, VECTOR_DECAY)
        for t in range(first, last):
            next_correction, next_k_hat, next_decay = load_record(
                corr_row, key_row, decay_row, t + 1, t + 1 < last, offs_v, mask_v, offs_k, mask_k, V, K, VECTOR_DECAY)
            S = replay_step(S, correction, k_hat, decay, VECTOR_DECAY, STATE_DTYPE, ROUND_EACH_TOKEN, INTERPRETED,
                            PTX_ROUND_BF16)
            correction, k_hat, decay = next_correction, next_k_hat, next_decay
    return S


@triton.jit
def layer_state(lt, STATE_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The layer's state pool: ``(pointer, slot stride, head stride, V-row stride)``, in elements."""
    VEC: tl.constexpr = 128 // STATE_DTYPE.primitive_bitwidth  # elements per 16 bytes
    return (table_pointer(lt, LAYER_STATE, STATE_DTYPE, ALIGNED),
            table_entry(lt, LAYER_STATE_SLOT_STRIDE, ALIGNED, VEC),
            table_entry(lt, LAYER_STATE_HEAD_STRIDE, ALIGNED, VEC),
            table_entry(lt, LAYER_STATE_V_STRIDE, ALIGNED, VEC))


@triton.jit
def tile_rows(tile_index, BV: tl.constexpr, V_TILES: tl.constexpr):
    """The ``BV`` V rows of state tile ``tile_index`` within its value head."""
    return (tile_index % V_TILES) * BV + tl.arange(0, BV)


@triton.jit
def tile_offsets(tile_index, head_stride, v_stride, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr,
                 BV: tl.constexpr, V_TILES: tl.constexpr):
    """Offsets within a slot of state tile ``tile_index`` (``BV`` rows of value head
    ``tile_index // V_TILES``), and its mask."""
    offs_v = tile_rows(tile_index, BV, V_TILES)
    offs_k = tl.arange(0, K_PAD)
    offsets = (tile_index // V_TILES) * head_stride + offs_v[:, None] * v_stride + offs_k[None, :]
    return offsets, (offs_v < V)[:, None] & (offs_k < K)[None, :]


@triton.jit
def record_rows(corr, key, decay, row, tile_index, max_window, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, V_TILES: tl.constexpr, VECTOR_DECAY: tl.constexpr):
    """Pointers to the replay records of records row ``row`` (the batch row, plus the buffer's
    first row where records are double-buffered) that state tile ``tile_index`` reads: its value
    head's corrections (``[max_window, V]``), its q/k head's keys (``[max_window, K]``) and its
    value head's decays (``[max_window]``, or ``[max_window, K]`` for KDA)."""
    hv = tile_index // V_TILES
    h = hv // (HV // H)
    row = row.to(tl.int64)
    DECAY_SIZE: tl.constexpr = K if VECTOR_DECAY else 1
    return (corr + (row * HV + hv) * max_window * V,
            key + (row * H + h) * max_window * K,
            decay + (row * HV + hv) * max_window * DECAY_SIZE)


@triton.jit
def prefetch_to_l2(pointers, wanted, fallback):
    """A hint, no value read: bring the 128-byte lines at ``pointers`` into L2, where ``wanted``
    (elsewhere ``fallback``, an address known to be valid, so that no hint ever leaves the
    tensors). PTX: compiled kernels on NVIDIA GPUs only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [tl.where(wanted, pointers, fallback)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_records(corr_row, key_row, decay_row, n, tile_index, K: tl.constexpr, V: tl.constexpr,
                     K_PAD: tl.constexpr, BV: tl.constexpr, V_TILES: tl.constexpr, TOKENS: tl.constexpr,
                     VECTOR_DECAY: tl.constexpr):
    """Hint the first ``min(n, TOKENS)`` records of a state tile into L2 (its corrections' rows,
    its keys, and with ``VECTOR_DECAY`` its K-vectors of decays; a scalar decay shares its line
    with the next tokens'): the replay then finds them there instead of waiting for memory token
    by token."""
    C_LINES: tl.constexpr = (BV + 31) // 32  # 32 fp32 values per line
    i = tl.arange(0, TOKENS * C_LINES)
    t = i // C_LINES
    v = (tile_index % V_TILES) * BV + (i % C_LINES) * 32
    prefetch_to_l2(corr_row + t * V + v, (t < n) & (v < V), corr_row)
    K_LINES: tl.constexpr = (K_PAD + 31) // 32
    i = tl.arange(0, TOKENS * K_LINES)
    t = i // K_LINES
    k = (i % K_LINES) * 32
    prefetch_to_l2(key_row + t * K + k, (t < n) & (k < K), key_row)
    if VECTOR_DECAY:
        prefetch_to_l2(decay_row + t * K + k, (t < n) & (k < K), decay_row)


@triton.jit
def prefetch_state_tile(source, tile_index, head_stride, v_stride, K: tl.constexpr, V: tl.constexpr,
                        K_PAD: tl.constexpr, BV: tl.constexpr, V_TILES: tl.constexpr, STATE_DTYPE: tl.constexpr):
    """Hint state tile ``tile_index`` of the slot at ``source`` into L2, one hint per line."""
    LINE: tl.constexpr = 1024 // STATE_DTYPE.primitive_bitwidth  # elements per 128 bytes
    ROW_LINES: tl.constexpr = (K_PAD + LINE - 1) // LINE
    i = tl.arange(0, BV * ROW_LINES)
    v = (tile_index % V_TILES) * BV + i // ROW_LINES
    k = (i % ROW_LINES) * LINE
    prefetch_to_l2(source + (tile_index // V_TILES) * head_stride + v * v_stride + k, (v < V) & (k < K), source)


@triton.jit
def commit_state_tile(state, slot_stride, offsets, mask, corr, key, decay,
                      row, tile_index, source_tile, n, final, boundary, boundary_len, max_window, null_slot,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      K_PAD: tl.constexpr, BV: tl.constexpr, V_TILES: tl.constexpr,
                      STATE_DTYPE: tl.constexpr, REPLAY_PAIRS: tl.constexpr, VECTOR_DECAY: tl.constexpr,
                      ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr, PTX_ROUND_BF16: tl.constexpr):
    """One ``[BV, K_PAD]`` state tile of one row and layer (``offsets``, ``mask``: from
    ``tile_offsets``), already read from the source slot (``source_tile``, storage dtype): replay
    the accepted records (``corr``, ``key``, ``decay``: the layer's record pointers; ``row``: the
    records' row), store the boundary and final states."""
    offs_v = tile_rows(tile_index, BV, V_TILES)
    mask_v = offs_v < V
    offs_k = tl.arange(0, K_PAD)
    mask_k = offs_k < K
    corr_row, key_row, decay_row = record_rows(corr, key, decay, row, tile_index, max_window, H, HV, K, V, V_TILES,
                                               VECTOR_DECAY)

    S = source_tile.to(tl.float32)
    S = replay_tokens(S, corr_row, key_row, decay_row, 0, boundary_len, offs_v, mask_v, offs_k, mask_k, V, K,
                      REPLAY_PAIRS, VECTOR_DECAY, STATE_DTYPE, ROUND_EACH_TOKEN, INTERPRETED, PTX_ROUND_BF16)
    if boundary > null_slot:
        tl.store(state + boundary.to(tl.int64) * slot_stride + offsets, to_storage(S, STATE_DTYPE, INTERPRETED),
                 mask=mask)
    S = replay_tokens(S, corr_row, key_row, decay_row, boundary_len, n, offs_v, mask_v, offs_k, mask_k, V, K,
                      REPLAY_PAIRS, VECTOR_DECAY, STATE_DTYPE, ROUND_EACH_TOKEN, INTERPRETED, PTX_ROUND_BF16)
    tl.store(state + final.to(tl.int64) * slot_stride + offsets, to_storage(S, STATE_DTYPE, INTERPRETED), mask=mask)


@triton.jit
def step_plan(lt, group, row, group_table_ptr, num_accepted_ptr, qsl_ptr, plan_ptr, parity_ptr, flush_rows_ptr,
              num_requests, null_slot, plan_rows, num_slots, max_window, FLUSH: tl.constexpr):
    """Grid row ``row``'s ``(row, records row, commit_len, source, final, boundary, boundary_len)``
    for layer table row ``lt`` of KV-cache group ``group``: from the step's index tensors
    (``plan_row``), or with ``FLUSH`` the deferred plan of the row ``flush_rows`` lists at ``row``,
    whose records are in the buffer ``1 - parity``."""
    if FLUSH:
        row = tl.load(flush_rows_ptr + row)
        in_plan = (row > null_slot) & (row >= 0) & (row < plan_rows)
        n, src, final, boundary, boundary_len = plan_entry(
            plan_ptr + group * PLAN_FIELDS * plan_rows, plan_rows, row, in_plan, null_slot, num_slots, max_window)
        record_row = (1 - tl.load(parity_ptr)).to(tl.int64) * tl.load(lt + LAYER_RECORD_ROWS) + row
    else:
        gt = group_table_ptr + group * GROUP_FIELDS
        request_indices = tl.load(gt + GROUP_REQUEST_INDICES)
        block_table = tl.load(gt + GROUP_BLOCK_TABLE)
        n, src, final, boundary, boundary_len = plan_row(
            row, row >= 0, num_accepted_ptr, qsl_ptr,
            tl.load(gt + GROUP_STATE_INDICES).to(tl.pointer_type(tl.int32)),
            request_indices.to(tl.pointer_type(tl.int32)),
            block_table.to(tl.pointer_type(tl.int32)),
            tl.load(gt + GROUP_NUM_COMPUTED).to(tl.pointer_type(tl.int32)),
            request_indices, block_table,
            tl.load(gt + GROUP_BLOCK_TABLE_STRIDE), tl.load(gt + GROUP_BLOCK_TABLE_WIDTH).to(tl.int32),
            tl.load(gt + GROUP_BLOCK_SIZE).to(tl.int32),
            num_requests, null_slot, num_slots, max_window)
        record_row = row.to(tl.int64)
    return row, record_row, n, src, final, boundary, boundary_len


@triton.jit
def grouped_commit_kernel(
    layer_table_ptr, group_table_ptr, num_accepted_ptr, qsl_ptr, plan_ptr, parity_ptr, flush_rows_ptr,
    num_requests, null_slot, plan_rows,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    K_PAD: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, CONV_COLS: tl.constexpr,
    STATE_DTYPE: tl.constexpr, CONV_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    PREFETCH_RECORDS: tl.constexpr, PREFETCH_NEXT_TILE: tl.constexpr, REPLAY_PAIRS: tl.constexpr,
    VECTOR_DECAY: tl.constexpr, FLUSH: tl.constexpr, INTERPRETED: tl.constexpr, ROUND_EACH_TOKEN: tl.constexpr,
    PTX_ROUND_BF16: tl.constexpr,
):
    """One step's commit (the plan of each row from the step's index tensors), or with ``FLUSH``
    the pending step of a deferred context for the rows ``flush_rows`` lists (each row's plan
    read from ``plan``, its records from the buffer ``1 - parity``; ``plan_ptr``, ``parity_ptr``
    and ``flush_rows_ptr`` are unused otherwise)."""
    item = tl.program_id(0)
    row = tl.program_id(1)
    layer = tl.program_id(2)
    V_TILES: tl.constexpr = (V + BV - 1) // BV

    lt = layer_table_ptr + layer * LAYER_FIELDS
    group = tl.load(lt + LAYER_GROUP)
    max_window = tl.load(lt + LAYER_MAX_WINDOW).to(tl.int32)
    num_slots = tl.load(lt + LAYER_NUM_SLOTS).to(tl.int32)
    row, record_row, n, src, final, boundary, boundary_len = step_plan(
        lt, group, row, group_table_ptr, num_accepted_ptr, qsl_ptr, plan_ptr, parity_ptr, flush_rows_ptr,
        num_requests, null_slot, plan_rows, num_slots, max_window, FLUSH)

    TILES: tl.constexpr = HV * V_TILES
    TILE_ITEMS: tl.constexpr = (TILES + TILES_PER_PROGRAM - 1) // TILES_PER_PROGRAM
    if n > 0:
        if item < TILE_ITEMS:
            state, slot_stride, head_stride, v_stride = layer_state(lt, STATE_DTYPE, ALIGNED)
            source = state + src.to(tl.int64) * slot_stride
            corr = table_pointer(lt, LAYER_CORRECTION, tl.float32, ALIGNED)
            key = table_pointer(lt, LAYER_KEY, tl.float32, ALIGNED)
            decay = table_pointer(lt, LAYER_DECAY, tl.float32, False)
            first_tile = item * TILES_PER_PROGRAM
            if PREFETCH_RECORDS:
                for j in tl.static_range(TILES_PER_PROGRAM):
                    if first_tile + j < TILES:
                        corr_row, key_row, decay_row = record_rows(corr, key, decay, record_row, first_tile + j,
                                                                   max_window, H, HV, K, V, V_TILES, VECTOR_DECAY)
                        prefetch_records(corr_row, key_row, decay_row, n, first_tile + j, K, V, K_PAD, BV,
                                         V_TILES, PREFETCH_RECORD_TOKENS, VECTOR_DECAY)
            # Several tiles per program share the plan above (a chain of dependent loads). A
            # source tile is read before anything is stored (the boundary or final slot may be
            # the source slot itself; other tiles of it are other addresses).
            for j in range(TILES_PER_PROGRAM):
                tile_index = first_tile + j
                offsets, mask = tile_offsets(tile_index, head_stride, v_stride, K, V, K_PAD, BV, V_TILES)
                tile = tl.load(source + offsets, mask=tl.where(tile_index < TILES, mask, False), other=0.0)
                if PREFETCH_NEXT_TILE:
                    if (j + 1 < TILES_PER_PROGRAM) & (tile_index + 1 < TILES):
                        prefetch_state_tile(source, tile_index + 1, head_stride, v_stride, K, V, K_PAD, BV,
                                            V_TILES, STATE_DTYPE)
                if tile_index < TILES:
                    commit_state_tile(state, slot_stride, offsets, mask, corr, key, decay,
                                      record_row, tile_index, tile, n, final, boundary, boundary_len, max_window,
                                      null_slot, H, HV, K, V, K_PAD, BV, V_TILES, STATE_DTYPE, REPLAY_PAIRS,
                                      VECTOR_DECAY, ROUND_EACH_TOKEN, INTERPRETED, PTX_ROUND_BF16)
        else:
            conv = tl.load(lt + LAYER_CONV)
            conv_dim = tl.load(lt + LAYER_CONV_DIM)
            offs_d = (item - TILE_ITEMS) * BD + tl.arange(0, BD)
            if (conv != 0) & ((item - TILE_ITEMS) * BD < conv_dim):
                # dst[:, :history] = src[:, n : n + history] (and boundary_len for the boundary
                # slot); the whole source window is loaded before either store.
                conv_state = conv.to(tl.pointer_type(CONV_DTYPE))
                history = tl.load(lt + LAYER_CONV_HISTORY)
                col_stride = tl.load(lt + LAYER_CONV_COL_STRIDE)
                chan = offs_d[:, None] * tl.load(lt + LAYER_CONV_DIM_STRIDE)
                cols = tl.arange(0, CONV_COLS)[None, :]
                slot_stride = tl.load(lt + LAYER_CONV_SLOT_STRIDE)
                mask_d = (offs_d < conv_dim)[:, None]
                src_row = conv_state + src.to(tl.int64) * slot_stride + chan
                keep = mask_d & (cols < history)
                final_cols = tl.load(src_row + (cols + n) * col_stride, mask=keep, other=0.0)
                boundary_cols = tl.load(src_row + (cols + boundary_len) * col_stride,
                                        mask=tl.where(boundary > null_slot, keep, False), other=0.0)
                tl.debug_barrier()
                if boundary > null_slot:
                    tl.store(conv_state + boundary.to(tl.int64) * slot_stride + chan + cols * col_stride,
                             boundary_cols, mask=keep)
                tl.store(conv_state + final.to(tl.int64) * slot_stride + chan + cols * col_stride,
                         final_cols, mask=keep)
