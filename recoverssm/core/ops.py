"""Every op as a ``torch.library`` custom op in the ``recoverssm`` namespace.

``torch.ops.recoverssm.<name>`` is what the Python API (``core/api.py``, ``core/commit.py``)
calls, and what ``torch.compile`` and CUDA graphs see: one opaque node per call, whose schema
states exactly which arguments it writes (``Tensor(a!)``). Outputs are written in place into
tensors the caller passes (the Python API allocates them when not given), so every op but
``plan_commit`` returns nothing.

The op table, :data:`OPS`, holds one :class:`OpSpec` per op: schema, implementation, capability,
repeat key, name in errors.

How the op finds its backend: one implementation is registered for every device
(``CompositeExplicitAutograd``); at run time it resolves the backend through the pluggy registry
(``core/registry.py``): the ``backend`` string argument when not empty, else
``RECOVERSSM_BACKEND``, else the tensors' device type. So ``RECOVERSSM_BACKEND`` and third-party
backends work through the ops, and a compiled graph picks its backend when it runs.

Argument checks run inside the implementation, on real tensors, also in a compiled graph: shape,
dtype, device, stride and overlap checks always; checks of index *values* on CPU tensors always
and on device tensors when ``check`` is true (or ``RECOVERSSM_CHECK=1``), never during CUDA
graph capture (``core/validation.py``). The rules for what a call writes (inference tensors,
version counters: ``core/writes.py``) are applied here, around every implementation. An op that
may be repeated (``OpSpec.repeat``) asks its backend for its launch bound to the call's addresses
when the repeat cache would keep it, and hands it over (``core/repeats.py``); an eager call that
repeats the layout then skips all of this. The fake implementations
(``torch.library.register_fake``, what ``torch.compile`` traces, and what a call mixing meta
tensors with others reaches) run the same checks but those that need data (``Checker.static``),
and describe the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from . import registry as _registry
from .arguments import check_conv, check_plan, check_recurrence
from .backend import Backend, PendingInputs, RecurrenceCall
from .commit_op import repeat_args, run_commit_op, run_defer_op, run_flush_op
from .registry import registry
from .repeats import REPEATS
from .types import FAMILIES
from .writes import (count_writes, refuse_inference_writes, writes_inference_tensor, written_arguments,
                     written_tensors)

BackendArg = Union[str, Backend, None]

NAMESPACE = "recoverssm"
LIB = torch.library.Library(NAMESPACE, "DEF")

_TAIL = "str backend, bool? check"
_LAYERS = ("Tensor(a!)[] states, Tensor(b!)[] conv_states, Tensor[] corrections, Tensor[] keys, Tensor[] decays, "
           "int[] groups, int[] conv_widths, int[] conv_dilations, bool[] round_each_token")
_STEP = ("Tensor[] state_indices, Tensor?[] request_indices, Tensor?[] block_tables, Tensor?[] num_computed_tokens, "
         "int[] block_sizes, int null_slot, int max_batch, int context")
#: the recurrence modes: op name suffix -> (mode, schema of the state argument, extra arguments)
_RECURRENCE_OPS = {
    "verify": ("verify", "Tensor state", "Tensor(a!) correction, Tensor(b!) key, Tensor(c!) decay, ", ""),
    # verify after a deferred commit: it writes the state where a row replays its pending step
    "verify_pending": ("verify", "Tensor(f!) state", "Tensor(a!) correction, Tensor(b!) key, Tensor(c!) decay, ",
                       "Tensor(e!) pending_plan, Tensor? pending_rows, Tensor parity, "),
    "decode": ("decode", "Tensor(a!) state", "", ""),
    "spec_decode_snapshot": ("snapshot", "Tensor(a!) state", "Tensor snapshot_slots, ", ""),
}


def _recurrence_schema(kind: str, suffix: str) -> str:
    _, state, before_gates, after_out = _RECURRENCE_OPS[suffix]
    family = FAMILIES[kind]
    tokens = ", ".join(f"Tensor {name}" for name in family.tokens)
    scalars = "".join(f", float? {name}" for name in family.scalars)
    options = f", {family.options}" if family.options else ""
    return (f"({tokens}, {state}, Tensor state_indices, Tensor query_start_loc, {before_gates}{family.gate_schema}"
            f"{scalars}{options}, int null_slot, bool round_each_token, Tensor(d!) out, {after_out}{_TAIL}) -> ()")


def backend_for(op: str, name: str, device: torch.device) -> Backend:
    """The backend that runs ``op`` on ``device``: ``name`` if not empty, else the registry's
    choice (``RECOVERSSM_BACKEND``, else by device type); it must declare the op's capability."""
    return _registry.backend_for(op, OPS[op].capability, name, device)


# ------------------------------------------------------------------------------------------------
# implementations (keyword arguments named as in the schema; ``bind``: return the launch bound to
# the call's addresses, for repeats)
# ------------------------------------------------------------------------------------------------
def _conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation, null_slot, out,
                 pending_plan, pending_rows, backend, check, static=False, bind=False):
    check_conv("conv_verify", x, conv_state, weight, bias, state_indices, query_start_loc, dilation, null_slot, out,
               check, static, pending_plan, pending_rows)
    if static:
        return None
    be = backend_for("conv_verify", backend, conv_state.device)
    pending = None
    if pending_plan is not None:
        _registry.backend_for("conv_verify", "deferred", backend, conv_state.device)     # declared, or refused
        pending = PendingInputs(pending_plan, pending_rows, None)
    return be.conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation, null_slot,
                          out, pending=pending, bind=bind)


def _conv_decode(x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, out, backend, check,
                 static=False, bind=False):
    check_conv("conv_decode", x, conv_state, weight, bias, state_indices, None, dilation, null_slot, out, check,
               static)
    if static:
        return None
    be = backend_for("conv_decode", backend, conv_state.device)
    return be.conv_decode(x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, out, bind=bind)


def _recurrence(kind: str, mode: str, op: str):
    """The implementation of ``op``: ``{kind}_{verify,verify_pending,decode,spec_decode_snapshot}``,
    called with the schema's arguments by name (the family's token, gate and scalar names:
    ``FAMILIES[kind]``)."""
    family = FAMILIES[kind]

    def impl(state, state_indices, query_start_loc, null_slot, round_each_token, out, backend, check,
             correction=None, key=None, decay=None, snapshot_slots=None, pending_plan=None, pending_rows=None,
             parity=None, scale=None, use_qk_l2norm=False, static=False, bind=False, **named):
        q, k, v = (named.pop(name) for name in family.tokens)
        gate_args = {name: named.pop(name) for name in (*family.gates, *family.scalars)}
        records = (correction, key, decay) if mode == "verify" else None
        pending = None if pending_plan is None else (pending_plan, pending_rows, parity)
        args = check_recurrence(op, kind, mode, q, k, v, state, state_indices, query_start_loc, gate_args, scale,
                                use_qk_l2norm, null_slot, round_each_token, out, records, snapshot_slots, check,
                                static, pending)
        if static:
            return None
        be = backend_for(op, backend, state.device)
        if pending is not None:          # the family's capability too
            _registry.backend_for(op, kind, backend, state.device)
        return be.recurrence(RecurrenceCall(
            mode, q, k, v, state, state_indices, query_start_loc, args.gates, args.scale, use_qk_l2norm, null_slot,
            out, records, snapshot_slots, None if pending is None else PendingInputs(*pending), round_each_token),
            bind=bind)

    return impl


def _plan_outputs(state_indices: torch.Tensor) -> tuple:
    B = state_indices.shape[0]
    return tuple(state_indices.new_empty(B) for _ in range(4))


def _plan_commit(num_accepted, state_indices, query_start_loc, request_indices, block_table, num_computed_tokens,
                 block_size, null_slot, num_slots, backend, check, static=False):
    _, block_size, null_slot, num_slots = check_plan(
        "plan_commit", num_accepted, state_indices, query_start_loc, request_indices, block_table,
        num_computed_tokens, block_size, null_slot, num_slots, check, static)
    out = _plan_outputs(state_indices)
    if static:
        return out
    be = backend_for("plan_commit", backend, num_accepted.device)
    be.plan_commit(num_accepted, state_indices, query_start_loc, request_indices, block_table,
                   num_computed_tokens, block_size or 1, null_slot, num_slots, out)
    return out


# ------------------------------------------------------------------------------------------------
# the op table
# ------------------------------------------------------------------------------------------------
#: ``OpSpec.repeat`` of an op whose repeats are keyed on its own arguments, in schema order
OWN_ARGUMENTS = "own arguments"


@dataclass(frozen=True)
class OpSpec:
    """One op, in one record. ``schema``: its arguments and what it writes (``Tensor(a!)``);
    ``implementation``: called with the schema's arguments by name (and ``static`` for the fake
    implementation, ``bind`` where it repeats); ``capability``: what a backend must declare for it
    (``Backend.CAPABILITIES``); ``repeat``: whether an eager call may repeat its launch
    (``core/repeats.py``) and what that is keyed on: :data:`OWN_ARGUMENTS`, a function of the named
    arguments (the ops of a commit context: the context and the step, its layers and pending
    tensors being the context's), or ``None`` (never repeated); ``shown_as``: how errors name it."""

    schema: str
    implementation: Callable
    capability: str
    repeat: Union[None, str, Callable[[dict], tuple]] = None
    shown_as: Optional[str] = None


def _step_key(a: dict) -> tuple:
    return repeat_args(a["context"], a["num_accepted"], a["query_start_loc"], a["state_indices"], a["request_indices"],
                       a["block_tables"], a["num_computed_tokens"], a["block_sizes"], a["check"])


OPS: dict[str, OpSpec] = {
    "conv_verify": OpSpec(
        "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor state_indices, Tensor query_start_loc, "
        "bool silu, int dilation, int null_slot, Tensor(b!) out, Tensor(c!)? pending_plan, Tensor? pending_rows, "
        f"{_TAIL}) -> ()", _conv_verify, "conv_verify", OWN_ARGUMENTS),
    "conv_decode": OpSpec(
        "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor state_indices, bool silu, "
        f"int dilation, int null_slot, Tensor(b!) out, {_TAIL}) -> ()", _conv_decode, "conv_decode", OWN_ARGUMENTS),
    "plan_commit": OpSpec(
        "(Tensor num_accepted, Tensor state_indices, Tensor query_start_loc, Tensor? request_indices, "
        "Tensor? block_table, Tensor? num_computed_tokens, int? block_size, int null_slot, int? num_slots, "
        f"{_TAIL}) -> (Tensor, Tensor, Tensor, Tensor)", _plan_commit, "plan_commit"),
    "commit": OpSpec(f"({_LAYERS}, Tensor num_accepted, Tensor query_start_loc, {_STEP}, {_TAIL}) -> ()",
                     run_commit_op, "commit", _step_key, "CommitContext.commit"),
    "defer": OpSpec(f"(Tensor(a!) plan, Tensor(b!) parity, Tensor num_accepted, Tensor query_start_loc, {_STEP}, "
                    f"{_TAIL}) -> ()", run_defer_op, "deferred", _step_key, "CommitContext.defer"),
    "flush": OpSpec(f"({_LAYERS}, Tensor(c!) plan, Tensor parity, Tensor rows, int null_slot, int max_batch, "
                    f"int context, {_TAIL}) -> ()", run_flush_op, "deferred",
                    lambda a: (a["context"], a["rows"], a["check"]), "CommitContext.flush"),
    **{f"{kind}_{suffix}": OpSpec(_recurrence_schema(kind, suffix), _recurrence(kind, mode, f"{kind}_{suffix}"),
                                  "deferred" if suffix == "verify_pending" else kind, OWN_ARGUMENTS)
       for kind in FAMILIES for suffix, (mode, *_) in _RECURRENCE_OPS.items()},
}


def _by_name(name: str, spec: OpSpec, static: bool):
    """The op's implementation called with the schema's arguments by name (the dispatcher passes
    them in order, or some by keyword when the op is called so); ``static``: the fake
    implementation (checks that need no data, no backend). Around the real one: the rules for
    what a call writes (``writes.py``), and for a repeatable op the launch handed to the repeat
    cache."""
    fn = spec.implementation
    names = tuple(a.name for a in torch._C.parse_schema("f" + spec.schema).arguments)
    repeatable = spec.repeat is not None
    key_of = spec.repeat if callable(spec.repeat) else None
    shown = spec.shown_as or name

    if static:
        def kernel(*args, **kwargs):
            return fn(**dict(zip(names, args)), **kwargs, static=True)
    else:
        def kernel(*args, **kwargs):
            if kwargs:      # in schema order, as the public functions pass them
                named = dict(zip(names, args), **kwargs)
                args = tuple(named[n] for n in names)
            written = written_tensors(name, args)
            if writes_inference_tensor(written):
                refuse_inference_writes(shown, written_arguments(name, args))
            named = dict(zip(names, args))
            if not repeatable:
                result = fn(**named)
                count_writes(written)
                return result
            bind = REPEATS.wants_launch()
            launch = fn(**named, bind=bind)
            count_writes(written)
            if bind and launch is not None:
                REPEATS.remember(name, key_of(named) if key_of else args, launch)
            return None

    kernel.__name__ = fn.__name__
    return kernel


def _register() -> None:
    for name, spec in OPS.items():
        LIB.define(name + spec.schema)
        LIB.impl(name, _by_name(name, spec, static=False), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _by_name(name, spec, static=True), lib=LIB)


_register()


def op(name: str):
    """``torch.ops.recoverssm.<name>`` (the overload packet)."""
    return getattr(torch.ops.recoverssm, name)


def resolve_name(backend: Optional[object]) -> str:
    """The ``backend`` argument of an op: ``""`` for the registry's choice, a backend's name, or
    for a :class:`~recoverssm.Backend` object the key the registry keeps it under."""
    if backend is None:
        return ""
    if isinstance(backend, str):
        return backend
    if isinstance(backend, Backend):
        return registry().key_for(backend)
    raise TypeError(f"backend must be a name, a recoverssm.Backend or None, got {type(backend).__name__}")
