"""Deferred commits (``CommitContext.defer``): the accepted tokens of a step replayed inside the
next step's verify. Random step sequences (``deferred_sim.Engine``) must give the eager path's
outputs every step and, after a final flush, its states and conv states, bit for bit; a pending
step that is neither replayed nor flushed is caught where value checks run."""
from __future__ import annotations

import functools

import pytest
import torch

import recoverssm as rs

from deferred_sim import Engine, Setup
from helpers import backends, device_of

SETUPS = {
    "gdn+kda fp32": Setup(),
    "bf16 states": Setup(state_dtype=torch.bfloat16),
    "align, 2 groups": Setup(align=True, block_size=2, groups=2, kinds=("gdn", "kda")),
    "align bf16, GQA": Setup(align=True, block_size=2, state_dtype=torch.bfloat16, H=1, HV=4, kinds=("kda", "gdn")),
    "align, dilated conv": Setup(align=True, block_size=2, kinds=("gdn", "kda"), width=4, dilation=3),
    "mamba2 beside gdn and kda": Setup(kinds=("mamba2", "gdn", "kda")),
    "align bf16, mamba2": Setup(align=True, block_size=2, state_dtype=torch.bfloat16, H=1, HV=4,
                                kinds=("mamba2", "kda")),
}


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_deferred_steps_give_the_eager_bits(backend, setup):
    s = SETUPS[setup]
    s = Setup(**{**s.__dict__, "backend": backend, "device": device_of(backend)})
    steps = 10 if backend == "cpu_ref" else 5
    engine = Engine(s, seed=sorted(SETUPS).index(setup))
    for i in range(steps):
        engine.step(flush_all=i == steps // 2)     # half-way, as before a change of draft length
    engine.finish()
    assert engine.replayed > 0 and engine.flushed > 0
    if s.align:
        assert engine.boundaries > 0


# ------------------------------------------------------------------------------------------------
# what the checks catch (CPU tensors: value checks always run)
# ------------------------------------------------------------------------------------------------
def _two_steps(setup: Setup = Setup(kinds=("gdn", "kda"))):
    """An engine after one deferred step of two rows (both worlds), and the next step's tensors
    with both rows continuing."""
    engine = Engine(setup, seed=5)
    world = engine.deferred
    step = _fixed_step(engine, [0, 1])
    inputs = engine._inputs(step["tokens"])
    for w in (engine.eager, world):
        w.verify(inputs, step)
        w.end_step(step)
    return engine, world, step, inputs


def _fixed_step(engine: Engine, prev: list) -> dict:
    s = engine.s
    if not engine.requests:
        engine.join()
        engine.join()
    rids = list(engine.requests)[:2]
    slots = torch.tensor([engine.requests[r].slots[0] for r in rids], dtype=torch.int32)
    return dict(tokens=2 * s.T, qsl=torch.tensor([0, s.T, 2 * s.T], dtype=torch.int32), slots=[slots],
                accepted=torch.tensor([2, 3], dtype=torch.int32),
                pending_rows=torch.tensor(prev, dtype=torch.int32))


def test_a_pending_row_neither_replayed_nor_flushed_is_caught():
    engine, world, step, inputs = _two_steps()
    step = {**step, "pending_rows": torch.tensor([0, -1], dtype=torch.int32)}     # row 1 forgotten
    world.verify(inputs, step)
    with pytest.raises(ValueError, match="row 1 has a pending commit that 0 of its 4 ops replayed"):
        world.end_step(step)


def test_a_layer_that_does_not_replay_is_caught():
    engine, world, step, inputs = _two_steps()
    world.layers = world.layers[:1]               # the second layer's verify is skipped
    world.verify(inputs, step)
    with pytest.raises(ValueError, match="row 0 has a pending commit that 2 of its 4 ops replayed"):
        world.end_step(step)


def test_a_row_that_was_replayed_is_not_flushed():
    engine, world, step, inputs = _two_steps()
    world.verify(inputs, step)
    with pytest.raises(ValueError, match="rows entry 0: row 0 was already replayed"):
        world.ctx.flush(torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("bad, message", [
    ([0, 0], "pending_rows makes rows 0 and 1 both replay row 0"),
    ([0, 7], "pending_rows entry 1 = 7 is neither a padding value"),
    ([1, 0], "state_indices entry 0 = .*final slot is"),
])
def test_pending_rows_are_checked(bad, message):
    engine, world, step, inputs = _two_steps()
    step = {**step, "pending_rows": torch.tensor(bad, dtype=torch.int32)}
    before = [t.clone() for t in world.caches()]
    with pytest.raises(ValueError, match=message):
        world.verify(inputs, step)
    assert all(torch.equal(a, b) for a, b in zip(before, world.caches()))


def test_records_and_pending_go_together():
    s = Setup()
    state = torch.zeros(s.num_slots, s.HV, s.V, s.K)
    single = rs.ReplayRecords.allocate(2, s.T, s.H, s.HV, s.K, s.V)
    double = rs.ReplayRecords.allocate(2, s.T, s.H, s.HV, s.K, s.V, buffers=2)
    with pytest.raises(ValueError, match="records have 1 buffer"):
        rs.CommitContext([[rs.LayerCache(state, single)]], max_batch=2, deferred=True)
    with pytest.raises(ValueError, match="records have 2 buffer"):
        rs.CommitContext([[rs.LayerCache(state, double)]], max_batch=2)
    ctx = rs.CommitContext([[rs.LayerCache(state, double)], [rs.LayerCache(state.clone(), rs.ReplayRecords.allocate(
        2, s.T, s.H, s.HV, s.K, s.V, buffers=2))]], max_batch=2, deferred=True)
    q = torch.randn(2, s.H, s.K)
    v = torch.randn(2, s.HV, s.V)
    kw = dict(state=state, state_indices=torch.tensor([0, 1], dtype=torch.int32),
              query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), g=-torch.rand(2, s.HV),
              beta=torch.rand(2, s.HV))
    with pytest.raises(ValueError, match="pending holds 2 KV-cache groups"):
        rs.gdn_verify(q, q, v, records=double, pending=ctx.pending, **kw)
    with pytest.raises(ValueError, match="double-buffered records"):
        rs.gdn_verify(q, q, v, records=double, **kw)
    with pytest.raises(ValueError, match="double-buffered records"):
        rs.gdn_verify(q, q, v, records=single, pending=ctx.pending[0], **kw)
    rs.gdn_verify(q, q, v, records=double, pending=ctx.pending[1], **kw)
    with pytest.raises(ValueError, match="commits eagerly"):
        rs.CommitContext([[rs.LayerCache(state, single)]], max_batch=2).pending


def test_commit_on_a_deferring_context_is_defer_and_flush():
    engine = Engine(Setup(kinds=("gdn", "kda")), seed=3)
    step = _fixed_step(engine, [-1, -1])
    inputs = engine._inputs(step["tokens"])
    for w in (engine.eager, engine.deferred):
        w.verify(inputs, step)
        w.ctx.commit(step["accepted"], step["slots"], step["qsl"])
    assert all(torch.equal(a, b) for a, b in zip(engine.eager.caches(), engine.deferred.caches()))
    assert engine.deferred.ctx.pending.plan[:, 0].eq(0).all()       # nothing pending afterwards


def test_a_deferred_step_compiles_and_gives_the_eager_bits():
    """conv + verify of every layer with the pending step, then defer, under
    ``torch.compile(fullgraph=True)``; then a flush: the eager bits."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        engine, world, step, inputs = _two_steps()

        def run(inputs, step):
            out = world.verify(inputs, step)
            world.end_step(step)
            return out
        fn = torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run
        outs = fn(inputs, step)
        world.ctx.flush()
        results.append(outs + world.caches())
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


# ------------------------------------------------------------------------------------------------
# on the GPU: realistic head sizes, and one CUDA graph per step
# ------------------------------------------------------------------------------------------------
GPU_SETUPS = {
    "fp32": Setup(H=2, HV=4, K=128, V=128, max_batch=6, backend="cuda", device="cuda"),
    "bf16 align": Setup(H=2, HV=4, K=128, V=128, max_batch=6, state_dtype=torch.bfloat16, align=True,
                        block_size=2, backend="cuda", device="cuda"),
    "two groups": Setup(H=1, HV=2, K=64, V=32, groups=2, kinds=("kda", "gdn"), backend="cuda", device="cuda"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("setup", sorted(GPU_SETUPS))
def test_deferred_steps_give_the_eager_bits_on_the_gpu(setup):
    engine = Engine(GPU_SETUPS[setup], seed=11)
    for i in range(12):
        engine.step(flush_all=i == 6)
    engine.finish()
    assert engine.replayed > 0 and engine.flushed > 0


def _fixed_buffers(state_dtype, backend: str, device: str, graphs: bool) -> None:
    """A step of fixed buffers, as under CUDA graphs (``graphs``: captured once per world, verify of
    every layer + commit, and verify with the pending step + defer, then replayed), run with new
    values: rows continue, one leaves (flushed between steps), another joins; the eager bits
    every step, and after a flush."""
    s = Setup(H=2, HV=4, K=128 if graphs else 16, V=128 if graphs else 16, max_batch=4, state_dtype=state_dtype,
              backend=backend, device=device)
    engine = Engine(s, seed=13)
    eager, deferred = engine.eager, engine.deferred
    for _ in range(s.max_batch):
        engine.join()
    rids = list(engine.requests)
    T, B = s.T, s.max_batch
    slots = torch.tensor([engine.requests[r].slots[0] for r in rids], dtype=torch.int32, device=device)
    step = dict(tokens=B * T, qsl=torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device), slots=[slots],
                accepted=torch.ones(B, dtype=torch.int32, device=device),
                pending_rows=torch.arange(B, dtype=torch.int32, device=device))
    inputs = engine._inputs(step["tokens"])
    outs = {}

    def run(world):
        outs[id(world)] = world.verify(inputs, step)     # fresh tensors (under capture: the graph's)
        world.end_step(step)

    replay = {id(world): _replayer(run, world, graphs) for world in (eager, deferred)}
    deferred.ctx.flush()                                 # the first step (a capture runs nothing), settled
    assert all(torch.equal(a, b) for a, b in zip(eager.caches(), deferred.caches()))
    gen = torch.Generator().manual_seed(3)
    step["pending_rows"].fill_(-1)                       # nothing pending at the first step
    for i in range(8):
        _reschedule(i, engine, step)
        for t in inputs.values():
            for x in t:
                x.copy_(torch.randn(x.shape, generator=gen))
        step["accepted"].copy_(torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32))
        for world in (eager, deferred):
            replay[id(world)]()
        if graphs:
            torch.cuda.synchronize()
        for n, (a, b) in enumerate(zip(outs[id(eager)], outs[id(deferred)])):
            assert torch.equal(a, b), f"step {i}: output {n} differs"
        step["pending_rows"].copy_(torch.tensor([r if slots[r] >= 0 and not (i == 4 and r == 1) else -1
                                                 for r in range(B)], dtype=torch.int32))
    deferred.ctx.flush()
    for n, (a, b) in enumerate(zip(eager.caches(), deferred.caches())):
        assert torch.equal(a, b), f"cache {n} differs"


def _replayer(run, world, graphs: bool):
    """The world's step, once eagerly (it compiles, binds, uploads the tables), then as a replay:
    of a CUDA graph captured from it, or of the eager call."""
    run(world)
    if not graphs:
        return functools.partial(run, world)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(world)
    return graph.replay


def _reschedule(i: int, engine: Engine, step: dict) -> None:
    """Before step ``i``: at 3 the request of row 1 leaves (flushed, the row padding); at 5 a new
    request takes row 1."""
    slots = step["slots"][0]
    if i == 3:
        engine.deferred.ctx.flush(torch.tensor([1], dtype=torch.int32, device=slots.device))
        slots[1] = -1
        step["pending_rows"][1] = -1
    if i == 5:
        engine.join()
        slots[1] = engine.requests[engine.next_id - 1].slots[0]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_fixed_buffers(state_dtype):
    _fixed_buffers(state_dtype, "cpu_ref", "cpu", graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_deferred_step_in_one_cuda_graph(state_dtype):
    _fixed_buffers(state_dtype, "cuda", "cuda", graphs=True)
