"""Eager repeats of a call's launch (``core/repeats.py``): when the shortcut is taken, when it is
not, that a repeat computes what the op computes whatever else happened in between (compiled
calls, other layouts, memory freed and reused, threads, a full or resting cache), and the rules
every call follows for what it writes (``core/writes.py``).

The CPU tests use ``replaying_backend.ReplayingBackend``, whose bound launches rebuild their
tensors from the addresses they were bound to and recompute with ``cpu_ref`` (so a repeat that
matched the wrong call computes something else), and the cuda backend under Triton's interpreter,
whose launches bind the same way. CPU tensors always want value checks, which keep every CPU call
on the op path; the fixture makes the cache decide for them as for GPU tensors (value checks only
when asked), while the op path still checks everything."""
from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import recoverssm as rs
from recoverssm.core import repeats as repeats_module
from recoverssm.core.registry import registry
from recoverssm.core.repeats import REPEATS, call_key

import replaying_backend
from helpers import conv_problem, decode_after, i32, make_batch_problem, make_problem
from repeat_worlds import Pair, random_actions

REPLAYING = replaying_backend.NAME
LENS = [4, 2, 3, 1]


def _gpu_like_value_checks(monkeypatch) -> None:
    monkeypatch.setattr(repeats_module, "wants_value_checks",
                        lambda check, device: bool(check) or os.environ.get("RECOVERSSM_CHECK") == "1")


@pytest.fixture
def replaying(monkeypatch):
    backend = replaying_backend.register()
    _gpu_like_value_checks(monkeypatch)
    monkeypatch.delenv("RECOVERSSM_REPEATS", raising=False)
    REPEATS.clear()
    try:
        yield backend
    finally:
        registry().unregister("tests.replaying")
        REPEATS.clear()


def _verify(p, records, out, **kw):
    return rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, backend=REPLAYING, **p.call_kwargs(**kw))


# ------------------------------------------------------------------------------------------------
# when a call repeats
# ------------------------------------------------------------------------------------------------
def test_a_repeat_launches_without_the_op_and_computes_what_the_op_computes(replaying):
    p = make_batch_problem([3, 1, 4], padding=(1,))
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (1, 0)
    hits = REPEATS.hits
    assert _verify(p, records, out) is out
    assert (replaying.calls, replaying.repeats, REPEATS.hits) == (1, 1, hits + 1)
    # New values in the same tensors are still a repeat, and it computes with them.
    p.q.mul_(0.5)
    p.state_indices[0] = p.state_indices[2]
    _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (1, 2)
    want_records, want_out = p.records(), torch.empty_like(p.v)
    with rs.no_repeats():
        _verify(p, want_records, want_out)
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip((records.correction, records.key, records.decay),
                                                 (want_records.correction, want_records.key, want_records.decay)))


def test_bound_launch_is_the_launch_a_repeat_runs(replaying, monkeypatch):
    p = make_batch_problem([3, 1, 4])
    records, out = p.records(), torch.empty_like(p.v)
    seen, run = [], REPEATS.run
    monkeypatch.setattr(REPEATS, "run", lambda op, args, *a: seen.append((op, args)) or run(op, args, *a))
    _verify(p, records, out)
    op, args = seen[-1]
    launch = REPEATS.bound_launch(op, args)
    assert launch is not None and launch() and replaying.repeats == 1
    other = tuple(torch.empty_like(out) if a is out else a for a in args)
    assert REPEATS.bound_launch(op, other) is None


def test_model_weights_as_parameters_repeat(replaying):
    p = make_batch_problem([3, 1, 4])
    gates = {n: torch.nn.Parameter(t, requires_grad=False) if n in ("A_log", "dt_bias") else t
             for n, t in p.gates.items()}
    records, out = p.records(), torch.empty_like(p.v)
    kw = dict(p.call_kwargs(), **gates)
    for _ in range(2):
        rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, backend=REPLAYING, **kw)
    assert (replaying.calls, replaying.repeats) == (1, 1)


def test_every_op_repeats_the_commit_included(replaying):
    x, conv_state, weight, bias, slots, qsl = conv_problem("cpu", [2, 3])
    out = torch.empty_like(x)
    for _ in range(2):
        rs.conv_verify(x, conv_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=out,
                       backend=REPLAYING)
    x1 = x[:2].contiguous()
    out1 = torch.empty_like(x1)
    for _ in range(2):
        rs.conv_decode(x1, conv_state, weight, bias, state_indices=slots, out=out1, backend=REPLAYING)
    p = make_batch_problem([2, 2], num_slots=12, sources_below=8)
    out = torch.empty_like(p.v)
    for _ in range(2):
        rs.gdn_decode(p.q, p.k, p.v, out=out, backend=REPLAYING, **p.call_kwargs())
    snapshot_slots = torch.tensor([[8, 9], [10, 11]], dtype=torch.int32)
    for _ in range(2):
        rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snapshot_slots, out=out, backend=REPLAYING,
                                    **p.call_kwargs())
    records = p.records()
    ctx = rs.CommitContext([[rs.LayerCache(p.state, records)]], max_batch=2, backend=REPLAYING)
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    for _ in range(2):
        ctx.commit(accepted, p.state_indices, p.qsl)
    assert (replaying.calls, replaying.repeats) == (5, 5)


def test_the_op_asks_for_a_launch_only_when_the_cache_would_keep_it(replaying, monkeypatch):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    with rs.no_repeats():
        _verify(p, records, torch.empty_like(out))
    monkeypatch.setenv("RECOVERSSM_REPEATS", "0")
    _verify(p, records, torch.empty_like(out))
    assert replaying.binds == [True, False, False] and len(REPEATS) == 1


def test_a_commit_step_repeats_only_what_would_pass_its_checks(replaying, monkeypatch):
    """A commit step of a layout seen before repeats its launch without the step's checks (they
    would pass again); any changed argument takes the op and its checks."""
    from recoverssm.core import commit_op

    checked = []
    real = commit_op.check_step_shapes
    monkeypatch.setattr(commit_op, "check_step_shapes", lambda *a, **k: checked.append(1) or real(*a, **k))
    p = make_problem(LENS, [0, 1, 2, 3], seed=11)
    layer = rs.LayerCache(p.state.clone(), p.records())
    ctx = rs.CommitContext([[layer]], max_batch=4, backend=REPLAYING)
    expected = p.state.clone()
    accepted = i32([1, 2, 1, 1])
    for _ in range(3):      # the same tensors each step: checked once, then repeated
        rs.gdn_verify(p.q, p.k, p.v, records=layer.records, **p.call_kwargs(state=layer.state))
        ctx.commit(accepted, p.state_indices, p.qsl)
        expected = decode_after(p, [1, 2, 1, 1], pool=expected)
        assert torch.equal(layer.state, expected)
    assert (len(checked), replaying.repeats) == (1, 2)
    ctx.commit(accepted, [p.state_indices], p.qsl)      # one group's list is the same step: repeated
    assert (len(checked), replaying.repeats) == (1, 3)
    qsl = p.qsl.clone()
    ctx.commit(accepted, p.state_indices, qsl)          # another address: checked, then repeated
    ctx.commit(accepted, p.state_indices, qsl)
    assert (len(checked), replaying.repeats) == (2, 4)
    qsl.resize_(qsl.shape[0] - 1)                       # the very tensor, shrunk in place: checked
    with pytest.raises(ValueError, match="query_start_loc"):
        ctx.commit(accepted, p.state_indices, qsl)
    with pytest.raises(TypeError, match="state_indices"):
        ctx.commit(accepted, p.state_indices.to(torch.int64), p.qsl)
    with pytest.raises(ValueError, match="query_start_loc"):
        ctx.commit(accepted, p.state_indices, p.qsl[:-1])
    with pytest.raises(TypeError, match="block_size"):   # a changed scalar is checked again too
        ctx.commit(accepted, p.state_indices, p.qsl, block_table=i32([[0], [1], [2], [3]]),
                   num_computed_tokens=i32([0, 0, 0, 0]), block_size=2.0)


# ------------------------------------------------------------------------------------------------
# the switch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["environment", "context manager"])
def test_the_switch_sends_every_call_through_the_op(replaying, monkeypatch, how):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (1, 1)
    if how == "environment":
        monkeypatch.setenv("RECOVERSSM_REPEATS", "0")
        for _ in range(2):
            _verify(p, records, out)
        monkeypatch.setenv("RECOVERSSM_REPEATS", "1")
    else:
        with rs.no_repeats():
            for _ in range(2):
                _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (3, 1)
    _verify(p, records, out)                       # switched on again: the kept launch repeats
    assert (replaying.calls, replaying.repeats) == (3, 2)


def test_no_repeats_is_per_thread(replaying):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out)
    other = threading.Thread(target=lambda: _verify(p, records, out))
    with rs.no_repeats():
        other.start()
        other.join()
        _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (2, 2)


# ------------------------------------------------------------------------------------------------
# what makes a call take the op
# ------------------------------------------------------------------------------------------------
class Call:
    """A verify call's arguments, for a test to change one thing of."""

    def __init__(self, p, records, out, buffer):
        self.p, self.records, self.out, self.buffer = p, records, out, buffer
        self.tokens = dict(q=p.q, k=p.k, v=p.v)
        self.kw = {}


def _out_strides_only(c: Call) -> None:       # the same address, another row stride
    T, HV, V = c.out.shape
    c.out = c.buffer.as_strided((T, HV, V), ((HV + 1) * V, V, 1))
    assert c.out.data_ptr() == c.buffer.data_ptr()


def _input_dtype_only(c: Call) -> None:       # the same addresses, shapes and strides, fp16
    c.tokens = {n: t.view(torch.float16) for n, t in c.tokens.items()}
    c.out = c.out.view(torch.float16)


CHANGES = {
    "out address": lambda c, mp: setattr(c, "out", torch.empty_like(c.out)),
    "out strides only": lambda c, mp: _out_strides_only(c),
    "input dtype only": lambda c, mp: _input_dtype_only(c),
    "null_slot": lambda c, mp: c.kw.update(null_slot=-2),
    "scale": lambda c, mp: c.kw.update(scale=0.5),
    "scale sign of zero": lambda c, mp: c.kw.update(scale=-0.0),      # the first call had 0.0
    "use_qk_l2norm": lambda c, mp: c.kw.update(use_qk_l2norm=False),
    "check": lambda c, mp: c.kw.update(check=True),
    "RECOVERSSM_CHECK": lambda c, mp: mp.setenv("RECOVERSSM_CHECK", "1"),
    "RECOVERSSM_REPEATS=0": lambda c, mp: mp.setenv("RECOVERSSM_REPEATS", "0"),
    "environment": lambda c, mp: mp.setenv("RECOVERSSM_BACKEND", "cpu_ref"),
    "negative view": lambda c, mp: c.tokens.update(q=torch._neg_view(c.p.q)),
}


@pytest.mark.parametrize("change", [*CHANGES, "registry", "launch table", "launch refused", "not a Launch"])
def test_what_makes_a_call_go_through_the_op(replaying, monkeypatch, change):
    p = make_batch_problem([3, 2], act_dtype=torch.bfloat16)
    T, HV, V = p.v.shape
    buffer = torch.empty(T * (HV + 1) * V, dtype=p.v.dtype)
    c = Call(p, p.records(), buffer[:T * HV * V].view(T, HV, V), buffer)
    replaying.returns = "callable" if change == "not a Launch" else "launch"
    first = {"scale": 0.0}
    _verify(p, c.records, c.out, **first)
    assert len(REPEATS) == (change != "not a Launch")     # kept, so the changes below matter
    c.kw.update(first)
    if change in CHANGES:
        CHANGES[change](c, monkeypatch)
    replaying.refuse = change == "launch refused"
    if change == "registry":
        registry().register(object(), name="tests.test_repeats.nothing")
    if change == "launch table":      # what backends/triton/tuning.py does around a table it sets
        registry().invalidate()
    try:
        rs.gdn_verify(c.tokens["q"], c.tokens["k"], c.tokens["v"], records=c.records, out=c.out, backend=REPLAYING,
                      **p.call_kwargs(**c.kw))
    finally:
        if change == "registry":
            registry().unregister("tests.test_repeats.nothing")
    assert (replaying.calls, replaying.repeats) == (2, 0), change


def test_scalars_are_keyed_with_their_types(replaying):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):                                # an int scale is the float the op receives
        _verify(p, records, out, scale=1)
    assert (replaying.calls, replaying.repeats) == (1, 1)
    with pytest.raises(TypeError, match="use_qk_l2norm"):     # 1 == True, but not its type
        _verify(p, records, out, scale=1, use_qk_l2norm=1)


def test_an_unhashable_argument_is_named_by_the_op(replaying):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    with pytest.raises((TypeError, RuntimeError), match="check"):
        _verify(p, records, out, check=[])


def test_modes_and_tracing_go_through_the_op(replaying):
    p = make_batch_problem([2, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassThroughFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        _verify(p, records, out)
    with PassThroughFunctions():
        _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (3, 0)

    def step(q, k, v):
        return rs.gdn_verify(q, k, v, records=records, out=out, backend=REPLAYING, **p.call_kwargs())

    torch.compile(step, fullgraph=True, backend="eager")(p.q, p.k, p.v)
    assert replaying.repeats == 0 and replaying.calls >= 4
    calls = replaying.calls
    torch.jit.trace(step, (p.q, p.k, p.v), check_trace=False)
    assert replaying.repeats == 0 and replaying.calls == calls + 1


def test_a_compiled_step_does_not_recompile_as_the_cache_changes(replaying):
    p = make_batch_problem([3, 2])
    records = p.records()

    def step(q, k, v, out):
        return rs.gdn_verify(q, k, v, records=records, out=out, backend=REPLAYING, **p.call_kwargs())

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    outs = [torch.empty_like(p.v) for _ in range(4)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for out in outs:
            compiled(p.q, p.k, p.v, out)
    assert replaying.repeats == 0


def test_a_bad_call_after_a_repeat_is_still_refused(replaying):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out)
    assert (replaying.calls, replaying.repeats) == (1, 1)
    # A bad value in the very tensors of the repeated call: refused when values are checked.
    p.state_indices[0] = 10_000
    with pytest.raises(ValueError, match="state_indices"):
        _verify(p, records, out, check=True)
    with pytest.raises(ValueError, match="query_start_loc has shape"):
        _verify(p, records, out, state_indices=p.state_indices[:1])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rs.gdn_verify(p.q.numpy(), p.k, p.v, records=records, out=out, backend=REPLAYING, **p.call_kwargs())


def test_call_key_has_every_layout_field():
    t = torch.zeros(4, 6)
    op, state, layout = call_key("gdn_verify", (t, 1.0, None, "x", [t, 2]))
    assert (op, state) == ("gdn_verify", registry().state())
    assert layout[0] == (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
    assert layout[1:4] == ((1.0).hex(), (type(None), None), (str, "x"))
    assert layout[4] == (list, (layout[0], (int, 2)))

    class Sub(torch.Tensor):
        pass

    assert call_key("gdn_verify", (t.as_subclass(Sub),)) is None
    assert call_key("commit", ([t.as_subclass(Sub)],)) is None


# ------------------------------------------------------------------------------------------------
# the cache's bounds: eviction, resting, threads
# ------------------------------------------------------------------------------------------------
def test_a_full_cache_keeps_the_recently_used_half(replaying, monkeypatch):
    monkeypatch.setattr(REPEATS, "size", 4)
    p = make_batch_problem([3, 2])
    records = p.records()
    a, b, c, d, e = (torch.empty_like(p.v) for _ in range(5))
    for out in (a, b, c, d, a):                       # a, b, c, d kept; a used last
        _verify(p, records, out)
    assert (len(REPEATS), replaying.repeats) == (4, 1)
    _verify(p, records, e)                            # full: b and c go, d, a and e stay
    assert len(REPEATS) == 3
    for out in (a, d, e):
        _verify(p, records, out)
    assert replaying.repeats == 4
    _verify(p, records, b)
    assert replaying.repeats == 4


def test_the_cache_rests_where_layouts_do_not_repeat(replaying, monkeypatch):
    monkeypatch.setattr(REPEATS, "window", 8)
    p = make_batch_problem([3, 2])
    records = p.records()
    outs = [torch.empty_like(p.v) for _ in range(48)]
    for out in outs[:9]:                              # 1 to fill the cache, then 8 lookups that miss
        _verify(p, records, out)
    assert REPEATS.resting and replaying.repeats == 0
    kept, calls = len(REPEATS), replaying.calls
    for _ in range(7):                                # resting: no lookups, nothing asked for or kept
        _verify(p, records, outs[0])
    assert (replaying.calls, replaying.repeats, len(REPEATS)) == (calls + 7, 0, kept)
    assert replaying.binds[-7:] == [False] * 7
    _verify(p, records, outs[0])                      # the rest's last call: the op
    assert not REPEATS.resting
    _verify(p, records, outs[0])                      # kept before the rest: repeats again
    assert replaying.repeats == 1
    for out in outs[16:23]:                           # 1 hit in this window of 8: enough, no rest
        _verify(p, records, out)
    assert not REPEATS.resting
    for out in outs[23:31]:                           # 8 misses: a rest of one window
        _verify(p, records, out)
    assert REPEATS._resting == 8
    for out in outs[31:47]:                           # 8 resting calls, 8 misses again: twice as long
        _verify(p, records, out)
    assert REPEATS._resting == 16


def test_eviction_is_safe_under_threads(replaying, monkeypatch):
    """Several threads fill a small cache with new layouts and hit old ones at once: no error
    escapes a valid call, and every result is the op's."""
    monkeypatch.setattr(REPEATS, "size", 6)               # 8 layouts in turn: evictions all along
    monkeypatch.setattr(REPEATS, "window", 10_000)        # never rests
    x, conv_state, weight, bias, slots, qsl = conv_problem("cpu", [2, 3])
    threads, per_thread = 4, 60
    outs = [[torch.zeros_like(x) for _ in range(2)] for _ in range(threads)]
    states = [conv_state.clone() for _ in range(threads)]
    errors = []

    def work(n: int) -> None:
        try:
            for i in range(per_thread):
                out = outs[n][i % 2]
                rs.conv_verify(x, states[n], weight, bias, state_indices=slots, query_start_loc=qsl, out=out,
                               backend=REPLAYING)
        except BaseException as exc:                      # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors[0]
    assert replaying.repeats > 0 and len(REPEATS) <= 6
    want_state, want = conv_state.clone(), torch.zeros_like(x)
    with rs.no_repeats():
        for _ in range(per_thread // 2):
            rs.conv_verify(x, want_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=want,
                           backend=REPLAYING)
    for n in range(threads):
        assert torch.equal(states[n], want_state)
        assert all(torch.equal(out, want) for out in outs[n])


# ------------------------------------------------------------------------------------------------
# compiled and eager calls interleaved; the stress test
# ------------------------------------------------------------------------------------------------
def test_an_eager_commit_after_a_compiled_commit_writes_its_own_slots(replaying):
    """The interleaving that once replayed the compiled call's index tensors: eager commit with
    slots A, the compiled commit of the same context with slots B, the eager commit with A again."""
    pair = Pair(REPLAYING, "cpu", lanes=1)
    for world in (pair.on, pair.off):
        lane = world.lanes[0]
        lane.index_sets[1] = (lane.index_sets[0][0].flip(0).contiguous(), lane.index_sets[0][1].clone())
    accepted = [1, 1]
    for compiled in (False, True, False, False):
        pair.both(lambda w: w.verify(0, 0, 0))
        pair.both(lambda w: w.commit(0, 1 if compiled else 0, accepted, compiled))
        pair.assert_equal("commit")
    assert replaying.repeats >= 2


@pytest.mark.parametrize("first", ["eager", "compiled"])
def test_per_layer_ops_interleaved_with_compiled_calls(replaying, first):
    pair = Pair(REPLAYING, "cpu", lanes=1)
    order = [(0, 0, None), (1, 1, pair.compiled_verify), (0, 0, None), (1, 1, None), (0, 0, pair.compiled_verify),
             (0, 0, None)]
    if first == "compiled":
        order = [(i, j, pair.compiled_verify if fn is None else None) for i, j, fn in order]
    for i, j, fn in order:
        pair.both(lambda w: w.verify(0, i, j, fn))
        pair.assert_equal(f"verify {i} {j} {'compiled' if fn else 'eager'}")
    assert replaying.repeats >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_repeat_what_the_op_computes(replaying, monkeypatch, seed):
    monkeypatch.setattr(REPEATS, "size", 8)              # full again and again
    monkeypatch.setattr(REPEATS, "window", 16)           # and resting at times
    pair = Pair(REPLAYING, "cpu", lanes=2, seed=seed)
    kinds = random_actions(pair, random.Random(seed), steps=120)
    assert replaying.repeats > 0
    assert {"verify", "compiled verify", "commit", "compiled commit", "threads", "relayout"} <= set(kinds)


@pytest.mark.interpreter
def test_random_interleavings_on_the_triton_kernels(monkeypatch):
    """The cuda backend's own bound launches (conv, recurrence, commit) under the interpreter
    (which runs one kernel at a time: no threads here)."""
    _gpu_like_value_checks(monkeypatch)
    REPEATS.clear()
    monkeypatch.setattr(REPEATS, "size", 8)
    pair = Pair("cuda", "cpu", lanes=2, seed=3)
    hits = REPEATS.hits
    random_actions(pair, random.Random(3), steps=40, leave_out=("threads",))
    assert REPEATS.hits > hits
    REPEATS.clear()


# ------------------------------------------------------------------------------------------------
# what every call writes: version counters and inference tensors
# ------------------------------------------------------------------------------------------------
def _each_op(p, records, out, backend, conv):
    x, conv_state, weight, bias, slots, qsl = conv
    x1 = x[:2].contiguous()
    snapshot_slots = torch.tensor([[8, 9], [10, 11]], dtype=torch.int32)
    ctx = rs.CommitContext([[rs.LayerCache(p.state, records)]], max_batch=2, backend=backend)
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    return {
        "conv_verify": (lambda: rs.conv_verify(x, conv_state, weight, bias, state_indices=slots, query_start_loc=qsl,
                                               out=out["conv"], backend=backend), [conv_state, out["conv"]]),
        "conv_decode": (lambda: rs.conv_decode(x1, conv_state, weight, bias, state_indices=slots, out=out["conv1"],
                                               backend=backend), [conv_state, out["conv1"]]),
        "gdn_verify": (lambda: rs.gdn_verify(p.q, p.k, p.v, records=records, out=out["o"], backend=backend,
                                             **p.call_kwargs()),
                       [records.correction, records.key, records.decay, out["o"]]),
        "gdn_decode": (lambda: rs.gdn_decode(p.q, p.k, p.v, out=out["o"], backend=backend, **p.call_kwargs()),
                       [p.state, out["o"]]),
        "gdn_spec_decode_snapshot": (lambda: rs.gdn_spec_decode_snapshot(
            p.q, p.k, p.v, snapshot_slots=snapshot_slots, out=out["o"], backend=backend, **p.call_kwargs()),
            [p.state, out["o"]]),
        "commit": (lambda: ctx.commit(accepted, p.state_indices, p.qsl), [p.state]),
    }


def _op_inputs(make_inference: bool):
    def make():
        p = make_batch_problem([2, 2], num_slots=12, sources_below=8)
        conv = conv_problem("cpu", [2, 3])
        out = dict(conv=torch.zeros_like(conv[0]), conv1=torch.zeros_like(conv[0][:2]), o=torch.zeros_like(p.v))
        return p, p.records(), out, conv
    if make_inference:
        with torch.inference_mode():
            return make()
    return make()


OPS = ["conv_verify", "conv_decode", "gdn_verify", "gdn_decode", "gdn_spec_decode_snapshot", "commit"]


@pytest.mark.parametrize("op", OPS)
def test_every_path_moves_the_version_counters_of_what_it_writes_once(replaying, op):
    p, records, out, conv = _op_inputs(False)
    for backend in ("cpu_ref", REPLAYING):
        call, written = _each_op(p, records, out, backend, conv)[op]
        for inside_inference_mode in (False, True):
            for _ in range(3):         # the op path; on the replaying backend: bind, then repeats
                before = [t._version for t in written]
                if inside_inference_mode:
                    with torch.inference_mode():
                        call()
                else:
                    call()
                assert [t._version for t in written] == [v + 1 for v in before], (backend, op)
    assert replaying.repeats >= 4


def _inference_backends():
    names = ["cpu_ref"]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        names += ["cuda", "xpu"]
    return names


@pytest.mark.parametrize("backend", _inference_backends())
@pytest.mark.parametrize("op", OPS)
def test_inference_tensors_are_written_only_inside_inference_mode(monkeypatch, backend, op):
    if backend == "xpu":
        monkeypatch.setenv("RECOVERSSM_XPU_INTERPRET", "1")
    p, records, out, conv = _op_inputs(True)
    call, written = _each_op(p, records, out, backend, conv)[op]
    before = [t.clone() for t in written]
    with pytest.raises(RuntimeError, match="is an inference tensor"):
        call()
    assert all(torch.equal(a, b) for a, b in zip(before, written))
    with torch.inference_mode():
        call()                                           # inside inference mode: written


def test_a_repeat_never_writes_an_inference_tensor_outside_inference_mode(replaying):
    p = make_batch_problem([3, 2])
    with torch.inference_mode():
        records, out = p.records(), torch.empty_like(p.v)
        for _ in range(2):
            _verify(p, records, out)
    assert replaying.repeats == 1
    with pytest.raises(RuntimeError, match="correction is an inference tensor"):
        _verify(p, records, out)
    assert replaying.repeats == 1


# ------------------------------------------------------------------------------------------------
# on the GPU: the cuda backend's bound launches
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_repeated_launches_compute_what_the_op_computes(state_dtype):
    REPEATS.clear()
    # sources in slots [1, 8), snapshot slots from 8 on: no snapshot overwrites a slot a row reads
    shape = dict(padding=(1,), H=2, HV=4, K=128, V=128, state_dtype=state_dtype, device="cuda", num_slots=8 + 4 * 4,
                 sources_below=8)
    p = make_batch_problem([4, 1, 3, 4], **shape)
    records, out = p.records(), torch.empty_like(p.v)
    fresh = make_batch_problem([4, 1, 3, 4], seed=7, **shape)
    rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, **p.call_kwargs())   # compiles
    rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, **p.call_kwargs())   # binds
    hits = REPEATS.hits
    for name in ("q", "k", "v", "state", "state_indices"):
        getattr(p, name).copy_(getattr(fresh, name))
    for name, t in p.gates.items():
        t.copy_(fresh.gates[name])
    rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, **p.call_kwargs())   # a repeat
    assert REPEATS.hits == hits + 1
    want_records, want_out = fresh.records(), torch.empty_like(fresh.v)
    rs.gdn_verify(fresh.q, fresh.k, fresh.v, records=want_records, out=want_out, **fresh.call_kwargs(),
                  check=True)                                                  # through the op
    torch.cuda.synchronize()
    assert torch.equal(out, want_out)
    for got, want in zip((records.correction, records.key, records.decay),
                         (want_records.correction, want_records.key, want_records.decay)):
        assert torch.equal(got, want)
    # decode and snapshot repeat too, and leave the states the op leaves
    state, hits = p.state.clone(), REPEATS.hits
    for _ in range(3):
        rs.gdn_decode(p.q, p.k, p.v, out=out, **p.call_kwargs(state=state))
    assert REPEATS.hits == hits + 2          # verify compiled the one binary: the first call binds
    want_state = p.state.clone()
    for _ in range(3):
        rs.gdn_decode(p.q, p.k, p.v, out=want_out, check=True, **p.call_kwargs(state=want_state))
    assert torch.equal(state, want_state) and torch.equal(out, want_out)
    B, T = p.B, p.T
    snapshot_slots = torch.arange(B * T, dtype=torch.int32, device="cuda").view(B, T) + 8
    hits = REPEATS.hits
    for target in (state, want_state):
        for _ in range(3):
            rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snapshot_slots, out=out,
                                        check=target is want_state, **p.call_kwargs(state=target))
    assert REPEATS.hits == hits + 2          # the unchecked calls: the first binds, two repeat
    assert torch.equal(state, want_state)


@pytest.mark.gpu
def test_a_misaligned_out_is_never_repeated():
    REPEATS.clear()
    p = make_batch_problem([2, 3], H=2, HV=4, K=128, V=128, device="cuda")
    records = p.records()
    buffer = torch.empty(p.v.numel() + 1, dtype=p.v.dtype, device="cuda")
    out = buffer[1:].view(p.v.shape)          # rows not 16-byte aligned: written through a packed copy
    for _ in range(3):
        rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, **p.call_kwargs())
    assert len(REPEATS) == 0


@pytest.mark.gpu
def test_repeated_conv_launches_compute_what_the_op_computes():
    REPEATS.clear()
    x, conv_state, weight, bias, slots, qsl = conv_problem("cuda", [2, 3, 4])
    want_state, out, want_out = conv_state.clone(), torch.empty_like(x), torch.empty_like(x)
    for i in range(3):
        x.add_(0.25)
        rs.conv_verify(x, conv_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=out)
        rs.conv_verify(x, want_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=want_out,
                       check=True)
        assert torch.equal(out, want_out) and torch.equal(conv_state, want_state), i
    x1 = x[:3].contiguous()
    for i in range(3):
        x1.mul_(0.5)
        hits = REPEATS.hits
        rs.conv_decode(x1, conv_state, weight, bias, state_indices=slots, out=out[:3])
        rs.conv_decode(x1, want_state, weight, bias, state_indices=slots, out=want_out[:3], check=True)
        assert torch.equal(out, want_out) and torch.equal(conv_state, want_state), i
    # the first call compiles (or finds the binary an earlier test compiled and binds), the second
    # binds at the latest: the third repeats
    assert REPEATS.hits == hits + 1


def _graph_action(pair: Pair, lane: int, i: int, j: int) -> None:
    """Capture a lane's verify and commit in one CUDA graph in each world (the ``on`` world's
    capture may take repeated launches), then replay it after new values."""
    graphs = []
    for world, off in ((pair.on, False), (pair.off, True)):
        def step(w=world):
            w.verify(lane, i, j)
            w.lanes[lane].ctx.commit(w.lanes[lane].accepted, *w.lanes[lane].index_sets[i])
        if off:
            with rs.no_repeats():
                step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
        else:
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        graphs.append(graph)
    for seed in range(2):
        pair.both(lambda w: w.new_values(1000 + seed))
        for graph in graphs:
            graph.replay()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_random_interleavings_on_the_gpu_with_cuda_graphs(seed):
    REPEATS.clear()
    pair = Pair("cuda", "cuda", lanes=2, seed=seed)
    hits = REPEATS.hits
    kinds = random_actions(pair, random.Random(seed), steps=150, extra={"graph": _graph_action})
    assert REPEATS.hits > hits and "graph" in kinds
