"""Launch configuration of the shared Triton kernels, importable without Triton installed.

The registry imports every built-in backend to ask whether it is available; keeping this module
free of ``import triton`` lets the GPU backends say "triton is not installed" instead of failing
the import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class CommitTile(NamedTuple):
    """The grouped commit's launch for one state dtype (``LaunchConfig.commit_tile``)."""

    block_v: int
    warps: int
    max_registers: Optional[int]
    tiles_per_program: int
    prefetch_records: bool
    prefetch_next_tile: bool
    replay_pairs: bool


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shapes and warps for one backend (one row of a backend's launch table).

    ``gdn_lanes_k``: lanes of a warp along K in the recurrence tile (the rest go along V; at most
    16 are used, ``launch.MAX_LANES_K``);
    ``gdn_rows``: V rows each thread holds (a program covers ``gdn_rows * 32 / gdn_lanes_k`` rows
    per warp); ``gdn_max_registers``: a register cap per thread for the recurrence (Triton's
    ``maxnreg``; without one the compiler takes more than the kernel needs, at the cost of
    occupancy); ``gdn_small_grid_programs``, ``gdn_small_grid_rows``,
    ``gdn_small_grid_max_registers``: a call whose grid would have fewer programs than
    ``gdn_small_grid_programs`` (too few to fill the GPU) uses at most ``gdn_small_grid_rows`` rows
    per thread, with that register cap: more, shorter programs. Rows per thread do not change the
    arithmetic of a row (the lanes along K do), so calls of either size agree bit for bit;
    ``gdn_ptx_widen_bf16``: the recurrence widens bf16 token inputs to fp32 with two PTX bit
    operations per pair of values instead of the compiler's cast (the same bits, fewer
    instructions; NVIDIA GPUs only, never under Triton's interpreter; ``numerics.to_fp32``);
    applied over fp32 states only: over bf16 states the default tile then spilled 720 bytes
    (sm_90, Triton 3.6);
    ``gdn_l2_hints``: cache hints on the recurrence's loads (PTX eviction policies; no effect on
    any value): its state tile, read once, ``evict_first``; the token's ``k`` and ``q``, read
    again by every V tile and value head of their q/k head, ``evict_last``;
    ``commit_block_v``, ``commit_warps``: V rows per commit program and its warps;
    ``commit_block_v_bf16``, ``commit_warps_bf16``: the same for bf16 states when set (half the
    bytes per row: the replay's arithmetic, not memory, decides the best tile; the commit is
    element-wise, so its tile never changes a bit); ``commit_max_registers``,
    ``commit_max_registers_bf16``: register caps for the commit (more programs per SM keep more
    state bytes in flight); ``commit_tiles_per_program``, ``commit_tiles_per_program_bf16``:
    state tiles one commit program replays in turn, sharing the row's commit plan;
    ``commit_prefetch_records``, ``commit_prefetch_next_tile``: L2 prefetch hints (PTX, so NVIDIA
    GPUs only; never under Triton's interpreter) for the replay records of a program's tiles, at
    its start, and for its next state tile, before the current one is replayed;
    ``commit_replay_pairs``, ``commit_replay_pairs_bf16``: the replay loads the records of two
    window positions at a time instead of the next position's while applying the current one
    (``commit.replay_tokens``);
    ``conv_block``: channels per conv program.
    ``compile_options``: extra options for every launch (e.g. ``grf_mode`` on Intel GPUs).
    """

    gdn_lanes_k: int = 8
    gdn_rows: int = 8
    gdn_warps: int = 1
    gdn_stages: Optional[int] = None
    gdn_max_registers: Optional[int] = None
    gdn_small_grid_programs: int = 0
    gdn_small_grid_rows: int = 4
    gdn_small_grid_max_registers: Optional[int] = None
    gdn_ptx_widen_bf16: bool = False
    gdn_l2_hints: bool = False
    commit_block_v: int = 32
    commit_warps: int = 1
    commit_block_v_bf16: Optional[int] = None
    commit_warps_bf16: Optional[int] = None
    commit_max_registers: Optional[int] = None
    commit_max_registers_bf16: Optional[int] = None
    commit_tiles_per_program: int = 1
    commit_tiles_per_program_bf16: Optional[int] = None
    commit_prefetch_records: bool = False
    commit_prefetch_next_tile: bool = False
    commit_replay_pairs: bool = False
    commit_replay_pairs_bf16: Optional[bool] = None
    conv_block: int = 128
    conv_warps: int = 4
    plan_block: int = 128
    compile_options: dict = field(default_factory=dict)

    def commit_tile(self, bf16_state: bool) -> CommitTile:
        """The commit kernel's tile, warps, register cap and tiles per program for the state dtype."""
        if bf16_state:
            return CommitTile(self.commit_block_v_bf16 or self.commit_block_v,
                              self.commit_warps_bf16 or self.commit_warps,
                              self.commit_max_registers_bf16 or self.commit_max_registers,
                              self.commit_tiles_per_program_bf16 or self.commit_tiles_per_program,
                              self.commit_prefetch_records, self.commit_prefetch_next_tile,
                              self.commit_replay_pairs if self.commit_replay_pairs_bf16 is None
                              else self.commit_replay_pairs_bf16)
        return CommitTile(self.commit_block_v, self.commit_warps, self.commit_max_registers,
                          self.commit_tiles_per_program, self.commit_prefetch_records,
                          self.commit_prefetch_next_tile, self.commit_replay_pairs)

    def options(self, num_warps: int, num_stages: Optional[int] = None,
                max_registers: Optional[int] = None) -> dict:
        # enable_fp_fusion=False: no multiply-add is contracted behind our back; every fused
        # multiply-add of the contract is an explicit tl.fma. Bit-identity depends on it: with
        # contraction on, verify and decode of one compiled recurrence kernel disagreed on the
        # H200 (the compiler may contract differently in the code it specializes per mode).
        opts = dict(num_warps=num_warps, enable_fp_fusion=False, **self.compile_options)
        if num_stages is not None:
            opts["num_stages"] = num_stages
        if max_registers is not None:
            opts["maxnreg"] = max_registers
        return opts
