"""The cuda backend's launch table, tuned on an NVIDIA H200 (sm_90, Triton 3.6).

Why each entry (measurements in docs/BENCHMARKS.md; ``benchmarks/tune_verify.py`` and
``benchmarks/tune_commit.py`` sweep them through ``backends/triton/tuning.py``):

* recurrence tile: 8 lanes along K, 8 rows per thread, 1 warp. 128 state values per thread
  spread each token's fixed work; 3 shuffle steps per reduction.
* small grids (< 792 programs): 4 rows per thread, 168 registers. Twice the programs still fit
  one wave (132 SMs x 12 / 2); N = 1 about 12% faster. 2 or 1 rows per thread are slower again
  (N = 1, T = 8: 8.0 -> 9.0 -> 9.8 us): each program does the token's fixed work again.
* PTX widening of bf16 inputs, over fp32 states only: 5% fewer instructions per token (verify
  N=64, T=4, HV=48: 91.1 -> 88.6 us); over bf16 states the tile spilled.
* L2 hints in the recurrence: verify N=64, T=4: 88.5 -> 84.8 us (HV=48), 64.8 -> 60.7 us (HV=32).
* commit, fp32 states: 32 V rows, 1 warp, 1 tile per program, record prefetch. At copy bandwidth
  (0.92x); fewer programs in flight only lose.
* commit, bf16 states: 16 V rows, 1 warp, 128 registers, 2 tiles per program, next tile hinted,
  record pairs, the per-token rounding in PTX pairs. 0.825x -> 0.916x copy at 64 requests (3 groups
  x 6 layers, T = 4) and 0.794x -> 0.888x at 8 from the PTX rounding alone (the compiler's cast
  widens back with a byte permute and a multiply per value: 604 -> 539 instructions per token);
  Mamba2 (Nemotron-H-8B, N = 64) 0.52x -> 0.68x at T = 8.
* commit, fp32 states with 64 V rows per head (Mamba2's headdim 64): 2 tiles per program (one
  program per head) and record pairs. Nemotron-H-8B, T = 8: 0.83x -> 0.90x copy at N = 64, 0.84x
  -> 0.91x at N = 256; the same spec for V = 128 (GDN, KDA) loses 2% to 7% (fewer programs).
"""
from dataclasses import replace

import torch

from ..triton.config import CommitSpec, ConvSpec, LaunchTable, RecurrenceSpec

_COMMIT_FP32 = CommitSpec(block_v=32, warps=1, prefetch_records=True)
_RECURRENCE = RecurrenceSpec(lanes_k=8, rows=8, warps=1, small_grid_programs=792, small_grid_rows=4,
                             small_grid_max_registers=168, l2_hints=True)

LAUNCH_TABLE = LaunchTable(
    recurrence={torch.float32: RecurrenceSpec(**{**_RECURRENCE.__dict__, "ptx_widen_bf16": True}),
                torch.bfloat16: _RECURRENCE},
    commit={torch.float32: _COMMIT_FP32,
            (torch.float32, 64): replace(_COMMIT_FP32, tiles_per_program=2, replay_pairs=True),
            torch.bfloat16: CommitSpec(block_v=16, warps=1, max_registers=128, tiles_per_program=2,
                                       prefetch_records=True, prefetch_next_tile=True, replay_pairs=True,
                                       ptx_round_bf16=True)},
    conv=ConvSpec(block=128, warps=4),
)
