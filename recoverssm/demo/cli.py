"""The command line of ``recoverssm demo``: the single-process front end, and the tensor-parallel
one (``--tp N``, one process per rank under torchrun). Both take the same arguments, print through
the same progress bar and table (:mod:`.report`), and exit 0 (checked), 1 (a mismatch) or 2 (a
usage or setup error, one line on stderr)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import recoverssm as rs
from recoverssm.cli_support import DeviceArgumentError, default_device, parse_device, torch_threads
from recoverssm.console import ProgressBar
from recoverssm.core.registry import registry

from .checks import DemoMismatch
from .model import ARCHS, STATE_DTYPES, model_config
from .report import StepPrinter, intro_lines, summary_lines, tp_intro_lines, tp_lines
from .run import DemoConfig, resolve_ref_conv, run_demo
from .tp import init_distributed, run_tp_demo, shard_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="torch device of the model and caches (default: cuda if present, else xpu if "
                        "present, else cpu; with --tp: cuda if present, else cpu)")
    p.add_argument("--backend", default=None,
                   help="backend name (default: the one selected for the device, cpu -> cpu_ref)")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default: 4)")
    p.add_argument("--draft-tokens", type=int, default=3, help="draft tokens per window, k (default: 3)")
    p.add_argument("--steps", type=int, default=12, help="speculative steps (default: 12)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and drafts (default: 0)")
    p.add_argument("--arch", choices=ARCHS, default="gdn",
                   help="the recurrent layers: gdn (Gated DeltaNet, Qwen3-Next-like), kda (Kimi Delta "
                        "Attention, Kimi-Linear-like: H = HV, K = V, a gate per K channel) or mamba2 (a "
                        "Nemotron-H-like hybrid: Mamba2 layers with 2 groups of B/C, and attention layers; "
                        "not with --tp) (default: gdn)")
    p.add_argument("--lower-bound", type=float, nargs="?", const=-5.0, default=None, metavar="LB",
                   help="with --arch kda: the bounded gate g = LB * sigmoid(exp(A_log) * (a + dt_bias)), "
                        "LB < 0 (default without a value: -5)")
    p.add_argument("--layers", type=int, default=4,
                   help="recurrent layers, split into 2 KV-cache groups; --arch mamba2 adds an attention "
                        "layer after every odd-numbered one that another follows (4: M*MM*M) (default: 4)")
    p.add_argument("--ref-conv", choices=("auto", "torch", "kernel"), default="auto",
                   help="per-token conv of the reference path: the backend's rs.conv_decode (kernel), or "
                        "plain torch, bit-identical on cpu_ref only (default: kernel where the backend "
                        "has conv_decode)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; the demo's ops are tiny, and extra intra-op "
                        "threads only add synchronisation, which spins badly on a busy machine)")
    p.add_argument("--state-dtype", choices=list(STATE_DTYPES), default="fp32",
                   help="the recurrent state pools' dtype; a bf16 pool is rounded after every token, so "
                        "the speculative path gives the per-token path's bits for both (default: fp32)")
    p.add_argument("--deferred", action="store_true",
                   help="defer each step's commit into the next step's verify (CommitContext(deferred=True): "
                        "double-buffered records, finished requests flushed); the same bit-identity checks")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism over N ranks, one process each: start with torchrun "
                        "--nproc-per-node N (gloo on cpu, nccl on cuda); see docs/PARALLELISM.md")


def size_error(args: argparse.Namespace) -> Optional[str]:
    """The first size or model argument out of range, as a message; None if all are valid."""
    if args.lower_bound is not None and args.arch != "kda":
        return "--lower-bound is KDA's bounded gate: it needs --arch kda"
    if args.lower_bound is not None and not args.lower_bound < 0:
        return f"--lower-bound must be < 0 (the gate is a decay), got {args.lower_bound:g}"
    limits = [("--requests", args.requests, 1), ("--draft-tokens", args.draft_tokens, 0),
              ("--steps", args.steps, 0), ("--layers", args.layers, 1)]
    if args.tp is not None:
        limits.append(("--tp", args.tp, 1))
    for flag, value, low in limits:
        if value < low:
            return f"{flag} must be >= {low}, got {value}"
    return None


def demo_config(args: argparse.Namespace, device: torch.device) -> DemoConfig:
    """The :class:`DemoConfig` the arguments ask for, on ``device``."""
    return DemoConfig(requests=args.requests, draft_tokens=args.draft_tokens, steps=args.steps,
                      seed=args.seed, device=str(device), backend=args.backend,
                      ref_conv=args.ref_conv, deferred=args.deferred,
                      model=model_config(args.arch, args.layers, args.lower_bound, args.state_dtype))


class Printer:
    """The demo's text on stdout, through the progress bar; silent when ``quiet`` (``--json``, or
    a rank other than 0)."""

    def __init__(self, steps: int, quiet: bool):
        self.quiet = quiet
        self.bar = ProgressBar(steps, "steps", enabled=False if quiet else None)

    def __call__(self, line: str = "") -> None:
        if not self.quiet:
            self.bar.print(line)

    def lines(self, lines: list[str]) -> None:
        for line in lines:
            self(line)


def _error(message: str) -> int:
    print(f"recoverssm demo: {message}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------------
# single process
# ------------------------------------------------------------------------------------------------
def run_single(args: argparse.Namespace) -> int:
    """``recoverssm demo``: one process, every request and layer on one device."""
    try:
        device = parse_device(args.device) if args.device else default_device()
    except DeviceArgumentError as e:
        return _error(str(e))
    cfg = demo_config(args, device)
    out = Printer(cfg.steps, quiet=args.json)
    try:
        backend, reason = registry().resolve(cfg.backend, cfg.device)
    except (rs.BackendError, RuntimeError) as e:
        return _error(str(e))
    out.lines(intro_lines(cfg, backend.name, reason, resolve_ref_conv(cfg.ref_conv, backend)))
    printer = StepPrinter(out, cfg, out.bar)
    t0 = time.perf_counter()
    try:
        with out.bar:
            res = run_demo(cfg, on_step=printer.on_step, on_prefill=printer.on_prefill)
    except DemoMismatch as e:
        out.bar.close()
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        print(f"recoverssm demo: MISMATCH: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({**res.to_json(), "elapsed_s": elapsed}, indent=2))
        return 0
    out("")
    out.lines(summary_lines(res))
    out(f"total {elapsed:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------
# tensor parallel (``--tp N``)
# ------------------------------------------------------------------------------------------------
def run_tensor_parallel(args: argparse.Namespace) -> int:
    """``recoverssm demo --tp N`` on this rank: join the process group torchrun set up, run, leave."""
    mcfg = model_config(args.arch, args.layers, args.lower_bound, args.state_dtype)
    try:
        # gloo runs anywhere; NCCL only on cuda, so an xpu machine defaults to the CPU here.
        device_type = (parse_device(args.device) if args.device else default_device(("cuda",))).type
        shard_config(mcfg, args.tp)
        t0 = time.perf_counter()
        rank, world, _, device = init_distributed(args.tp, device_type)
        init_s = time.perf_counter() - t0
    except (ValueError, RuntimeError) as e:        # TPSetupError and DeviceArgumentError included
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"recoverssm demo --tp: {e}", file=sys.stderr)
        return 2
    try:
        return _run_rank(args, rank, world, device, init_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(args: argparse.Namespace, rank: int, world: int, device: torch.device, init_s: float) -> int:
    cfg = demo_config(args, device)
    lead = rank == 0
    out = Printer(cfg.steps, quiet=args.json or not lead)
    try:
        backend, reason = registry().resolve(cfg.backend, device)
    except (rs.BackendError, RuntimeError) as e:
        return _error(str(e)) if lead else 2
    out.lines(tp_intro_lines(cfg, world, device.type, backend.name, reason, dist.get_backend(),
                             resolve_ref_conv(cfg.ref_conv, backend)))
    printer = StepPrinter(out, cfg, out.bar, prefill_note=" on every rank")
    t0 = time.perf_counter()
    try:
        with out.bar:
            tpr = run_tp_demo(cfg, on_step=printer.on_step, on_prefill=printer.on_prefill)
    except DemoMismatch as e:
        out.bar.close()
        if args.json and lead:
            print(json.dumps({"ok": False, "rank": rank, "error": str(e)}))
        print(f"recoverssm demo (rank {rank}): MISMATCH: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:          # a collective failed: another rank stopped first
        out.bar.close()
        print(f"recoverssm demo (rank {rank}): stopped, a collective failed (did another rank "
              f"fail first?): {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    if args.json:
        if lead:
            print(json.dumps({**tpr.to_json(), "elapsed_s": elapsed, "init_s": init_s}, indent=2))
        return 0
    out("")
    out.lines(summary_lines(tpr.result))
    out(f"(bytes and bit-identity counts above: rank 0; each rank holds 1/{world} of every state and record)")
    out.lines(tp_lines(tpr))
    out(f"total {elapsed:.1f} s")
    return 0


def main(args: argparse.Namespace) -> int:
    """``recoverssm demo``, with ``args.threads`` torch threads (the caller's setting restored)."""
    problem = size_error(args)
    if problem:
        return _error(problem)
    with torch_threads(args.threads):
        return run_single(args) if args.tp is None else run_tensor_parallel(args)
