"""Eager repeats of a call's launch (``core/repeats.py``): when the shortcut is taken, when it is
not, and (on the GPU) that a repeated launch computes what the op computes, bit for bit.

The CPU tests use a backend registered here that counts its calls and hands back a counting
launch; CPU tensors always want value checks, so those tests switch that off for the cache's
decision only (the op path still checks everything)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import recoverssm as rs
from recoverssm.core import repeats as repeats_module
from recoverssm.core.backend import Backend
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

    def _launch(self):
        def launch() -> bool:
            if self.refuse:
                return False
            self.repeats += 1
            return True
        return launch

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
    # CPU tensors always want value checks; for the cache's decision only, they do not here.
    monkeypatch.setattr(repeats_module, "wants_value_checks", lambda check, device: bool(check))
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


@pytest.mark.parametrize("change", ["out address", "out strides", "state dtype", "null_slot", "scale",
                                    "use_qk_l2norm", "check", "environment", "registry", "launch refused"])
def test_what_makes_a_call_go_through_the_op(counting, monkeypatch, change):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    kw = {}
    if change == "out address":
        out = torch.empty_like(p.v)
    elif change == "out strides":
        out = torch.empty(p.v.shape[0], p.v.shape[1] + 1, p.v.shape[2])[:, 1:]
    elif change == "state dtype":
        kw["state"] = p.state.to(torch.bfloat16)
    elif change == "null_slot":
        kw["null_slot"] = -2
    elif change == "scale":
        kw["scale"] = 0.5
    elif change == "use_qk_l2norm":
        kw["use_qk_l2norm"] = False
    elif change == "check":
        kw["check"] = True
    elif change == "environment":
        monkeypatch.setenv("RECOVERSSM_BACKEND", "cpu_ref")
    elif change == "registry":
        registry().register(object(), name="tests.test_repeats.nothing")
    elif change == "launch refused":
        counting.refuse = True
    try:
        _verify(p, records, out, **kw)
    finally:
        if change == "registry":
            registry().unregister("tests.test_repeats.nothing")
    assert (counting.calls, counting.repeats) == (2, 0), change


def test_modes_and_compilation_go_through_the_op(counting):
    p = make_batch_problem([2, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        _verify(p, records, out)
    assert (counting.calls, counting.repeats) == (2, 0)

    def step(q, k, v):
        return rs.gdn_verify(q, k, v, records=records, out=out, backend=COUNTING, **p.call_kwargs())

    torch.compile(step, fullgraph=True, backend="eager")(p.q, p.k, p.v)
    assert counting.repeats == 0 and counting.calls >= 3


def test_a_bad_call_after_a_repeat_is_still_refused(counting):
    p = make_batch_problem([3, 2])
    records, out = p.records(), torch.empty_like(p.v)
    _verify(p, records, out)
    with pytest.raises(ValueError, match="query_start_loc has shape"):
        _verify(p, records, out, state_indices=p.state_indices[:1])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rs.gdn_verify(p.q.numpy(), p.k, p.v, records=records, out=out, backend=COUNTING, **p.call_kwargs())


def test_call_key_has_every_layout_field():
    t = torch.zeros(4, 6)
    key = call_key("gdn_verify", (t, 1.0, None, "x"))
    assert (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) == key[2:7]
    assert key[7:] == (1.0, None, "x")

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
    p = make_batch_problem([4, 1, 3, 4], padding=(1,), H=2, HV=4, K=128, V=128, state_dtype=state_dtype,
                           device="cuda")
    records, out = p.records(), torch.empty_like(p.v)
    fresh = make_batch_problem([4, 1, 3, 4], padding=(1,), H=2, HV=4, K=128, V=128, state_dtype=state_dtype,
                               device="cuda", seed=7)
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
    # decode repeats too, and leaves the state the op leaves
    state = p.state.clone()
    for _ in range(3):
        rs.gdn_decode(p.q, p.k, p.v, out=out, **p.call_kwargs(state=state))
    want_state = p.state.clone()
    for _ in range(3):
        rs.gdn_decode(p.q, p.k, p.v, out=want_out, check=True, **p.call_kwargs(state=want_state))
    assert REPEATS.hits >= hits + 2
    assert torch.equal(state, want_state) and torch.equal(out, want_out)


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
        rs.conv_decode(x1, conv_state, weight, bias, state_indices=slots, out=out[:3])
        rs.conv_decode(x1, want_state, weight, bias, state_indices=slots, out=want_out[:3], check=True)
        assert torch.equal(out, want_out) and torch.equal(conv_state, want_state), i
    assert REPEATS.hits > 0
