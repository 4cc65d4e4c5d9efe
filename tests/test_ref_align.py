"""Align mode (prefix caching): the plan worked out by hand, and the states it writes.

Two hand-worked cases hold values the value checks reject (more accepted tokens than the window,
a last token past the block table): the kernels' rule still defines them (clamped), so every case
runs through the backends with no checks, and the legal ones through the public ops too."""

import pytest
import torch

import recoverssm as rs
from helpers import (BF16, F32, commit_one, commit_unchecked, decode_after, i32, make_problem, plan_unchecked,
                     run_verify)

BS = 4
NULL = -1
# Each case: (name, num_computed_tokens, window length, num_accepted, block_table row, source slot,
#             expected plan (commit_len, final_slot, boundary_slot, boundary_len)), worked out by hand
# with block j covering tokens [4j, 4j + 4) and the window covering tokens [nc, nc + len).
CASES = [
    # tokens 5,6 stay in block 1 (4..7); source = block 1 = 11; next boundary 8 not reached
    ("inside a block", 5, 3, 2, [10, 11, 12, 13], 11, (2, 11, NULL, 0)),
    # tokens 6..9: last in block 2 (16); boundary 8 reached -> block 1 (15, the source) after 2 tokens
    ("crosses, boundary == source", 6, 6, 4, [14, 15, 16, 17], 15, (4, 16, 15, 2)),
    # tokens 5,6,7: ends exactly on the boundary 8 -> final is block 1 (19) holding token 7, no boundary
    ("ends exactly on a boundary", 5, 4, 3, [18, 19, 20, 21], 19, (3, 19, NULL, 0)),
    # nc = 8 starts on a boundary (source block 1 = 23); tokens 8..12 -> final block 3 (25);
    # boundary 12 reached -> block 2 (24) after 4 tokens
    ("starts on a boundary, crosses", 8, 5, 5, [22, 23, 24, 25], 23, (5, 25, 24, 4)),
    # nc = 4 starts on a boundary, tokens 4,5,6 stay in block 1 (27)
    ("starts on a boundary, stays", 4, 3, 3, [26, 27, 28, 29], 26, (3, 27, NULL, 0)),
    # tokens 6..9 end in block 2, which is unallocated (-1): the row writes nothing
    ("null final block", 6, 4, 4, [30, 31, NULL, NULL], 31, (0, NULL, NULL, 0)),
    # nothing accepted
    ("n = 0", 3, 2, 0, [32, 33, 34, 35], 32, (0, NULL, NULL, 0)),
    # tokens 14,15,16 -> block 4 is past the table's width 4: clamped to block 3 (37), which is
    # also the boundary block (16 reached) -> no separate boundary
    ("final clamped to last column", 14, 3, 3, [34, 35, 36, 37], 37, (3, 37, NULL, 0)),
    # tokens 2..9 cross boundaries 4 and 8: final block 2 (40), boundary block 0 (38, the source)
    # after 2 tokens (only the first boundary is kept)
    ("crosses two boundaries", 2, 8, 8, [38, 39, 40, 41], 38, (8, 40, 38, 2)),
    # tokens 6..9 with block 1 unallocated: no boundary, final block 2 (43)
    ("null boundary block", 6, 4, 4, [42, NULL, 43, 44], 45, (4, 43, NULL, 0)),
    # n larger than the row: clamped to len = 3; tokens 9,10,11 end on boundary 12 -> block 2 (47)
    ("n > len clamped", 9, 3, 7, [46, NULL, 47, 48], 47, (3, 47, NULL, 0)),
    # padding row (source -1): writes nothing, whatever the table says
    ("padding row", 6, 4, 4, [49, 50, 51, 52], NULL, (0, NULL, NULL, 0)),
]
NUM_SLOTS = 56
#: cases the value checks reject, and the argument they name
REJECTED = {"n > len clamped": "num_accepted", "final clamped to last column": "block_table"}
LEGAL = [c for c in CASES if c[0] not in REJECTED]


def build(state_dtype=F32, seed=0, cases=CASES):
    lens = [c[2] for c in cases]
    srcs = [c[5] for c in cases]
    p = make_problem(lens, srcs, seed=seed, state_dtype=state_dtype, num_slots=NUM_SLOTS)
    num_accepted = i32(c[3] for c in cases)
    block_table = torch.tensor([c[4] for c in cases], dtype=torch.int32)
    nct = i32(c[1] for c in cases)
    return p, num_accepted, block_table, nct


def assert_plan(plan, cases):
    got = plan.as_dict()
    for r, case in enumerate(cases):
        row = tuple(got[k][r] for k in ("commit_len", "final_slot", "boundary_slot", "boundary_len"))
        assert row == case[6], f"{case[0]}: plan {row}, expected {case[6]}"
    for t in (plan.commit_len, plan.final_slot, plan.boundary_slot, plan.boundary_len):
        assert t.dtype == torch.int32 and t.shape == (len(cases),)


def test_plan_by_hand():
    p, num_accepted, block_table, nct = build()
    assert_plan(plan_unchecked(num_accepted, p.state_indices, p.qsl, block_table=block_table,
                               num_computed_tokens=nct, block_size=BS), CASES)
    p, num_accepted, block_table, nct = build(cases=LEGAL)
    assert_plan(rs.plan_commit(num_accepted, p.state_indices, p.qsl, block_table=block_table,
                               num_computed_tokens=nct, block_size=BS), LEGAL)


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_plan_checks_reject_what_the_kernels_clamp(name):
    p, num_accepted, block_table, nct = build(cases=[c for c in CASES if c[0] == name])
    with pytest.raises(ValueError, match=rf"^plan_commit: {REJECTED[name]} "):
        rs.plan_commit(num_accepted, p.state_indices, p.qsl, block_table=block_table, num_computed_tokens=nct,
                       block_size=BS)


def test_plan_non_align_and_request_indices():
    # non-align: final = source, no boundary; lengths clamp; request_indices maps rows to requests
    # (checks off: counts past a window clamp)
    num_accepted = i32([5, 0, 2, 9])                # per request
    slots = i32([3, 7, -1, 2])
    qsl = i32([0, 2, 5, 7, 10])
    plan = plan_unchecked(num_accepted, slots, qsl, request_indices=i32([3, 0, 2, 1]))
    assert plan.as_dict() == {"commit_len": [2, 3, 0, 0], "final_slot": [3, 7, -1, -1],
                              "boundary_slot": [-1, -1, -1, -1], "boundary_len": [0, 0, 0, 0]}
    plan = plan_unchecked(num_accepted, slots, qsl)
    assert plan.as_dict()["commit_len"] == [2, 0, 0, 3]
    plan = rs.plan_commit(i32([3, 0, 2, 2]), slots, qsl, request_indices=i32([3, 0, 2, 1]))
    assert plan.as_dict()["commit_len"] == [2, 3, 0, 0]
    # null_slot other than -1: slots <= null_slot are padding
    plan = rs.plan_commit(i32([1, 1]), i32([2, 3]), i32([0, 1, 2]), null_slot=2)
    assert plan.as_dict() == {"commit_len": [0, 1], "final_slot": [2, 3], "boundary_slot": [2, 2],
                              "boundary_len": [0, 0]}


def expected_pool(p, cases):
    """Final slot = decode after n tokens; boundary slot = decode after boundary_len tokens;
    every other slot unchanged."""
    ns = [c[6][0] for c in cases]
    bls = [c[6][3] for c in cases]
    after_n = decode_after(p, ns)
    after_b = decode_after(p, bls)
    exp = p.state.clone()
    for r, case in enumerate(cases):
        n, final, boundary, bl = case[6]
        if boundary != NULL:
            exp[boundary] = after_b[case[5]]
        if final != NULL:
            exp[final] = after_n[case[5]]
    return exp


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["normal", "extreme"])
def test_align_commit_states(state_dtype, regime):
    p, num_accepted, block_table, nct = build(state_dtype)
    if regime == "extreme":
        p = make_problem([c[2] for c in CASES], [c[5] for c in CASES], seed=2, state_dtype=state_dtype,
                         num_slots=NUM_SLOTS, regime="extreme")
    _, records = run_verify(p)
    exp = expected_pool(p, CASES)
    pool = p.state.clone()
    commit_unchecked(pool, records, num_accepted, p.state_indices, p.qsl, block_table=block_table,
                     num_computed_tokens=nct, block_size=BS)
    legal = torch.tensor([c[0] not in REJECTED for c in CASES])
    checked = p.state.clone()
    commit_one(checked, records, torch.where(legal, num_accepted, 0), torch.where(legal, p.state_indices, -1), p.qsl,
               block_table=block_table, num_computed_tokens=nct, block_size=BS)
    written = {slot for c in CASES if c[0] in REJECTED for slot in c[6][1:3] if slot != NULL}
    for slot in range(NUM_SLOTS):
        want = p.state[slot] if slot in written else exp[slot]
        assert torch.equal(checked[slot], want), f"checked commit, slot {slot}"
    for r, case in enumerate(CASES):
        n, final, boundary, _ = case[6]
        for slot in (final, boundary):
            if slot != NULL:
                assert torch.equal(pool[slot], exp[slot]), f"{case[0]}: slot {slot}"
    assert torch.equal(pool, exp), "a slot outside the plan changed"
    # the boundary states differ from the final states (the test can tell them apart)
    assert not torch.equal(pool[15], pool[16]) and not torch.equal(pool[38], pool[40])


def test_align_boundary_equal_source_alone():
    """The boundary block is the source block: the source must be read before it is overwritten."""
    case = [c for c in CASES if c[0] == "crosses, boundary == source"]
    p, num_accepted, block_table, nct = build(cases=case, seed=5)
    _, records = run_verify(p)
    exp = expected_pool(p, case)
    pool = p.state.clone()
    commit_one(pool, records, num_accepted, p.state_indices, p.qsl, block_table=block_table,
               num_computed_tokens=nct, block_size=BS)
    assert torch.equal(pool, exp)
    assert not torch.equal(pool[15], p.state[15])


def test_align_block_size_one_and_large():
    """block_size 1: every token ends a block; a huge block_size: never crosses."""
    p = make_problem([4, 3], [5, 9], seed=6, num_slots=24)
    _, records = run_verify(p)
    bt = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], dtype=torch.int32)
    nct = i32([6, 2])
    # bs=1: row 0 tokens 6..9 with n=3: final = bt[0][8]? width 8 -> column min(8, 7) = 7;
    # next boundary 7 -> boundary = bt[0][6] = 6 after 1 token. Row 1: tokens 2,3,4 with n=2 ->
    # final = bt[1][3] = 11, boundary = bt[1][2] = 10 after 1 token.
    # (row 0's last token is past the table: the checks reject it, the kernels clamp the column)
    plan = plan_unchecked(i32([3, 2]), p.state_indices, p.qsl, block_table=bt, num_computed_tokens=nct,
                          block_size=1)
    assert plan.as_dict() == {"commit_len": [3, 2], "final_slot": [7, 11], "boundary_slot": [6, 10],
                              "boundary_len": [1, 1]}
    # bs=1 with source 5 and 9: row 0 reads 5 (= bt[0][5], the block of token 5) fine.
    pool = p.state.clone()
    commit_unchecked(pool, records, i32([3, 2]), p.state_indices, p.qsl, block_table=bt,
                     num_computed_tokens=nct, block_size=1)
    after3 = decode_after(p, [3, 2])
    after1 = decode_after(p, [1, 1])
    exp = p.state.clone()
    exp[6], exp[7], exp[10], exp[11] = after1[5], after3[5], after1[9], after3[9]
    assert torch.equal(pool, exp)
    plan = rs.plan_commit(i32([3, 2]), p.state_indices, p.qsl, block_table=bt, num_computed_tokens=nct,
                          block_size=1000)
    assert plan.as_dict() == {"commit_len": [3, 2], "final_slot": [0, 8], "boundary_slot": [-1, -1],
                              "boundary_len": [0, 0]}


@pytest.mark.parametrize("conv_dtype", [F32, BF16])
def test_align_conv_compaction(conv_dtype):
    """In align mode the final slot gets the history ending at the last committed token and the
    boundary slot the history ending at the boundary: src[:, n : n + history] and
    src[:, boundary_len : boundary_len + history]."""
    p, num_accepted, block_table, nct = build(seed=7)
    T = max(p.lens)
    width, dim = 4, 12
    hist = width - 1
    g = torch.Generator().manual_seed(8)
    conv_state = torch.randn(NUM_SLOTS, dim, hist + T, generator=g).to(conv_dtype)
    weight = torch.randn(dim, width, generator=g)
    x = torch.randn(p.T_total, dim, generator=g)
    rs.conv_verify(x, conv_state, weight, None, state_indices=p.state_indices, query_start_loc=p.qsl)
    _, records = run_verify(p)
    after_verify = conv_state.clone()
    exp = conv_state.clone()
    for r, case in enumerate(CASES):
        n, final, boundary, bl = case[6]
        if n == 0:
            continue
        seq = torch.cat([after_verify[case[5], :, :hist], x[p.qsl[r]:p.qsl[r + 1]].t().to(conv_dtype)], 1)
        if boundary != NULL:
            exp[boundary, :, :hist] = seq[:, bl:bl + hist]
        exp[final, :, :hist] = seq[:, n:n + hist]
    pool = p.state.clone()
    commit_unchecked(pool, records, num_accepted, p.state_indices, p.qsl, conv_state=conv_state, conv_width=width,
                     block_table=block_table, num_computed_tokens=nct, block_size=BS)
    assert torch.equal(conv_state, exp)
    assert torch.equal(pool, expected_pool(p, CASES))
    assert not torch.equal(conv_state, after_verify)
