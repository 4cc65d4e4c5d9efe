"""The commit side of the public API: ``plan_commit`` and ``CommitContext``.

``CommitContext`` is a thin holder: it validates its layers once, asks the backend for a
committer (GPU backends build their device pointer tables there) and, per call, hands the step's
small metadata to ``torch.ops.recoverssm.commit``, whose body (``core/commit_op.py``) checks the
step and runs the committer; an eager step that repeats an earlier one's layout repeats its
launch (``core/repeats.py``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .arguments import LayerTensors, check_deferred_layers, check_layers
from .backend import Committer
from .commit_op import commit_layer, register_context, repeat_args
from .ops import BackendArg, backend_for, op, resolve_name
from .repeats import REPEATS
from .types import PLAN_FIELDS, CommitPlan, LayerCache, Pending, ReplayRecords
from .validation import Checker, check_int, check_types

PerGroup = Union[object, Sequence[object]]


def plan_commit(num_accepted: torch.Tensor, state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, *, request_indices: Optional[torch.Tensor] = None,
                block_table: Optional[torch.Tensor] = None,
                num_computed_tokens: Optional[torch.Tensor] = None,
                block_size: Optional[int] = None, null_slot: int = -1,
                num_slots: Optional[int] = None, backend: BackendArg = None,
                check: Optional[bool] = None) -> CommitPlan:
    """The commit plan of each batch row, as int32 ``[B]`` tensors (see :class:`CommitPlan`).

    ``num_accepted``: int32 ``[num_requests]`` (accepted drafts + 1); ``state_indices``: int32
    ``[B]``; ``query_start_loc``: int32 ``[B + 1]``; ``request_indices``: int32 ``[B]`` (batch row
    -> request row; default: row ``r`` is request ``r``). Align mode (prefix caching):
    ``block_table`` int32 ``[num_requests, width]``, ``num_computed_tokens`` int32
    ``[num_requests]`` and ``block_size``. ``num_slots`` (optional): slots at or past it are
    treated as padding. Per row ``r`` of request ``q``::

        n = clamp(num_accepted[q], 0, len_r)          (0 for padding rows: nothing written)
        final = state_indices[r]                       (non-align mode)
        final = block_table[q, min((nc + n - 1) // bs, width - 1)]      (align; nc = num_computed_tokens[q])
        boundary = block_table[q, nc // bs] if nc + n reaches the next block boundary and that block
                   is not the final one; boundary_len = (nc // bs + 1) * bs - nc tokens

    :meth:`CommitContext.commit` computes the same plan inside its kernel; this op is for engines
    that want to see or reuse it.
    """
    name = "plan_commit"
    check_types(name, num_accepted=num_accepted, state_indices=state_indices,
                query_start_loc=query_start_loc, request_indices=request_indices, block_table=block_table,
                num_computed_tokens=num_computed_tokens)
    check_int(name, "block_size", block_size, optional=True, minimum=1)
    check_int(name, "null_slot", null_slot)
    check_int(name, "num_slots", num_slots, optional=True, minimum=0)
    outputs = op("plan_commit")(num_accepted, state_indices, query_start_loc, request_indices, block_table,
                                num_computed_tokens, block_size, null_slot, num_slots, resolve_name(backend), check)
    return CommitPlan(*outputs, null_slot=null_slot)


def _per_group(op_name: str, name: str, value, num_groups: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"{op_name}: {name} has {len(value)} entries for {num_groups} groups")
        return list(value)
    return [value] * num_groups


class CommitContext:
    """Commits every layer of every KV-cache group in one call (one kernel launch on a GPU).

    ``groups``: a list of KV-cache groups, each a list of :class:`LayerCache`. Layers of one group
    share the step's slot indices (and, in align mode, block table); groups may differ. All
    layers share one device, and no two layers may share memory (each layer's state, conv state
    and records are its own). ``max_batch``: the most batch rows a commit will carry
    (``records.max_batch`` of every layer must be at least that). ``null_slot``: the padding
    marker of the index tensors.

    The context keeps pointers to every layer's tensors (GPU backends upload them once, into a
    device table): reallocating a state pool, a conv state or a records workspace means building a
    new context. Under CUDA graphs: build the context and run one eager :meth:`commit` with the
    very index tensors the graph will use before capturing (that uploads the per-group table),
    then capture; replays may change the values in those index tensors (slots, accepted counts,
    padding rows), never the tensors themselves.

    ``deferred=True``: the context defers its commits (:meth:`defer`, :meth:`flush`): every
    layer's records are double-buffered (``ReplayRecords.allocate(..., buffers=2)``), the layers
    of a group share one slot count and one records window, and :attr:`pending` holds the step
    whose commit is pending, for the next step's verify ops.
    """

    def __init__(self, groups: Sequence[Sequence[LayerCache]], *, max_batch: int,
                 backend: BackendArg = None, null_slot: int = -1, deferred: bool = False):
        name = "CommitContext"
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ValueError(f"{name}: groups must be a non-empty list of lists of LayerCache")
        if not isinstance(deferred, bool):
            raise TypeError(f"{name}: deferred must be a bool, got {type(deferred).__name__}")
        layers: list[LayerTensors] = []
        for gi, group in enumerate(groups):
            if not isinstance(group, (list, tuple)) or not group:
                raise ValueError(f"{name}: groups[{gi}] must be a non-empty list of LayerCache")
            for li, layer in enumerate(group):
                layers.append(_layer_tensors(name, f"groups[{gi}][{li}]", gi, layer, deferred))
        device = layers[0].state.device
        c = Checker(name, device)
        self.max_batch = c.integer("max_batch", max_batch, minimum=1)
        self.null_slot = c.null_slot(null_slot)
        self.backend = backend_for("commit", resolve_name(backend), device)
        check_layers(c, layers, self.max_batch, self.backend.capabilities, self.backend.name)
        self.deferred = deferred
        #: Per group, how many ops replay each pending row (the recurrence and, with a conv state,
        #: the conv of every layer); deferred contexts only.
        self.replays_per_row: list[int] = []
        self._pending: Optional[Pending] = None
        if deferred:
            info = check_deferred_layers(c, layers, len(groups), self.backend.capabilities, self.backend.name)
            self.replays_per_row = [replays for _, _, replays in info]
            plan = torch.zeros(len(groups), len(PLAN_FIELDS), self.max_batch, dtype=torch.int32, device=device)
            plan[:, 1:4] = self.null_slot
            self._pending = Pending(plan, torch.zeros(1, dtype=torch.int32, device=device))
            self._all_rows = torch.arange(self.max_batch, dtype=torch.int32, device=device)
            self._pending_inference = plan.is_inference()
        self.groups = [list(g) for g in groups]
        self.device = device
        self.layers = layers
        self.committer: Committer = self.backend.make_committer(
            [commit_layer(layer) for layer in layers], len(groups), self.max_batch, self.null_slot)
        self.id = register_context(self)
        conv = [layer for layer in layers if layer.conv_state is not None]
        self._layer_args = ([layer.state for layer in layers], [layer.conv_state for layer in conv],
                            [layer.correction for layer in layers], [layer.key for layer in layers],
                            [layer.decay for layer in layers], [layer.group for layer in layers],
                            [layer.conv_width for layer in layers], [layer.conv_dilation for layer in layers],
                            [layer.round_each_token for layer in layers])
        #: What a commit writes: every state and conv state (their version counters move), and
        #: whether one of them is an inference tensor (written only inside inference mode).
        self._written = self._layer_args[0] + self._layer_args[1]
        self._writes_inference = any(t.is_inference() for t in self._written)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def pending(self) -> Pending:
        """The step whose commit is pending (a context that defers its commits): the same tensors
        for the life of the context, which :meth:`defer` and :meth:`flush` update in place. Pass
        it (``pending[g]`` for a layer of group ``g`` where there are several) to the next
        step's ``conv_verify`` and ``gdn_verify`` / ``kda_verify``."""
        if self._pending is None:
            raise ValueError("CommitContext.pending: this context commits eagerly; build it with deferred=True")
        return self._pending

    @property
    def max_window(self) -> int:
        """The shortest records window of any layer: the longest row a commit accepts."""
        return min(layer.correction.shape[2] for layer in self.layers)

    def commit(self, num_accepted: torch.Tensor, state_indices: PerGroup,
               query_start_loc: torch.Tensor, *, request_indices: PerGroup = None,
               block_table: PerGroup = None, num_computed_tokens: PerGroup = None,
               block_size: PerGroup = None, check: Optional[bool] = None) -> None:
        """Replay each row's accepted tokens into every layer and write each state once.

        ``num_accepted``: int32 ``[num_requests]`` (accepted drafts + 1, at most the row's window
        length); ``query_start_loc``: int32 ``[B + 1]``, the same as in verify.
        ``state_indices``, ``request_indices``, ``block_table``, ``num_computed_tokens`` and
        ``block_size`` are either one value for all groups or a list with one entry per group (see
        :func:`plan_commit` for what they mean). Conv states of layers that have one are
        compacted: the ``history`` inputs ending at the last accepted token move to the front.
        No host sync on GPU tensors unless ``check`` (or ``RECOVERSSM_CHECK=1``).

        An eager step whose arguments have the layout of an earlier step of this context (the
        same addresses, dtypes, shapes and strides, the same block sizes and ``check``) repeats
        that step's launch without the checks (they would pass again; ``core/repeats.py``); any
        other call goes through ``torch.ops.recoverssm.commit``.
        """
        if self.deferred:        # the same plan and records: defer this step, then flush every row of it
            self.defer(num_accepted, state_indices, query_start_loc, request_indices=request_indices,
                       block_table=block_table, num_computed_tokens=num_computed_tokens, block_size=block_size,
                       check=check)
            self.flush(check=check)
            return
        per, block_sizes = self._step("CommitContext.commit", num_accepted, state_indices, query_start_loc,
                                      request_indices, block_table, num_computed_tokens, block_size)
        if REPEATS.run("commit", repeat_args(self.id, num_accepted, query_start_loc, *per[:4], block_sizes, check),
                       check, self.device, self._written, self._writes_inference):
            return
        self._check_step_types("CommitContext.commit", num_accepted, query_start_loc, per)
        op("commit")(*self._layer_args, num_accepted, query_start_loc, *per[:4], block_sizes, self.null_slot,
                     self.max_batch, self.id, self.backend.name, check)

    def defer(self, num_accepted: torch.Tensor, state_indices: PerGroup, query_start_loc: torch.Tensor, *,
              request_indices: PerGroup = None, block_table: PerGroup = None, num_computed_tokens: PerGroup = None,
              block_size: PerGroup = None, check: Optional[bool] = None) -> Pending:
        """End the step without writing any state: keep its commit plan (per row: commit length,
        source, final and boundary slots, boundary length; the arguments and rules of
        :meth:`commit`) and its records (the buffer this step's verify wrote) on the device, as
        :attr:`pending`, which it returns. One small launch on a GPU.

        The next step's ``conv_verify`` and ``gdn_verify`` / ``kda_verify`` of every layer take
        ``pending=`` and ``pending_rows=`` (the row of this step each of their rows continues):
        they commit the continuing rows first, in registers. Rows that do not continue (finished,
        preempted or aborted requests, a block handed to another request) must be flushed
        (:meth:`flush`) before the next :meth:`defer` or :meth:`commit`. Where value checks run
        (``check=True``, ``RECOVERSSM_CHECK=1``, CPU tensors) a pending row that was neither
        replayed by every op of its group nor flushed is a ``ValueError`` here."""
        name = "CommitContext.defer"
        pending = self.pending
        per, block_sizes = self._step(name, num_accepted, state_indices, query_start_loc, request_indices,
                                      block_table, num_computed_tokens, block_size)
        key = repeat_args(self.id, num_accepted, query_start_loc, *per[:4], block_sizes, check)
        if REPEATS.run("defer", key, check, self.device, [pending.plan, pending.parity], self._pending_inference):
            return pending
        self._check_step_types(name, num_accepted, query_start_loc, per)
        op("defer")(pending.plan, pending.parity, num_accepted, query_start_loc, *per[:4], block_sizes,
                    self.null_slot, self.max_batch, self.id, self.backend.name, check)
        return pending

    def flush(self, rows: Optional[torch.Tensor] = None, *, check: Optional[bool] = None) -> None:
        """Commit now the pending step of the rows of the deferred step listed in ``rows`` (int32
        ``[R]``, on the context's device; ``None``: every row), exactly as :meth:`commit` would
        have committed them at :meth:`defer` time; they have nothing pending afterwards. For
        requests that leave the batch (finished, preempted, aborted), a block about to be shared
        through the prefix cache, and before the draft length or the batch layout changes in a
        way the next verify does not follow with ``pending_rows``. A row the next step has
        already replayed may not be flushed (checked where value checks run). Two launches on a
        GPU (the commit, then clearing the flushed rows)."""
        name = "CommitContext.flush"
        pending = self.pending
        rows = self._all_rows if rows is None else rows
        check_types(name, rows=rows)
        key = (self.id, rows, check)
        if REPEATS.run("flush", key, check, self.device, [*self._written, pending.plan],
                       self._writes_inference or self._pending_inference):
            return
        op("flush")(*self._layer_args, pending.plan, pending.parity, rows, self.null_slot, self.max_batch, self.id,
                    self.backend.name, check)

    def _step(self, name: str, num_accepted, state_indices, query_start_loc, request_indices, block_table,
              num_computed_tokens, block_size) -> tuple[list, list]:
        """A step's per-group arguments as lists, one entry per group, and its block sizes as the
        op takes them (0: none)."""
        G = self.num_groups
        per = [_per_group(name, n, v, G) for n, v in (("state_indices", state_indices),
                                                       ("request_indices", request_indices),
                                                       ("block_table", block_table),
                                                       ("num_computed_tokens", num_computed_tokens),
                                                       ("block_size", block_size))]
        return per, [0 if bs is None else bs for bs in per[4]]

    def _check_step_types(self, name: str, num_accepted, query_start_loc, per: list) -> None:
        G = self.num_groups
        check_types(name, num_accepted=num_accepted, query_start_loc=query_start_loc,
                    **{f"{n}[{g}]": t for n, values in zip(("state_indices", "request_indices", "block_table",
                                                           "num_computed_tokens"), per) for g, t in enumerate(values)})
        for g, bs in enumerate(per[4]):
            check_int(name, f"block_size[{g}]" if G > 1 else "block_size", bs, optional=True, minimum=1)

    def owns(self, states: Sequence[torch.Tensor], conv_states: Sequence[torch.Tensor],
             corrections: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
             decays: Sequence[torch.Tensor], settings: Sequence[Sequence]) -> bool:
        """True when these are this context's very tensors (its committer's tables point at them)
        and ``settings`` its layers' (groups, conv widths, conv dilations, rounding modes)."""
        mine = self._layer_args
        lists = (states, conv_states, corrections, keys, decays)
        return (all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(lists, mine[:5]))
                and all(list(a) == b for a, b in zip(settings, mine[5:])))


def _layer_tensors(name: str, where: str, group: int, layer, deferred: bool) -> LayerTensors:
    if not isinstance(layer, LayerCache):
        raise TypeError(f"{name}: {where} must be a LayerCache, got {type(layer).__name__}")
    rec = layer.records
    if not isinstance(rec, ReplayRecords):
        raise TypeError(f"{name}: {where}.records must be a ReplayRecords, got {type(rec).__name__}")
    check_types(name, **{f"{where}.state": layer.state, f"{where}.conv_state": layer.conv_state,
                         f"{where}.records.correction": rec.correction, f"{where}.records.key": rec.key,
                         f"{where}.records.decay": rec.decay})
    if not isinstance(layer.state, torch.Tensor):
        raise TypeError(f"{name}: {where}.state must be a torch.Tensor, got {type(layer.state).__name__}")
    if layer.conv_state is not None and layer.conv_width is None:
        raise ValueError(f"{name}: {where}.conv_width must be the conv kernel's width (an int >= 1) when a "
                         "conv_state is given, got None")
    if (rec.buffers == 2) != deferred:
        raise ValueError(f"{name}: {where}.records have {rec.buffers} buffer(s); a context that defers its commits "
                         "(deferred=True) takes double-buffered records (ReplayRecords.allocate(..., buffers=2)), "
                         "one that commits eagerly single ones")
    width = layer.conv_width if layer.conv_width is not None else 0
    if not isinstance(rec.round_each_token, bool):
        raise TypeError(f"{name}: {where}.records.round_each_token must be a bool, got {rec.round_each_token!r}")
    return LayerTensors(layer.state, rec.correction, rec.key, rec.decay, layer.conv_state, width, group, rec.buffers,
                        layer.conv_dilation, rec.round_each_token)


