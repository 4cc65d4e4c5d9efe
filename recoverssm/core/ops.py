"""Every op as a ``torch.library`` custom op in the ``recoverssm`` namespace.

``torch.ops.recoverssm.<name>`` is what the Python API (``core/api.py``, ``core/commit.py``)
calls, and what ``torch.compile`` and CUDA graphs see: one opaque node per call, whose schema
states exactly which arguments it writes (``Tensor(a!)``). Outputs are written in place into
tensors the caller passes (the Python API allocates them when not given), so every op but
``plan_commit`` returns nothing.

How the op finds its backend: one implementation is registered for every device
(``CompositeExplicitAutograd``); at run time it resolves the backend through the pluggy registry
(``core/registry.py``): the ``backend`` string argument when not empty, else
``RECOVERSSM_BACKEND``, else the tensors' device type. So ``RECOVERSSM_BACKEND`` and third-party
backends work through the ops, and a compiled graph picks its backend when it runs.

Argument checks run inside the implementation, on real tensors, also in a compiled graph: shape,
dtype, device, stride and overlap checks always; checks of index *values* on CPU tensors always
and on device tensors when ``check`` is true (or ``RECOVERSSM_CHECK=1``), never during CUDA
graph capture (``core/validation.py``). An eager call that repeats an earlier call's layout may
skip all of this and repeat that call's launch (``core/repeats.py``). The fake implementations
(``torch.library.register_fake``, what ``torch.compile`` traces, and what a call mixing meta
tensors with others reaches) run the same checks but those that need data (``Checker.static``),
and describe the outputs.
"""
from __future__ import annotations

from typing import Optional

import torch

from .arguments import check_conv, check_plan, check_recurrence
from .backend import Backend
from .registry import BackendError, registry
from .repeats import REPEATABLE, REPEATS

NAMESPACE = "recoverssm"
LIB = torch.library.Library(NAMESPACE, "DEF")

_GATES = "Tensor? a, Tensor? b, Tensor? A_log, Tensor? dt_bias, Tensor? g, Tensor? beta"
_TOKENS = "Tensor q, Tensor k, Tensor v"
_TAIL = "str backend, bool? check"

SCHEMAS = {
    "conv_verify": "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor state_indices, "
                   f"Tensor query_start_loc, bool silu, int null_slot, Tensor(b!) out, {_TAIL}) -> ()",
    "conv_decode": "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor state_indices, "
                   f"bool silu, int null_slot, Tensor(b!) out, {_TAIL}) -> ()",
    "plan_commit": "(Tensor num_accepted, Tensor state_indices, Tensor query_start_loc, Tensor? request_indices, "
                   "Tensor? block_table, Tensor? num_computed_tokens, int? block_size, int null_slot, "
                   f"int? num_slots, {_TAIL}) -> (Tensor, Tensor, Tensor, Tensor)",
    "commit": "(Tensor(a!)[] states, Tensor(b!)[] conv_states, Tensor[] corrections, Tensor[] keys, "
              "Tensor[] decays, int[] groups, int[] conv_widths, Tensor num_accepted, Tensor query_start_loc, "
              "Tensor[] state_indices, Tensor?[] request_indices, Tensor?[] block_tables, "
              "Tensor?[] num_computed_tokens, int[] block_sizes, int null_slot, int max_batch, int context, "
              f"{_TAIL}) -> ()",
}
for _kind in ("gdn", "kda"):
    _bound = ", float? lower_bound" if _kind == "kda" else ""
    SCHEMAS[f"{_kind}_verify"] = (
        f"({_TOKENS}, Tensor state, Tensor state_indices, Tensor query_start_loc, Tensor(a!) correction, "
        f"Tensor(b!) key, Tensor(c!) decay, {_GATES}{_bound}, float? scale, bool use_qk_l2norm, "
        f"int null_slot, Tensor(d!) out, {_TAIL}) -> ()")
    SCHEMAS[f"{_kind}_decode"] = (
        f"({_TOKENS}, Tensor(a!) state, Tensor state_indices, Tensor query_start_loc, {_GATES}{_bound}, "
        f"float? scale, bool use_qk_l2norm, int null_slot, Tensor(b!) out, {_TAIL}) -> ()")
    SCHEMAS[f"{_kind}_spec_decode_snapshot"] = (
        f"({_TOKENS}, Tensor(a!) state, Tensor state_indices, Tensor query_start_loc, Tensor snapshot_slots, "
        f"{_GATES}{_bound}, float? scale, bool use_qk_l2norm, int null_slot, Tensor(b!) out, {_TAIL}) -> ()")

#: The capability a backend must declare for each op (``Backend.CAPABILITIES``).
CAPABILITY = {"conv_verify": "conv_verify", "conv_decode": "conv_decode", "plan_commit": "plan_commit",
              "commit": "commit", **{f"{k}_{m}": k for k in ("gdn", "kda")
                                     for m in ("verify", "decode", "spec_decode_snapshot")}}


def backend_for(op: str, name: str, device: torch.device):
    """The backend that runs ``op`` on ``device``: ``name`` if not empty, else the registry's
    choice (``RECOVERSSM_BACKEND``, else by device type); it must declare the op's capability."""
    backend = registry().resolve(name or None, device)[0]
    if CAPABILITY[op] not in backend.capabilities:
        raise BackendError(f"{op}: backend {backend.name!r} does not provide {CAPABILITY[op]!r} "
                           f"(it declares {', '.join(sorted(backend.capabilities)) or 'nothing'})")
    return backend


# ------------------------------------------------------------------------------------------------
# implementations
# ------------------------------------------------------------------------------------------------
def _conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc, silu, null_slot, out,
                 backend, check, static=False):
    check_conv("conv_verify", x, conv_state, weight, bias, state_indices, query_start_loc, null_slot, out, check,
               static)
    if static:
        return
    be = backend_for("conv_verify", backend, conv_state.device)
    return be.conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc, silu, null_slot, out)


def _conv_decode(x, conv_state, weight, bias, state_indices, silu, null_slot, out, backend, check, static=False):
    check_conv("conv_decode", x, conv_state, weight, bias, state_indices, None, null_slot, out, check, static)
    if static:
        return
    be = backend_for("conv_decode", backend, conv_state.device)
    return be.conv_decode(x, conv_state, weight, bias, state_indices, silu, null_slot, out)


def _recurrence(kind: str, mode: str):
    """The implementation of ``{kind}_{verify,decode,spec_decode_snapshot}`` (keyword arguments
    named as in the schema)."""
    op = f"{kind}_{'spec_decode_snapshot' if mode == 'snapshot' else mode}"

    def impl(q, k, v, state, state_indices, query_start_loc, a, b, A_log, dt_bias, g, beta, scale,
             use_qk_l2norm, null_slot, out, backend, check, correction=None, key=None, decay=None,
             snapshot_slots=None, lower_bound=None, static=False):
        records = (correction, key, decay) if mode == "verify" else None
        args = check_recurrence(op, kind, mode, q, k, v, state, state_indices, query_start_loc, a, b, A_log,
                                dt_bias, g, beta, scale, use_qk_l2norm, null_slot, out, records, snapshot_slots,
                                lower_bound, check, static)
        if static:
            return
        be = backend_for(op, backend, state.device)
        return be.recurrence(mode, q, k, v, state, state_indices, query_start_loc, args.gates, args.scale,
                      use_qk_l2norm, null_slot, out, records, snapshot_slots)

    return op, impl


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


def _commit(**kwargs):
    from .commit import run_commit_op     # commit.py builds on the ops; imported when first used
    run_commit_op(**kwargs)


IMPLEMENTATIONS = {"conv_verify": _conv_verify, "conv_decode": _conv_decode, "plan_commit": _plan_commit,
                   "commit": _commit}
for _kind in ("gdn", "kda"):
    for _mode in ("verify", "decode", "snapshot"):
        _name, _impl = _recurrence(_kind, _mode)
        IMPLEMENTATIONS[_name] = _impl


def _by_name(name: str, fn, schema: str, static: bool):
    """``fn`` called with the schema's arguments by name (the dispatcher passes them in order);
    ``static``: the fake implementation (checks that need no data, no backend). The launch a
    backend hands back from a repeatable op is kept for eager repeats of the call (``repeats.py``)."""
    names = tuple(a.name for a in torch._C.parse_schema("f" + schema).arguments)

    if static or name not in REPEATABLE:
        def kernel(*args, **kwargs):
            return fn(**dict(zip(names, args)), **kwargs, static=static)
    else:
        def kernel(*args, **kwargs):
            launch = fn(**dict(zip(names, args)), **kwargs)
            if not kwargs:     # the key is built from positional arguments, as the API passes them
                REPEATS.remember(name, args, launch)

    kernel.__name__ = fn.__name__
    return kernel


def _register() -> None:
    for name, schema in SCHEMAS.items():
        LIB.define(name + schema)
        LIB.impl(name, _by_name(name, IMPLEMENTATIONS[name], schema, static=False), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}",
                                    _by_name(name, IMPLEMENTATIONS[name], schema, static=True), lib=LIB)


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
