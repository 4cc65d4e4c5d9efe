"""When the demo checks the slots a step commits: at once, or (``--deferred``) once they are written.

A context that defers its commits writes a step's states only when its commit actually runs:
replayed by the next step's verify of every layer (the conv and the recurrence each replay it
for their own layer), or flushed. Until then the slots hold what they held before the step.

**The rule: the host reads a deferred row's slots only after its commit has run** (replayed or
flushed). So a deferred step is checked one step late, right after the next step's verify and
before the per-token path moves on (both paths then stand at the same token count), and the last
step after the final flush, when the run ends and every request finishes. The end-of-run check
of the prefix cache comes after that flush too.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .checks import DemoMismatch, SlotChecker
from .spec import GroupPlan, SpecEngine


def boundary_writes(plans: Sequence[GroupPlan]) -> int:
    """Block-boundary states a step's commit stores, over every group and request."""
    return sum(1 for p in plans for n, slot in zip(p.commit_len, p.boundary_slot) if n > 0 and slot > -1)


class CommitChecks:
    """Checks each step's committed slots against the per-token path when the rule allows, and
    counts (deferred) the rows whose pending commit the next verify replayed or a flush committed."""

    def __init__(self, spec: SpecEngine, checker: SlotChecker):
        self.spec, self.checker = spec, checker
        #: deferred: ``(where, plans, tokens computed before)`` of the step whose commit is pending
        self.waiting: Optional[tuple[str, list[GroupPlan], list[int]]] = None
        self.replayed_rows = 0
        self.flushed_rows = 0

    def committed(self, where: str, plans: list[GroupPlan], computed_before: Sequence[int]) -> None:
        """A step has ended: its slots are checked now (eager), or once its commit has run."""
        if self.spec.deferred:
            self.waiting = (where, plans, list(computed_before))
        else:
            self.checker.after_commit(where, plans, computed_before)

    def verified(self, where: str) -> None:
        """Every layer's verify of step ``where`` has run: (deferred) it replayed the pending
        step, whose slots now hold their states; check them."""
        if self.waiting is None:
            return
        pending, replayed = self.spec.pending_rows_counts()
        if replayed != pending:
            raise DemoMismatch(f"{where}: the verify replayed {replayed} of the {pending} rows whose commit "
                               f"was pending (every request continues its row)")
        self.replayed_rows += replayed
        self._check_waiting(f"replayed by {where}'s verify")

    def finish(self) -> None:
        """The run ends and every request finishes: (deferred) flush what is pending before
        anything reads its slots (or could reuse them), then check the last step."""
        if not self.spec.deferred:
            return
        pending, _ = self.spec.pending_rows_counts()
        self.spec.flush(range(self.spec.num_requests))
        self.flushed_rows += pending
        left, _ = self.spec.pending_rows_counts()
        if left:
            raise DemoMismatch(f"end of run: {left} rows still have a commit pending after the flush")
        if self.waiting is not None:
            self._check_waiting("flushed at the end of the run")

    def _check_waiting(self, how: str) -> None:
        where, plans, before = self.waiting
        self.waiting = None
        self.checker.after_commit(f"{where} ({how})", plans, before)
