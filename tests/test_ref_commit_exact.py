"""The commit of verify's records is bit-identical to the native per-token path.

Accepted counts within each row's window go through the public commit (value checks on); counts
outside it (negative, past the window) go through the committer with no checks, which clamps
them, as a GPU commit with ``check`` off does."""

import random

import pytest
import torch

import recoverssm as rs
from helpers import (BF16, F32, commit_one, commit_unchecked, decode_after, i32, legal_accepted, make_problem,
                     run_verify)

# ragged and padded batches per window length: (lens, slots); -1 = padding row
BATCHES = {
    1: ([1, 0, 1, 1], [3, 0, -1, 5]),
    2: ([2, 1, 0, 2, 2], [0, 6, 2, -1, 4]),
    4: ([4, 2, 0, 3, 4, 1], [7, 1, 3, -1, 0, 5]),
    8: ([8, 3, 0, 5, 8, 1, 6], [2, 9, 4, -1, 0, 11, 6]),
}


def commit_state(p, records, ns, checked=True, **kw):
    """The pool after a commit of ``ns``: through the public API (``checked``), else with no value checks."""
    pool = p.state.clone()
    (commit_one if checked else commit_unchecked)(pool, records, i32(ns), p.state_indices, p.qsl, **kw)
    return pool


@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("regime,gate_form", [("normal", "raw"), ("extreme", "raw"),
                                              ("normal", "pre"), ("extreme", "pre")])
def test_commit_equals_decode_every_n(T, state_dtype, regime, gate_form):
    lens, slots = BATCHES[T]
    p = make_problem(lens, slots, seed=T, state_dtype=state_dtype, regime=regime, gate_form=gate_form)
    state_before = p.state.clone()
    _, records = run_verify(p)
    assert torch.equal(p.state, state_before)
    distinct = set()
    for n in range(0, T + 3):          # n > len: rejected by the checks, clamped to len by the kernels
        ns = [n] * p.B
        committed = commit_state(p, records, legal_accepted(ns, lens))
        expected = decode_after(p, ns)
        assert torch.equal(committed, expected), f"n={n}: commit != decode"
        assert torch.equal(commit_state(p, records, ns, checked=False), expected), f"n={n}: unchecked"
        if n == 0:
            assert torch.equal(committed, p.state), "n=0 must leave the pool unchanged"
        bits = committed if state_dtype == F32 else committed.view(torch.int16)
        distinct.add(bits.numpy().tobytes())
    # the test must be able to tell n apart (every n up to T gives a different pool)
    assert len(distinct) == T + 1


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["normal", "extreme"])
def test_commit_equals_decode_mixed_accepts(state_dtype, regime):
    """Each row accepts its own count (including 0, len, and more than len)."""
    lens, slots = BATCHES[8]
    p = make_problem(lens, slots, seed=21, state_dtype=state_dtype, regime=regime)
    _, records = run_verify(p)
    rng = random.Random(5)
    for _ in range(12):
        ns = [rng.randint(0, 10) for _ in lens]
        expected = decode_after(p, ns)
        assert torch.equal(commit_state(p, records, legal_accepted(ns, lens)), expected), ns
        assert torch.equal(commit_state(p, records, ns, checked=False), expected), ns
    # a negative num_accepted: rejected by the checks; the kernels clamp it to 0 (nothing written)
    with pytest.raises(ValueError, match="^CommitContext.commit: num_accepted entry 0 = -3 is outside"):
        commit_state(p, records, [-3] * p.B)
    assert torch.equal(commit_state(p, records, [-3] * p.B, checked=False), p.state)


def test_commit_ignores_records_past_commit_len():
    """Records beyond position n-1 (and of other rows) are not read: scribbling on them changes nothing."""
    lens, slots = BATCHES[4]
    p = make_problem(lens, slots, seed=22)
    _, records = run_verify(p)
    ns = legal_accepted([2, 1, 0, 3, 1, 1], lens)
    ref = commit_state(p, records, ns)
    for r, n in enumerate(ns):
        m = min(n, lens[r])
        records.correction[r, :, m:] = float("nan")
        records.key[r, :, m:] = float("nan")
        records.decay[r, :, m:] = float("nan")
    records.correction[len(lens):] = float("nan")
    assert torch.equal(commit_state(p, records, ns), ref)


def test_commit_from_records_only_not_inputs():
    """The commit reads only records and state: the verify inputs may change afterwards."""
    lens, slots = BATCHES[4]
    p = make_problem(lens, slots, seed=23)
    _, records = run_verify(p)
    ns = legal_accepted([4, 2, 1, 3, 4, 1], lens)
    expected = decode_after(p, ns)
    p.q.zero_(), p.k.zero_(), p.v.zero_()
    assert torch.equal(commit_state(p, records, ns), expected)


@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["normal", "extreme"])
def test_snapshot_slot_equals_commit(T, state_dtype, regime):
    """gdn_spec_decode_snapshot's slot after position t == commit with n = t + 1, bit for bit; its
    outputs equal verify's."""
    lens, slots = BATCHES[T]
    p = make_problem(lens, slots, seed=30 + T, state_dtype=state_dtype, regime=regime)
    B = p.B
    num_slots = p.state.shape[0]
    pool = torch.cat([p.state, torch.zeros(B * T, *p.state.shape[1:], dtype=state_dtype)])
    snap = torch.tensor([[num_slots + r * T + t for t in range(T)] for r in range(B)], dtype=torch.int32)
    out_snap = rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snap, **p.call_kwargs(state=pool))
    assert torch.equal(pool[:num_slots], p.state)
    out_ver, records = run_verify(p)
    assert torch.equal(out_snap, out_ver)
    for t in range(T):
        committed = commit_state(p, records, legal_accepted([t + 1] * B, lens))
        for r in range(B):
            if slots[r] < 0 or lens[r] <= t:
                assert (pool[snap[r, t]] == 0).all(), f"row {r} t {t}: snapshot slot written"
                continue
            assert torch.equal(pool[snap[r, t]], committed[slots[r]]), f"row {r} t {t}"


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_decode_in_one_call_equals_decode_token_by_token(state_dtype):
    """The native path in one call == one token per call, states and outputs: a bf16 pool's
    running state is rounded to bf16 after every token, as each one-token call stores it."""
    lens, slots = [4, 2, 3], [0, 1, 2]
    p = make_problem(lens, slots, seed=40, state_dtype=state_dtype)
    whole = p.state.clone()
    whole_out = rs.gdn_decode(p.q, p.k, p.v, state=whole, state_indices=p.state_indices, query_start_loc=p.qsl,
                              **p.gates)
    pool = p.state.clone()
    qsl = p.qsl.tolist()
    for t in range(max(lens)):
        rows = [r for r in range(p.B) if lens[r] > t]
        idx = torch.tensor([qsl[r] + t for r in rows])
        gates = {k: (v if k in ("A_log", "dt_bias") else v[idx]) for k, v in p.gates.items()}
        out = rs.gdn_decode(p.q[idx], p.k[idx], p.v[idx], state=pool, state_indices=p.state_indices[rows],
                            query_start_loc=i32(range(len(rows) + 1)), **gates)
        assert torch.equal(out, whole_out[idx]), f"token {t}"
    assert torch.equal(pool, whole)
