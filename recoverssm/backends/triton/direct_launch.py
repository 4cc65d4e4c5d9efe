"""Launching a compiled Triton kernel with little host work.

``kernel[grid](...)`` re-derives, on every call, which compiled binary the arguments select
(binding about 50 arguments, building a cache key from their specialization, reading launch
hooks and knobs): measured on the H200 machine's CPU, 46 us for the commit kernel and 51 us for
the recurrence kernel, the largest share of a call's host time. :class:`DirectLauncher` goes
through that path once per specialization, keeps the compiled kernel, and afterwards calls its
launcher directly with a key of its own.

The key is at least as fine as Triton's specialization, so a cached binary is never reused for
arguments Triton would have compiled differently: every pointer's dtype; the 16-byte alignment
of pointers Triton specializes on alignment; for integers Triton specializes, whether they are 1
or multiples of 16; for every integer, whether it needs 64 bits; all constexprs and compile
options; the device. Launch hooks (``triton.knobs.runtime.launch_enter_hook``) are not called on
this path. It is used for CUDA tensors only (under Triton's interpreter tensors are on the CPU);
anything unexpected (a Triton whose compiled-kernel interface differs) turns it off for good and
the normal path runs.

:meth:`DirectLauncher.bind` goes one step further for a launch that repeats with the very same
tensors (the commit of an engine that passes its persistent index buffers every step), or with
tensors of the very same layout (an eager op call that repeats an earlier one,
``core/repeats.py``): the key and the tensors' addresses are computed once, and each repeat is
the launcher call alone.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
#: A launch bound to its arguments (:meth:`DirectLauncher.bind`): True when it launched.
Bound = Callable[[], bool]

try:        # what Triton's own launch path uses: the raw handle of a device's current stream
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover - older torch
    def _current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _run(compiled, grid: tuple, device_index: int, flat_args: tuple) -> None:
    """Call a compiled kernel's launcher on the device's current stream, without launch hooks."""
    compiled.run(grid[0], grid[1], grid[2], _current_stream(device_index), compiled.function,
                 compiled.packed_metadata, None, None, None, *flat_args)


class DirectLauncher:
    """Launches one ``@triton.jit`` kernel whose runtime arguments precede its constexprs."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        params = getattr(kernel, "params", None)
        self.enabled = params is not None
        if not self.enabled:
            return
        runtime = [p for p in params if not p.is_constexpr]
        if any(p.is_constexpr for p in params[:len(runtime)]):
            raise ValueError(f"{kernel.__name__}: runtime arguments must come before constexprs")
        self.constexpr_names = tuple(p.name for p in params if p.is_constexpr)
        self.num_runtime = len(runtime)
        self.pointers = tuple(i for i, p in enumerate(runtime) if p.name.endswith("_ptr"))
        self.aligned_pointers = tuple(i for i in self.pointers if not runtime[i].do_not_specialize_on_alignment)
        self.specialized_ints = tuple(i for i, p in enumerate(runtime)
                                      if not p.name.endswith("_ptr") and not p.do_not_specialize)
        self.non_pointers = tuple(i for i, p in enumerate(runtime) if not p.name.endswith("_ptr"))

    def __call__(self, grid: Sequence[int], args: Sequence, constexprs: dict, options: dict, *,
                 bind: bool = False) -> Optional[Bound]:
        """``args``: the runtime arguments in order (tensors for ``*_ptr``); ``constexprs`` by name.
        ``bind``: also return this launch bound to the tensors' addresses, holding none of them
        (:meth:`bind` with ``hold_arguments=False``), or ``None`` where the direct path is off."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        key = None
        if self.enabled and args[self.pointers[0]].device.type == "cuda":
            if len(args) != self.num_runtime:
                raise TypeError(f"{self.kernel.__name__}: {len(args)} runtime arguments, expected {self.num_runtime}")
            key = self._key(args, constexprs, options)
            compiled = self.compiled.get(key)
            if compiled is not None:
                try:
                    _run(compiled, grid, key[0], (*args, *(constexprs[n] for n in self.constexpr_names)))
                except (AttributeError, TypeError) as exc:     # nothing launched: Triton's path below
                    self._disable(exc)
                    key = None
                else:
                    return self._bound(compiled, key[0], grid, args, constexprs, options, False) if bind else None
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if key is not None and compiled is not None and not hasattr(compiled, "result"):
            self.compiled[key] = compiled
        return None

    def bind(self, grid: Sequence[int], args: Sequence, constexprs: dict, options: dict, *,
             hold_arguments: bool = True) -> Optional[Bound]:
        """A launch of these very arguments, to repeat with no per-call work but reading the
        current stream: pointers become plain addresses (so Triton's launcher neither looks up
        ``data_ptr`` nor asks the driver about each pointer) and the binary is the one
        :meth:`__call__` compiled for them. ``None`` until that binary exists, or on the plain path.
        Calling it returns True when it launched.

        ``hold_arguments``: the launch keeps the tensors alive, and should the direct path turn
        out unavailable it launches through :meth:`__call__` with them. Without: it holds no
        tensor and returns False instead; the caller must then only call it while tensors of
        exactly this layout (addresses, dtypes, devices, shapes, strides) are alive. Either way
        the caller calls it with the tensors' device current, and values may change between calls."""
        if not (self.enabled and args[self.pointers[0]].device.type == "cuda" and len(args) == self.num_runtime):
            return None
        key = self._key(args, constexprs, options)
        compiled = self.compiled.get(key)
        if compiled is None:
            return None
        return self._bound(compiled, key[0], grid, args, constexprs, options, hold_arguments)

    def _bound(self, compiled, device_index: int, grid: Sequence[int], args: Sequence, constexprs: dict,
               options: dict, hold_arguments: bool) -> Bound:
        runner = compiled.run
        head = (*grid, *(1,) * (3 - len(grid)))
        values = list(args)
        for i in self.pointers:
            values[i] = values[i].data_ptr()
        tail = (compiled.function, compiled.packed_metadata, None, None, None, *values,
                *(constexprs[n] for n in self.constexpr_names))
        held = tuple(args) if hold_arguments else None

        def launch() -> bool:    # _run's call, everything but the stream fixed
            if self.enabled:
                try:
                    runner(*head, _current_stream(device_index), *tail)
                    return True
                except (AttributeError, TypeError) as exc:   # addresses refused: the plain path from now on
                    self._disable(exc)
            if held is None:
                return False
            self(grid, held, constexprs, options)
            return True
        return launch

    def _disable(self, exc: Exception) -> None:
        log.warning("direct launch of %s unavailable (%s); using Triton's launch path", self.kernel.__name__, exc)
        self.enabled = False

    def _key(self, args, constexprs: dict, options: dict) -> tuple:
        scalars = [args[i] for i in self.non_pointers]
        return (args[self.pointers[0]].device.index,
                tuple([args[i].dtype for i in self.pointers]),
                tuple([args[i].data_ptr() % 16 == 0 for i in self.aligned_pointers]),
                tuple([(args[i] == 1, args[i] % 16 == 0) for i in self.specialized_ints]),
                tuple([type(a) for a in scalars]),
                min(scalars, default=0) < INT32_MIN or max(scalars, default=0) > INT32_MAX,
                tuple(constexprs.values()), tuple(options.items()))
