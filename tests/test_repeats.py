"""Eager repeats of a call's launch (``core/repeats.py``): when the shortcut is taken, when it is
not, and (on the GPU) that a repeated launch computes what the op computes, bit for bit.

The CPU tests use a backend registered here that counts its calls and hands back a counting
launch; CPU tensors always want value checks, so those tests switch that off for the cache's
decision only (the op path still checks everything)."""
from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import recoverssm as rs
from recoverssm.core import repeats as repeats_module
from recoverssm.core.backend import Backend, Launch
from recoverssm.core.hookspecs import hookimpl
from recoverssm.core.registry import registry
from recoverssm.core.repeats import REPEATS, call_key

from helpers import conv_problem, make_batch_problem

COUNTING = "counting"


class CountingBackend(Backend):
    """Runs cpu_ref and returns a launch that only counts (so a repeat is visible as such)."""

    name = COUNTING
    device_types = ("cpu",)
    capabilities = Backend.CAPABILITIES

    def __init__(self):
        self.calls = 0
        self.repeats = 0
        self.refuse = False
        self.returns = "launch"      # or "callable": a plain function, which the ops must ignore

    def _launch(self):
        def launch() -> bool:
            if self.refuse:
                return False
            self.repeats += 1
            return True
        return Launch(launch) if self.returns == "launch" else launch

    def _ref(self):
        return registry().resolve("cpu_ref", "cpu")[0]

    def conv_verify(self, *args):
        self.calls += 1
        self._ref().conv_verify(*args)
        return self._launch()

    def conv_decode(self, *args):
        self.calls += 1
        self._ref().conv_decode(*args)
        return self._launch()

    def recurrence(self, *args):
        self.calls += 1
        self._ref().recurrence(*args)
        return self._launch()

    def plan_commit(self, *args):
        self._ref().plan_commit(*args)

    def make_committer(self, *args):
        return self._ref().make_committer(*args)


@pytest.fixture
def counting(monkeypatch):
    backend = CountingBackend()

    class Plugin:
        @hookimpl
        def recoverssm_backends(self):
            return [backend]

    registry().register(Plugin(), name="tests.test_repeats.counting")
    # CPU tensors always want value checks; for the cache's decision only, they want them here as
    # GPU tensors do: with check=True or RECOVERSSM_CHECK=1.
    monkeypatch.setattr(repeats_module, "wants_value_checks",
                        lambda check, device: bool(check) or os.environ.get("RECOVERSSM_CHECK") == "1")
    REPEATS.clear()
    try:
        yield backend
    finally:
        registry().unregister("tests.test_repeats.counting")
        REPEATS.clear()


def _verify(p, records, out, **kw):
    return rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, backend=COUNTING, **p.call_kwargs(**kw))


def test_a_repeat_launches_without_the_op(counting):
    p = make_batch_problem([3, 1, 4], padding=(1,))
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    assert (counting.calls, counting.repeats) == (1, 0)
    hits = REPEATS.hits
    returned = _verify(p, records, out)
    assert returned is out
    assert (counting.calls, counting.repeats, REPEATS.hits) == (1, 1, hits + 1)
    # New values in the same tensors are still a repeat.
    p.q.mul_(0.5)
    p.state_indices[0] = p.state_indices[2]
    _verify(p, records, out)
    assert (counting.calls, counting.repeats) == (1, 2)


def test_bound_launch_is_the_launch_a_repeat_runs(counting, monkeypatch):
    p = make_batch_problem([3, 1, 4])
    records, out = p.records(), torch.empty_like(p.v)
    seen, run = [], REPEATS.run
    monkeypatch.setattr(REPEATS, "run", lambda op, args, check: seen.append((op, args)) or run(op, args, check))
    _verify(p, records, out)
    op, args = seen[-1]
    launch = REPEATS.bound_launch(op, args)
    assert launch is not None and launch() and counting.repeats == 1
    other = tuple(torch.empty_like(out) if a is out else a for a in args)
    assert REPEATS.bound_launch(op, other) is None


def test_model_weights_as_parameters_repeat(counting):
    p = make_batch_problem([3, 1, 4])
    gates = {n: torch.nn.Parameter(t, requires_grad=False) if n in ("A_log", "dt_bias") else t
             for n, t in p.gates.items()}
    records, out = p.records(), torch.empty_like(p.v)
    kw = dict(p.call_kwargs(), **gates)
    for _ in range(2):
        rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, backend=COUNTING, **kw)
    assert (counting.calls, counting.repeats) == (1, 1)


def test_a_missed_lookup_hands_its_key_to_the_op(counting, monkeypatch):
    p = make_batch_problem([3, 2])
    records, first = p.records(), torch.empty_like(p.v)
    _verify(p, records, first)                        # the cache is not empty from here on
    computed = []

    def counted(op, args):
        computed.append(op)
        return call_key(op, args)

    monkeypatch.setattr(repeats_module, "call_key", counted)
    out = torch.empty_like(p.v)
    _verify(p, records, out)                          # a new layout: one key, for the lookup and the op
    assert (counting.calls, len(computed)) == (2, 1)
    _verify(p, records, out)                          # its repeat
    assert (counting.calls, counting.repeats, len(computed)) == (2, 1, 2)


def test_the_cache_rests_where_layouts_do_not_repeat(counting, monkeypatch):
    monkeypatch.setattr(REPEATS, "window", 8)
    p = make_batch_problem([3, 2])
    records = p.records()
    outs = [torch.empty_like(p.v) for _ in range(40)]
    for out in outs[:9]:                              # 1 to fill the cache, then 8 lookups that miss
        _verify(p, records, out)
    assert REPEATS.resting and counting.repeats == 0
    calls = counting.calls
    for _ in range(7):                                # resting (one window's worth of calls): the op
        _verify(p, records, outs[7])                  # path even for a layout it keeps
    _verify(p, records, outs[9])                      # ... and nothing new is kept
    assert not REPEATS.resting and (counting.calls, counting.repeats) == (calls + 8, 0)
    _verify(p, records, outs[7])                      # kept before the rest: repeats again
    _verify(p, records, outs[9])                      # seen only while resting: through the op
    assert (counting.calls, counting.repeats) == (calls + 9, 1)
    for out in outs[10:16]:                           # 1 hit in this window of 8: enough, no rest
        _verify(p, records, out)
    assert not REPEATS.resting
    for out in outs[16:24]:                           # 8 misses: a rest of one window
        _verify(p, records, out)
    assert REPEATS._resting == 8
    for out in outs[24:40]:                           # 8 resting calls, 8 misses again: twice as long
        _verify(p, records, out)
    assert REPEATS._resting == 16


def test_a_full_cache_keeps_the_recently_used_half(counting, monkeypatch):
    monkeypatch.setattr(REPEATS, "size", 4)
    p = make_batch_problem([3, 2])
    records = p.records()
    a, b, c, d, e = (torch.empty_like(p.v) for _ in range(5))
    for out in (a, b, c, d, a):                       # a, b, c, d kept; a used last
        _verify(p, records, out)
    assert (len(REPEATS), counting.repeats) == (4, 1)
    _verify(p, records, e)                            # full: b and c go, d, a and e stay
    assert len(REPEATS) == 3
    for out in (a, d, e):
        _verify(p, records, out)
    assert counting.repeats == 4
    _verify(p, records, b)
    assert counting.repeats == 4


def test_a_missed_key_does_not_outlive_its_call(counting):
    x, conv_state, weight, bias, slots, _ = conv_problem("cpu", [1, 1])
    x = x[:2].contiguous()
    rs.conv_decode(x, conv_state, weight, bias, state_indices=slots, out=torch.empty_like(x), backend=COUNTING)
    wrong = torch.empty(1, x.shape[1])
    with pytest.raises(ValueError, match="out"):      # a lookup that misses, then the op refuses
        rs.conv_decode(x, conv_state, weight, bias, state_indices=slots, out=wrong, backend=COUNTING)
    assert getattr(REPEATS._local, "missed", None) is None


def test_scalars_are_keyed_with_their_types(counting):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):                                # an int scale is the float the op receives
        _verify(p, records, out, scale=1)
    assert (counting.calls, counting.repeats) == (1, 1)
    with pytest.raises(TypeError, match="use_qk_l2norm"):     # 1 == True, but not its type
        _verify(p, records, out, scale=1, use_qk_l2norm=1)


def test_a_repeat_bumps_the_versions_of_what_it_writes(counting):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out)
    before = [t._version for t in (out, records.correction, records.key, records.decay)]
    _verify(p, records, out)
    assert counting.repeats == 2
    after = [t._version for t in (out, records.correction, records.key, records.decay)]
    assert all(a > b for a, b in zip(after, before))


def test_an_inference_tensor_written_outside_inference_mode_is_refused(counting):
    p = make_batch_problem([3, 2])
    with torch.inference_mode():
        records, out = p.records(), torch.empty_like(p.v)
        for _ in range(2):
            _verify(p, records, out)
    assert counting.repeats == 1
    with pytest.raises(RuntimeError, match="inference"):
        _verify(p, records, out)
    assert counting.repeats == 1


def test_a_compiled_step_does_not_recompile_as_the_cache_changes(counting):
    p = make_batch_problem([3, 2])
    records = p.records()

    def step(q, k, v, out):
        return rs.gdn_verify(q, k, v, records=records, out=out, backend=COUNTING, **p.call_kwargs())

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    outs = [torch.empty_like(p.v) for _ in range(4)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for out in outs:
            compiled(p.q, p.k, p.v, out)
    assert counting.repeats == 0


def test_every_op_family_repeats(counting):
    x, conv_state, weight, bias, slots, qsl = conv_problem("cpu", [2, 3])
    out = torch.empty_like(x)
    for _ in range(2):
        rs.conv_verify(x, conv_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=out,
                       backend=COUNTING)
    x1 = x[:2].contiguous()
    out1 = torch.empty_like(x1)
    for _ in range(2):
        rs.conv_decode(x1, conv_state, weight, bias, state_indices=slots, out=out1, backend=COUNTING)
    p = make_batch_problem([2, 2], num_slots=12, sources_below=8)
    out = torch.empty_like(p.v)
    for _ in range(2):
        rs.gdn_decode(p.q, p.k, p.v, out=out, backend=COUNTING, **p.call_kwargs())
    snapshot_slots = torch.tensor([[8, 9], [10, 11]], dtype=torch.int32)
    for _ in range(2):
        rs.gdn_spec_decode_snapshot(p.q, p.k, p.v, snapshot_slots=snapshot_slots, out=out, backend=COUNTING,
                                    **p.call_kwargs())
    assert (counting.calls, counting.repeats) == (4, 4)


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
    "environment": lambda c, mp: mp.setenv("RECOVERSSM_BACKEND", "cpu_ref"),
    "negative view": lambda c, mp: c.tokens.update(q=torch._neg_view(c.p.q)),
}


@pytest.mark.parametrize("change", [*CHANGES, "registry", "launch refused", "not a Launch"])
def test_what_makes_a_call_go_through_the_op(counting, monkeypatch, change):
    p = make_batch_problem([3, 2], act_dtype=torch.bfloat16)
    T, HV, V = p.v.shape
    buffer = torch.empty(T * (HV + 1) * V, dtype=p.v.dtype)
    c = Call(p, p.records(), buffer[:T * HV * V].view(T, HV, V), buffer)
    counting.returns = "callable" if change == "not a Launch" else "launch"
    first = {"scale": 0.0}
    _verify(p, c.records, c.out, **first)
    assert len(REPEATS) == (change != "not a Launch")     # kept, so the changes below matter
    c.kw.update(first)
    if change in CHANGES:
        CHANGES[change](c, monkeypatch)
    counting.refuse = change == "launch refused"
    if change == "registry":
        registry().register(object(), name="tests.test_repeats.nothing")
    try:
        rs.gdn_verify(c.tokens["q"], c.tokens["k"], c.tokens["v"], records=c.records, out=c.out, backend=COUNTING,
                      **p.call_kwargs(**c.kw))
    finally:
        if change == "registry":
            registry().unregister("tests.test_repeats.nothing")
    assert (counting.calls, counting.repeats) == (2, 0), change


def test_the_unchanged_call_of_that_table_repeats(counting):
    p = make_batch_problem([3, 2], act_dtype=torch.bfloat16)
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out, scale=0.0)
    assert (counting.calls, counting.repeats) == (1, 1)


def test_an_unhashable_argument_is_named_by_the_op(counting):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    with pytest.raises((TypeError, RuntimeError), match="check"):
        _verify(p, records, out, check=[])


def test_modes_and_compilation_go_through_the_op(counting):
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
    assert (counting.calls, counting.repeats) == (3, 0)

    def step(q, k, v):
        return rs.gdn_verify(q, k, v, records=records, out=out, backend=COUNTING, **p.call_kwargs())

    torch.compile(step, fullgraph=True, backend="eager")(p.q, p.k, p.v)
    assert counting.repeats == 0 and counting.calls >= 4
    calls = counting.calls
    torch.jit.trace(step, (p.q, p.k, p.v), check_trace=False)
    assert counting.repeats == 0 and counting.calls == calls + 1


def test_a_bad_call_after_a_repeat_is_still_refused(counting):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    for _ in range(2):
        _verify(p, records, out)
    assert (counting.calls, counting.repeats) == (1, 1)
    # A bad value in the very tensors of the repeated call: refused when values are checked.
    p.state_indices[0] = 10_000
    with pytest.raises(ValueError, match="state_indices"):
        _verify(p, records, out, check=True)
    with pytest.raises(ValueError, match="query_start_loc has shape"):
        _verify(p, records, out, state_indices=p.state_indices[:1])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rs.gdn_verify(p.q.numpy(), p.k, p.v, records=records, out=out, backend=COUNTING, **p.call_kwargs())


def test_call_key_has_every_layout_field():
    t = torch.zeros(4, 6)
    key = call_key("gdn_verify", (t, 1.0, None, "x"))
    assert key[2] == (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
    assert key[3:] == ((1.0).hex(), (type(None), None), (str, "x"))

    class Sub(torch.Tensor):
        pass

    assert call_key("gdn_verify", (t.as_subclass(Sub),)) is None


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
