"""The public tuning hook: run with another launch table, for sweeps and experiments.

    from dataclasses import replace
    from recoverssm.backends.triton.tuning import launch_table

    base = rs.get_backend("cuda").table
    with launch_table("cuda", replace(base, conv=ConvSpec(block=64))):
        ...   # ops, and CommitContexts built here, use the table

A :class:`~recoverssm.CommitContext` fixes its commit launch when it is built, so build one
inside the block to measure a commit spec. The library itself never sets a table here.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Union

from ...core.backend import Backend
from ...core.registry import get_backend, registry
from .backend import TritonBackend
from .config import LaunchTable


@contextlib.contextmanager
def launch_table(backend: Union[str, Backend], table: LaunchTable) -> Iterator[TritonBackend]:
    """Make ``table`` the launch table of ``backend`` (a Triton backend) inside the block."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(be, TritonBackend):
        raise TypeError(f"launch_table: backend {be.name!r} is not a Triton backend")
    if not isinstance(table, LaunchTable):
        raise TypeError(f"launch_table: table must be a LaunchTable, got {type(table).__name__}")
    previous = be._table_override
    be._table_override = table
    registry().invalidate()     # no launch bound under the previous table is repeated under this one
    try:
        yield be
    finally:
        be._table_override = previous
        registry().invalidate()
