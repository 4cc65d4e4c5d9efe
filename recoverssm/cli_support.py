"""Small helpers shared by the command-line entry points (check, demo, tensor-parallel demo)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` torch CPU threads (``<= 0``: leave as is), restoring the setting after.

    The commands default to one thread: on small, shared machines the reference's many tiny ops
    run faster single-threaded than contending for cores."""
    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class DeviceArgumentError(ValueError):
    """A ``--device`` value that torch does not parse as a device."""


def parse_device(text: str) -> torch.device:
    """``torch.device(text)``, with a message naming ``--device`` when torch refuses it (the
    commands print it on one line and exit 2, as for their other bad arguments)."""
    try:
        return torch.device(text)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DeviceArgumentError(f"--device {text!r} is not a torch device ({reason})") from None


def accelerator_available(device_type: str) -> bool:
    """Whether torch sees a device of ``device_type`` (``"cuda"`` or ``"xpu"``)."""
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available and is_available())


def default_device(accelerators: Sequence[str] = ("cuda", "xpu")) -> torch.device:
    """The first of ``accelerators`` that torch sees, else the CPU: the commands run where the
    default backend is (``cuda`` on an NVIDIA GPU, ``xpu`` on an Intel GPU) unless told otherwise."""
    for device_type in accelerators:
        if accelerator_available(device_type):
            return torch.device(device_type)
    return torch.device("cpu")
