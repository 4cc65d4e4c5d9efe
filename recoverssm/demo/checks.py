"""The demo's bit-identity checks: the speculative path's committed slots (and the attention
layers' KV caches) against the per-token path, with ``torch.equal``; any difference raises
:class:`DemoMismatch`."""
from __future__ import annotations

from typing import Sequence

import torch

from .reference import ReferenceEngine
from .spec import GroupPlan, SpecEngine


class DemoMismatch(RuntimeError):
    """The speculative path and the per-token path disagree (tokens, logits, states or conv)."""


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise :class:`DemoMismatch` naming ``what`` unless ``got`` and ``want`` are bit-identical."""
    if torch.equal(got, want):
        return
    diff = (got.double() - want.double()).abs()
    raise DemoMismatch(
        f"{what} differs from the per-token path: {int((got != want).sum())} of {got.numel()} "
        f"elements, max |diff| {diff.max().item():.3e} (bit-identity broken)")


class SlotChecker:
    """Compares the slots a commit wrote with the reference, and remembers them for the end."""

    def __init__(self, spec: SpecEngine, ref: ReferenceEngine):
        self.spec, self.ref = spec, ref
        self.compared = 0
        self.compared_kv = 0      # attention layers' KV-cache prefixes compared
        #: per group: slot -> (request, tokens it holds the state after)
        self.written: list[dict[int, tuple[int, int]]] = [{} for _ in spec.block_sizes]

    def _compare(self, where: str, g: int, slot: int, want) -> None:
        for layer, (state, conv) in zip(self.spec.layers_of[g], want):
            expect_equal(self.spec.slot_state(layer, slot), state,
                         f"{where}: layer {layer} (group {g}) recurrent state in slot {slot}")
            expect_equal(self.spec.slot_conv_history(layer, slot), conv,
                         f"{where}: layer {layer} (group {g}) conv history in slot {slot}")
            self.compared += 2

    def _want(self, where: str, g: int, q: int, tokens: int):
        if tokens == self.ref.num_computed[q]:
            return self.ref.current(g, q)
        key = (g, q, tokens)
        if key not in self.ref.block_states:
            raise DemoMismatch(f"{where}: group {g} slot holds request {q}'s state after {tokens} "
                               f"tokens, which is neither current nor a block boundary")
        return self.ref.block_states[key]

    def _check_token_counts(self, where: str) -> None:
        for q, (spec_n, ref_n) in enumerate(zip(self.spec.num_computed, self.ref.num_computed)):
            if spec_n != ref_n:
                raise DemoMismatch(f"{where}: request {q} has {spec_n} tokens committed but the "
                                   f"per-token path computed {ref_n}")

    def _check_kv_caches(self, where: str) -> None:
        """Every attention layer holds, for each request's computed tokens, the per-token path's
        keys and values: the positions of rejected drafts were overwritten or lie past them."""
        for layer in self.spec.kv:
            for q in range(self.spec.num_requests):
                for name, got, want in zip(("keys", "values"), self.spec.kv_prefix(layer, q),
                                           self.ref.kv_prefix(layer, q)):
                    expect_equal(got, want, f"{where}, request {q}: attention layer {layer} cached {name}")
                self.compared_kv += 1

    def _check_slot(self, where: str, g: int, q: int, slot: int, tokens: int, what: str) -> None:
        self._compare(f"{where}, request {q}, {what} (after {tokens} tokens)", g, slot,
                      self._want(where, g, q, tokens))
        self.written[g][slot] = (q, tokens)

    def after_commit(self, where: str, plans: Sequence[GroupPlan], computed_before: Sequence[int]) -> int:
        """Check the final and boundary slots of every group and request, and the attention
        layers' KV caches; return boundary writes."""
        self._check_token_counts(where)
        self._check_kv_caches(where)
        boundaries = 0
        for g, plan in enumerate(plans):
            for q, before in enumerate(computed_before):
                n = plan.commit_len[q]
                if n == 0:
                    continue
                if plan.boundary_slot[q] > -1:
                    self._check_slot(where, g, q, plan.boundary_slot[q], before + plan.boundary_len[q],
                                     "boundary block")
                    boundaries += 1
                self._check_slot(where, g, q, plan.final_slot[q], before + n, "final slot")
        return boundaries

    def prefix_cache(self) -> int:
        """Every slot written during the run still holds its state (verify never wrote a state,
        no commit clobbered another block). Returns the number of blocks checked."""
        blocks = 0
        for g, slots in enumerate(self.written):
            for slot, (q, tokens) in sorted(slots.items()):
                self._compare(f"end of run, request {q}, block slot (after {tokens} tokens)",
                              g, slot, self._want("end of run", g, q, tokens))
                blocks += 1
        return blocks
