"""Grouped commit: several KV-cache groups with their own slots / block tables, in one call."""

import pytest
import torch

import recoverssm as rs
from helpers import BF16, F32, Dims, clone_all, decode_after, i32, make_problem, run_verify

LENS = [4, 2, 3, 1]
REQ = [4, 1, 5, 2]                 # batch row -> request row: a permuted subset of 6 requests
NUM_REQ = 6
MAX_BATCH = 6


def legal(num_accepted):
    """Per-request counts within the window of the row that carries each request."""
    out = list(num_accepted)
    for r, q in enumerate(REQ):
        out[q] = min(out[q], LENS[r])
    return out


def group_meta():
    """Per group: state_indices, block_table, num_computed_tokens, block_size, num_slots."""
    g0 = (i32([3, 0, -1, 5]), None, None, None, 8)
    # group 1: block size 4, width 3, request q owns slots 8q .. 8q+2
    bt1 = torch.tensor([[8 * q + j for j in range(3)] for q in range(NUM_REQ)], dtype=torch.int32)
    nct1 = i32([0, 5, 3, 0, 6, 7])
    src1 = i32([int(bt1[q, (int(nct1[q]) - 1) // 4]) for q in REQ])
    g1 = (src1, bt1, nct1, 4, 8 * NUM_REQ)
    # group 2: block size 2, width 5, request q owns slots 5q .. 5q+4 (+1 offset)
    bt2 = torch.tensor([[1 + 5 * q + j for j in range(5)] for q in range(NUM_REQ)], dtype=torch.int32)
    nct2 = i32([0, 2, 1, 0, 4, 3])
    src2 = i32([int(bt2[q, (int(nct2[q]) - 1) // 2]) for q in REQ])
    g2 = (src2, bt2, nct2, 2, 1 + 5 * NUM_REQ)
    return [g0, g1, g2]


# layer specs per group: (dims, state dtype, conv width or None)
LAYERS = [
    [(Dims(2, 4, 16, 16), F32, None)],
    [(Dims(2, 4, 16, 16), BF16, 4), (Dims(1, 2, 32, 16), F32, None)],
    [(Dims(2, 4, 16, 32), F32, 3), (Dims(2, 2, 16, 16), BF16, None), (Dims(1, 4, 32, 32), F32, 2)],
]


def build_layers(seed=0):
    metas = group_meta()
    groups = []
    probs = []
    for gi, specs in enumerate(LAYERS):
        slots, _, _, _, num_slots = metas[gi]
        layers, ps = [], []
        for li, (dims, sdt, width) in enumerate(specs):
            p = make_problem(LENS, slots.tolist(), dims=dims, seed=seed + 10 * gi + li, state_dtype=sdt,
                             num_slots=num_slots)
            records = rs.ReplayRecords.allocate(8, 4, dims.H, dims.HV, dims.K, dims.V)
            run_verify(p, records=records)
            conv_state = None
            if width is not None:
                gen = torch.Generator().manual_seed(seed + 99 + li)
                dim = 8 + li
                conv_state = torch.randn(num_slots, dim, width - 1 + 4, generator=gen).to(sdt)
                rs.conv_verify(torch.randn(p.T_total, dim, generator=gen), conv_state,
                               torch.randn(dim, width, generator=gen), None,
                               state_indices=p.state_indices, query_start_loc=p.qsl)
            layers.append(rs.LayerCache(p.state.clone(), records, conv_state=conv_state, conv_width=width))
            ps.append(p)
        groups.append(layers)
        probs.append(ps)
    return groups, probs, metas


def commit_kwargs(metas, gi=None):
    pick = (lambda i: [m[i] for m in metas]) if gi is None else (lambda i: metas[gi][i])
    return dict(request_indices=i32(REQ) if gi is not None else [i32(REQ)] * len(metas),
                block_table=pick(1), num_computed_tokens=pick(2), block_size=pick(3))


@pytest.mark.parametrize("num_accepted", [[9, 2, 1, 7, 3, 3], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1],
                                          [5, 5, 5, 5, 5, 5], [2, 0, 4, 0, 1, 2]])
def test_grouped_equals_each_layer_alone(num_accepted):
    num_accepted = legal(num_accepted)
    groups, probs, metas = build_layers()
    originals = clone_all(groups)
    grouped = clone_all(groups)
    ctx = rs.CommitContext(grouped, max_batch=MAX_BATCH)
    assert ctx.num_groups == 3
    qsl = probs[0][0].qsl
    ctx.commit(i32(num_accepted), [m[0] for m in metas], qsl, **commit_kwargs(metas))
    changed = False
    for gi, layers in enumerate(groups):
        for li, layer in enumerate(layers):
            alone = clone_all(layer)
            c1 = rs.CommitContext([[alone]], max_batch=MAX_BATCH)
            c1.commit(i32(num_accepted), metas[gi][0], qsl, **commit_kwargs(metas, gi))
            g = grouped[gi][li]
            assert torch.equal(g.state, alone.state), f"group {gi} layer {li}: state"
            if layer.conv_state is not None:
                assert torch.equal(g.conv_state, alone.conv_state), f"group {gi} layer {li}: conv"
            assert torch.equal(g.records.correction, originals[gi][li].records.correction)
            changed |= not torch.equal(g.state, originals[gi][li].state)
    assert changed == any(num_accepted[q] > 0 for q in REQ)


def test_grouped_align_groups_have_boundaries():
    """The block tables above do make boundary writes (so the grouped test covers them)."""
    metas = group_meta()
    qsl = make_problem(LENS).qsl
    for gi in (1, 2):
        plan = rs.plan_commit(i32([9, 2, 1, 7, 3, 3]), metas[gi][0], qsl, request_indices=i32(REQ),
                              block_table=metas[gi][1], num_computed_tokens=metas[gi][2],
                              block_size=metas[gi][3])
        assert (plan.boundary_slot >= 0).any(), gi


def test_request_indices_equals_resolved_rows():
    """Committing with request_indices == committing with the per-request values gathered per row."""
    groups, probs, metas = build_layers(seed=3)
    num_accepted = i32(legal([9, 2, 1, 7, 3, 3]))
    req = torch.tensor(REQ)
    qsl = probs[0][0].qsl
    for gi in range(3):
        for layer in groups[gi]:
            a, b = clone_all(layer), clone_all(layer)
            rs.CommitContext([[a]], max_batch=MAX_BATCH).commit(num_accepted, metas[gi][0], qsl,
                                                                **commit_kwargs(metas, gi))
            bt, nct, bs = metas[gi][1], metas[gi][2], metas[gi][3]
            rs.CommitContext([[b]], max_batch=MAX_BATCH).commit(
                num_accepted[req].contiguous(), metas[gi][0], qsl,
                block_table=None if bt is None else bt[req].contiguous(),
                num_computed_tokens=None if nct is None else nct[req].contiguous(), block_size=bs)
            assert torch.equal(a.state, b.state)
            if a.conv_state is not None:
                assert torch.equal(a.conv_state, b.conv_state)


def test_request_indices_commit_equals_decode():
    groups, probs, metas = build_layers(seed=4)
    p = probs[0][0]
    layer = groups[0][0]
    num_accepted = legal([9, 2, 1, 7, 3, 3])
    rs.CommitContext([[layer]], max_batch=MAX_BATCH).commit(i32(num_accepted), metas[0][0], p.qsl,
                                                            request_indices=i32(REQ))
    ns = [num_accepted[q] for q in REQ]
    assert torch.equal(layer.state, decode_after(p, ns))


def test_same_value_for_all_groups_and_context_reuse():
    """A single (non-list) state_indices is shared by every group; one context commits many steps."""
    p1 = make_problem(LENS, [0, 1, 2, 3], seed=7)
    p2 = make_problem(LENS, [0, 1, 2, 3], seed=8, state_dtype=BF16)
    l1 = rs.LayerCache(p1.state.clone(), p1.records())
    l2 = rs.LayerCache(p2.state.clone(), p2.records())
    ctx = rs.CommitContext([[l1], [l2]], max_batch=4)
    ns = [[1, 2, 3, 1], [4, 0, 2, 1]]
    exp1, exp2 = p1.state.clone(), p2.state.clone()
    for step in ns:
        # verify from the current state, then commit: two speculative steps in a row
        for p, cache in ((p1, l1), (p2, l2)):
            rs.gdn_verify(p.q, p.k, p.v, records=cache.records, **p.call_kwargs(state=cache.state))
        ctx.commit(i32(step), p1.state_indices, p1.qsl)
        exp1 = decode_after(p1, step, pool=exp1)
        exp2 = decode_after(p2, step, pool=exp2)
        assert torch.equal(l1.state, exp1) and torch.equal(l2.state, exp2)


