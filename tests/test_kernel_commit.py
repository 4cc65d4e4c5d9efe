"""The commit kernel (``CommitContext.commit`` on the ``cuda`` backend) against its own native
per-token path and against ``cpu_ref``'s commit, in the interpreter and on a GPU
(:mod:`kernel_settings`).

Everything here is exact (``torch.equal``): commit == the same backend's decode and snapshot of
the accepted tokens; commit == ``cpu_ref``'s commit of the same records (both use a true fused
multiply-add); align-mode boundary writes, conv states, grouped vs per-layer commits, and every
launch variant (tiles per program, prefetch hints, persistent index buffers).
"""
import pytest
import torch

import recoverssm as rs
from recoverssm.core.repeats import REPEATS
from helpers import align_case, make_batch_problem, take_prefix
from kernel_settings import SETTINGS, accepted_tensor, commit, commit_table, dims, to_cpu, verify


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_is_bit_identical_to_native(s, state_dtype):
    """Every n: commit(verify records) == decode of the first n tokens == snapshot slot n-1."""
    for T in s["Ts"]:
        for extreme in (False, True):
            lens = [min(length, T) for length in s["lens"][0]]
            p = make_batch_problem(lens, T=T, padding=(1,), state_dtype=state_dtype, extreme=extreme,
                                   num_slots=(T + 2) * len(lens) + 2, sources_below=len(lens) + 2, **dims(s))
            _, rec = verify(p, "cuda")
            B = p.B
            snap = torch.arange(B * T, dtype=torch.int32, device=p.q.device).view(B, T) + B + 2
            snap_state = p.state.clone()
            rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, backend="cuda", snapshot_slots=snap,
                                        **p.call_kwargs(state=snap_state))
            for n in range(0, T + 2):
                committed = p.state.clone()
                commit(p, committed, rec, accepted_tensor([n] * B, p), "cuda")
                native = p.state.clone()
                q, k, v, gates, qsl = take_prefix(p, [n] * p.B)
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
    p = make_batch_problem(lens, T=T, padding=(1,), state_dtype=state_dtype, **dims(s))
    _, rec = verify(p, "cuda")
    accepted = accepted_tensor([(3 * r + 1) % (T + 1) for r in range(p.B)], p).cpu()
    gpu_state = p.state.clone()
    commit(p, gpu_state, rec, accepted.to(p.q.device), "cuda")
    cpu_state, cpu_rec = to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(cpu_state, cpu_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    ctx.commit(accepted, p.state_indices.cpu(), p.qsl.cpu())
    assert torch.equal(gpu_state.cpu(), cpu_state)



@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_align_commit_matches_reference(s, state_dtype):
    lens = [4, 4, 4, 4, 4]
    p = make_batch_problem(lens, T=4, state_dtype=state_dtype, num_slots=16, **dims(s))
    align, accepted, sources = align_case(p.q.device, 16)
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=p.q.device)
    _, rec = verify(p, "cuda")
    plan = rs.plan_commit(accepted, p.state_indices, p.qsl, backend="cuda", **align)
    ref_plan = rs.plan_commit(accepted.cpu(), p.state_indices.cpu(), p.qsl.cpu(),
                              backend="cpu_ref",
                              **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in align.items()})
    assert plan.as_dict() == ref_plan.as_dict()
    assert ref_plan.as_dict() == {"commit_len": [2, 4, 4, 3, 0], "final_slot": [1, 5, 8, 12, -1],
                                  "boundary_slot": [-1, 4, -1, 11, -1], "boundary_len": [0, 2, 0, 2, 0]}
    gpu_state = p.state.clone()
    commit(p, gpu_state, rec, accepted, "cuda", **align)
    cpu_state, cpu_rec = to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(cpu_state, cpu_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    ctx.commit(accepted.cpu(), p.state_indices.cpu(), p.qsl.cpu(),
               **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in align.items()})
    assert torch.equal(gpu_state.cpu(), cpu_state)
    untouched = [i for i in range(16) if i not in (1, 5, 8, 12, 4, 11)]
    assert torch.equal(gpu_state[untouched], p.state[untouched])



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
            p = make_batch_problem(lens, T=4, num_slots=16, seed=10 * gi + li, **dims(s))
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
    qsl = layers[0][0][0].qsl
    before = [[(p.state.clone(), cs.clone()) for p, _, cs in g] for g in layers]
    ctx = rs.CommitContext([[rs.LayerCache(p.state, rec, cs, conv_width=4) for p, rec, cs in g] for g in layers],
                           max_batch=5, backend="cuda")
    ctx.commit(accepted, [a["state_indices"] for a in group_args], qsl,
               block_table=[a["block_table"] for a in group_args],
               num_computed_tokens=[a["num_computed_tokens"] for a in group_args],
               block_size=[a["block_size"] for a in group_args])
    for gi, g in enumerate(layers):
        for li, (p, rec, cs) in enumerate(g):
            st, cst = before[gi][li]
            single = rs.CommitContext([[rs.LayerCache(st, rec, cst, conv_width=4)]], max_batch=5, backend="cuda")
            args = group_args[gi]
            single.commit(accepted, args["state_indices"], qsl, block_table=args["block_table"],
                          num_computed_tokens=args["num_computed_tokens"], block_size=args["block_size"])
            assert torch.equal(st, p.state), (gi, li)
            assert torch.equal(cst, cs), (gi, li)



@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiles_per_program_do_not_change_the_bits(s, state_dtype):
    """A commit program may replay several state tiles in turn (sharing the row's plan), may
    hint records and next tiles into L2 (compiled kernels only), may load the replay records
    of two window positions at a time, and may round a bf16 state in PTX pairs (compiled kernels
    only): 1, 2 and 3 tiles per program (3 leaves the last program short), with and without the
    hints, records one ahead or two at a time, either rounding, give the same states and conv
    states, align mode with boundary writes included (request 0 accepts 4 here:
    3 tokens into its boundary state, then 1, so replays of odd and even lengths start at odd
    and even positions)."""
    from recoverssm.backends.triton.tuning import launch_table

    device = s["device"]
    align, accepted, sources = align_case(device, 16)
    accepted = accepted.clone()
    accepted[0] = 4
    p = make_batch_problem([4] * 5, T=4, num_slots=16, seed=21, state_dtype=state_dtype, **dims(s))
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=device)
    _, rec = verify(p, "cuda")
    conv_state = torch.randn(16, 12, 3 + 4, device=device)
    results = []
    for tiles, prefetch, pairs, ptx in ((1, False, False, False), (2, False, False, False), (3, False, False, False),
                                        (1, True, False, False), (3, True, False, False), (1, False, True, False),
                                        (2, True, True, False), (3, False, True, False), (1, False, False, True),
                                        (2, True, True, True)):
        state, conv = p.state.clone(), conv_state.clone()
        table = commit_table(block_v=16, tiles_per_program=tiles, prefetch_records=prefetch,
                             prefetch_next_tile=prefetch, replay_pairs=pairs, ptx_round_bf16=ptx)
        with launch_table("cuda", table):       # a context fixes its launch when it is built
            ctx = rs.CommitContext([[rs.LayerCache(state, rec, conv, conv_width=4)]], max_batch=5, backend="cuda")
        ctx.commit(accepted, p.state_indices, p.qsl, **align)
        results.append((state, conv))
    for state, conv in results[1:]:
        assert torch.equal(state, results[0][0]) and torch.equal(conv, results[0][1])
    assert not torch.equal(results[0][0], p.state), "the commit wrote nothing"



def test_launch_table_entry_for_a_head_size():
    """A commit spec keyed ``(state dtype, V)`` serves layers of ``V`` value rows per head only;
    every other head size, and a call that names none, gets the state dtype's own spec."""
    from recoverssm.backends.triton.config import CommitSpec, LaunchTable

    own, for_64 = CommitSpec(block_v=32), CommitSpec(block_v=32, tiles_per_program=2)
    table = LaunchTable(commit={torch.float32: own, (torch.float32, 64): for_64, torch.bfloat16: CommitSpec()})
    assert table.commit_for(torch.float32, 64) is for_64
    assert table.commit_for(torch.float32, 128) is own and table.commit_for(torch.float32) is own
    assert table.commit_for(torch.bfloat16, 64) == CommitSpec()


@pytest.mark.parametrize("s", SETTINGS)
def test_steps_with_persistent_index_buffers(s):
    """An engine's loop: the same index tensors every step, their values rewritten in place (as
    under CUDA graphs). From the second such step on, the commit repeats a launch bound to those
    tensors (GPU only; the interpreter has no direct launch path): every step must still read the
    new values, on whatever stream is current, and give cpu_ref's bits."""
    device = s["device"]
    lens = [4, 4, 3, 4, 2, 4]
    p = make_batch_problem(lens, T=4, num_slots=16, seed=5, **dims(s))
    _, rec = verify(p, "cuda")
    state, (ref_state, ref_rec) = p.state.clone(), to_cpu(p.state.clone(), rec)
    ctx = rs.CommitContext([[rs.LayerCache(state, rec)]], max_batch=rec.max_batch, backend="cuda")
    ref = rs.CommitContext([[rs.LayerCache(ref_state, ref_rec)]], max_batch=rec.max_batch, backend="cpu_ref")
    accepted, slots = torch.zeros_like(p.state_indices), p.state_indices.clone()
    qsl = p.qsl
    hits = REPEATS.hits
    for step in range(6):
        accepted.copy_(accepted_tensor([(step + 2 * r) % 5 for r in range(p.B)], p))
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
        assert REPEATS.hits > hits, "the commit never repeated its bound launch"



@pytest.mark.parametrize("s", SETTINGS)
def test_conv_compaction_matches_reference(s):
    device = s["device"]
    lens = [4, 4, 4, 4, 4]
    align, accepted, sources = align_case(device, 16)
    p = make_batch_problem(lens, T=4, num_slots=16, **dims(s))
    p.state_indices = torch.tensor(sources, dtype=torch.int32, device=device)
    _, rec = verify(p, "cuda")
    conv_state = torch.randn(16, 20, 3 + 4, device=device).to(torch.bfloat16)
    for kw in (align, {}):
        gpu_conv = conv_state.clone()
        ctx = rs.CommitContext([[rs.LayerCache(p.state.clone(), rec, gpu_conv, conv_width=4)]], max_batch=5,
                               backend="cuda")
        ctx.commit(accepted, p.state_indices, p.qsl, **kw)
        cpu_conv = conv_state.cpu().clone()
        state_cpu, rec_cpu = to_cpu(p.state.clone(), rec)
        ref = rs.CommitContext([[rs.LayerCache(state_cpu, rec_cpu, cpu_conv, conv_width=4)]], max_batch=5,
                               backend="cpu_ref")
        ref.commit(accepted.cpu(), p.state_indices.cpu(), p.qsl.cpu(),
                   **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
        assert torch.equal(gpu_conv.cpu(), cpu_conv)



@pytest.mark.gpu
def test_repeated_runs_identical_bits():
    """20 runs of verify + commit on the GPU give identical outputs, records and states."""
    p = make_batch_problem([4] * 32, H=16, HV=48, K=128, V=128, device="cuda", num_slots=80)
    results = []
    for _ in range(20):
        out, rec = verify(p, "cuda")
        st = p.state.clone()
        commit(p, st, rec, accepted_tensor([3] * 32, p), "cuda")
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
    p = make_batch_problem(lens, T=T, H=16, HV=HV, K=128, V=128, padding=(5, 17), state_dtype=state_dtype,
                           device="cuda", num_slots=64 * (T + 1) + 2, sources_below=66)
    _, rec = verify(p, "cuda")
    B = p.B
    snap = torch.arange(B * T, dtype=torch.int32, device="cuda").view(B, T) + B + 2
    snap_state = p.state.clone()
    rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, backend="cuda", snapshot_slots=snap, **p.call_kwargs(state=snap_state))
    for n in range(1, T + 1):
        committed = p.state.clone()
        commit(p, committed, rec, accepted_tensor([n] * B, p), "cuda")
        for r, slot in enumerate(p.state_indices.tolist()):
            m = min(n, lens[r])
            if slot >= 0:
                assert torch.equal(committed[slot], snap_state[snap[r, m - 1]]), (n, r)
