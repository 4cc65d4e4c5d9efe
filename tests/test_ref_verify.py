"""gdn_verify (and the native paths) against an independent float64 step-by-step reference."""

import pytest
import torch

import recoverssm as rs
from helpers import (BF16, F32, Dims, assert_bf16_rounded, assert_close_rel, i32, make_problem,
                     ref_gdn, run_verify)

FP32_TOL = 1e-5
# With a bf16 pool the state is rounded to bf16 after every token, here and in the float64
# reference; an element within fp32 error of a bf16 rounding midpoint may round the other way
# in the two, and the later tokens' outputs and corrections then differ by a part of one bf16
# ulp of that element. (The bit-exact checks of the rounding are in test_ref_commit_exact.py
# and test_ref_commit_numerics.py.)
BF16_POOL_TOL = 2.0 ** -12
LENS = [3, 0, 8, 1, 5, 4]          # ragged, with a zero-length row
SLOTS = [4, 0, 1, -1, 6, 2]        # row 3 is a padding row with a token


def check_against_ref(p, out, records, ref, *, out_dtype=F32, padding_zero=True):
    qsl = p.qsl.tolist()
    tol = FP32_TOL if p.state.dtype == F32 else BF16_POOL_TOL
    live = [r for r in range(p.B) if p.state_indices[r] > -1 and p.lens[r] > 0]
    assert live, "test problem has no live row"
    for r in live:
        s, e = qsl[r], qsl[r + 1]
        n = e - s
        if out_dtype == BF16:
            assert_bf16_rounded(out[s:e], ref["out"][s:e], what=f"out row {r}")
        else:
            assert_close_rel(out[s:e], ref["out"][s:e], tol, f"out row {r}")
        assert_close_rel(records.correction[r, :, :n], ref["corr"][r], tol, f"correction row {r}")
        assert_close_rel(records.key[r, :, :n], ref["key"][r], FP32_TOL, f"key row {r}")
        assert_close_rel(records.decay[r, :, :n], ref["decay"][r], FP32_TOL, f"decay row {r}")
    if padding_zero:
        for r in range(p.B):
            if r not in live:
                assert (out[qsl[r]:qsl[r + 1]] == 0).all(), f"padding row {r} output not zero"


@pytest.mark.parametrize("gate_form", ["raw", "pre"])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_verify_matches_float64_reference(gate_form, state_dtype):
    p = make_problem(LENS, SLOTS, seed=1, gate_form=gate_form, state_dtype=state_dtype)
    state_before = p.state.clone()
    # out pre-filled with garbage: verify must write every token, zeros for padding rows
    out = torch.full((p.T_total, 4, 16), 7.0)
    records = p.records()
    ret = rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, **p.call_kwargs())
    assert ret is out
    assert torch.equal(p.state, state_before), "verify wrote the read-only state"
    check_against_ref(p, out, records, ref_gdn(p))


@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_verify_reference_each_window_length(T):
    p = make_problem([T, max(T - 1, 0), T], [0, 2, 5], seed=10 + T)
    out, records = run_verify(p)
    check_against_ref(p, out, records, ref_gdn(p))


def test_verify_extreme_gates_reference():
    """Decay ~1 and ~0 (and underflow), beta ~0 and ~1, a + dt_bias > 20 (softplus linear branch)."""
    p = make_problem([8, 8, 5], [0, 1, 2], seed=3, regime="extreme")
    out, records = run_verify(p)
    check_against_ref(p, out, records, ref_gdn(p))
    d = records.decay[:3]
    assert (d == 1.0).any() and (d == 0.0).any() and ((d > 0.999) & (d < 1.0)).any()


def test_softplus_linear_branch_is_observable():
    """a + dt_bias = 95 with A = exp(-10): log1p(exp(95)) overflows fp32 (decay would be 0); the
    linear branch gives g = -exp(-10) * 95, decay ~0.9957."""
    dims = Dims(H=1, HV=1, K=16, V=16)
    p = make_problem([2], [0], dims=dims, seed=4)
    p.gates["a"] = torch.full((2, 1), 95.0)
    p.gates["dt_bias"] = torch.zeros(1)
    p.gates["A_log"] = torch.full((1,), -10.0)
    out, records = run_verify(p)
    ref = ref_gdn(p)
    expected = torch.exp(torch.tensor(-torch.exp(torch.tensor(-10.0, dtype=torch.float64)).item() * 95.0))
    assert abs(records.decay[0, 0, 0].item() - expected.item()) < 1e-6
    check_against_ref(p, out, records, ref)


@pytest.mark.parametrize("gate_form", ["raw", "pre"])
def test_verify_no_l2norm_and_custom_scale(gate_form):
    p = make_problem(LENS, SLOTS, seed=5, gate_form=gate_form)
    # without l2norm the keys must stay small for a stable recurrence
    p.k.mul_(0.2)
    for use_l2, scale in ((False, None), (True, 0.37), (False, 1.3)):
        out, records = run_verify(p, use_qk_l2norm=use_l2, scale=scale)
        check_against_ref(p, out, records, ref_gdn(p, scale=scale, use_qk_l2norm=use_l2))
    # the default scale is K ** -0.5 and actually differs from scale=1.0
    o_default, _ = run_verify(p)
    o_explicit, _ = run_verify(p, scale=16 ** -0.5)
    o_one, _ = run_verify(p, scale=1.0)
    assert torch.equal(o_default, o_explicit)
    assert not torch.equal(o_default, o_one)


@pytest.mark.parametrize("gate_form", ["raw", "pre"])
def test_verify_strided_views_and_strided_out(gate_form):
    """q/k/v are views into one fused projection [T, 2*H*K + HV*V + pad], a/b (g/beta) views into
    one gate tensor, out a strided view: same bits as contiguous inputs, and the pad untouched."""
    fused = make_problem(LENS, SLOTS, seed=6, gate_form=gate_form, fused=True)
    plain = make_problem(LENS, SLOTS, seed=6, gate_form=gate_form)
    assert not fused.q.is_contiguous() and fused.q.stride(-1) == 1
    assert not fused.v.is_contiguous()
    buf = torch.full((fused.T_total, 4, 16 + 3), float("nan"))
    out = buf[..., :16]
    assert not out.is_contiguous()
    rec_f = fused.records()
    rs.gdn_verify(fused.q, fused.k, fused.v, records=rec_f, out=out, **fused.call_kwargs())
    assert torch.isnan(buf[..., 16:]).all(), "verify wrote outside the out view"
    o_plain, rec_p = run_verify(plain)
    assert torch.equal(out, o_plain)
    for name in ("correction", "key", "decay"):
        assert torch.equal(getattr(rec_f, name), getattr(rec_p, name))
    check_against_ref(fused, out, rec_f, ref_gdn(plain))


@pytest.mark.parametrize("gate_form", ["raw", "pre"])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_verify_bf16_activations(gate_form, state_dtype):
    p = make_problem(LENS, SLOTS, seed=7, act_dtype=BF16, gate_form=gate_form, state_dtype=state_dtype)
    out, records = run_verify(p)
    assert out.dtype == BF16
    check_against_ref(p, out, records, ref_gdn(p), out_dtype=BF16)


@pytest.mark.parametrize("K,V,H,HV", [(32, 16, 2, 4), (16, 32, 1, 4), (32, 32, 2, 2)])
def test_verify_other_head_shapes(K, V, H, HV):
    p = make_problem([4, 2, 8], [0, 3, 1], dims=Dims(H=H, HV=HV, K=K, V=V), seed=8)
    out, records = run_verify(p)
    check_against_ref(p, out, records, ref_gdn(p))


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_decode_and_snapshot_match_reference(state_dtype):
    """The native paths agree with the float64 reference too: outputs, the final state written by
    decode and every per-position state written by the snapshot method."""
    lens, slots = [3, 0, 8, 5], [0, 1, 2, -1]
    p = make_problem(lens, slots, seed=9, state_dtype=state_dtype)
    ref = ref_gdn(p)
    state_tol = FP32_TOL if state_dtype == F32 else 2.0 ** -8

    pool = p.state.clone()
    out = rs.gdn_decode(p.q, p.k, p.v, **p.call_kwargs(state=pool))
    check_out_only(p, out, ref)
    for r in (0, 2):
        assert_close_rel(pool[slots[r]], ref["states"][r][-1], state_tol, f"decode state row {r}")
    assert torch.equal(pool[1], p.state[1]) and torch.equal(pool[3:], p.state[3:])

    pool = torch.zeros(40, 4, 16, 16, dtype=state_dtype)
    pool[:4] = p.state[:4]
    snap = torch.full((4, 8), -1, dtype=torch.int32)
    snap[0, :3] = i32([10, 11, 12])
    snap[2, :8] = i32(range(20, 28))
    snap[1, 0] = 30                      # zero-length row: writes nothing
    snap[3, :5] = i32(range(31, 36))     # padding row: writes nothing
    out = rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snap, **p.call_kwargs(state=pool))
    check_out_only(p, out, ref)
    for r, base in ((0, 10), (2, 20)):
        for t in range(lens[r]):
            assert_close_rel(pool[base + t], ref["states"][r][t + 1], state_tol, f"snapshot row {r} t {t}")
    assert (pool[30:] == 0).all() and (pool[4:10] == 0).all()
    assert torch.equal(pool[:4], p.state[:4]), "snapshot wrote the source slots"


def check_out_only(p, out, ref):
    qsl = p.qsl.tolist()
    for r in range(p.B):
        s, e = qsl[r], qsl[r + 1]
        if e == s:
            continue
        if p.state_indices[r] < 0:
            assert (out[s:e] == 0).all()
        else:
            assert_close_rel(out[s:e], ref["out"][s:e], FP32_TOL, f"out row {r}")


def test_verify_grouped_heads_use_their_qk_head():
    """HV = 2H: value heads 0,1 use q/k head 0 and heads 2,3 use head 1. Changing q/k head 1 must
    change exactly the outputs and records of value heads 2 and 3."""
    p = make_problem([4], [0], seed=11)
    o1, r1 = run_verify(p)
    o1, c1 = o1.clone(), r1.correction.clone()
    p.k[:, 1] += 0.5
    o2, r2 = run_verify(p)
    assert torch.equal(o1[:, :2], o2[:, :2]) and not torch.equal(o1[:, 2:], o2[:, 2:])
    assert torch.equal(c1[:, :2], r2.correction[:, :2]) and not torch.equal(c1[:, 2:], r2.correction[:, 2:])
