"""One benchmark row: a time with the bytes it moved, against a device copy of the same bytes."""
from __future__ import annotations

from typing import Callable

from .timing import CopyCeiling, median_us


def row(kind: str, case: str, us: float, traffic: int, ceiling: CopyCeiling, **extra) -> dict:
    """``vs_copy``: the copy's time over this time (1.0 = at copy bandwidth)."""
    copy_us = ceiling.us(traffic)
    return dict(kind=kind, case=case, us=round(us, 2), traffic_bytes=traffic,
                tbps=round(traffic / us / 1e6, 3), copy_us=round(copy_us, 2),
                copy_tbps=round(traffic / copy_us / 1e6, 3), vs_copy=round(copy_us / us, 3), **extra)


def peer_row(kind: str, case: str, make_calls: Callable[[], list], verify_us: float, traffic: int,
             ceiling: CopyCeiling, **extra) -> dict:
    """A peer kernel's row on the same windows (``verify_speedup``: its time over ours), or, when
    building or timing its calls raises, a row with the error (the caller then stops asking it)."""
    try:
        us = median_us(make_calls())
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        return dict(kind=kind, case=case, error=f"{type(exc).__name__}: {exc}"[:300])
    return row(kind, case, us, traffic, ceiling, **extra, verify_speedup=round(us / verify_us, 3))
