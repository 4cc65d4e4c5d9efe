"""What a call writes: which arguments, the inference-tensor rule, and version counters.

The schema of each ``torch.ops.recoverssm.*`` op marks the tensors it writes (``Tensor(a!)``,
and the commit's ``Tensor(a!)[]`` lists of states and conv states). Every call, whether it goes
through the op or repeats an earlier call's launch (``core/repeats.py``), follows PyTorch's own
rules for in-place ops:

* **Inference tensors** (made inside ``torch.inference_mode()``) are written only inside
  inference mode. Outside it, the call refuses before anything runs, with a ``RuntimeError``
  naming the argument (the error PyTorch's in-place ops raise, with the argument's name).
* **Version counters**: the call increments the version counter of each tensor it writes once,
  whichever backend ran. Tensors that are views of one base share a counter, which then moves
  once for each of them. Inference tensors have none. So a backend's kernel-facing functions
  leave counters alone (a kernel moves none); one that writes through PyTorch operations, as the
  reference does, wraps them in :func:`versions_kept`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

_WRITTEN: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}


def _takes_lists(fn, *args) -> bool:
    """Whether a version-counter function takes lists of tensors (torch >= 2.6) rather than one."""
    try:
        fn(*args)
        return True
    except TypeError:
        return False


_increment_one = torch._C._increment_version
_set_one = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
if _takes_lists(_increment_one, []):
    _increment = _increment_one
else:  # pragma: no cover - torch < 2.6
    def _increment(tensors):
        for t in tensors:
            _increment_one(t)
if _set_one is None or _takes_lists(_set_one, [], []):
    _set_versions = _set_one
else:  # pragma: no cover - torch < 2.6
    def _set_versions(tensors, values):
        for t, v in zip(tensors, values):
            _set_one(t, v)


def _schema(op: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The argument names of ``torch.ops.recoverssm.<op>`` and the positions of those it writes."""
    hit = _WRITTEN.get(op)
    if hit is None:
        arguments = getattr(torch.ops.recoverssm, op).default._schema.arguments
        hit = _WRITTEN[op] = (tuple(a.name for a in arguments),
                              tuple(i for i, a in enumerate(arguments)
                                    if a.alias_info is not None and a.alias_info.is_write))
    return hit


def written_arguments(op: str, args: Sequence) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor a call of ``op`` with its schema's positional ``args``
    writes; the elements of a written list as ``name[i]``, ``None`` left out."""
    names, positions = _schema(op)
    out = []
    for i in positions:
        value = args[i]
        if isinstance(value, (list, tuple)):
            out.extend((f"{names[i]}[{j}]", t) for j, t in enumerate(value) if t is not None)
        elif value is not None:
            out.append((names[i], value))
    return out


def written_tensors(op: str, args: Sequence) -> list[torch.Tensor]:
    """The tensors of :func:`written_arguments` (the repeat path's cheaper form: no names)."""
    out = []
    for i in _schema(op)[1]:
        value = args[i]
        if isinstance(value, (list, tuple)):
            out.extend(t for t in value if t is not None)
        elif value is not None:
            out.append(value)
    return out


def refuse_inference_writes(op: str, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Outside inference mode, a ``RuntimeError`` naming the first written inference tensor."""
    if torch.is_inference_mode_enabled():
        return
    for name, t in named:
        if t is not None and t.is_inference():
            raise RuntimeError(f"{op}: {name} is an inference tensor (made inside torch.inference_mode()); it "
                               "can be written only inside inference mode, as PyTorch's in-place ops require")


def writes_inference_tensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call writing ``tensors`` here would be refused (outside inference mode, one of
    them is an inference tensor)."""
    return not torch.is_inference_mode_enabled() and any([t.is_inference() for t in tensors])


def count_writes(tensors: Sequence[torch.Tensor]) -> None:
    """Increment each written tensor's version counter once (after the call wrote them)."""
    _increment(tensors)


@contextlib.contextmanager
def versions_kept(tensors: Sequence[Optional[torch.Tensor]]) -> Iterator[None]:
    """Within the block, writes through PyTorch operations leave these tensors' version counters
    as they were (the op moves each once, :func:`count_writes`)."""
    kept = [t for t in tensors if t is not None and not t.is_inference()]
    before = [t._version for t in kept]
    try:
        yield
    finally:
        if kept and _set_versions is not None:
            _set_versions(kept, before)
