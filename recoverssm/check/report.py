"""The report of ``recoverssm check``: one item per comparison, its tolerance, and the table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch

from recoverssm.console import format_table

#: the backend every other one is compared with
REF = "cpu_ref"

#: relative tolerance by the dtype a value is stored in: for fp32, room for another device's
#: rounding of ``exp`` or order of a sum; for bf16 and fp16, about one ulp of the stored value
#: (bf16: 2**-8 of it, fp16: 2**-10)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
T = TypeVar("T")


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16`` or ``fp16``: the short names of the case labels."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@dataclass
class Item:
    """One row of the report. ``tol`` None means exact (``torch.equal``)."""

    case: str
    name: str
    status: str                      # "pass", "FAIL", "skip", "error"
    max_abs: Optional[float] = None
    rel: Optional[float] = None
    tol: Optional[float] = None
    note: str = ""


def diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want|, that / max |want|)`` on CPU in float64; inf on shape mismatch or NaN."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if got.numel() == 0:
        return 0.0, 0.0
    d = (got.double() - want.double()).abs()
    if torch.isnan(d).any():
        return float("inf"), float("inf")
    max_abs = d.max().item()
    scale = want.double().abs().max().item()
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return max_abs, rel


class Report:
    """The items of one check run, in the order they were checked."""

    def __init__(self):
        self.items: list[Item] = []

    def close(self, case: str, name: str, pairs: Pairs, tol: float) -> Item:
        """Worst relative difference over ``(got, want)`` pairs must be ``<= tol``."""
        worst_abs, worst_rel = 0.0, 0.0
        for got, want in pairs:
            a, r = diff(got, want)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
        return self._add(Item(case, name, "pass" if worst_rel <= tol else "FAIL", worst_abs, worst_rel, tol))

    def exact(self, case: str, name: str, pairs: Pairs) -> Item:
        """Every ``(got, want)`` pair must be ``torch.equal`` (same shape, dtype and bits)."""
        ok = True
        worst_abs, worst_rel = 0.0, 0.0
        for got, want in pairs:
            got, want = got.detach().cpu(), want.detach().cpu()
            ok &= got.dtype == want.dtype and torch.equal(got, want)
            a, r = diff(got, want)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
        return self._add(Item(case, name, "pass" if ok else "FAIL", worst_abs, worst_rel, None))

    def skip(self, case: str, name: str, why: str) -> Item:
        return self._add(Item(case, name, "skip", note=why))

    def error(self, case: str, name: str, exc: BaseException) -> Item:
        """An item that raised: its first line, so that one broken op does not stop the run."""
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return self._add(Item(case, name, "error", note=msg[:200]))

    def guarded(self, case: str, name: str, fn: Callable[[], T]) -> Optional[T]:
        """``fn()``, or None with an error item if it raises: the run goes on with the next item."""
        try:
            return fn()
        except Exception as e:
            self.error(case, name, e)
            return None

    def _add(self, item: Item) -> Item:
        self.items.append(item)
        return item

    @property
    def passed(self) -> bool:
        return all(i.status in ("pass", "skip") for i in self.items)

    def counts(self) -> dict[str, int]:
        """Items per status: ``pass``, ``FAIL``, ``error``, ``skip``."""
        return {s: sum(i.status == s for i in self.items) for s in ("pass", "FAIL", "error", "skip")}


def _fmt(x: Optional[float], spec: str = ".1e") -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return format(x, spec)


def format_report(report: Report) -> list[str]:
    """The report as a table: one heading line per case, its items indented below it."""
    rows = []
    for i in report.items:
        tol = "exact" if i.tol is None and i.status in ("pass", "FAIL") else _fmt(i.tol, ".0e")
        status = i.status + (f" ({i.note})" if i.note else "")
        rows.append(["  " + i.name, _fmt(i.max_abs), _fmt(i.rel), tol, status])
    header, *lines = format_table(["case / item", "max|diff|", "rel", "tol", "result"], rows, align="<>>><",
                                  min_widths=[0, 9, 8, 7, 0])
    out, last_case = [header], None
    for item, line in zip(report.items, lines):
        if item.case != last_case:
            out.append(item.case)
            last_case = item.case
        out.append(line)
    return out
