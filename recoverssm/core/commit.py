"""The commit side of the public API: ``plan_commit``, ``CommitContext`` and the commit op's body.

``CommitContext`` is a thin holder: it validates its layers once, asks the backend for a
committer (GPU backends build their device pointer tables there) and, per call, hands the step's
small metadata to ``torch.ops.recoverssm.commit``, whose implementation (:func:`run_commit_op`)
checks the step and runs the committer.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional, Sequence, Union

import torch

from .api import BackendArg, check_int, check_types
from .arguments import LayerTensors, check_layers, check_step_shapes, check_step_values, layer_names
from .backend import Backend, CommitLayer, Committer, GroupStep
from .ops import backend_for, op, resolve_name
from .types import CommitPlan, LayerCache, ReplayRecords
from .validation import Checker, wants_value_checks

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

    ``matches`` compares field by field and stops at the first difference: these metadata reads
    are about half of a repeated commit's host time."""

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


_CONTEXTS: "weakref.WeakValueDictionary[int, CommitContext]" = weakref.WeakValueDictionary()
_CONTEXT_IDS = itertools.count(1)


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
    """

    def __init__(self, groups: Sequence[Sequence[LayerCache]], *, max_batch: int,
                 backend: BackendArg = None, null_slot: int = -1):
        name = "CommitContext"
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ValueError(f"{name}: groups must be a non-empty list of lists of LayerCache")
        layers: list[LayerTensors] = []
        for gi, group in enumerate(groups):
            if not isinstance(group, (list, tuple)) or not group:
                raise ValueError(f"{name}: groups[{gi}] must be a non-empty list of LayerCache")
            for li, layer in enumerate(group):
                layers.append(_layer_tensors(name, f"groups[{gi}][{li}]", gi, layer))
        device = layers[0].state.device
        c = Checker(name, device)
        self.max_batch = c.integer("max_batch", max_batch, minimum=1)
        self.null_slot = c.null_slot(null_slot)
        self.backend = backend_for("commit", resolve_name(backend), device)
        check_layers(c, layers, self.max_batch, self.backend.capabilities, self.backend.name)
        self.groups = [list(g) for g in groups]
        self.device = device
        self.layers = layers
        self.committer: Committer = self.backend.make_committer(
            [_commit_layer(layer) for layer in layers], len(groups), self.max_batch, self.null_slot)
        self.id = next(_CONTEXT_IDS)
        _CONTEXTS[self.id] = self
        conv = [layer for layer in layers if layer.conv_state is not None]
        self._layer_args = ([layer.state for layer in layers], [layer.conv_state for layer in conv],
                            [layer.correction for layer in layers], [layer.key for layer in layers],
                            [layer.decay for layer in layers], [layer.group for layer in layers],
                            [layer.conv_width for layer in layers])
        self._last_signature: Optional[_StepSignature] = None
        self._last_steps: list = []

    @property
    def num_groups(self) -> int:
        return len(self.groups)

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

        An eager call whose every argument is the very tensor of the previous call, unchanged in
        address, dtype, shape and strides, skips the checks (they would pass again) and repeats
        the previous launch; any other call goes through ``torch.ops.recoverssm.commit``.
        """
        step = (num_accepted, state_indices, query_start_loc, request_indices, block_table,
                num_computed_tokens, block_size)
        compiling = torch.compiler.is_compiling()
        if not compiling and not wants_value_checks(check, self.device):
            last = self._last_signature
            if last is not None and last.matches(step):
                self.committer.commit_again(num_accepted, query_start_loc, self._last_steps)
                return
        G = self.num_groups
        per = [_per_group(n, v, G) for n, v in (("state_indices", state_indices), ("request_indices", request_indices),
                                                 ("block_table", block_table),
                                                 ("num_computed_tokens", num_computed_tokens),
                                                 ("block_size", block_size))]
        check_types("CommitContext.commit", num_accepted=num_accepted, query_start_loc=query_start_loc,
                    **{f"{n}[{g}]": t for n, values in zip(("state_indices", "request_indices", "block_table",
                                                           "num_computed_tokens"), per) for g, t in enumerate(values)})
        for g, bs in enumerate(per[4]):
            check_int("CommitContext.commit", f"block_size[{g}]" if G > 1 else "block_size", bs, optional=True,
                      minimum=1)
        block_sizes = [0 if bs is None else bs for bs in per[4]]
        op("commit")(*self._layer_args, num_accepted, query_start_loc, *per[:4], block_sizes, self.null_slot,
                     self.max_batch, self.id, self.backend.name, check)
        if not compiling:
            values = wants_value_checks(check, self.device)
            self._last_signature = None if values else _StepSignature(step)

    def owns(self, states: Sequence[torch.Tensor], conv_states: Sequence[torch.Tensor],
             corrections: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
             decays: Sequence[torch.Tensor]) -> bool:
        """True when these are this context's very tensors (its committer's tables point at them)."""
        mine = self._layer_args
        lists = (states, conv_states, corrections, keys, decays)
        return all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(lists, mine[:5]))


def _layer_tensors(name: str, where: str, group: int, layer) -> LayerTensors:
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
    width = layer.conv_width if layer.conv_width is not None else 0
    return LayerTensors(layer.state, rec.correction, rec.key, rec.decay, layer.conv_state, width, group)


def _commit_layer(layer: LayerTensors) -> CommitLayer:
    history = layer.conv_width - 1 if layer.conv_state is not None else 0
    return CommitLayer(layer.group, layer.state, layer.correction, layer.key, layer.decay, layer.conv_state,
                       history)


# ------------------------------------------------------------------------------------------------
# the body of torch.ops.recoverssm.commit
# ------------------------------------------------------------------------------------------------
def run_commit_op(states, conv_states, corrections, keys, decays, groups, conv_widths, num_accepted,
                  query_start_loc, state_indices, request_indices, block_tables, num_computed_tokens,
                  block_sizes, null_slot, max_batch, context, backend, check, static: bool = False) -> None:
    """Check one commit step and run it. The layers are those of :class:`CommitContext` ``context``
    when these are its very tensors; otherwise (a direct call of the op, or a compiled graph that
    passes copies) they are checked here and a committer is built for them for this call.
    ``static``: the op's fake implementation (checks that need no data; nothing runs)."""
    name = "CommitContext.commit"
    ctx = _CONTEXTS.get(context)
    if ctx is not None and ctx.owns(states, conv_states, corrections, keys, decays) and ctx.null_slot == null_slot:
        committer, layers, device = ctx.committer, ctx.layers, ctx.device
    else:
        committer, layers, device = _committer_for(states, conv_states, corrections, keys, decays, groups,
                                                   conv_widths, max_batch, null_slot, backend, static)
    c = Checker(name, device, static)
    steps = _check_step(c, layers, num_accepted, query_start_loc, state_indices, request_indices,
                        block_tables, num_computed_tokens, block_sizes, null_slot, max_batch, check)
    if static:
        return
    committer.commit(num_accepted, query_start_loc, steps)
    if ctx is not None:
        ctx._last_steps = steps       # what a repeat of this very step hands to commit_again


def _check_step(c: Checker, layers, num_accepted, query_start_loc, state_indices, request_indices,
                block_tables, num_computed_tokens, block_sizes, null_slot, max_batch, check) -> list[GroupStep]:
    G = len(state_indices)
    if any(not 0 <= layer.group < G for layer in layers):
        c.fail("state_indices", f"has {G} entries, fewer than the layers' groups")
    lists = (("state_indices", state_indices), ("request_indices", request_indices),
             ("block_table", block_tables), ("num_computed_tokens", num_computed_tokens), ("block_size", block_sizes))
    for n, values in lists:
        if len(values) != G:
            c.fail(n, f"has {len(values)} entries for {G} groups")
    values_checked = c.values(check)
    steps, checked = [], set()
    for gi in range(G):
        suffix = f"[{gi}]" if G > 1 else ""
        bt = block_tables[gi]
        bs = block_sizes[gi] if bt is not None else None
        B, bs = check_step_shapes(c, num_accepted, state_indices[gi], query_start_loc, request_indices[gi], bt,
                                  num_computed_tokens[gi], bs, suffix=suffix, checked=checked)
        if B > max_batch:
            c.fail("state_indices" + suffix, f"has {B} rows, more than max_batch = {max_batch}")
        if gi and B != steps[0].state_indices.shape[0]:
            c.fail("state_indices" + suffix, f"has {B} rows, group 0 has {steps[0].state_indices.shape[0]}")
        if values_checked:
            members = [layer for layer in layers if layer.group == gi]
            window = min(layer.correction.shape[2] for layer in members)
            for num_slots in sorted({layer.state.shape[0] for layer in members}):
                check_step_values(c, num_accepted, state_indices[gi], query_start_loc, request_indices[gi], bt,
                                  num_computed_tokens[gi], bs, null_slot, num_slots, window, suffix)
        steps.append(GroupStep(state_indices[gi], request_indices[gi], bt, num_computed_tokens[gi], bs))
    # The index tensors are read while the states are written: no state may hold them.
    index_tensors = [(n + (f"[{g}]" if G > 1 else ""), t) for n, values in lists[:4] for g, t in enumerate(values)]
    c.writes([(f"{name}.state", layer.state) for name, layer in zip(layer_names(layers), layers)]
             + [(f"{name}.conv_state", layer.conv_state) for name, layer in zip(layer_names(layers), layers)],
             [("num_accepted", num_accepted), ("query_start_loc", query_start_loc), *index_tensors])
    return steps


def _committer_for(states, conv_states, corrections, keys, decays, groups, conv_widths, max_batch, null_slot,
                   backend, static: bool = False):
    """Check layers given as the op's lists and build a committer for them (for one call: it is
    not kept, since it would keep the tensors alive)."""
    name = "CommitContext.commit"
    if not states:
        raise ValueError(f"{name}: states is empty: a commit needs at least one layer")
    n = len(states)
    for what, values in (("corrections", corrections), ("keys", keys), ("decays", decays), ("groups", groups),
                         ("conv_widths", conv_widths)):
        if len(values) != n:
            raise ValueError(f"{name}: {what} has {len(values)} entries for {n} layers")
    if sum(1 for w in conv_widths if w) != len(conv_states):
        raise ValueError(f"{name}: conv_widths names {sum(1 for w in conv_widths if w)} layers with a conv state, "
                         f"conv_states has {len(conv_states)}")
    conv = iter(conv_states)
    layers = [LayerTensors(states[i], corrections[i], keys[i], decays[i], next(conv) if conv_widths[i] else None,
                           conv_widths[i], groups[i]) for i in range(n)]
    device = states[0].device
    c = Checker(name, device, static)
    if static:
        check_layers(c, layers, max_batch, frozenset(Backend.CAPABILITIES), "(any)")
        return None, layers, device
    be = backend_for("commit", backend, device)
    check_layers(c, layers, max_batch, be.capabilities, be.name)
    committer = be.make_committer([_commit_layer(layer) for layer in layers], max(groups) + 1, max_batch, null_slot)
    return committer, layers, device
