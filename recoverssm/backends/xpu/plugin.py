"""Registers the ``xpu`` backend: the shared Triton kernels on Intel GPUs.

Intel GPU device addresses have bit 63 set, so its pointer tables use the ``uint64-in-int64``
encoding; that choice is this backend's attribute, read by the shared commit launcher.
"""
from __future__ import annotations

import os

import torch

from ...core.hookspecs import hookimpl
from ...core.pointers import PointerEncoding
from ..triton.backend import TritonBackend
from ..triton.config import interpreting
from . import device
from .launch_table import INTERPRETER, LAUNCH_TABLE

#: Set to 1 to let the ``xpu`` backend run its launch path on CPU tensors under
#: ``TRITON_INTERPRET=1`` on a machine without an Intel GPU (how CI checks it).
ENV_FORCE = "RECOVERSSM_XPU_INTERPRET"


class XpuBackend(TritonBackend):
    """Intel GPUs through Triton (Intel's XPU Triton backend). Never run on Intel hardware here."""

    name = "xpu"
    device_types = ("xpu",)
    pointer_encoding = PointerEncoding.UINT64_IN_INT64

    launch_table = LAUNCH_TABLE
    environment = TritonBackend.environment + (ENV_FORCE,)

    @property
    def table(self):
        return self._table_override or (INTERPRETER if self._forced() else LAUNCH_TABLE)

    @staticmethod
    def _forced() -> bool:
        return interpreting() and os.environ.get(ENV_FORCE, "0") not in ("", "0")

    def device_present(self) -> bool:
        return device.xpu_available()

    def is_available(self) -> bool:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return self._forced() or self.device_present()

    def serves(self, device_type: str) -> bool:
        return device_type in self.device_types or (device_type == "cpu" and self._forced())

    def unavailable_reason(self) -> str:
        reason = super().unavailable_reason()
        if reason.startswith("no "):
            reason = device.why_unavailable() + (f" (set {ENV_FORCE}=1 with TRITON_INTERPRET=1 to run "
                                                 "its launch path on CPU tensors)")
        return reason

    def device_guard(self, dev: torch.device):
        if dev.type == "xpu":
            return torch.xpu.device(dev)
        return super().device_guard(dev)


@hookimpl
def recoverssm_backends():
    return [XpuBackend()]


@hookimpl
def recoverssm_default_backend(device_type: str):
    return "xpu" if device_type == "xpu" else None
