"""Registers the ``cuda`` backend: shared Triton kernels, plain int64 pointer tables."""
from __future__ import annotations

import torch

from ...core.hookspecs import hookimpl
from ...core.pointers import PointerEncoding
from ..triton.backend import STAY_ON_DEVICE, TritonBackend
from ..triton.config import LaunchConfig


class CudaBackend(TritonBackend):
    """NVIDIA GPUs through Triton. Launch table tuned on an H200 (docs/BENCHMARKS.md)."""

    name = "cuda"
    device_types = ("cuda",)
    pointer_encoding = PointerEncoding.INT64
    launch_table = {
        # A grid of fewer than 792 programs (N <= 4 at HV = 48) takes 4 rows per thread, capped to
        # fit 12 warps per SM: twice the programs still fit one wave (132 SMs x 12 / 2). Larger
        # grids keep 8 rows: at N = 8 the small tile needed a second wave (docs/BENCHMARKS.md).
        # Commits hint each program's replay records into L2 up front (the replay otherwise
        # waits on memory token by token); bf16 commits: 16 V rows x 1 warp at 128 registers, 2
        # tiles per program (one plan for both), the second tile hinted into L2 while the first
        # is replayed: 0.904x -> 0.927x copy at 64 requests, 0.863x -> 0.898x at 8; fp32 0.920x
        # -> 0.922x; the bf16 replay loads two positions' records at a time: 0.925x -> 0.930x at
        # 64 requests, 0.898x -> 0.901x at 8 (fp32: 0.919x -> 0.917x, so not there) (tune_commit,
        # docs/BENCHMARKS.md). The recurrence widens bf16 token inputs with PTX bit operations
        # over fp32 states: 5% fewer instructions per token, verify N=64, T=4, HV=48 91.1 ->
        # 88.6 us (tune_verify, docs/BENCHMARKS.md). Its L2 hints (the state tile evict_first, k
        # and q evict_last): verify N=64, T=4 88.5 -> 84.8 us at HV=48 and 64.8 -> 60.7 us at
        # HV=32 (tune_verify, one call), the speculative step at HV=32 1.374x -> 1.420x the
        # snapshot path (docs/BENCHMARKS.md).
        None: LaunchConfig(gdn_small_grid_programs=792, gdn_small_grid_rows=4, gdn_small_grid_max_registers=168,
                           gdn_ptx_widen_bf16=True, gdn_l2_hints=True,
                           commit_block_v_bf16=16, commit_warps_bf16=1, commit_max_registers_bf16=128,
                           commit_tiles_per_program_bf16=2, commit_prefetch_records=True,
                           commit_prefetch_next_tile=True, commit_replay_pairs_bf16=True),
    }

    def device_present(self) -> bool:
        return torch.cuda.is_available()

    def device_guard(self, device: torch.device):
        # Switching devices costs a few microseconds per call even when nothing changes; most
        # calls already run on the tensors' device.
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            return torch.cuda.device(device)
        return STAY_ON_DEVICE


@hookimpl
def recoverssm_backends():
    return [CudaBackend()]


@hookimpl
def recoverssm_default_backend(device_type: str):
    return "cuda" if device_type == "cuda" else None
