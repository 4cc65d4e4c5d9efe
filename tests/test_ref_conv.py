"""conv_verify against an independent computation, and conv compaction through the commit."""

import pytest
import torch
import torch.nn.functional as F

import recoverssm as rs
from helpers import (BF16, F32, assert_bf16_rounded, assert_close_rel, commit_one, i32, legal_accepted,
                     make_problem, qsl_of, ref_conv, run_verify)

LENS = [3, 0, 8, 1, 5, 2]
SLOTS = [4, 0, 1, -1, 6, 2]
DIM = 24
NUM_SLOTS = 9


def setup(width=4, x_dtype=F32, state_dtype=F32, w_dtype=F32, bias=True, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    hist = width - 1
    conv_state = torch.randn(NUM_SLOTS, DIM, hist + T, generator=g).to(state_dtype)
    weight = torch.randn(DIM, width, generator=g).to(w_dtype)
    b = torch.randn(DIM, generator=g).to(w_dtype) if bias else None
    x = torch.randn(sum(LENS), DIM, generator=g).to(x_dtype)
    return x, conv_state, weight, b


def conv1d_reference(x_row, history, weight, bias, silu):
    seq = torch.cat([history.double(), x_row.double().t()], 1)[None]          # [1, dim, hist+len]
    y = F.conv1d(seq, weight.double()[:, None, :], None if bias is None else bias.double(),
                 groups=weight.shape[0])[0].t()                                # [len, dim]
    return F.silu(y) if silu else y


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype,state_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_conv_verify_reference(activation, width, bias, x_dtype, state_dtype):
    x, conv_state, weight, b = setup(width, x_dtype, state_dtype, bias=bias)
    hist = width - 1
    before = conv_state.clone()
    y = rs.conv_verify(x, conv_state, weight, b, state_indices=i32(SLOTS), query_start_loc=qsl_of(LENS),
                       activation=activation)
    assert y.dtype == x_dtype and y.shape == x.shape
    qsl = qsl_of(LENS).tolist()
    exp_state = before.clone()
    for r, slot in enumerate(SLOTS):
        s, e = qsl[r], qsl[r + 1]
        if slot < 0:
            assert (y[s:e] == 0).all()
            continue
        if e == s:
            continue
        ref_loop = ref_conv(x[s:e], before[slot, :, :hist], weight, b, activation == "silu")
        ref_f = conv1d_reference(x[s:e], before[slot, :, :hist], weight, b, activation == "silu")
        assert (ref_loop - ref_f).abs().max() < 1e-10        # the two references agree
        if x_dtype == BF16:
            assert_bf16_rounded(y[s:e], ref_f, what=f"row {r}")
        else:
            assert_close_rel(y[s:e], ref_f, 1e-5, f"row {r}")
        exp_state[slot, :, hist:hist + e - s] = x[s:e].t().to(state_dtype)
    # window columns written, history columns and other slots (and columns past len) untouched
    assert torch.equal(conv_state, exp_state)


def test_conv_verify_strided_x_and_out():
    x, conv_state, weight, b = setup(seed=3)
    big = torch.full((x.shape[0], 2 * DIM + 5), float("nan"))
    big[:, 5:5 + DIM] = x
    xv = big[:, 5:5 + DIM]
    obuf = torch.full((x.shape[0], DIM + 7), float("nan"))
    out = obuf[:, 2:2 + DIM]
    cs2 = conv_state.clone()
    ret = rs.conv_verify(xv, conv_state, weight, b, state_indices=i32(SLOTS), query_start_loc=qsl_of(LENS),
                         out=out)
    assert ret is out
    y = rs.conv_verify(x, cs2, weight, b, state_indices=i32(SLOTS), query_start_loc=qsl_of(LENS))
    assert torch.equal(out, y) and torch.equal(conv_state, cs2)
    assert obuf[:, :2].isnan().all() and obuf[:, 2 + DIM:].isnan().all()


def test_conv_verify_activation_none_aliases():
    x, conv_state, weight, b = setup(seed=4)
    outs = [rs.conv_verify(x, conv_state.clone(), weight, b, state_indices=i32(SLOTS),
                           query_start_loc=qsl_of(LENS), activation=a) for a in (None, "none", "identity")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    silu = rs.conv_verify(x, conv_state.clone(), weight, b, state_indices=i32(SLOTS),
                          query_start_loc=qsl_of(LENS))
    assert not torch.equal(silu, outs[0])


def conv_commit_case(conv_dtype, width, seed):
    """Verify (GDN + conv) a ragged batch, return everything needed to commit with a conv state."""
    p = make_problem(LENS, SLOTS, seed=seed, num_slots=NUM_SLOTS)
    T = 8
    hist = width - 1
    g = torch.Generator().manual_seed(seed + 1)
    conv_state = torch.randn(NUM_SLOTS, DIM, hist + T, generator=g).to(conv_dtype)
    weight = torch.randn(DIM, width, generator=g)
    x = torch.randn(p.T_total, DIM, generator=g)
    history_before = conv_state[:, :, :hist].clone()
    rs.conv_verify(x, conv_state, weight, None, state_indices=p.state_indices, query_start_loc=p.qsl)
    _, records = run_verify(p, records=rs.ReplayRecords.allocate(len(LENS), T, 2, 4, 16, 16))
    return p, x, conv_state, history_before, records


@pytest.mark.parametrize("conv_dtype", [F32, BF16])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_compaction_non_align(conv_dtype, width):
    hist = width - 1
    p, x, conv_state, history_before, records = conv_commit_case(conv_dtype, width, seed=11)
    after_verify = conv_state.clone()
    qsl = p.qsl.tolist()
    for n in range(0, 10):
        cs = after_verify.clone()
        pool = p.state.clone()
        commit_one(pool, records, i32(legal_accepted([n] * len(LENS), LENS)), p.state_indices, p.qsl, conv_state=cs,
                   conv_width=width)
        exp = after_verify.clone()
        for r, slot in enumerate(SLOTS):
            m = min(n, LENS[r])
            if slot < 0 or m == 0:
                continue
            seq = torch.cat([history_before[slot], x[qsl[r]:qsl[r + 1]].t().to(conv_dtype)], 1)
            exp[slot, :, :hist] = seq[:, m:m + hist]
        assert torch.equal(cs, exp), f"n={n}"
        if n == 0:
            assert torch.equal(cs, after_verify)


def test_conv_compaction_mixed_accepts_and_commit_state():
    p, x, conv_state, history_before, records = conv_commit_case(F32, 4, seed=12)
    ns = legal_accepted([1, 5, 8, 1, 3, 0], LENS)
    pool_a = p.state.clone()
    commit_one(pool_a, records, i32(ns), p.state_indices, p.qsl, conv_state=conv_state, conv_width=4)
    pool_b = p.state.clone()
    commit_one(pool_b, records, i32(ns), p.state_indices, p.qsl)
    assert torch.equal(pool_a, pool_b), "a conv state must not change the recurrent commit"
    qsl = p.qsl.tolist()
    for r, slot in enumerate(SLOTS):
        m = min(ns[r], LENS[r])
        if slot < 0:
            continue
        seq = torch.cat([history_before[slot], x[qsl[r]:qsl[r + 1]].t()], 1)
        assert torch.equal(conv_state[slot, :, :3], seq[:, m:m + 3])
