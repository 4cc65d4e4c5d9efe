"""Compile every Gluon recurrence variant for sm_90 without a GPU; print registers, spills, shared
memory and the token loop's instructions.

    /work/venv36/bin/python benchmarks/gluon/compile_check.py            # K = V = 128
    /work/venv36/bin/python benchmarks/gluon/compile_check.py --kv 64 --ops

Needs Triton 3.6 (what the H200 machine has) and no torch: the kernel's signature is built by hand,
as ``ci/compile_kernels.py`` does for the Triton kernels. ptxas, cuobjdump and nvdisasm ship in
Triton's wheel. The loop counts are static: one pass through the innermost largest loop (the
token loop), both sides of every branch in it, so the snapshot store that verify skips is counted.
Exits non-zero when a variant fails to compile or spills.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recurrence import VARIANTS, Variant, fit_tile, gdn_recurrent_gluon  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ci"))
from sass import loops, opcodes, resource_usage  # noqa: E402

_INDEX_POINTERS = {"state_indices_ptr", "qsl_ptr", "snapshot_ptr"}
_FP32_POINTERS = {"corr_ptr", "key_ptr", "decay_ptr", "A_log_ptr", "dt_bias_ptr"}


def signature(state_dtype: str, token_dtype: str, gate_dtype: str, constexprs: dict):
    """Signature and attributes as Triton's JIT would build them for a launch from the library's
    tensors: state pointer and state strides divisible by 16; token pointers, scalars and index
    tensors not specialized (the kernel's ``do_not_specialize`` lists)."""
    fn = gdn_recurrent_gluon
    sig, attrs = {}, {}
    for i, p in enumerate(inspect.signature(fn.fn).parameters):
        if p in constexprs:
            sig[p] = "constexpr"
        elif p.endswith("_ptr"):
            if p in _INDEX_POINTERS:
                sig[p] = "*i32"
            elif p == "state_ptr":
                sig[p] = state_dtype
            elif p in _FP32_POINTERS:
                sig[p] = "*fp32"
            elif p in ("a_ptr", "b_ptr"):
                sig[p] = gate_dtype
            else:
                sig[p] = token_dtype
            if p not in fn.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif p == "scale":
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
            if p.startswith("stride_s"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_variant(variant: Variant, state_dtype: str = "*fp32", token_dtype: str = "*bf16",
                    gates_precomputed: bool = False, K: int = 128, V: int = 128, H: int = 16, HV: int = 48,
                    arch: int = 90):
    constexprs = dict(H=H, HV=HV, K=K, V=V, STRIDE_S_V=K, **fit_tile(variant, K, V),
                      GATES_PRECOMPUTED=gates_precomputed, USE_L2NORM=True, ALIGNED=True,
                      PTX_WIDEN_BF16=variant.ptx_widen_bf16 and state_dtype == "*fp32",
                      L2_HINTS=variant.l2_hints, PERSISTENT=variant.persistent, STAGED=variant.staged)
    gate_dtype = "*fp32" if gates_precomputed else token_dtype
    sig, attrs = signature(state_dtype, token_dtype, gate_dtype, constexprs)
    options = dict(num_warps=variant.warps, enable_fp_fusion=False)
    if variant.max_registers is not None:
        options["maxnreg"] = variant.max_registers
    src = GluonASTSource(gdn_recurrent_gluon, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def token_loop_opcodes(cubin: bytes) -> collections.Counter:
    """Opcodes of the largest loop that contains no other loop (the token loop)."""
    code, spans = loops(cubin)
    innermost = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    if not innermost:
        return collections.Counter()
    return opcodes(code, max(innermost, key=lambda s: s[1] - s[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kv", type=int, nargs="*", default=[128], help="head sizes K = V to compile (default 128)")
    ap.add_argument("--ops", action="store_true", help="print the token loop's most frequent opcodes")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failed = 0
    for kv in args.kv:
        for name in args.variants:
            variant = VARIANTS[name]
            for state in ("*fp32", "*bf16"):
                for precomputed in (False, True):
                    label = (f"K=V={kv} {name:13s} state={state[1:]:4s} gates="
                             f"{'precomputed' if precomputed else 'raw':11s}")
                    try:
                        compiled = compile_variant(variant, state, gates_precomputed=precomputed, K=kv, V=kv)
                        regs, stack = resource_usage(compiled.asm["cubin"])
                        ops = token_loop_opcodes(compiled.asm["cubin"])
                        fp = sum(ops[o] for o in ("FFMA", "FMUL", "FADD"))
                        print(f"{label} warps={variant.warps} regs={regs:3d} stack bytes={stack:3d} "
                              f"shared={compiled.metadata.shared:5d} token loop={sum(ops.values()):4d} "
                              f"(fp32 {fp}, SHFL {ops['SHFL']}, LDG {ops['LDG']}, STG {ops['STG']})")
                        if args.ops:
                            print(" " * 8 + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
                        if stack:
                            failed += 1
                    except Exception as exc:  # noqa: BLE001 - report every variant, fail at the end
                        failed += 1
                        print(f"{label} FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
