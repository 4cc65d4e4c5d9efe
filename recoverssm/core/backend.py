"""The backend interface: what a backend declares and the kernel-facing functions it implements.

The kernel-facing functions take tensors and scalars only, mutate only the tensors they name and
allocate nothing. The conv and recurrence functions, and a committer's ``commit``, take ``bind``:
when it is true they may return a :class:`Launch` (their launch, bound to the addresses of the
tensors they were given, to repeat for a call of the same layout) or ``None`` where they cannot;
when it is false they return ``None``. The ``torch.library`` ops (``core/ops.py``) validate their
arguments (``core/arguments.py``), pick the backend (``core/registry.py``) and call these.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence

import torch

from .pointers import PointerEncoding
from .types import FAMILIES


class Launch:
    """What a kernel-facing function returns when asked to ``bind``: its launch, bound to the
    addresses of the tensors it was given, to be called again (with no argument) for an eager
    call whose tensors have exactly that layout: the same addresses, dtypes, devices, shapes and
    strides, new values (``core/repeats.py``). ``run`` must hold no tensor of the caller's (it
    may hold the backend's own, such as a device table it points at), launch on the current
    stream with the device it was bound on made current, and either launch everything the call
    launched or nothing: it returns False without launching when it cannot run (the call then
    goes through the op). Anything else a backend returns is ignored."""

    __slots__ = ("run",)

    def __init__(self, run: Callable[[], bool]):
        self.run = run

    def __call__(self) -> bool:
        return self.run()


class Backend(ABC):
    """Base class of every backend.

    Class attributes a backend sets:

    ``name``: unique registry name (``"cpu_ref"``, ``"cuda"``, ``"xpu"``, ...).
    ``device_types``: the ``torch.device.type`` values it serves.
    ``pointer_encoding``: a :class:`~recoverssm.core.pointers.PointerEncoding` for device pointer tables.
    ``capabilities``: a frozenset of the names in ``CAPABILITIES`` it implements; the ops and
    :class:`~recoverssm.CommitContext` refuse work a backend does not declare.
    ``environment``: names of environment variables whose value can change :meth:`is_available`
    or :meth:`serves` (the registry resolves again when one of them changes).
    """

    name: str = ""
    device_types: tuple[str, ...] = ()
    pointer_encoding: PointerEncoding = PointerEncoding.INT64
    capabilities: frozenset[str] = frozenset()
    environment: tuple[str, ...] = ()

    #: What a backend may declare, and what each name promises:
    #: ``conv_verify``, ``conv_decode``: the conv ops; each family of ``core.types.FAMILIES``
    #: (``gdn``, ``kda``, ``mamba2``): its recurrence (verify, decode, snapshot); ``plan_commit``: the plan
    #: op; ``commit``: the grouped commit of scalar-decay records; ``vector_decay``: the commit of
    #: KDA's vector-decay records; ``bf16_state``: bf16 state pools; ``deferred``: deferred
    #: commits (verify and conv verify replaying a pending step, a committer's ``defer`` and
    #: ``flush``).
    CAPABILITIES = frozenset({
        "conv_verify", "conv_decode", *FAMILIES, "plan_commit", "commit", "vector_decay", "bf16_state", "deferred",
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

    def kernels(self) -> dict[str, str]:
        """Which kernel family runs each op on this backend, and why (``recoverssm info``)."""
        return {}

    # ---- kernel-facing ops (tensors and scalars in, named tensors mutated) ---------------------
    @abstractmethod
    def conv_verify(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], state_indices: torch.Tensor,
                    query_start_loc: torch.Tensor, silu: bool, dilation: int, null_slot: int,
                    out: torch.Tensor, *, pending: "Optional[PendingInputs]" = None,
                    bind: bool = False) -> Optional[Launch]:
        """Causal depthwise conv of each row's window, taps ``dilation`` tokens apart; writes
        ``out`` and the window columns of ``conv_state`` (``[history, history + len)``, ``history =
        (width - 1) * dilation``), never the history columns (but where a row
        replays its ``pending`` step first: then the compacted history of its final and boundary
        slots, and its window goes to the final slot)."""

    @abstractmethod
    def conv_decode(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], state_indices: torch.Tensor, silu: bool, dilation: int,
                    null_slot: int, out: torch.Tensor, *, bind: bool = False) -> Optional[Launch]:
        """One token per row: writes ``out`` and shifts the history columns ``[0, history)`` of
        the row's slot by one token, the new token last."""

    @abstractmethod
    def recurrence(self, call: "RecurrenceCall", *, bind: bool = False) -> Optional[Launch]:
        """The recurrence of ``call.gates.kind`` (GDN, KDA, Mamba2) over each row's window, in one
        of three modes, ``call.mode`` (:class:`RecurrenceCall`; Mamba2: ``q``, ``k``, ``v`` are
        ``C``, ``B``, ``x``; ``scale`` 1, no norm):

        ``"verify"``: read the checkpoint, write ``out`` and ``records``; never write ``state``
        (but where a row replays its ``pending`` step first: its final and boundary slots).
        ``"decode"``: write ``out`` and the final state back into the row's slot.
        ``"snapshot"``: write ``out`` and the state after every position into ``snapshot_slots``.
        ``round_each_token``: round the running state to ``state``'s dtype after every token (the
        output of a token taken before), in the pending replay too; else only where it is stored.
        """

    @abstractmethod
    def plan_commit(self, num_accepted: torch.Tensor, state_indices: torch.Tensor,
                    query_start_loc: torch.Tensor, request_indices: Optional[torch.Tensor],
                    block_table: Optional[torch.Tensor], num_computed_tokens: Optional[torch.Tensor],
                    block_size: int, null_slot: int, num_slots: int,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Fill ``out = (commit_len, final_slot, boundary_slot, boundary_len)`` (``core/plan.py``)."""

    @abstractmethod
    def make_committer(self, layers: "Sequence[CommitLayer]", num_groups: int, max_batch: int,
                       null_slot: int) -> "Committer":
        """Build whatever the backend needs once per set of layers (for GPU backends, the device
        tables of per-layer pointers and strides). ``layers`` are validated."""

    def describe(self) -> str:
        return f"{self.name} (devices: {', '.join(self.device_types)}; pointers: {self.pointer_encoding.value})"


class GateInputs:
    """The gate inputs of a recurrence call, by family (``kind``, a key of ``FAMILIES``).

    GDN and KDA: either raw (``a``, ``b``, ``A_log``, ``dt_bias``) or precomputed (``g``,
    ``beta``): exactly one form is set. GDN: ``a``, ``b``, ``g``, ``beta`` ``[T, HV]``; ``A_log``,
    ``dt_bias`` ``[HV]``. KDA: ``a``, ``g`` ``[T, HV, K]``; ``b``, ``beta`` ``[T, HV]``;
    ``A_log`` ``[HV]``; ``dt_bias`` ``[HV, K]``; ``lower_bound`` selects KDA's bounded gate.

    Mamba2: ``a`` is the raw ``dt`` ``[T, HV]``, ``dt_bias`` ``[HV]``, one of ``A_log`` and ``A``
    ``[HV]`` fp32 (``A = -exp(A_log)``), ``D`` ``[HV]`` or ``[HV, V]`` fp32 or None, ``z``
    ``[T, HV, V]`` or None, ``dt_limit`` ``(dt_min, dt_max)`` or None (no clamp).
    """

    __slots__ = ("kind", "a", "b", "A_log", "dt_bias", "g", "beta", "lower_bound", "A", "D", "z", "dt_limit")

    def __init__(self, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None, *,
                 kind: str = "gdn", lower_bound: Optional[float] = None, A=None, D=None, z=None,
                 dt_limit: Optional[tuple[float, float]] = None):
        self.kind = kind
        self.a, self.b, self.A_log, self.dt_bias, self.g, self.beta = a, b, A_log, dt_bias, g, beta
        self.lower_bound = lower_bound
        self.A, self.D, self.z, self.dt_limit = A, D, z, dt_limit

    @property
    def precomputed(self) -> bool:
        return self.g is not None

    @property
    def vector_decay(self) -> bool:
        return FAMILIES[self.kind].vector_decay

    @property
    def delta_rule(self) -> bool:
        return FAMILIES[self.kind].delta_rule


class PendingInputs:
    """A verify's view of the step before it, whose commit was deferred.

    ``plan``: int32 ``[1, 6, max_batch]``, the layer's KV-cache group's plan of the deferred step
    (``core.types.PLAN_FIELDS``: commit length, source, final and boundary slots, boundary
    length, replays); ``rows``: int32 ``[B]`` or ``None``, the deferred row each row of this call
    replays first (``<= null_slot`` or ``None``: nothing); ``parity``: int32 ``[1]``, the records
    buffer this call writes (the records are double-buffered: the other buffer holds the pending
    step's), ``None`` for the conv. A row that replays does in registers what the commit of its
    deferred row would have done (reads the source slot, replays ``commit_len`` records, stores
    the boundary and final states, or compacts the conv history into them), adds one to the
    row's ``replays``, then verifies from the final state."""

    __slots__ = ("plan", "rows", "parity")

    def __init__(self, plan, rows, parity):
        self.plan, self.rows, self.parity = plan, rows, parity


class RecurrenceCall:
    """One call of a recurrence op, as its backend receives it (checked): the mode and everything
    the op passes, so that the backends, the launchers and the reference take one object instead
    of restating the argument list.

    ``mode``: ``"verify"``, ``"decode"`` or ``"snapshot"``. ``q``, ``k``: ``[T, H, K]``; ``v``,
    ``out``: ``[T, HV, V]`` (Mamba2: ``C``, ``B``, ``x`` in these roles); ``state``: ``[num_slots,
    HV, V, K]``; ``state_indices``: int32 ``[B]``; ``query_start_loc``: int32 ``[B + 1]``;
    ``gates``: :class:`GateInputs` (its ``kind`` is the family); ``scale``: of ``q^`` (1 for
    Mamba2); ``use_qk_l2norm``; ``null_slot``; ``records``: ``(correction, key, decay)`` in verify,
    else ``None``; ``snapshot_slots``: int32 ``[B, T_max]`` in snapshot mode, else ``None``;
    ``pending``: a verify's :class:`PendingInputs` (a deferred step to replay first) or ``None``;
    ``round_each_token``: round the running state to ``state``'s dtype after every token."""

    __slots__ = ("mode", "q", "k", "v", "state", "state_indices", "query_start_loc", "gates", "scale",
                 "use_qk_l2norm", "null_slot", "out", "records", "snapshot_slots", "pending", "round_each_token")

    def __init__(self, mode: str, q, k, v, state, state_indices, query_start_loc, gates: "GateInputs", scale: float,
                 use_qk_l2norm: bool, null_slot: int, out, records=None, snapshot_slots=None,
                 pending: "Optional[PendingInputs]" = None, round_each_token: bool = True):
        self.mode, self.q, self.k, self.v, self.state = mode, q, k, v, state
        self.state_indices, self.query_start_loc, self.gates, self.scale = state_indices, query_start_loc, gates, scale
        self.use_qk_l2norm, self.null_slot, self.out, self.records = use_qk_l2norm, null_slot, out, records
        self.snapshot_slots, self.pending, self.round_each_token = snapshot_slots, pending, round_each_token

    def replace(self, **changes) -> "RecurrenceCall":
        """A copy with ``changes`` (for example the token inputs packed by a launcher)."""
        return RecurrenceCall(**{name: changes.get(name, getattr(self, name)) for name in self.__slots__})

    @property
    def written(self) -> tuple:
        """The tensors the call may write: ``out``, the state, the records, a pending plan."""
        return (self.state, self.out, *(self.records or ()),
                self.pending.plan if self.pending is not None else None)


class CommitLayer:
    """One layer as a committer sees it: its tensors and the KV-cache group it belongs to.
    ``conv_history``: the conv state's history columns (conv width - 1), 0 without a conv state.
    ``record_buffers``: 2 where the records are double-buffered (a context that defers its
    commits: buffer ``b`` is rows ``[b * max_batch, (b + 1) * max_batch)``), else 1.
    ``round_each_token``: the replay rounds the state to the pool's dtype after every token
    (``ReplayRecords.round_each_token``), else only where it is stored."""

    __slots__ = ("group", "state", "correction", "key", "decay", "conv_state", "conv_history", "record_buffers",
                 "round_each_token")

    def __init__(self, group: int, state, correction, key, decay, conv_state, conv_history: int,
                 record_buffers: int = 1, round_each_token: bool = True):
        self.group = group
        self.state = state
        self.correction = correction
        self.key = key
        self.decay = decay
        self.conv_state = conv_state
        self.conv_history = conv_history
        self.record_buffers = record_buffers
        self.round_each_token = round_each_token

    @property
    def vector_decay(self) -> bool:
        return self.decay.dim() == 4


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
    """A backend's commit engine for a fixed set of layers (built once per ``CommitContext``).
    ``bind``: as the kernel-facing functions (the module's docstring)."""

    @abstractmethod
    def commit(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor,
               groups: Sequence[GroupStep], *, bind: bool = False) -> Optional[Launch]:
        """Replay the accepted tokens of every row into every layer's state, and compact conv
        states."""

    def defer(self, plan: torch.Tensor, parity: torch.Tensor, num_accepted: torch.Tensor,
              query_start_loc: torch.Tensor, groups: Sequence[GroupStep], *,
              bind: bool = False) -> Optional[Launch]:
        """Write nothing but each group's commit plan of this step into ``plan`` (int32 ``[G, 6,
        max_batch]``, ``core.types.PLAN_FIELDS``; rows past the batch commit nothing; ``replays``
        zero) and flip ``parity`` (int32 ``[1]``): the records this step's verify wrote are now
        the pending step's. The plan is the commit's (``core/plan.py``), with each group's
        slot count and records window (one per group in a deferring context). Backends that
        declare ``deferred`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not defer commits")

    def flush(self, plan: torch.Tensor, parity: torch.Tensor, rows: torch.Tensor, *,
              bind: bool = False) -> Optional[Launch]:
        """Commit now the pending step of the deferred rows ``rows`` (int32 ``[R]``; entries that
        are not rows of the plan are skipped): each row's plan entry (``core.plan.plan_entry``),
        its records in the buffer ``1 - parity``; then their ``commit_len`` is 0 in every
        group (nothing pending)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer commits")
