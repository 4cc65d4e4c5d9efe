"""Rounding helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, done on the bits.

    Written out instead of ``x.to(tl.bfloat16)`` so that every target rounds alike: Triton's CPU
    interpreter truncates in that cast, and the bf16 state must match ``cpu_ref`` (torch rounds to
    nearest even) bit for bit. NaN stays a quiet NaN.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    return rounded.to(tl.bfloat16, bitcast=True)


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """Round an fp32 tile to the storage dtype of a state (fp32 or bf16)."""
    if DTYPE == tl.bfloat16:
        return round_to_bf16(x)
    else:
        return x.to(DTYPE)
