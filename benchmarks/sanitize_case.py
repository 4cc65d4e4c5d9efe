"""Every kernel once on legal inputs, then again with adversarial index values and the value checks
off, for ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` (see docs/TESTING.md).

    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize_case.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python benchmarks/sanitize_case.py

Legal: conv_verify, conv_decode, gdn_verify (three times each with one layout, so that the last
calls repeat their bound launches), kda_verify, gdn_decode, gdn_spec_decode_snapshot, an
align-mode grouped commit of two KV-cache groups with conv compaction (repeated with the same
tensors, which repeats the bound launch), a bf16 commit, a mixed GDN + KDA commit, a dilated conv
and its compaction, Mamba2's verify, decode and snapshot (with ``z``, ``D`` per channel, a
``dt_limit``, head sizes that leave partial tiles) and a commit of a Mamba2 and a GDN layer; deferred
commits (verify and conv verify replaying the pending step, defer, flush), also with adversarial
pending rows and a plan of out-of-range values.
Adversarial (``check=False``: shapes are checked, values are not): slots between ``null_slot`` and
0, past the pool, the int32 extremes; ``query_start_loc`` that decreases, runs past the tokens,
or is negative (the dilated conv and Mamba2 too); ``num_accepted`` negative and huge; request
rows out of range; block tables with entries between ``null_slot`` and 0 and
``num_computed_tokens`` near 2^31. The script then checks that guard slots around the pools were
not written.
"""
import torch

import recoverssm as rs
from recoverssm.bench.problems import align_step, window

I32 = torch.int32
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
NULL = -3                 # a null slot below -1, so that -2 and -1 are "between null_slot and 0"
GUARD = 2                 # guard slots on each side of every pool


def guarded(pool: torch.Tensor):
    """``(full, middle)``: a pool with GUARD sentinel slots on each side, and its middle."""
    full = torch.full((pool.shape[0] + 2 * GUARD, *pool.shape[1:]), 123.0, dtype=pool.dtype, device=pool.device)
    full[GUARD:-GUARD] = pool
    return full, full[GUARD:-GUARD]


def assert_guards(name: str, full: torch.Tensor) -> None:
    for part in (full[:GUARD], full[-GUARD:]):
        assert bool((part == 123.0).all()), f"{name}: a guard slot was written"


def mamba2_calls(R: int, T: int, slots: torch.Tensor, qsl: torch.Tensor, snaps: torch.Tensor, num_slots: int,
                 null_slot: int = -1, check=None) -> tuple:
    """Mamba2's verify, decode and snapshot over a guarded bf16 pool of ``num_slots`` slots: 6
    heads of 24 channels, dstate 40 (partial tiles in both dims), 3 groups, ``z``, ``D`` per
    channel, ``A`` given, a ``dt_limit``. Returns the guarded pool and the verify's records."""
    HV, V, K, G = 6, 24, 40, 3
    gen = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)
    x, B, C, dt, z = rand(R * T, HV, V), rand(R * T, G, K), rand(R * T, G, K), rand(R * T, HV), rand(R * T, HV, V)
    full, state = guarded(rand(num_slots, HV, V, K).to(torch.bfloat16))
    records = rs.ReplayRecords.allocate(R, T, G, HV, K, V, device="cuda")
    kw = dict(state=state, state_indices=slots, query_start_loc=qsl, dt_bias=rand(HV), A=-rand(HV).abs(),
              D=rand(HV, V), z=z, dt_limit=(0.01, 2.0), null_slot=null_slot, check=check)
    rs.mamba2_verify(x, B, C, dt, records=records, **kw)
    rs.mamba2_decode(x, B, C, dt, **kw)
    rs.mamba2_spec_decode_snapshot(x, B, C, dt, snapshot_slots=snaps, **kw)
    return full, state, records


def legal_calls() -> None:
    H, HV, K, V, T, R = 16, 32, 128, 128, 4, 6
    w = window(R, T, H, HV, K, V, extra_slots=4)
    step = align_step(R, T, block_size=4)
    conv_state = torch.randn(step.num_slots, 64, 3 + T, device="cuda")
    conv_in = torch.randn(R * T, 64, device="cuda")
    weight = torch.randn(64, 4, device="cuda")
    conv_out, decode_out, verify_out = torch.empty_like(conv_in), torch.empty_like(conv_in[:R]), torch.empty_like(w.v)
    w.state_indices.copy_(step.state_indices)
    state = torch.randn(step.num_slots, HV, V, K, device="cuda")
    for _ in range(3):   # the same layout again: the third calls repeat the launches bound by the second
        rs.conv_verify(conv_in, conv_state, weight, None, state_indices=step.state_indices,
                       query_start_loc=step.query_start_loc, out=conv_out)
        rs.conv_decode(conv_in[:R], conv_state, weight, None, state_indices=step.state_indices, out=decode_out)
        rs.gdn_verify(w.q, w.k, w.v, state=state, state_indices=w.state_indices,
                      query_start_loc=w.query_start_loc, records=w.records, out=verify_out, **w.gates())
    ctx = rs.CommitContext([[rs.LayerCache(state, w.records, conv_state, conv_width=4)],
                            [rs.LayerCache(state.clone(),
                                           rs.ReplayRecords.allocate(R, T, H, HV, K, V, device="cuda"))]],
                           max_batch=R)
    align = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens, block_size=step.block_size)
    ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, check=True, **align)
    for _ in range(3):   # the same tensors again: the third call repeats the launch bound by the second
        ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, **align)
    bf16_state = state.to(torch.bfloat16)
    rs.CommitContext([[rs.LayerCache(bf16_state, w.records)]], max_batch=R).commit(
        step.num_accepted, step.state_indices, step.query_start_loc, check=True, **align)
    # KDA verify, then a context with a GDN and a KDA layer (one launch each)
    krec = rs.ReplayRecords.allocate(R, T, H, HV, K, V, device="cuda", vector_decay=True)
    kstate = torch.randn(step.num_slots, HV, V, K, device="cuda")
    ka = torch.randn(R * T, HV, K, device="cuda").to(torch.bfloat16)
    kbias = torch.randn(HV, K, device="cuda")
    rs.kda_verify(w.q, w.k, w.v, state=kstate, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  records=krec, a=ka, b=w.b, A_log=w.A_log, dt_bias=kbias)
    rs.CommitContext([[rs.LayerCache(state, w.records), rs.LayerCache(kstate, krec)]], max_batch=R).commit(
        step.num_accepted, step.state_indices, step.query_start_loc, check=True, **align)
    # a dilated conv (taps 3 tokens apart: a history of 9 columns) and its compaction in the commit
    dilated = torch.randn(step.num_slots, 64, 9 + T, device="cuda")
    rs.conv_verify(conv_in, dilated, weight, None, state_indices=step.state_indices,
                   query_start_loc=step.query_start_loc, dilation=3, out=conv_out)
    rs.conv_decode(conv_in[:R], dilated, weight, None, state_indices=step.state_indices, dilation=3, out=decode_out)
    rs.CommitContext([[rs.LayerCache(state, w.records, dilated, conv_width=4, conv_dilation=3)]], max_batch=R).commit(
        step.num_accepted, step.state_indices, step.query_start_loc, check=True, **align)
    rs.gdn_decode(w.q, w.k, w.v, state=state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  **w.gates())
    snaps = torch.arange(R * T, dtype=I32, device="cuda").view(R, T)     # distinct, below the rows' slots
    snap_pool = torch.randn(step.num_slots + R * T, HV, V, K, device="cuda")
    rs.gdn_spec_decode_snapshot(w.q, w.k, w.v, state=snap_pool, state_indices=w.state_indices + R * T,
                                query_start_loc=w.query_start_loc, snapshot_slots=snaps, **w.gates())
    # Mamba2 (its pool's rows after the snapshot slots), then its commit beside a GDN layer
    full_m2, m2_state, m2_records = mamba2_calls(R, T, w.state_indices + R * T, w.query_start_loc, snaps,
                                                 step.num_slots + R * T, check=True)
    m2_state_before = full_m2.clone()
    rs.CommitContext([[rs.LayerCache(m2_state, m2_records), rs.LayerCache(snap_pool, w.records)]], max_batch=R).commit(
        step.num_accepted, w.state_indices + R * T, step.query_start_loc, check=True)
    torch.cuda.synchronize()
    assert_guards("mamba2 state", full_m2)
    assert not torch.equal(full_m2, m2_state_before)


def deferred_calls() -> None:
    """A context that defers its commits, four steps of verify with the pending step (conv and
    GDN, with one layout, so that the last steps repeat their bound launches) and defer, a flush
    of one row, then adversarial pending rows and a plan of out-of-range values, checks off."""
    H, HV, K, V, T, R = 4, 8, 64, 64, 4, 6
    w = window(R, T, H, HV, K, V, extra_slots=4)
    full_state, state = guarded(w.state.clone())
    full_conv, conv = guarded(torch.randn(state.shape[0], 32, 3 + T, device="cuda"))
    records = rs.ReplayRecords.allocate(R, T, H, HV, K, V, device="cuda", buffers=2)
    ctx = rs.CommitContext([[rs.LayerCache(state, records, conv, conv_width=4)]], max_batch=R, deferred=True)
    x = torch.randn(R * T, 32, device="cuda")
    weight = torch.randn(32, 4, device="cuda")
    rows = torch.arange(R, dtype=I32, device="cuda")
    accepted = torch.tensor([1, 2, 3, 4, 2, 1], dtype=I32, device="cuda")
    out = torch.empty_like(w.v)
    for step in range(4):
        rs.conv_verify(x, conv, weight, None, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                       pending=ctx.pending, pending_rows=rows)
        rs.gdn_verify(w.q, w.k, w.v, state=state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                      records=records, out=out, pending=ctx.pending, pending_rows=rows, **w.gates())
        ctx.defer(accepted, w.state_indices, w.query_start_loc, check=step < 2)
    ctx.flush(torch.tensor([2], dtype=I32, device="cuda"))
    # adversarial: rows out of range and repeated, a plan with slots past the pool, lengths huge
    bad_rows = torch.tensor([INT32_MAX, -2, 0, R, INT32_MIN, 0], dtype=I32, device="cuda")
    plan = ctx.pending.plan
    plan[0, 0] = torch.tensor([INT32_MAX, -5, 3, 2, 1, 4], dtype=I32)
    plan[0, 1] = torch.tensor([0, 1, INT32_MAX, -2, 4, INT32_MIN], dtype=I32)
    plan[0, 2] = torch.tensor([1, INT32_MIN, 3, 9999, 5, 2], dtype=I32)
    plan[0, 3] = torch.tensor([INT32_MAX, 2, -1, 4, NULL, 0], dtype=I32)
    plan[0, 4] = torch.tensor([INT32_MAX, INT32_MIN, 2, -3, 7, 1], dtype=I32)
    rs.conv_verify(x, conv, weight, None, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                   pending=ctx.pending, pending_rows=bad_rows, check=False)
    rs.gdn_verify(w.q, w.k, w.v, state=state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  records=records, out=out, pending=ctx.pending, pending_rows=bad_rows, check=False, **w.gates())
    ctx.flush(bad_rows, check=False)
    torch.cuda.synchronize()
    assert_guards("deferred state", full_state)
    assert_guards("deferred conv_state", full_conv)


def adversarial_calls() -> None:
    H, HV, K, V, T, R = 4, 8, 64, 64, 4, 8
    slots = torch.tensor([NULL + 1, -1, 5, INT32_MAX, INT32_MIN, 1, 6, 2], dtype=I32, device="cuda")
    qsl = torch.tensor([0, 4, 3, 9, 40, -5, 8, 12, 100], dtype=I32, device="cuda")   # decreasing, past T, negative
    w = window(R, T, H, HV, K, V)
    full_state, state = guarded(w.state[:6].clone())
    out = torch.zeros_like(w.v)
    for _ in range(3):   # the last call repeats the launch bound by the second
        rs.gdn_verify(w.q, w.k, w.v, state=state, state_indices=slots, query_start_loc=qsl, records=w.records,
                      null_slot=NULL, out=out, check=False, **w.gates())
    rs.gdn_decode(w.q, w.k, w.v, state=state, state_indices=slots, query_start_loc=qsl, null_slot=NULL, out=out,
                  check=False, **w.gates())
    snaps = torch.tensor([[NULL + 1, 9, INT32_MIN, 3]] * R, dtype=I32, device="cuda")
    rs.gdn_spec_decode_snapshot(w.q, w.k, w.v, state=state, state_indices=slots, query_start_loc=qsl,
                                snapshot_slots=snaps, null_slot=NULL, out=out, check=False, **w.gates())
    krec = rs.ReplayRecords.allocate(R, T, H, HV, K, V, device="cuda", vector_decay=True)
    rs.kda_verify(w.q, w.k, w.v, state=state, state_indices=slots, query_start_loc=qsl, records=krec,
                  a=torch.randn(R * T, HV, K, device="cuda"), b=w.b, A_log=w.A_log,
                  dt_bias=torch.randn(HV, K, device="cuda"), null_slot=NULL, check=False)
    full_m2, m2_state, m2_records = mamba2_calls(R, T, slots, qsl, snaps, 6, null_slot=NULL, check=False)
    full_conv, conv = guarded(torch.randn(6, 32, 3 + T, device="cuda"))
    x = torch.randn(R * T, 32, device="cuda")
    rs.conv_verify(x, conv, torch.randn(32, 4, device="cuda"), None, state_indices=slots, query_start_loc=qsl,
                   null_slot=NULL, check=False)
    rs.conv_decode(x[:R], conv, torch.randn(32, 4, device="cuda"), None, state_indices=slots, null_slot=NULL,
                   check=False)
    full_dilated, dilated = guarded(torch.randn(6, 32, 6 + T, device="cuda"))     # dilation 2: 6 history columns
    rs.conv_verify(x, dilated, torch.randn(32, 4, device="cuda"), None, state_indices=slots, query_start_loc=qsl,
                   null_slot=NULL, dilation=2, check=False)
    rs.conv_decode(x[:R], dilated, torch.randn(32, 4, device="cuda"), None, state_indices=slots, null_slot=NULL,
                   dilation=2, check=False)
    # commits: a block table with entries between null_slot and 0 and past the pool, computed
    # tokens near 2^31, accepted counts negative and huge, request rows out of range
    block_table = torch.tensor([[NULL + 1, 0], [1, -2], [INT32_MAX, 2], [3, 4], [5, NULL + 1], [0, 1], [2, 3],
                                [4, 5]], dtype=I32, device="cuda")
    computed = torch.tensor([0, INT32_MAX - 2, 3, INT32_MAX, 1, -7, 2, 5], dtype=I32, device="cuda")
    accepted = torch.tensor([3, 2, -4, INT32_MAX, 1, 2, INT32_MIN, 4], dtype=I32, device="cuda")
    requests = torch.tensor([0, 1, 9, -1, 4, 5, 6, 7], dtype=I32, device="cuda")
    ctx = rs.CommitContext([[rs.LayerCache(state, w.records, conv, conv_width=4),
                             rs.LayerCache(state.clone(), rs.ReplayRecords.allocate(R, T, H, HV, K, V, device="cuda"),
                                           dilated, conv_width=4, conv_dilation=2)],
                            [rs.LayerCache(guarded(w.state[:6].clone())[1], krec),
                             rs.LayerCache(m2_state, m2_records)]], max_batch=R, null_slot=NULL)
    for _ in range(2):
        ctx.commit(accepted, slots, qsl, request_indices=requests, block_table=[block_table, None],
                   num_computed_tokens=[computed, None], block_size=[4, None], check=False)
        ctx.commit(accepted, slots, qsl, check=False)
    rs.plan_commit(accepted, slots, qsl, request_indices=requests, block_table=block_table,
                   num_computed_tokens=computed, block_size=2**30, null_slot=NULL, num_slots=6, check=False)
    torch.cuda.synchronize()
    assert_guards("state", full_state)
    assert_guards("conv_state", full_conv)
    assert_guards("dilated conv_state", full_dilated)
    assert_guards("mamba2 state", full_m2)


def main() -> None:
    legal_calls()
    deferred_calls()
    adversarial_calls()
    torch.cuda.synchronize()
    print("sanitize case ran: every kernel on legal inputs (the repeated commit through its bound launch, bf16, "
          "GDN + KDA + Mamba2, deferred commits), then with adversarial indices and value checks off; "
          "guard slots intact")


if __name__ == "__main__":
    main()
