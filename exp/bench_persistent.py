"""Experiment driver (H200): persistent recurrence kernel vs the library's verify."""
import json, os, sys
from dataclasses import replace
from functools import partial
import torch, triton
sys.path.insert(0, ".")
from exp.persistent_gdn import persistent_kernel
from recoverssm.backends.cuda.plugin import CudaBackend
from recoverssm.backends.triton import launch
from recoverssm.backends.triton.launch import recurrence_tile, MODES
from recoverssm.bench.problems import window
from recoverssm.bench.timing import CopyCeiling, copies_for, median_us
from recoverssm.core.backend import GateInputs

H, K, V = 16, 128, 128
base = CudaBackend.launch_table[None]
SM = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def lib_verify(w, out):
    launch.gdn_recurrent(base, "verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                         GateInputs(**w.gates()), K ** -0.5, True, -1, out,
                         (w.records.correction, w.records.key, w.records.decay), None)


def persistent_verify(w, out, rows, cap, stages, per_sm):
    cfg = replace(base, gdn_rows=rows, gdn_small_grid_programs=0)
    tile = recurrence_tile(cfg, K, V)
    g = GateInputs(**w.gates())
    q, k, v, state = w.q, w.k, w.v, w.state
    corr, key, decay = w.records.correction, w.records.key, w.records.decay
    B = w.state_indices.shape[0]
    HV = v.shape[1]
    n_tiles = triton.cdiv(V, tile.block_v) * HV * B
    grid = (min(n_tiles, SM * per_sm),)
    opts = cfg.options(1, max_registers=cap)
    persistent_kernel[grid](
        q, k, v, g.a, g.b, g.A_log, g.dt_bias, out, state, w.state_indices, w.query_start_loc,
        corr, key, decay, w.state_indices,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.a.stride(0), g.b.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), 0,
        q.shape[0], state.shape[0], -1, corr.shape[2], K ** -0.5, MODES["verify"], n_tiles,
        H=H, HV=HV, K=K, V=V, STRIDE_S_V=state.stride(2), K_PAD=tile.k_pad, K_INNER=tile.k_inner,
        ROWS=tile.rows, ROW_LANES=tile.row_lanes, GATES_PRECOMPUTED=False, USE_L2NORM=True, ALIGNED=True,
        TILE_STAGES=stages, **opts)


def main():
    ceiling = CopyCeiling("cuda")
    shapes = [(64, 4, 48), (64, 8, 48), (256, 4, 48), (64, 2, 48), (8, 4, 48)]
    variants = [("lib", None)]
    for rows, cap in ((8, None), (4, 168)):
        for stages in (1, 2):
            for per_sm in ((6, 8) if rows == 8 else (8, 12)):
                variants.append((f"p r{rows} s{stages} x{per_sm}", (rows, cap, stages, per_sm)))
    results = []
    # bit check on one window
    w = window(8, 4, H, 48, K, V, seed=5)
    o1 = torch.empty_like(w.v); lib_verify(w, o1)
    rec1 = [t.clone() for t in (w.records.correction, w.records.key, w.records.decay)]
    for name, p in variants[1:]:
        o2 = torch.empty_like(w.v)
        for t in (w.records.correction, w.records.key, w.records.decay):
            t.zero_()
        persistent_verify(w, o2, *p)
        torch.cuda.synchronize()
        same = torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(rec1, (w.records.correction, w.records.key, w.records.decay)))
        print(name, "bit-identical to library verify:", same, flush=True)
    for N, T, HV in shapes:
        ws = [window(N, T, H, HV, K, V, seed=i) for i in range(copies_for(N * HV * V * K * 4))]
        outs = [torch.empty_like(x.v) for x in ws]
        sb = N * HV * V * K * 4
        for name, p in variants:
            if p is None:
                calls = [partial(lib_verify, x, o) for x, o in zip(ws, outs)]
            else:
                calls = [partial(persistent_verify, x, o, *p) for x, o in zip(ws, outs)]
            try:
                us = median_us(calls, warmup=3, iters=20)
                row = dict(case=f"N{N}T{T}HV{HV}", variant=name, us=round(us, 1), vs_copy=round(ceiling.us(sb) / us, 3))
            except Exception as exc:  # noqa: BLE001
                row = dict(case=f"N{N}T{T}HV{HV}", variant=name, error=str(exc)[:200])
            print(row, flush=True)
            results.append(row)
    if os.environ.get("OUT"):
        json.dump(results, open(os.path.join(os.environ["OUT"], "persistent.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
