"""Launch specifications of the shared Triton kernels, importable without Triton installed.

The registry imports every built-in backend to ask whether it is available; keeping this module
free of ``import triton`` lets the GPU backends say "triton is not installed" instead of failing
the import. Each GPU backend's table lives in its own module (``backends/cuda/launch_table.py``,
``backends/xpu/launch_table.py``), with the measurements behind it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

ENV_INTERPRET = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``). Every part
    of the library that depends on it calls this, at run time."""
    return os.environ.get(ENV_INTERPRET, "0") not in ("", "0")


@dataclass(frozen=True)
class RecurrenceSpec:
    """The recurrence kernel's tile (verify, decode and snapshot share it: one binary).

    ``lanes_k``: lanes of a warp along K (the rest go along V; at most 16 are used,
    ``launch.MAX_LANES_K``); ``rows``: V rows each thread holds (a program covers
    ``rows * 32 / lanes_k * warps`` rows of V); ``warps``: warps per program.
    ``small_grid_programs``, ``small_grid_rows``, ``small_grid_max_registers``: a call whose grid
    would have fewer programs than ``small_grid_programs`` (too few to fill the GPU) takes at most
    ``small_grid_rows`` rows per thread, with that register cap: more, shorter programs. Rows per
    thread never change a row's arithmetic (the lanes along K do), so both agree bit for bit.
    ``ptx_widen_bf16``: widen bf16 token inputs with two PTX bit operations per pair instead of
    the compiler's cast (the same bits, fewer instructions; NVIDIA only, never interpreted).
    ``l2_hints``: L2 eviction policies on the loads (the state tile ``evict_first``, ``k``/``q``
    ``evict_last``; PTX cache policies, no effect on any value).
    """

    lanes_k: int = 8
    rows: int = 8
    warps: int = 1
    small_grid_programs: int = 0
    small_grid_rows: int = 4
    small_grid_max_registers: Optional[int] = None
    ptx_widen_bf16: bool = False
    l2_hints: bool = False


@dataclass(frozen=True)
class CommitSpec:
    """The grouped commit's tile. The commit is element-wise, so none of this changes a bit.

    ``block_v``: V rows per state tile; ``warps``: warps per program; ``max_registers``: a
    register cap (more programs per SM keep more state bytes in flight); ``tiles_per_program``:
    state tiles one program replays in turn, sharing the row's plan; ``prefetch_records``,
    ``prefetch_next_tile``: L2 prefetch hints (PTX; NVIDIA only, never interpreted) for a
    program's replay records and for its next state tile; ``replay_pairs``: load two window
    positions' records at a time (``commit.replay_tokens``); ``ptx_round_bf16``: round a bf16
    pool's running state after each token with PTX, two values per instruction
    (``numerics.round_pairs_to_bf16``: the same bits; NVIDIA only, never interpreted).
    """

    block_v: int = 32
    warps: int = 1
    max_registers: Optional[int] = None
    tiles_per_program: int = 1
    prefetch_records: bool = False
    prefetch_next_tile: bool = False
    replay_pairs: bool = False
    ptx_round_bf16: bool = False


@dataclass(frozen=True)
class ConvSpec:
    """The conv kernels: ``block`` channels per program, ``warps`` per program."""

    block: int = 128
    warps: int = 4


@dataclass(frozen=True)
class LaunchTable:
    """One backend's launch specifications: per kernel, and for the recurrence and the commit per
    state dtype (``torch.float32``, ``torch.bfloat16``). The commit's may also name a head size:
    an entry keyed ``(state dtype, V)`` serves layers of ``V`` value rows per head (e.g. Mamba2's
    ``headdim``) in place of the state dtype's own. ``compile_options``: extra options for every
    launch (e.g. ``grf_mode`` on Intel GPUs)."""

    recurrence: dict = field(default_factory=lambda: {torch.float32: RecurrenceSpec(),
                                                      torch.bfloat16: RecurrenceSpec()})
    commit: dict = field(default_factory=lambda: {torch.float32: CommitSpec(), torch.bfloat16: CommitSpec()})
    conv: ConvSpec = ConvSpec()
    plan_block: int = 128
    compile_options: dict = field(default_factory=dict)

    def recurrence_for(self, state_dtype: torch.dtype) -> RecurrenceSpec:
        return self.recurrence[state_dtype]

    def commit_for(self, state_dtype: torch.dtype, V: Optional[int] = None) -> CommitSpec:
        """The commit's spec for a pool of ``state_dtype`` with ``V`` value rows per head."""
        return self.commit.get((state_dtype, V)) or self.commit[state_dtype]

    def options(self, num_warps: int, max_registers: Optional[int] = None) -> dict:
        """Compile options of one launch.

        ``enable_fp_fusion=False``: no multiply-add is contracted behind our back; every fused
        multiply-add is an explicit ``tl.fma``. Bit-identity depends on it: with contraction on,
        verify and decode of one compiled recurrence kernel disagreed on the H200 (the compiler
        may contract differently in the code it specializes per mode)."""
        opts = dict(num_warps=num_warps, enable_fp_fusion=False, **self.compile_options)
        if max_registers is not None:
            opts["maxnreg"] = max_registers
        return opts
