"""Per-program timeline of the grouped commit kernel on a GPU: where a commit's time goes between
the grid's steady state and its drain.

    python benchmarks/commit_timeline.py         # prints a table; writes $OUT/commit_timeline.json, .pt
    python benchmarks/commit_timeline.py --tiny  # CPU tensors, Triton's interpreter: checks the stamped launch
    python benchmarks/commit_timeline.py --compile   # no GPU: registers and spills, library and stamped (sm_90)

The library's commit kernel (``recoverssm/backends/triton/commit.py``) is compiled a second time
from its own source with stamps added (``kernel_variant.py``; nothing else changes): when a
program starts, when its commit plan is known (the stamp waits for the plan's values), when it has
issued its last store, and its SM. Times are the GPU's global timer (``%globaltimer``, comparable
across SMs) and the SM's cycle counter (``%clock64``, for durations within a program). The stamped
kernel is launched with the context's own launches (``CommitContext.committer.launches``: grid,
layer table, constexprs, compile options) and a per-group table uploaded with
``committer.upload``.

For each case the script reports the library kernel's time (``CommitContext.commit``, CUDA graph,
as in the benchmark) next to the stamped kernel's span, so the stamps' own cost shows, and from the
stamps: programs resident over time (mean and a 40-point profile), program life and plan wait,
the drain (from the last program's start to the end: resident-program time lost there, in us of
the whole GPU), and how far apart in the grid's order the programs running at half time are
(1st to 99th percentile of their program numbers: the working set's spread). Programs are
numbered in the grid's dispatch order: item, then batch row, then layer. At the end it fits
time against bytes for the copy (at six sizes) and for the commit (over the bf16 and fp32 sizes
of 3 x 6 layers): the copy's intercept is the fixed cost any kernel of these bytes pays.

``--tiny`` stamps with placeholders instead of PTX (the interpreter runs no PTX) and checks that
the stamped launch commits exactly what ``CommitContext.commit`` commits and that every program
stamps its three points.
"""
import argparse
import functools
import os
import re
import statistics

import torch

import common
from kernel_variant import compile_variant, replace_once

H, HV, K, V, T = 16, 48, 128, 128, 4
STAMPS = 7   # global timer at start, plan, end; clock64 at start, plan, end; SM id
TABLE_COLUMNS = ["case", "commit_us", "vs_copy", "span_us", "programs", "peak_resident", "resident_mean",
                 "life_us_median", "plan_wait_us_median", "drain_idle_us", "idle_share", "running_at_half_spread"]

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

# Under Triton's interpreter (no PTX): every stamp is 1 once its dependency is known, the SM 0.
_INTERPRETED_HELPERS = '''
@triton.jit
def _global_time_after(dependency):
    return (dependency * 0 + 1).to(tl.int64)


@triton.jit
def _clock_after(dependency):
    return (dependency * 0 + 1).to(tl.int64)


@triton.jit
def _sm_id():
    return tl.program_id(0) * 0
'''


# Stamp {0} (0 start, 1 plan known, 2 end) of this program, stored at once so that no
# register holds it across the program: global time at column {0}, clock at {0} + 3, SM at 6.
_STAMP = """    _rec = timeline_ptr + ((layer * tl.num_programs(1) + row) * tl.num_programs(0) + item).to(tl.int64) * 7
    tl.store(_rec + {0}, _global_time_after({1}))
    tl.store(_rec + {0} + 3, _clock_after({1}))
    tl.store(_rec + 6, _sm_id().to(tl.int64))
"""


def _replace_once(text: str, old: str, new: str) -> str:
    return replace_once(text, old, new, "commit.py")


def stamped_kernel(interpreted: bool):
    """The library's ``grouped_commit_kernel`` compiled from its own source with the stamps added
    and one more runtime argument, ``timeline_ptr`` (int64 ``[programs, STAMPS]``)."""
    from recoverssm.backends.triton import commit as commit_module

    source = open(commit_module.__file__).read()
    imports = re.search(r"^from \.numerics import [^\n]*\n", source, re.M)
    if imports is None:
        raise RuntimeError("commit.py changed: no 'from .numerics import' line; update this script")
    line = imports.group(0)
    source = _replace_once(source, line, line.replace("from .numerics", "from recoverssm.backends.triton.numerics")
                           + (_INTERPRETED_HELPERS if interpreted else _STAMP_HELPERS))
    source = _replace_once(source, "    num_requests, null_slot,\n    H: tl.constexpr",
                           "    num_requests, null_slot, timeline_ptr,\n    H: tl.constexpr")
    source = _replace_once(source, "    layer = tl.program_id(2)\n",
                           "    layer = tl.program_id(2)\n" + _STAMP.format(0, "item"))
    plan_end = "        num_requests, null_slot, num_slots, max_window)\n"
    source = _replace_once(source, plan_end, plan_end + _STAMP.format(1, "n + src + final + boundary + boundary_len"))
    # the kernel is the file's last function: its end is the end of the file
    if not re.search(r"^def grouped_commit_kernel\(", source, re.M) or re.search(
            r"^(def |class |@)", source[source.index("def grouped_commit_kernel("):][1:], re.M):
        raise RuntimeError("commit.py changed: grouped_commit_kernel is not its last function; update this script")
    body_end = re.search(r"\n*\Z", source).start()
    source = source[:body_end] + "\n" + _STAMP.format(2, "item")
    return compile_variant(source, "recoverssm_commit_stamped").grouped_commit_kernel


class StampedCommit:
    """The stamped kernel launched as ``ctx.commit`` would launch the library's: one launch per
    entry of ``ctx.committer.launches``, one group table for the step (every group the same index
    tensors). Each call returns the timelines of its launches."""

    def __init__(self, kernel, ctx, num_accepted, state_indices, query_start_loc, block_table=None,
                 num_computed_tokens=None, block_size=None):
        from recoverssm.backends.triton import commit as ck

        self.kernel, self.committer = kernel, ctx.committer
        self.num_accepted, self.query_start_loc = num_accepted, query_start_loc
        self.B = state_indices.shape[0]
        row = [0] * ck.GROUP_FIELDS.value
        row[ck.GROUP_STATE_INDICES.value] = state_indices.data_ptr()
        row[ck.GROUP_BLOCK_TABLE_WIDTH.value] = 1
        row[ck.GROUP_BLOCK_SIZE.value] = 1
        if block_table is not None:
            row[ck.GROUP_BLOCK_TABLE.value] = block_table.data_ptr()
            row[ck.GROUP_BLOCK_TABLE_STRIDE.value] = block_table.stride(0)
            row[ck.GROUP_BLOCK_TABLE_WIDTH.value] = block_table.shape[1]
            row[ck.GROUP_NUM_COMPUTED.value] = num_computed_tokens.data_ptr()
            row[ck.GROUP_BLOCK_SIZE.value] = block_size
        self.keep = (state_indices, block_table, num_computed_tokens)      # the table points at them
        self.group_table, self.group_host = self.committer.upload([row] * ctx.num_groups, ck.GROUP_FIELDS.value,
                                                                  ck.GROUP_POINTER_COLUMNS)

    def __call__(self) -> list:
        timelines = []
        for launch in self.committer.launches:
            grid = (launch.items, self.B, len(launch.layers))
            timeline = torch.zeros(grid[0] * grid[1] * grid[2], STAMPS, dtype=torch.int64,
                                   device=self.num_accepted.device)
            self.kernel[grid](launch.layer_table, self.group_table, self.num_accepted, self.query_start_loc,
                              self.num_accepted.shape[0], self.committer.null_slot, timeline,
                              **launch.constexprs, **launch.options)
            timelines.append(timeline)
        return timelines


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
    quantum = float(torch.diff(torch.unique(tl_[:, 0])).min()) if tl_.shape[0] > 1 else 0.0
    running = torch.nonzero((start <= span / 2) & (end > span / 2)).flatten().double()
    spread = torch.quantile(running, torch.tensor([0.01, 0.99], dtype=torch.float64))
    return dict(programs=tl_.shape[0], span_us=round(span, 2), peak_resident=int(peak),
                sms=int(torch.unique(tl_[:, 6]).numel()),
                resident_mean=round(float((end - start).sum()) / span, 1),
                life_us_median=round(float((end - start).median()), 2),
                life_us_mean=round(float((end - start).mean()), 2),
                plan_wait_us_median=round(float((plan - start).median()), 2),
                life_cycles_median=int(cycles_life.median()), plan_wait_cycles_median=int(cycles_plan.median()),
                first_end_us=round(first_end, 2), last_start_us=round(last_start, 2),
                idle_share=round(lost, 4), drain_idle_us=round(drain_lost, 2),
                running_at_half_spread=int(spread[1] - spread[0]),
                timer_quantum_ns=quantum,
                resident_profile=[int(r) for r in resident[:: max(1, bins // 40)]])


def check_tiny(device) -> None:
    """Under the interpreter: the stamped launch commits what ``CommitContext.commit`` commits, and
    every program stamps start, plan and end."""
    from recoverssm.bench.problems import align_step, commit_context

    kernel = stamped_kernel(interpreted=True)
    for G, L, R, dtype in [(2, 2, 3, torch.float32), (1, 2, 3, torch.bfloat16)]:
        step = align_step(R, T, device=device)
        ctx, caches = commit_context(G, L, R, T, 2, 4, 16, 16, step.num_slots, dtype, device=device)
        kw = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                  block_size=step.block_size)
        states = [layer.state for group in caches for layer in group]
        before = [s.clone() for s in states]
        ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, **kw)
        expected = [s.clone() for s in states]
        for s, b in zip(states, before):
            s.copy_(b)
        timelines = StampedCommit(kernel, ctx, step.num_accepted, step.state_indices, step.query_start_loc, **kw)()
        case = f"{G}x{L}L x {R}req {str(dtype).split('.')[-1]}"
        if not all(torch.equal(s, e) for s, e in zip(states, expected)):
            raise SystemExit(f"{case}: the stamped launch committed other values than CommitContext.commit")
        if all(torch.equal(e, b) for e, b in zip(expected, before)):
            raise SystemExit(f"{case}: the commit changed no state (the case commits nothing)")
        for timeline in timelines:
            if not bool((timeline[:, :6] == 1).all()):
                raise SystemExit(f"{case}: programs without all three stamps: {int((timeline[:, 0] != 1).sum())}")
        print(f"{case}: stamped launch == CommitContext.commit, bit for bit; "
              f"{sum(t.shape[0] for t in timelines)} programs stamped in {len(timelines)} launch(es)")


def compile_kernels(arch: int) -> None:
    """Compile the library's commit kernel and the stamped one for both state dtypes (H=16, HV=48,
    K=V=128, the cuda backend's launch table)."""
    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.commit import grouped_commit_kernel
    from recoverssm.backends.triton.launch import commit_specialization

    stamped = stamped_kernel(interpreted=False)
    types = {**common.COMMIT_TYPES, "timeline_ptr": "*i64"}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        _, constexprs, options = commit_specialization(LAUNCH_TABLE.commit_for(dtype), LAUNCH_TABLE, name, "fp32",
                                                       H, HV, K, V, 1, True)
        for label, kernel in (("library", grouped_commit_kernel), ("stamped", stamped)):
            regs, spills = common.compile_for_gpu(kernel, constexprs, types, options, arch)
            print(f"{label:8s} {name} state, sm_{arch}: {regs} registers, {spills} bytes spilled")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    common.add_tiny_arg(ap)
    common.add_compile_arg(ap)
    args = ap.parse_args()
    if args.compile:
        return compile_kernels(args.compile)
    device = common.setup_device(args.tiny)
    if args.tiny:
        check_tiny(device)
        return

    from recoverssm.bench.problems import align_step, commit_context
    from recoverssm.bench.timing import CopyCeiling, median_us

    ceiling = CopyCeiling("cuda")
    kernel = stamped_kernel(interpreted=False)
    rows, timelines = [], {}
    for G, L, R, dtype in [(3, 6, 8, torch.bfloat16), (3, 6, 16, torch.bfloat16), (3, 6, 32, torch.bfloat16),
                           (3, 6, 64, torch.bfloat16), (1, 12, 8, torch.float32), (3, 6, 8, torch.float32),
                           (3, 6, 64, torch.float32)]:
        step = align_step(R, T)
        ctx, caches = commit_context(G, L, R, T, H, HV, K, V, step.num_slots, dtype)
        kw = dict(block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                  block_size=step.block_size)
        state = HV * V * K * torch.tensor([], dtype=dtype).element_size()
        accepted = step.num_accepted.sum().item()
        traffic = G * L * (state * (2 * R + step.boundaries) + accepted * (HV * V + H * K + HV) * 4)

        us = median_us([functools.partial(ctx.commit, step.num_accepted, step.state_indices, step.query_start_loc,
                                          **kw)], iters=40)
        copy_us = ceiling.us(traffic)
        stamped = StampedCommit(kernel, ctx, step.num_accepted, step.state_indices, step.query_start_loc, **kw)
        if len(ctx.committer.launches) != 1:
            raise SystemExit(f"expected one launch per commit, the context has {len(ctx.committer.launches)}")
        spans = []
        for _ in range(5):
            timeline = stamped()[0]
            torch.cuda.synchronize()
            spans.append((timeline, analyse(timeline)))
        timeline, stats = sorted(spans, key=lambda s: s[1]["span_us"])[len(spans) // 2]
        row = dict(case=f"{G}x{L}L x {R}req {str(dtype).split('.')[-1]}", traffic_mb=round(traffic / 1e6, 1),
                   commit_us=round(us, 1), copy_us=round(copy_us, 1), vs_copy=round(copy_us / us, 3),
                   stamped_span_us=[s["span_us"] for _, s in spans], **stats)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "resident_profile"}, flush=True)
        print("  resident:", row["resident_profile"], flush=True)
        timelines[row["case"]] = timeline.cpu()
        del ctx, caches, stamped
        torch.cuda.empty_cache()
    common.print_table([{k: v for k, v in r.items() if k in TABLE_COLUMNS} for r in rows], TABLE_COLUMNS)
    # the copy's fixed cost: time against bytes at the commit cases' sizes
    copies = [(mb, ceiling.us(int(mb * 1e6))) for mb in (100, 200, 400, 800, 1600, 3200)]
    slope = statistics.linear_regression([m for m, _ in copies], [u for _, u in copies])
    print("copy us vs MB:", copies, "intercept us:", round(slope.intercept, 2), flush=True)
    for dtype in ("bfloat16", "float32"):
        pts = [(r["traffic_mb"], r["commit_us"]) for r in rows
               if r["case"].startswith("3x6L") and r["case"].endswith(dtype)]
        if len(pts) >= 2:
            fit = statistics.linear_regression([m for m, _ in pts], [u for _, u in pts])
            print(f"commit {dtype} 3x6L us vs MB: slope {fit.slope:.4f} us/MB, intercept {fit.intercept:.2f} us "
                  f"(copy: {slope.slope:.4f} us/MB, {slope.intercept:.2f} us)", flush=True)
    if common.write_json("commit_timeline.json", dict(rows=rows, copy=copies)):
        # int64 [programs, STAMPS] per case
        torch.save(timelines, os.path.join(os.environ["OUT"], "commit_timeline.pt"))


if __name__ == "__main__":
    main()
