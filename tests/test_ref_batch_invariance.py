"""A row's outputs, records and committed state do not depend on the batch it arrives in."""

import pytest
import torch

import recoverssm as rs
from helpers import BF16, F32, assemble, commit_one, i32, legal_accepted, row_data

TARGET_LEN = 5


def others(seed, lens, **kw):
    return [row_data(seed + i, n, **kw) for i, n in enumerate(lens)]


# (other rows' lengths, position of the target row, slot of the target row, other rows' slots)
COMPOSITIONS = [
    ([], 0, 0, []),
    ([8, 3], 0, 5, [1, 2]),
    ([8, 3], 1, 2, [7, 1]),
    ([8, 3], 2, 9, [3, 0]),
    ([1, 0, 8, 2, 7, 4, 6], 4, 11, [0, 1, -1, 3, 4, 5, 6]),   # padding row with tokens, empty row
    ([8, 8, 8, 8, 8, 8], 6, 1, [10, 9, 8, 7, 6, 5]),
    ([2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], 3, 20, list(range(0, 11))),
]


def run_composition(target, comp, kw, regime, ns_other):
    lens, pos, tslot, oslots = comp
    rows = others(500 + 17 * len(lens), lens, **kw)
    rows.insert(pos, target)
    slots = list(oslots)
    slots.insert(pos, tslot)
    p = assemble(rows, slots, num_slots=24, regime=regime, layer_seed=3, junk_seed=len(lens))
    records = rs.ReplayRecords.allocate(16, 8, 2, 4, 16, 16)
    out = rs.gdn_verify(p.q, p.k, p.v, records=records, **p.call_kwargs())
    s = p.qsl[pos].item()
    o = out[s:s + TARGET_LEN].clone()
    rec = [getattr(records, n)[pos, :, :TARGET_LEN].clone() for n in ("correction", "key", "decay")]
    committed = {}
    for n in (0, 1, 3, TARGET_LEN):
        pool = p.state.clone()
        na = [ns_other] * len(rows)
        na[pos] = n
        commit_one(pool, records, i32(legal_accepted(na, p.lens)), p.state_indices, p.qsl, max_batch=16)
        committed[n] = pool[tslot].clone()
    return o, rec, committed


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("act_dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["normal", "extreme"])
def test_row_alone_equals_row_in_any_batch(state_dtype, act_dtype, regime):
    kw = dict(act_dtype=act_dtype, state_dtype=state_dtype, regime=regime)
    target = row_data(42, TARGET_LEN, **kw)
    base = run_composition(target, COMPOSITIONS[0], kw, regime, 0)
    for ci, comp in enumerate(COMPOSITIONS[1:], 1):
        for ns_other in (0, 2, 8):
            got = run_composition(target, comp, kw, regime, ns_other)
            assert torch.equal(got[0], base[0]), f"composition {ci}: outputs differ"
            for name, a, b in zip(("correction", "key", "decay"), got[1], base[1]):
                assert torch.equal(a, b), f"composition {ci}: records.{name} differ"
            for n in base[2]:
                assert torch.equal(got[2][n], base[2][n]), f"composition {ci}: committed state n={n} differs"
    # sanity: the committed states for different n differ, so the comparison has teeth
    assert not torch.equal(base[2][1], base[2][TARGET_LEN])
    assert torch.equal(base[2][0], target["state0"])


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_decode_and_snapshot_batch_invariant(state_dtype):
    target = row_data(77, TARGET_LEN, state_dtype=state_dtype)
    results = []
    for lens, pos, tslot, oslots in COMPOSITIONS[:5]:
        rows = others(900, lens, state_dtype=state_dtype)
        rows.insert(pos, target)
        slots = list(oslots)
        slots.insert(pos, tslot)
        p = assemble(rows, slots, num_slots=24, layer_seed=4)
        pool = p.state.clone()
        out = rs.gdn_decode(p.q, p.k, p.v, **p.call_kwargs(state=pool))
        s = p.qsl[pos].item()
        pool2 = torch.cat([p.state, torch.zeros(len(rows) * 8, 4, 16, 16, dtype=state_dtype)])
        snap = torch.tensor([[24 + r * 8 + t for t in range(8)] for r in range(len(rows))], dtype=torch.int32)
        out2 = rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snap, **p.call_kwargs(state=pool2))
        results.append((out[s:s + TARGET_LEN].clone(), pool[tslot].clone(),
                        out2[s:s + TARGET_LEN].clone(), pool2[snap[pos, :TARGET_LEN].long()].clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)


def test_conv_batch_invariant():
    dim, width, T = 24, 4, 8
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    tx = torch.randn(TARGET_LEN, dim, generator=g)
    thist = torch.randn(dim, width - 1, generator=g)
    results = []
    for lens, pos, tslot, oslots in COMPOSITIONS[:5]:
        xs = [torch.randn(n, dim, generator=g) for n in lens]
        xs.insert(pos, tx)
        slots = list(oslots)
        slots.insert(pos, tslot)
        conv_state = torch.randn(24, dim, width - 1 + T, generator=g)
        conv_state[tslot, :, :width - 1] = thist
        qsl = [0]
        for x in xs:
            qsl.append(qsl[-1] + x.shape[0])
        y = rs.conv_verify(torch.cat(xs), conv_state, weight, bias, state_indices=i32(slots),
                           query_start_loc=i32(qsl))
        results.append(y[qsl[pos]:qsl[pos + 1]].clone())
    for r in results[1:]:
        assert torch.equal(r, results[0])
