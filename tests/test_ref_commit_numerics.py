"""The commit's rounding, checked exactly:

    S' = S * d            one fp32 multiply, rounded
    S  = fma(c, k^, S')   S'[i,j] + c[i] * k^[j] with ONE rounding
    S  = bf16(S)          with a bf16 pool, after every token (to nearest even)

The expected values are computed with exact rational arithmetic (``fractions.Fraction``) and
correctly rounded to fp32 here, independently of the library's fma helper. Records are written by
the test, so every value is known exactly.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch

import recoverssm as rs
from helpers import BF16, F32, i32, qsl_of


def round_f32(x: Fraction) -> np.float32:
    """``x`` correctly rounded to fp32 (round to nearest, ties to even)."""
    approx = np.float32(float(x))
    cands = [np.nextafter(approx, np.float32(-np.inf)), approx, np.nextafter(approx, np.float32(np.inf))]
    best = None
    for c in cands:
        if not np.isfinite(c):
            continue
        err = abs(Fraction(float(c)) - x)
        if best is None or err < best[0] or (err == best[0] and int(c.view(np.int32)) % 2 == 0):
            best = (err, c)
    return best[1]


def exact_commit(S0: np.ndarray, corr: np.ndarray, key: np.ndarray, decay: np.ndarray, n: int,
                 pool_dtype: torch.dtype = torch.float32) -> np.ndarray:
    """One (row, head) tile: S0 [V, K] fp32; corr [T, V]; key [T, K]; decay [T] or [T, K]; the
    state rounded to ``pool_dtype`` after every token."""
    S = S0.astype(np.float32).copy()
    V, K = S.shape
    for t in range(n):
        new = np.empty_like(S)
        for i in range(V):
            for j in range(K):
                d = decay[t] if decay.ndim == 1 else decay[t, j]
                sp = round_f32(Fraction(float(S[i, j])) * Fraction(float(d)))
                new[i, j] = round_f32(Fraction(float(sp)) + Fraction(float(corr[t, i])) * Fraction(float(key[t, j])))
        S = torch.from_numpy(new).to(pool_dtype).float().numpy()
    return S


def setup(vector_decay, state_dtype, seed=0, B=2, H=1, HV=2, K=4, V=4, T=3):
    g = torch.Generator().manual_seed(seed)
    records = rs.ReplayRecords.allocate(B, T, H, HV, K, V, vector_decay=vector_decay)
    records.correction.copy_(torch.randn(records.correction.shape, generator=g))
    records.key.copy_(torch.randn(records.key.shape, generator=g) * 0.5)
    records.decay.copy_(torch.rand(records.decay.shape, generator=g) * 0.5 + 0.5)
    state = torch.randn(B + 1, HV, V, K, generator=g).to(state_dtype)
    # Crafted values (row 0, head 0, t = 0; e = 2^-12; d = 1 + e on the elements used):
    #  [0, 0]: S = 1 + e, c = 1 + e, k = -1. S*d = 1 + 2e + e^2 rounds to 1 + 2e, so the result is
    #          e; with an unrounded S*d it would be e + e^2.
    #  [0, 1]: S = -1, c = 1 + e, k = 1 + e. S' = -(1 + e) exactly; the fused result is e + e^2,
    #          with the product rounded first (two roundings) it would be e.
    e = 2.0 ** -12
    if state_dtype == F32:
        state[0, 0, 0, 0] = 1 + e
        state[0, 0, 0, 1] = -1.0
        if vector_decay:
            records.decay[0, 0, 0, :2] = 1 + e
        else:
            records.decay[0, 0, 0] = 1 + e
        records.correction[0, 0, 0, 0] = 1 + e
        records.key[0, 0, 0, 0] = -1.0
        records.key[0, 0, 0, 1] = 1 + e
    return records, state


@pytest.mark.parametrize("vector_decay", [False, True])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_commit_rounding_is_exact(vector_decay, state_dtype):
    B, T = 2, 3
    records, state = setup(vector_decay, state_dtype)
    H, HV = records.key.shape[1], records.correction.shape[1]
    slots = [0, 2]
    lens = [3, 2]
    for n in range(0, T + 1):
        pool = state.clone()
        ctx = rs.CommitContext([[rs.LayerCache(pool, records)]], max_batch=B)
        ctx.commit(i32([min(n, length) for length in lens]), i32(slots), qsl_of(lens))
        for r, slot in enumerate(slots):
            m = min(n, lens[r])
            for hv in range(HV):
                h = hv // (HV // H)
                exp = exact_commit(state[slot, hv].float().numpy(), records.correction[r, hv].numpy(),
                                   records.key[r, h].numpy(), records.decay[r, hv].numpy(), m, state_dtype)
                expected = torch.from_numpy(exp).to(state_dtype)
                assert torch.equal(pool[slot, hv], expected), f"n={n} row {r} head {hv}"
        assert torch.equal(pool[1], state[1])


def test_crafted_values_separate_fused_from_unfused():
    """The crafted elements really tell one rounding from two, and a rounded decay product from an
    unrounded one (so the exact test above catches either mistake); the library gets both right."""
    e = 2.0 ** -12
    F = Fraction
    # [0, 0]
    rounded = round_f32(F(float(round_f32(F(1 + e) * F(1 + e)))) + F(1 + e) * F(-1.0))
    unrounded_decay = round_f32(F(1 + e) * F(1 + e) + F(1 + e) * F(-1.0))
    assert float(rounded) == e and float(unrounded_decay) == e + e * e
    # [0, 1]
    fused = round_f32(F(-(1 + e)) + F(1 + e) * F(1 + e))
    two_roundings = round_f32(F(-(1 + e)) + F(float(round_f32(F(1 + e) * F(1 + e)))))
    assert float(fused) == e + e * e and float(two_roundings) == e
    for vector_decay in (False, True):
        records, state = setup(vector_decay, F32)
        pool = state.clone()
        rs.CommitContext([[rs.LayerCache(pool, records)]], max_batch=2).commit(
            i32([1, 0]), i32([0, 2]), qsl_of([3, 2]))
        assert pool[0, 0, 0, 0].item() == e
        assert pool[0, 0, 0, 1].item() == e + e * e


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_fma_double_rounding_case(sign):
    """c * k = 2^-24 + 2^-60, S' = 1: the exact sum lies just above the fp32 midpoint 1 + 2^-24.
    A float64 sum rounds onto the midpoint and a second rounding to fp32 would give 1 (ties to
    even); one correct rounding gives 1 + 2^-23."""
    c = 2.0 ** -24 * (1 + 2.0 ** -12)
    k = 1 - 4095 * 2.0 ** -24
    assert float(np.float32(c)) == c and float(np.float32(k)) == k
    exact = Fraction(sign) + Fraction(sign * c) * Fraction(k)
    assert exact == int(sign) * (1 + Fraction(1, 2 ** 24) + Fraction(1, 2 ** 60))
    assert float(round_f32(exact)) == sign * (1 + 2.0 ** -23)
    assert float(np.float32(float(exact))) == sign * 1.0          # what double rounding gives
    records = rs.ReplayRecords.allocate(1, 1, 1, 1, 1, 1)
    records.correction.fill_(sign * c)
    records.key.fill_(k)
    records.decay.fill_(1.0)
    pool = torch.full((1, 1, 1, 1), sign)
    rs.CommitContext([[rs.LayerCache(pool, records)]], max_batch=1).commit(i32([1]), i32([0]), i32([0, 1]))
    assert pool.item() == sign * (1 + 2.0 ** -23)
