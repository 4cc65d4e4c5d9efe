"""The commit plan and the replay commit (the reference).

The plan rules themselves live in ``recoverssm.core.plan.plan_rows`` (validation uses them too).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...core.backend import CommitLayer, Committer, GroupStep
from ...core.plan import plan_rows
from ...core.writes import versions_kept
from .conv import conv_compact
from .recurrence import replay_step


def plan_commit(num_accepted, state_indices, query_start_loc, request_indices, block_table,
                num_computed_tokens, block_size, null_slot, num_slots, out) -> None:
    rows = plan_rows(
        num_accepted.tolist(), state_indices.tolist(), query_start_loc.tolist(),
        None if request_indices is None else request_indices.tolist(),
        None if block_table is None else block_table.tolist(),
        None if num_computed_tokens is None else num_computed_tokens.tolist(),
        block_size, null_slot, num_slots)
    for column, values in zip(out, zip(*rows) if rows else ((),) * 4):
        column.copy_(torch.tensor(values, dtype=torch.int32))


def commit_layer(layer: CommitLayer, sources: list[int], plan: list[tuple[int, int, int, int]],
                 null_slot: int) -> None:
    """Replay each row's first ``commit_len`` records into its source state; store the boundary
    state after ``boundary_len`` tokens and the final state after ``commit_len``."""
    rows = [r for r, p in enumerate(plan) if p[0] > 0]
    if not rows:
        return
    state = layer.state
    H, HV = layer.key.shape[1], layer.correction.shape[1]
    head_of = torch.arange(HV) // (HV // H)
    S = state[[sources[r] for r in rows]].float()     # every source read before any store
    for t in range(max(plan[r][0] for r in rows)):
        live = [i for i, r in enumerate(rows) if plan[r][0] > t]
        rr = [rows[i] for i in live]
        S[live] = replay_step(S[live], layer.correction[rr, :, t], layer.key[rr][:, head_of, t],
                              layer.decay[rr, :, t])
        for i in live:
            _, _, boundary, boundary_len = plan[rows[i]]
            if boundary > null_slot and boundary_len == t + 1:
                state[boundary] = S[i].to(state.dtype)
    for i, r in enumerate(rows):
        state[plan[r][1]] = S[i].to(state.dtype)
    if layer.conv_state is not None:
        for r in rows:
            n, final, boundary, boundary_len = plan[r]
            conv_compact(layer.conv_state, layer.conv_history, sources[r], final, boundary, n,
                         boundary_len, null_slot)


class RefCommitter(Committer):
    """Commits every layer of every group, one layer after the other."""

    def __init__(self, layers: Sequence[CommitLayer], null_slot: int):
        self.layers = list(layers)
        self.null_slot = null_slot

    def commit(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor,
               groups: Sequence[GroupStep], *, bind: bool = False) -> None:
        with versions_kept([t for layer in self.layers for t in (layer.state, layer.conv_state)]):
            self._commit(num_accepted, query_start_loc, groups)

    def _commit(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor, groups: Sequence[GroupStep]) -> None:
        qsl = query_start_loc.tolist()
        accepted = num_accepted.tolist()
        for layer in self.layers:
            step = groups[layer.group]
            sources = step.state_indices.tolist()
            plan = plan_rows(
                accepted, sources, qsl,
                None if step.request_indices is None else step.request_indices.tolist(),
                None if step.block_table is None else step.block_table.tolist(),
                None if step.num_computed_tokens is None else step.num_computed_tokens.tolist(),
                step.block_size or 1, self.null_slot, layer.state.shape[0], layer.correction.shape[2])
            commit_layer(layer, sources, plan, self.null_slot)
