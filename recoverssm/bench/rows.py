"""One benchmark row: a time with the bytes it moved, against a device copy of the same bytes."""
from __future__ import annotations

from .timing import CopyCeiling


def row(kind: str, case: str, us: float, traffic: int, ceiling: CopyCeiling, **extra) -> dict:
    """``vs_copy``: the copy's time over this time (1.0 = at copy bandwidth)."""
    copy_us = ceiling.us(traffic)
    return dict(kind=kind, case=case, us=round(us, 2), traffic_bytes=traffic,
                tbps=round(traffic / us / 1e6, 3), copy_us=round(copy_us, 2),
                copy_tbps=round(traffic / copy_us / 1e6, 3), vs_copy=round(copy_us / us, 3), **extra)
