"""The commit side of the public API: ``plan_commit`` and ``CommitContext`` (contract sections 4, 5).

``CommitContext`` is a thin holder: it validates the layers once, asks the backend for a committer
(GPU backends build their device pointer tables there) and, per call, validates the step's small
metadata and hands it over.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .api import BackendArg, _first_tensor, _resolve, _written_slots_distinct
from .backend import CommitLayer, GroupStep
from .plan import NO_SLOT_LIMIT, plan_rows
from .types import CommitPlan, LayerCache, ReplayRecords
from .validation import FLOAT_DTYPES, STATE_DTYPES, Checker, wants_value_checks

PerGroup = Union[object, Sequence[object]]


def _check_step_shapes(c: Checker, num_accepted, state_indices, query_start_loc, request_indices,
                       block_table, num_computed_tokens, block_size, suffix: str = "",
                       checked: Optional[set] = None):
    """Shape/dtype checks of one group's step metadata. Returns ``(B, block_size)``.

    ``checked``: ids of tensors this call has already passed through the same checks (groups
    usually share ``num_accepted``, ``query_start_loc`` and often their index tensors); they are
    skipped, and the ids of the tensors checked here are added."""
    checked = set() if checked is None else checked

    def first_time(x) -> bool:
        new = id(x) not in checked
        checked.add(id(x))
        return new

    if first_time(num_accepted):
        c.index("num_accepted", num_accepted)
    num_requests = num_accepted.shape[0]
    if first_time(state_indices):
        c.index("state_indices" + suffix, state_indices)
    B = state_indices.shape[0]
    c.index("query_start_loc", query_start_loc, B + 1)
    if request_indices is not None:
        c.index("request_indices" + suffix, request_indices, B)
    elif num_requests < B:
        c.fail("num_accepted", f"has {num_requests} requests for a batch of {B} rows; "
                               "pass request_indices when the batch rows are not the requests")
    if (block_table is None) != (num_computed_tokens is None):
        c.fail("num_computed_tokens" + suffix if block_table is not None else "block_table" + suffix,
               "is required in align mode: pass block_table and num_computed_tokens together")
    if block_table is not None:
        if first_time(block_table):
            c.tensor("block_table" + suffix, block_table, dims=2, dtypes=(torch.int32,), last_contiguous=True)
        if block_table.shape[0] != num_requests:
            c.fail("block_table" + suffix, f"has {block_table.shape[0]} rows, num_accepted has {num_requests} requests")
        if block_table.shape[1] < 1:
            c.fail("block_table" + suffix, "has no columns")
        if first_time(num_computed_tokens):
            c.index("num_computed_tokens" + suffix, num_computed_tokens, num_requests)
        if block_size is None:
            c.fail("block_size" + suffix, "is required in align mode")
        block_size = c.integer("block_size" + suffix, block_size, minimum=1)
    return B, block_size


def _check_step_values(c: Checker, num_accepted, state_indices, query_start_loc, request_indices,
                       block_table, num_computed_tokens, block_size, null_slot, num_slots,
                       num_tokens_max, max_len, suffix: str = ""):
    """Host-side value checks; the written slots of one group must not collide or be another
    row's source (that would race on a GPU)."""
    num_requests = num_accepted.shape[0]
    qsl = c.query_start_loc("query_start_loc", query_start_loc, num_tokens_max, max_len)
    c.slots_in_range("state_indices" + suffix, state_indices, num_slots, null_slot)
    req = None
    if request_indices is not None:
        req = request_indices.tolist()
        for r, q in enumerate(req):
            if not 0 <= q < num_requests:
                c.fail("request_indices" + suffix, f"entry {r} = {q} is not a request row in [0, {num_requests})")
    nct = None
    if num_computed_tokens is not None:
        nct = num_computed_tokens.tolist()
        for q, n in enumerate(nct):
            if n < 0:
                c.fail("num_computed_tokens" + suffix, f"entry {q} = {n} is negative")
    srcs = state_indices.tolist()
    plan = plan_rows(num_accepted.tolist(), srcs, qsl, req,
                     None if block_table is None else block_table.tolist(), nct,
                     block_size or 1, null_slot, NO_SLOT_LIMIT)
    writes = []
    for r, (n, final, boundary, _) in enumerate(plan):
        for what, slot in (("final", final), ("boundary", boundary)):
            if slot > null_slot:
                if slot >= num_slots:
                    c.fail("block_table" + suffix, f"gives row {r} the {what} slot {slot}, outside [0, {num_slots})")
                writes.append((r, slot))
    live_sources = [(r, srcs[r]) for r, p in enumerate(plan) if p[0] > 0]
    _written_slots_distinct(c, "block_table" + suffix if block_table is not None else "state_indices" + suffix,
                            writes, live_sources)


def plan_commit(num_accepted: torch.Tensor, state_indices: torch.Tensor,
                query_start_loc: torch.Tensor, *, request_indices: Optional[torch.Tensor] = None,
                block_table: Optional[torch.Tensor] = None,
                num_computed_tokens: Optional[torch.Tensor] = None,
                block_size: Optional[int] = None, null_slot: int = -1,
                num_slots: Optional[int] = None, backend: BackendArg = None,
                check: Optional[bool] = None) -> CommitPlan:
    """The commit plan of each batch row (contract section 4), as int32 ``[B]`` tensors.

    ``num_accepted``: int32 ``[num_requests]``; ``state_indices``: int32 ``[B]``;
    ``query_start_loc``: int32 ``[B + 1]``; ``request_indices``: int32 ``[B]`` (batch row ->
    request row). Align mode: ``block_table`` int32 ``[num_requests, width]``,
    ``num_computed_tokens`` int32 ``[num_requests]`` and ``block_size``. ``num_slots`` (optional):
    slots at or past it are treated as null. :meth:`CommitContext.commit` computes the same plan
    inside its kernel; this op is for engines that want to see or reuse it.
    """
    op = "plan_commit"
    c = Checker(op, _first_tensor(op, "num_accepted", num_accepted).device)
    B, block_size = _check_step_shapes(c, num_accepted, state_indices, query_start_loc,
                                       request_indices, block_table, num_computed_tokens, block_size)
    null_slot = c.integer("null_slot", null_slot)
    slot_limit = NO_SLOT_LIMIT if num_slots is None else c.integer("num_slots", num_slots, minimum=0)
    if wants_value_checks(check, num_accepted.device):
        _check_step_values(c, num_accepted, state_indices, query_start_loc, request_indices,
                           block_table, num_computed_tokens, block_size, null_slot, slot_limit,
                           NO_SLOT_LIMIT, None)
    be = _resolve(backend, num_accepted.device)
    kw = dict(dtype=torch.int32, device=num_accepted.device)
    plan = CommitPlan(*(torch.empty(B, **kw) for _ in range(4)), null_slot=null_slot)
    be.plan_commit(num_accepted, state_indices, query_start_loc, request_indices, block_table,
                   num_computed_tokens, block_size or 1, null_slot, slot_limit,
                   (plan.commit_len, plan.final_slot, plan.boundary_slot, plan.boundary_len))
    return plan


_TENSOR_ARGUMENT = object()   # marks where a step's argument is a tensor


def _split_step(args: tuple) -> tuple[list, list]:
    """A step's arguments as its tensors, in order, and the rest of its shape: per argument a
    tensor marker, a list's length, or another value with its type (None, a block size)."""
    tensors, rest = [], []
    for x in args:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            rest.append(_TENSOR_ARGUMENT)
        elif isinstance(x, (list, tuple)):
            rest.append(len(x))
            for y in x:
                if isinstance(y, torch.Tensor):
                    tensors.append(y)
                    rest.append(_TENSOR_ARGUMENT)
                else:
                    rest.append((type(y), y))
        else:
            rest.append((type(x), x))
    return tensors, rest


class _StepSignature:
    """What a commit step's checks depend on: every tensor itself (held, so that no other tensor
    can take its id) with its address, dtype, device, shape and strides, and the rest of the
    arguments (``_split_step``). A step that matches the last checked one would pass the same
    checks and needs the same launch; only the tensors' values may differ.

    ``matches`` compares field by field and stops at the first difference: on the H200 machines'
    CPUs the metadata reads are about half of a repeated commit's host time (docs/BENCHMARKS.md)."""

    __slots__ = ("tensors", "metadata", "rest")

    def __init__(self, args: tuple):
        self.tensors, self.rest = _split_step(args)
        self.metadata = [(x.data_ptr(), x.dtype, x.device, x.shape, x.stride()) for x in self.tensors]

    def matches(self, args: tuple) -> bool:
        tensors, rest = _split_step(args)
        if rest != self.rest:
            return False
        for x, last, (address, dtype, device, shape, stride) in zip(tensors, self.tensors, self.metadata):
            if (x is not last or x.data_ptr() != address or x.dtype is not dtype or x.device != device
                    or x.shape != shape or x.stride() != stride):
                return False
        return True


def _per_group(name: str, value, num_groups: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"CommitContext.commit: {name} has {len(value)} entries for {num_groups} groups")
        return list(value)
    return [value] * num_groups


class CommitContext:
    """Commits every layer of every KV-cache group in one call.

    ``groups``: a list of KV-cache groups, each a list of :class:`LayerCache`. Layers of one group
    share the step's slot indices (and, in align mode, block table); groups may differ. All
    layers share one device. ``max_batch``: the most batch rows a commit will carry.
    """

    def __init__(self, groups: Sequence[Sequence[LayerCache]], *, max_batch: int,
                 backend: BackendArg = None, null_slot: int = -1):
        op = "CommitContext"
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ValueError(f"{op}: groups must be a non-empty list of lists of LayerCache")
        first = None
        for gi, group in enumerate(groups):
            if not isinstance(group, (list, tuple)) or not group:
                raise ValueError(f"{op}: groups[{gi}] must be a non-empty list of LayerCache")
            for li, layer in enumerate(group):
                if not isinstance(layer, LayerCache):
                    raise TypeError(f"{op}: groups[{gi}][{li}] must be a LayerCache, got {type(layer).__name__}")
                if first is None:
                    first = layer
        c = Checker(op, first.state.device if isinstance(first.state, torch.Tensor) else torch.device("cpu"))
        self.max_batch = c.integer("max_batch", max_batch, minimum=1)
        self.null_slot = c.integer("null_slot", null_slot)
        layers = []
        for gi, group in enumerate(groups):
            for li, layer in enumerate(group):
                layers.append(self._check_layer(c, f"groups[{gi}][{li}]", gi, layer))
        self.groups = [list(g) for g in groups]
        self.device = c.device
        self.backend = _resolve(backend, self.device)
        self.layers = layers
        self.max_window = min(l.records.max_window for g in self.groups for l in g)
        self._committer = self.backend.make_committer(layers, len(groups), self.max_batch, self.null_slot)
        self._last_signature: Optional[_StepSignature] = None
        self._last_steps: list = []

    def _check_layer(self, c: Checker, where: str, gi: int, layer: LayerCache) -> CommitLayer:
        rec = layer.records
        if not isinstance(rec, ReplayRecords):
            c.fail(f"{where}.records", f"must be a ReplayRecords, got {type(rec).__name__}", TypeError)
        for name in ("correction", "key", "decay"):  # ranks first: the shapes below index them
            c.tensor(f"{where}.records.{name}", getattr(rec, name), dims=None if name == "decay" else 4)
        mb, H, T, K = rec.key.shape
        HV, V = rec.correction.shape[1], rec.correction.shape[3]
        c.tensor(f"{where}.state", layer.state, dtypes=STATE_DTYPES, shape=(None, HV, V, K), last_contiguous=True)
        c.tensor(f"{where}.records.correction", rec.correction, dtypes=(torch.float32,), shape=(mb, HV, T, V), contiguous=True)
        c.tensor(f"{where}.records.key", rec.key, dtypes=(torch.float32,), shape=(mb, H, T, K), contiguous=True)
        decay_shape = (mb, HV, T, K) if rec.vector_decay else (mb, HV, T)
        c.tensor(f"{where}.records.decay", rec.decay, dtypes=(torch.float32,), shape=decay_shape, contiguous=True)
        if HV % H:
            c.fail(f"{where}.records", f"have {HV} value heads, not a multiple of {H} key heads")
        if mb < self.max_batch:
            c.fail(f"{where}.records", f"have room for {mb} rows, max_batch is {self.max_batch}")
        history = 0
        if layer.conv_state is not None:
            c.tensor(f"{where}.conv_state", layer.conv_state, dims=3, dtypes=FLOAT_DTYPES)
            if layer.conv_state.shape[0] != layer.state.shape[0]:
                c.fail(f"{where}.conv_state", f"has {layer.conv_state.shape[0]} slots, the state has {layer.state.shape[0]}")
            history = layer.conv_history
            if history < 0:
                c.fail(f"{where}.conv_state", f"has {layer.conv_state.shape[2]} columns, fewer than the "
                                              f"records' window of {T}")
        return CommitLayer(gi, layer.state, rec.correction, rec.key, rec.decay, layer.conv_state, history)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def commit(self, num_accepted: torch.Tensor, state_indices: PerGroup,
               query_start_loc: torch.Tensor, *, request_indices: PerGroup = None,
               block_table: PerGroup = None, num_computed_tokens: PerGroup = None,
               block_size: PerGroup = None, check: Optional[bool] = None) -> None:
        """Replay each row's accepted tokens into every layer and write each state once.

        ``num_accepted``: int32 ``[num_requests]`` (accepted drafts + 1); ``query_start_loc``:
        int32 ``[B + 1]``, the same as in verify. ``state_indices``, ``request_indices``,
        ``block_table``, ``num_computed_tokens`` and ``block_size`` are either one value for all
        groups or a list with one entry per group. Conv states of layers that have one are
        compacted. No host sync on GPU tensors unless ``check`` (or ``RECOVERSSM_CHECK=1``).
        """
        values = wants_value_checks(check, self.device)
        step = (num_accepted, state_indices, query_start_loc, request_indices, block_table,
                num_computed_tokens, block_size)
        if not values:
            # Engines pass the same persistent index buffers every step (they must, under CUDA
            # graphs): when every argument is the very tensor, with the same metadata, that
            # passed the checks last time, the checks would pass again; skip them.
            last = self._last_signature
            if last is not None and last.matches(step):
                self._committer.commit_again(num_accepted, query_start_loc, self._last_steps)
                return
        c = Checker("CommitContext.commit", self.device)
        G = self.num_groups
        per = {name: _per_group(name, val, G) for name, val in (
            ("state_indices", state_indices), ("request_indices", request_indices),
            ("block_table", block_table), ("num_computed_tokens", num_computed_tokens),
            ("block_size", block_size))}
        steps = []
        checked: set = set()
        for gi in range(G):
            suffix = f"[{gi}]" if G > 1 else ""
            args = [per[n][gi] for n in ("state_indices", "request_indices", "block_table",
                                          "num_computed_tokens", "block_size")]
            B, bs = _check_step_shapes(c, num_accepted, args[0], query_start_loc, *args[1:], suffix=suffix,
                                       checked=checked)
            if B > self.max_batch:
                c.fail("state_indices" + suffix, f"has {B} rows, more than max_batch = {self.max_batch}")
            if gi and B != steps[0].state_indices.shape[0]:
                c.fail("state_indices" + suffix, f"has {B} rows, group 0 has {steps[0].state_indices.shape[0]}")
            if values:
                for num_slots in sorted({l.state.shape[0] for l in self.groups[gi]}):
                    _check_step_values(c, num_accepted, args[0], query_start_loc, args[1], args[2],
                                       args[3], bs, self.null_slot, num_slots, NO_SLOT_LIMIT,
                                       self.max_window, suffix)
            steps.append(GroupStep(args[0], args[1], args[2], args[3], bs))
        self._committer.commit(num_accepted, query_start_loc, steps)
        self._last_signature = None if values else _StepSignature(step)
        self._last_steps = steps
