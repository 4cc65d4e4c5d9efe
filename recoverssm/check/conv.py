"""Check of ``conv_verify``: outputs within tolerance, conv states (pure copies) exact."""
from __future__ import annotations

import random

import torch

import recoverssm as rs

from .problems import ConvCase, ConvProblem, i32
from .report import REF, TOL, Report


def run_conv(p: ConvProblem, backend_name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv_verify`` of ``p`` on ``device``: the output and the conv state pool after it."""
    case = p.case
    cs = p.pool.to(device).clone()
    y = rs.conv_verify(p.fused.to(device)[:, :case.dim], cs, p.weight.to(device),
                       None if p.bias is None else p.bias.to(device), state_indices=i32(p.sources, device),
                       query_start_loc=i32(p.qsl, device), activation="silu" if case.silu else None,
                       backend=backend_name)
    return y, cs


def check_conv(report: Report, case: ConvCase, backend, device: torch.device, gen: torch.Generator,
               rng: random.Random) -> None:
    """``conv_verify`` on one random problem (``rng`` is not used here)."""
    label = case.label
    if "conv_verify" not in backend.capabilities:
        report.skip(label, "conv_verify", "no conv_verify capability")
        return
    p = ConvProblem(case, gen)
    results = report.guarded(label, "conv_verify", lambda: (run_conv(p, REF, torch.device("cpu")),
                                                            run_conv(p, backend.name, device)))
    if results is None:
        return
    (y_ref, cs_ref), (y_dut, cs_dut) = results
    report.close(label, "conv_verify out vs cpu_ref", [(y_dut, y_ref)], TOL[case.act_dtype])
    report.exact(label, "conv_verify conv_state vs cpu_ref", [(cs_dut, cs_ref)])
