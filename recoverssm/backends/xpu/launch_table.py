"""Launch configurations for Intel GPUs.

NOT TUNED ON HARDWARE: no Intel GPU was available when these were written. They follow what peer
Triton projects use on Intel parts (Data Center GPU Max / Arc): a narrower V block (16) so the
fp32 state tile does not spill the register file, 8-lane-friendly warp counts, and the large
register file mode (``grf_mode="large"``) that Intel's Triton backend accepts as a compile option.
Change this table, not the kernels, when tuning on a real part.
"""
from dataclasses import replace

from ..triton.config import LaunchConfig

INTEL_DEFAULT = LaunchConfig(
    gdn_lanes_k=8,
    gdn_rows=1,
    gdn_warps=4,
    commit_block_v=16,
    commit_warps=4,
    conv_block=64,
    conv_warps=4,
    compile_options={"grf_mode": "large"},
)

#: (K, V) -> config; ``None`` is the default row.
LAUNCH_TABLE = {None: INTEL_DEFAULT}

#: The config used when the kernels run under TRITON_INTERPRET=1 on CPU tensors (CI): the same
#: tile shapes, without Intel-only compile options the interpreter does not know.
INTERPRETER = replace(INTEL_DEFAULT, compile_options={})
