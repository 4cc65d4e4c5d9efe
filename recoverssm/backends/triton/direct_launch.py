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

:meth:`DirectLauncher.__call__` with ``bind`` goes one step further for a launch that is made
again with tensors of the very same layout (an eager op call whose arguments have an earlier
call's addresses, dtypes, shapes and strides, when the op asks its backend to ``bind``): the key
and the tensors' addresses are computed once, and each later launch is the launcher call alone.
Under Triton's interpreter (CPU tensors) a bound launch rebuilds the tensors over the same memory
and runs the interpreter, so the bound paths are tested in CI too.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from ...core.layout import aligned, tensor_at, tensor_layout

log = logging.getLogger(__name__)
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
#: A launch bound to its arguments (``DirectLauncher.__call__`` with ``bind``): True when it launched.
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
        (:meth:`_bound`; from the second call of a specialization on, once it is compiled), or
        ``None`` where the direct path is off."""
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
                    return self._bound(compiled, key[0], grid, args, constexprs) if bind else None
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if key is not None and compiled is not None and not hasattr(compiled, "result"):
            self.compiled[key] = compiled
        if bind and (args[self.pointers[0]] if self.enabled else args[0]).device.type == "cpu":
            return self._interpreted(grid, args, constexprs, options)
        return None

    def _bound(self, compiled, device_index: int, grid: Sequence[int], args: Sequence, constexprs: dict) -> Bound:
        """This launch again with no per-call work but reading the current stream: pointers
        become plain addresses (so Triton's launcher neither looks up ``data_ptr`` nor asks the
        driver about each pointer) and the binary is the one compiled for them. It holds no
        tensor: the caller calls it only while tensors of exactly this layout (addresses, dtypes,
        devices, shapes, strides) are alive, with their device current; values may change. It
        returns False, launching nothing, should the direct path turn out unavailable."""
        runner = compiled.run
        head = (*grid, *(1,) * (3 - len(grid)))
        values = list(args)
        for i in self.pointers:
            values[i] = values[i].data_ptr()
        tail = (compiled.function, compiled.packed_metadata, None, None, None, *values,
                *(constexprs[n] for n in self.constexpr_names))

        def launch() -> bool:    # _run's call, everything but the stream fixed
            if self.enabled:
                try:
                    runner(*head, _current_stream(device_index), *tail)
                    return True
                except (AttributeError, TypeError) as exc:   # addresses refused: the plain path from now on
                    self._disable(exc)
            return False
        return launch

    def _interpreted(self, grid: Sequence[int], args: Sequence, constexprs: dict, options: dict) -> Bound:
        """The same for CPU tensors under Triton's interpreter: the launch keeps each tensor's
        layout and rebuilds a tensor over that memory when called (``core.layout.tensor_at``), so
        CI runs bound launches through the same code as the GPU. It holds no tensor either."""
        layouts = [tensor_layout(a) if isinstance(a, torch.Tensor) else None for a in args]
        scalars = list(args)

        def launch() -> bool:
            values = [tensor_at(layout) if layout is not None else value for layout, value in zip(layouts, scalars)]
            self.kernel[grid](*values, **constexprs, **options)
            return True
        return launch

    def _disable(self, exc: Exception) -> None:
        log.warning("direct launch of %s unavailable (%s); using Triton's launch path", self.kernel.__name__, exc)
        self.enabled = False

    def _key(self, args, constexprs: dict, options: dict) -> tuple:
        scalars = [args[i] for i in self.non_pointers]
        return (args[self.pointers[0]].device.index,
                tuple([args[i].dtype for i in self.pointers]),
                tuple([aligned(args[i]) for i in self.aligned_pointers]),
                tuple([(args[i] == 1, args[i] % 16 == 0) for i in self.specialized_ints]),
                tuple([type(a) for a in scalars]),
                min(scalars, default=0) < INT32_MIN or max(scalars, default=0) > INT32_MAX,
                tuple(constexprs.values()), tuple(options.items()))
