"""Rounding, widening and index helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, done on the bits (about 7 integer instructions per
    value). NaN becomes the quiet NaN 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    return rounded.to(tl.bfloat16, bitcast=True)


@triton.jit
def to_storage(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Round a tile to the dtype it is stored in, to nearest even, on every target.

    A compiled kernel's fp32 -> bf16 cast rounds to nearest even in hardware (one instruction per
    pair of values on NVIDIA GPUs). Triton's CPU interpreter truncates in that cast, so there
    (``INTERPRETED``, which launchers set from ``config.interpreting()``) the rounding is done on
    the bits: both give torch's bits for every value but NaN."""
    if DTYPE == tl.bfloat16:
        if INTERPRETED:
            return round_to_bf16(x.to(tl.float32))
        else:
            return x.to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def round_pairs_to_bf16(x):
    """An fp32 tile rounded to bf16 (to nearest even) and widened back, two values per PTX
    ``cvt.rn.bf16x2.f32`` (the compiler's cast issues the same instruction) and one bit operation
    per value to widen: the same bits as ``to_storage(x, bf16).to(fp32)``, and the tile never
    leaves fp32, so the compiler keeps its layout. PTX: compiled kernels on NVIDIA GPUs only."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
        "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def as_stored(S, DTYPE: tl.constexpr, ROUND_EACH_TOKEN: tl.constexpr, INTERPRETED: tl.constexpr,
              PTX_ROUND_BF16: tl.constexpr):
    """The running state after a token: with ``ROUND_EACH_TOKEN``, as a pool of ``DTYPE`` holds
    it (rounded to ``DTYPE`` with ``to_storage`` and widened back, or for bf16 with
    ``PTX_ROUND_BF16`` by ``round_pairs_to_bf16``), so that a window run in one call gives the
    bits of one call per token, each of which stores its state; else (and for an fp32 pool) ``S``
    itself."""
    if (DTYPE == tl.float32) or (not ROUND_EACH_TOKEN):
        return S
    elif PTX_ROUND_BF16 and (DTYPE == tl.bfloat16):
        return round_pairs_to_bf16(S)
    else:
        return to_storage(S, DTYPE, INTERPRETED).to(tl.float32)


@triton.jit
def to_fp32(x, PTX_WIDEN_BF16: tl.constexpr):
    """Widen a tile of token inputs to fp32 (exact for every input dtype).

    With ``PTX_WIDEN_BF16`` a bf16 tile is widened two values at a time, as the 32-bit register
    that holds them: the low value is the register shifted left by 16 bits, the high value the
    register with its low 16 bits cleared (one instruction each). ptxas spends three
    instructions per pair on the plain cast (a byte permute and a shift for the high value), and
    the recurrence kernel widens 40 values per token and thread, so this is about 5% of its
    per-token instructions. The result is the same bits either way: a bf16 value is the top half
    of its fp32 value. PTX, so compiled kernels on NVIDIA GPUs only."""
    if PTX_WIDEN_BF16 and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)
    else:
        return x.to(tl.float32)


@triton.jit
def is_slot(value, null_slot, num_slots):
    """The index rule (``core/indices.py``): above ``null_slot`` and in ``[0, num_slots)``;
    anything else is padding."""
    return (value > null_slot) & (value >= 0) & (value < num_slots)


@triton.jit
def row_window(qsl_ptr, row, num_tokens, max_len):
    """Row ``row``'s first token, its span and its length, whatever ``query_start_loc`` holds:
    both ends clamped to ``[0, num_tokens]`` (the span: the tokens between them, at least 0), the
    length to ``[0, max_len]`` (so no token index leaves the inputs and no difference
    overflows). A live row works on ``length`` tokens; a padding row zeroes its whole span."""
    start = tl.minimum(tl.maximum(tl.load(qsl_ptr + row), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(qsl_ptr + row + 1), 0), num_tokens)
    span = tl.maximum(end - start, 0)
    return start, span, tl.minimum(span, max_len)
