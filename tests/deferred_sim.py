"""An engine's step loop, run twice: once committing every step eagerly, once deferring every
commit into the next step's verify (``CommitContext.defer``), for ``tests/test_deferred.py``.

Requests join, leave and move between batch rows from step to step; rows are ragged, some are
padding; GDN and KDA layers (each with a conv) share one context of one or two KV-cache groups;
states are fp32 or bf16; align mode keeps a block table per request and group. Both worlds start
from the same tensors and see the same inputs and accepted counts; the deferred world flushes the
rows of requests that leave, and sometimes every row (as an engine does before it changes its
draft length). Every step's conv and recurrence outputs must agree bit for bit, and after a final
flush every state and conv state.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

import recoverssm as rs

I32 = torch.int32


@dataclass
class Setup:
    kinds: tuple = ("gdn", "kda", "gdn")          # one layer each, every layer with a conv
    groups: int = 1                               # layers go to groups round-robin
    state_dtype: torch.dtype = torch.float32
    align: bool = False
    block_size: int = 3
    H: int = 1
    HV: int = 2
    K: int = 8
    V: int = 8
    width: int = 3
    dilation: int = 1                             # the conv's taps this many tokens apart
    T: int = 3                                    # the records' window: 1 + drafts
    max_batch: int = 4
    num_slots: int = 40
    backend: str = "cpu_ref"
    device: str = "cpu"

    @property
    def history(self) -> int:
        return (self.width - 1) * self.dilation


@dataclass
class Request:
    slots: list                                   # per group: the slot (non-align) ...
    blocks: list = field(default_factory=list)    # ... or the block list (align)
    computed: int = 0                             # align: tokens computed


class World:
    """One copy of the model's caches and its context."""

    def __init__(self, s: Setup, deferred: bool, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.s, self.deferred = s, deferred
        dev = s.device
        self.conv_dim = 2 * s.H * s.K + s.HV * s.V
        self.layers = []
        for i, kind in enumerate(s.kinds):
            state = (torch.randn(s.num_slots, s.HV, s.V, s.K, generator=gen) * 0.5).to(s.state_dtype).to(dev)
            conv = torch.randn(s.num_slots, self.conv_dim, s.history + s.T, generator=gen).to(dev)
            records = rs.ReplayRecords.allocate(s.max_batch, s.T, s.H, s.HV, s.K, s.V, device=dev,
                                                vector_decay=kind == "kda", buffers=2 if deferred else 1)
            weights = dict(w=(torch.randn(self.conv_dim, s.width, generator=gen) * 0.5).to(dev),
                           A_log=(torch.randn(s.HV, generator=gen) * 0.5).to(dev),
                           dt_bias=(torch.randn(s.HV, s.K, generator=gen) if kind == "kda"
                                    else torch.randn(s.HV, generator=gen)).to(dev))
            self.layers.append(dict(kind=kind, group=i % s.groups, state=state, conv=conv, records=records,
                                    **weights))
        groups = [[rs.LayerCache(L["state"], L["records"], L["conv"], conv_width=s.width, conv_dilation=s.dilation)
                   for L in self.layers if L["group"] == g] for g in range(s.groups)]
        self.ctx = rs.CommitContext(groups, max_batch=s.max_batch, backend=s.backend, deferred=deferred)

    def verify(self, inputs: dict, step: dict) -> list:
        """Every layer's conv and verify of the step; returns their outputs."""
        s = self.s
        outs = []
        for i, L in enumerate(self.layers):
            g = L["group"]
            kw = {}
            if self.deferred:
                kw = dict(pending=self.ctx.pending[g], pending_rows=step["pending_rows"])
            slots, qsl = step["slots"][g], step["qsl"]
            y = rs.conv_verify(inputs["x"][i], L["conv"], L["w"], None, state_indices=slots, query_start_loc=qsl,
                               dilation=s.dilation,
                               backend=s.backend, **kw)
            T = y.shape[0]
            q = y[:, :s.H * s.K].view(T, s.H, s.K)
            k = y[:, s.H * s.K:2 * s.H * s.K].view(T, s.H, s.K)
            v = y[:, 2 * s.H * s.K:].view(T, s.HV, s.V)
            if L["kind"] == "mamba2":        # q, k, v in the roles of C, B, x; dt the GDN gate input
                o = rs.mamba2_verify(v, k, q, inputs["a"][i], state=L["state"], state_indices=slots,
                                     query_start_loc=qsl, records=L["records"], dt_bias=L["dt_bias"],
                                     A_log=L["A_log"], D=L["A_log"], backend=s.backend, **kw)
            else:
                fn = rs.kda_verify if L["kind"] == "kda" else rs.gdn_verify
                o = fn(q, k, v, state=L["state"], state_indices=slots, query_start_loc=qsl, records=L["records"],
                       a=inputs["a_kda" if L["kind"] == "kda" else "a"][i], b=inputs["b"][i], A_log=L["A_log"],
                       dt_bias=L["dt_bias"], backend=s.backend, **kw)
            outs += [y.clone(), o.clone()]
        return outs

    def end_step(self, step: dict) -> None:
        kw = dict(block_table=step["block_table"], num_computed_tokens=step["num_computed"],
                  block_size=self.s.block_size) if self.s.align else {}
        (self.ctx.defer if self.deferred else self.ctx.commit)(step["accepted"], step["slots"], step["qsl"], **kw)

    def caches(self) -> list:
        return [t for L in self.layers for t in (L["state"], L["conv"])]


class Engine:
    """Schedules requests over steps and drives both worlds."""

    def __init__(self, s: Setup, seed: int):
        self.s, self.rng = s, random.Random(seed)
        self.eager, self.deferred = World(s, False, seed), World(s, True, seed)
        self.free = [list(range(s.num_slots)) for _ in range(s.groups)]
        for free in self.free:
            self.rng.shuffle(free)
        self.requests: dict[int, Request] = {}
        self.next_id = 0
        self.prev_rows: dict[int, int] = {}      # request -> its row in the previous (deferred) step
        self.gen = torch.Generator().manual_seed(seed + 99)
        #: What the run exercised: rows that replayed a pending commit, rows flushed, boundary writes.
        self.replayed = self.flushed = self.boundaries = 0

    # ---- requests ------------------------------------------------------------------------------
    def _take(self, g: int) -> int:
        return self.free[g].pop()

    def join(self) -> None:
        """A new request, its prefilled state and history written into both worlds."""
        s = self.s
        rid, self.next_id = self.next_id, self.next_id + 1
        if s.align:
            computed = self.rng.randint(1, 2 * s.block_size)
            blocks = [[self._take(g) for _ in range((computed - 1) // s.block_size + 1)] for g in range(s.groups)]
            req = Request([b[-1] for b in blocks], blocks, computed)
        else:
            req = Request([self._take(g) for g in range(s.groups)])
        for i in range(len(s.kinds)):
            g = i % s.groups
            state = (torch.randn(s.HV, s.V, s.K, generator=self.gen) * 0.5).to(s.state_dtype)
            history = torch.randn(self.eager.conv_dim, s.history, generator=self.gen)
            for world in (self.eager, self.deferred):
                world.layers[i]["state"][req.slots[g]] = state.to(s.device)
                world.layers[i]["conv"][req.slots[g], :, :s.history] = history.to(s.device)
        self.requests[rid] = req

    def leave(self, rid: int) -> None:
        req = self.requests.pop(rid)
        for g in range(self.s.groups):
            self.free[g] += req.blocks[g] if self.s.align else [req.slots[g]]

    def _grow_blocks(self, req: Request) -> None:
        """Align mode: blocks for every token the next window may commit."""
        need = (req.computed + self.s.T - 1) // self.s.block_size + 1
        for g in range(self.s.groups):
            while len(req.blocks[g]) < need:
                req.blocks[g].append(self._take(g))

    # ---- one step ------------------------------------------------------------------------------
    def step(self, flush_all: bool = False) -> None:
        """One step: some requests leave (finished) or sit this step out (preempted), others
        join; the deferred world first flushes every deferred row that does not continue (or
        all of them), as an engine must before it frees or reuses those slots."""
        s, rng = self.s, self.rng
        leaving = [rid for rid in self.requests if rng.random() < 0.2]
        waiting = [rid for rid in self.requests if rid not in leaving and rng.random() < 0.1]
        scheduled = [rid for rid in self.requests if rid not in leaving and rid not in waiting]
        plan = self.deferred.ctx.pending.plan[0].tolist()
        if flush_all:
            self.deferred.ctx.flush()
            self.flushed += sum(1 for n in plan[0] if n > 0)
        else:
            gone = [r for rid, r in self.prev_rows.items() if rid not in scheduled]
            if gone:
                self.deferred.ctx.flush(torch.tensor(gone, dtype=I32, device=s.device))
                self.flushed += sum(1 for r in gone if plan[0][r] > 0)
        for rid in leaving:
            self.leave(rid)
        while len(scheduled) + len(waiting) < s.max_batch - 1 and rng.random() < 0.6:
            self.join()
            scheduled.append(self.next_id - 1)
        if not scheduled:
            self.join()
            scheduled.append(self.next_id - 1)
        rng.shuffle(scheduled)
        rows: list[Optional[int]] = scheduled[:s.max_batch]
        while len(rows) < s.max_batch and rng.random() < 0.5:    # padding rows
            rows.insert(rng.randrange(len(rows) + 1), None)
        continuing = {} if flush_all else {rid: r for rid, r in self.prev_rows.items() if rid in rows}
        self.replayed += sum(1 for r in continuing.values() if plan[0][r] > 0)
        self.boundaries += sum(1 for r in continuing.values() if plan[0][r] > 0 and plan[3][r] >= 0)
        step = self._step_tensors(rows, continuing)
        inputs = self._inputs(step["tokens"])
        got = self.deferred.verify(inputs, step)
        want = self.eager.verify(inputs, step)
        for n, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"output {n} differs"
        for world in (self.eager, self.deferred):
            world.end_step(step)
        self.prev_rows = {rid: r for r, rid in enumerate(rows) if rid is not None}
        for r, rid in enumerate(rows):          # align: the committed tokens, the next source blocks
            if rid is not None and s.align:
                req = self.requests[rid]
                req.computed += int(step["accepted"][r])
                req.slots = [req.blocks[g][(req.computed - 1) // s.block_size] for g in range(s.groups)]

    def _step_tensors(self, rows: list, continuing: dict) -> dict:
        s, rng, dev = self.s, self.rng, self.s.device
        lens, accepted, pending_rows = [], [], []
        slots = [[] for _ in range(s.groups)]
        for rid in rows:
            if rid is None:
                lens.append(rng.randint(0, s.T))
                accepted.append(rng.randint(0, s.T))
                pending_rows.append(-1)
                for g in range(s.groups):
                    slots[g].append(-1)
                continue
            req = self.requests[rid]
            if s.align:
                self._grow_blocks(req)
            n = rng.randint(1, s.T)
            lens.append(n)
            accepted.append(rng.randint(0 if rng.random() < 0.1 else 1, n))
            pending_rows.append(continuing.get(rid, -1))
            for g in range(s.groups):
                slots[g].append(req.slots[g])
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        step = dict(tokens=qsl[-1], qsl=torch.tensor(qsl, dtype=I32, device=dev),
                    slots=[torch.tensor(x, dtype=I32, device=dev) for x in slots],
                    accepted=torch.tensor(accepted, dtype=I32, device=dev),
                    pending_rows=torch.tensor(pending_rows, dtype=I32, device=dev))
        if s.align:
            width = max([len(self.requests[rid].blocks[0]) for rid in rows if rid is not None] + [1])
            step["block_table"], step["num_computed"] = [], []
            for g in range(s.groups):
                table = [(self.requests[rid].blocks[g] if rid is not None else []) for rid in rows]
                step["block_table"].append(torch.tensor([t + [-1] * (width - len(t)) for t in table], dtype=I32,
                                                        device=dev))
            step["num_computed"] = torch.tensor([self.requests[rid].computed if rid is not None else 0
                                                 for rid in rows], dtype=I32, device=dev)
        return step

    def _inputs(self, tokens: int) -> dict:
        s, dev, n = self.s, self.s.device, len(self.s.kinds)
        conv_dim = self.eager.conv_dim

        def rand(*shape):
            return [torch.randn(*shape, generator=self.gen).to(dev) for _ in range(n)]
        return dict(x=rand(tokens, conv_dim), a=rand(tokens, s.HV), a_kda=rand(tokens, s.HV, s.K),
                    b=rand(tokens, s.HV))

    def finish(self) -> None:
        """Flush what is pending; then every cache of both worlds must agree."""
        self.deferred.ctx.flush()
        self.prev_rows = {}
        for n, (a, b) in enumerate(zip(self.eager.caches(), self.deferred.caches())):
            assert torch.equal(a, b), f"cache {n} differs"
