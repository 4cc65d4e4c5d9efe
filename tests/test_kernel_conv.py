"""The conv kernel (``conv_verify`` of the ``cuda`` backend) against ``cpu_ref``, in the
interpreter and on a GPU (:mod:`kernel_settings`): outputs within fp32 tolerance, conv states
(pure copies) exact.
"""
import pytest
import torch

import recoverssm as rs
from helpers import conv_problem, rel_err
from kernel_settings import FP32_TOL, SETTINGS


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_verify_matches_reference(s, activation):
    lens = [min(length, 4) for length in s["lens"][0]]
    dim = 24 if s["device"] == "cpu" else 2 * s["H"] * s["K"] + s["HV"] * s["V"]
    x, cs, w, bias, slots, qsl = conv_problem(s["device"], lens, dim=dim)
    cs_gpu = cs.clone()
    y = rs.conv_verify(x, cs_gpu, w, bias, state_indices=slots, query_start_loc=qsl,
                       activation=activation, backend="cuda")
    xc, csc, wc, bc, sc, qc = (t.cpu() for t in (x, cs, w, bias, slots, qsl))
    y_ref = rs.conv_verify(xc, csc, wc, bc, state_indices=sc, query_start_loc=qc,
                           activation=activation, backend="cpu_ref")
    assert rel_err(y, y_ref) < FP32_TOL
    assert torch.equal(cs_gpu.cpu(), csc)
