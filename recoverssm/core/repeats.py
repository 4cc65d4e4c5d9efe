"""Eager calls that repeat an earlier call's layout: the launch alone, without the dispatcher.

An engine that runs its layers eagerly calls each op once per layer and step with tensors whose
addresses, dtypes, shapes and strides repeat (persistent buffers, and activations the caching
allocator hands out at the same addresses). Everything an op does before its kernel starts (the
dispatcher, the argument checks, resolving the backend, choosing the kernel's specialization)
depends only on that layout and on the scalar arguments (``core/layout.py``). So an op that has
run once through ``torch.ops.recoverssm.*`` may keep the launch its backend made, as a
:class:`~recoverssm.core.backend.Launch` bound to those addresses, and a later eager call whose
*call key* is the same calls it directly. The commit of a :class:`~recoverssm.CommitContext` is
one such op too (its key: the context and the step's arguments).

This module is the only place that knows about it: the public functions look a call up
(:meth:`Repeats.run`) before they call the op; the op (``core/ops.py``) asks its backend for a
launch only when the cache would keep one (:meth:`Repeats.wants_launch`) and hands it over
(:meth:`Repeats.remember`). Backends only return what they are asked for.

**The call key** (:func:`call_key`): the op's name, the registry's state (its plugins, a
generation that launch-table changes also move, and the environment variables backends read)
and :func:`~recoverssm.core.layout.layout_key` of the arguments. Two calls with one key pass the
same checks and launch the same kernel on the same memory; only the values in that memory may
differ. A launch holds no tensor of the caller's: it is only ever called with live tensors at
exactly those addresses, and a key never outlives the layout it names except as an entry that
no live call can match unless tensors of that very layout exist again.

**When it is not taken** (the call goes through the op): while ``torch.compile`` or
``torch.jit.trace`` traces, under a ``TorchFunctionMode`` or ``TorchDispatchMode`` (including
the one ``torch.set_default_device`` installs), for tensor subclasses (``nn.Parameter`` aside)
and negative views, when the call would write an inference tensor outside inference mode (the op
refuses that), when the call wants value checks (CPU tensors, ``check=True``,
``RECOVERSSM_CHECK=1``), and when switched off: ``RECOVERSSM_REPEATS=0`` in the environment, or
inside :func:`no_repeats` (per thread). A repeated call follows the op's rules for what it
writes (``core/writes.py``: version counters, inference tensors). It is one kernel launch and
nothing else: ``torch.profiler`` shows the kernel without a ``recoverssm::`` op around it, and
Triton's launch hooks are not called.

The cache is bounded (the least recently used half goes when it is full), safe to use from
several threads, and where layouts do not repeat it measures its hit rate and rests.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional, Sequence

import torch

from . import environment
from .backend import Launch
from .layout import layout_key
from .registry import registry
from .validation import wants_value_checks
from .writes import count_writes, writes_inference_tensor, written_tensors

ENV_REPEATS = "RECOVERSSM_REPEATS"


def _environment_allows() -> bool:
    """``RECOVERSSM_REPEATS`` is unset or not one of ``0, false, False, off``."""
    return not environment.is_off(ENV_REPEATS)


def call_key(op: str, args: Sequence) -> Optional[tuple]:
    """The key of a call of ``op`` with ``args`` (``None`` when an argument is not plain
    memory; see :func:`~recoverssm.core.layout.layout_key`)."""
    layout = layout_key(args)
    return None if layout is None else (op, registry().state(), layout)


class Repeats:
    """The bound launches of recent calls, by call key.

    Bounded: when full, the least recently used half goes (each entry carries the lookup count
    of its last use, so a hit writes one number instead of moving the entry). Entries are added
    and evicted under a lock; a lookup reads the dictionary without one (a single ``dict.get``).

    Where layouts do not repeat (activations at new addresses every step) keys are pure cost, so
    the hit rate is measured over every ``window`` lookups: below ``min_hit_rate`` the cache rests
    (no lookups, nothing bound or kept: the op path alone) for one window's worth of calls, twice
    as long after each window that misses again, at most ``max_rest_windows``."""

    def __init__(self, size: int = 4096, window: int = 1024, min_hit_rate: float = 1 / 16,
                 max_rest_windows: int = 16):
        self.size, self.window, self.min_hit_rate = size, window, min_hit_rate
        self.max_rest_windows = max_rest_windows
        self._launches: dict[tuple, list] = {}    # key -> [Launch.run, the clock at its last use]
        self._lock = threading.Lock()
        self._switch = threading.local()          # .off: how many no_repeats() blocks are open
        self._clock = 0                           # hits and entries so far: the order of use
        self._lookups = self._window_hits = self._resting = 0
        self._rest_windows = 1
        #: How many calls took the shortcut (tests and benchmarks read it).
        self.hits = 0

    def __len__(self) -> int:
        return len(self._launches)

    @property
    def resting(self) -> bool:
        return self._resting > 0

    # ---- the switch ------------------------------------------------------------------------------
    def enabled(self) -> bool:
        """Whether calls of this thread may repeat launches: not inside :meth:`disabled`, and
        ``RECOVERSSM_REPEATS`` does not switch it off."""
        return not getattr(self._switch, "off", 0) and _environment_allows()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block, this thread's calls go through the op and nothing is kept."""
        self._switch.off = getattr(self._switch, "off", 0) + 1
        try:
            yield
        finally:
            self._switch.off -= 1

    def clear(self) -> None:
        """Forget every launch and the hit-rate measurement."""
        with self._lock:
            self._launches.clear()
            self._lookups = self._window_hits = self._resting = 0
            self._rest_windows = 1

    # ---- the op's side -------------------------------------------------------------------------
    def wants_launch(self) -> bool:
        """Whether a launch handed over now would be kept (the op asks its backend for one only
        then: binding a launch costs host time)."""
        return self._resting <= 0 and self.enabled()

    def remember(self, op: str, args: Sequence, launch: object) -> None:
        """Keep ``launch`` for repeats of this call when it is a :class:`Launch` (anything else
        is ignored). ``args``: the arguments :meth:`run` is given for the same call."""
        if not isinstance(launch, Launch) or not self.wants_launch():
            return
        try:
            key = call_key(op, args)
        except RuntimeError:      # a tensor without an address
            return
        if key is None:
            return
        with self._lock:
            if len(self._launches) >= self.size:        # the least recently used half goes
                by_use = sorted(self._launches.items(), key=lambda item: item[1][1])
                for old, _ in by_use[:self.size // 2]:
                    self._launches.pop(old, None)
            self._clock += 1
            self._launches[key] = [launch.run, self._clock]

    # ---- the caller's side ---------------------------------------------------------------------
    def run(self, op: str, args: Sequence, check: Optional[bool], device: Optional[torch.device] = None,
            written: Optional[Sequence[torch.Tensor]] = None, writes_inference: Optional[bool] = None) -> bool:
        """Launch this call through a bound launch when it repeats one; ``False`` when the call
        must go through the op (nothing was launched). ``args``: the op's positional arguments
        (or, for an op whose caller keys it otherwise, what it passes to :meth:`remember`);
        ``device``: where value checks are decided (default: ``args[0]``'s); ``written``: the
        tensors the call writes (default: from the op's schema); ``writes_inference``: whether
        one of them is an inference tensor, where the caller knows (default: looked at)."""
        if torch.compiler.is_compiling():      # first: nothing below may become a guard
            return False
        if self._resting > 0:
            self._resting -= 1
            return False
        if (not self._launches or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
                or torch._C._get_tracing_state() is not None or not self.enabled()):
            return False
        if device is None:
            if not isinstance(args[0], torch.Tensor):
                return False
            device = args[0].device
        if wants_value_checks(check, device):
            return False
        try:
            key = call_key(op, args)
            entry = self._launches.get(key) if key is not None else None
        except (RuntimeError, TypeError):    # no address; an unhashable argument (the op names it)
            return False
        if entry is None:
            self._count(False)
            return False
        self._clock += 1
        entry[1] = self._clock
        if written is None:
            written = written_tensors(op, args)
        if writes_inference is None:
            refused = writes_inference_tensor(written)
        else:
            refused = writes_inference and not torch.is_inference_mode_enabled()
        if refused or not entry[0]():
            return False
        count_writes(written)
        self._count(True)
        self.hits += 1
        return True

    def bound_launch(self, op: str, args: Sequence) -> Optional[Callable[[], bool]]:
        """The launch a repeat of this call would run (benchmarks time it alone), or ``None``."""
        key = call_key(op, args)
        entry = self._launches.get(key) if key is not None else None
        return entry[0] if entry is not None else None

    def _count(self, hit: bool) -> None:
        # Unlocked: concurrent calls may lose a count, which only shifts when the cache rests.
        self._lookups += 1
        self._window_hits += hit
        if self._lookups >= self.window:
            if self._window_hits < self.min_hit_rate * self._lookups:
                self._resting = self._rest_windows * self.window
                self._rest_windows = min(2 * self._rest_windows, self.max_rest_windows)
            else:
                self._rest_windows = 1
            self._lookups = self._window_hits = 0


#: The one cache the public ops use.
REPEATS = Repeats()


def no_repeats():
    """A context manager: inside it, this thread's calls never repeat an earlier call's launch
    (each goes through ``torch.ops.recoverssm.*``, its checks and its launcher), and nothing is
    kept for later. ``RECOVERSSM_REPEATS=0`` does the same for the whole process.

    >>> with recoverssm.no_repeats():
    ...     y = recoverssm.conv_verify(...)     # always the op path
    """
    return REPEATS.disabled()
