"""Intel GPU detection through upstream ``torch.xpu`` (PyTorch >= 2.5).

intel-extension-for-pytorch was retired in 2026 and is not required. It is imported only as a
fallback, where it is installed and the running torch has no ``torch.xpu`` (old PyTorch builds),
because on those it is what provides the device.
"""
from __future__ import annotations

import importlib.util

import torch


def _torch_xpu():
    xpu = getattr(torch, "xpu", None)
    if xpu is None and importlib.util.find_spec("intel_extension_for_pytorch") is not None:
        import intel_extension_for_pytorch  # noqa: F401  (registers torch.xpu on old torch)
        xpu = getattr(torch, "xpu", None)
    return xpu


def xpu_available() -> bool:
    xpu = _torch_xpu()
    try:
        return bool(xpu is not None and xpu.is_available())
    except Exception:  # noqa: BLE001 - a broken driver stack reads as "no device"
        return False


def why_unavailable() -> str:
    if _torch_xpu() is None:
        return "this torch build has no torch.xpu (PyTorch >= 2.5 with XPU support is needed)"
    return "torch.xpu.is_available() is False: no Intel GPU (or no Level Zero driver) on this machine"
