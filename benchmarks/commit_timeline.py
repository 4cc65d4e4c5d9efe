"""Per-program timeline of the grouped commit kernel on a GPU: where a commit's time goes between
the grid's fill, its steady state and its drain.

    python benchmarks/commit_timeline.py                 # prints a table, writes $OUT/commit_timeline.json
    python benchmarks/commit_timeline.py --bf16-programs-per-sm 16 --fp32-programs-per-sm 8
                                                         # the same with persistent grids

The library's kernel source is compiled a second time with four time stamps added (nothing else
changes): when a program starts, when its commit plan is known (the stamp waits for the plan's
values), when it has issued its last store, and its SM. Stamps are the GPU's global timer
(``%globaltimer``, comparable across SMs) and the SM's cycle counter (``%clock64``, for durations
within a program). For each case the script reports the stamped kernel's span next to the
library kernel's time (CUDA events, the same step), so the stamps' own cost shows, and from the
stamps: programs resident over time, the median program life and plan wait, and how long the
grid takes to fill (the first program to finish) and to drain (from the last program's start to
the end), with the share of resident-program time lost while fewer than the peak were resident.
The copy ceiling of the same bytes is timed at several sizes too: its intercept is the fixed
cost any kernel of these bytes pays, next to the commit's.
"""
import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import types

import torch

from recoverssm.backends.triton import commit as commit_module
from recoverssm.backends.triton import launch
from recoverssm.bench.problems import align_step, commit_context
from recoverssm.bench.timing import CopyCeiling, median_us

H, HV, K, V, T = 16, 48, 128, 128, 4
STAMPS = 7   # global timer at start, plan, end; clock64 at start, plan, end; SM id

_STAMP_HELPERS = '''
@triton.jit
def _global_time_after(dependency):
    """%globaltimer, read only once ``dependency`` (an int32) is available."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, -123456789; mov.u64 $0, 0; @p mov.u64 $0, %globaltimer; }",
        "=l,r", [dependency], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock_after(dependency):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, -123456789; mov.u64 $0, 0; @p mov.u64 $0, %clock64; }",
        "=l,r", [dependency], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
'''


# Stamp number {0} (0 work item started, 1 its commit plan known, 2 ended) of the work item whose
# record is ``_rec``, stored at once so that no register holds it: global time at column {0},
# clock at {0} + 3, SM at 6.
_STAMP = """{2}tl.store(_rec + {0}, _global_time_after({1}))
{2}tl.store(_rec + {0} + 3, _clock_after({1}))
{2}tl.store(_rec + 6, _sm_id().to(tl.int64))
"""


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"commit.py changed: {old!r} found {text.count(old)} times; update this script")
    return text.replace(old, new)


def stamped_kernel():
    """The library's ``grouped_commit_kernel`` compiled from its own source with the stamps added
    and one more runtime argument, ``timeline_ptr`` (int64 ``[work items, STAMPS]``)."""
    source = open(commit_module.__file__).read()
    source = _replace_once(source, "from .numerics import to_storage",
                           "from recoverssm.backends.triton.numerics import to_storage\n" + _STAMP_HELPERS)
    source = _replace_once(source, "    num_requests, null_slot, batch, num_layers,\n",
                           "    num_requests, null_slot, batch, num_layers, timeline_ptr,\n")
    source = _replace_once(source, "                     item, row, layer,\n", "                     item, row, layer, _rec,\n")
    plan_end = "        num_requests, null_slot, num_slots, max_window)\n"
    source = _replace_once(source, plan_end, plan_end + _STAMP.format(1, "n + src + final + boundary + boundary_len", "    "))
    # both calls of the work item (persistent loop, plain grid): stamp around each, the record
    # indexed by the work item's number, the plain grid's order
    calls = list(re.finditer(r"^( +)commit_work_item\((.*?)PREFETCH_NEXT_TILE\)\n", source, re.M | re.S))
    if len(calls) != 2:
        raise RuntimeError(f"commit.py changed: {len(calls)} calls of commit_work_item; update this script")
    for call in reversed(calls):
        indent, text = call.group(1), call.group(0)
        work = "work" if "work % ITEMS" in text else \
            "(tl.program_id(2) * batch + tl.program_id(1)) * ITEMS + tl.program_id(0)"
        text = re.sub(r"(\n +)(H, HV, K, V, K_PAD)", r" _rec,\1\2", text, count=1)   # after (item, row, layer)
        stamped = (f"{indent}_rec = timeline_ptr + ({work}).to(tl.int64) * 7\n" + _STAMP.format(0, f"({work})", indent)
                   + text + _STAMP.format(2, f"({work})", indent))
        source = source[:call.start()] + stamped + source[call.end():]
    module = types.ModuleType("recoverssm_commit_stamped")
    module.__file__ = os.path.join(os.environ.get("OUT", "/tmp"), "recoverssm_commit_stamped.py")
    with open(module.__file__, "w") as f:      # Triton reads a jit function's source from its file
        f.write(source)
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module.grouped_commit_kernel


class StampedLaunch:
    """Stands in for ``launch._GROUPED_COMMIT``: launches the stamped kernel into ``self.timeline``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.timeline = None

    def __call__(self, grid, args, constexprs, options):
        work = constexprs["ITEMS"] * args[-2] * args[-1]         # items x batch x layers
        self.timeline = torch.zeros(work, STAMPS, dtype=torch.int64, device=args[0].device)
        self.kernel[tuple(grid)](*args, self.timeline, **constexprs, **options)

    def bind(self, *launch):
        return None        # never repeat a bound launch: each call stamps a fresh timeline


def analyse(timeline: torch.Tensor, bins: int = 200) -> dict:
    tl_ = timeline.cpu()
    start, plan, end = tl_[:, 0].double(), tl_[:, 1].double(), tl_[:, 2].double()
    t0 = start.min()
    start, plan, end = (start - t0) / 1e3, (plan - t0) / 1e3, (end - t0) / 1e3      # us
    span = float(end.max())
    cycles_life = (tl_[:, 5] - tl_[:, 3]).double()
    cycles_plan = (tl_[:, 4] - tl_[:, 3]).double()
    edges = torch.linspace(0, span, bins + 1, dtype=torch.float64)
    mid = (edges[:-1] + edges[1:]) / 2
    resident = ((start[None, :] <= mid[:, None]) & (end[None, :] > mid[:, None])).sum(1).double()
    peak = float(resident.max())
    lost = float((1 - resident / peak).sum() / bins)          # share of span x peak slots left idle
    first_end = float(end.min())
    last_start = float(start.max())
    drain_lost = float(((1 - resident / peak) * (mid >= last_start)).sum() / bins * span)
    fill_lost = float(((1 - resident / peak) * (mid < first_end)).sum() / bins * span)
    quantum = float(torch.diff(torch.unique(tl_[:, 0])).min()) if tl_.shape[0] > 1 else 0.0
    return dict(programs=tl_.shape[0], span_us=round(span, 2), peak_resident=int(peak),
                sms=int(torch.unique(tl_[:, 6]).numel()),
                life_us_median=round(float((end - start).median()), 2),
                plan_wait_us_median=round(float((plan - start).median()), 2),
                life_cycles_median=int(cycles_life.median()), plan_wait_cycles_median=int(cycles_plan.median()),
                first_end_us=round(first_end, 2), last_start_us=round(last_start, 2),
                idle_share=round(lost, 4), fill_idle_us=round(fill_lost, 2), drain_idle_us=round(drain_lost, 2),
                timer_quantum_ns=quantum,
                resident_profile=[int(r) for r in resident[:: max(1, bins // 40)]])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16-programs-per-sm", type=int, help="override the launch table's for bf16 states")
    ap.add_argument("--fp32-programs-per-sm", type=int, help="override the launch table's for fp32 states")
    args = ap.parse_args()
    out = os.environ.get("OUT")
    tag = "" if args.bf16_programs_per_sm is None and args.fp32_programs_per_sm is None else \
        f"_persistent_{args.bf16_programs_per_sm}_{args.fp32_programs_per_sm}"
    ceiling = CopyCeiling("cuda")
    stamped = StampedLaunch(stamped_kernel())
    library = launch._GROUPED_COMMIT
    rows = []
    for G, L, R, dtype in [(3, 6, 8, torch.bfloat16), (3, 6, 16, torch.bfloat16), (3, 6, 32, torch.bfloat16),
                           (3, 6, 64, torch.bfloat16), (1, 12, 8, torch.float32), (3, 6, 8, torch.float32),
                           (3, 6, 64, torch.float32)]:
        step = align_step(R, T)
        ctx, caches = commit_context(G, L, R, T, H, HV, K, V, step.num_slots, dtype)
        cfg = ctx._committer.cfg
        if args.bf16_programs_per_sm is not None:
            cfg = dataclasses.replace(cfg, commit_programs_per_sm_bf16=args.bf16_programs_per_sm)
        if args.fp32_programs_per_sm is not None:
            cfg = dataclasses.replace(cfg, commit_programs_per_sm=args.fp32_programs_per_sm)
        ctx._committer.set_config(cfg)
        kw = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                  block_size=step.block_size)
        state = HV * V * K * torch.tensor([], dtype=dtype).element_size()
        accepted = step.num_accepted.sum().item()
        traffic = G * L * (state * (2 * R + step.boundaries) + accepted * (HV * V + H * K + HV) * 4)

        call = functools.partial(ctx.commit, step.num_accepted, step.state_indices, step.query_start_loc, **kw)

        launch._GROUPED_COMMIT = library
        us = median_us([call], iters=40)
        copy_us = ceiling.us(traffic)
        launch._GROUPED_COMMIT = stamped
        ctx._committer._repeat = None       # the library's bound launch would bypass the stand-in
        spans = []
        for _ in range(5):
            call()
            torch.cuda.synchronize()
            spans.append((stamped.timeline, analyse(stamped.timeline)))
        launch._GROUPED_COMMIT = library
        timeline, stats = sorted(spans, key=lambda s: s[1]["span_us"])[len(spans) // 2]
        row = dict(case=f"{G}x{L}L x {R}req {str(dtype).split('.')[-1]}", traffic_mb=round(traffic / 1e6, 1),
                   commit_us=round(us, 1), copy_us=round(copy_us, 1), vs_copy=round(copy_us / us, 3),
                   stamped_span_us=[s["span_us"] for _, s in spans], **stats)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "resident_profile"}, flush=True)
        print("  resident:", row["resident_profile"], flush=True)
        if out:
            torch.save(timeline.cpu(), os.path.join(out, f"timeline_{G}x{L}_{R}_{str(dtype).split('.')[-1]}{tag}.pt"))
        del ctx, caches
        torch.cuda.empty_cache()
    # the copy's fixed cost: time against bytes at the commit cases' sizes
    copies = [(mb, ceiling.us(int(mb * 1e6))) for mb in (100, 200, 400, 800, 1600, 3200)]
    slope = statistics.linear_regression([m for m, _ in copies], [u for _, u in copies])
    print("copy us vs MB:", copies, "intercept us:", round(slope.intercept, 2), flush=True)
    for dtype in ("bfloat16", "float32"):
        pts = [(r["traffic_mb"], r["commit_us"]) for r in rows if r["case"].startswith("3x6L") and r["case"].endswith(dtype)]
        if len(pts) >= 2:
            fit = statistics.linear_regression([m for m, _ in pts], [u for _, u in pts])
            print(f"commit {dtype} 3x6L us vs MB: slope {fit.slope:.4f} us/MB, intercept {fit.intercept:.2f} us "
                  f"(copy: {slope.slope:.4f} us/MB, {slope.intercept:.2f} us)", flush=True)
    if out:
        with open(os.path.join(out, f"commit_timeline{tag}.json"), "w") as f:
            json.dump(dict(bf16_programs_per_sm=args.bf16_programs_per_sm,
                           fp32_programs_per_sm=args.fp32_programs_per_sm, rows=rows, copy=copies), f, indent=1)


if __name__ == "__main__":
    main()
