"""A tiny progress bar on stderr (no dependency). Drawn only on a terminal."""
from __future__ import annotations

import sys
from typing import Optional, TextIO


class ProgressBar:
    """``[#######.......] 7/12 label`` redrawn in place on ``stream``.

    ``enabled=None`` draws only when ``stream`` is a terminal. :meth:`print` writes a line to
    stdout without tearing the bar (clear, print, redraw).
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
        self.done += n
        self.note = note
        self._draw()

    def print(self, line: str) -> None:
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
