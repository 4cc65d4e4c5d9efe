"""Registers the ``cpu_ref`` backend with the plugin manager."""
from __future__ import annotations

from ...core.backend import Backend
from ...core.hookspecs import hookimpl
from ...core.pointers import PointerEncoding
from ...core.writes import versions_kept
from . import commit, conv, recurrence


class CpuRefBackend(Backend):
    """Pure PyTorch on CPU tensors: the readable reference every kernel is checked against."""

    name = "cpu_ref"
    device_types = ("cpu",)
    pointer_encoding = PointerEncoding.INT64
    capabilities = Backend.CAPABILITIES

    def kernels(self) -> dict[str, str]:
        return {"all ops": "the PyTorch reference (recoverssm/backends/cpu_ref)"}

    # The reference computes on the host: it hands over no launch to repeat (``bind`` is ignored).
    # It writes through PyTorch operations, which move version counters; the op moves each once.
    def conv_verify(self, x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation,
                    null_slot, out, *, pending=None, bind=False):
        with versions_kept((conv_state, out, pending.plan if pending is not None else None)):
            conv.conv_verify(x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation,
                             null_slot, out, pending)

    def conv_decode(self, x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, out, *,
                    bind=False):
        with versions_kept((conv_state, out)):
            conv.conv_decode(x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, out)

    def recurrence(self, call, *, bind=False):
        with versions_kept(call.written):
            recurrence.recurrence(call)

    def plan_commit(self, num_accepted, state_indices, query_start_loc, request_indices,
                    block_table, num_computed_tokens, block_size, null_slot, num_slots, out):
        commit.plan_commit(num_accepted, state_indices, query_start_loc, request_indices,
                           block_table, num_computed_tokens, block_size, null_slot, num_slots, out)

    def make_committer(self, layers, num_groups, max_batch, null_slot):
        return commit.RefCommitter(layers, null_slot)


@hookimpl
def recoverssm_backends():
    return [CpuRefBackend()]


@hookimpl
def recoverssm_default_backend(device_type: str):
    return "cpu_ref" if device_type == "cpu" else None
