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
without a ``recoverssm::`` op around it, and Triton's launch hooks are not called. Where layouts
do not repeat, the cache measures its hit rate and rests (:class:`Repeats`), so that a call
costs what the op path alone costs.
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


def _same_arguments(a: Sequence, b: Sequence) -> bool:
    """Whether two argument tuples hold the very same tensors and equal other values of the same
    types (so that their call keys are equal)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if isinstance(x, _Tensor) or type(x) is not type(y) or x != y:
            return False
    return True


class Repeats:
    """The bound launches of recent calls, by call key. Bounded: when full it starts over.

    A call's key is computed once: a lookup that misses hands its key to the op's
    :meth:`remember` of the same call (which checks that the arguments and the registry's state
    are those the key was computed from). Where layouts do not repeat (activations at new addresses
    every step) keys are pure cost, so the hit rate is measured over every ``window`` lookups;
    below ``min_hit_rate`` the cache rests for ``rest`` calls (no lookups, nothing remembered:
    the op path alone, as without this cache), then measures again."""

    def __init__(self, size: int = 2048, window: int = 1024, min_hit_rate: float = 1 / 16, rest: int = 15 * 1024):
        self.size, self.window, self.min_hit_rate, self.rest = size, window, min_hit_rate, rest
        self._launches: dict[tuple, Callable[[], bool]] = {}     # key -> Launch.run
        self._missed: Optional[tuple] = None     # (op, args, key) of this call's lookup that missed
        self._lookups = self._window_hits = self._resting = 0
        #: How many calls took the shortcut (tests and benchmarks read it).
        self.hits = 0

    def __len__(self) -> int:
        return len(self._launches)

    @property
    def resting(self) -> bool:
        return self._resting > 0

    def clear(self) -> None:
        """Forget every launch and the hit-rate measurement."""
        self._launches.clear()
        self._missed = None
        self._lookups = self._window_hits = self._resting = 0

    def remember(self, op: str, args: Sequence, launch: object) -> None:
        """Keep ``launch`` for repeats of this call when it is a :class:`Launch` (what the
        backend's function returned; anything else is ignored)."""
        missed, self._missed = self._missed, None
        if not isinstance(launch, Launch) or op not in REPEATABLE or self._resting:
            return
        if (missed is not None and missed[0] == op and missed[2][1] == registry().state()
                and _same_arguments(missed[1], args)):
            key = missed[2]
        else:
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
        self._missed = None
        if self._resting:
            self._resting -= 1
            return False
        if (not self._launches or torch.compiler.is_compiling() or torch._C._len_torch_function_stack()
                or torch._C._len_torch_dispatch_stack() or torch._C._get_tracing_state() is not None
                or not isinstance(args[0], _Tensor) or wants_value_checks(check, args[0].device)):
            return False
        try:
            key = call_key(op, args)
            launch = self._launches.get(key) if key is not None else None
        except (RuntimeError, TypeError):    # no address; an unhashable argument (the op names it)
            return False
        hit = launch is not None and launch()
        self._count(hit)
        if not hit:
            if key is not None:
                self._missed = (op, args, key)
            return False
        self.hits += 1
        return True

    def _count(self, hit: bool) -> None:
        self._lookups += 1
        self._window_hits += hit
        if self._lookups >= self.window:
            if self._window_hits < self.min_hit_rate * self._lookups:
                self._resting = self.rest
            self._lookups = self._window_hits = 0


#: The one cache the public ops use.
REPEATS = Repeats()
