"""The building blocks of argument checking, shared by every op.

Each check raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (shape, stride,
device, value, overlap) whose message starts with the op and names the argument. The op-level
checks that use these live in ``core/arguments.py``; all of them run before anything is launched
or written.

Checks of *values held in tensors* (slot indices, ``query_start_loc``, block tables) need the
values on the host: they always run for CPU tensors; for device tensors they run when the caller
passes ``check=True`` or sets ``RECOVERSSM_CHECK=1`` (each costs a device sync), never while a
CUDA graph is being captured. Without them, kernels follow the index rule of ``core/indices.py``.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from . import environment
from .indices import INT32_MAX, INT32_MIN, is_slot
from .layout import layout_key

ENV_CHECK = "RECOVERSSM_CHECK"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def wants_value_checks(check: Optional[bool], device: torch.device) -> bool:
    """Value checks run on CPU tensors always; on other devices when asked (``check=True`` or
    ``RECOVERSSM_CHECK=1``), except during CUDA graph capture, where a host sync is not allowed."""
    if device.type == "cpu":
        return True
    if check is None:
        check = environment.is_on(ENV_CHECK)
    return bool(check) and not _capturing(device)


class PassedLayouts:
    """Remembers the argument layouts (``core/layout.py``: addresses, dtypes, shapes, strides,
    devices, and the scalars) that passed an op's checks without values, so that a call
    repeating one (an engine's persistent buffers, or activations the caching allocator puts at
    the same addresses every step) skips them: they would pass again. Bounded; never holds a
    tensor. :meth:`key` is the key of a call (``None``: not to be remembered)."""

    def __init__(self, size: int = 512):
        self.size = size
        self._keys: set = set()

    @staticmethod
    def key(op: str, values: Sequence) -> tuple:
        """The key of a call of ``op`` whose checks depend on ``values`` (tensors and scalars)."""
        return op, layout_key(values, plain_only=False)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def add(self, key) -> None:
        if len(self._keys) >= self.size:
            self._keys.clear()
        self._keys.add(key)


# ------------------------------------------------------------------------------------------------
# argument types, before an op is called (a wrong type is then a TypeError naming the argument
# rather than a schema error)
# ------------------------------------------------------------------------------------------------
def check_types(op_name: str, **tensors) -> None:
    """``TypeError`` naming the first argument that is neither a tensor nor ``None``."""
    for name, x in tensors.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{op_name}: {name} must be a torch.Tensor, got {type(x).__name__}")


def check_int(op_name: str, name: str, value, *, optional: bool = False, minimum: int = INT32_MIN) -> None:
    """``TypeError`` unless ``value`` is an int (or None where ``optional``); ``ValueError`` outside
    ``[minimum, 2^31 - 1]`` (the kernels take these as 32-bit integers)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op_name}: {name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= INT32_MAX:
        raise ValueError(f"{op_name}: {name} must be in [{minimum}, {INT32_MAX}], got {value}")


def check_real(op_name: str, name: str, value, *, optional: bool = True) -> None:
    """``TypeError`` unless ``value`` is a real number (or None where ``optional``); not a bool."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op_name}: {name} must be a float, got {type(value).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Checker:
    """Collects the context (op name, reference device) so each rule is one short line.

    ``static``: only the checks that need no data (types, dtypes, devices, shapes, strides), as
    an op's fake implementation runs them on fake tensors while ``torch.compile`` traces; the
    overlap checks (addresses) and the value checks are skipped there and run when the op runs."""

    __slots__ = ("op", "device", "static")

    def __init__(self, op: str, device: torch.device, static: bool = False):
        self.op = op
        self.device = device
        self.static = static

    def values(self, check: Optional[bool]) -> bool:
        """Whether this call checks values held in tensors (``wants_value_checks``; never static)."""
        return not self.static and wants_value_checks(check, self.device)

    def fail(self, name: str, msg: str, exc: type = ValueError):
        raise exc(f"{self.op}: {name} {msg}")

    # ---- one tensor -----------------------------------------------------------------------------
    def tensor(self, name: str, x, *, dims: Optional[int] = None, dtypes: Sequence[torch.dtype] = (),
               shape: Optional[Sequence[Optional[int]]] = None, last_contiguous: bool = False,
               contiguous: bool = False, why: str = "") -> torch.Tensor:
        """Type, dtype, device, rank, shape (``None`` entries match any size) and strides.
        ``why`` is appended to a shape error (for example which argument a size came from)."""
        # One pass that accepts a good tensor cheaply (this runs for every argument of every
        # call, a visible share of the host time); any miss re-checks rule by rule to name it.
        if (isinstance(x, torch.Tensor) and (not dtypes or x.dtype in dtypes) and x.device == self.device
                and (dims is None or x.dim() == dims) and (shape is None or _shape_matches(x.shape, shape))
                and (not contiguous or x.is_contiguous())
                and (not last_contiguous or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1)):
            return x
        return self._explain_tensor(name, x, dims, dtypes, shape, last_contiguous, contiguous, why)

    def _explain_tensor(self, name, x, dims, dtypes, shape, last_contiguous, contiguous, why) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            self.fail(name, f"must be a torch.Tensor, got {type(x).__name__}", TypeError)
        if dtypes and x.dtype not in dtypes:
            allowed = ", ".join(_dtype_name(d) for d in dtypes)
            self.fail(name, f"has dtype {_dtype_name(x.dtype)}; expected {allowed}", TypeError)
        if x.device != self.device:
            self.fail(name, f"is on {x.device}, but the op's tensors are on {self.device}")
        if dims is not None and x.dim() != dims:
            self.fail(name, f"must have {dims} dims, got shape {list(x.shape)}")
        if shape is not None and not _shape_matches(x.shape, shape):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            self.fail(name, f"has shape {list(x.shape)}; expected {want}{why}")
        if last_contiguous and x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
            self.fail(name, f"must be contiguous in its last dim (strides {x.stride()})")
        if contiguous and not x.is_contiguous():
            self.fail(name, f"must be contiguous (strides {x.stride()})")
        return x

    def index(self, name: str, x, length: Optional[int] = None) -> torch.Tensor:
        """A 1-D int32 index tensor, contiguous, of ``length`` elements when given."""
        return self.tensor(name, x, dtypes=(torch.int32,), shape=(length,), contiguous=True)

    def size(self, name: str, value: int, what: str) -> int:
        """A dimension that must not be empty (a head count, a head size, a channel count)."""
        if value < 1:
            self.fail(name, f"has {what} = {value}; it must be at least 1")
        return value

    # ---- scalars --------------------------------------------------------------------------------
    def integer(self, name: str, v, minimum: Optional[int] = INT32_MIN,
                maximum: Optional[int] = INT32_MAX) -> int:
        """A Python int within ``[minimum, maximum]`` (by default the int32 range: the kernels
        take these values as 32-bit integers)."""
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(name, f"must be an int, got {type(v).__name__}", TypeError)
        if minimum is not None and v < minimum:
            self.fail(name, f"must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            self.fail(name, f"must be <= {maximum}, got {v}")
        return v

    def null_slot(self, v) -> int:
        """The padding marker: any int32 (values ``<= null_slot`` are padding)."""
        return self.integer("null_slot", v)

    # ---- memory: what an op writes must not overlap anything else it touches --------------------
    def writes(self, written: Iterable[tuple[str, Optional[torch.Tensor]]],
               read: Iterable[tuple[str, Optional[torch.Tensor]]]) -> None:
        """Refuse a written tensor that overlaps itself (a zero or interleaving stride: two of its
        elements at one address) or shares bytes with any other argument, read or written.

        Tensors of one storage (views of one buffer) are compared by byte ranges (first to last
        byte), so two interleaved views that never touch the same byte are refused as well, which
        no op here needs to allow; tensors of different storages cannot share bytes unless made
        over the same memory outside torch (``from_blob``, DLPack), which is not detected."""
        if self.static or self.device.type == "meta":
            return
        by_storage: dict[int, list] = {}
        for is_written, pairs in ((True, written), (False, read)):
            for name, t in pairs:
                if t is None or not t.numel():
                    continue
                if is_written and not t.is_contiguous() and _overlaps_itself(t):
                    self.fail(name, f"overlaps itself in memory (strides {t.stride()}): every element "
                                    "it is written through must have its own address")
                by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((is_written, name, t))
        for members in by_storage.values():
            if len(members) > 1 and any(m[0] for m in members):
                self._disjoint(members)

    def _disjoint(self, members: list) -> None:
        """``members``: ``(written, name, tensor)`` of one storage, written ones first."""
        spans = [(written, name, _byte_span(t)) for written, name, t in members]
        for i, (written, name, (lo, hi)) in enumerate(spans):
            if not written:
                break
            for _, other, (lo2, hi2) in spans[i + 1:]:
                if lo < hi2 and lo2 < hi:
                    self.fail(name, f"overlaps {other} in memory")

    # ---- value checks (host-side; the caller decides whether to run them) ----------------------
    def slots_in_range(self, name: str, slots: torch.Tensor, num_slots: int, null_slot: int):
        """Every entry is padding (``<= null_slot``) or a slot (``core/indices.py``)."""
        for i, s in enumerate(slots.reshape(-1).tolist()):
            if s > null_slot and not is_slot(s, null_slot, num_slots):
                self.fail(name, f"entry {i} = {s} is neither a padding value (<= null_slot = {null_slot}) "
                                f"nor a slot in [0, {num_slots})")

    def query_start_loc(self, name: str, qsl: torch.Tensor, num_tokens: int,
                        max_len: Optional[int]) -> list[int]:
        """Starts at 0 or later, never decreases, ends within the tokens given; no row longer
        than ``max_len``. Returns the values."""
        vals = qsl.tolist()
        if vals and vals[0] < 0:
            self.fail(name, f"starts at {vals[0]} < 0")
        for i in range(len(vals) - 1):
            length = vals[i + 1] - vals[i]
            if length < 0:
                self.fail(name, f"decreases at row {i}: {vals[i]} -> {vals[i + 1]}")
            if max_len is not None and length > max_len:
                self.fail(name, f"row {i} has {length} tokens, more than the window of {max_len}")
        if vals and vals[-1] > num_tokens:
            self.fail(name, f"ends at {vals[-1]}, past the {num_tokens} tokens given")
        return vals

    def distinct_writes(self, name: str, writes: list[tuple[int, int]], sources: list[tuple[int, int]]):
        """Refuse two writes to one slot, or a write to a slot another row reads (a race on a
        GPU). ``writes`` and ``sources``: ``(row, slot)`` pairs (several rows may read one slot)."""
        readers: dict[int, list[int]] = {}
        for row, slot in sources:
            readers.setdefault(slot, []).append(row)
        seen: dict[int, int] = {}
        for row, slot in writes:
            if slot in seen and seen[slot] != row:
                self.fail(name, f"makes rows {seen[slot]} and {row} both write slot {slot}")
            seen[slot] = row
            others = [r for r in readers.get(slot, ()) if r != row]
            if others:
                self.fail(name, f"makes row {row} write slot {slot}, which row {others[0]} reads")


def _shape_matches(actual: torch.Size, expected: Sequence[Optional[int]]) -> bool:
    """``expected`` has one entry per dim; ``None`` matches any size."""
    if len(actual) != len(expected):
        return False
    if None not in expected:
        return tuple(actual) == tuple(expected)
    return all(want is None or want == got for want, got in zip(expected, actual))


def _overlaps_itself(x: torch.Tensor) -> bool:
    """True unless every dim's stride exceeds the furthest element the smaller strides reach
    (the usual sufficient test for a view whose elements all have their own address)."""
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of a non-empty tensor (strides are never negative)."""
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    lo = x.data_ptr()
    return lo, lo + (last + 1) * x.element_size()
