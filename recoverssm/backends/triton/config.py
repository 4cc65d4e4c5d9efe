"""Launch configuration of the shared Triton kernels, importable without Triton installed.

The registry imports every built-in backend to ask whether it is available; keeping this module
free of ``import triton`` lets the GPU backends say "triton is not installed" instead of failing
the import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shapes and warps for one backend (one row of a backend's launch table).

    ``gdn_block_v``: V rows per recurrence program; ``gdn_k_chunks``: K chunks kept in-thread;
    ``commit_block_v``: V rows per commit program; ``conv_block``: channels per conv program.
    ``compile_options``: extra options for every launch (e.g. ``grf_mode`` on Intel GPUs).
    """

    gdn_block_v: int = 8
    gdn_k_chunks: int = 2
    gdn_warps: int = 1
    gdn_stages: Optional[int] = None
    gdn_fp_fusion: bool = False
    commit_block_v: int = 32
    commit_warps: int = 1
    conv_block: int = 128
    conv_warps: int = 4
    plan_block: int = 128
    compile_options: dict = field(default_factory=dict)

    def options(self, num_warps: int, num_stages: Optional[int] = None, fp_fusion: bool = False) -> dict:
        # enable_fp_fusion=False: no multiply-add is contracted behind our back; every fused
        # multiply-add of the contract is an explicit tl.fma (bit-identity depends on it).
        opts = dict(num_warps=num_warps, enable_fp_fusion=fp_fusion, **self.compile_options)
        if num_stages is not None:
            opts["num_stages"] = num_stages
        return opts
