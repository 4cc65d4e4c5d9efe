"""The layout of a call's arguments: the one key every memo of the library builds on.

Several things the library remembers depend only on the *layout* of an op's arguments, never on
the values in its tensors: whether the checks that need no values passed
(``validation.PassedLayouts``), which launch an eager call may repeat (``core/repeats.py``, the
commit included), which compiled binary a launch selects and which device table a commit step
points at (``backends/triton``). The layout of a tensor is its address, dtype, shape, strides
and device (:func:`tensor_layout`); of any other argument, its type and value (floats by their
exact bits, so ``-0.0`` and ``0.0`` differ, and ``1`` and ``True`` differ by type).

Two calls with equal :func:`layout_key` pass the same checks and launch the same kernel on the
same memory; only the values in that memory may differ. A key never holds a tensor.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

_Tensor = torch.Tensor
#: Model weights (``A_log``, ``dt_bias``, conv weights) are often ``nn.Parameter``s: plain memory.
_Parameter = torch.nn.Parameter


def tensor_layout(t: torch.Tensor) -> tuple:
    """``(address, dtype, shape, strides, device)`` of a tensor."""
    return t.data_ptr(), t.dtype, t.shape, t.stride(), t.device


def is_plain(t: torch.Tensor) -> bool:
    """Whether a tensor is plain memory: a ``torch.Tensor`` or ``nn.Parameter`` (no other
    subclass) without a pending negation (the dispatcher would materialize a negative view
    before an op sees it). A conjugate view needs no test: only complex tensors carry that bit,
    and no op accepts a complex dtype."""
    cls = t.__class__
    return (cls is _Tensor or cls is _Parameter) and not t.is_neg()


def layout_key(values: Sequence, plain_only: bool = True) -> Optional[tuple]:
    """The layout of a sequence of arguments, element by element: a tensor as
    :func:`tensor_layout`, a float by its bits, a list or tuple as the key of its elements (with
    its type), anything else as ``(type, value)``. With ``plain_only``, ``None`` when a tensor is
    not plain memory (:func:`is_plain`): such a call has no key (an op's own arguments need no such
    test: the dispatcher hands ops plain tensors). Raises ``RuntimeError`` for a tensor without an
    address; an unhashable value makes a key that a dictionary refuses (``TypeError``)."""
    key = []
    for x in values:
        cls = x.__class__
        if cls is _Tensor or cls is _Parameter or (not plain_only and isinstance(x, _Tensor)):
            if plain_only and x.is_neg():
                return None
            key.append((x.data_ptr(), x.dtype, x.shape, x.stride(), x.device))
        elif cls is float:
            key.append(x.hex())
        elif cls is list or cls is tuple:
            inner = layout_key(x, plain_only)
            if inner is None:
                return None
            key.append((cls, inner))
        elif isinstance(x, _Tensor):
            return None
        else:
            key.append((cls, x))
    return tuple(key)


def aligned(t: torch.Tensor, alignment: int = 16) -> bool:
    """Whether a tensor's address is a multiple of ``alignment`` bytes (what Triton specializes
    pointers on)."""
    return t.data_ptr() % alignment == 0


def tensor_at(layout: tuple) -> torch.Tensor:
    """A CPU tensor over the memory a :func:`tensor_layout` names (what a launch bound under
    Triton's interpreter runs on: it holds no tensor, as a GPU launch holds only addresses).
    The memory must be alive: the caller guarantees a tensor of exactly this layout exists."""
    address, dtype, shape, stride, device = layout
    if device.type != "cpu":
        raise ValueError(f"tensor_at: only CPU memory can be addressed from the host, not {device}")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if span == 0:
        return torch.empty(shape, dtype=dtype)
    size = span * torch.empty((), dtype=dtype).element_size()
    flat = torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype, count=span)
    return flat.as_strided(shape, stride)
