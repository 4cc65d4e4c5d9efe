"""Where the host time of one commit call and one verify call goes, piece by piece (on a GPU).

    python benchmarks/host_breakdown.py

Each line is the median host time (us) of calling only that piece, as wall time and as the
thread's CPU time; the pieces of one call add up to roughly the whole. Complements
benchmarks/host_profile.py (cProfile inflates Python-heavy code).
"""
import torch

from recoverssm.backends.triton import launch
from recoverssm.bench.problems import align_step, commit_context, per_group_indices, window
from recoverssm.bench.timing import host_times
from recoverssm.core import api
from recoverssm.core.backend import GroupStep
from recoverssm.core.commit import _check_step_shapes, _StepSignature
from recoverssm.core.validation import Checker

H, K, V = 16, 128, 128


def _enter_exit(ctx_manager):
    with ctx_manager:
        pass


def main():
    T, R = 4, 8
    step = align_step(R, T)
    ctx, _ = commit_context(3, 6, R, T, H, 48, K, V, step.num_slots)
    kw = per_group_indices(step, 3)
    groups = [GroupStep(kw["state_indices"][gi], None, kw["block_table"][gi], kw["num_computed_tokens"][gi],
                        step.block_size) for gi in range(3)]
    c = Checker("commit", ctx.device)
    committer = ctx._committer

    def checks():
        for gi, g in enumerate(groups):
            _check_step_shapes(c, step.num_accepted, g.state_indices, step.query_start_loc, None,
                               g.block_table, g.num_computed_tokens, step.block_size, f"[{gi}]")

    def whole_call():
        ctx.commit(step.num_accepted, query_start_loc=step.query_start_loc, **kw)

    whole_call()
    whole_call()        # the second call with the same tensors binds the repeated launch
    same = (step.num_accepted, kw["state_indices"], step.query_start_loc, None, kw["block_table"],
            kw["num_computed_tokens"], step.block_size)
    last = _StepSignature(same)
    launch_args = committer._launch_args(step.num_accepted, step.query_start_loc, groups, R)
    bound = launch._GROUPED_COMMIT.bind(*launch_args)
    if bound is None:
        raise SystemExit("host_breakdown.py needs the direct launch path (a CUDA GPU, no TRITON_INTERPRET)")
    rows = [("commit: whole call", whole_call),
            ("commit: signature of the step (matching the last)", lambda: last.matches(same)),
            ("commit: committer.commit_again", lambda: committer.commit_again(
                step.num_accepted, step.query_start_loc, ctx._last_steps)),
            ("commit: shape checks (3 groups; first call only)", checks),
            ("commit: committer.commit (unbound launch)", lambda: committer.commit(step.num_accepted, step.query_start_loc, groups)),
            ("commit: group table lookup", lambda: committer._group_table_for(groups)),
            ("commit: device guard", lambda: _enter_exit(committer.device_guard(committer.device))),
            ("commit: kernel launch only", lambda: launch._GROUPED_COMMIT(*launch_args)),
            ("commit: bound launch only", bound)]
    w = window(R, T, H, 48, K, V)
    be = api._resolve("cuda", w.q.device)
    out = torch.empty_like(w.v)
    g = dict(a=w.a, b=w.b, A_log=w.A_log, dt_bias=w.dt_bias)
    cfg = be.config(K, V)
    gates = api.GateInputs(**g)
    rec = (w.records.correction, w.records.key, w.records.decay)

    def verify_checks():
        cc, dims, *_ = api._check_gdn("gdn_verify", w.q, w.k, w.v, w.state, w.state_indices,
                                      w.query_start_loc, w.a, w.b, w.A_log, w.dt_bias, None, None,
                                      None, -1, None)
        api._check_records(cc, w.records, dims)

    rows += [("verify: whole call", w.verify),
             ("verify: checks", verify_checks),
             ("verify: backend resolve", lambda: api._resolve("cuda", w.q.device)),
             ("verify: launcher (pack + launch)", lambda: launch.gdn_recurrent(
                 cfg, "verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc, gates,
                 K ** -0.5, True, -1, out, rec, None)),
             ("verify: input alignment check", lambda: launch._aligned_token_inputs(w.q, w.k, w.v, out)),
             ("verify: kernel launch only", lambda: launch._launch_recurrent(
                 cfg, "verify", w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc, gates,
                 K ** -0.5, True, -1, out, rec, None, True)),
             ("torch.empty_like", lambda: torch.empty_like(w.v))]

    def show(name, fn):
        times = host_times(fn)
        print(f"{name:48s} {times['wall_us']:8.2f} us wall {times['cpu_us']:8.2f} us CPU", flush=True)

    for name, fn in rows:
        show(name, fn)
    # The same two launches through Triton's own per-call path, for comparison in this run.
    print("direct launch enabled:", launch._RECURRENCE.enabled, launch._GROUPED_COMMIT.enabled,
          "compiled variants:", len(launch._RECURRENCE.compiled), len(launch._GROUPED_COMMIT.compiled))
    for launcher in (launch._RECURRENCE, launch._GROUPED_COMMIT):
        launcher.enabled = False
    for name, fn in rows:
        if name in ("commit: kernel launch only", "verify: kernel launch only") or "whole call" in name:
            show(name + " (Triton path)", fn)


if __name__ == "__main__":
    main()
