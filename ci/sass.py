"""Reading compiled cubins with the tools Triton's wheel ships (``cuobjdump``, ``nvdisasm``):
registers and spills, and the opcodes of a loop. No GPU needed."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile


def run_tool(name: str, args: list, cubin: bytes) -> str:
    """The standard output of Triton's copy of the CUDA tool ``name`` run on ``cubin``."""
    from triton.backends.nvidia import compiler as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers and stack (spill) bytes per thread, from ``cuobjdump --dump-resource-usage``."""
    text = run_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"STACK:(\d+)", text).group(1))


def loops(cubin: bytes) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The instructions ``(address, text)`` in ``nvdisasm`` order, and every loop as the span
    ``(start, end)`` from a backward branch's target to the branch, in the order of the branches."""
    text = run_tool("nvdisasm", ["-c"], cubin)
    labels, code, pending = {}, [], []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*)", line)
        if ins:
            address = int(ins.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            code.append((address, ins.group(2)))
    spans = []
    for address, ins in code:
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if target and labels.get(target.group(1), address + 1) < address:
            spans.append((labels[target.group(1)], address))
    return code, spans


def opcodes(code: list[tuple[int, str]], span: tuple[int, int]) -> collections.Counter:
    """Opcodes (predicates and modifiers dropped) of the instructions inside ``span``."""
    start, end = span
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ins).group(1)
                               for address, ins in code if start <= address <= end)


def first_loop_opcodes(cubin: bytes) -> collections.Counter:
    """Opcodes of the first loop (empty when the kernel has none)."""
    code, spans = loops(cubin)
    return opcodes(code, spans[0]) if spans else collections.Counter()
