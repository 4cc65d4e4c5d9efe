"""Terminal output shared by the commands (``demo``, ``check``, ``bench``): one progress bar and
one fixed-width table formatter.

The progress bar is a few lines of our own rather than a dependency: it draws only on a terminal,
and lets the commands print their table lines through it without tearing the bar.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Sequence, TextIO


class ProgressBar:
    """``[#######.......] 7/12 label note`` redrawn in place on ``stream`` (default: stderr).

    ``enabled=None`` draws only when ``stream`` is a terminal, so redirected or captured output
    stays clean. :meth:`print` writes a line to stdout without tearing the bar (clear, print,
    redraw).
    """

    def __init__(self, total: int, label: str = "", *, stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None, width: int = 24):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.note = ""

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r\033[K[{bar}] {self.done}/{self.total} {self.label} {self.note}".rstrip())
        self.stream.flush()

    def _clear(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def update(self, n: int = 1, note: str = "") -> None:
        """Advance by ``n`` and show ``note`` after the count."""
        self.done += n
        self.note = note
        self._draw()

    def print(self, line: str = "") -> None:
        """Print ``line`` on stdout above the bar."""
        self._clear()
        print(line, flush=True)
        self._draw()

    def close(self) -> None:
        """Erase the bar for good; later :meth:`print` calls just print."""
        self._clear()
        self.enabled = False

    def __enter__(self) -> "ProgressBar":
        self._draw()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Table:
    """Fixed-width text columns. ``align``: one ``"<"`` (left) or ``">"`` (right) per column.

    The widths are fixed up front so that rows can be printed one at a time as they are produced
    (the demo prints a step's row as soon as the step is checked); :func:`format_table` sizes
    them to a whole table instead. The last column is never padded, so lines carry no trailing
    blanks and a free-text last column may be of any length.
    """

    def __init__(self, headers: Sequence[str], widths: Sequence[int], align: Optional[str] = None,
                 sep: str = "  "):
        if len(widths) != len(headers) or (align is not None and len(align) != len(headers)):
            raise ValueError("one width and one alignment per column")
        self.headers = list(headers)
        self.widths = [max(w, len(h)) for w, h in zip(widths, headers)]
        self.align = align or "<" * len(headers)
        self.sep = sep

    def line(self, cells: Sequence[object]) -> str:
        """One row: ``cells`` formatted with ``str`` and aligned to the columns."""
        last = len(self.widths) - 1
        parts = [f"{str(c):{a}{w if i < last else ''}}"
                 for i, (c, w, a) in enumerate(zip(cells, self.widths, self.align))]
        return self.sep.join(parts).rstrip()

    def header(self) -> str:
        return self.line(self.headers)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: Optional[str] = None,
                 sep: str = "  ", min_widths: Optional[Sequence[int]] = None) -> list[str]:
    """``rows`` under ``headers`` as aligned lines (the header first), each column as wide as its
    widest cell, and at least ``min_widths`` (keeps numeric columns steady when their values are
    short). ``align``: one ``"<"`` or ``">"`` per column (default: all left)."""
    rows = [[str(c) for c in r] for r in rows]
    least = min_widths or [0] * len(headers)
    widths = [max([len(h), least[i]] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    table = Table(headers, widths, align, sep)
    return [table.header()] + [table.line(r) for r in rows]
