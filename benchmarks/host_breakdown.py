"""Where the host time of one ``gdn_verify`` call and one ``CommitContext.commit`` call goes.

    python benchmarks/host_breakdown.py                 # GPU tensors, the cuda backend
    python benchmarks/host_breakdown.py --device cpu    # CPU tensors, a backend that does nothing
    python benchmarks/host_breakdown.py --cprofile      # and cProfile of the whole calls
    python benchmarks/host_breakdown.py --whole         # the whole calls only (what host_ab.py compares)
    python benchmarks/host_breakdown.py --device cpu --repeats   # eager repeats (core/repeats.py)

Each row is the median host time of calling only that piece, as wall time and as the calling
thread's CPU time (``time.thread_time``: what the call itself costs on a shared machine); device
work queues behind and is not counted. Every piece is a public function, called as the layer
above it calls it, so the pieces nest and their differences (printed below the rows) are the cost
of each layer:

* verify: ``rs.gdn_verify`` (the Python API) > ``torch.ops.recoverssm.gdn_verify`` (the
  dispatcher) > the op's body (``core.ops.OPS[name].implementation``) > the argument checks
  (``core.arguments.check_recurrence``), the backend's resolution (``core.ops.backend_for``) and
  the backend's ``recurrence`` (on a Triton backend: ``launch.recurrence``, the launcher). A call
  that repeats an earlier call's layout (on a GPU) is the API's own work, the call key
  (``core.repeats.call_key``), the lookup and the bound launch (``Repeats.bound_launch``)
  instead of the dispatcher; the key and the launch have rows of their own.
* commit, the checked path (the repeat cache switched off, ``rs.no_repeats()``; two sets of index
  tensors alternate): ``CommitContext.commit`` > ``torch.ops.recoverssm.commit`` > the op's body
  (``core.commit_op.run_commit_op``) > the step's checks (``core.arguments.check_step_shapes``,
  ``check_step_values``) and ``ctx.committer.commit``.
* commit, the repeat path (a step of a layout seen before, on a GPU): ``CommitContext.commit`` >
  the bound launch alone.

The case is the benchmark's: verify of 8 rows x 4 tokens, H=16, HV=48; a commit of 3 KV-cache
groups x 6 layers, 8 requests in align mode, each group with its own index tensors. On the CPU
the backend is registered here (``registry().register``) and does nothing, so the rows are the
library's own host code, K=V=16 (the head sizes change no host work); checks of index values
always run on CPU tensors (on a GPU only with ``check=True``).
"""
import argparse
import cProfile
import functools
import io
import itertools
import os
import pstats
import sys

import torch

H, HV, R, T, GROUPS, LAYERS = 16, 48, 8, 4, 3, 6
NULL_BACKEND = "null"
NULL_PLUGIN = "benchmarks.host_breakdown.null_backend"


def register_null_backend(launches: bool = False) -> None:
    """Register backend ``"null"`` (CPU tensors): every kernel-facing function returns at once, and
    its committer commits nothing. Built from the abstract methods of the tree's ``Backend`` and
    ``Committer``, so that host_ab.py can run it against another source tree. ``launches``: its
    recurrence hands over a launch that does nothing (a ``core.backend.Launch``), for repeats."""
    from recoverssm.core.backend import Backend, Committer
    from recoverssm.core.hookspecs import hookimpl
    from recoverssm.core.registry import registry

    def nothing(*args, **kwargs):
        return None

    committer = type("NullCommitter", (Committer,), {m: nothing for m in Committer.__abstractmethods__})
    methods = {m: nothing for m in Backend.__abstractmethods__}
    if launches:
        from recoverssm.core.backend import Launch
        launch = Launch(lambda: True)
        methods["recurrence"] = lambda self, *args, **kwargs: launch
    methods.update(name=NULL_BACKEND, device_types=("cpu",),
                   capabilities=getattr(Backend, "CAPABILITIES", frozenset()),
                   make_committer=lambda self, *args, **kwargs: committer())
    backend = type("NullBackend", (Backend,), methods)()

    class Plugin:
        @hookimpl
        def recoverssm_backends(self):
            return [backend]

    registry().register(Plugin(), name=NULL_PLUGIN)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def alternating(first, second):
    """A call that runs ``first`` and ``second`` in turn."""
    turn = [False]

    def call():
        turn[0] = not turn[0]
        (first if turn[0] else second)()
    return call


def build(device: str, backend: str):
    """The verify window and the commit context with two sets of per-group index tensors."""
    import recoverssm as rs
    from recoverssm.bench.problems import align_step, per_group_indices, window

    K = V = 128 if device == "cuda" else 16
    w = window(R, T, H, HV, K, V, device=device)
    step = align_step(R, T, device=device)
    groups = [[rs.LayerCache(torch.zeros(step.num_slots, HV, V, K, device=device),
                             rs.ReplayRecords.allocate(R, T, H, HV, K, V, device=device)) for _ in range(LAYERS)]
              for _ in range(GROUPS)]
    ctx = rs.CommitContext(groups, max_batch=R, backend=backend)
    index_sets = [per_group_indices(step, GROUPS) for _ in range(2)]
    return w, step, ctx, index_sets


def whole_calls(w, step, ctx, index_sets, backend: str, out) -> dict:
    import recoverssm as rs

    verify = functools.partial(rs.gdn_verify, w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                               query_start_loc=w.query_start_loc, records=w.records, out=out, backend=backend,
                               **w.gates())
    commits = [functools.partial(ctx.commit, step.num_accepted, query_start_loc=step.query_start_loc, **kw)
               for kw in index_sets]
    return {"gdn_verify": verify,
            "CommitContext.commit, the last call's tensors (repeat path on a GPU)": commits[0],
            "CommitContext.commit, other tensors each call (checked path)": alternating(*commits)}


def verify_pieces(w, backend: str, out) -> list:
    import recoverssm as rs
    from recoverssm.core.arguments import check_recurrence
    from recoverssm.core.backend import RecurrenceCall
    from recoverssm.core.ops import OPS, backend_for
    from recoverssm.core.repeats import REPEATS, call_key

    rec = w.records
    records = (rec.correction, rec.key, rec.decay)
    api = functools.partial(rs.gdn_verify, w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                            query_start_loc=w.query_start_loc, records=rec, out=out, backend=backend, **w.gates())
    op = functools.partial(torch.ops.recoverssm.gdn_verify, w.q, w.k, w.v, w.state, w.state_indices,
                           w.query_start_loc, *records, w.a, w.b, w.A_log, w.dt_bias, None, None, None, True, -1,
                           rec.round_each_token, out, backend, None)
    body = functools.partial(OPS["gdn_verify"].implementation, q=w.q, k=w.k, v=w.v, state=w.state,
                             state_indices=w.state_indices, query_start_loc=w.query_start_loc, a=w.a, b=w.b,
                             A_log=w.A_log, dt_bias=w.dt_bias, g=None, beta=None, scale=None, use_qk_l2norm=True,
                             null_slot=-1, round_each_token=rec.round_each_token, out=out, backend=backend,
                             check=None, correction=rec.correction,
                             key=rec.key, decay=rec.decay)
    gate_args = dict(a=w.a, b=w.b, A_log=w.A_log, dt_bias=w.dt_bias, g=None, beta=None)
    checks = functools.partial(check_recurrence, "gdn_verify", "gdn", "verify", w.q, w.k, w.v, w.state,
                               w.state_indices, w.query_start_loc, gate_args, None, True, -1, rec.round_each_token,
                               out, records, None, None)
    args = checks()
    be = backend_for("gdn_verify", backend, w.state.device)
    run = functools.partial(be.recurrence, RecurrenceCall("verify", w.q, w.k, w.v, w.state, w.state_indices,
                                                          w.query_start_loc, args.gates, args.scale, True, -1, out,
                                                          records, None, round_each_token=rec.round_each_token))
    api()
    api()                 # on a GPU the second call binds its launch; later calls repeat it
    bound = REPEATS.bound_launch("gdn_verify", op.args)
    key = functools.partial(call_key, "gdn_verify", op.args)
    if bound is None:     # every call goes through the op (CPU tensors: value checks)
        rows = [("verify", "gdn_verify (API)", api)]
    else:
        rows = [("verify", "gdn_verify (API), a repeated call", api),
                ("verify", "  repeats: the bound launch alone (Triton's launcher)", bound)]
    rows += [("verify", "  repeats.call_key (what a repeated call computes before its launch)", key),
             ("verify", "torch.ops.recoverssm.gdn_verify (dispatcher)", op),
             ("verify", "op body: OPS['gdn_verify']", body),
             ("verify", "  check_recurrence (argument checks)", checks),
             ("verify", "  backend_for (backend resolution)", functools.partial(backend_for, "gdn_verify", backend,
                                                                               w.state.device)),
             ("verify", f"  {be.name}.recurrence (backend)", run)]
    table = getattr(be, "table", None)
    if table is not None:     # a Triton backend: its launcher, without the device guard
        from recoverssm.backends.triton import launch
        rows.append(("verify", "    launch.recurrence (launcher)", functools.partial(
            launch.recurrence, table, RecurrenceCall("verify", w.q, w.k, w.v, w.state, w.state_indices,
                                                     w.query_start_loc, args.gates, args.scale, True, -1, out,
                                                     records, None))))
    return rows


def without_repeats(call):
    """``call`` with the repeat cache switched off (``rs.no_repeats()``): the op path every time."""
    import recoverssm as rs

    def off():
        with rs.no_repeats():
            call()
    return off


def commit_pieces(step, ctx, index_sets, backend: str) -> list:
    from recoverssm.core.arguments import check_step_shapes, check_step_values
    from recoverssm.core.backend import GroupStep
    from recoverssm.core.commit_op import repeat_args, run_commit_op
    from recoverssm.core.repeats import REPEATS
    from recoverssm.core.validation import Checker

    layers = ctx.layers
    layer_args = dict(states=[x.state for x in layers],
                      conv_states=[x.conv_state for x in layers if x.conv_state is not None],
                      corrections=[x.correction for x in layers], keys=[x.key for x in layers],
                      decays=[x.decay for x in layers], groups=[x.group for x in layers],
                      conv_widths=[x.conv_width for x in layers], conv_dilations=[x.conv_dilation for x in layers],
                      round_each_token=[x.round_each_token for x in layers])
    G = ctx.num_groups
    window = ctx.max_window
    num_slots = layers[0].state.shape[0]

    def op_kwargs(kw):
        return dict(**layer_args, num_accepted=step.num_accepted, query_start_loc=step.query_start_loc,
                    state_indices=kw["state_indices"], request_indices=[None] * G, block_tables=kw["block_table"],
                    num_computed_tokens=kw["num_computed_tokens"], block_sizes=[kw["block_size"]] * G,
                    null_slot=ctx.null_slot, max_batch=ctx.max_batch, context=ctx.id, backend=backend, check=None)

    names = list(op_kwargs(index_sets[0]))

    def op(kw):
        args = op_kwargs(kw)
        return functools.partial(torch.ops.recoverssm.commit, *[args[n] for n in names])

    def shape_checks(kw):
        def call():
            c, checked = Checker("CommitContext.commit", ctx.device), set()
            for g in range(G):
                check_step_shapes(c, step.num_accepted, kw["state_indices"][g], step.query_start_loc, None,
                                  kw["block_table"][g], kw["num_computed_tokens"][g], kw["block_size"],
                                  suffix=f"[{g}]", checked=checked)
        return call

    def value_checks(kw):
        def call():
            c = Checker("CommitContext.commit", ctx.device)
            for g in range(G):
                check_step_values(c, step.num_accepted, kw["state_indices"][g], step.query_start_loc, None,
                                  kw["block_table"][g], kw["num_computed_tokens"][g], kw["block_size"],
                                  ctx.null_slot, num_slots, window, f"[{g}]")
        return call

    steps = [[GroupStep(kw["state_indices"][g], None, kw["block_table"][g], kw["num_computed_tokens"][g],
                        kw["block_size"]) for g in range(G)] for kw in index_sets]
    committer = ctx.committer
    a, b = index_sets
    api = [functools.partial(ctx.commit, step.num_accepted, query_start_loc=step.query_start_loc, **kw)
           for kw in index_sets]
    checked = [
        ("commit, checked path", "CommitContext.commit (API), repeats switched off",
         alternating(*(without_repeats(call) for call in api))),
        ("commit, checked path", "torch.ops.recoverssm.commit (dispatcher)", alternating(op(a), op(b))),
        ("commit, checked path", "op body: run_commit_op", alternating(
            functools.partial(run_commit_op, **op_kwargs(a)), functools.partial(run_commit_op, **op_kwargs(b)))),
        ("commit, checked path", f"  check_step_shapes x {G} groups", alternating(shape_checks(a), shape_checks(b))),
        ("commit, checked path", f"  check_step_values x {G} groups (CPU, or check=True)",
         alternating(value_checks(a), value_checks(b))),
        ("commit, checked path", "  ctx.committer.commit (committer)", alternating(
            functools.partial(committer.commit, step.num_accepted, step.query_start_loc, steps[0]),
            functools.partial(committer.commit, step.num_accepted, step.query_start_loc, steps[1]))),
    ]
    if ctx.device.type == "cpu":    # index values are checked on every call: no repeat path
        return checked
    api[0]()
    api[0]()                        # the second call binds the step's launch; later calls repeat it
    bound = REPEATS.bound_launch("commit", repeat_args(
        ctx.id, step.num_accepted, step.query_start_loc, a["state_indices"], [None] * G, a["block_table"],
        a["num_computed_tokens"], [a["block_size"]] * G, None))
    rows = [("commit, repeat path", "CommitContext.commit (API)", api[0])]
    if bound is not None:
        rows.append(("commit, repeat path", "  the bound launch alone", bound))
    return checked + rows


def repeat_rows(w, backend: str, out) -> list:
    """Eager repeats of ``gdn_verify`` with the null backend's do-nothing launch. CPU tensors
    always want value checks, which keep every call on the op path; here the repeat cache decides
    as it does for GPU tensors (no value checks unless asked), the op path still checks."""
    import recoverssm as rs
    from recoverssm.core import repeats

    repeats.wants_value_checks = lambda check, device: bool(check)
    cache = repeats.REPEATS
    kw = dict(state=w.state, state_indices=w.state_indices, query_start_loc=w.query_start_loc, records=w.records,
              backend=backend, **w.gates())
    api = functools.partial(rs.gdn_verify, w.q, w.k, w.v, out=out, **kw)

    def in_inference_mode():
        with torch.inference_mode():
            api()

    def new_layout():              # the cache emptied: a lookup of nothing, the op, one key
        cache.clear()
        api()

    # more layouts in turn than the cache holds (outputs 16 bytes apart in one buffer): every
    # lookup misses, and the argument checks run too (they remember fewer layouts still)
    layouts = 4 * cache.size
    buffer = torch.empty(4 * layouts + out.numel(), dtype=out.dtype)
    turn = itertools.cycle([buffer[4 * i:4 * i + out.numel()].view(out.shape) for i in range(layouts)])

    def churn():
        rs.gdn_verify(w.q, w.k, w.v, out=next(turn), **kw)

    return [("verify, repeats", "gdn_verify, a repeated layout", api),
            ("verify, repeats", "gdn_verify, a repeated layout, inside torch.inference_mode()", in_inference_mode),
            ("verify, repeats", "gdn_verify, a layout not seen before", new_layout),
            ("verify, repeats", "gdn_verify, one layout, the repeat cache switched off", without_repeats(api)),
            ("verify, repeats", f"gdn_verify, {layouts} layouts in turn (cache of {cache.size}; it rests)", churn),
            ("verify, repeats", f"gdn_verify, {layouts} layouts in turn, the repeat cache switched off",
             without_repeats(churn))]


DIFFERENCES = [
    ("verify", "a repeated call besides its key and its launch (API, lookup, version counters)",
     "gdn_verify (API), a repeated call", ["  repeats.call_key*", "  repeats: the bound launch*"]),
    ("verify", "Python API", "gdn_verify (API)", ["torch.ops.recoverssm.gdn_verify (dispatcher)"]),
    ("verify", "dispatcher", "torch.ops.recoverssm.gdn_verify (dispatcher)",
     ["op body: OPS['gdn_verify']"]),
    ("verify", "rest of the op body", "op body: OPS['gdn_verify']",
     ["  check_recurrence (argument checks)", "  backend_for (backend resolution)", "*.recurrence (backend)"]),
    ("commit, checked path", "Python API", "CommitContext.commit (API), repeats switched off",
     ["torch.ops.recoverssm.commit (dispatcher)"]),
    ("commit, checked path", "dispatcher", "torch.ops.recoverssm.commit (dispatcher)", ["op body: run_commit_op"]),
    ("commit, checked path", "rest of the op body (layer lookup, overlap checks)", "op body: run_commit_op",
     ["  check_step_shapes*", "  check_step_values*", "  ctx.committer.commit (committer)"]),
    ("commit, repeat path", "Python API (the step's key, the lookup, version counters)", "CommitContext.commit (API)",
     ["  the bound launch alone"]),
]


def print_differences(times: dict) -> None:
    """Each layer's own cost: a row minus the rows nested in it (``DIFFERENCES``)."""
    print("-- differences (us, wall / thread CPU)")
    for g, what, outer, inner in DIFFERENCES:
        total = _find(times, g, outer)
        parts = [_find(times, g, p) for p in inner]
        if total is None or any(p is None for p in parts):
            continue
        wall = total[0] - sum(p[0] for p in parts)
        cpu = total[1] - sum(p[1] for p in parts)
        print(f"  {g + ': ' + what:82s} {wall:8.2f} / {cpu:8.2f}")


def _find(times: dict, group: str, pattern: str):
    for (g, name), value in times.items():
        if g == group and (name == pattern or (pattern.startswith("*") and name.endswith(pattern[1:]))
                           or (pattern.endswith("*") and name.startswith(pattern[:-1]))):
            return value
    return None


def profile(name: str, call, device: str, n: int = 300) -> None:
    for _ in range(20):
        call()
    sync(device)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    sync(device)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== cProfile, {n} calls: {name}")
    print(s.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: GPU tensors, the cuda backend; cpu: CPU tensors, a backend that does nothing")
    ap.add_argument("--iters", type=int, default=200, help="timed calls per row")
    ap.add_argument("--whole", action="store_true", help="the whole calls and the reference only")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile each whole call")
    ap.add_argument("--repeats", action="store_true",
                    help="with --device cpu: eager repeats of verify (a launch that does nothing)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (--device cpu runs the library's host code alone)")
    backend = "cuda" if args.device == "cuda" else NULL_BACKEND
    if args.repeats and args.device != "cpu":
        raise SystemExit("--repeats runs with --device cpu (on a GPU the whole calls repeat already)")
    if args.device == "cpu":
        register_null_backend(launches=args.repeats)
    w, step, ctx, index_sets = build(args.device, backend)
    out = torch.empty_like(w.v)
    whole = whole_calls(w, step, ctx, index_sets, backend, out)
    small = torch.zeros(8, device=args.device)
    reference = [("reference", f"torch.empty(8, device={args.device!r})",
                  functools.partial(torch.empty, 8, device=args.device)),
                 ("reference", "x.add_(1) on 8 floats (on a GPU: one PyTorch kernel launch)",
                  functools.partial(small.add_, 1))]
    if args.repeats:
        rows = repeat_rows(w, backend, out) + reference
    elif args.whole:
        rows = [("whole", name, call) for name, call in whole.items()] + reference
    else:
        rows = verify_pieces(w, backend, out) + commit_pieces(step, ctx, index_sets, backend) + reference
    import recoverssm
    from recoverssm.bench.timing import host_times
    print(f"host time per call, median of {args.iters} (us): wall / thread CPU; device {args.device}, "
          f"backend {backend}; recoverssm from {os.path.dirname(os.path.dirname(recoverssm.__file__))}, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}")
    times, group = {}, None
    for g, name, call in rows:
        if g != group:
            print(f"-- {g}")
            group = g
        t = host_times(call, args.iters, device=args.device)
        wall, cpu = t["wall_us"], t["cpu_us"]
        times[(g, name)] = (wall, cpu)
        print(f"  {name:82s} {wall:8.2f} / {cpu:8.2f}", flush=True)
    if not (args.whole or args.repeats):
        print_differences(times)
    if args.cprofile:
        for name, call in whole.items():
            profile(name, call, args.device)


if __name__ == "__main__":
    main()
