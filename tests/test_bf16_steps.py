"""bf16 state pools: speculative steps give the bits of one-token-per-step decoding.

A bf16 pool's running state is rounded to bf16 after every token in every op (verify, decode,
the snapshot method, the commit's and the deferred replay), so for random windows and accepted
counts, GDN and KDA:

* verify + commit of n == n separate one-token ``*_decode`` calls (states and outputs),
* the snapshot of position n - 1 == the same,
* two deferred steps (the second verify replays the first step's commit) + flush == the
  decode calls of both steps' accepted tokens,

bit for bit, on ``cpu_ref`` and the Triton kernels (under the interpreter on the CPU, on the GPU
where one is present). With ``round_each_token=False`` (records and decode) the state is rounded
only where it is stored: verify + commit of n == one decode call of the n tokens, and the
deferred path == the eager one."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import recoverssm as rs
from helpers import backends, device_of

I32 = torch.int32
H, HV, K, V, T = 2, 4, 32, 32, 4
SLOTS = [3, 0, -1, 2]            # row 2 is padding


def _window(kind: str, lens: list, gen: torch.Generator, dev: str) -> dict:
    """Token inputs of one window per row (``lens[r]`` tokens), bf16 activations."""
    n = sum(lens)
    inputs = dict(q=torch.randn(n, H, K, generator=gen), k=torch.randn(n, H, K, generator=gen),
                  v=torch.randn(n, HV, V, generator=gen), b=torch.randn(n, HV, generator=gen))
    if kind == "gdn":
        inputs["a"] = torch.randn(n, HV, generator=gen)
    else:
        inputs["a"] = torch.randn(n, HV, K, generator=gen)
    qsl = [0]
    for length in lens:
        qsl.append(qsl[-1] + length)
    window = {name: x.to(torch.bfloat16).to(dev) for name, x in inputs.items()}
    window["query_start_loc"] = torch.tensor(qsl, dtype=I32, device=dev)
    return window


def _constants(kind: str, gen: torch.Generator, dev: str) -> dict:
    shape = (HV,) if kind == "gdn" else (HV, K)
    return dict(A_log=(torch.rand(HV, generator=gen) * 0.5).to(dev),
                dt_bias=(torch.randn(shape, generator=gen) * 0.5).to(dev))


def _tokens(window: dict, rows_tokens: list) -> dict:
    """The inputs of the listed tokens, one token per row."""
    idx = torch.tensor(rows_tokens, dtype=torch.long, device=window["q"].device)
    picked = {name: window[name][idx] for name in ("q", "k", "v", "a", "b")}
    picked["query_start_loc"] = torch.arange(len(rows_tokens) + 1, dtype=I32, device=idx.device)
    return picked


def _decode_call(kind: str, state, window: dict, consts: dict, counts: list, backend: str, **kw):
    """One decode call over the first ``counts[r]`` tokens of every row."""
    qsl = window["query_start_loc"].tolist()
    tokens = [qsl[r] + t for r in range(len(SLOTS)) for t in range(counts[r])]
    picked = _tokens(window, tokens)
    picked["query_start_loc"] = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=I32,
                                             device=state.device)
    op = rs.gdn_decode if kind == "gdn" else rs.kda_decode
    return op(picked["q"], picked["k"], picked["v"], state=state,
              state_indices=torch.tensor(SLOTS, dtype=I32, device=state.device),
              query_start_loc=picked["query_start_loc"], a=picked["a"], b=picked["b"], **consts, backend=backend,
              **kw)


def _verify(kind: str, state, slots, window: dict, consts: dict, records, backend: str, **pending):
    op = rs.gdn_verify if kind == "gdn" else rs.kda_verify
    return op(window["q"], window["k"], window["v"], state=state, state_indices=slots,
              query_start_loc=window["query_start_loc"], records=records, a=window["a"], b=window["b"], **consts,
              backend=backend, **pending)


def _decode_steps(kind: str, state, window: dict, consts: dict, counts: list, backend: str) -> dict:
    """``counts[r]`` one-token decode calls per row (one call per position, every row that still
    has a token in it); returns each decoded token's output, by token index."""
    op = rs.gdn_decode if kind == "gdn" else rs.kda_decode
    qsl = window["query_start_loc"].tolist()
    outs = {}
    for t in range(max(counts, default=0)):
        rows = [r for r in range(len(SLOTS)) if SLOTS[r] >= 0 and counts[r] > t]
        if not rows:
            continue
        tok = [qsl[r] + t for r in rows]
        one = _tokens(window, tok)
        slots = torch.tensor([SLOTS[r] for r in rows], dtype=I32, device=state.device)
        out = op(one["q"], one["k"], one["v"], state=state, state_indices=slots,
                 query_start_loc=one["query_start_loc"], a=one["a"], b=one["b"], **consts, backend=backend)
        for i, token in enumerate(tok):
            outs[token] = out[i]
    return outs


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, T + 1, (len(SLOTS),), generator=gen)]
    accepted = [0 if s < 0 else int(torch.randint(0, n + 1, (1,), generator=gen)) for n, s in zip(lens, SLOTS)]
    return gen, lens, accepted


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_commit_and_snapshot_equal_one_token_steps(backend, kind, seed):
    dev = device_of(backend)
    gen, lens, accepted = _case(seed)
    consts = _constants(kind, gen, dev)
    window = _window(kind, lens, gen, dev)
    pool = (torch.randn(4, HV, V, K, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    slots = torch.tensor(SLOTS, dtype=I32, device=dev)

    stepped = pool.clone()
    outs = _decode_steps(kind, stepped, window, consts, accepted, backend)

    records = rs.ReplayRecords.allocate(len(SLOTS), T, H, HV, K, V, device=dev, vector_decay=kind == "kda")
    committed = pool.clone()
    verified = _verify(kind, committed, slots, window, consts, records, backend)
    rs.CommitContext([[rs.LayerCache(committed, records)]], max_batch=len(SLOTS), backend=backend).commit(
        torch.tensor(accepted, dtype=I32, device=dev), slots, window["query_start_loc"])
    assert torch.equal(committed, stepped)
    for token, out in outs.items():
        assert torch.equal(verified[token], out), f"token {token}"

    if kind == "gdn":            # the snapshot method: the state after position n - 1 in its own slot
        snap_pool = torch.cat([pool, torch.zeros(len(SLOTS) * T, HV, V, K, dtype=pool.dtype, device=dev)])
        snaps = torch.tensor([[4 + r * T + t for t in range(T)] for r in range(len(SLOTS))], dtype=I32, device=dev)
        rs.gdn_spec_decode_snapshot(window["q"], window["k"], window["v"], state=snap_pool, state_indices=slots,
                                    query_start_loc=window["query_start_loc"], snapshot_slots=snaps,
                                    a=window["a"], b=window["b"], **consts, backend=backend)
        for r, n in enumerate(accepted):
            if SLOTS[r] >= 0 and n > 0:
                assert torch.equal(snap_pool[int(snaps[r, n - 1])], stepped[SLOTS[r]]), f"row {r}"


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_deferred_steps_equal_one_token_steps(backend, kind):
    """Step 1 verifies and defers its commit; step 2's verify replays it (records of the other
    buffer) before verifying its own window, then defers; the flush commits step 2."""
    dev = device_of(backend)
    gen, lens1, accepted1 = _case(7)
    _, lens2, accepted2 = _case(8)
    consts = _constants(kind, gen, dev)
    windows = [_window(kind, lens1, gen, dev), _window(kind, lens2, gen, dev)]
    pool = (torch.randn(4, HV, V, K, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    slots = torch.tensor(SLOTS, dtype=I32, device=dev)

    stepped = pool.clone()
    outs = [_decode_steps(kind, stepped, w, consts, n, backend) for w, n in ((windows[0], accepted1),
                                                                            (windows[1], accepted2))]

    deferred = pool.clone()
    records = rs.ReplayRecords.allocate(len(SLOTS), T, H, HV, K, V, device=dev, vector_decay=kind == "kda",
                                        buffers=2)
    ctx = rs.CommitContext([[rs.LayerCache(deferred, records)]], max_batch=len(SLOTS), deferred=True,
                           backend=backend)
    rows = torch.arange(len(SLOTS), dtype=I32, device=dev)
    for step, (window, accepted) in enumerate(zip(windows, (accepted1, accepted2))):
        verified = _verify(kind, deferred, slots, window, consts, records, backend, pending=ctx.pending,
                           pending_rows=rows)
        for token, out in outs[step].items():
            assert torch.equal(verified[token], out), f"step {step} token {token}"
        ctx.defer(torch.tensor(accepted, dtype=I32, device=dev), slots, window["query_start_loc"])
    ctx.flush(rows)
    assert torch.equal(deferred, stepped)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_rounding_only_where_stored(backend, kind):
    """``round_each_token=False``: verify + commit of n == one decode call of the n tokens (the
    state fp32 within the call, rounded once at the store), and deferred + flush == eager."""
    dev = device_of(backend)
    gen = torch.Generator().manual_seed(3)
    lens, accepted = [4, 3, 1, 4], [4, 2, 0, 3]
    consts = _constants(kind, gen, dev)
    window = _window(kind, lens, gen, dev)
    pool = (torch.randn(4, HV, V, K, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    slots = torch.tensor(SLOTS, dtype=I32, device=dev)

    decoded = pool.clone()
    _decode_call(kind, decoded, window, consts, accepted, backend, round_each_token=False)
    stepped = pool.clone()
    _decode_steps(kind, stepped, window, consts, accepted, backend)
    assert not torch.equal(decoded, stepped)      # the modes differ on these inputs (the test can tell them apart)

    vector_decay = kind == "kda"
    records = rs.ReplayRecords.allocate(len(SLOTS), T, H, HV, K, V, device=dev, vector_decay=vector_decay,
                                        round_each_token=False)
    committed = pool.clone()
    _verify(kind, committed, slots, window, consts, records, backend)
    rs.CommitContext([[rs.LayerCache(committed, records)]], max_batch=len(SLOTS), backend=backend).commit(
        torch.tensor(accepted, dtype=I32, device=dev), slots, window["query_start_loc"])
    assert torch.equal(committed, decoded)

    deferred = pool.clone()
    drecords = rs.ReplayRecords.allocate(len(SLOTS), T, H, HV, K, V, device=dev, vector_decay=vector_decay,
                                         buffers=2, round_each_token=False)
    ctx = rs.CommitContext([[rs.LayerCache(deferred, drecords)]], max_batch=len(SLOTS), deferred=True,
                           backend=backend)
    rows = torch.arange(len(SLOTS), dtype=I32, device=dev)
    _verify(kind, deferred, slots, window, consts, drecords, backend, pending=ctx.pending, pending_rows=rows)
    ctx.defer(torch.tensor(accepted, dtype=I32, device=dev), slots, window["query_start_loc"])
    _verify(kind, deferred, slots, window, consts, drecords, backend, pending=ctx.pending, pending_rows=rows)
    ctx.defer(torch.zeros(len(SLOTS), dtype=I32, device=dev), slots, window["query_start_loc"])
    assert torch.equal(deferred, decoded)


def test_the_mode_must_be_a_bool():
    with pytest.raises(TypeError, match="round_each_token"):
        rs.ReplayRecords.allocate(2, 2, 1, 1, 4, 4, round_each_token=1)
    x = torch.zeros(1, 1, 4)
    with pytest.raises(TypeError, match="gdn_decode: round_each_token must be a bool"):
        rs.gdn_decode(x, x, x, state=torch.zeros(1, 1, 4, 4), state_indices=torch.zeros(1, dtype=I32),
                      query_start_loc=torch.tensor([0, 1], dtype=I32), g=torch.zeros(1, 1), beta=torch.zeros(1, 1),
                      round_each_token="yes")
    records = dataclasses.replace(rs.ReplayRecords.allocate(2, 2, 1, 1, 4, 4), round_each_token=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        records.round_each_token = False         # frozen: a verify and its commit read one mode
    with pytest.raises(TypeError, match="records.round_each_token"):
        rs.CommitContext([[rs.LayerCache(torch.zeros(2, 1, 4, 4), records)]], max_batch=2)
