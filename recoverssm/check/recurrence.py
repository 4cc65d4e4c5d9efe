"""Check of the GDN, KDA or Mamba2 ops of one layer: verify, decode, snapshot and the non-align commit."""
from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

import torch

import recoverssm as rs

from .problems import RecurrenceCase, RecurrenceProblem, i32, prefix
from .report import REF, TOL, Report

#: the ops of each kind of recurrence, by mode
OPS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "gdn": {"verify": rs.gdn_verify, "decode": rs.gdn_decode, "snapshot": rs.gdn_spec_decode_snapshot},
    "kda": {"verify": rs.kda_verify, "decode": rs.kda_decode, "snapshot": rs.kda_spec_decode_snapshot},
    "mamba2": {"verify": rs.mamba2_verify, "decode": rs.mamba2_decode, "snapshot": rs.mamba2_spec_decode_snapshot},
}


class RecurrenceRun:
    """Every op of one problem's recurrence on one backend and device; results stay on that device."""

    def __init__(self, p: RecurrenceProblem, backend: str, device: torch.device):
        self.p, self.backend, self.device = p, backend, device
        self.ops = OPS[p.case.kind]
        self.tok = p.token_inputs(device)
        self.heads = p.head_inputs(device)
        self.si = i32(p.sources, device)
        self.qsl = i32(p.qsl, device)
        self.common = dict(backend=backend, **p.case.op_kwargs())

    def verify(self):
        state = self.p.state.to(self.device)
        rec = self.p.case.records(self.device)
        out = self.ops["verify"](**self.tok, **self.heads, state=state, state_indices=self.si,
                                 query_start_loc=self.qsl, records=rec, **self.common)
        return out, rec, state

    def decode(self, counts: Optional[Sequence[int]] = None, state: Optional[torch.Tensor] = None):
        """Native per-token path over the first ``counts[r]`` tokens of each row (default: all)."""
        counts = self.p.case.lengths if counts is None else counts
        tok, qsl = prefix(self.tok, self.p.qsl, counts)
        state = (self.p.state if state is None else state).to(self.device).clone()
        out = self.ops["decode"](**tok, **self.heads, state=state, state_indices=self.si,
                                 query_start_loc=i32(qsl, self.device), **self.common)
        return out, state

    def decode_steps(self, counts: Sequence[int]) -> torch.Tensor:
        """One-token decode calls, one per window position, over the first ``counts[r]`` tokens
        of each live row (how a server that does not speculate decodes); returns the state."""
        state = self.p.state.to(self.device).clone()
        for t in range(max(counts, default=0)):
            rows = [r for r in self.p.live_rows() if counts[r] > t]
            if not rows:
                continue
            # one token of each row: "rows" starting at the tokens' indices, one token long
            tok, qsl = prefix(self.tok, [self.p.qsl[r] + t for r in rows], [1] * len(rows))
            slots = i32([self.p.sources[r] for r in rows], self.device)
            self.ops["decode"](**tok, **self.heads, state=state, state_indices=slots,
                               query_start_loc=i32(qsl, self.device), **self.common)
        return state

    def snapshot(self):
        state = self.p.state.to(self.device).clone()
        slots = torch.tensor(self.p.snapshot_slots, dtype=torch.int32, device=self.device)
        out = self.ops["snapshot"](**self.tok, **self.heads, state=state, state_indices=self.si,
                                   query_start_loc=self.qsl, snapshot_slots=slots, **self.common)
        return out, state

    def commit(self, rec: rs.ReplayRecords):
        state = self.p.state.to(self.device).clone()
        ctx = rs.CommitContext([[rs.LayerCache(state, rec)]], max_batch=self.p.case.B, backend=self.backend)
        ctx.commit(i32(self.p.num_accepted, self.device), self.si, self.qsl)
        return state


def record_pairs(p: RecurrenceProblem, got: rs.ReplayRecords, want: rs.ReplayRecords):
    """The records of live rows at positions ``t < len`` (the rest of the workspace is free)."""
    rows, ts = [], []
    for r in p.live_rows():
        for t in range(p.case.lengths[r]):
            rows.append(r)
            ts.append(t)
    pairs = []
    for field_ in ("correction", "key", "decay"):
        g, w = getattr(got, field_).cpu(), getattr(want, field_)
        pairs.append((g[rows, :, ts], w[rows, :, ts]))
    return pairs


class RecurrenceCheck:
    """The items of one :class:`RecurrenceCase`: the backend under test (``dut``) against cpu_ref
    (``ref``) on the same problem, and against its own per-token decode."""

    def __init__(self, report: Report, case: RecurrenceCase, p: RecurrenceProblem, backend_name: str,
                 device: torch.device):
        self.report, self.case, self.p, self.label = report, case, p, case.label
        self.ref = RecurrenceRun(p, REF, torch.device("cpu"))
        self.dut = RecurrenceRun(p, backend_name, device)
        self.kind = case.kind
        # A pool's state is rounded to its dtype after every token, so from the second token on the
        # outputs and records depend on states each backend rounded: the state dtype's tolerance.
        self.out_tol = max(TOL[case.act_dtype], TOL[case.state_dtype])
        self.records_tol = max(TOL[torch.float32], TOL[case.state_dtype])
        self.state_tol = TOL[case.state_dtype]

    def verify(self) -> tuple[rs.ReplayRecords, rs.ReplayRecords]:
        """Returns the records ``(cpu_ref's, the backend's)`` for the commit."""
        o_ref, rec_ref, _ = self.ref.verify()
        o_dut, rec_dut, st_dut = self.dut.verify()
        op = f"{self.kind}_verify"
        self.report.close(self.label, f"{op} out vs cpu_ref", [(o_dut, o_ref)], self.out_tol)
        self.report.close(self.label, f"{op} records vs cpu_ref", record_pairs(self.p, rec_dut, rec_ref),
                          self.records_tol)
        self.report.exact(self.label, f"{op} leaves state unwritten", [(st_dut, self.p.state)])
        return rec_ref, rec_dut

    def decode(self) -> None:
        o_ref, s_ref = self.ref.decode()
        o_dut, s_dut = self.dut.decode()
        op = f"{self.kind}_decode"
        self.report.close(self.label, f"{op} out vs cpu_ref", [(o_dut, o_ref)], self.out_tol)
        self.report.close(self.label, f"{op} state vs cpu_ref", [(s_dut, s_ref)], self.state_tol)

    def snapshot(self) -> None:
        p, lengths = self.p, self.case.lengths
        _, s_ref = self.ref.snapshot()
        _, s_dut = self.dut.snapshot()
        self.report.close(self.label, "snapshot states vs cpu_ref", [(s_dut, s_ref)], self.state_tol)
        # The state after a row's last position is what decode leaves in the row's slot.
        _, dec = self.dut.decode()
        pairs = [(s_dut[p.snapshot_slots[r][lengths[r] - 1]], dec[p.sources[r]])
                 for r in p.live_rows() if p.snapshot_slots[r][lengths[r] - 1] > -1]
        self.report.exact(self.label, "snapshot last state == own decode", pairs)

    def commit(self, rec_ref: rs.ReplayRecords, rec_dut: rs.ReplayRecords) -> None:
        c_ref = self.ref.commit(rec_ref)
        c_dut = self.dut.commit(rec_dut)
        self.report.close(self.label, "commit vs cpu_ref", [(c_dut, c_ref)], self.state_tol)
        # The promise: commit of n accepted tokens == per-token decode of those n tokens.
        n = [min(a, length) for a, length in zip(self.p.num_accepted, self.case.lengths)]
        _, dec = self.dut.decode(n)
        self.report.exact(self.label, "commit == own decode (bit-exact)", [(c_dut, dec)])
        # ... and (every state is rounded after every token) one-token decode calls, as a server
        # that does not speculate runs them.
        self.report.exact(self.label, "commit == own one-token decode steps", [(c_dut, self.dut.decode_steps(n))])


def check_recurrence(report: Report, case: RecurrenceCase, backend, device: torch.device, gen: torch.Generator,
                     rng: random.Random) -> None:
    """Every op of the case's recurrence the backend has, on one random problem (``rng`` is not
    used here)."""
    label, caps, kind = case.label, backend.capabilities, case.kind
    if case.state_dtype == torch.bfloat16 and "bf16_state" not in caps:
        report.skip(label, "all", "no bf16_state capability")
        return
    if kind not in caps:
        report.skip(label, "all", f"no {kind} capability")
        return
    check = RecurrenceCheck(report, case, RecurrenceProblem(case, gen), backend.name, device)
    records = report.guarded(label, f"{kind}_verify", check.verify)
    report.guarded(label, f"{kind}_decode", check.decode)
    report.guarded(label, "snapshot", check.snapshot)
    missing = [c for c in case.capabilities() if c not in caps]
    if missing:
        report.skip(label, "commit", "missing capabilities: " + ", ".join(missing))
    elif records is not None:
        report.guarded(label, "commit", lambda: check.commit(*records))
