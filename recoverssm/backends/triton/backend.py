"""The part of a Triton-based backend that does not depend on the GPU vendor.

Kernels and launchers (which import Triton) are imported when an op runs, not when the backend is
registered, so a machine without Triton still lists the backend, as unavailable.

A GPU backend subclasses :class:`TritonBackend` and sets its name, device types, pointer
encoding and launch table (a module of its own); the kernels and launchers are shared
(``recoverssm/backends/triton``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...core.backend import Backend, Launch
from .config import ENV_INTERPRET, LaunchTable, interpreting

#: The guard of a launch that needs no device switch (a reusable do-nothing context manager).
STAY_ON_DEVICE = contextlib.nullcontext()


class TritonBackend(Backend):
    capabilities = Backend.CAPABILITIES
    #: The launch table, one per backend (``config.LaunchTable``).
    launch_table: LaunchTable = LaunchTable()
    #: Environment variables whose change can change this backend's availability (the registry
    #: re-resolves when one changes).
    environment: tuple[str, ...] = (ENV_INTERPRET,)
    _table_override: Optional[LaunchTable] = None

    @property
    def table(self) -> LaunchTable:
        """The launch table in force (``tuning.launch_table`` may replace it for a while)."""
        return self._table_override or self.launch_table

    def serves(self, device_type: str) -> bool:
        # Under TRITON_INTERPRET=1 the real kernels run on CPU tensors (CI checks them that way).
        return device_type in self.device_types or (device_type == "cpu" and interpreting())

    def device_present(self) -> bool:  # pragma: no cover - hardware specific
        return False

    def is_available(self) -> bool:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return interpreting() or self.device_present()

    def unavailable_reason(self) -> str:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (pip install 'recoverssm[triton]')"
        if not self.device_present():
            return f"no {'/'.join(self.device_types)} device is visible to torch"
        return ""

    def kernels(self) -> dict[str, str]:
        where = "Triton's CPU interpreter" if interpreting() else "compiled Triton kernels"
        return {"conv_verify, conv_decode": f"triton/conv.py ({where})",
                "gdn_*, kda_* (verify, decode, snapshot)":
                    f"triton/recurrence.py, one binary for the three modes, one more for a verify "
                    f"that replays a deferred commit ({where})",
                "plan_commit, commit": f"triton/commit.py ({where})"}

    def conv_verify(self, x, conv_state, weight, bias, state_indices, query_start_loc, silu, dilation,
                    null_slot, out, *, pending=None, bind=False) -> Optional[Launch]:
        from . import launch
        with self.device_guard(x.device):
            return self.launch_on(x.device, launch.conv_verify(self.table, x, conv_state, weight, bias, state_indices,
                                                               query_start_loc, silu, dilation, null_slot, out, bind,
                                                               pending))

    def conv_decode(self, x, conv_state, weight, bias, state_indices, silu, dilation, null_slot, out, *,
                    bind=False) -> Optional[Launch]:
        from . import launch
        with self.device_guard(x.device):
            return self.launch_on(x.device, launch.conv_decode(self.table, x, conv_state, weight, bias, state_indices,
                                                               silu, dilation, null_slot, out, bind))

    def recurrence(self, call, *, bind=False) -> Optional[Launch]:
        from . import launch
        with self.device_guard(call.q.device):
            return self.launch_on(call.q.device, launch.recurrence(self.table, call, bind))

    def launch_on(self, device: torch.device, bound) -> Optional[Launch]:
        """A bound launch (``DirectLauncher``'s, or ``None``) as a :class:`Launch` that makes
        ``device`` current first, as the first launch did (with one device in the process, it
        always is)."""
        if bound is None:
            return None
        if self.one_device():
            return Launch(bound)
        guard = self.device_guard

        def on_device() -> bool:
            with guard(device):
                return bound()
        return Launch(on_device)

    def plan_commit(self, num_accepted, state_indices, query_start_loc, request_indices,
                    block_table, num_computed_tokens, block_size, null_slot, num_slots, out):
        from . import launch
        with self.device_guard(num_accepted.device):
            launch.plan_commit(self.table, num_accepted, state_indices, query_start_loc, request_indices,
                               block_table, num_computed_tokens, block_size, null_slot, num_slots, out)

    def make_committer(self, layers, num_groups, max_batch, null_slot):
        from . import launch
        with self.device_guard(layers[0].state.device):
            return launch.TritonCommitter(self.table, self.pointer_encoding, self.device_guard, self.launch_on, layers,
                                          num_groups, max_batch, null_slot)

    def device_guard(self, device: torch.device):
        """Make ``device`` current while launching (Triton launches on the current device)."""
        return STAY_ON_DEVICE

    def one_device(self) -> bool:
        """Whether the process sees exactly one device of this backend's kind (then no launch
        needs a device guard). False where unknown."""
        return False
