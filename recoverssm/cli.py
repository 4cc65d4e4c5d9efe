"""The ``recoverssm`` command line: ``info``, ``demo``, ``check`` and ``bench``.

``recoverssm info [--json]``        versions, devices, backends, and which backend each device gets
``recoverssm demo [...]``           speculative decoding of a tiny model, checked bit for bit
``recoverssm check [...]``          one backend against the cpu_ref reference
``recoverssm bench [...]``          the benchmark (``recoverssm.bench``, imported only when asked)

The benchmark (and whatever it needs, e.g. matplotlib) is imported only by ``bench``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from typing import Optional, Sequence

import torch

import recoverssm
from recoverssm.build_info import ENV_COMMIT, package_version, source_commit
from recoverssm.core.registry import ENV_BACKEND, registry



# ------------------------------------------------------------------------------------------------
# info
# ------------------------------------------------------------------------------------------------
def _triton_version() -> str:
    """The installed Triton's version without importing it if metadata knows it (XPU and ROCm
    builds ship it under other distribution names)."""
    for dist in ("triton", "pytorch-triton-xpu", "pytorch-triton-rocm", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import triton
        return getattr(triton, "__version__", "unknown version")
    except ImportError:
        return "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _devices() -> list[dict]:
    """The devices torch sees: cpu, each cuda device, each xpu device."""
    devs = [{"type": "cpu", "name": _cpu_name(),
             "detail": f"{os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads"}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devs.append({"type": "cuda", "index": i, "name": torch.cuda.get_device_name(i),
                         "detail": f"{p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}"})
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        for i in range(xpu.device_count()):
            devs.append({"type": "xpu", "index": i, "name": xpu.get_device_name(i), "detail": ""})
    return devs


def collect_info() -> dict:
    """Everything ``recoverssm info`` reports, as plain data."""
    info = {
        "recoverssm": package_version(),
        "commit": source_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "env": {k: os.environ[k] for k in (ENV_BACKEND, "RECOVERSSM_CHECK", ENV_COMMIT, "TRITON_INTERPRET")
                if k in os.environ},
        "devices": _devices(),
        "backends": [],
        "selected": {},
    }
    try:
        backends = registry().backends()
    except Exception as e:  # a broken third-party plugin must not hide everything else
        info["backends_error"] = f"{type(e).__name__}: {e}"
        backends = {}
    for name, be in backends.items():
        available = be.is_available()
        info["backends"].append({
            "name": name, "device_types": list(be.device_types),
            "pointer_encoding": be.pointer_encoding.value,
            "capabilities": sorted(be.capabilities), "available": available,
            "unavailable_reason": "" if available else be.unavailable_reason(),
            "class": f"{type(be).__module__}.{type(be).__qualname__}",
        })
    for dev_type in dict.fromkeys(d["type"] for d in info["devices"]):
        try:
            be, why = registry().resolve(None, dev_type)
            info["selected"][dev_type] = {"backend": be.name, "reason": why}
        except Exception as e:
            info["selected"][dev_type] = {"backend": None, "reason": str(e)}
    return info


def _print_info(info: dict) -> None:
    commit = f" (commit {info['commit']})" if info["commit"] else ""
    print(f"recoverssm {info['recoverssm']}{commit}  (python {info['python']}, torch {info['torch']}, "
          f"triton {info['triton']})")
    for k, v in info["env"].items():
        print(f"  {k}={v}")
    print("\ndevices:")
    for d in info["devices"]:
        label = d["type"] if "index" not in d else f"{d['type']}:{d['index']}"
        print(f"  {label:<8} {d['name']}" + (f"  ({d['detail']})" if d["detail"] else ""))
    print("\nbackends:")
    if "backends_error" in info:
        print(f"  could not load the backends: {info['backends_error']}")
    for b in info["backends"]:
        status = "available" if b["available"] else f"unavailable: {b['unavailable_reason']}"
        print(f"  {b['name']:<8} devices: {', '.join(b['device_types']) or '-'}; "
              f"pointers: {b['pointer_encoding']}; {status}")
        print(f"  {'':<8} capabilities: {', '.join(b['capabilities'])}")
    print("\nselected:")
    for dev_type, sel in info["selected"].items():
        if sel["backend"]:
            print(f"  {dev_type:<8} -> {sel['backend']}  ({sel['reason']})")
        else:
            print(f"  {dev_type:<8} -> none  ({sel['reason']})")


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


# ------------------------------------------------------------------------------------------------
# demo, check, bench
# ------------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from recoverssm.demo import cli as demo_cli
    return demo_cli.main(args)


def cmd_check(args: argparse.Namespace) -> int:
    from recoverssm.check import cli as check_cli
    return check_cli.main(args)


def cmd_bench(argv: Sequence[str]) -> int:
    """Hand the arguments to ``recoverssm.bench.main`` (imported only here)."""
    from recoverssm import bench
    rc = bench.main(list(argv))
    return 0 if rc is None else int(rc)


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recoverssm",
        description="Exact speculative decoding for Gated DeltaNet layers: verify from a read-only "
                    "checkpoint, commit only the accepted tokens.")
    p.add_argument("--version", action="version", version=f"recoverssm {recoverssm.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pi = sub.add_parser("info", help="versions, devices, backends and the backend each device gets")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(func=cmd_info)

    pd = sub.add_parser("demo", help="speculative decoding of a tiny GDN, KDA or Mamba2 hybrid model, checked "
                                     "bit for bit against per-token decoding")
    from recoverssm.demo.cli import add_arguments as demo_arguments
    demo_arguments(pd)
    pd.set_defaults(func=cmd_demo)

    pc = sub.add_parser("check", help="run a backend against cpu_ref on random problems")
    from recoverssm.check.cli import add_arguments as check_arguments
    check_arguments(pc)
    pc.set_defaults(func=cmd_check)

    sub.add_parser("bench", help="the benchmark (recoverssm.bench); arguments are passed through",
                   add_help=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        # Everything after "bench" belongs to the benchmark's own parser, options included.
        return cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # stdout was closed early (``recoverssm info --json | head``): not an error of ours.
        # Point stdout at devnull so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
