"""Check of the conv ops: ``conv_verify`` and ``conv_decode``, outputs within tolerance, conv
states (pure copies) exact; and ``conv_decode`` against the backend's own ``conv_verify``."""
from __future__ import annotations

import random
from typing import Optional

import torch

import recoverssm as rs

from .problems import ConvCase, ConvDecodeCase, ConvProblem, i32
from .report import REF, TOL, Report


def _weights(p: ConvProblem, device: torch.device) -> dict:
    return dict(weight=p.weight.to(device), bias=None if p.bias is None else p.bias.to(device),
                activation="silu" if p.case.silu else None)


def run_conv(p: ConvProblem, backend_name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv_verify`` of ``p`` on ``device``: the output and the conv state pool after it."""
    case = p.case
    cs = p.pool.to(device).clone()
    y = rs.conv_verify(p.fused.to(device)[:, :case.dim], cs, state_indices=i32(p.sources, device),
                       query_start_loc=i32(p.qsl, device), backend=backend_name, **_weights(p, device))
    return y, cs


def run_conv_decode(p: ConvProblem, backend_name: str, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv_decode`` of every row's window, one token per row per call: the outputs in the
    layout of ``conv_verify``'s (``[T_total, dim]``, row after row) and the pool after the calls."""
    case = p.case
    cs = p.pool.to(device).clone()
    n = case.T
    fused, si, kw = p.fused.to(device), i32(p.sources, device), _weights(p, device)
    # Token t of every row: rows are n tokens apart in the fused buffer, a strided view.
    outs = [rs.conv_decode(fused[t::n, :case.dim], cs, state_indices=si, backend=backend_name, **kw)
            for t in range(n)]
    return torch.stack(outs, dim=1).flatten(0, 1), cs


def against_reference(report: Report, case, backend, device: torch.device, gen: torch.Generator, op: str,
                      run) -> Optional[tuple[ConvProblem, tuple[torch.Tensor, torch.Tensor]]]:
    """Run ``op`` (``run(problem, backend_name, device)``) on one random problem with cpu_ref and
    the backend; report the output within tolerance and the conv state bit for bit. Returns the
    problem and the backend's ``(out, conv_state)``, or None where the op did not run."""
    label = case.label
    if op not in backend.capabilities:
        report.skip(label, op, f"no {op} capability")
        return None
    p = ConvProblem(case, gen)
    results = report.guarded(label, op, lambda: (run(p, REF, torch.device("cpu")), run(p, backend.name, device)))
    if results is None:
        return None
    (y_ref, cs_ref), (y_dut, cs_dut) = results
    report.close(label, f"{op} out vs cpu_ref", [(y_dut, y_ref)], TOL[case.act_dtype])
    report.exact(label, f"{op} conv_state vs cpu_ref", [(cs_dut, cs_ref)])
    return p, (y_dut, cs_dut)


def check_conv(report: Report, case: ConvCase, backend, device: torch.device, gen: torch.Generator,
               rng: random.Random) -> None:
    """``conv_verify`` on one random problem (``rng`` is not used here)."""
    against_reference(report, case, backend, device, gen, "conv_verify", run_conv)


def check_decode_against_verify(report: Report, p: ConvProblem, backend, device: torch.device,
                                decoded: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Bit-exact, the backend against itself: ``n`` decodes leave in each live slot the history
    that ``conv_verify`` of the ``n`` tokens leaves for a commit of all of them (its window columns
    ``[n, n + history)``, the commit's compaction rule); and, where the pool's dtype holds the
    inputs exactly, the decode outputs are verify's."""
    case, label = p.case, p.case.label
    hist, n = case.width - 1, case.T
    y_dec, cs_dec = decoded
    y_ver, cs_ver = run_conv(p, backend.name, device)
    live = [s for s in p.sources if s > -1]
    report.exact(label, "conv_decode history == own conv_verify window",
                 [(cs_dec[s, :, :hist], cs_ver[s, :, n:n + hist]) for s in live])
    if case.pool_dtype == case.act_dtype:
        report.exact(label, "conv_decode out == own conv_verify", [(y_dec, y_ver)])


def check_conv_decode(report: Report, case: ConvDecodeCase, backend, device: torch.device,
                      gen: torch.Generator, rng: random.Random) -> None:
    """``conv_decode`` on one random problem, against cpu_ref and the backend's own
    ``conv_verify`` (``rng`` is not used here)."""
    ran = against_reference(report, case, backend, device, gen, "conv_decode", run_conv_decode)
    if ran is None:
        return
    p, decoded = ran
    if "conv_verify" not in backend.capabilities:
        report.skip(case.label, "conv_decode vs own conv_verify", "no conv_verify capability")
        return
    report.guarded(case.label, "conv_decode vs own conv_verify",
                   lambda: check_decode_against_verify(report, p, backend, device, decoded))
