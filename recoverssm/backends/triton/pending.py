"""Deferred commits in the kernels: reading a row's pending step, and the plan written by ``defer``.

A context that defers its commits keeps, per KV-cache group and row of the deferred step, the
commit plan of that row (``core.types.PLAN_FIELDS``: ``[G, 6, max_batch]`` int32, one field per
row of the plan). The next step's verify kernels (recurrence and conv) read the plan of the
deferred row each of their rows continues (``pending_rows``), do what the commit would have done,
and add one to the row's ``replays``.

``pending_commit`` reads one row's entry under the index rule, whatever the values (a row that
is not a row of the plan: nothing pending; the entry itself: ``commit.plan_entry``, which the
commit kernel's flush reads too). ``defer_kernel`` writes the plan with the commit's own rule
(``commit.plan_row``).
"""
import triton
import triton.language as tl

from .commit import GROUP_BLOCK_SIZE, GROUP_BLOCK_TABLE, GROUP_BLOCK_TABLE_STRIDE, GROUP_BLOCK_TABLE_WIDTH, \
    GROUP_FIELDS, GROUP_MAX_WINDOW, GROUP_NUM_COMPUTED, GROUP_NUM_SLOTS, GROUP_REQUEST_INDICES, \
    GROUP_STATE_INDICES, PLAN_BOUNDARY, PLAN_BOUNDARY_LEN, PLAN_COMMIT_LEN, PLAN_FIELDS, PLAN_FINAL, PLAN_REPLAYS, \
    PLAN_SOURCE, plan_entry, plan_row


@triton.jit
def pending_commit(pending_rows_ptr, plan_ptr, plan_rows, row, live, null_slot, num_slots, max_len):
    """Row ``row``'s pending step: ``(plan row, n, source, final, boundary, boundary_len)`` from
    ``commit.plan_entry``, with ``n = 0`` where nothing is pending (also where ``live`` is false: a
    padding row replays nothing)."""
    prev = tl.load(pending_rows_ptr + row)
    ok = live & (prev > null_slot) & (prev >= 0) & (prev < plan_rows)
    n, source, final, boundary, boundary_len = plan_entry(plan_ptr, plan_rows, prev, ok, null_slot, num_slots,
                                                          max_len)
    return prev, n, source, final, boundary, boundary_len


@triton.jit
def verify_rows(row, slot, live, parity_ptr, pending_rows_ptr, plan_ptr, plan_rows, record_rows,
                REPLAY: tl.constexpr, null_slot, num_slots, max_len):
    """Where a verify's row reads and writes: ``(records row written, records row replayed,
    plan row, replay length, source slot, final slot, boundary slot, boundary length)``. With
    single-buffered records (``record_rows = 0``) the row's own records row and its own slot,
    nothing to replay; double-buffered, the buffer ``parity`` is written, and where the row has a
    pending step (``REPLAY``) the other buffer's row of it is replayed first."""
    zero = tl.full([], 0, tl.int32)
    write_row = row.to(tl.int64)
    read_row = write_row
    prev, n, source, final, boundary, boundary_len = zero, zero, slot, slot, null_slot + zero, zero
    if record_rows > 0:
        parity = tl.load(parity_ptr).to(tl.int64)
        write_row += parity * record_rows
        if REPLAY:
            prev, n, source, final, boundary, boundary_len = pending_commit(
                pending_rows_ptr, plan_ptr, plan_rows, row, live, null_slot, num_slots, max_len)
            read_row = (1 - parity) * record_rows + prev
            source = tl.where(n > 0, source, slot)
    return write_row, read_row, prev, n, source, final, boundary, boundary_len


@triton.jit
def count_replay(plan_ptr, plan_rows, prev):
    """One more op has replayed deferred row ``prev`` (checked by the next ``defer``)."""
    tl.atomic_add(plan_ptr + PLAN_REPLAYS * plan_rows + prev.to(tl.int64), 1)


@triton.jit
def defer_kernel(group_table_ptr, num_accepted_ptr, qsl_ptr, plan_ptr, parity_ptr, batch, plan_rows,
                 num_requests, null_slot, BLOCK: tl.constexpr):
    """Each group's commit plan of rows ``[0, plan_rows)`` (rows past ``batch``: nothing pending),
    ``replays`` zero; the first program flips the records buffer the next verify writes."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    group = tl.program_id(1)
    gt = group_table_ptr + group * GROUP_FIELDS
    request_indices = tl.load(gt + GROUP_REQUEST_INDICES)
    block_table = tl.load(gt + GROUP_BLOCK_TABLE)
    in_plan = rows < plan_rows
    n, source, final, boundary, boundary_len = plan_row(
        rows, rows < batch, num_accepted_ptr, qsl_ptr,
        tl.load(gt + GROUP_STATE_INDICES).to(tl.pointer_type(tl.int32)),
        request_indices.to(tl.pointer_type(tl.int32)), block_table.to(tl.pointer_type(tl.int32)),
        tl.load(gt + GROUP_NUM_COMPUTED).to(tl.pointer_type(tl.int32)), request_indices, block_table,
        tl.load(gt + GROUP_BLOCK_TABLE_STRIDE), tl.load(gt + GROUP_BLOCK_TABLE_WIDTH).to(tl.int32),
        tl.load(gt + GROUP_BLOCK_SIZE).to(tl.int32), num_requests, null_slot,
        tl.load(gt + GROUP_NUM_SLOTS).to(tl.int32), tl.load(gt + GROUP_MAX_WINDOW).to(tl.int32))
    source = tl.where(rows < batch, source, null_slot)
    plan = plan_ptr + group.to(tl.int64) * PLAN_FIELDS * plan_rows + rows
    tl.store(plan + PLAN_COMMIT_LEN * plan_rows, n, mask=in_plan)
    tl.store(plan + PLAN_SOURCE * plan_rows, source, mask=in_plan)
    tl.store(plan + PLAN_FINAL * plan_rows, final, mask=in_plan)
    tl.store(plan + PLAN_BOUNDARY * plan_rows, boundary, mask=in_plan)
    tl.store(plan + PLAN_BOUNDARY_LEN * plan_rows, boundary_len, mask=in_plan)
    tl.store(plan + PLAN_REPLAYS * plan_rows, tl.zeros([BLOCK], dtype=tl.int32), mask=in_plan)
    if (tl.program_id(0) == 0) & (group == 0):
        tl.store(parity_ptr, 1 - tl.load(parity_ptr))


@triton.jit
def clear_rows_kernel(plan_ptr, rows_ptr, count, plan_rows, num_groups, null_slot, BLOCK: tl.constexpr):
    """After a flush: the flushed rows have nothing pending any more (``commit_len = 0`` in every
    group). A separate launch, since every program of the flush reads the commit lengths first."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + i, mask=i < count, other=-1)
    ok = (i < count) & (rows > null_slot) & (rows >= 0) & (rows < plan_rows)
    for g in range(num_groups):
        tl.store(plan_ptr + (g * PLAN_FIELDS + PLAN_COMMIT_LEN) * plan_rows + rows.to(tl.int64),
                 tl.zeros([BLOCK], dtype=tl.int32), mask=ok)
