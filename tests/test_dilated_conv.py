"""The dilated short conv (``dilation`` on ``conv_verify``, ``conv_decode`` and ``LayerCache``):
taps ``dilation`` tokens apart over ``(width - 1) * dilation`` history columns, as Qwen4Exp's
per-layer-embedding conv. Against ``torch.nn.functional.conv1d`` within fp32 rounding, and bit
for bit: ``n`` ``conv_decode`` calls == ``conv_verify`` of the ``n`` tokens and a commit of them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recoverssm as rs
from helpers import backends, device_of

I32 = torch.int32
DIM, WIDTH, T = 12, 4, 5


def _pool(history: int, slots: int = 3, gen=None, dtype=torch.float32):
    return torch.randn(slots, DIM, history + T, generator=gen).to(dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dilation", [1, 2, 3])
def test_verify_is_the_dilated_conv(backend, dilation):
    dev = device_of(backend)
    g = torch.Generator().manual_seed(dilation)
    history = (WIDTH - 1) * dilation
    pool = _pool(history, gen=g).to(dev)
    weight = torch.randn(DIM, WIDTH, generator=g).to(dev)
    bias = torch.randn(DIM, generator=g).to(dev)
    x = torch.randn(7, DIM, generator=g).to(dev)
    slots = torch.tensor([2, 0], dtype=I32, device=dev)
    qsl = torch.tensor([0, 4, 7], dtype=I32, device=dev)
    before = pool.clone()
    y = rs.conv_verify(x, pool, weight, bias, state_indices=slots, query_start_loc=qsl, dilation=dilation,
                       backend=backend)
    for r, (slot, a, b) in enumerate([(2, 0, 4), (0, 4, 7)]):
        seq = torch.cat([before[slot, :, :history], x[a:b].t()], dim=1)[None].cpu().double()
        want = F.silu(F.conv1d(seq, weight.cpu().double()[:, None, :], bias.cpu().double(), dilation=dilation,
                               groups=DIM))[0].t()
        torch.testing.assert_close(y[a:b].cpu().double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(pool[slot, :, history:history + b - a], x[a:b].t())       # the window's inputs
        assert torch.equal(pool[slot, :, :history], before[slot, :, :history])      # history read only


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dilation", [2, 3])
def test_decode_steps_equal_verify_and_commit(backend, dilation):
    """For every accepted count n: n conv_decode calls leave the history the commit of n leaves,
    and give conv_verify's outputs (fp32 inputs: the history holds them exactly)."""
    dev = device_of(backend)
    g = torch.Generator().manual_seed(10 + dilation)
    history = (WIDTH - 1) * dilation
    weight = torch.randn(DIM, WIDTH, generator=g).to(dev)
    x = torch.randn(T, DIM, generator=g).to(dev)
    start = _pool(history, slots=1, gen=g).to(dev)
    slots = torch.zeros(1, dtype=I32, device=dev)
    qsl = torch.tensor([0, T], dtype=I32, device=dev)
    for n in range(T + 1):
        verified = start.clone()
        records = rs.ReplayRecords.allocate(1, T, 1, 1, 4, 4, device=dev)
        state = torch.zeros(1, 1, 4, 4, device=dev)
        y = rs.conv_verify(x, verified, weight, None, state_indices=slots, query_start_loc=qsl, dilation=dilation,
                           backend=backend)
        ctx = rs.CommitContext([[rs.LayerCache(state, records, verified, conv_width=WIDTH, conv_dilation=dilation)]],
                               max_batch=1, backend=backend)
        ctx.commit(torch.tensor([n], dtype=I32, device=dev), slots, qsl)
        decoded = start.clone()
        for t in range(n):
            out = rs.conv_decode(x[t:t + 1], decoded, weight, None, state_indices=slots, dilation=dilation,
                                 backend=backend)
            assert torch.equal(out[0], y[t])
        assert torch.equal(decoded[:, :, :history], verified[:, :, :history]), n


def test_dilation_is_checked():
    pool = _pool(3 * 2)
    weight, x = torch.randn(DIM, WIDTH), torch.randn(2, DIM)
    slots, qsl = torch.tensor([0], dtype=I32), torch.tensor([0, 2], dtype=I32)
    with pytest.raises(ValueError, match="dilation must be in"):
        rs.conv_verify(x, pool, weight, None, state_indices=slots, query_start_loc=qsl, dilation=0)
    with pytest.raises(TypeError, match="dilation must be an int"):
        rs.conv_decode(x[:1], pool, weight, None, state_indices=slots, dilation=2.0)
    with pytest.raises(ValueError, match=r"11 columns, fewer than room for a window after the 12 history columns of a "
                                         r"width-4 conv with taps 4 tokens apart"):
        rs.conv_verify(x, pool, weight, None, state_indices=slots, query_start_loc=qsl, dilation=4)
    records = rs.ReplayRecords.allocate(1, T, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"conv_state has 11 columns, fewer than the 9 history columns"):
        rs.CommitContext([[rs.LayerCache(torch.zeros(3, 1, 4, 4), records, pool, conv_width=WIDTH,
                                         conv_dilation=3)]], max_batch=1)
    with pytest.raises(ValueError, match="conv_dilation must be an int >= 1"):
        rs.CommitContext([[rs.LayerCache(torch.zeros(3, 1, 4, 4), records, pool, conv_width=WIDTH,
                                         conv_dilation=0)]], max_batch=1)
