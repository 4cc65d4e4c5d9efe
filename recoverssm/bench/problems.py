"""Benchmark inputs built on the device: windows, state pools, records and commit contexts."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import recoverssm as rs


def spread_accepted(N: int, T: int, device="cuda") -> torch.Tensor:
    """The benchmarks' accepted counts for ``N`` rows of ``T``-token windows: row ``r`` accepts
    ``1 + 7r mod T`` tokens (int32 ``[N]``), every length from 1 to ``T`` in turn."""
    return torch.tensor([1 + (r * 7) % T for r in range(N)], dtype=torch.int32, device=device)


@dataclass
class Window:
    """One layer's verify inputs for ``N`` rows of ``T`` tokens (bf16 activations, raw gates).

    ``family`` is ``"gdn"`` (scalar decay, ``a`` ``[T, HV]``) or ``"kda"`` (per-channel decay,
    ``a`` ``[T, HV, K]``, vector-decay records); it picks the verify op."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    state: torch.Tensor
    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    records: rs.ReplayRecords
    N: int
    T: int
    family: str = "gdn"

    def gates(self) -> dict:
        return dict(a=self.a, b=self.b, A_log=self.A_log, dt_bias=self.dt_bias)

    def verify(self, backend: str = "cuda"):
        op = rs.gdn_verify if self.family == "gdn" else rs.kda_verify
        return op(self.q, self.k, self.v, state=self.state, state_indices=self.state_indices,
              query_start_loc=self.query_start_loc, records=self.records,
              backend=backend, **self.gates())


def window(N: int, T: int, H: int, HV: int, K: int, V: int, *, state_dtype=torch.float32,
           extra_slots: int = 0, device="cuda", seed: int = 0, round_each_token: bool = True) -> Window:
    """``round_each_token``: the records' rounding mode (``ReplayRecords``), which the window's
    verify, its commits and its deferred steps (:class:`DeferredLayer`) follow."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = N * T
    kw = dict(device=device, generator=g)
    q = torch.randn(total, H, K, **kw).to(torch.bfloat16)
    k = torch.randn(total, H, K, **kw).to(torch.bfloat16)
    v = torch.randn(total, HV, V, **kw).to(torch.bfloat16)
    a = torch.randn(total, HV, **kw).to(torch.bfloat16)
    b = torch.randn(total, HV, **kw).to(torch.bfloat16)
    A_log = torch.randn(HV, **kw) * 0.5
    dt_bias = torch.randn(HV, **kw) * 0.5
    state = (torch.randn(N + extra_slots, HV, V, K, **kw) * 0.1).to(state_dtype)
    state_indices = torch.arange(N, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=device)
    records = rs.ReplayRecords.allocate(N, T, H, HV, K, V, device=device, round_each_token=round_each_token)
    return Window(q, k, v, a, b, A_log, dt_bias, state, state_indices, qsl, records, N, T)


class DeferredLayer:
    """One layer's step with deferred commits over a :class:`Window`'s inputs and state: a
    context that defers, double-buffered records, every row continuing its own row of the step
    before. :meth:`verify` replays the pending step and verifies; :meth:`defer` ends the step.
    :meth:`warm` runs a step so that every row has a step pending (the steady state)."""

    def __init__(self, w: Window, accepted: torch.Tensor, H: int, K: int, V: int, backend: str = "cuda"):
        HV = w.state.shape[1]
        self.w, self.accepted, self.backend = w, accepted, backend
        self.records = rs.ReplayRecords.allocate(w.N, w.T, H, HV, K, V, device=w.state.device,
                                                 vector_decay=w.family == "kda", buffers=2,
                                                 round_each_token=w.records.round_each_token)
        self.ctx = rs.CommitContext([[rs.LayerCache(w.state, self.records)]], max_batch=w.N, backend=backend,
                                    deferred=True)
        self.rows = torch.arange(w.N, dtype=torch.int32, device=w.state.device)

    def verify(self):
        w = self.w
        op = rs.gdn_verify if w.family == "gdn" else rs.kda_verify
        return op(w.q, w.k, w.v, state=w.state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  records=self.records, pending=self.ctx.pending, pending_rows=self.rows, backend=self.backend,
                  **w.gates())

    def defer(self):
        return self.ctx.defer(self.accepted, self.w.state_indices, self.w.query_start_loc)

    def step(self):
        self.verify()
        self.defer()

    def warm(self) -> "DeferredLayer":
        self.step()
        return self


@dataclass
class AlignStep:
    """An align-mode commit step for ``R`` requests: a mix of windows that stay inside a block,
    cross a boundary, and end exactly on one. Slots are the pool's blocks."""

    num_accepted: torch.Tensor
    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_size: int
    num_slots: int
    boundaries: int      # rows whose commit also writes a boundary state


def align_step(R: int, T: int, *, block_size: int = 16, device="cuda") -> AlignStep:
    blocks_per_req = 3
    num_slots = R * blocks_per_req
    block_table = torch.arange(num_slots, dtype=torch.int32).view(R, blocks_per_req)
    accepted, computed, sources = [], [], []
    for r in range(R):
        kind = r % 3
        if kind == 0:      # inside a block
            nc, n = block_size + 2, max(1, T - 2)
        elif kind == 1:    # crossing into the next block
            nc, n = 2 * block_size - 2, T
        else:              # ending exactly on a block boundary
            nc, n = 2 * block_size - T, T
        accepted.append(n)
        computed.append(nc)
        sources.append(int(block_table[r, (nc - 1) // block_size]))
    plan = rs.plan_commit(torch.tensor(accepted, dtype=torch.int32), torch.tensor(sources, dtype=torch.int32),
                          torch.arange(0, (R + 1) * T, T, dtype=torch.int32), block_table=block_table,
                          num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
                          block_size=block_size, backend="cpu_ref")
    boundaries = int((plan.boundary_slot >= 0).sum())
    to = dict(dtype=torch.int32, device=device)
    return AlignStep(torch.tensor(accepted, **to), torch.tensor(sources, **to),
                     torch.arange(0, (R + 1) * T, T, **to), block_table.to(device),
                     torch.tensor(computed, **to), block_size, num_slots, boundaries)


def per_group_indices(step: AlignStep, groups: int) -> dict:
    """The step's per-group commit arguments as an engine passes them: each group its own copy of
    the slot indices, block table and computed-token counts (the same values)."""
    def copies(t: torch.Tensor) -> list:
        return [t.clone() for _ in range(groups)]

    return dict(state_indices=copies(step.state_indices), block_table=copies(step.block_table),
                num_computed_tokens=copies(step.num_computed_tokens), block_size=step.block_size)


def commit_context(groups: int, layers_per_group: int, R: int, T: int, H: int, HV: int, K: int,
                   V: int, num_slots: int, state_dtype=torch.float32, device="cuda"):
    """A CommitContext over fresh state pools and filled records (values do not matter for time)."""
    caches = []
    for _ in range(groups):
        group = []
        for _ in range(layers_per_group):
            state = (torch.randn(num_slots, HV, V, K, device=device) * 0.1).to(state_dtype)
            rec = rs.ReplayRecords.allocate(R, T, H, HV, K, V, device=device)
            rec.correction.normal_().mul_(0.01)
            rec.key.normal_().mul_(0.08)
            rec.decay.uniform_(0.9, 1.0)
            group.append(rs.LayerCache(state, rec))
        caches.append(group)
    return rs.CommitContext(caches, max_batch=R, backend="cuda"), caches
