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

from .arguments import LayerTensors, check_layers
from .backend import Committer
from .commit_op import commit_layer, register_context, repeat_args
from .ops import BackendArg, backend_for, op, resolve_name
from .repeats import REPEATS
from .types import CommitPlan, LayerCache, ReplayRecords
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


def _per_group(name: str, value, num_groups: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"CommitContext.commit: {name} has {len(value)} entries for {num_groups} groups")
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
            [commit_layer(layer) for layer in layers], len(groups), self.max_batch, self.null_slot)
        self.id = register_context(self)
        conv = [layer for layer in layers if layer.conv_state is not None]
        self._layer_args = ([layer.state for layer in layers], [layer.conv_state for layer in conv],
                            [layer.correction for layer in layers], [layer.key for layer in layers],
                            [layer.decay for layer in layers], [layer.group for layer in layers],
                            [layer.conv_width for layer in layers])
        #: What a commit writes: every state and conv state (their version counters move), and
        #: whether one of them is an inference tensor (written only inside inference mode).
        self._written = self._layer_args[0] + self._layer_args[1]
        self._writes_inference = any(t.is_inference() for t in self._written)

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

        An eager step whose arguments have the layout of an earlier step of this context (the
        same addresses, dtypes, shapes and strides, the same block sizes and ``check``) repeats
        that step's launch without the checks (they would pass again; ``core/repeats.py``); any
        other call goes through ``torch.ops.recoverssm.commit``.
        """
        G = self.num_groups
        per = [_per_group(n, v, G) for n, v in (("state_indices", state_indices), ("request_indices", request_indices),
                                                 ("block_table", block_table),
                                                 ("num_computed_tokens", num_computed_tokens),
                                                 ("block_size", block_size))]
        block_sizes = [0 if bs is None else bs for bs in per[4]]
        if REPEATS.run("commit", repeat_args(self.id, num_accepted, query_start_loc, *per[:4], block_sizes, check),
                       check, self.device, self._written, self._writes_inference):
            return
        check_types("CommitContext.commit", num_accepted=num_accepted, query_start_loc=query_start_loc,
                    **{f"{n}[{g}]": t for n, values in zip(("state_indices", "request_indices", "block_table",
                                                           "num_computed_tokens"), per) for g, t in enumerate(values)})
        for g, bs in enumerate(per[4]):
            check_int("CommitContext.commit", f"block_size[{g}]" if G > 1 else "block_size", bs, optional=True,
                      minimum=1)
        op("commit")(*self._layer_args, num_accepted, query_start_loc, *per[:4], block_sizes, self.null_slot,
                     self.max_batch, self.id, self.backend.name, check)

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


