"""Padding rows' outputs whatever ``query_start_loc`` holds (value checks off): every token of a
padding row's span (its two ends clamped to ``[0, T_total]``) is zero, every other token keeps
its value, and nothing else is written. Through the backends' kernel-facing functions, as a GPU
call without value checks reaches them; on ``cpu_ref``, the Triton kernels (interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch

from recoverssm.core.backend import GateInputs, RecurrenceCall
from recoverssm.core.registry import registry

from helpers import backends, device_of

I32 = torch.int32
T_TOTAL = 9
QSLS = {
    "in range": [0, 2, 5, 9],
    "past the tokens": [0, 4, 100, 2**31 - 1],
    "negative and decreasing": [-7, 6, 1, 3],
    "one row over all": [-5, 2**31 - 1, 2**31 - 1, 2**31 - 1],
    "starts late": [3, 3, 8, 5],
}


def spans(qsl: list) -> set:
    """The tokens of every row's clamped span."""
    ends = [min(max(x, 0), T_TOTAL) for x in qsl]
    return {t for r in range(len(qsl) - 1) for t in range(ends[r], max(ends[r + 1], ends[r]))}


def _expected(before: torch.Tensor, qsl: list) -> torch.Tensor:
    want = before.clone()
    for t in spans(qsl):
        want[t] = 0
    return want


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", sorted(QSLS))
def test_conv_verify_zeroes_each_padding_rows_span(backend, case):
    dev = device_of(backend)
    be = registry().resolve(backend, dev)[0]
    dim, width, window = 16, 4, 3              # the conv window (3) is shorter than most spans
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T_TOTAL, dim, generator=g).to(dev)
    conv_state = torch.randn(5, dim, width - 1 + window, generator=g).to(dev)
    weight = torch.randn(dim, width, generator=g).to(dev)
    out = torch.full((T_TOTAL, dim), 7.0, device=dev)
    before_out, before_state = out.clone(), conv_state.clone()
    slots = torch.tensor([-1, -3, -1], dtype=I32, device=dev)
    qsl = torch.tensor(QSLS[case], dtype=I32, device=dev)
    be.conv_verify(x, conv_state, weight, None, slots, qsl, True, 1, -1, out)
    assert torch.equal(out.cpu(), _expected(before_out.cpu(), QSLS[case]))
    assert torch.equal(conv_state, before_state)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("mode", ["verify", "decode", "snapshot"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("case", sorted(QSLS))
def test_recurrences_zero_each_padding_rows_span(backend, mode, kind, case):
    dev = device_of(backend)
    be = registry().resolve(backend, dev)[0]
    H, HV, K, V, window = 1, 2, 16, 16, 3
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(T_TOTAL, H, K, generator=g).to(dev) for _ in range(2))
    v = torch.randn(T_TOTAL, HV, V, generator=g).to(dev)
    gate_shape = (T_TOTAL, HV, K) if kind == "kda" else (T_TOTAL, HV)
    gates = GateInputs(g=-torch.rand(gate_shape, generator=g).to(dev),
                       beta=torch.rand(T_TOTAL, HV, generator=g).to(dev), kind=kind)
    state = torch.randn(6, HV, V, K, generator=g).to(dev)
    decay_shape = (3, HV, window, K) if kind == "kda" else (3, HV, window)
    records = (torch.full((3, HV, window, V), 5.0, device=dev), torch.full((3, H, window, K), 5.0, device=dev),
               torch.full(decay_shape, 5.0, device=dev)) if mode == "verify" else None
    snapshot = torch.tensor([[1, 2, 3]] * 3, dtype=I32, device=dev) if mode == "snapshot" else None
    out = torch.full((T_TOTAL, HV, V), 7.0, device=dev)
    before = [t.clone() for t in (out, state, *(records or ()))]
    slots = torch.tensor([-1, -2, -1], dtype=I32, device=dev)
    qsl = torch.tensor(QSLS[case], dtype=I32, device=dev)
    be.recurrence(RecurrenceCall(mode, q, k, v, state, slots, qsl, gates, K ** -0.5, True, -1, out, records, snapshot))
    assert torch.equal(out.cpu(), _expected(before[0].cpu(), QSLS[case]))
    for got, want in zip((state, *(records or ())), before[1:]):
        assert torch.equal(got, want)
