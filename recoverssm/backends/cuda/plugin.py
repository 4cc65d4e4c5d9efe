"""Registers the ``cuda`` backend: shared Triton kernels, plain int64 pointer tables."""
from __future__ import annotations

import torch

from ...core.hookspecs import hookimpl
from ...core.pointers import PointerEncoding
from ..triton.backend import STAY_ON_DEVICE, TritonBackend
from .launch_table import LAUNCH_TABLE


class CudaBackend(TritonBackend):
    """NVIDIA GPUs through Triton; launch table tuned on an H200 (``launch_table.py``)."""

    name = "cuda"
    device_types = ("cuda",)
    pointer_encoding = PointerEncoding.INT64
    launch_table = LAUNCH_TABLE

    def device_present(self) -> bool:
        return torch.cuda.is_available()

    def device_guard(self, device: torch.device):
        # Switching devices costs a few microseconds per call even when nothing changes; most
        # calls already run on the tensors' device.
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            return torch.cuda.device(device)
        return STAY_ON_DEVICE

    def one_device(self) -> bool:
        return torch.cuda.device_count() == 1


@hookimpl
def recoverssm_backends():
    return [CudaBackend()]


@hookimpl
def recoverssm_default_backend(device_type: str):
    return "cuda" if device_type == "cuda" else None
