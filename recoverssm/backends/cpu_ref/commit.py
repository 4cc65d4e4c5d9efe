"""The commit plan and the replay commit (the reference).

The plan rules themselves live in ``recoverssm.core.plan.plan_rows`` (validation uses them too).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...core.backend import CommitLayer, Committer, GroupStep
from ...core.plan import plan_entry, plan_rows
from ...core.writes import versions_kept
from .conv import conv_compact
from .replay import RowCommit, replay_commits


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


def commit_layer(layer: CommitLayer, commits: Sequence[RowCommit], null_slot: int) -> None:
    """The rows' commits into one layer: the state (``replay.replay_commits``), then the conv
    history of each into its final and boundary slots."""
    commits = [c for c in commits if c.n > 0]
    replay_commits(layer.state, layer.correction, layer.key, layer.decay, commits, null_slot, layer.round_each_token)
    if layer.conv_state is not None:
        for c in commits:
            conv_compact(layer.conv_state, layer.conv_history, c.source, c.final, c.boundary, c.n, c.boundary_len,
                         null_slot)


class RefCommitter(Committer):
    """Commits every layer of every group, one layer after the other."""

    def __init__(self, layers: Sequence[CommitLayer], null_slot: int):
        self.layers = list(layers)
        self.null_slot = null_slot

    def _written(self) -> list:
        return [t for layer in self.layers for t in (layer.state, layer.conv_state)]

    def commit(self, num_accepted: torch.Tensor, query_start_loc: torch.Tensor,
               groups: Sequence[GroupStep], *, bind: bool = False) -> None:
        qsl, accepted = query_start_loc.tolist(), num_accepted.tolist()
        with versions_kept(self._written()):
            for layer in self.layers:
                step = groups[layer.group]
                sources = step.state_indices.tolist()
                plan = _step_plan(step, accepted, sources, qsl, self.null_slot, layer.state.shape[0],
                                  layer.correction.shape[2])
                commit_layer(layer, [RowCommit(r, n, sources[r], final, boundary, boundary_len)
                                     for r, (n, final, boundary, boundary_len) in enumerate(plan)], self.null_slot)

    def defer(self, plan: torch.Tensor, parity: torch.Tensor, num_accepted: torch.Tensor,
              query_start_loc: torch.Tensor, groups: Sequence[GroupStep], *, bind: bool = False) -> None:
        with versions_kept((plan, parity)):
            self._defer(plan, parity, num_accepted, query_start_loc, groups)

    def _defer(self, plan, parity, num_accepted, query_start_loc, groups: Sequence[GroupStep]) -> None:
        qsl, accepted = query_start_loc.tolist(), num_accepted.tolist()
        for g, step in enumerate(groups):
            members = [layer for layer in self.layers if layer.group == g]
            sources = step.state_indices.tolist()
            rows = _step_plan(step, accepted, sources, qsl, self.null_slot, members[0].state.shape[0],
                              members[0].correction.shape[2])
            fields = torch.zeros(plan.shape[1:], dtype=torch.int32)
            fields[1:4] = self.null_slot
            for r, (n, final, boundary, boundary_len) in enumerate(rows):
                fields[:5, r] = torch.tensor([n, sources[r], final, boundary, boundary_len], dtype=torch.int32)
            plan[g].copy_(fields)
        parity.copy_(1 - parity)

    def flush(self, plan: torch.Tensor, parity: torch.Tensor, rows: torch.Tensor, *, bind: bool = False) -> None:
        wanted = rows.tolist()
        other = 1 - int(parity.item())
        with versions_kept([*self._written(), plan]):
            for layer in self.layers:
                fields = plan[layer.group].tolist()
                buffer_rows = layer.correction.shape[0] // layer.record_buffers
                commits = []
                for r in wanted:
                    n, source, final, boundary, boundary_len = plan_entry(
                        fields, r, self.null_slot, layer.state.shape[0], layer.correction.shape[2])
                    if n > 0:
                        commits.append(RowCommit(other * buffer_rows + r, n, source, final, boundary, boundary_len))
                commit_layer(layer, commits, self.null_slot)
            for r in wanted:                 # flushed: nothing pending any more
                if r > self.null_slot and 0 <= r < plan.shape[2]:
                    plan[:, 0, r] = 0


def _step_plan(step: GroupStep, accepted: list, sources: list, qsl: list, null_slot: int, num_slots: int,
               max_len: int) -> list:
    return plan_rows(accepted, sources, qsl,
                     None if step.request_indices is None else step.request_indices.tolist(),
                     None if step.block_table is None else step.block_table.tolist(),
                     None if step.num_computed_tokens is None else step.num_computed_tokens.tolist(),
                     step.block_size or 1, null_slot, num_slots, max_len)
