"""The xpu backend's launch table. NOT TUNED ON HARDWARE: no Intel GPU was available.

* recurrence tile: 8 lanes along K, 1 row per thread, 4 warps: a small fp32 tile per thread, so
  the state does not spill Intel's register file.
* commit: 16 V rows, 4 warps, for the same reason; conv: 64 channels, 4 warps.
* compile option ``grf_mode="large"``: the large register file mode Intel's Triton backend accepts.
* PTX switches (widening, L2 hints, prefetch): off; PTX is NVIDIA-only.

Change this table, not the kernels, when tuning on a real part.
"""
from dataclasses import replace

import torch

from ..triton.config import CommitSpec, ConvSpec, LaunchTable, RecurrenceSpec

_RECURRENCE = RecurrenceSpec(lanes_k=8, rows=1, warps=4)
_COMMIT = CommitSpec(block_v=16, warps=4)

LAUNCH_TABLE = LaunchTable(
    recurrence={torch.float32: _RECURRENCE, torch.bfloat16: _RECURRENCE},
    commit={torch.float32: _COMMIT, torch.bfloat16: _COMMIT},
    conv=ConvSpec(block=64, warps=4),
    compile_options={"grf_mode": "large"},
)

#: The table used when the kernels run under TRITON_INTERPRET=1 on CPU tensors (CI): the same
#: tiles, without the Intel-only compile option the interpreter does not know.
INTERPRETER = replace(LAUNCH_TABLE, compile_options={})
