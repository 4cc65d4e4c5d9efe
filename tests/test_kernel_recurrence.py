"""The recurrence kernel (``gdn_verify``, ``gdn_decode``, ``gdn_spec_decode_snapshot`` of the
``cuda`` backend) against ``cpu_ref`` and against itself, in the interpreter and on a GPU
(:mod:`kernel_settings`).

Cross-backend values (outputs, records) agree within fp32 tolerance; whatever must not depend on
the launch (tile shape, rows per thread, PTX switches, state row padding, batch composition)
gives the same bits, checked with ``torch.equal``.
"""
import pytest
import torch

import recoverssm as rs
from helpers import make_batch_problem, rel_err
from kernel_settings import FP32_TOL, SETTINGS, accepted_tensor, commit, dims, recurrence_table, verify


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_form", ["raw", "precomputed"])
def test_verify_matches_reference(s, state_dtype, gate_form):
    lens = s["lens"][0]
    p = make_batch_problem(lens, padding=(1,), state_dtype=state_dtype,
                           precomputed_gates=gate_form == "precomputed", **dims(s))
    state_before = p.state.clone()
    out, rec = verify(p, "cuda")
    assert torch.equal(p.state, state_before), "verify wrote the state"
    pc = make_batch_problem(lens, padding=(1,), state_dtype=state_dtype,
                            precomputed_gates=gate_form == "precomputed", **{**dims(s), "device": "cpu"})
    ref_out, ref_rec = verify(pc, "cpu_ref")
    assert rel_err(out, ref_out) < FP32_TOL
    for name in ("correction", "key", "decay"):
        assert rel_err(getattr(rec, name), getattr(ref_rec, name)) < FP32_TOL, name
    start = p.qsl.tolist()[1]
    assert torch.count_nonzero(out[start:start + lens[1]]) == 0, "padding row output not zero"



@pytest.mark.parametrize("s", SETTINGS)
def test_verify_options_match_reference(s):
    """No l2norm, a custom scale, a strided out view and bf16 activations."""
    lens = s["lens"][0]
    for act_dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, 1e-2)):
        p = make_batch_problem(lens, act_dtype=act_dtype, **dims(s))
        pc = make_batch_problem(lens, act_dtype=act_dtype, **{**dims(s), "device": "cpu"})
        for l2 in (True, False):
            big = torch.full((p.q.shape[0], p.dims.HV, p.dims.V + 8), float("nan"), dtype=act_dtype,
                             device=p.q.device)
            out_view = big[:, :, 4:4 + p.dims.V]
            verify(p, "cuda", use_qk_l2norm=l2, scale=0.3, out=out_view)
            ref, _ = verify(pc, "cpu_ref", use_qk_l2norm=l2, scale=0.3)
            assert rel_err(out_view, ref) < tol
            assert torch.isnan(big[:, :, :4]).all() and torch.isnan(big[:, :, 4 + p.dims.V:]).all()



@pytest.mark.parametrize("s", SETTINGS)
def test_verify_is_batch_invariant(s):
    """A row's outputs and records do not depend on the rest of the batch: verify of the first two
    rows alone gives the bits they get inside the whole batch. On the GPU the whole batch (16 rows
    x 48 heads) runs the large tile and the two rows the small-grid one (fewer rows per thread)."""
    p = make_batch_problem(s["lens"][0] * 2, padding=(1,), **dims(s))
    out_all, rec_all = verify(p, "cuda")
    n = int(p.qsl[2])
    gates = {name: (t[:n] if t.dim() == 2 else t) for name, t in p.gates.items()}
    rec_two = rs.ReplayRecords.allocate(2, p.T, p.dims.H, p.dims.HV, p.dims.K, p.dims.V, device=p.q.device)
    out_two = rs.gdn_verify(p.q[:n], p.k[:n], p.v[:n], records=rec_two, state=p.state,
                            state_indices=p.state_indices[:2], query_start_loc=p.qsl[:3],
                            backend="cuda", **gates)
    assert torch.equal(out_two, out_all[:n])
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec_two, name)[:2], getattr(rec_all, name)[:2]), name



def launch_every_mode(p, cfg, snapshot_slots=None):
    """Problem ``p`` through the recurrence launcher with ``cfg``: verify's outputs and records,
    the pool after native decode and, given ``snapshot_slots``, the pool after snapshot (else
    None)."""
    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs, RecurrenceCall

    args = (p.q, p.k, p.v)
    tail = (GateInputs(**p.gates), p.dims.K ** -0.5, True, -1)
    rec = p.records()
    out = torch.empty_like(p.v)
    launch.recurrence(cfg, RecurrenceCall("verify", *args, p.state, p.state_indices, p.qsl, *tail, out,
                                          (rec.correction, rec.key, rec.decay), None))
    native = p.state.clone()
    launch.recurrence(cfg, RecurrenceCall("decode", *args, native, p.state_indices, p.qsl, *tail,
                                          torch.empty_like(p.v), None, None))
    snapshots = None
    if snapshot_slots is not None:
        snapshots = p.state.clone()
        launch.recurrence(cfg, RecurrenceCall("snapshot", *args, snapshots, p.state_indices, p.qsl, *tail,
                                              torch.empty_like(p.v), None, snapshot_slots))
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
    device, K, V = s["device"], s["K"], s["V"]
    p = make_batch_problem([3, 1, 4, 2], T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device=device,
                           num_slots=8, sources_below=6)
    results = []
    for rows in (8, 4, 2, 1):
        out, rec, native, _ = launch_every_mode(p, recurrence_table(rows=rows))
        results.append((rows, out, rec, native))
    _, out8, rec8, native8 = results[0]
    for rows, out, rec, native in results[1:]:
        assert torch.equal(out, out8), rows
        for name in ("correction", "key", "decay"):
            assert torch.equal(getattr(rec, name), getattr(rec8, name)), (rows, name)
        assert torch.equal(native, native8), rows
    committed = p.state.clone()
    commit(p, committed, rec8, accepted_tensor([4] * p.B, p), "cuda")
    assert torch.equal(committed, results[-1][3])



@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["ptx_widen_bf16", "l2_hints"])
@pytest.mark.parametrize("rows", [8, 4])
def test_ptx_switches_do_not_change_the_bits(switch, rows):
    """Two launch-table switches act in PTX only, so this is a GPU-only test (the interpreter
    never takes those paths): ``ptx_widen_bf16`` widens bf16 token inputs with bit operations
    instead of the compiler's cast; ``l2_hints`` adds cache eviction policies to the
    recurrence's loads (another binary). Verify's outputs and records, native decode's state and
    every snapshot are identical either way, with token inputs that include signed zeros, bf16
    subnormals and large values (1e30: larger ones overflow the state to NaN, which torch.equal
    cannot compare)."""
    K = V = 128
    p = make_batch_problem([3, 1, 4, 2], T=4, padding=(1,), H=4, HV=12, K=K, V=V, device="cuda",
                           act_dtype=torch.bfloat16, num_slots=8 + 10 * 4, sources_below=8)
    tiny = torch.finfo(torch.bfloat16).tiny
    special = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 2, tiny, 1.0, -1.0e30, 1.0e30],
                           dtype=torch.bfloat16, device="cuda")
    p.v[:, :, :8] = special        # v enters the correction linearly: every value must widen exactly
    p.k[:, :, 1:9] = special[:4].repeat(2)
    p.q[:, :, 5:13] = special[:4].repeat(2)
    snapshot_slots = torch.arange(p.B * p.T, dtype=torch.int32, device="cuda").view(p.B, p.T) + 8
    (out0, rec0, native0, snap0), (out1, rec1, native1, snap1) = (
        launch_every_mode(p, recurrence_table(rows=rows, **{switch: on}), snapshot_slots)
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
    p = make_batch_problem(s["lens"][0], padding=(1,), **dims(s))
    slots, HV, V, K = p.state.shape
    big = torch.full((slots, HV, V, K + 4), float("nan"), device=p.state.device)
    padded = big[..., :K]
    padded.copy_(p.state)
    out_packed, rec_packed = verify(p, "cuda")
    out_padded, rec_padded = verify(p, "cuda", state=padded)
    assert torch.equal(out_padded, out_packed)
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec_padded, name), getattr(rec_packed, name)), name
    rs.gdn_decode(p.q, p.k, p.v, backend="cuda", **p.call_kwargs())
    rs.gdn_decode(p.q, p.k, p.v, backend="cuda", **p.call_kwargs(state=padded))
    assert torch.equal(padded, p.state)
    assert torch.isnan(big[..., K:]).all(), "decode wrote into the row padding"



@pytest.mark.parametrize("s", SETTINGS)
def test_kernels_ignore_out_of_range_indices(s):
    """Called below validation, bad slots and lengths read and write nothing out of bounds:
    such rows are treated as padding (zero output) and the state pool is untouched."""
    from recoverssm.core.backend import GateInputs, RecurrenceCall

    p = make_batch_problem([3, 2, 2], T=3, **dims(s))
    backend = rs.get_backend("cuda", p.q.device)
    bad_slots = torch.tensor([p.state.shape[0] + 5, -7, 2**30], dtype=torch.int32, device=p.q.device)
    rec = p.records()
    rec_before = rec.correction.clone()
    out = torch.full_like(p.v, 7.0)
    state_before = p.state.clone()
    for mode in ("verify", "decode"):
        backend.recurrence(RecurrenceCall(mode, p.q, p.k, p.v, p.state, bad_slots, p.qsl,
                                          GateInputs(**p.gates), 0.25, True, -1, out,
                                          (rec.correction, rec.key, rec.decay), None))
        assert torch.count_nonzero(out) == 0
        assert torch.equal(p.state, state_before)
        assert torch.equal(rec.correction, rec_before)
    # A commit whose rows claim more accepted tokens than the window, and slots out of range.
    ctx = rs.CommitContext([[rs.LayerCache(p.state, rec)]], max_batch=3, backend="cuda")
    from recoverssm.core.backend import GroupStep

    ctx.committer.commit(torch.tensor([99, 99, 99], dtype=torch.int32, device=p.q.device),
                          p.qsl, [GroupStep(bad_slots, None, None, None, 1)])
    assert torch.equal(p.state, state_before)



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
        ctx.commit(torch.tensor(lens, dtype=torch.int32, device=device), slots, qsl)
        native = state.clone()
        rs.gdn_decode(q.contiguous(), k.contiguous(), v.contiguous(), state=native, state_indices=slots,
                      query_start_loc=qsl, backend="cuda", **gates)
        assert torch.equal(committed, native), K



# lanes_k=32 runs as 16 (launch.MAX_LANES_K): the entry checks that the clamp keeps the bits right
TILE_CONFIGS = [dict(lanes_k=4, rows=1), dict(lanes_k=8, rows=2),
                dict(lanes_k=16, rows=4), dict(lanes_k=32, rows=8), dict(lanes_k=8, rows=8),
                dict(lanes_k=8, rows=1, warps=2)]



@pytest.mark.parametrize("s", [
    pytest.param(dict(device="cpu", H=1, HV=2, shapes=[(64, 64), (48, 40), (8, 12)]),
                 marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=4, HV=12, shapes=[(128, 128), (64, 64), (48, 40), (8, 12)]),
                 marks=pytest.mark.gpu, id="gpu"),
])
@pytest.mark.parametrize("tile", TILE_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_every_recurrence_tile(s, tile):
    """Each tile configuration (lanes along K, rows per thread, warps) on shapes
    that use several K chunks, a padded K and a partial last V block: verify agrees with cpu_ref,
    and commit == native decode bit for bit under that configuration."""
    from recoverssm.backends.triton import launch
    from recoverssm.core.backend import GateInputs, RecurrenceCall

    device = s["device"]
    cfg = recurrence_table(**tile)
    for K, V in s["shapes"]:
        lens = [3, 1, 4, 2]
        p = make_batch_problem(lens, T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device=device,
                               num_slots=8, sources_below=6)
        pc = make_batch_problem(lens, T=4, padding=(1,), H=s["H"], HV=s["HV"], K=K, V=V, device="cpu",
                                num_slots=8, sources_below=6)
        gates = GateInputs(**p.gates)
        rec = p.records()
        out = torch.empty_like(p.v)
        launch.recurrence(cfg, RecurrenceCall("verify", p.q, p.k, p.v, p.state, p.state_indices, p.qsl,
                                              gates, K ** -0.5, True, -1, out, (rec.correction, rec.key, rec.decay),
                                              None))
        ref_out, ref_rec = verify(pc, "cpu_ref")
        assert rel_err(out, ref_out) < FP32_TOL, (K, V)
        for name in ("correction", "key", "decay"):
            assert rel_err(getattr(rec, name), getattr(ref_rec, name)) < FP32_TOL, (K, V, name)
        committed = p.state.clone()
        commit(p, committed, rec, accepted_tensor([4] * p.B, p), "cuda")
        native = p.state.clone()
        launch.recurrence(cfg, RecurrenceCall("decode", p.q.contiguous(), p.k.contiguous(), p.v.contiguous(), native,
                                              p.state_indices, p.qsl, gates, K ** -0.5, True, -1,
                                              torch.empty_like(p.v), None, None))
        assert torch.equal(committed, native), (K, V)
