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

The call key (:func:`call_key`) is the op's name, every argument that is not a tensor with its
type (floats by their exact bits), for every tensor its address, dtype, shape, strides and
device, the environment the registry resolves backends from, and the registry's generation (it
changes when a plugin is registered or removed). Two calls with one key pass the same checks and
launch the same kernel on the same memory; only the values in that memory may differ. The bound
launch holds no tensor: it is only ever called with live tensors at exactly those addresses.
Outside inference mode a repeat bumps the version counters of the tensors the op writes, as the
op would (inside it, neither does).

The shortcut is not taken (the call goes through the op) while ``torch.compile`` or
``torch.jit.trace`` traces, under a ``TorchFunctionMode`` or ``TorchDispatchMode`` (including
the one ``torch.set_default_device`` installs), for tensor subclasses (``nn.Parameter`` aside)
and tensors whose negation is a pending view bit (the dispatcher would materialize it), for an
inference tensor the op would write outside inference mode (the op refuses that), and when the
call wants value checks (CPU tensors, ``check=True``, ``RECOVERSSM_CHECK=1``): those run in the
op. A repeated call is one kernel launch and nothing else: ``torch.profiler`` shows the kernel
without a ``recoverssm::`` op around it, and Triton's launch hooks are not called. Where layouts
do not repeat, the cache measures its hit rate and rests (:class:`Repeats`).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch
from torch.autograd.graph import increment_version

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
    never matches a call that passed the checks (no op takes complex tensors). Other values are
    keyed with their type, so ``1`` and ``True`` (or an ``int`` and a ``numpy`` integer) differ."""
    key = [op, registry().state()]
    for x in args:
        cls = x.__class__
        if cls is _Tensor or cls is _Parameter:
            if x.is_neg():
                return None
            key.append((x.data_ptr(), x.dtype, x.shape, x.stride(), x.device))
        elif cls is float:
            key.append(x.hex())         # the exact bits: -0.0 and 0.0 differ
        elif isinstance(x, _Tensor):
            return None
        else:
            key.append((cls, x))
    return tuple(key)


_WRITTEN: dict[str, tuple[int, ...]] = {}
_RESTING = ("resting",)      # what a call made while the cache rests leaves for its op


def written_arguments(op: str) -> tuple[int, ...]:
    """Positions of the arguments ``torch.ops.recoverssm.<op>`` writes (``Tensor(a!)``)."""
    hit = _WRITTEN.get(op)
    if hit is None:
        schema = getattr(torch.ops.recoverssm, op).default._schema
        hit = _WRITTEN[op] = tuple(i for i, a in enumerate(schema.arguments)
                                   if a.alias_info is not None and a.alias_info.is_write)
    return hit


class Repeats:
    """The bound launches of recent calls, by call key. Bounded: when full, the least recently
    used half goes (each entry carries the lookup count of its last use: a hit writes one
    number instead of moving the entry).

    A call's key is computed once: a lookup that misses leaves its key, for this thread, to the
    op of the same call, whose :meth:`remember` takes it when the arguments are the very same
    objects and the registry's state is unchanged; the API drops it once that op has returned or
    raised (:meth:`forget_miss`).

    Where layouts do not repeat (activations at new addresses every step) keys are pure cost, so
    the hit rate is measured over every ``window`` lookups: below ``min_hit_rate`` the cache rests
    (no lookups, nothing remembered, nothing bound: the op path alone) for one window's worth of
    calls, twice as long after each window that misses again, at most ``max_rest_windows``."""

    def __init__(self, size: int = 4096, window: int = 1024, min_hit_rate: float = 1 / 16,
                 max_rest_windows: int = 16):
        self.size, self.window, self.min_hit_rate = size, window, min_hit_rate
        self.max_rest_windows = max_rest_windows
        self._launches: dict[tuple, list] = {}    # key -> [Launch.run, the clock at its last use]
        self._clock = 0                              # hits and entries so far: the order of use
        self._local = threading.local()                          # .missed: (op, args, key)
        self._lookups = self._window_hits = self._resting = 0
        self._rest_windows = 1
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
        self._local.missed = None
        self._lookups = self._window_hits = self._resting = 0
        self._rest_windows = 1

    def forget_miss(self) -> None:
        """Drop the key a missed lookup left for its op (the API calls this once the op is done)."""
        self._local.missed = None

    def remember(self, op: str, args: Sequence, launch: object) -> None:
        """Keep ``launch`` for repeats of this call when it is a :class:`Launch` (what the
        backend's function returned; anything else is ignored)."""
        missed = getattr(self._local, "missed", None)
        self._local.missed = None
        if not isinstance(launch, Launch) or op not in REPEATABLE or self._resting or missed is _RESTING:
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
        if len(self._launches) >= self.size:        # the least recently used half goes
            by_use = sorted(self._launches.items(), key=lambda item: item[1][1])
            for old, _ in by_use[:self.size // 2]:
                del self._launches[old]
        self._clock += 1
        self._launches[key] = [launch.run, self._clock]

    def run(self, op: str, args: Sequence, check: Optional[bool]) -> bool:
        """Launch this call through a bound launch when it repeats one; ``False`` when the call
        must go through the op (nothing was launched). ``args[0]`` (``x`` or ``q``) gives the
        device the value checks are decided for."""
        if torch.compiler.is_compiling():      # first: nothing below may become a guard
            return False
        if self._resting:
            self._resting -= 1
            self._local.missed = _RESTING      # this call's op keeps nothing, even the last one's
            return False
        self._local.missed = None
        if (not self._launches or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
                or torch._C._get_tracing_state() is not None or not isinstance(args[0], _Tensor)
                or wants_value_checks(check, args[0].device)):
            return False
        try:
            key = call_key(op, args)
            entry = self._launches.get(key) if key is not None else None
        except (RuntimeError, TypeError):    # no address; an unhashable argument (the op names it)
            return False
        if entry is not None:
            self._clock += 1
            entry[1] = self._clock
            # Inside inference mode the op writes anything and bumps no version counter; outside
            # it, it refuses to write inference tensors and bumps the counters of what it writes.
            written = () if torch.is_inference_mode_enabled() else tuple([args[i] for i in written_arguments(op)])
            if not any([t.is_inference() for t in written]) and entry[0]():
                for t in written:      # one at a time: torch < 2.6 takes a single tensor
                    increment_version(t)
                self._count(True)
                self.hits += 1
                return True
        self._count(False)
        if key is not None:
            self._local.missed = (op, args, key)
        return False

    def bound_launch(self, op: str, args: Sequence) -> Optional[Callable[[], bool]]:
        """The launch a repeat of this call would run (benchmarks time it alone), or ``None``."""
        key = call_key(op, args)
        entry = self._launches.get(key) if key is not None else None
        return entry[0] if entry is not None else None

    def accepting(self) -> bool:
        """Whether a launch handed over now would be kept (backends may skip binding otherwise)."""
        return not self._resting

    def _count(self, hit: bool) -> None:
        self._lookups += 1
        self._window_hits += hit
        if self._lookups >= self.window:
            if self._window_hits < self.min_hit_rate * self._lookups:
                self._resting = self._rest_windows * self.window
                self._rest_windows = min(2 * self._rest_windows, self.max_rest_windows)
            else:
                self._rest_windows = 1
            self._lookups = self._window_hits = 0


def _same_arguments(a: Sequence, b: Sequence) -> bool:
    """Whether two argument tuples hold the very same tensors and other values of the same types
    and bits (so that their call keys are equal)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if isinstance(x, _Tensor) or type(x) is not type(y):
            return False
        same = x.hex() == y.hex() if type(x) is float else x == y
        if not same:
            return False
    return True


#: The one cache the public ops use.
REPEATS = Repeats()
