"""Thin holders over tensors: replay records, a layer's caches and a commit plan.

They own no logic beyond allocation and shape bookkeeping, so that the kernel-facing layer
(backends) can stay a set of functions over plain tensors (the future ``torch.library`` ops).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Family:
    """A recurrence family: what its ops add to, or change in, the shared recurrence.

    Every family's state is ``[num_slots, HV, V, K]`` (K contiguous) and its step is
    ``S = fma(c, k, S * d)``, so its records and its commit are the shared ones. What differs:

    ``tokens``: the names of its three token inputs in the roles ``(q, k, v)`` of the shared
    kernels: the vector read against the state (GDN/KDA ``q``; Mamba2 ``C``), the key of the
    update (``k``; ``B``), the per-value-head input (``v``; ``x``); ``q`` and ``k`` are
    ``[T, H, K]``, ``v`` ``[T, HV, V]``. ``gates``: its gate arguments in the ops' schema (the
    names, and the schema text ``gate_schema``), ``scalars``: its float arguments after them,
    ``options``: the schema text of the arguments after those (GDN/KDA: ``scale`` and
    ``use_qk_l2norm``). ``vector_decay``: the decay is a K-vector per token and value head (KDA:
    the gate input ``a`` and ``g`` are ``[T, HV, K]``, ``dt_bias`` ``[HV, K]``, records with a
    vector decay), else a scalar (GDN, Mamba2: ``[T, HV]`` and ``[HV]``). ``delta_rule``: the
    correction depends on the state (``c = beta * (v - S' k^)``; Mamba2's is ``dt * x``)."""

    name: str
    vector_decay: bool
    scalars: tuple[str, ...] = ()
    tokens: tuple[str, str, str] = ("q", "k", "v")
    gates: tuple[str, ...] = ("a", "b", "A_log", "dt_bias", "g", "beta")
    options: str = "float? scale, bool use_qk_l2norm"
    delta_rule: bool = True

    @property
    def gate_schema(self) -> str:
        """The gate arguments as the ops' schema declares them (every one optional: which are
        required depends on the gate form, checked with a message that names them)."""
        return ", ".join(f"Tensor? {name}" for name in self.gates)


#: The recurrence families, by the name their ops start with (``gdn_verify``, ``kda_decode``, ...).
FAMILIES = {
    "gdn": Family("gdn", vector_decay=False),
    "kda": Family("kda", vector_decay=True, scalars=("lower_bound",)),
    "mamba2": Family("mamba2", vector_decay=False, scalars=("dt_min", "dt_max"), tokens=("C", "B", "x"),
                     gates=("dt", "dt_bias", "A_log", "A", "D", "z"), options="", delta_rule=False),
}


@dataclass(frozen=True)
class ReplayRecords:
    """Per-token replay records of one recurrent layer, written by verify, read by the commit.

    ``correction``: fp32 ``[buffers * max_batch, HV, max_window, V]``, the correction ``c_t``.
    ``key``: fp32 ``[buffers * max_batch, H, max_window, K]``, the normalized key ``k^_t`` (one per
    q/k head). ``decay``: fp32 ``[buffers * max_batch, HV, max_window]`` (scalar decay, GDN /
    Mamba2) or ``[buffers * max_batch, HV, max_window, K]`` (vector decay, KDA), the exact
    multiplier ``d_t``.

    Indexed by batch row ``r`` and window position ``t``. The records live in a workspace beside
    the state pool; they are overwritten by every verify and consumed by the commit that follows.
    ``buffers = 2`` (deferred commits, :meth:`CommitContext.defer`): two workspaces of
    ``max_batch`` rows each, buffer ``b`` at rows ``[b * max_batch, (b + 1) * max_batch)``; a
    verify writes one while the other holds the records of the step still pending (the
    context's ``Pending.parity`` says which).

    ``round_each_token`` (the layer's rounding mode, read by its verify and by the commit that
    replays these records): ``True`` (the default) rounds the running state to the pool's dtype
    after every token, in verify, in the commit's replay and in the deferred replay, so that a
    bf16 pool gets the bits of one-token-per-call decoding; ``False`` keeps it fp32 within a call
    and rounds it only where it is stored (fewer instructions per token; for fp32 pools the two
    are the same). Frozen, like every field: a layer's verify and the commit that replays its
    records (which specializes its launches on the mode once) then cannot disagree.
    """

    correction: torch.Tensor
    key: torch.Tensor
    decay: torch.Tensor
    buffers: int = 1
    round_each_token: bool = True

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_window: int,
        H: int,
        HV: int,
        K: int,
        V: int,
        *,
        device: torch.device | str | None = None,
        vector_decay: bool = False,
        buffers: int = 1,
        round_each_token: bool = True,
    ) -> "ReplayRecords":
        """Allocate an fp32 records workspace for up to ``max_batch`` rows of ``max_window`` tokens
        (``buffers=2``: double-buffered, for a context that defers its commits;
        ``round_each_token``: the layer's rounding mode, see the class)."""
        for name, val in (("max_batch", max_batch), ("max_window", max_window), ("H", H),
                          ("HV", HV), ("K", K), ("V", V)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"ReplayRecords.allocate: {name} must be a positive int, got {val!r}")
        if HV % H:
            raise ValueError(f"ReplayRecords.allocate: HV ({HV}) must be a multiple of H ({H})")
        if buffers not in (1, 2):
            raise ValueError(f"ReplayRecords.allocate: buffers must be 1 or 2, got {buffers!r}")
        if not isinstance(round_each_token, bool):
            raise TypeError(f"ReplayRecords.allocate: round_each_token must be a bool, got {round_each_token!r}")
        kw = dict(dtype=torch.float32, device=device)
        rows = buffers * max_batch
        decay_shape = (rows, HV, max_window, K) if vector_decay else (rows, HV, max_window)
        return cls(
            correction=torch.zeros(rows, HV, max_window, V, **kw),
            key=torch.zeros(rows, H, max_window, K, **kw),
            decay=torch.zeros(decay_shape, **kw),
            buffers=buffers,
            round_each_token=round_each_token,
        )

    @property
    def max_batch(self) -> int:
        return self.correction.shape[0] // self.buffers

    @property
    def num_v_heads(self) -> int:
        return self.correction.shape[1]

    @property
    def num_k_heads(self) -> int:
        return self.key.shape[1]

    @property
    def max_window(self) -> int:
        return self.correction.shape[2]

    @property
    def head_v_dim(self) -> int:
        return self.correction.shape[3]

    @property
    def head_k_dim(self) -> int:
        return self.key.shape[3]

    @property
    def vector_decay(self) -> bool:
        return self.decay.dim() == 4

    @property
    def device(self) -> torch.device:
        return self.correction.device


def conv_history(width: int, dilation: int = 1) -> int:
    """Columns of conv history a width-``width`` conv with taps ``dilation`` tokens apart reads
    before a window: ``(width - 1) * dilation``."""
    return (width - 1) * dilation


@dataclass
class LayerCache:
    """One recurrent layer's caches, as the commit sees them.

    ``state``: ``[num_slots, HV, V, K]`` fp32 or bf16, K contiguous.
    ``records``: the layer's :class:`ReplayRecords`.
    ``conv_state``: optional ``[num_slots, conv_dim, history + window]`` (``history =
    (conv_width - 1) * conv_dilation``; ``window >= records.max_window``), compacted by the commit.
    ``conv_width``: the conv kernel's width (``weight.shape[1]`` of ``conv_verify``); required
    with a conv state. ``conv_dilation``: the ``dilation`` of its ``conv_verify`` (default 1).

    Holds the tensors it is given: a :class:`~recoverssm.CommitContext` built over it keeps
    pointers to them, so reallocating a pool means building a new context.
    """

    state: torch.Tensor
    records: ReplayRecords
    conv_state: Optional[torch.Tensor] = None
    conv_width: Optional[int] = None
    conv_dilation: int = 1

    @property
    def conv_history(self) -> int:
        """Columns of conv history (``(conv_width - 1) * conv_dilation``); 0 without a conv state."""
        if self.conv_state is None or self.conv_width is None:
            return 0
        return conv_history(self.conv_width, self.conv_dilation)


@dataclass
class CommitPlan:
    """What the commit does for each batch row (``core/plan.py``); int32 tensors of shape ``[B]``.

    ``commit_len``: accepted tokens replayed (0 for rows that write nothing).
    ``final_slot``: the slot that receives the state after ``commit_len`` tokens (null where invalid).
    ``boundary_slot``: align mode only, the slot that receives the block-boundary state (else null).
    ``boundary_len``: tokens folded into the boundary state (0 where ``boundary_slot`` is null).
    """

    commit_len: torch.Tensor
    final_slot: torch.Tensor
    boundary_slot: torch.Tensor
    boundary_len: torch.Tensor
    null_slot: int = -1

    def as_dict(self) -> dict[str, list[int]]:
        return {k: getattr(self, k).tolist() for k in ("commit_len", "final_slot", "boundary_slot", "boundary_len")}


#: The rows of a pending plan (``Pending.plan``), in order.
PLAN_FIELDS = ("commit_len", "source_slot", "final_slot", "boundary_slot", "boundary_len", "replays")


@dataclass
class Pending:
    """A step whose commit is deferred (:meth:`CommitContext.defer`), as the next step's verify
    ops read it. Persistent: the context writes each new step into the same tensors.

    ``plan``: int32 ``[G, 6, max_batch]``, per KV-cache group and row of the deferred step: its
    commit plan (``commit_len``, ``source_slot``, ``final_slot``, ``boundary_slot``,
    ``boundary_len``; a row with ``commit_len = 0`` has nothing pending) and ``replays``, how many
    ops have replayed the row so far (the conv and the recurrence of every layer each do once;
    checked where value checks run). ``parity``: int32 ``[1]``, the records buffer the next
    verify writes (the other one holds the pending step's records).

    A per-layer op takes the view of its layer's group: ``pending[g]`` (a context of one group
    can pass its ``Pending`` as it is).
    """

    plan: torch.Tensor
    parity: torch.Tensor

    @property
    def num_groups(self) -> int:
        return self.plan.shape[0]

    @property
    def max_batch(self) -> int:
        return self.plan.shape[2]

    def __getitem__(self, group: int) -> "Pending":
        if not 0 <= group < self.num_groups:
            raise IndexError(f"Pending: group {group} out of range for {self.num_groups} groups")
        if self.num_groups == 1:
            return self
        views = self.__dict__.setdefault("_groups", {})     # the same view every time (its layout repeats)
        if group not in views:
            views[group] = Pending(self.plan[group:group + 1], self.parity)
        return views[group]

    def as_dict(self, group: int = 0) -> dict[str, list[int]]:
        """The plan of one group, by field (a host copy, for inspection)."""
        return {name: row.tolist() for name, row in zip(PLAN_FIELDS, self.plan[group])}
