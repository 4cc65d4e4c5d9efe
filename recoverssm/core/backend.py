"""The backend interface: what a backend declares and the kernel-facing functions it implements.

The kernel-facing functions take tensors and scalars only, mutate only the tensors they name and
allocate nothing: the public API (``recoverssm.core.api``) validates, allocates outputs, picks the
backend and calls these. That keeps each op ready to be wrapped as a ``torch.library`` custom op.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from .pointers import PointerEncoding


class Backend(ABC):
    """Base class of every backend.

    Class attributes a backend sets:

    ``name``: unique registry name (``"cpu_ref"``, ``"cuda"``, ``"xpu"``, ...).
    ``device_types``: the ``torch.device.type`` values it serves.
    ``pointer_encoding``: a :class:`~recoverssm.core.pointers.PointerEncoding` for device pointer tables.
    ``capabilities``: a frozenset of feature names (see ``CAPABILITIES``).
    """

    name: str = ""
    device_types: tuple[str, ...] = ()
    pointer_encoding: PointerEncoding = PointerEncoding.INT64
    capabilities: frozenset[str] = frozenset()

    #: What a backend may claim. Ops outside this list are not part of the contract yet.
    CAPABILITIES = frozenset({
        "conv_verify", "gdn_verify", "gdn_decode", "gdn_spec_decode_snapshot",
        "plan_commit", "commit", "grouped_commit", "bf16_state", "vector_decay",
    })

    # ---- availability -------------------------------------------------------------------------
    def is_available(self) -> bool:
        """True when this machine can run the backend (hardware, compiler, drivers present)."""
        return True

    def unavailable_reason(self) -> str:
        """One line saying why :meth:`is_available` is False (shown in errors and ``recoverssm info``)."""
        return ""

    def serves(self, device_type: str) -> bool:
        """True when this backend can run on tensors of ``device_type``."""
        return device_type in self.device_types

    # ---- kernel-facing ops (tensors and scalars in, named tensors mutated) ---------------------
    @abstractmethod
    def conv_verify(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                    query_start_loc: torch.Tensor, silu: bool, null_slot: int,
                    out: torch.Tensor) -> None:
        """Causal depthwise conv of each row's window; writes ``out`` and the window columns of
        ``conv_state`` (``[history, history + len)``), never the history columns."""

    @abstractmethod
    def gdn_recurrent(self, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      state: torch.Tensor, state_indices: torch.Tensor,
                      query_start_loc: torch.Tensor, gates: "GateInputs", scale: float,
                      use_qk_l2norm: bool, null_slot: int, out: torch.Tensor,
                      records: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      snapshot_slots: Optional[torch.Tensor]) -> None:
        """The GDN recurrence over each row's window, in one of three modes:

        ``"verify"``: read the checkpoint, write ``out`` and ``records``; never write ``state``.
        ``"decode"``: write ``out`` and the final state back into the row's slot.
        ``"snapshot"``: write ``out`` and the state after every position into ``snapshot_slots``.
        """

    @abstractmethod
    def plan_commit(self, num_accepted: torch.Tensor, state_indices: torch.Tensor,
                    query_start_loc: torch.Tensor, request_indices: Optional[torch.Tensor],
                    block_table: Optional[torch.Tensor], num_computed_tokens: Optional[torch.Tensor],
                    block_size: int, null_slot: int, num_slots: int,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Fill ``out = (commit_len, final_slot, boundary_slot, boundary_len)`` (contract section 4)."""

    @abstractmethod
    def make_committer(self, layers: "Sequence[CommitLayer]", num_groups: int, max_batch: int,
                       null_slot: int) -> "Committer":
        """Build whatever the backend needs once per :class:`~recoverssm.CommitContext`
        (for GPU backends, the device tables of per-layer pointers and strides)."""

    def describe(self) -> str:
        return f"{self.name} (devices: {', '.join(self.device_types)}; pointers: {self.pointer_encoding.value})"


class GateInputs:
    """The gate inputs of a GDN call: either raw (``a``, ``b``, ``A_log``, ``dt_bias``) or
    precomputed (``g``, ``beta``). Exactly one form is set; tensors are ``[T_total, HV]`` and ``[HV]``."""

    __slots__ = ("a", "b", "A_log", "dt_bias", "g", "beta")

    def __init__(self, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None):
        self.a, self.b, self.A_log, self.dt_bias, self.g, self.beta = a, b, A_log, dt_bias, g, beta

    @property
    def precomputed(self) -> bool:
        return self.g is not None


class CommitLayer:
    """One layer as a committer sees it: its tensors and the KV-cache group it belongs to."""

    __slots__ = ("group", "state", "correction", "key", "decay", "conv_state", "conv_history")

    def __init__(self, group: int, state, correction, key, decay, conv_state, conv_history: int):
        self.group = group
        self.state = state
        self.correction = correction
        self.key = key
        self.decay = decay
        self.conv_state = conv_state
        self.conv_history = conv_history


class GroupStep:
    """One KV-cache group's step metadata for a commit call (already validated)."""

    __slots__ = ("state_indices", "request_indices", "block_table", "num_computed_tokens", "block_size")

    def __init__(self, state_indices, request_indices, block_table, num_computed_tokens, block_size):
        self.state_indices = state_indices
        self.request_indices = request_indices
        self.block_table = block_table
        self.num_computed_tokens = num_computed_tokens
        self.block_size = block_size


class Committer(ABC):
    """A backend's commit engine for a fixed set of layers (built once per ``CommitContext``)."""

    @abstractmethod
    def commit(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor,
               groups: Sequence[GroupStep]) -> None:
        """Replay the accepted tokens of every row into every layer's state, and compact conv states."""

    def commit_again(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor,
                     groups: Sequence[GroupStep]) -> None:
        """:meth:`commit` with the very objects of the previous call, whose tensors the caller has
        found unchanged in address, dtype, device, shape and strides (their values may differ).
        A backend may reuse whatever it derived from them last time."""
        self.commit(num_accepted, query_start_loc, groups)
