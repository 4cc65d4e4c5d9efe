"""The speculative path: verify every request's window from a read-only checkpoint, commit once.

State layout, as an engine with prefix caching (align mode) holds it:

* two KV-cache groups (every other recurrent layer), each with its own block size and its own block
  table ``[num_requests, width]`` of slots in its own pools; block ``j`` of a request covers tokens
  ``[j*bs, (j+1)*bs)`` and holds the state after the last of them that has been computed;
* per recurrent layer: ``state [num_slots, HV, V, K]`` (fp32 or bf16), ``conv_state [num_slots,
  conv_dim, history + T_max]`` and one :class:`~recoverssm.ReplayRecords` workspace (batch row =
  request; a decay per K channel for KDA layers; Mamba2 maps ngroups, nheads, dstate, headdim to
  H, HV, K, V and commits like GDN);
* per attention layer (the Mamba2 hybrid): a :class:`~.attention.KVCache` by request and position,
  written by the verify and never committed (the next window overwrites rejected positions);
* per group and request: the *source slot*, the slot holding the state after the last computed
  token (where the next window is verified from). The commit plan says where the state goes; the
  engine computes the same plan with :func:`recoverssm.plan_commit` to know the next source slots.

``deferred=True`` (``recoverssm demo --deferred``): the context defers its commits. A step ends
with :meth:`CommitContext.defer` (no state written), and the next step's verify of every layer
replays it first (``pending=``, ``pending_rows=``); the records are double-buffered. Every request
keeps its batch row for the whole run, so row ``q`` always continues row ``q``. A deferred row's
states reach its slots only when that replay or a :meth:`SpecEngine.flush` has run: nothing may
read them (or reuse the slots) before.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import recoverssm as rs
from recoverssm.core.types import PLAN_FIELDS

from .model import TinyModel


@dataclass
class GroupPlan:
    """One group's commit plan, on the host: lists over requests (the plan rule, core/plan.py)."""

    commit_len: list[int]
    final_slot: list[int]
    boundary_slot: list[int]
    boundary_len: list[int]


class SpecEngine:
    """Windows in, logits out; commits the accepted prefix of every window into every layer.

    ``block_sizes``: one block size per KV-cache group (layer ``i`` belongs to group
    ``i % len(block_sizes)``). ``max_tokens``: the most tokens a request will ever compute (sizes
    the block tables). ``backend``: a backend name or object for every op. ``deferred``: each
    step's commit is deferred into the next step's verify (see the module docstring).
    """

    def __init__(self, model: TinyModel, num_requests: int, max_window: int,
                 block_sizes: Sequence[int], max_tokens: int, backend, seed: int = 0, deferred: bool = False):
        c = model.cfg
        self.model = model
        self.backend = backend
        self.deferred = deferred
        self.num_requests = num_requests
        self.max_window = max_window
        # One group per block size, but never an empty group (a 1-layer model has one group).
        self.block_sizes = list(block_sizes)[:c.num_layers]
        self.num_groups = len(self.block_sizes)
        dev = model.device
        # Layers are named by their index in the stack; the j-th recurrent layer is in group j % G.
        recurrent = c.recurrent_layers
        self.group_of = {i: j % self.num_groups for j, i in enumerate(recurrent)}
        self.layers_of = [[i for i in recurrent if self.group_of[i] == g] for g in range(self.num_groups)]

        # Block tables: every request gets `width` blocks of shuffled slots, so that slot numbers
        # say nothing about requests or positions (as in an engine's block pool). Different groups
        # get different tables (and block sizes): the grouped commit must keep them apart.
        rng = random.Random(seed)
        self.block_tables: list[torch.Tensor] = []
        self.num_slots: list[int] = []
        for bs in self.block_sizes:
            width = math.ceil(max_tokens / bs) + 1
            num_slots = num_requests * width
            slots = list(range(num_slots))
            rng.shuffle(slots)
            table = [slots[q * width:(q + 1) * width] for q in range(num_requests)]
            self.block_tables.append(torch.tensor(table, dtype=torch.int32, device=dev))
            self.num_slots.append(num_slots)
        self.block_tables_host = [t.tolist() for t in self.block_tables]

        # Per recurrent layer, by stack index.
        hist = c.conv_history
        self.state = {i: torch.zeros(self.num_slots[self.group_of[i]], c.HV, c.V, c.K, device=dev,
                                     dtype=c.state_torch_dtype) for i in recurrent}
        self.conv_state = {i: torch.zeros(self.num_slots[self.group_of[i]], c.conv_dim, hist + max_window,
                                          device=dev) for i in recurrent}
        # Deferred: two records buffers, the pending step's and the one this step's verify writes.
        self.records = {i: rs.ReplayRecords.allocate(num_requests, max_window, c.H, c.HV, c.K, c.V, device=dev,
                                                     vector_decay=c.vector_decay, buffers=2 if deferred else 1)
                        for i in recurrent}
        # Per attention layer, by stack index.
        self.kv = {i: model.kv_cache(num_requests) for i in c.attention_layers}
        # Built once: a GPU backend builds its pointer tables here, not per step.
        self.ctx = rs.CommitContext(
            [[rs.LayerCache(self.state[i], self.records[i], conv_state=self.conv_state[i],
                           conv_width=c.conv_width)
              for i in layers] for layers in self.layers_of],
            max_batch=num_requests, backend=backend, deferred=deferred)
        # Deferred: row q of a step continues row q of the step before (a request never changes row).
        self.pending_rows = torch.arange(num_requests, dtype=torch.int32, device=dev)
        # Nothing computed yet: every request starts from block 0 (zero state, zero conv history).
        self.source = [[row[0] for row in tables] for tables in self.block_tables_host]
        self.num_computed = [0] * num_requests

    # ---- one window per request -----------------------------------------------------------------
    def forward(self, windows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify one window per request (lengths ``0 .. max_window``).

        Returns ``logits [T_total, vocab]`` and ``query_start_loc`` int32 ``[R + 1]``. Writes the
        records of every recurrent layer, the window columns of the source slots' conv states and
        the windows' keys and values of every attention layer; no state, except (deferred) the
        previous step's pending commit, which every recurrent layer replays first.
        """
        m, dev = self.model, self.model.device
        lengths = [len(w) for w in windows]
        assert max(lengths) <= self.max_window
        starts = [0] + list(_cumsum(lengths))
        qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
        tokens = torch.tensor([t for w in windows for t in w], dtype=torch.long, device=dev)
        sources = [torch.tensor(s, dtype=torch.int32, device=dev) for s in self.source]
        h = m.embed(tokens)
        verify = m.recurrence("verify")
        for i, w in enumerate(m.layers):
            if m.is_attention(i):
                # a window starts after its request's computed tokens (deferred too: num_computed
                # already counts a pending step's accepted tokens)
                h = m.attention(i, h, self.kv[i], range(self.num_requests), self.num_computed, starts)
                continue
            g = self.group_of[i]
            x = m.in_proj(i, h)
            pending = self._pending(g)
            y = rs.conv_verify(x.conv_in, self.conv_state[i], w.conv_w, w.conv_b, state_indices=sources[g],
                               query_start_loc=qsl, activation="silu", backend=self.backend, **pending)
            o = verify(*m.operands(y), state=self.state[i], state_indices=sources[g], query_start_loc=qsl,
                       records=self.records[i], **m.gates(i, x), backend=self.backend, **pending)
            h = m.finish_layer(i, h, o, x.z)
        return m.logits(h), qsl

    def _pending(self, g: int) -> dict:
        """The verify ops' arguments for the pending step of group ``g`` (none when eager)."""
        if not self.deferred:
            return {}
        return dict(pending=self.ctx.pending[g], pending_rows=self.pending_rows)

    def commit(self, num_accepted: Sequence[int], qsl: torch.Tensor) -> list[GroupPlan]:
        """Commit ``num_accepted[q]`` tokens of each request's window into every layer (ONE call
        for all layers and both groups; deferred: ONE ``defer``, the states are written later),
        then advance the source slots to where the plan puts the states. Returns each group's
        plan (for the checks)."""
        dev = self.model.device
        na = torch.tensor(list(num_accepted), dtype=torch.int32, device=dev)
        nct = torch.tensor(self.num_computed, dtype=torch.int32, device=dev)
        sources = [torch.tensor(s, dtype=torch.int32, device=dev) for s in self.source]
        plans = []
        for g in range(self.num_groups):
            p = rs.plan_commit(na, sources[g], qsl, block_table=self.block_tables[g],
                               num_computed_tokens=nct, block_size=self.block_sizes[g],
                               num_slots=self.num_slots[g], backend=self.backend)
            plans.append(GroupPlan(**p.as_dict()))
        end_step = self.ctx.defer if self.deferred else self.ctx.commit
        end_step(na, sources, qsl, block_table=self.block_tables, num_computed_tokens=nct,
                 block_size=self.block_sizes)
        for g, p in enumerate(plans):
            for q in range(self.num_requests):
                if p.commit_len[q] > 0:
                    self.source[g][q] = p.final_slot[q]
        for q in range(self.num_requests):
            self.num_computed[q] += plans[0].commit_len[q]
        return plans

    def flush(self, requests: Optional[Sequence[int]] = None) -> None:
        """Deferred: commit now what ``requests`` (default: all) have pending, as a finished
        request needs before anything reads or reuses its slots."""
        rows = None if requests is None else torch.tensor(list(requests), dtype=torch.int32,
                                                          device=self.model.device)
        self.ctx.flush(rows)

    def pending_rows_counts(self) -> tuple[int, int]:
        """Deferred: ``(rows with a commit pending, rows of them that every op of every group
        has replayed)``, read from the context's pending plan (a host copy)."""
        plan = self.ctx.pending.plan.cpu()                     # [G, fields, R]
        need = torch.tensor(self.ctx.replays_per_row)[:, None]
        waiting = (plan[:, 0] > 0).any(0)
        replayed = ((plan[:, 0] == 0) | (plan[:, PLAN_FIELDS.index("replays")] >= need)).all(0)
        return int(waiting.sum()), int((waiting & replayed).sum())

    # ---- what the checks read ---------------------------------------------------------------------
    def slot_state(self, layer: int, slot: int) -> torch.Tensor:
        """Layer ``layer``'s recurrent state in ``slot`` ``[HV, V, K]``."""
        return self.state[layer][slot]

    def slot_conv_history(self, layer: int, slot: int) -> torch.Tensor:
        """Layer ``layer``'s conv history in ``slot`` ``[conv_dim, history]``."""
        return self.conv_state[layer][slot, :, :self.model.cfg.conv_history]

    def kv_prefix(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer ``layer``'s keys and values of ``request``'s computed tokens."""
        return self.kv[layer].prefix(request, self.num_computed[request])

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the live working set: one state slot per request per recurrent layer plus
        records, against the snapshot method's ``1 + k`` slots (``k = max_window - 1``) per request
        (attention layers' KV caches are the same for both methods and left out)."""
        c = self.model.cfg
        L, R, T = c.num_layers, self.num_requests, self.max_window
        state = c.HV * c.V * c.K * c.state_torch_dtype.itemsize
        records = sum(r.correction.nbytes + r.key.nbytes + r.decay.nbytes for r in self.records.values())
        return {"state_bytes_per_slot": state, "recoverssm_states": L * R * state,
                "recoverssm_records": records, "snapshot_states": L * R * T * state}


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
