"""Eager calls that repeat an earlier call's layout: the launch alone, without the dispatcher.

An engine that runs the recurrent layers eagerly calls each op once per layer and step with
tensors whose addresses, dtypes, shapes and strides repeat (persistent buffers, and activations
the caching allocator hands out at the same addresses). Everything the op does before its kernel
starts (the dispatcher, the argument checks, resolving the backend, choosing the kernel's
specialization) depends only on that layout and on the scalar arguments. So when an op has run
once through ``torch.ops.recoverssm.*``, the backend may hand back the launch it made, as a
:class:`~recoverssm.core.backend.Launch` bound to those addresses (:meth:`Backend.recurrence`
and the conv methods return it), and a later eager call whose *call key* is the same calls it
directly.

The call key (:func:`call_key`) is the op's name, every argument that is not a tensor (scalars,
floats by their exact bits, ``check``, the ``backend`` name), for every tensor its address,
dtype, shape, strides and device, the environment the registry resolves backends from, and the
registry's generation (it changes when a plugin is registered or removed). Two calls with one key
pass the same checks and launch the same kernel on the same memory; only the values in that
memory may differ. The bound launch holds no tensor: it is only ever called with live tensors at
exactly those addresses.

The shortcut is not taken (the call goes through the op) while ``torch.compile`` or
``torch.jit.trace`` traces, under a ``TorchFunctionMode`` or ``TorchDispatchMode`` (including
the one ``torch.set_default_device`` installs), for tensor subclasses (``nn.Parameter`` aside)
and tensors whose negation is a pending view bit (the dispatcher would materialize it), and when
the call wants value checks (CPU tensors, ``check=True``, ``RECOVERSSM_CHECK=1``): those run in
the op.
A repeated call is one kernel launch and nothing else: ``torch.profiler`` shows the kernel
without a ``recoverssm::`` op around it, and Triton's launch hooks are not called.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .backend import Launch
from .registry import registry
from .validation import wants_value_checks

#: The ops whose launches may be repeated this way.
REPEATABLE = frozenset({"conv_verify", "conv_decode"} | {f"{kind}_{mode}" for kind in ("gdn", "kda")
                                                         for mode in ("verify", "decode", "spec_decode_snapshot")})
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter    # model weights (A_log, dt_bias, conv weights): plain memory


def call_key(op: str, args: Sequence) -> Optional[tuple]:
    """The key of a call of ``op`` with its schema's positional ``args``; ``None`` when a tensor
    argument is not plain memory (a subclass other than ``nn.Parameter``, a negative view).
    A conjugate view needs no test: only complex tensors carry that bit, and the dtype in the key
    never matches a call that passed the checks (no op takes complex tensors)."""
    key = [op, registry().state()]
    for x in args:
        cls = x.__class__
        if cls is _Tensor or cls is _Parameter:
            if x.is_neg():
                return None
            key += (x.data_ptr(), x.dtype, x.shape, x.stride(), x.device)
        elif cls is float:
            key.append(x.hex())         # the exact bits: -0.0 and 0.0 differ
        elif isinstance(x, _Tensor):
            return None
        else:
            key.append(x)
    return tuple(key)


class Repeats:
    """The bound launches of recent calls, by call key. Bounded: when full it starts over."""

    def __init__(self, size: int = 2048):
        self.size = size
        self._launches: dict[tuple, Callable[[], bool]] = {}     # key -> Launch.run
        #: How many calls took the shortcut (tests and benchmarks read it).
        self.hits = 0

    def __len__(self) -> int:
        return len(self._launches)

    def clear(self) -> None:
        self._launches.clear()

    def remember(self, op: str, args: Sequence, launch: object) -> None:
        """Keep ``launch`` for repeats of this call when it is a :class:`Launch` (what the
        backend's function returned; anything else is ignored)."""
        if not isinstance(launch, Launch) or op not in REPEATABLE:
            return
        try:
            key = call_key(op, args)
        except RuntimeError:      # a tensor without an address
            return
        if key is None:
            return
        if len(self._launches) >= self.size:
            self._launches.clear()
        self._launches[key] = launch.run

    def run(self, op: str, args: Sequence, check: Optional[bool]) -> bool:
        """Launch this call through a bound launch when it repeats one; ``False`` when the call
        must go through the op (nothing was launched). ``args[0]`` (``x`` or ``q``) gives the
        device the value checks are decided for."""
        if (not self._launches or torch.compiler.is_compiling() or torch._C._len_torch_function_stack()
                or torch._C._len_torch_dispatch_stack() or torch._C._get_tracing_state() is not None
                or not isinstance(args[0], _Tensor) or wants_value_checks(check, args[0].device)):
            return False
        try:
            key = call_key(op, args)
            launch = self._launches.get(key) if key is not None else None
        except (RuntimeError, TypeError):    # no address; an unhashable argument (the op names it)
            return False
        if launch is None or not launch():
            return False
        self.hits += 1
        return True


#: The one cache the public ops use.
REPEATS = Repeats()
