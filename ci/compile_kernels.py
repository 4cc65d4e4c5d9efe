"""Compile every Triton kernel for a GPU target without a GPU, and print registers and spills.

Triton's wheel carries ptxas, so this runs on a CPU-only machine: it catches compile errors that
the interpreter cannot see and shows register pressure before any device time is spent.

    python ci/compile_kernels.py            # sm_90 (H100 / H200)
    python ci/compile_kernels.py --arch 80
    python ci/compile_kernels.py --loops    # + instructions in each kernel's first loop, by opcode

The loop counts are static (one pass through the loop body, both sides of every branch in it):
for the recurrence kernel that is the per-token cost a warp issues, plus the snapshot store that
verify skips. They depend on the Triton version; the H200 machine has Triton 3.6.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recoverssm.backends.triton.commit import grouped_commit_kernel, plan_commit_kernel
from recoverssm.backends.triton.config import LaunchTable
from recoverssm.backends.triton.conv import conv_decode_kernel, conv_verify_kernel
from recoverssm.backends.triton.launch import commit_specialization, recurrence_specialization
from recoverssm.backends.triton.pending import clear_rows_kernel, defer_kernel
from recoverssm.backends.triton.recurrence import recurrence_kernel
from recoverssm.core.backend import GateInputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import first_loop_opcodes, resource_usage  # noqa: E402


def _signature(fn, pointer_types: dict[str, str], constexprs: dict, default: str = "i32"):
    params = list(inspect.signature(fn.fn).parameters)
    sig, attrs = {}, {}
    for i, p in enumerate(params):
        if p in constexprs:
            sig[p] = "constexpr"
        elif p.endswith("_ptr"):
            sig[p] = pointer_types.get(p, "*fp32")
            if p not in getattr(fn, "do_not_specialize_on_alignment", ()):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p] = pointer_types.get(p, default)
            if p.startswith("stride_s"):  # what Triton's JIT infers for state strides (multiples of 16)
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(fn, constexprs, pointer_types, options, arch):
    sig, attrs = _signature(fn, pointer_types, constexprs)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return resource_usage(compiled.asm["cubin"]), compiled.asm["cubin"]


def cases(table: LaunchTable, K=128, V=128, H=16, HV=48):
    """Every specialization the cuda backend launches at these head sizes: the recurrence for
    GDN and KDA, raw and precomputed gates (and Mamba2 at Nemotron-H's sizes, two input forms),
    fp32 and bf16 states (bf16 in both rounding modes), on the large-grid tile and the small-grid
    one, with and without the pending replay; both conv
    kernels; the plan; the commit and the flush for both state dtypes (and modes) and both decays;
    the defer kernels."""
    ints = {n: "*i32" for n in ("state_indices_ptr", "qsl_ptr", "snapshot_ptr", "num_accepted_ptr",
                                "request_indices_ptr", "block_table_ptr", "num_computed_ptr",
                                "commit_len_ptr", "final_ptr", "boundary_ptr", "boundary_len_ptr",
                                "pending_rows_ptr", "plan_ptr", "parity_ptr", "flush_rows_ptr", "rows_ptr")}
    floats = {"scale": "fp32", "lower_bound": "fp32", "dt_min": "fp32", "dt_max": "fp32"}
    # a bf16 pool with round_each_token (the default) and without (the state rounded only where stored)
    states = ((torch.float32, "*fp32", True), (torch.bfloat16, "*bf16", True), (torch.bfloat16, "*bf16", False))
    for state_dtype, state, rounding in states:
        for kind in ("gdn", "kda"):
            for precomputed in (False, True):
                for (grid, heads_times_rows), replay in itertools.product((("large", None), ("small", 1)),
                                                                          (False, True)):
                    gates = GateInputs(g=1, beta=1, kind=kind) if precomputed else GateInputs(a=1, kind=kind)
                    tile, constexprs, options = recurrence_specialization(
                        table, state_dtype, H, HV, K, V, K, gates, True, True, heads_times_rows, replay, rounding)
                    yield (f"{kind} recurrence precomputed={precomputed} state={state}"
                           f"{'' if rounding else ' store-rounded'} {grid} grid"
                           f"{' replay' if replay else ''}", recurrence_kernel,
                           constexprs, {**ints, **floats, "state_ptr": state, "q_ptr": "*bf16", "k_ptr": "*bf16",
                                        "v_ptr": "*bf16", "out_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16"},
                           options)
    # Mamba2 at Nemotron-H's layer (dstate 128, headdim 64, 8 groups of 128 heads): D per head and a
    # dt_limit (the models' form); D per channel, z and A given
    d_head, d_channel = torch.empty(HV), torch.empty(HV, V)
    forms = (("D per head, dt_limit", GateInputs(a=1, kind="mamba2", D=d_head, dt_limit=(0.001, float("inf")))),
             ("D per channel, z, A", GateInputs(a=1, kind="mamba2", D=d_channel, z=1, A=1)))
    for (state_dtype, state, rounding), (form, gates) in itertools.product(states, forms):
        for (grid, heads_times_rows), replay in itertools.product((("large", None), ("small", 1)), (False, True)):
            tile, constexprs, options = recurrence_specialization(
                table, state_dtype, 8, 128, 128, 64, 128, gates, False, True, heads_times_rows, replay, rounding)
            yield (f"mamba2 recurrence {form} state={state}{'' if rounding else ' store-rounded'} {grid} grid"
                   f"{' replay' if replay else ''}", recurrence_kernel, constexprs,
                   {**ints, **floats, "state_ptr": state, "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                    "out_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "D_ptr": "*fp32", "z_ptr": "*bf16"},
                   options)
    conv = dict(WIDTH=4, DILATION=1, BD=table.conv.block, HAS_BIAS=True, SILU=True, INTERPRETED=False)
    conv_types = {**ints, "x_ptr": "*bf16", "conv_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16",
                  "out_ptr": "*bf16"}
    yield ("conv_verify", conv_verify_kernel, conv, conv_types, table.options(table.conv.warps))
    yield ("conv_decode", conv_decode_kernel, conv, conv_types, table.options(table.conv.warps))
    dilated = dict(conv, DILATION=3, HAS_BIAS=False)             # Qwen4Exp's per-layer-embedding conv
    yield ("conv_verify dilation=3", conv_verify_kernel, dilated, conv_types, table.options(table.conv.warps))
    yield ("conv_decode dilation=3", conv_decode_kernel, dilated, conv_types, table.options(table.conv.warps))
    yield ("plan_commit", plan_commit_kernel, dict(BLOCK=table.plan_block), {**ints, "bt_stride": "i64"},
           table.options(4))
    for state_dtype, state, rounding in ((torch.float32, "fp32", True), (torch.bfloat16, "bf16", True),
                                         (torch.bfloat16, "bf16", False)):
        for vector_decay in (False, True):
            _, constexprs, options = commit_specialization(table.commit_for(state_dtype), table, state, "bf16",
                                                           H, HV, K, V, conv_cols=4, aligned=True,
                                                           vector_decay=vector_decay, round_each_token=rounding)
            for flush in (False, True):
                yield (f"grouped_commit state={state}{'' if rounding else ' store-rounded'} "
                       f"vector_decay={vector_decay}{' flush' if flush else ''}",
                       grouped_commit_kernel, {**constexprs, "FLUSH": flush},
                       {**ints, "layer_table_ptr": "*i64", "group_table_ptr": "*i64"}, options)
    yield ("defer", defer_kernel, dict(BLOCK=table.plan_block), {**ints, "group_table_ptr": "*i64"}, table.options(4))
    yield ("clear_rows", clear_rows_kernel, dict(BLOCK=table.plan_block), ints, table.options(4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--loops", action="store_true", help="count the instructions of each kernel's first loop")
    args = ap.parse_args(argv)
    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    failed = 0
    for name, fn, constexprs, ptypes, options in cases(LAUNCH_TABLE):
        try:
            (regs, spills), cubin = compile_one(fn, constexprs, ptypes, options, args.arch)
            print(f"{name:58s} warps={options['num_warps']} regs={regs:4d} stack bytes={spills}")
            if args.loops:
                ops = first_loop_opcodes(cubin)
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
                print(f"{'':58s} first loop: {sum(ops.values())} instructions ({top})")
        except Exception as exc:  # noqa: BLE001 - report every kernel, fail at the end
            failed += 1
            print(f"{name:58s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
