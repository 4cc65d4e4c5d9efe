"""A test backend whose bound launches recompute, for the repeat cache's CPU tests.

``ReplayingBackend`` runs ``cpu_ref`` and, when the op asks it to ``bind``, hands back a
:class:`~recoverssm.core.backend.Launch` that holds no tensor: only each tensor argument's layout
(address, dtype, shape, strides). Calling it rebuilds tensors over that memory
(``core.layout.tensor_at``) and runs ``cpu_ref`` on them again, as a GPU launch bound to
addresses would run its kernel on whatever those addresses hold. So a repeat that matched the
wrong call, or outlived the memory it names, computes something else than the op path, and the
tests see it. It also counts calls (through the op) and repeats (through a bound launch).
"""
from __future__ import annotations

import threading

import torch

from recoverssm.core.backend import Backend, Committer, GateInputs, GroupStep, Launch, PendingInputs, RecurrenceCall
from recoverssm.core.hookspecs import hookimpl
from recoverssm.core.layout import tensor_at, tensor_layout
from recoverssm.core.registry import registry

NAME = "replaying"


class _Frozen:
    """A tensor argument as a bound launch keeps it: its layout alone."""

    __slots__ = ("layout",)

    def __init__(self, t: torch.Tensor):
        self.layout = tensor_layout(t)


#: the argument objects whose tensors a bound launch keeps as layouts (slotted classes whose
#: constructors take every slot by name)
HOLDERS = (GateInputs, GroupStep, PendingInputs, RecurrenceCall)


def _rebuilt(value, convert):
    return type(value)(**{n: convert(getattr(value, n)) for n in type(value).__slots__})


def freeze(value):
    """Tensors (also inside tuples and the argument objects) replaced by their layouts."""
    if isinstance(value, torch.Tensor):
        return _Frozen(value)
    if isinstance(value, (list, tuple)):
        return type(value)(freeze(v) for v in value)
    if isinstance(value, HOLDERS):
        return _rebuilt(value, freeze)
    return value


def thaw(value):
    """:func:`freeze` undone: tensors rebuilt over the memory their layouts name."""
    if isinstance(value, _Frozen):
        return tensor_at(value.layout)
    if isinstance(value, (list, tuple)):
        return type(value)(thaw(v) for v in value)
    if isinstance(value, HOLDERS):
        return _rebuilt(value, thaw)
    return value


class ReplayingBackend(Backend):
    name = NAME
    device_types = ("cpu",)
    capabilities = Backend.CAPABILITIES

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.repeats = 0
        self.refuse = False          # bound launches refuse to run (the call then takes the op)
        self.returns = "launch"      # or "callable": a plain function, which the ops must ignore
        self.binds: list[bool] = []  # the ``bind`` argument of every call through the op

    @staticmethod
    def ref() -> Backend:
        return registry().resolve("cpu_ref", "cpu")[0]

    def _through_op(self, bind: bool, run, args, **kwargs):
        with self._lock:
            self.calls += 1
            self.binds.append(bind)
        run(*args, **kwargs)
        if not bind:
            return None
        frozen, frozen_kwargs = freeze(args), {n: freeze(v) for n, v in kwargs.items()}

        def launch() -> bool:
            if self.refuse:
                return False
            with self._lock:
                self.repeats += 1
            run(*thaw(frozen), **{n: thaw(v) for n, v in frozen_kwargs.items()})
            return True
        return Launch(launch) if self.returns == "launch" else launch

    def conv_verify(self, *args, pending=None, bind=False):
        return self._through_op(bind, self.ref().conv_verify, args, pending=pending)

    def conv_decode(self, *args, bind=False):
        return self._through_op(bind, self.ref().conv_decode, args)

    def recurrence(self, call, *, bind=False):
        return self._through_op(bind, self.ref().recurrence, (call,))

    def plan_commit(self, *args):
        self.ref().plan_commit(*args)

    def make_committer(self, layers, num_groups, max_batch, null_slot):
        return _ReplayingCommitter(self, self.ref().make_committer(layers, num_groups, max_batch, null_slot))


class _ReplayingCommitter(Committer):
    def __init__(self, backend: ReplayingBackend, ref: Committer):
        self.backend, self.ref = backend, ref

    def commit(self, num_accepted, query_start_loc, groups, *, bind=False):
        return self.backend._through_op(bind, self.ref.commit, (num_accepted, query_start_loc, list(groups)))


_BACKEND = ReplayingBackend()


class _Plugin:
    @hookimpl
    def recoverssm_backends(self):
        return [_BACKEND]


def register() -> ReplayingBackend:
    """Register the backend (once per process) and return it, counts reset."""
    if registry().pm.get_plugin("tests.replaying") is None:
        registry().register(_Plugin(), name="tests.replaying")
    _BACKEND.reset()
    return _BACKEND
