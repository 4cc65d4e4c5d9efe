"""Reading the library's environment variables on every call, cheaply.

Every op call reads a few variables (the backend choice, value checks, repeats, the variables
backends declare), so that a change of ``os.environ`` takes effect at the next call. CPython on
POSIX keeps ``os.environ``'s values in a dictionary of encoded bytes; reading that dictionary
with pre-encoded names gives the same values without encoding each name per call.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Union

_RAW = getattr(os.environ, "_data", None) if os.name == "posix" else None
_FAST = isinstance(_RAW, dict)


@functools.lru_cache(maxsize=None)
def _raw_name(name: str) -> bytes:
    return name.encode()


def read(name: str) -> Optional[Union[str, bytes]]:
    """The variable's value, or ``None`` when unset (``bytes`` where the fast path reads it: compare
    with :func:`is_off` / :func:`is_on`, or decode)."""
    if _FAST:
        return _RAW.get(_raw_name(name))
    return os.environ.get(name)  # pragma: no cover - not CPython on POSIX


def read_all(names: tuple[str, ...]) -> tuple:
    """:func:`read` of each name (what a cache keys the environment on)."""
    if _FAST:
        return tuple([_RAW.get(_raw_name(n)) for n in names])
    return tuple([os.environ.get(n) for n in names])  # pragma: no cover


_OFF = ("0", "false", "False", "off", b"0", b"false", b"False", b"off")
_UNSET_OR_OFF = ("", b"", "0", b"0", "false", b"false", "False", b"False")


def is_off(name: str) -> bool:
    """The variable is set to ``0``, ``false``, ``False`` or ``off`` (unset: not off)."""
    return read(name) in _OFF


def is_on(name: str) -> bool:
    """The variable is set, and not empty, ``0``, ``false`` or ``False``."""
    value = read(name)
    return value is not None and value not in _UNSET_OR_OFF
