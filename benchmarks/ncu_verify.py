"""One verify launch after a warm-up one, for ncu: ours with a recurrence spec, the Gluon
experiment's kernel, or FLA's kernel.

    python benchmarks/ncu_verify.py ours [FIELD=VALUE ...]    # e.g. ours lanes_k=16 rows=4 l2_hints=0
    python benchmarks/ncu_verify.py gluon [VARIANT]           # benchmarks/gluon/recurrence.py (rs8x8 default)
    python benchmarks/ncu_verify.py fla                       # fla.ops.gated_delta_rule, the peer
    python benchmarks/ncu_verify.py deferred                  # ours, every row replaying a pending step
    python benchmarks/ncu_verify.py --tiny ours rows=4        # CPU tensors, Triton's interpreter, tiny shape

N=64, T=4, HV=48, H=16, K=V=128, fp32 state, bf16 inputs: the benchmark's headline verify case.
``ours``: ``gdn_verify`` on the cuda backend, the fields (``config.RecurrenceSpec``: lanes_k, rows,
warps, small_grid_programs, small_grid_rows, small_grid_max_registers, ptx_widen_bf16, l2_hints)
replacing the cuda launch table's for fp32 states, through ``tuning.launch_table``. Used by
``benchmarks/ncu_run.sh``, which profiles the second launch. ``deferred``: ours with deferred
commits in the steady state (every row first replays its pending step, accepted counts spread
over ``1..T`` as in the verify suite's deferred rows).
"""
import argparse
import dataclasses

import torch

import common

H, K, V, N, T, HV = 16, 128, 128, 64, 4, 48


def fla_call(w):
    """FLA's fused recurrent GDN over window ``w``: raw gates, q/k l2-normalized in the kernel,
    the state read from ``w.state[:N]`` (V-major, as ours)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q4, k4 = w.q.view(w.N, w.T, *w.q.shape[1:]), w.k.view(w.N, w.T, *w.k.shape[1:])
    v4 = w.v.view(w.N, w.T, *w.v.shape[1:])
    a4, b4 = w.a.view(w.N, w.T, -1), w.b.view(w.N, w.T, -1)
    state = w.state[:w.N]

    def call():
        return fused_recurrent_gated_delta_rule(
            q4, k4, v4, g=a4, beta=b4, initial_state=state, output_final_state=False, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=w.A_log, dt_bias=w.dt_bias, use_beta_sigmoid_in_kernel=True,
            state_v_first=True)
    return call


def gluon_call(w, variant: str):
    """The Gluon experiment's recurrence in verify mode over window ``w`` (sm_90 and newer)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gluon"))
    import recurrence as gluon_recurrence
    from recoverssm.core.backend import GateInputs

    out = torch.empty_like(w.v)
    records = (w.records.correction, w.records.key, w.records.decay)

    def call():
        gluon_recurrence.launch("verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                                GateInputs(**w.gates()), w.q.shape[2] ** -0.5, True, -1, out, records, None,
                                variant=variant)
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("kind", choices=["ours", "deferred", "gluon", "fla"])
    ap.add_argument("fields", nargs="*", metavar="FIELD=VALUE",
                    help="RecurrenceSpec fields (ours); the variant name (gluon)")
    common.add_tiny_arg(ap)
    args = ap.parse_args()
    device = common.setup_device(args.tiny)

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import RecurrenceSpec
    from recoverssm.backends.triton.tuning import launch_table
    from recoverssm.bench.problems import DeferredLayer, spread_accepted, window

    n, t, h, hv, k, v = (2, 2, 2, 4, 16, 16) if args.tiny else (N, T, H, HV, K, V)
    w = window(n, t, h, hv, k, v, device=device)
    if args.kind == "fla":
        if args.fields:
            raise SystemExit("fla takes no fields")
        calls = [fla_call(w)] * 2
        table = LAUNCH_TABLE
    elif args.kind == "deferred":
        if args.fields:
            raise SystemExit("deferred takes no fields")
        layer = DeferredLayer(w, spread_accepted(n, t, device=device), h, k, v, backend="cuda").warm()
        calls = [layer.verify] * 2
        table = LAUNCH_TABLE
    elif args.kind == "gluon":
        calls = [gluon_call(w, args.fields[0] if args.fields else "rs8x8")] * 2
        table = LAUNCH_TABLE
    else:
        spec = dataclasses.replace(LAUNCH_TABLE.recurrence_for(torch.float32),
                                   **common.parse_fields(RecurrenceSpec, args.fields))
        table = common.table_with(LAUNCH_TABLE, "recurrence", torch.float32, spec)
        print("recurrence spec:", spec, flush=True)
        calls = [w.verify] * 2
    with launch_table("cuda", table):
        for call in calls:
            call()
            if device == "cuda":
                torch.cuda.synchronize()
    if args.tiny:
        print(f"{args.kind}: two launches at N={n}, T={t}, HV={hv} ran under the interpreter")


if __name__ == "__main__":
    main()
