"""The part of a Triton-based backend that does not depend on the GPU vendor.

Kernels and launchers (which import Triton) are imported when an op runs, not when the backend is
registered, so a machine without Triton still lists the backend, as unavailable.

A GPU backend subclasses :class:`TritonBackend` and sets its name, device types, pointer
encoding and launch table; the kernels and launchers are shared (``recoverssm/backends/triton``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...core.backend import Backend
from .config import LaunchConfig, interpreting

#: The guard of a launch that needs no device switch (a reusable do-nothing context manager).
STAY_ON_DEVICE = contextlib.nullcontext()


class TritonBackend(Backend):
    capabilities = frozenset({
        "conv_verify", "gdn_verify", "gdn_decode", "gdn_spec_decode_snapshot",
        "plan_commit", "commit", "grouped_commit", "bf16_state",
    })
    #: Launch table: head dims -> config; ``None`` is the default row.
    launch_table: dict[Optional[tuple[int, int]], LaunchConfig] = {None: LaunchConfig()}

    def config(self, K: int, V: int) -> LaunchConfig:
        return self.launch_table.get((K, V), self.launch_table[None])

    def serves(self, device_type: str) -> bool:
        # Under TRITON_INTERPRET=1 the real kernels run on CPU tensors (CI checks them that way).
        return device_type in self.device_types or (device_type == "cpu" and interpreting())

    def device_present(self) -> bool:  # pragma: no cover - hardware specific
        raise NotImplementedError

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

    def conv_verify(self, x, conv_state, weight, bias, state_indices, query_start_loc, silu,
                    null_slot, out):
        from . import launch
        with self.device_guard(x.device):
            launch.conv_verify(self.launch_table[None], x, conv_state, weight, bias, state_indices,
                               query_start_loc, silu, null_slot, out)

    def gdn_recurrent(self, mode, q, k, v, state, state_indices, query_start_loc, gates, scale,
                      use_qk_l2norm, null_slot, out, records, snapshot_slots):
        from . import launch
        with self.device_guard(q.device):
            launch.gdn_recurrent(self.config(q.shape[2], v.shape[2]), mode, q, k, v, state,
                                 state_indices, query_start_loc, gates, scale, use_qk_l2norm,
                                 null_slot, out, records, snapshot_slots)

    def plan_commit(self, num_accepted, state_indices, query_start_loc, request_indices,
                    block_table, num_computed_tokens, block_size, null_slot, num_slots, out):
        from . import launch
        with self.device_guard(num_accepted.device):
            launch.plan_commit(self.launch_table[None], num_accepted, state_indices,
                               query_start_loc, request_indices, block_table, num_computed_tokens,
                               block_size, null_slot, num_slots, out)

    def make_committer(self, layers, num_groups, max_batch, null_slot):
        first = layers[0]
        cfg = self.config(first.key.shape[3], first.correction.shape[3])
        from . import launch
        with self.device_guard(first.state.device):
            return launch.TritonCommitter(cfg, self.pointer_encoding, self.device_guard, layers,
                                          num_groups, max_batch, null_slot)

    def device_guard(self, device: torch.device):
        """Make ``device`` current while launching (Triton launches on the current device)."""
        return STAY_ON_DEVICE
