"""The command line of ``recoverssm check``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch

import recoverssm as rs
from recoverssm.cli_support import DeviceArgumentError, parse_device, torch_threads
from recoverssm.cli_support import default_device as accelerator_or_cpu
from recoverssm.console import ProgressBar
from recoverssm.core.registry import registry

from .report import REF, Report, format_report
from .suite import cases, run_check


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend to check (default: the one selected for the device)")
    p.add_argument("--device", default=None,
                   help="device of the backend's tensors (default: cpu under TRITON_INTERPRET=1 or for "
                        "cpu backends, else the backend's device type, else cuda if present, else xpu "
                        "if present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random problems (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; the problems are tiny)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def default_device(backend_name: Optional[str]) -> torch.device:
    """Where to run ``backend_name`` when ``--device`` is not given: on CPU tensors under the
    Triton interpreter, else on the backend's first device type, else (no backend named) on the
    GPU if there is one."""
    if os.environ.get("TRITON_INTERPRET") == "1" and backend_name not in (None, REF):
        return torch.device("cpu")
    if backend_name is not None:
        try:
            be = registry().backends().get(backend_name)
        except Exception:
            be = None
        if be is not None and be.device_types:
            return torch.device(be.device_types[0])
        return torch.device("cpu")
    return accelerator_or_cpu()


def _print_report(report: Report, backend, device: torch.device, reason: str, elapsed: float) -> None:
    counts = report.counts()
    against = " (cpu_ref against itself: a smoke test)" if backend.name == REF else ""
    print(f"recoverssm check: backend {backend.name} on {device} ({reason}) against cpu_ref{against}")
    print()
    for line in format_report(report):
        print(line)
    print()
    verdict = "PASSED" if report.passed else "FAILED"
    print(f"{verdict}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['error']} errors, "
          f"{counts['skip']} skipped in {elapsed:.1f} s")


def _main(args: argparse.Namespace) -> int:
    try:
        device = parse_device(args.device) if args.device else default_device(args.backend)
    except DeviceArgumentError as e:
        print(f"recoverssm check: {e}", file=sys.stderr)
        return 2
    bar = ProgressBar(len(cases(device)), "cases", enabled=False if args.json else None)
    t0 = time.perf_counter()
    try:
        with bar:
            report, backend, reason = run_check(args.backend, device, args.seed,
                                                on_case=lambda label: bar.update(1, label[:40]))
    except (rs.BackendError, RuntimeError) as e:
        bar.close()
        print(f"recoverssm check: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"backend": backend.name, "device": str(device), "reason": reason,
                          "passed": report.passed, "counts": report.counts(), "elapsed_s": elapsed,
                          "items": [asdict(i) for i in report.items]}, indent=2))
    else:
        _print_report(report, backend, device, reason, elapsed)
    return 0 if report.passed else 1


def main(args: argparse.Namespace) -> int:
    """Run with ``args.threads`` torch threads, restoring the caller's setting afterwards."""
    with torch_threads(args.threads):
        return _main(args)
