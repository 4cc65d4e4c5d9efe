"""Check of an align-mode grouped commit: conv + GDN, KDA or Mamba2 layers in two KV-cache groups,
verified and committed as an engine runs them, against cpu_ref and against the backend's own
decode."""
from __future__ import annotations

import random
from typing import Sequence

import torch

import recoverssm as rs

from .problems import AlignCase, align_layers, heads_of, i32, prefix, query_start_loc, random_align_step
from .recurrence import OPS
from .report import REF, TOL, Report

PLAN_FIELDS = ("commit_len", "final_slot", "boundary_slot", "boundary_len")


class AlignRun:
    """One verify (conv + recurrence per layer) and one grouped align-mode commit on a backend."""

    def __init__(self, case: AlignCase, meta: dict, weights: list[dict], pools: list[dict],
                 backend: str, device: torch.device):
        self.case, self.meta, self.backend, self.device = case, meta, backend, device
        d = device
        self.weights = [{k: v.to(d) for k, v in w.items()} for w in weights]
        self.state = [p["state"].to(d).clone() for p in pools]
        self.conv = [p["conv"].to(d).clone() for p in pools]
        self.qsl_host = query_start_loc(case.lengths)
        self.qsl = i32(self.qsl_host, d)
        G = len(meta["groups"])
        self.si = [i32(g["state_indices"], d) for g in meta["groups"]]
        self.tables = [torch.tensor(g["block_table"], dtype=torch.int32, device=d) for g in meta["groups"]]
        self.nct = i32(meta["num_computed_tokens"], d)
        self.na = i32(meta["num_accepted"], d)
        self.ri = [i32(meta["request_of"], d)] * G if meta["permute"] else None
        self.records = [case.records(d) for _ in range(case.layers)]
        self.ops = OPS[case.kind]
        self.tokens: list[dict] = []

    def group(self, layer: int) -> int:
        return layer % 2

    def verify(self) -> None:
        c = self.case
        conv_dim = c.conv_dim
        for layer, w in enumerate(self.weights):
            g = self.group(layer)
            proj = w["proj"]
            y = rs.conv_verify(proj[:, :conv_dim], self.conv[layer], w["conv_w"], w["conv_b"],
                               state_indices=self.si[g], query_start_loc=self.qsl, backend=self.backend)
            tok = c.split_tokens(y, proj[:, conv_dim:])
            self.ops["verify"](**tok, **heads_of(w), state=self.state[layer],
                               state_indices=self.si[g], query_start_loc=self.qsl, records=self.records[layer],
                               backend=self.backend, **c.op_kwargs())
            self.tokens.append(tok)

    def plans(self) -> list[rs.CommitPlan]:
        return [rs.plan_commit(self.na, self.si[g], self.qsl,
                               request_indices=None if self.ri is None else self.ri[g],
                               block_table=self.tables[g], num_computed_tokens=self.nct,
                               block_size=grp["block_size"], num_slots=grp["num_slots"], backend=self.backend)
                for g, grp in enumerate(self.meta["groups"])]

    def commit(self) -> None:
        groups = [[] for _ in self.meta["groups"]]
        for layer in range(self.case.layers):
            groups[self.group(layer)].append(
                rs.LayerCache(self.state[layer], self.records[layer], conv_state=self.conv[layer],
                              conv_width=self.case.conv_width))
        ctx = rs.CommitContext(groups, max_batch=self.case.B, backend=self.backend)
        ctx.commit(self.na, self.si, self.qsl, request_indices=self.ri, block_table=self.tables,
                   num_computed_tokens=self.nct,
                   block_size=[g["block_size"] for g in self.meta["groups"]])

    def decode_prefix(self, layer: int, counts: Sequence[int], state_before: torch.Tensor) -> torch.Tensor:
        """This backend's per-token decode of each row's first ``counts[r]`` tokens of ``layer``,
        from ``state_before``; returns the pool (the rows' states in their source slots)."""
        w = self.weights[layer]
        tok, qsl = prefix(self.tokens[layer], self.qsl_host, counts)
        state = state_before.to(self.device).clone()
        self.ops["decode"](**tok, **heads_of(w), state=state,
                           state_indices=self.si[self.group(layer)], query_start_loc=i32(qsl, self.device),
                           backend=self.backend, **self.case.op_kwargs())
        return state


def expected_layer(dut: AlignRun, layer: int, plan: dict, after_verify: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools ``(state, conv)`` of ``layer`` that the commit must leave, from the backend's own
    decode: the final slot holds the decode of ``commit_len`` tokens from the source, the boundary
    slot the decode of ``boundary_len`` tokens; every other slot is untouched. Conv: the compaction
    rule (the history after the accepted tokens, cut from the verify window)."""
    c = dut.case
    hist = c.conv_width - 1
    src = dut.meta["groups"][dut.group(layer)]["state_indices"]
    state0, conv0 = after_verify
    dec_n = dut.decode_prefix(layer, plan["commit_len"], state0)
    dec_b = dut.decode_prefix(layer, [bl if bs > -1 else 0 for bl, bs in
                                      zip(plan["boundary_len"], plan["boundary_slot"])], state0)
    want_state, want_conv = state0.clone(), conv0.clone()
    for r in range(c.B):
        n, final, bslot, blen = (plan[f][r] for f in PLAN_FIELDS)
        if n == 0:
            continue
        window = conv0[src[r]].clone()
        if bslot > -1:
            want_state[bslot] = dec_b[src[r]]
            want_conv[bslot, :, :hist] = window[:, blen:blen + hist]
        want_state[final] = dec_n[src[r]]
        want_conv[final, :, :hist] = window[:, n:n + hist]
    return want_state, want_conv


def check_own_decode(report: Report, label: str, dut: AlignRun, plans: list[rs.CommitPlan],
                     after_verify: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Bit-exact: every layer's committed pools against :func:`expected_layer`."""
    state_pairs, conv_pairs = [], []
    for layer in range(dut.case.layers):
        want_state, want_conv = expected_layer(dut, layer, plans[dut.group(layer)].as_dict(), after_verify[layer])
        state_pairs.append((dut.state[layer], want_state))
        conv_pairs.append((dut.conv[layer], want_conv))
    report.exact(label, "commit == own decode (final+boundary)", state_pairs)
    report.exact(label, "conv compaction (the commit's rule)", conv_pairs)


def check_align(report: Report, case: AlignCase, backend, device: torch.device, gen: torch.Generator,
                rng: random.Random) -> None:
    """One align-mode step: plans and committed states against cpu_ref, and against own decode."""
    label = case.label
    missing = [c for c in case.capabilities() if c not in backend.capabilities]
    if case.state_dtype == torch.bfloat16 and "bf16_state" not in backend.capabilities:
        missing.append("bf16_state")
    if missing:
        report.skip(label, "all", "missing capabilities: " + ", ".join(missing))
        return
    meta = random_align_step(case.B, case.lengths, case.block_sizes, rng, permute=case.permute,
                             pad_row=case.pad_row, unallocated=case.unallocated)
    weights, pools = align_layers(case, meta, gen)
    phase = "setup"
    try:
        ref = AlignRun(case, meta, weights, pools, REF, torch.device("cpu"))
        dut = AlignRun(case, meta, weights, pools, backend.name, device)
        phase = f"conv_verify + {case.kind}_verify"
        for run in (ref, dut):
            run.verify()
        phase = "plan_commit"
        plans_ref, plans_dut = ref.plans(), dut.plans()
        after_verify = [(s.clone(), cv.clone()) for s, cv in zip(dut.state, dut.conv)]
        phase = "grouped align commit"
        for run in (ref, dut):
            run.commit()
    except Exception as e:
        report.error(label, phase, e)
        return

    report.exact(label, "plan_commit vs cpu_ref (2 groups)",
                 [(getattr(pd, f), getattr(pr, f)) for pd, pr in zip(plans_dut, plans_ref) for f in PLAN_FIELDS])
    report.close(label, "commit states vs cpu_ref", list(zip(dut.state, ref.state)), TOL[case.state_dtype])
    report.guarded(label, "commit == own decode", lambda: check_own_decode(report, label, dut, plans_ref,
                                                                             after_verify))
