"""One grouped commit launch after a warm-up one, for ncu, with a commit spec.

    python benchmarks/ncu_commit.py fp32|bf16|kda [FIELD=VALUE ...]   # e.g. bf16 block_v=32 tiles_per_program=1
    python benchmarks/ncu_commit.py --tiny bf16 replay_pairs=0     # CPU tensors, Triton's interpreter, tiny shape

fp32: 12 layers x 8 requests; bf16: 3 groups x 6 layers x 64 requests; both H=16, HV=48,
K=V=128, T=4, the benchmark's align-mode mix (``recoverssm/bench/problems.py::align_step``).
kda: the KDA benchmark's step commit (``recoverssm/bench/kda.py``): one layer of vector-decay
records, fp32 state, N=64, T=8, HV=32 (tiny: N=2, T=4, HV=2), row r accepting ``1 + 7r mod T``. The
fields (``config.CommitSpec``: block_v, warps, max_registers, tiles_per_program, prefetch_records,
prefetch_next_tile, replay_pairs) replace the cuda launch table's for that state dtype, through
``tuning.launch_table``; the ``CommitContext`` is built inside it. Used by
``benchmarks/ncu_run.sh``, which profiles the second launch.
"""
import argparse
import dataclasses

import torch

import common


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("dtype", choices=[*common.DTYPES, "kda"], help="the state dtype (and with it the case), or kda")
    ap.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="CommitSpec fields")
    common.add_tiny_arg(ap)
    args = ap.parse_args()
    device = common.setup_device(args.tiny)

    import recoverssm as rs
    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import CommitSpec
    from recoverssm.backends.triton.tuning import launch_table
    from recoverssm.bench.problems import align_step, commit_context

    if args.dtype == "kda":
        return kda_commits(device, args.tiny, common.parse_fields(CommitSpec, args.fields))
    dtype = common.DTYPES[args.dtype]
    groups, layers, requests = (1, 12, 8) if dtype == torch.float32 else (3, 6, 64)
    h, hv, k, v = 16, 48, 128, 128
    if args.tiny:
        groups, layers, requests, h, hv, k, v = min(groups, 2), 2, 3, 2, 4, 16, 16
    spec = dataclasses.replace(LAUNCH_TABLE.commit_for(dtype), **common.parse_fields(CommitSpec, args.fields))
    print("commit spec:", spec, flush=True)
    step = align_step(requests, 4, device=device)
    _, caches = commit_context(groups, layers, requests, 4, h, hv, k, v, step.num_slots, dtype, device=device)
    with launch_table("cuda", common.table_with(LAUNCH_TABLE, "commit", dtype, spec)):
        ctx = rs.CommitContext(caches, max_batch=requests, backend="cuda")
    for _ in range(2):
        ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, block_table=step.block_table,
                   num_computed_tokens=step.num_computed_tokens, block_size=step.block_size)
        if device == "cuda":
            torch.cuda.synchronize()
    if args.tiny:
        print(f"{args.dtype}: two commits of {groups} x {layers} layers x {requests} requests, interpreted")


def kda_commits(device: str, tiny: bool, fields: dict) -> None:
    """Two commits of the KDA benchmark's step (fp32 state) after its verify."""
    import recoverssm as rs
    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.tuning import launch_table
    from recoverssm.bench.kda import kda_window
    from recoverssm.bench.problems import spread_accepted

    N, T, HV = (2, 4, 2) if tiny else (64, 8, 32)
    spec = dataclasses.replace(LAUNCH_TABLE.commit_for(torch.float32), **fields)
    print("commit spec:", spec, flush=True)
    w = kda_window(N, T, HV, device=device)
    w.verify()
    accepted = spread_accepted(N, T, device)
    with launch_table("cuda", common.table_with(LAUNCH_TABLE, "commit", torch.float32, spec)):
        ctx = rs.CommitContext([[rs.LayerCache(w.state, w.records)]], max_batch=N, backend="cuda")
    for _ in range(2):
        ctx.commit(accepted, w.state_indices, w.query_start_loc)
        if device == "cuda":
            torch.cuda.synchronize()
    if tiny:
        print(f"kda: two commits of N={N}, T={T}, HV={HV}, interpreted")


if __name__ == "__main__":
    main()
