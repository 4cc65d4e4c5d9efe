"""The body of ``torch.ops.recoverssm.commit``: check one commit step and run it.

A :class:`~recoverssm.CommitContext` registers itself here (:func:`register_context`) so that the
op finds the committer (its device tables) of the context whose very tensors it is given.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional, Sequence

import torch

from .arguments import LayerTensors, check_layers, check_step_shapes, check_step_values, layer_names
from .backend import Backend, CommitLayer, GroupStep, Launch
from .registry import backend_for
from .types import PLAN_FIELDS, conv_history
from .validation import Checker

_CONTEXTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CONTEXT_IDS = itertools.count(1)


def register_context(context) -> int:
    """A new id for ``context`` (never reused in the process), under which the op finds it."""
    ident = next(_CONTEXT_IDS)
    _CONTEXTS[ident] = context
    return ident


def repeat_args(context: int, num_accepted, query_start_loc, state_indices: Sequence, request_indices: Sequence,
                block_tables: Sequence, num_computed_tokens: Sequence, block_sizes: Sequence, check) -> tuple:
    """What a commit step is keyed on for an eager repeat of its launch (``core/repeats.py``):
    the context (which fixes the layers, ``null_slot``, ``max_batch`` and the backend) and the
    step's arguments, one entry per KV-cache group. The public method and the op build it alike."""
    return (context, num_accepted, query_start_loc, tuple(state_indices), tuple(request_indices),
            tuple(block_tables), tuple(num_computed_tokens), tuple(block_sizes), check)


def commit_layer(layer: LayerTensors) -> CommitLayer:
    """A checked layer as a backend's committer takes it."""
    history = conv_history(layer.conv_width, layer.conv_dilation) if layer.conv_state is not None else 0
    return CommitLayer(layer.group, layer.state, layer.correction, layer.key, layer.decay, layer.conv_state,
                       history, layer.record_buffers, layer.round_each_token)


def run_commit_op(states, conv_states, corrections, keys, decays, groups, conv_widths, conv_dilations,
                  round_each_token, num_accepted,
                  query_start_loc, state_indices, request_indices, block_tables, num_computed_tokens,
                  block_sizes, null_slot, max_batch, context, backend, check, static: bool = False,
                  bind: bool = False) -> Optional[Launch]:
    """Check one commit step and run it. The layers are those of the :class:`CommitContext` whose
    id is ``context`` when these are its very tensors; otherwise (a direct call of the op, or a
    compiled graph that passes copies) they are checked here and a committer is built for them
    for this call. ``static``: the op's fake implementation (checks that need no data; nothing
    runs). ``bind``: return the step's launch bound to these tensors' addresses, for repeats
    keyed by :func:`repeat_args` (only for a context's own tensors)."""
    name = "CommitContext.commit"
    ctx = _CONTEXTS.get(context)
    settings = (groups, conv_widths, conv_dilations, round_each_token)
    owned = (ctx is not None and ctx.owns(states, conv_states, corrections, keys, decays, settings)
             and ctx.null_slot == null_slot)
    if owned:
        committer, layers, device = ctx.committer, ctx.layers, ctx.device
    else:
        committer, layers, device = _committer_for(states, conv_states, corrections, keys, decays, groups,
                                                   conv_widths, conv_dilations, round_each_token, max_batch,
                                                   null_slot, backend, static)
    c = Checker(name, device, static)
    steps = _check_step(c, layers, num_accepted, query_start_loc, state_indices, request_indices,
                        block_tables, num_computed_tokens, block_sizes, null_slot, max_batch, check)
    if static:
        return None
    return committer.commit(num_accepted, query_start_loc, steps, bind=bind and owned)


def run_defer_op(plan, parity, num_accepted, query_start_loc, state_indices, request_indices, block_tables,
                 num_computed_tokens, block_sizes, null_slot, max_batch, context, backend, check,
                 static: bool = False, bind: bool = False) -> Optional[Launch]:
    """Check one deferred step and write its plan (``CommitContext.defer``): the context's layers
    give each group's slot count and window. Where value checks run, the step it replaces must
    have been replayed by every op of its group, or flushed (nothing pending is dropped)."""
    name = "CommitContext.defer"
    ctx = _CONTEXTS.get(context)
    if ctx is None or not ctx.deferred:
        raise ValueError(f"{name}: context {context} is not a live CommitContext that defers its commits")
    c = Checker(name, ctx.device, static)
    c.tensor("pending.plan", plan, dtypes=(torch.int32,), shape=tuple(ctx.pending.plan.shape), contiguous=True)
    c.tensor("pending.parity", parity, dtypes=(torch.int32,), shape=(1,), contiguous=True)
    steps = _check_step(c, ctx.layers, num_accepted, query_start_loc, state_indices, request_indices, block_tables,
                        num_computed_tokens, block_sizes, null_slot, max_batch, check)
    c.writes([("pending.plan", plan), ("pending.parity", parity)],
             [("num_accepted", num_accepted), ("query_start_loc", query_start_loc),
              *[(f"state_indices[{g}]", t) for g, t in enumerate(state_indices)]])
    if static:
        return None
    if c.values(check):
        _nothing_dropped(c, plan, ctx.replays_per_row, null_slot)
    return ctx.committer.defer(plan, parity, num_accepted, query_start_loc, steps,
                               bind=bind and plan is ctx.pending.plan and parity is ctx.pending.parity)


def run_flush_op(states, conv_states, corrections, keys, decays, groups, conv_widths, conv_dilations,
                 round_each_token, plan, parity, rows, null_slot, max_batch, context, backend, check,
                 static: bool = False, bind: bool = False) -> Optional[Launch]:
    """Commit the pending step of the deferred rows ``rows`` now (``CommitContext.flush``), with
    the context's committer when these are its very tensors (else one built for this call)."""
    name = "CommitContext.flush"
    ctx = _CONTEXTS.get(context)
    settings = (groups, conv_widths, conv_dilations, round_each_token)
    owned = (ctx is not None and ctx.deferred and ctx.owns(states, conv_states, corrections, keys, decays, settings)
             and ctx.null_slot == null_slot)
    if owned:
        committer, layers, device = ctx.committer, ctx.layers, ctx.device
    else:
        committer, layers, device = _committer_for(states, conv_states, corrections, keys, decays, groups,
                                                   conv_widths, conv_dilations, round_each_token, max_batch,
                                                   null_slot, backend, static, buffers=2)
    c = Checker(name, device, static)
    G = max(layer.group for layer in layers) + 1
    c.tensor("pending.plan", plan, dims=3, dtypes=(torch.int32,), contiguous=True)
    c.tensor("pending.plan", plan, shape=(G, len(PLAN_FIELDS), None), why=f" ({G} groups)")
    c.tensor("pending.parity", parity, dtypes=(torch.int32,), shape=(1,), contiguous=True)
    c.index("rows", rows)
    names = layer_names(layers)
    c.writes([(f"{n}.state", layer.state) for n, layer in zip(names, layers)]
             + [(f"{n}.conv_state", layer.conv_state) for n, layer in zip(names, layers)] + [("pending.plan", plan)],
             [("pending.parity", parity), ("rows", rows)])
    if static:
        return None
    if c.values(check):
        _flushable(c, plan, rows, null_slot)
    return committer.flush(plan, parity, rows, bind=bind and owned)


def _nothing_dropped(c: Checker, plan, replays_per_row: Sequence[int], null_slot: int) -> None:
    """Every row of the pending step was replayed by each op of its group (its conv and
    recurrence verify of every layer) or flushed; a row that was not, or was twice, is an error."""
    fields = plan.tolist()
    for g, (group, expected) in enumerate(zip(fields, replays_per_row)):
        for row, (n, replays) in enumerate(zip(group[0], group[5])):
            if n > 0 and replays != expected:
                where = f" of group {g}" if len(fields) > 1 else ""
                c.fail("pending", f"row {row}{where} has a pending commit that {replays} of its {expected} ops "
                                  "replayed: continue the request in this step's verify of every layer (pending_rows), "
                                  "or flush it (ctx.flush) before the next defer or commit; nothing pending is dropped")


def _flushable(c: Checker, plan, rows, null_slot: int) -> None:
    """Rows to flush are rows of the plan (or padding), each once, and not replayed yet (a
    flush after a replay would commit the step twice)."""
    fields = plan.tolist()
    seen = set()
    for i, row in enumerate(rows.tolist()):
        if row <= null_slot:
            continue
        if not 0 <= row < plan.shape[2]:
            c.fail("rows", f"entry {i} = {row} is neither a padding value (<= null_slot = {null_slot}) nor a row "
                           f"of the pending step in [0, {plan.shape[2]})")
        if row in seen:
            c.fail("rows", f"lists row {row} twice")
        seen.add(row)
        for g, group in enumerate(fields):
            if group[0][row] > 0 and group[5][row] != 0:
                c.fail("rows", f"entry {i}: row {row} was already replayed by {group[5][row]} ops of this step; "
                               "a row that continues is not flushed")


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


def _committer_for(states, conv_states, corrections, keys, decays, groups, conv_widths, conv_dilations,
                   round_each_token, max_batch, null_slot, backend, static: bool = False, buffers: int = 1):
    """Check layers given as the op's lists and build a committer for them (for one call: it is
    not kept, since it would keep the tensors alive)."""
    name = "CommitContext.commit"
    if not states:
        raise ValueError(f"{name}: states is empty: a commit needs at least one layer")
    n = len(states)
    for what, values in (("corrections", corrections), ("keys", keys), ("decays", decays), ("groups", groups),
                         ("conv_widths", conv_widths), ("conv_dilations", conv_dilations),
                         ("round_each_token", round_each_token)):
        if len(values) != n:
            raise ValueError(f"{name}: {what} has {len(values)} entries for {n} layers")
    if sum(1 for w in conv_widths if w) != len(conv_states):
        raise ValueError(f"{name}: conv_widths names {sum(1 for w in conv_widths if w)} layers with a conv state, "
                         f"conv_states has {len(conv_states)}")
    conv = iter(conv_states)
    layers = [LayerTensors(states[i], corrections[i], keys[i], decays[i], next(conv) if conv_widths[i] else None,
                           conv_widths[i], groups[i], buffers, conv_dilations[i], round_each_token[i])
              for i in range(n)]
    device = states[0].device
    c = Checker(name, device, static)
    if static:
        check_layers(c, layers, max_batch, frozenset(Backend.CAPABILITIES), "(any)")
        return None, layers, device
    be = backend_for("commit", "commit" if buffers == 1 else "deferred", backend, device)
    check_layers(c, layers, max_batch, be.capabilities, be.name)
    committer = be.make_committer([commit_layer(layer) for layer in layers], max(groups) + 1, max_batch, null_slot)
    return committer, layers, device
