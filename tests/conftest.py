"""Test setup.

Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1``
must be set before any kernel module is imported, so it is set here, first. On a GPU machine the
compiled kernels run and the ``gpu`` tests run too.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interp = pytest.mark.skip(reason="needs triton and TRITON_INTERPRET=1 (set when no GPU is present)")
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and triton_importable()
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "interpreter" in item.keywords and not interp:
            item.add_marker(no_interp)
