"""conv_decode: one token per row. Its conv state is bit-exact against cpu_ref, n calls leave the
state that conv_verify of the n tokens plus a commit leaves, and its output is conv_verify's for
a one-token window."""
from __future__ import annotations


import pytest
import torch

import recoverssm as rs

from helpers import backends, device_of

I32 = torch.int32


def conv_problem(num_slots=6, dim=20, width=4, window=4, dtype=torch.float32, state_dtype=torch.float32, seed=0,
                 device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return dict(conv_state=torch.randn(num_slots, dim, width - 1 + window, generator=g).to(state_dtype).to(device),
                weight=torch.randn(dim, width, generator=g).to(dtype).to(device),
                bias=torch.randn(dim, generator=g).to(dtype).to(device))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_decode_matches_cpu_ref(backend, state_dtype, width):
    dev = device_of(backend)
    p = conv_problem(width=width, state_dtype=state_dtype, seed=width, device=dev)
    x = torch.randn(4, 20, generator=torch.Generator().manual_seed(1)).to(dev)
    slots = torch.tensor([2, -1, 0, 5], dtype=I32, device=dev)
    ref_state = p["conv_state"].cpu().clone()
    ref = rs.conv_decode(x.cpu(), ref_state, p["weight"].cpu(), p["bias"].cpu(), state_indices=slots.cpu(),
                         backend="cpu_ref")
    state = p["conv_state"].clone()
    out = rs.conv_decode(x, state, p["weight"], p["bias"], state_indices=slots, backend=backend)
    assert torch.equal(state.cpu(), ref_state), "conv state differs from cpu_ref"
    assert torch.allclose(out.cpu(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1].cpu(), torch.zeros(20)), "a padding row's output must be zeros"
    untouched = [1, 3, 4]
    assert torch.equal(state[untouched], p["conv_state"][untouched])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_n_decodes_equal_verify_and_commit(backend, state_dtype):
    """n calls of conv_decode == conv_verify of the n tokens, then a commit of n tokens (the conv
    compaction), bit for bit. The outputs agree too where the conv state holds x exactly (verify
    reads a window's earlier tokens from x, decode from the history, rounded to its dtype)."""
    dev = device_of(backend)
    width, window, dim, n = 4, 4, 20, 3
    p = conv_problem(width=width, window=window, dim=dim, state_dtype=state_dtype, device=dev)
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(2)).to(dev)
    slot = torch.tensor([3], dtype=I32, device=dev)
    decoded = p["conv_state"].clone()
    outs = [rs.conv_decode(x[t:t + 1], decoded, p["weight"], p["bias"], state_indices=slot, backend=backend)
            for t in range(n)]
    verified = p["conv_state"].clone()
    y = rs.conv_verify(x, verified, p["weight"], p["bias"], state_indices=slot,
                       query_start_loc=torch.tensor([0, n], dtype=I32, device=dev), backend=backend)
    state = torch.zeros(verified.shape[0], 1, 4, 4, device=dev)
    records = rs.ReplayRecords.allocate(1, window, 1, 1, 4, 4, device=dev)
    records.decay.fill_(1.0)                       # the recurrent state is left as it is
    ctx = rs.CommitContext([[rs.LayerCache(state, records, verified, conv_width=width)]], max_batch=1,
                           backend=backend)
    ctx.commit(torch.tensor([n], dtype=I32, device=dev), slot, torch.tensor([0, n], dtype=I32, device=dev))
    history = width - 1
    assert torch.equal(decoded[:, :, :history], verified[:, :, :history])
    if state_dtype == x.dtype:
        assert torch.equal(torch.cat(outs), y)


def test_decode_only_pool_with_history_columns_only():
    """A pool with exactly the history columns serves conv_decode (no window columns needed)."""
    p = conv_problem(window=0)
    x = torch.randn(2, 20)
    rs.conv_decode(x, p["conv_state"], p["weight"], p["bias"], state_indices=torch.tensor([0, 1], dtype=I32))
    assert torch.equal(p["conv_state"][:2, :, -1], x)


@pytest.mark.parametrize("mutate, name", [
    (lambda kw: kw.update(x=torch.randn(3, 20)), "x"),                                    # rows != B
    (lambda kw: kw.update(state_indices=torch.tensor([0, 0], dtype=I32)), "state_indices"),  # one slot twice
    (lambda kw: kw.update(state_indices=torch.tensor([0, 6], dtype=I32)), "state_indices"),  # not a slot
    (lambda kw: kw.update(out=kw["x"]), "out"),                                           # out is x
    (lambda kw: kw.update(weight=torch.randn(20, 0)), "weight"),                          # no taps
])
def test_decode_rejects(mutate, name):
    p = conv_problem()
    kw = dict(x=torch.randn(2, 20), conv_state=p["conv_state"], weight=p["weight"], bias=p["bias"],
              state_indices=torch.tensor([0, 1], dtype=I32), out=torch.zeros(2, 20))
    mutate(kw)
    before = {k: v.clone() for k, v in kw.items()}
    with pytest.raises(ValueError, match=rf"^conv_decode: {name} "):
        rs.conv_decode(kw.pop("x"), kw.pop("conv_state"), kw.pop("weight"), kw.pop("bias"), **kw)
    for k, v in before.items():
        if k in kw:
            assert torch.equal(kw[k], v)
