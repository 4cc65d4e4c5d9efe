"""The index rule, in one place.

Every index an op reads from a tensor (``state_indices``, ``snapshot_slots``, block-table
entries, ``request_indices``) is one of:

* **padding**: a value ``<= null_slot`` (a slot index) : the row or entry reads and writes
  nothing;
* **an index**: a value in ``[0, num_slots)`` (or ``[0, num_requests)``) and above ``null_slot``;
* **anything else** (between ``null_slot`` and 0, or too large): rejected with a ``ValueError``
  where value checks run, and treated as padding by every kernel, whatever the values.

The kernels' twin of :func:`is_slot` is ``backends/triton/indices.py``; ``cpu_ref`` and the plan
rules call this one. Index arithmetic that can grow past 32 bits (``num_computed_tokens + n``,
block columns times strides) is done in 64-bit integers by every backend.
"""
from __future__ import annotations

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def is_slot(value: int, null_slot: int, num_slots: int) -> bool:
    """True when ``value`` names a slot of a pool of ``num_slots``: above ``null_slot`` and in
    ``[0, num_slots)``."""
    return value > null_slot and 0 <= value < num_slots


def is_request(value: int, num_requests: int) -> bool:
    """True when ``value`` names a request row in ``[0, num_requests)``."""
    return 0 <= value < num_requests
