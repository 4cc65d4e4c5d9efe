"""The commit plan rules, one row at a time, on host lists.

This is the plan written as plainly as possible. The ``cpu_ref`` backend commits with it,
validation uses it to find the slots a commit would write, and every other backend's plan (the
GPU commit computes it inside the kernel) must agree with it.
"""
from __future__ import annotations

from typing import Optional

from .indices import INT32_MAX, is_request, is_slot

NO_SLOT_LIMIT = INT32_MAX


def plan_rows(num_accepted: list[int], state_indices: list[int], qsl: list[int],
              request_indices: Optional[list[int]], block_table: Optional[list[list[int]]],
              num_computed_tokens: Optional[list[int]], block_size: int, null_slot: int,
              num_slots: int, max_len: int = INT32_MAX) -> list[tuple[int, int, int, int]]:
    """``(commit_len, final_slot, boundary_slot, boundary_len)`` for each batch row.

    Whatever the values (the index rule, ``core/indices.py``): a slot that is not a slot is
    null, so a row whose source or final slot is not one writes nothing; so does a row whose
    request index is not a request or whose ``num_computed_tokens`` is negative; the commit
    length is clamped to ``[0, min(len, max_len)]`` (``max_len``: the records' window) and the
    final block column to the table's width.
    Validation rejects such values before this on CPU (and on GPU with ``check=True``); the
    kernels follow these same rules, in 64-bit arithmetic where Python's integers are exact.
    """
    def real(slot: int) -> bool:
        return is_slot(slot, null_slot, num_slots)

    plan = []
    for r, src in enumerate(state_indices):
        q = request_indices[r] if request_indices is not None else r
        length = min(qsl[r + 1] - qsl[r], max_len)
        if not is_request(q, len(num_accepted)):
            plan.append((0, null_slot, null_slot, 0))
            continue
        n = min(max(num_accepted[q], 0), length)
        if not real(src) or n <= 0:
            plan.append((0, null_slot, null_slot, 0))
            continue
        if block_table is None:
            plan.append((n, src, null_slot, 0))
            continue
        blocks = block_table[q]
        width = len(blocks)
        nc = num_computed_tokens[q]
        if nc < 0:
            plan.append((0, null_slot, null_slot, 0))
            continue
        final = blocks[min((nc + n - 1) // block_size, width - 1)]
        if not real(final):
            plan.append((0, null_slot, null_slot, 0))
            continue
        first_block = nc // block_size
        next_boundary = (first_block + 1) * block_size
        boundary, boundary_len = null_slot, 0
        if nc + n >= next_boundary and first_block < width:
            cand = blocks[first_block]
            if cand != final and real(cand):
                boundary, boundary_len = cand, next_boundary - nc
        plan.append((n, final, boundary, boundary_len))
    return plan




def plan_entry(fields: list[list[int]], row: int, null_slot: int, num_slots: int,
               max_len: int) -> tuple[int, int, int, int, int]:
    """Row ``row`` of a deferred step's plan (one group's ``PLAN_FIELDS`` lists), as every backend
    reads it, whatever the values: ``(commit_len, source, final, boundary, boundary_len)``;
    nothing to commit (``commit_len = 0``) for a row that is not a row of the plan, a commit
    length that is not positive, or a source or final that is not a slot; the length clamped to
    ``max_len`` (the records' window), the boundary length to ``[0, commit_len]``, a boundary
    that is not a slot (or has no length) none."""
    if not (row > null_slot and 0 <= row < len(fields[0])):
        return 0, null_slot, null_slot, null_slot, 0
    n, source, final, boundary, boundary_len = (fields[i][row] for i in range(5))
    if n <= 0 or not is_slot(source, null_slot, num_slots) or not is_slot(final, null_slot, num_slots):
        return 0, source, final, null_slot, 0
    n = min(n, max_len)
    boundary_len = min(max(boundary_len, 0), n) if is_slot(boundary, null_slot, num_slots) else 0
    return n, source, final, boundary if boundary_len > 0 else null_slot, boundary_len
