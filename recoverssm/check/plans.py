"""Check of ``plan_commit`` on random align and non-align steps, exact against cpu_ref."""
from __future__ import annotations

import random

import torch

import recoverssm as rs

from .align import PLAN_FIELDS
from .problems import PlanCase, i32, query_start_loc, random_align_step
from .report import REF, Report


def plan_on(backend_name: str, device: torch.device, meta: dict, lengths: list[int], align: bool
            ) -> rs.CommitPlan:
    """``plan_commit`` of the step ``meta`` (its first group) on ``device``; without ``align``, the
    same step in non-align mode (no block table)."""
    grp, dev = meta["groups"][0], device
    return rs.plan_commit(
        i32(meta["num_accepted"], dev), i32(grp["state_indices"], dev), i32(query_start_loc(lengths), dev),
        request_indices=i32(meta["request_of"], dev) if meta["permute"] else None,
        block_table=torch.tensor(grp["block_table"], dtype=torch.int32, device=dev) if align else None,
        num_computed_tokens=i32(meta["num_computed_tokens"], dev) if align else None,
        block_size=grp["block_size"] if align else None, num_slots=grp["num_slots"], backend=backend_name)


def random_plan_pairs(case: PlanCase, backend_name: str, device: torch.device, rng: random.Random) -> list:
    """``(backend's field, cpu_ref's field)`` of every plan field of ``case.count`` random steps."""
    pairs = []
    for i in range(case.count):
        B = rng.randint(1, 6)
        lengths = [rng.randint(0, 5) for _ in range(B)]
        meta = random_align_step(B, lengths, (rng.randint(1, 5),), rng, permute=i % 3 == 1,
                                 pad_row=i % 4 == 2, unallocated=i % 2 == 0)
        align = i % 5 != 4
        want = plan_on(REF, torch.device("cpu"), meta, lengths, align)
        got = plan_on(backend_name, device, meta, lengths, align)
        pairs += [(getattr(got, f), getattr(want, f)) for f in PLAN_FIELDS]
    return pairs


def check_plans(report: Report, case: PlanCase, backend, device: torch.device, gen: torch.Generator,
                rng: random.Random) -> None:
    """``case.count`` random plans (``gen`` is not used here)."""
    if "plan_commit" not in backend.capabilities:
        report.skip(case.label, "plan_commit", "no plan_commit capability")
        return
    pairs = report.guarded(case.label, "plan_commit",
                           lambda: random_plan_pairs(case, backend.name, device, rng))
    if pairs is not None:
        report.exact(case.label, "plan_commit vs cpu_ref", pairs)
