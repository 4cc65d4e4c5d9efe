"""Argument checks shared by every public op (contract section 5).

Each check raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (shape, stride,
device, value) whose message starts with the op and names the argument. All checks run before
anything is launched or written.

Checks of *values held in tensors* (slot indices, ``query_start_loc``, block tables) need the
values on the host: they always run for CPU tensors; for device tensors they run only when the
caller passes ``check=True`` or sets ``RECOVERSSM_CHECK=1`` (each costs a device sync). Without
them, kernels treat any slot outside ``(null_slot, num_slots)`` as null.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

ENV_CHECK = "RECOVERSSM_CHECK"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def wants_value_checks(check: Optional[bool], device: torch.device) -> bool:
    """Value checks run on CPU tensors always, elsewhere when asked (``check=True`` or the env var)."""
    if device.type == "cpu":
        return True
    if check is not None:
        return bool(check)
    return os.environ.get(ENV_CHECK, "0") not in ("", "0", "false", "False")


class Checker:
    """Collects the context (op name, reference device) so each rule is one short line."""

    def __init__(self, op: str, device: torch.device):
        self.op = op
        self.device = device

    def fail(self, name: str, msg: str, exc: type = ValueError):
        raise exc(f"{self.op}: {name} {msg}")

    def tensor(self, name: str, x, *, dims: Optional[int] = None, dtypes: Sequence[torch.dtype] = (),
               shape: Optional[Sequence[Optional[int]]] = None, last_contiguous: bool = False,
               contiguous: bool = False) -> torch.Tensor:
        # One pass that accepts a good tensor cheaply (this runs for every argument of every
        # call, so it is a visible share of the host time); any miss re-checks rule by rule
        # below to name the failure.
        if (isinstance(x, torch.Tensor) and (not dtypes or x.dtype in dtypes) and x.device == self.device
                and (dims is None or x.dim() == dims) and (shape is None or _shape_matches(x.shape, shape))
                and (not contiguous or x.is_contiguous())
                and (not last_contiguous or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1)):
            return x
        return self._explain_tensor(name, x, dims, dtypes, shape, last_contiguous, contiguous)

    def _explain_tensor(self, name, x, dims, dtypes, shape, last_contiguous, contiguous) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            self.fail(name, f"must be a torch.Tensor, got {type(x).__name__}", TypeError)
        if dtypes and x.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            self.fail(name, f"has dtype {str(x.dtype).replace('torch.', '')}; expected {allowed}", TypeError)
        if x.device != self.device:
            self.fail(name, f"is on {x.device}, but the op's tensors are on {self.device}")
        if dims is not None and x.dim() != dims:
            self.fail(name, f"must have {dims} dims, got shape {tuple(x.shape)}")
        if shape is not None:
            if not _shape_matches(x.shape, shape):
                want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                self.fail(name, f"has shape {list(x.shape)}; expected {want}")
        if last_contiguous and x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
            self.fail(name, f"must be contiguous in its last dim (strides {x.stride()})")
        if contiguous and not x.is_contiguous():
            self.fail(name, f"must be contiguous (strides {x.stride()})")
        return x

    def index(self, name: str, x, length: Optional[int] = None) -> torch.Tensor:
        """A 1-D int32 index tensor, contiguous, of ``length`` elements when given."""
        return self.tensor(name, x, dtypes=(torch.int32,), shape=(length,), contiguous=True)

    def integer(self, name: str, v, minimum: Optional[int] = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(name, f"must be an int, got {type(v).__name__}", TypeError)
        if minimum is not None and v < minimum:
            self.fail(name, f"must be >= {minimum}, got {v}")
        return v

    def no_overlap(self, name: str, x: torch.Tensor, other_name: str, other: torch.Tensor):
        """Refuse an output that shares memory with an input the op still reads."""
        if x.untyped_storage().data_ptr() == other.untyped_storage().data_ptr():
            lo1, hi1 = _byte_span(x)
            lo2, hi2 = _byte_span(other)
            if lo1 < hi2 and lo2 < hi1:
                self.fail(name, f"overlaps {other_name} in memory")

    # ---- value checks (host-side; the caller decides whether to run them) ----------------------
    def slots_in_range(self, name: str, slots: torch.Tensor, num_slots: int, null_slot: int):
        vals = slots.reshape(-1).tolist()
        for i, s in enumerate(vals):
            if s > null_slot and not 0 <= s < num_slots:
                self.fail(name, f"entry {i} = {s} is neither a padding value (<= null_slot = {null_slot}) "
                                f"nor a slot in [0, {num_slots})")

    def query_start_loc(self, name: str, qsl: torch.Tensor, num_tokens: int,
                        max_len: Optional[int]) -> list[int]:
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


def _shape_matches(actual: torch.Size, expected: Sequence[Optional[int]]) -> bool:
    """``expected`` has one entry per dim; ``None`` matches any size."""
    if len(actual) != len(expected):
        return False
    for want, got in zip(expected, actual):
        if want is not None and want != got:
            return False
    return True


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    if x.numel() == 0:
        return x.data_ptr(), x.data_ptr()
    lo = hi = x.data_ptr()
    for size, stride in zip(x.shape, x.stride()):
        span = (size - 1) * stride * x.element_size()
        if span >= 0:
            hi += span
        else:
            lo += span
    return lo, hi + x.element_size()
