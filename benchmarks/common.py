"""What the scripts in ``benchmarks/`` share: the device they run on, launch specs from the command
line (applied through the public tuning hook, ``recoverssm.backends.triton.tuning``), device
timing on a GPU or under Triton's interpreter, a printed table and the JSON written under ``$OUT``.

Not a script: imported by the scripts beside it (``python benchmarks/<script>.py`` puts this
directory on ``sys.path``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

#: The library's Triton kernel modules: ``TRITON_INTERPRET`` must be set before they are imported.
KERNEL_MODULES = ("recoverssm.backends.triton.launch", "recoverssm.backends.triton.recurrence",
                  "recoverssm.backends.triton.commit", "recoverssm.backends.triton.conv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_tiny_arg(ap) -> None:
    ap.add_argument("--tiny", action="store_true",
                    help="CPU tensors, Triton's interpreter, tiny shapes: checks that the script runs "
                         "without a GPU (the times are the interpreter's, not kernel times)")


def add_config_args(ap, base_help: str) -> None:
    """The arguments every tuning script takes: the configurations (``--grid``, ``--sweep``), the
    spec their fields replace (``--base``) and the passes over them (``--repeat``)."""
    ap.add_argument("--grid", help="configurations: 'FIELD=V,FIELD=V;FIELD=V' (';' between configurations, "
                                   "an empty one is the base spec)")
    ap.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                    help="every value of a field (repeatable: every combination), on each --grid configuration")
    ap.add_argument("--base", choices=["table", "default"], default="table", help=base_help)
    ap.add_argument("--repeat", type=int, default=1, help="passes over the configurations (an A/B within one run)")


def setup_device(tiny: bool) -> str:
    """The device the script runs on: ``"cpu"`` under Triton's interpreter with ``tiny``, else
    ``"cuda"`` (which must be present). Call it before anything imports a kernel module."""
    if not tiny:
        if not torch.cuda.is_available():
            raise SystemExit("this script needs a CUDA GPU (or --tiny: CPU tensors under Triton's interpreter)")
        return "cuda"
    loaded = [m for m in KERNEL_MODULES if m in sys.modules]
    if loaded and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(f"kernel modules {loaded} were imported before TRITON_INTERPRET=1 was set")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


# ------------------------------------------------------------------------------------------------
# launch specs from the command line
# ------------------------------------------------------------------------------------------------
def _parse_value(cls, name: str, text: str):
    """``text`` as a value of field ``name`` of dataclass ``cls``: its type is that of the field's
    default (``bool``, ``int``; a default of ``None`` means an int or ``none``)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise SystemExit(f"{cls.__name__} has no field {name!r}; its fields: {', '.join(fields)}")
    default = fields[name].default
    t = text.strip().lower()
    if isinstance(default, bool):
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off"):
            return False
        raise SystemExit(f"{cls.__name__}.{name} is a bool (0/1, true/false), got {text!r}")
    if t == "none" and default is None:
        return None
    try:
        return int(t)
    except ValueError:
        raise SystemExit(f"{cls.__name__}.{name} is an int{' or none' if default is None else ''}, got {text!r}")


def parse_fields(cls, items: Iterable[str]) -> dict:
    """``["rows=4", "l2_hints=0"]`` -> ``{"rows": 4, "l2_hints": False}`` (fields of ``cls``)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"expected FIELD=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        out[name.strip()] = _parse_value(cls, name.strip(), value)
    return out


def parse_configs(cls, grid: Optional[str], sweeps: Sequence[str], default: Sequence[dict]) -> list[dict]:
    """The configurations to measure, each a dict of fields of ``cls`` that replace the base spec's.

    ``grid``: ``"f=v,g=w;f=x"`` (configurations separated by ``;``, fields by ``,``; an empty one
    is the base spec itself). ``sweeps``: ``["f=v1,v2", "g=w1,w2"]``, every combination, applied
    on top of each grid configuration. Neither given: ``default``."""
    configs = default
    if grid is not None:
        configs = [parse_fields(cls, [f for f in part.split(",") if f.strip()]) for part in grid.split(";")]
    if sweeps:
        axes = []
        for sweep in sweeps:
            if "=" not in sweep:
                raise SystemExit(f"--sweep expects FIELD=V1,V2,..., got {sweep!r}")
            name, values = sweep.split("=", 1)
            axes.append([(name.strip(), _parse_value(cls, name.strip(), v)) for v in values.split(",")])
        base = configs if grid is not None else [{}]
        configs = [{**c, **dict(combo)} for c in base for combo in itertools.product(*axes)]
    return [dict(c) for c in configs]


def label(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items()) or "(table)"


def table_with(table, kernel: str, dtype: torch.dtype, spec):
    """``table`` with ``spec`` as kernel ``kernel``'s (``"recurrence"``, ``"commit"``) spec for
    state dtype ``dtype``, for every head size (the table's entries for ``(dtype, V)`` dropped)."""
    specs = {key: s for key, s in getattr(table, kernel).items() if not (isinstance(key, tuple) and key[0] == dtype)}
    return dataclasses.replace(table, **{kernel: {**specs, dtype: spec}})


# ------------------------------------------------------------------------------------------------
# timing, output
# ------------------------------------------------------------------------------------------------
def device_us(calls: Sequence[Callable[[], object]], device: str, iters: int = 40) -> float:
    """Median time of one call in us: on a GPU the kernels' time (``recoverssm.bench.timing.median_us``,
    CUDA graph replays); on the CPU the wall time of each call once, after one warm-up call."""
    if device == "cuda":
        from recoverssm.bench.timing import median_us
        return median_us(calls, iters=iters)
    calls[0]()
    times = []
    for call in calls:
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def print_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> None:
    """``rows`` as an aligned text table (``columns``: default every key, in order of appearance)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(c) for c in columns]] + [["" if r.get(c) is None else str(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def write_json(name: str, obj) -> Optional[str]:
    """Write ``obj`` to ``$OUT/name`` when ``OUT`` is set; returns the path."""
    out = os.environ.get("OUT")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print("wrote", path)
    return path


# ------------------------------------------------------------------------------------------------
# compiling without a GPU
# ------------------------------------------------------------------------------------------------
def add_compile_arg(ap) -> None:
    ap.add_argument("--compile", type=int, nargs="?", const=90, metavar="ARCH",
                    help="compile the kernels for an NVIDIA target (default sm_90) without a GPU and print "
                         "registers and spilled bytes (ci/compile_kernels.py), then exit")


#: Argument types of the recurrence kernel as verify launches it (bf16 inputs; ``state_ptr`` is the
#: state dtype's pointer) and of the grouped commit kernel, for :func:`compile_for_gpu`.
RECURRENCE_TYPES = {"state_indices_ptr": "*i32", "qsl_ptr": "*i32", "snapshot_ptr": "*i32", "scale": "fp32",
                    "lower_bound": "fp32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
                    "a_ptr": "*bf16", "b_ptr": "*bf16"}
COMMIT_TYPES = {"num_accepted_ptr": "*i32", "qsl_ptr": "*i32", "layer_table_ptr": "*i64", "group_table_ptr": "*i64"}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
TRITON_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def compile_for_gpu(fn, constexprs: dict, pointer_types: dict, options: dict, arch: int) -> tuple[int, int]:
    """Compile ``fn`` for NVIDIA target ``sm_<arch>`` without a GPU (``ci/compile_kernels.py``, which
    ptxas shipped with Triton runs): ``(registers, spilled bytes)``. ``pointer_types``: Triton
    types of the arguments that are not ``*fp32`` pointers or ``i32`` integers."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("--compile needs TRITON_INTERPRET unset (the interpreter compiles nothing)")
    ci = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci")
    if ci not in sys.path:
        sys.path.insert(0, ci)
    from compile_kernels import compile_one

    usage, _ = compile_one(fn, constexprs, pointer_types, options, arch)
    return usage


if __name__ == "__main__":
    print(__doc__)
