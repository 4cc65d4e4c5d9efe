"""Small helpers shared by the command-line entry points (check, demo, tensor-parallel demo)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` torch CPU threads (``<= 0``: leave as is), restoring the setting after.

    The commands default to one thread: on small, shared machines the reference's many tiny ops
    run faster single-threaded than contending for cores."""
    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
