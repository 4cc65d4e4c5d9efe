"""The random step sequence of a :class:`DeferredCase`: an engine's schedule and inputs, drawn once on
the host, then run by every world of the deferred check (:mod:`.deferred`).

Each step, as an engine runs it: some requests leave (finished) and some sit the step out
(preempted); the rows of the previous step that do not continue are flushed (a deferring world
must do so before their slots are freed or reused); new requests join, their prefilled state and
conv history written into their slots; the others continue, in any row. Half-way every row is
flushed, as an engine does before it changes its draft length. Rows are ragged and padding rows
are mixed in. In align mode a request holds a list of blocks per group, and its slot is the block
of its last computed token: where the commit plan puts its final state, as a continuing row needs.

``tests/deferred_sim.py`` draws the same kind of schedule with code of its own, on purpose: the
test suite's oracle of deferred commits does not share a generator (or its mistakes) with the
check it also tests.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from .problems import DeferredCase


@dataclass
class Join:
    """A request that joins: per group its slot, per layer its state and conv history there."""

    slots: list[int]
    states: list[torch.Tensor]           # [HV, V, K], in the state dtype
    histories: list[torch.Tensor]        # [conv_dim, conv_width - 1]


@dataclass
class Step:
    """One step. ``flush``: rows of the previous step to flush first (a deferring world only;
    ``None``: every row). Per row: ``lengths``, ``accepted`` (``num_accepted``) and
    ``pending_rows`` (the previous step's row it continues, -1: none); per group ``slots`` (-1:
    padding) and, in align mode, ``block_tables``; ``num_computed`` (align); per layer ``proj``,
    the fused inputs of the step's tokens."""

    flush: Optional[list[int]]
    joins: list[Join]
    lengths: list[int]
    accepted: list[int]
    pending_rows: list[int]
    slots: list[list[int]]
    proj: list[torch.Tensor]
    block_tables: Optional[list[list[list[int]]]] = None
    num_computed: Optional[list[int]] = None


@dataclass
class StepSequence:
    """A case's layers (per layer: weights and initial pools, on CPU) and its steps."""

    case: DeferredCase
    layers: list[dict]
    steps: list[Step]


@dataclass
class _Request:
    slots: list[int]                                          # per group: the slot of its state
    blocks: list[list[int]] = field(default_factory=list)     # align: per group, its blocks
    computed: int = 0                                         # align: tokens computed


def num_slots(case: DeferredCase) -> int:
    """Slots per pool: enough for ``max_batch`` live requests (align: each with the blocks of
    every token it may compute)."""
    if not case.align:
        return 2 * case.max_batch + 2
    blocks = (2 * max(case.block_sizes) + (case.steps + 1) * case.T) // min(case.block_sizes) + 2
    return case.max_batch * blocks + 2


def draw_sequence(case: DeferredCase, gen: torch.Generator, rng: random.Random) -> StepSequence:
    """The layers and ``case.steps`` steps of one random run."""
    c, n = case, num_slots(case)
    layers = []
    for i, kind in enumerate(c.kinds):
        layers.append(dict(
            kind=kind, group=i % c.groups,
            state=(torch.randn(n, c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype),
            conv=torch.randn(n, c.conv_dim, c.conv_width - 1 + c.T, generator=gen),
            conv_w=torch.randn(c.conv_dim, c.conv_width, generator=gen) * 0.5,
            conv_b=torch.randn(c.conv_dim, generator=gen) * 0.1,
            **c.layer(kind).draw_heads(gen)))
    schedule = _Schedule(case, n, gen, rng)
    return StepSequence(case, layers, [schedule.step(flush_all=i == c.steps // 2) for i in range(c.steps)])


class _Schedule:
    """The engine's host-side bookkeeping: free slots, live requests, last step's rows."""

    def __init__(self, case: DeferredCase, slots: int, gen: torch.Generator, rng: random.Random):
        self.case, self.gen, self.rng = case, gen, rng
        self.free = [rng.sample(range(slots), slots) for _ in range(case.groups)]
        self.requests: dict[int, _Request] = {}
        self.next_id = 0
        self.prev_rows: dict[int, int] = {}          # request -> its row in the previous step

    def step(self, flush_all: bool) -> Step:
        c, rng = self.case, self.rng
        leaving = [q for q in self.requests if rng.random() < 0.2]
        waiting = [q for q in self.requests if q not in leaving and rng.random() < 0.1]
        scheduled = [q for q in self.requests if q not in leaving and q not in waiting]
        if waiting and not scheduled:            # at most max_batch - 1 live requests: slots suffice
            scheduled.append(waiting.pop())
        # A row that does not continue is flushed before its request's slots are freed (below)
        # and taken by a request that joins.
        flush = None if flush_all else sorted(r for q, r in self.prev_rows.items() if q not in scheduled)
        for q in leaving:
            self._leave(q)
        joins = []
        while (len(scheduled) + len(waiting) < c.max_batch - 1 and rng.random() < 0.6) or not scheduled:
            joins.append(self._join())
            scheduled.append(self.next_id - 1)
        rng.shuffle(scheduled)
        rows: list[Optional[int]] = list(scheduled)
        while len(rows) < c.max_batch and rng.random() < 0.5:          # padding rows
            rows.insert(rng.randrange(len(rows) + 1), None)
        continuing = {} if flush_all else {q: r for q, r in self.prev_rows.items() if q in rows}
        step = self._rows(rows, continuing, flush, joins)
        self.prev_rows = {q: r for r, q in enumerate(rows) if q is not None}
        for r, q in enumerate(rows):      # align: the committed tokens, the block of the last one
            if q is not None and c.align:
                req = self.requests[q]
                req.computed += step.accepted[r]
                req.slots = [req.blocks[g][(req.computed - 1) // bs] for g, bs in enumerate(c.block_sizes)]
        return step

    def _rows(self, rows: list, continuing: dict, flush, joins: list) -> Step:
        c, rng = self.case, self.rng
        lengths, accepted, pending_rows, slots = [], [], [], [[] for _ in range(c.groups)]
        for q in rows:
            if q is None:                  # padding: any length and count, nothing committed
                lengths.append(rng.randint(0, c.T))
                accepted.append(rng.randint(0, c.T))
                pending_rows.append(-1)
                for g in range(c.groups):
                    slots[g].append(-1)
                continue
            req = self.requests[q]
            if c.align:
                self._grow(req)
            n = rng.randint(1, c.T)
            lengths.append(n)
            accepted.append(rng.randint(0 if rng.random() < 0.1 else 1, n))
            pending_rows.append(continuing.get(q, -1))
            for g in range(c.groups):
                slots[g].append(req.slots[g])
        tokens = sum(lengths)
        proj = [torch.randn(tokens, c.proj_width(kind), generator=self.gen) for kind in c.kinds]
        step = Step(flush, joins, lengths, accepted, pending_rows, slots, proj)
        if c.align:
            blocks = [[self.requests[q].blocks[g] if q is not None else [] for q in rows] for g in range(c.groups)]
            step.block_tables = [[b + [-1] * (max(map(len, table), default=0) + 1 - len(b)) for b in table]
                                 for table in blocks]
            step.num_computed = [self.requests[q].computed if q is not None else 0 for q in rows]
        return step

    def _join(self) -> Join:
        c, gen = self.case, self.gen
        if c.align:
            computed = self.rng.randint(1, 2 * max(c.block_sizes))
            blocks = [[self.free[g].pop() for _ in range((computed - 1) // bs + 1)]
                      for g, bs in enumerate(c.block_sizes)]
            req = _Request([b[-1] for b in blocks], blocks, computed)
        else:
            req = _Request([self.free[g].pop() for g in range(c.groups)])
        self.requests[self.next_id] = req
        self.next_id += 1
        return Join(list(req.slots),
                    [(torch.randn(c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype) for _ in c.kinds],
                    [torch.randn(c.conv_dim, c.conv_width - 1, generator=gen) for _ in c.kinds])

    def _leave(self, q: int) -> None:
        req = self.requests.pop(q)
        for g in range(self.case.groups):
            self.free[g] += req.blocks[g] if self.case.align else [req.slots[g]]

    def _grow(self, req: _Request) -> None:
        """Align: blocks for every token the next window may commit."""
        for g, bs in enumerate(self.case.block_sizes):
            while len(req.blocks[g]) < (req.computed + self.case.T - 1) // bs + 1:
                req.blocks[g].append(self.free[g].pop())
