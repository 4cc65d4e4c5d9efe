"""Check of deferred commits (``CommitContext(deferred=True)``): a random step sequence
(:mod:`.sequence`) run three times from the same tensors: on the backend with a deferring context
(each step's commit replayed by the next step's ``conv_verify`` and ``gdn_verify`` /
``kda_verify`` / ``mamba2_verify``, rows that do not continue flushed, everything flushed at the
end), on the backend with an eager one, and on cpu_ref with an eager one.

* bit-exact against the backend's own eager run: every step's conv and recurrence outputs, and
  after the final flush every state and conv state (the library's promise: deferring changes
  when a commit runs, never its bits). On cpu_ref this is the deferred path against cpu_ref's
  eager path.
* against cpu_ref: outputs and states within the tolerance of the dtype they are stored in, conv
  histories exact (copies of the inputs). From the second step on, outputs depend on states that
  each backend rounded to the state dtype, hence the state dtype's tolerance for them too.
"""
from __future__ import annotations

import random

import torch

import recoverssm as rs
from recoverssm.core.types import PLAN_FIELDS

from .problems import DeferredCase, heads_of, i32, query_start_loc
from .recurrence import OPS
from .report import REF, TOL, Report
from .sequence import Step, StepSequence, draw_sequence

#: rows of a pending plan (``CommitContext.pending.plan[g]``) the coverage counts read
COMMIT_LEN, BOUNDARY_SLOT = PLAN_FIELDS.index("commit_len"), PLAN_FIELDS.index("boundary_slot")


class World:
    """One copy of the sequence's layers (pools, records, one context over them) on one backend
    and device; :meth:`run` runs a step, ``outputs`` collects every step's outputs. A deferring
    world counts what its pending plan held when each step replayed or flushed it (``covered``)."""

    def __init__(self, seq: StepSequence, backend: str, device: torch.device, deferred: bool):
        c = self.case = seq.case
        self.backend, self.device, self.deferred = backend, device, deferred
        self.layers = [{k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
                       for layer in seq.layers]
        for layer in self.layers:
            layer["records"] = c.layer(layer["kind"]).allocate_records(c.max_batch, c.T, device,
                                                                       buffers=2 if deferred else 1)
        groups = [[rs.LayerCache(L["state"], L["records"], L["conv"], conv_width=c.conv_width)
                   for L in self.layers if L["group"] == g] for g in range(c.groups)]
        self.ctx = rs.CommitContext(groups, max_batch=c.max_batch, backend=backend, deferred=deferred)
        self.outputs: list[torch.Tensor] = []
        #: deferring: rows whose pending commit a verify replayed, rows flushed with one pending,
        #: and the block-boundary states among those commits (every group)
        self.covered = {"replayed": 0, "flushed": 0, "boundary": 0}

    def run(self, step: Step) -> None:
        """Flush (deferring), write the joining requests, verify every layer, defer or commit."""
        c, dev = self.case, self.device
        if self.deferred:
            flushed = list(range(c.max_batch)) if step.flush is None else step.flush
            self._count(flushed, [p for p in step.pending_rows if p >= 0])
            if flushed:
                self.ctx.flush(None if step.flush is None else i32(flushed, dev))
        for join in step.joins:
            for L, state, history in zip(self.layers, join.states, join.histories):
                slot = join.slots[L["group"]]
                L["state"][slot] = state.to(dev)
                L["conv"][slot, :, :c.conv_width - 1] = history.to(dev)
        qsl = i32(query_start_loc(step.lengths), dev)
        slots = [i32(s, dev) for s in step.slots]
        rows = i32(step.pending_rows, dev)
        for L, proj in zip(self.layers, step.proj):
            self._verify(L, proj.to(dev), slots[L["group"]], qsl, rows)
        align = {}
        if c.align:
            align = dict(block_table=[torch.tensor(t, dtype=torch.int32, device=dev) for t in step.block_tables],
                         num_computed_tokens=i32(step.num_computed, dev), block_size=list(c.block_sizes))
        end_step = self.ctx.defer if self.deferred else self.ctx.commit
        end_step(i32(step.accepted, dev), slots, qsl, **align)

    def _verify(self, L: dict, proj: torch.Tensor, slots: torch.Tensor, qsl: torch.Tensor,
                rows: torch.Tensor) -> None:
        c, spec = self.case, self.case.layer(L["kind"])
        pending = dict(pending=self.ctx.pending[L["group"]], pending_rows=rows) if self.deferred else {}
        cd = c.conv_dim
        y = rs.conv_verify(proj[:, :cd], L["conv"], L["conv_w"], L["conv_b"], state_indices=slots,
                           query_start_loc=qsl, backend=self.backend, **pending)
        o = OPS[L["kind"]]["verify"](
            **spec.split_tokens(y, proj[:, cd:]), **heads_of(L), state=L["state"], state_indices=slots,
            query_start_loc=qsl, records=L["records"], backend=self.backend, **spec.op_kwargs(), **pending)
        self.outputs += [y, o]

    def _count(self, flushed: list[int], replayed: list[int]) -> None:
        plan = self.ctx.pending.plan.cpu()                      # [G, fields, max_batch]
        pending = plan[:, COMMIT_LEN] > 0
        boundary = pending & (plan[:, BOUNDARY_SLOT] > self.ctx.null_slot)
        self.covered["flushed"] += int(pending[0, flushed].sum())
        self.covered["replayed"] += int(pending[0, replayed].sum())
        self.covered["boundary"] += int(boundary[:, flushed + replayed].sum())

    def finish(self) -> None:
        """The run ends: a deferring world flushes what is pending."""
        if self.deferred:
            self._count(list(range(self.case.max_batch)), [])
            self.ctx.flush()

    def pools(self, name: str) -> list[torch.Tensor]:
        return [L[name] for L in self.layers]


def check_deferred(report: Report, case: DeferredCase, backend, device: torch.device, gen: torch.Generator,
                   rng: random.Random) -> None:
    """One random step sequence, deferring on the backend against eager on it and on cpu_ref."""
    label = case.label
    missing = [cap for cap in case.capabilities() if cap not in backend.capabilities]
    if missing:
        report.skip(label, "all", "missing capabilities: " + ", ".join(missing))
        return
    seq = draw_sequence(case, gen, rng)
    phase = "setup"
    try:
        worlds = {"deferred": World(seq, backend.name, device, True), "eager": World(seq, backend.name, device, False),
                  REF: World(seq, REF, torch.device("cpu"), False)}
        for i, step in enumerate(seq.steps):
            for name, world in worlds.items():
                phase = f"step {i + 1} ({name})"
                world.run(step)
        phase = "final flush"
        worlds["deferred"].finish()
    except Exception as e:
        report.error(label, phase, e)
        return
    dut, own, ref = worlds.values()
    hist = case.conv_width - 1
    item = report.exact(label, "deferred outputs == own eager (every step)", list(zip(dut.outputs, own.outputs)))
    cov = dut.covered
    item.note = f"{cov['replayed']} rows replayed by a verify, {cov['flushed']} flushed" + (
        f"; {cov['boundary']} boundary states" if case.align else "")
    report.exact(label, "deferred states == own eager (after flush)", list(zip(dut.pools("state"), own.pools("state"))))
    report.exact(label, "deferred conv states == own eager (after flush)",
                 list(zip(dut.pools("conv"), own.pools("conv"))))
    report.close(label, "deferred outputs vs cpu_ref", list(zip(dut.outputs, ref.outputs)),
                 max(TOL[torch.float32], TOL[case.state_dtype]))
    report.close(label, "deferred states vs cpu_ref", list(zip(dut.pools("state"), ref.pools("state"))),
                 TOL[case.state_dtype])
    report.exact(label, "deferred conv histories vs cpu_ref",
                 [(d[:, :, :hist], r[:, :, :hist]) for d, r in zip(dut.pools("conv"), ref.pools("conv"))])
