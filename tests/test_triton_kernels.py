"""The shared Triton kernels (``cuda`` backend) against ``cpu_ref`` and against themselves.

Two settings run the same checks:

* ``interp``: Triton's CPU interpreter on CPU tensors, small shapes (runs in CI, no GPU);
* ``gpu``: compiled kernels on a CUDA GPU at real shapes (H=16, HV=32/48, K=V=128).

Cross-backend values (outputs, records, decode states) agree within fp32 tolerance. Everything
the contract calls exact is checked with ``torch.equal``: commit vs the same backend's native
per-token path (decode and snapshot), commit vs ``cpu_ref``'s commit of the same records (both
use a true fused multiply-add), conv states, grouped vs per-layer commits.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import recoverssm as rs  # noqa: E402
from gdn_problems import make_problem, rel_err  # noqa: E402

SETTINGS = [
    pytest.param(dict(device="cpu", H=2, HV=4, K=16, V=16, lens=[[3, 1, 4, 0, 2], [1, 2]], Ts=[1, 2, 4]),
                 marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=16, HV=48, K=128, V=128,
                      lens=[[4, 1, 3, 0, 2, 4, 4, 1], [2] * 8], Ts=[2, 4, 8]),
                 marks=pytest.mark.gpu, id="gpu"),
]
FP32_TOL = 2e-5


def dims(s):
    return dict(H=s["H"], HV=s["HV"], K=s["K"], V=s["V"], device=s["device"])


def verify(p, backend, records=None, **over):
    records = records or p.records()
    out = rs.gdn_verify(p.q, p.k, p.v, records=records, backend=backend, **p.kwargs(**over))
    return out, records


def commit(p, state, records, num_accepted, backend, **kw):
    ctx = rs.CommitContext([[rs.LayerCache(state, records)]], max_batch=records.max_batch, backend=backend)
    ctx.commit(num_accepted, p.state_indices, p.query_start_loc, **kw)


def to_cpu(p_state, records):
    return p_state.cpu(), rs.ReplayRecords(records.correction.cpu(), records.key.cpu(), records.decay.cpu())


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_form", ["raw", "precomputed"])
def test_verify_matches_reference(s, state_dtype, gate_form):
    lens = s["lens"][0]
    p = make_problem(lens, padding=(1,), state_dtype=state_dtype,
                     precomputed_gates=gate_form == "precomputed", **dims(s))
    state_before = p.state.clone()
    out, rec = verify(p, "cuda")
    assert torch.equal(p.state, state_before), "verify wrote the state"
    pc = make_problem(lens, padding=(1,), state_dtype=state_dtype,
                      precomputed_gates=gate_form == "precomputed", **{**dims(s), "device": "cpu"})
    ref_out, ref_rec = verify(pc, "cpu_ref")
    assert rel_err(out, ref_out) < FP32_TOL
    for name in ("correction", "key", "decay"):
        assert rel_err(getattr(rec, name), getattr(ref_rec, name)) < FP32_TOL, name
    start = p.query_start_loc.tolist()[1]
    assert torch.count_nonzero(out[start:start + lens[1]]) == 0, "padding row output not zero"


@pytest.mark.parametrize("s", SETTINGS)
def test_verify_options_match_reference(s):
    """No l2norm, a custom scale, a strided out view and bf16 activations."""
    lens = s["lens"][0]
    for act_dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, 1e-2)):
        p = make_problem(lens, act_dtype=act_dtype, **dims(s))
        pc = make_problem(lens, act_dtype=act_dtype, **{**dims(s), "device": "cpu"})
        for l2 in (True, False):
            big = torch.full((p.q.shape[0], p.HV, p.V + 8), float("nan"), dtype=act_dtype, device=p.q.device)
            out_view = big[:, :, 4:4 + p.V]
            verify(p, "cuda", use_qk_l2norm=l2, scale=0.3, out=out_view)
            ref, _ = verify(pc, "cpu_ref", use_qk_l2norm=l2, scale=0.3)
            assert rel_err(out_view, ref) < tol
            assert torch.isnan(big[:, :, :4]).all() and torch.isnan(big[:, :, 4 + p.V:]).all()


@pytest.mark.parametrize("s", SETTINGS)
def test_verify_is_batch_invariant(s):
    """A row's outputs and records do not depend on the rest of the batch: verify of the first two
    rows alone gives the bits they get inside the whole batch. On the GPU the whole batch (16 rows
    x 48 heads) runs the large tile and the two rows the small-grid one (fewer rows per thread)."""
    p = make_problem(s["lens"][0] * 2, padding=(1,), **dims(s))
    out_all, rec_all = verify(p, "cuda")
    n = int(p.query_start_loc[2])
    gates = {name: (t[:n] if t.dim() == 2 else t) for name, t in p.gates.items()}
    rec_two = rs.ReplayRecords.allocate(2, p.T, p.H, p.HV, p.K, p.V, device=p.q.device)
    out_two = rs.gdn_verify(p.q[:n], p.k[:n], p.v[:n], records=rec_two, state=p.state,
                            state_indices=p.state_indices[:2], query_start_loc=p.query_start_loc[:3],
                            backend="cuda", **gates)
    assert torch.equal(out_two, out_all[:n])
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec_two, name)[:2], getattr(rec_all, name)[:2]), name


def launch_every_mode(p, cfg, snapshot_slots=None):
    """Problem ``p`` through the recurrence launcher with ``cfg``: verify's outputs and records,
    the pool after native decode and, given ``snapshot_slots``, the pool after snapshot (else
    None)."""
    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs

    args = (p.q, p.k, p.v)
    tail = (GateInputs(**p.gates), p.K ** -0.5, True, -1)
    rec = p.records()
    out = torch.empty_like(p.v)
    launch.gdn_recurrent(cfg, "verify", *args, p.state, p.state_indices, p.query_start_loc, *tail, out,
                         (rec.correction, rec.key, rec.decay), None)
    native = p.state.clone()
    launch.gdn_recurrent(cfg, "decode", *args, native, p.state_indices, p.query_start_loc, *tail,
                         torch.empty_like(p.v), None, None)
    snapshots = None
    if snapshot_slots is not None:
        snapshots = p.state.clone()
        launch.gdn_recurrent(cfg, "snapshot", *args, snapshots, p.state_indices, p.query_start_loc, *tail,
                             torch.empty_like(p.v), None, snapshot_slots)
    return out, rec, native, snapshots


@pytest.mark.parametrize("s", [
    pytest.param(dict(device="cpu", H=1, HV=2, K=64, V=64), marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=4, HV=12, K=128, V=128), marks=pytest.mark.gpu, id="gpu"),
])
def test_rows_per_thread_do_not_change_the_bits(s):
    """The launcher picks fewer rows per thread for a small grid (``launch.recurrence_tile``), so
    verify of a large batch and native decode of a small one may run different tiles with the same
    lanes along K: records, outputs and decoded states are identical whatever the rows per thread,
    and a commit of records from one tile equals native decode under another."""
    from dataclasses import replace

    from recoverssm.backends.triton import launch

    device, K, V = s["device"], s["K"], s["V"]
    p = make_problem([3, 1, 4, 2], T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device=device,
                     num_slots=8, sources_below=6)
    results = []
    for rows in (8, 4, 2, 1):
        out, rec, native, _ = launch_every_mode(p, replace(launch.LaunchConfig(), gdn_rows=rows))
        results.append((rows, out, rec, native))
    _, out8, rec8, native8 = results[0]
    for rows, out, rec, native in results[1:]:
        assert torch.equal(out, out8), rows
        for name in ("correction", "key", "decay"):
            assert torch.equal(getattr(rec, name), getattr(rec8, name)), (rows, name)
        assert torch.equal(native, native8), rows
    committed = p.state.clone()
    commit(p, committed, rec8, torch.full((p.B,), 4, dtype=torch.int32, device=device), "cuda")
    assert torch.equal(committed, results[-1][3])


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["gdn_ptx_widen_bf16", "gdn_l2_hints"])
@pytest.mark.parametrize("rows", [8, 4])
def test_ptx_switches_do_not_change_the_bits(switch, rows):
    """Two launch-table switches act in PTX only, so this is a GPU-only test (the interpreter
    never takes those paths): ``gdn_ptx_widen_bf16`` widens bf16 token inputs with bit operations
    instead of the compiler's cast; ``gdn_l2_hints`` adds cache eviction policies to the
    recurrence's loads (another binary). Verify's outputs and records, native decode's state and
    every snapshot are identical either way, with token inputs that include signed zeros, bf16
    subnormals and large values (1e30: larger ones overflow the state to NaN, which torch.equal
    cannot compare)."""
    from dataclasses import replace

    from recoverssm.backends.triton import launch

    K = V = 128
    p = make_problem([3, 1, 4, 2], T=4, padding=(1,), H=4, HV=12, K=K, V=V, device="cuda",
                     act_dtype=torch.bfloat16, num_slots=8 + 10 * 4, sources_below=8)
    tiny = torch.finfo(torch.bfloat16).tiny
    special = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 2, tiny, 1.0, -1.0e30, 1.0e30],
                           dtype=torch.bfloat16, device="cuda")
    p.v[:, :, :8] = special        # v enters the correction linearly: every value must widen exactly
    p.k[:, :, 1:9] = special[:4].repeat(2)
    p.q[:, :, 5:13] = special[:4].repeat(2)
    snapshot_slots = torch.arange(p.B * p.T, dtype=torch.int32, device="cuda").view(p.B, p.T) + 8
    (out0, rec0, native0, snap0), (out1, rec1, native1, snap1) = (
        launch_every_mode(p, replace(launch.LaunchConfig(), gdn_rows=rows, **{switch: on}), snapshot_slots)
        for on in (False, True))
    assert torch.equal(out0, out1)
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec0, name), getattr(rec1, name)), name
    assert torch.equal(native0, native1)
    assert torch.equal(snap0, snap1)


@pytest.mark.parametrize("s", SETTINGS)
def test_state_with_padded_rows(s):
    """A state pool whose V rows are padded (row stride > K; the kernel specializes on the row
    stride): verify and decode give the same bits as on a packed copy of the state, and nothing
    is read from or written to the padding."""
    p = make_problem(s["lens"][0], padding=(1,), **dims(s))
    slots, HV, V, K = p.state.shape
    big = torch.full((slots, HV, V, K + 4), float("nan"), device=p.state.device)
    padded = big[..., :K]
    padded.copy_(p.state)
    out_packed, rec_packed = verify(p, "cuda")
    out_padded, rec_padded = verify(p, "cuda", state=padded)
    assert torch.equal(out_padded, out_packed)
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec_padded, name), getattr(rec_packed, name)), name
    rs.gdn_decode(p.q, p.k, p.v, backend="cuda", **p.kwargs())
    rs.gdn_decode(p.q, p.k, p.v, backend="cuda", **p.kwargs(state=padded))
    assert torch.equal(padded, p.state)
    assert torch.isnan(big[..., K:]).all(), "decode wrote into the row padding"


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_is_bit_identical_to_native(s, state_dtype):
    """Every n: commit(verify records) == decode of the first n tokens == snapshot slot n-1."""
    for T in s["Ts"]:
        for extreme in (False, True):
            lens = [min(l, T) for l in s["lens"][0]]
            p = make_problem(lens, T=T, padding=(1,), state_dtype=state_dtype, extreme=extreme,
                             num_slots=(T + 2) * len(lens) + 2, sources_below=len(lens) + 2, **dims(s))
            _, rec = verify(p, "cuda")
            B = p.B
            snap = torch.arange(B * T, dtype=torch.int32, device=p.q.device).view(B, T) + B + 2
            snap_state = p.state.clone()
            rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, backend="cuda", snapshot_slots=snap,
                                        **p.kwargs(state=snap_state))
            for n in range(0, T + 2):
                committed = p.state.clone()
                commit(p, committed, rec, torch.full((B,), n, dtype=torch.int32, device=p.q.device), "cuda")
                native = p.state.clone()
                q, k, v, gates, qsl = p.first_tokens(n)
                rs.gdn_decode(q, k, v, state=native, state_indices=p.state_indices, query_start_loc=qsl,
                              backend="cuda", **gates)
                assert torch.equal(committed, native), (T, n, extreme)
                for r, slot in enumerate(p.state_indices.tolist()):
                    m = min(n, lens[r])
                    if slot >= 0 and m > 0:
                        assert torch.equal(committed[slot], snap_state[snap[r, m - 1]]), (T, n, r)


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_equals_reference_commit_bitwise(s, state_dtype):
    """The same records committed by cpu_ref and by the kernel give the same bits (true fma both)."""
    lens = s["lens"][0]
    T = max(lens)
    p = make_problem(lens, T=T, padding=(1,), state_dtype=state_dtype, **dims(s))
    _, rec = verify(p, "cuda")
    accepted = torch.tensor([(3 * r + 1) % (T + 1) for r in range(p.B)], dtype=torch.int32)
    gpu_state = p.state.clone()
    commit(p, gpu_state, rec, accepted.to(p.q.device), "cuda")
    cpu_state, cpu_rec = to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(cpu_state, cpu_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    ctx.commit(accepted, p.state_indices.cpu(), p.query_start_loc.cpu())
    assert torch.equal(gpu_state.cpu(), cpu_state)


def align_case(device, num_slots):
    """Five requests, block size 4: inside a block; crossing a boundary; starting and ending exactly
    on boundaries (the final block holds the boundary state, so no separate boundary write); a
    boundary block that is the source slot itself; a null final block (writes nothing)."""
    bs = 4
    block_table = torch.tensor([[1, 2, 3, -1], [4, 5, 6, -1], [7, 8, 9, -1], [10, 11, 12, -1],
                                [13, -1, -1, -1]], dtype=torch.int32)
    num_computed = torch.tensor([1, 2, 4, 6, 3], dtype=torch.int32)
    accepted = torch.tensor([2, 4, 4, 3, 2], dtype=torch.int32)
    sources = [1, 4, 14, 11, 13]      # row 3: source is block 11, also its boundary block
    return dict(block_table=block_table.to(device), num_computed_tokens=num_computed.to(device),
                block_size=bs), accepted.to(device), sources


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_align_commit_matches_reference(s, state_dtype):
    lens = [4, 4, 4, 4, 4]
    p = make_problem(lens, T=4, state_dtype=state_dtype, num_slots=16, **dims(s))
    align, accepted, sources = align_case(p.q.device, 16)
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=p.q.device)
    _, rec = verify(p, "cuda")
    plan = rs.plan_commit(accepted, p.state_indices, p.query_start_loc, backend="cuda", **align)
    ref_plan = rs.plan_commit(accepted.cpu(), p.state_indices.cpu(), p.query_start_loc.cpu(),
                              backend="cpu_ref", **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in align.items()})
    assert plan.as_dict() == ref_plan.as_dict()
    assert ref_plan.as_dict() == {"commit_len": [2, 4, 4, 3, 0], "final_slot": [1, 5, 8, 12, -1],
                                  "boundary_slot": [-1, 4, -1, 11, -1], "boundary_len": [0, 2, 0, 2, 0]}
    gpu_state = p.state.clone()
    commit(p, gpu_state, rec, accepted, "cuda", **align)
    cpu_state, cpu_rec = to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(cpu_state, cpu_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    ctx.commit(accepted.cpu(), p.state_indices.cpu(), p.query_start_loc.cpu(),
               **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in align.items()})
    assert torch.equal(gpu_state.cpu(), cpu_state)
    untouched = [i for i in range(16) if i not in (1, 5, 8, 12, 4, 11)]
    assert torch.equal(gpu_state[untouched], p.state[untouched])


def conv_problem(device, lens, dim=24, width=4, T=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    num_slots = 2 * len(lens) + 2
    conv_state = torch.randn(num_slots, dim, width - 1 + T, generator=g).to(dtype)
    x = torch.randn(total, dim + 5, generator=g).to(dtype)[:, 2:2 + dim]
    weight = torch.randn(dim, width, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g).to(dtype)
    slots = torch.tensor([2 * r + 1 if r != 1 else -1 for r in range(len(lens))], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return [t.to(device) for t in (x, conv_state, weight, bias, slots, qsl)]


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_verify_matches_reference(s, activation):
    lens = [min(l, 4) for l in s["lens"][0]]
    dim = 24 if s["device"] == "cpu" else 2 * s["H"] * s["K"] + s["HV"] * s["V"]
    x, cs, w, bias, slots, qsl = conv_problem(s["device"], lens, dim=dim)
    cs_gpu = cs.clone()
    y = rs.conv_verify(x, cs_gpu, w, bias, state_indices=slots, query_start_loc=qsl,
                       activation=activation, backend="cuda")
    xc, csc, wc, bc, sc, qc = (t.cpu() for t in (x, cs, w, bias, slots, qsl))
    y_ref = rs.conv_verify(xc, csc, wc, bc, state_indices=sc, query_start_loc=qc,
                           activation=activation, backend="cpu_ref")
    assert rel_err(y, y_ref) < FP32_TOL
    assert torch.equal(cs_gpu.cpu(), csc)


@pytest.mark.parametrize("s", SETTINGS)
def test_grouped_commit_equals_per_layer(s):
    """3 groups with 1, 2 and 3 layers, per-group slots and block tables, conv states, one launch."""
    device = s["device"]
    lens = [4, 4, 4, 4, 4]
    layers, group_args = [], []
    align, accepted, sources = align_case(device, 16)
    for gi, count in enumerate((1, 2, 3)):
        group = []
        for li in range(count):
            p = make_problem(lens, T=4, num_slots=16, seed=10 * gi + li, **dims(s))
            p.state_indices = torch.tensor(sources, dtype=torch.int32, device=device)
            _, rec = verify(p, "cuda")
            conv_state = torch.randn(16, 12, 3 + 4, device=device)
            group.append((p, rec, conv_state))
        layers.append(group)
        if gi == 1:   # group 1 runs without align mode
            group_args.append(dict(state_indices=p.state_indices, block_table=None,
                                   num_computed_tokens=None, block_size=None))
        else:
            group_args.append(dict(state_indices=p.state_indices, **align))
    qsl = layers[0][0][0].query_start_loc
    before = [[(p.state.clone(), cs.clone()) for p, _, cs in g] for g in layers]
    ctx = rs.CommitContext([[rs.LayerCache(p.state, rec, cs) for p, rec, cs in g] for g in layers],
                           max_batch=5, backend="cuda")
    ctx.commit(accepted, [a["state_indices"] for a in group_args], qsl,
               block_table=[a["block_table"] for a in group_args],
               num_computed_tokens=[a["num_computed_tokens"] for a in group_args],
               block_size=[a["block_size"] for a in group_args])
    for gi, g in enumerate(layers):
        for li, (p, rec, cs) in enumerate(g):
            st, cst = before[gi][li]
            single = rs.CommitContext([[rs.LayerCache(st, rec, cst)]], max_batch=5, backend="cuda")
            args = group_args[gi]
            single.commit(accepted, args["state_indices"], qsl, block_table=args["block_table"],
                          num_computed_tokens=args["num_computed_tokens"], block_size=args["block_size"])
            assert torch.equal(st, p.state), (gi, li)
            assert torch.equal(cst, cs), (gi, li)


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiles_per_program_do_not_change_the_bits(s, state_dtype):
    """A commit program may replay several state tiles in turn (sharing the row's plan), may
    hint records and next tiles into L2 (compiled kernels only), and may load the replay records
    of two window positions at a time: 1, 2 and 3 tiles per program (3 leaves the last program
    short), with and without the hints, records one ahead or two at a time, give the same
    states and conv states, align mode with boundary writes included (request 0 accepts 4 here:
    3 tokens into its boundary state, then 1, so replays of odd and even lengths start at odd
    and even positions)."""
    from recoverssm.backends.triton.launch import LaunchConfig

    device = s["device"]
    align, accepted, sources = align_case(device, 16)
    accepted = accepted.clone()
    accepted[0] = 4
    p = make_problem([4] * 5, T=4, num_slots=16, seed=21, state_dtype=state_dtype, **dims(s))
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=device)
    _, rec = verify(p, "cuda")
    conv_state = torch.randn(16, 12, 3 + 4, device=device)
    results = []
    for tiles, prefetch, pairs in ((1, False, False), (2, False, False), (3, False, False), (1, True, False),
                                   (3, True, False), (1, False, True), (2, True, True), (3, False, True)):
        state, conv = p.state.clone(), conv_state.clone()
        ctx = rs.CommitContext([[rs.LayerCache(state, rec, conv)]], max_batch=5, backend="cuda")
        ctx._committer.set_config(LaunchConfig(commit_block_v=16, commit_tiles_per_program=tiles,
                                               commit_prefetch_records=prefetch,
                                               commit_prefetch_next_tile=prefetch,
                                               commit_replay_pairs=pairs))
        ctx.commit(accepted, p.state_indices, p.query_start_loc, **align)
        results.append((state, conv))
    for state, conv in results[1:]:
        assert torch.equal(state, results[0][0]) and torch.equal(conv, results[0][1])
    assert not torch.equal(results[0][0], p.state), "the commit wrote nothing"


@pytest.mark.parametrize("s", SETTINGS)
def test_steps_with_persistent_index_buffers(s):
    """An engine's loop: the same index tensors every step, their values rewritten in place (as
    under CUDA graphs). From the second such step on, the commit repeats a launch bound to those
    tensors (GPU only; the interpreter has no direct launch path): every step must still read the
    new values, on whatever stream is current, and give cpu_ref's bits."""
    device = s["device"]
    lens = [4, 4, 3, 4, 2, 4]
    p = make_problem(lens, T=4, num_slots=16, seed=5, **dims(s))
    _, rec = verify(p, "cuda")
    state, (ref_state, ref_rec) = p.state.clone(), to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(state, rec)]], max_batch=rec.max_batch, backend="cuda")
    ref = rs.CommitContext([[rs.LayerCache(ref_state, ref_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    accepted, slots = torch.zeros_like(p.state_indices), p.state_indices.clone()
    qsl = p.query_start_loc
    for step in range(6):
        accepted.copy_(torch.tensor([(step + 2 * r) % 5 for r in range(p.B)], dtype=torch.int32))
        slots.copy_(p.state_indices.roll(step))    # distinct slots, a different row each step
        side = torch.cuda.Stream() if device == "cuda" and step % 2 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ctx.commit(accepted, slots, qsl)
            torch.cuda.current_stream().wait_stream(side)
        else:
            ctx.commit(accepted, slots, qsl)
        ref.commit(accepted.cpu(), slots.cpu(), qsl.cpu())
        assert torch.equal(state.cpu(), ref_state), step
    if device == "cuda":
        assert ctx._committer._repeat is not None, "the repeated launch was never bound"


@pytest.mark.parametrize("s", SETTINGS)
def test_conv_compaction_matches_reference(s):
    device = s["device"]
    lens = [4, 4, 4, 4, 4]
    align, accepted, sources = align_case(device, 16)
    p = make_problem(lens, T=4, num_slots=16, **dims(s))
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=device)
    _, rec = verify(p, "cuda")
    conv_state = torch.randn(16, 20, 3 + 4, device=device).to(torch.bfloat16)
    for kw in (align, {}):
        gpu_conv = conv_state.clone()
        ctx = rs.CommitContext([[rs.LayerCache(p.state.clone(), rec, gpu_conv)]], max_batch=5, backend="cuda")
        ctx.commit(accepted, p.state_indices, p.query_start_loc, **kw)
        cpu_conv = conv_state.cpu().clone()
        state_cpu, rec_cpu = to_cpu(p.state.clone(), rec)
        ref = rs.CommitContext([[rs.LayerCache(state_cpu, rec_cpu, cpu_conv)]], max_batch=5, backend="cpu_ref")
        ref.commit(accepted.cpu(), p.state_indices.cpu(), p.query_start_loc.cpu(),
                   **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
        assert torch.equal(gpu_conv.cpu(), cpu_conv)


def backend_plan(name, device, accepted, src, qsl, req, kw, num_slots):
    """The kernel-facing plan op, below validation, so that any values can be fed to it."""
    be = rs.get_backend(name, device)
    out = tuple(torch.empty(src.shape[0], dtype=torch.int32, device=device) for _ in range(4))
    to = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
    be.plan_commit(to(accepted), to(src), to(qsl), to(req), to(kw.get("block_table")),
                   to(kw.get("num_computed_tokens")), kw.get("block_size", 1), -1, num_slots, out)
    return [t.tolist() for t in out]


@pytest.mark.parametrize("s", SETTINGS)
def test_plan_commit_random_matches_reference(s):
    """Random plans, including values validation would refuse (slots past the pool, null and
    negative blocks, windows past the block table): the in-kernel plan follows cpu_ref's rules."""
    device = s["device"]
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        B, R, width, bs = 6, 8, 5, 1 + trial % 4
        lens = torch.randint(0, 5, (B,), generator=g)
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        req = torch.randperm(R, generator=g)[:B].to(torch.int32)
        accepted = torch.randint(-1, 6, (R,), generator=g, dtype=torch.int32)
        bt = torch.randint(-1, 40, (R, width), generator=g, dtype=torch.int32)
        nct = torch.randint(0, bs * width + 2, (R,), generator=g, dtype=torch.int32)
        src = torch.randint(-1, 40, (B,), generator=g, dtype=torch.int32)
        for kw in (dict(block_table=bt, num_computed_tokens=nct, block_size=bs), {}):
            for r in (req, None):
                ref = backend_plan("cpu_ref", "cpu", accepted, src, qsl, r, kw, 32)
                got = backend_plan("cuda", device, accepted, src, qsl, r, kw, 32)
                assert got == ref, (trial, list(kw), r is None)


@pytest.mark.parametrize("s", SETTINGS)
def test_kernels_ignore_out_of_range_indices(s):
    """Called below validation, bad slots and lengths read and write nothing out of bounds:
    such rows are treated as padding (zero output) and the state pool is untouched."""
    from recoverssm.core.backend import GateInputs

    p = make_problem([3, 2, 2], T=3, **dims(s))
    backend = rs.get_backend("cuda", p.q.device)
    bad_slots = torch.tensor([p.state.shape[0] + 5, -7, 2**30], dtype=torch.int32, device=p.q.device)
    rec = p.records()
    rec_before = rec.correction.clone()
    out = torch.full_like(p.v, 7.0)
    state_before = p.state.clone()
    for mode in ("verify", "decode"):
        backend.gdn_recurrent(mode, p.q, p.k, p.v, p.state, bad_slots, p.query_start_loc,
                              GateInputs(**p.gates), 0.25, True, -1, out,
                              (rec.correction, rec.key, rec.decay), None)
        assert torch.count_nonzero(out) == 0
        assert torch.equal(p.state, state_before)
        assert torch.equal(rec.correction, rec_before)
    # A commit whose rows claim more accepted tokens than the window, and slots out of range.
    ctx = rs.CommitContext([[rs.LayerCache(p.state, rec)]], max_batch=3, backend="cuda")
    from recoverssm.core.backend import GroupStep

    ctx._committer.commit(torch.tensor([99, 99, 99], dtype=torch.int32, device=p.q.device),
                          p.query_start_loc, [GroupStep(bad_slots, None, None, None, 1)])
    assert torch.equal(p.state, state_before)


@pytest.mark.gpu
def test_repeated_runs_identical_bits():
    """20 runs of verify + commit on the GPU give identical outputs, records and states."""
    p = make_problem([4] * 32, H=16, HV=48, K=128, V=128, device="cuda", num_slots=80)
    results = []
    for _ in range(20):
        out, rec = verify(p, "cuda")
        st = p.state.clone()
        commit(p, st, rec, torch.full((32,), 3, dtype=torch.int32, device="cuda"), "cuda")
        results.append((out, rec.correction.clone(), rec.key.clone(), rec.decay.clone(), st))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("HV", [32, 48])
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_large_batch_commit_vs_snapshot(HV, T, state_dtype):
    """B = 64 ragged rows at real shapes: commit == snapshot for every n, torch.equal."""
    g = torch.Generator().manual_seed(T * HV)
    lens = torch.randint(1, T + 1, (64,), generator=g).tolist()
    p = make_problem(lens, T=T, H=16, HV=HV, K=128, V=128, padding=(5, 17), state_dtype=state_dtype,
                     device="cuda", num_slots=64 * (T + 1) + 2, sources_below=66)
    _, rec = verify(p, "cuda")
    B = p.B
    snap = torch.arange(B * T, dtype=torch.int32, device="cuda").view(B, T) + B + 2
    snap_state = p.state.clone()
    rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, backend="cuda", snapshot_slots=snap, **p.kwargs(state=snap_state))
    for n in range(1, T + 1):
        committed = p.state.clone()
        commit(p, committed, rec, torch.full((B,), n, dtype=torch.int32, device="cuda"), "cuda")
        for r, slot in enumerate(p.state_indices.tolist()):
            m = min(n, lens[r])
            if slot >= 0:
                assert torch.equal(committed[slot], snap_state[snap[r, m - 1]]), (n, r)


@pytest.mark.parametrize("s", [
    pytest.param(dict(device="cpu", H=2, HV=4, Ks=[16, 32]), marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=4, HV=8, Ks=[32, 64, 128]), marks=pytest.mark.gpu, id="gpu"),
])
def test_commit_matches_decode_whatever_the_input_alignment(s):
    """Verify reads q/k/v through views that are not 16-byte aligned (an odd column offset into a
    fused projection); the native path gets packed copies. The launcher packs misaligned inputs, so
    both run the same binary and commit == decode bit for bit (this differed at K = 32 and 64 before
    the kernel stopped specializing on token-input alignment)."""
    device, H, HV = s["device"], s["H"], s["HV"]
    for K in s["Ks"]:
        V, T, lens = K, 4, [4, 3, 4, 2]
        total = sum(lens)
        g = torch.Generator().manual_seed(K)
        fused = torch.randn(total, 1 + 2 * H * K + HV * V, generator=g).to(device)
        q = fused[:, 1:1 + H * K].view(total, H, K)
        k = fused[:, 1 + H * K:1 + 2 * H * K].view(total, H, K)
        v = fused[:, 1 + 2 * H * K:].view(total, HV, V)
        assert q.data_ptr() % 16 != 0
        gates = dict(a=torch.randn(total, HV, generator=g).to(device), b=torch.randn(total, HV, generator=g).to(device),
                     A_log=torch.randn(HV, generator=g).to(device), dt_bias=torch.randn(HV, generator=g).to(device))
        state = torch.randn(len(lens) + 2, HV, V, K, generator=g).to(device)
        slots = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=device)
        qsl = torch.tensor([0, 4, 7, 11, 13], dtype=torch.int32, device=device)
        rec = rs.ReplayRecords.allocate(len(lens), T, H, HV, K, V, device=device)
        rs.gdn_verify(q, k, v, state=state, state_indices=slots, query_start_loc=qsl, records=rec,
                      backend="cuda", **gates)
        committed = state.clone()
        ctx = rs.CommitContext([[rs.LayerCache(committed, rec)]], max_batch=len(lens), backend="cuda")
        ctx.commit(torch.full((len(lens),), T, dtype=torch.int32, device=device), slots, qsl)
        native = state.clone()
        rs.gdn_decode(q.contiguous(), k.contiguous(), v.contiguous(), state=native, state_indices=slots,
                      query_start_loc=qsl, backend="cuda", **gates)
        assert torch.equal(committed, native), K


# lanes_k=32 runs as 16 (launch.MAX_LANES_K): the entry checks that the clamp keeps the bits right
TILE_CONFIGS = [dict(gdn_lanes_k=4, gdn_rows=1), dict(gdn_lanes_k=8, gdn_rows=2),
                dict(gdn_lanes_k=16, gdn_rows=4), dict(gdn_lanes_k=32, gdn_rows=8), dict(gdn_lanes_k=8, gdn_rows=8),
                dict(gdn_lanes_k=8, gdn_rows=1, gdn_warps=2)]


@pytest.mark.parametrize("s", [
    pytest.param(dict(device="cpu", H=1, HV=2, shapes=[(64, 64), (48, 40), (8, 12)]),
                 marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=4, HV=12, shapes=[(128, 128), (64, 64), (48, 40), (8, 12)]),
                 marks=pytest.mark.gpu, id="gpu"),
])
@pytest.mark.parametrize("tile", TILE_CONFIGS, ids=lambda c: "-".join(f"{k[4:]}{v}" for k, v in c.items()))
def test_every_recurrence_tile(s, tile):
    """Each tile configuration (lanes along K, rows per thread, warps) on shapes
    that use several K chunks, a padded K and a partial last V block: verify agrees with cpu_ref,
    and commit == native decode bit for bit under that configuration."""
    from dataclasses import replace

    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs

    device = s["device"]
    cfg = replace(launch.LaunchConfig(), **tile)
    for K, V in s["shapes"]:
        lens = [3, 1, 4, 2]
        p = make_problem(lens, T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device=device,
                         num_slots=8, sources_below=6)
        pc = make_problem(lens, T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device="cpu",
                          num_slots=8, sources_below=6)
        gates = GateInputs(**p.gates)
        rec = p.records()
        out = torch.empty_like(p.v)
        launch.gdn_recurrent(cfg, "verify", p.q, p.k, p.v, p.state, p.state_indices, p.query_start_loc,
                             gates, K ** -0.5, True, -1, out, (rec.correction, rec.key, rec.decay), None)
        ref_out, ref_rec = verify(pc, "cpu_ref")
        assert rel_err(out, ref_out) < FP32_TOL, (K, V)
        for name in ("correction", "key", "decay"):
            assert rel_err(getattr(rec, name), getattr(ref_rec, name)) < FP32_TOL, (K, V, name)
        committed = p.state.clone()
        commit(p, committed, rec, torch.full((p.B,), 4, dtype=torch.int32, device=device), "cuda")
        native = p.state.clone()
        launch.gdn_recurrent(cfg, "decode", p.q.contiguous(), p.k.contiguous(), p.v.contiguous(), native,
                             p.state_indices, p.query_start_loc, gates, K ** -0.5, True, -1,
                             torch.empty_like(p.v), None, None)
        assert torch.equal(committed, native), (K, V)
