"""How device addresses are stored in the int64 pointer tables that commit kernels read.

A kernel only casts a table entry back to a pointer, so what matters is the 64-bit pattern.
CUDA addresses fit in a signed int64. Intel GPU (Level Zero / SYCL USM) addresses have bit 63
set (e.g. ``0xffff85abd4e00000``): ``torch.tensor([addr], dtype=torch.int64)`` overflows, so
those tables hold each address's unsigned bit pattern reinterpreted as int64 (two's complement).
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class PointerEncoding(str, enum.Enum):
    INT64 = "int64"
    """Addresses are non-negative and stored as they are (CUDA)."""
    UINT64_IN_INT64 = "uint64-in-int64"
    """The address's uint64 bit pattern, stored in an int64 element (XPU)."""

    def encode(self, addresses: Sequence[int]) -> torch.Tensor:
        """Return a CPU int64 tensor whose elements hold the addresses' 64-bit patterns."""
        values = [int(a) for a in addresses]
        for i, a in enumerate(values):
            if a < 0 or a >= _U64:
                raise ValueError(f"pointer table entry {i} = {a:#x} is not a 64-bit unsigned address")
        if self is PointerEncoding.INT64:
            for i, a in enumerate(values):
                if a > _I64_MAX:
                    raise ValueError(
                        f"pointer table entry {i} = {a:#x} has bit 63 set and cannot be stored with the "
                        "'int64' encoding; this device needs the 'uint64-in-int64' encoding")
            return torch.tensor(values, dtype=torch.int64)
        return torch.tensor([to_signed_bits(a) for a in values], dtype=torch.int64)

    def decode(self, table: torch.Tensor) -> list[int]:
        """The addresses a table holds (for tests and debugging)."""
        vals = table.to(torch.int64).tolist()
        if self is PointerEncoding.INT64:
            return vals
        return [v + _U64 if v < 0 else v for v in vals]


def to_signed_bits(address: int) -> int:
    """The int64 value whose two's-complement bits equal the uint64 ``address``."""
    return address - _U64 if address > _I64_MAX else address
