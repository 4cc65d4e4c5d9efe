"""Two identical copies of a small model's caches, one run with the repeat cache and one without,
for the repeat cache's stress tests (``tests/test_repeats.py``).

A :class:`World` holds one conv + GDN layer's pools (conv state, recurrent state), its weights,
and ``lanes``: per lane its own replay records, commit context, output buffers and index tensors
over its own slots, so that lanes can run in separate threads. Output buffers are views into one
arena, so a buffer can be dropped and made again at the very same address (with the same or
another dtype), as a caching allocator does. Every action a test takes is applied to both worlds
(:class:`Pair`): world ``on`` with the cache, world ``off`` inside ``rs.no_repeats()``; their
tensors must stay equal bit for bit.
"""
from __future__ import annotations

import random
import threading
from typing import Callable, Optional

import torch

import recoverssm as rs

I32 = torch.int32
H, HV, K, V = 1, 2, 8, 8
WIDTH = 3
CONV_DIM = 2 * H * K + HV * V
T_MAX = 3
ROWS = 2                  # batch rows per lane
SLOTS_PER_LANE = 6
INDEX_SETS = 3            # per lane: tensors of slots and query_start_loc, each its own layout
BUFFERS = 3               # per lane: conv and recurrence output buffers


def _split(y: torch.Tensor):
    """q, k, v as strided views of the conv output (as an engine splits its fused projection)."""
    T = y.shape[0]
    return (y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V))


class Lane:
    def __init__(self, world: "World", index: int, gen: torch.Generator):
        dev = world.device
        self.world = world
        first = index * SLOTS_PER_LANE
        self.records = rs.ReplayRecords.allocate(ROWS, T_MAX, H, HV, K, V, device=dev)
        self.ctx = rs.CommitContext([[rs.LayerCache(world.state, self.records, world.conv_state,
                                                    conv_width=WIDTH)]], max_batch=ROWS, backend=world.backend)
        # compiled per context: the graph holds the context
        self.compiled_commit = torch.compile(self.ctx.commit, backend="eager", fullgraph=True)
        self.index_sets = []
        for i in range(INDEX_SETS):
            slots = torch.randperm(SLOTS_PER_LANE, generator=gen)[:ROWS] + first
            if i == 1:
                slots[0] = -1                                  # a padding row
            lens = torch.randint(1, T_MAX + 1, (ROWS,), generator=gen)
            qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            self.index_sets.append((slots.to(I32).to(dev), qsl.to(I32).to(dev)))
        self.accepted = torch.zeros(ROWS, dtype=I32, device=dev)
        self.one_each = torch.arange(ROWS + 1, dtype=I32, device=dev)
        tokens = ROWS * T_MAX
        # output buffers: views into one arena per lane (realloc puts a new view at the same place)
        self.y_arena = torch.zeros(BUFFERS * tokens * CONV_DIM + 64, device=dev)
        self.o_arena = torch.zeros(BUFFERS * tokens * HV * V + 64, device=dev)
        self.y = [self._y_view(j, torch.float32) for j in range(BUFFERS)]
        self.o = [self._o_view(j, torch.float32) for j in range(BUFFERS)]

    def _y_view(self, j: int, dtype) -> torch.Tensor:
        tokens = ROWS * T_MAX
        flat = self.y_arena[j * tokens * CONV_DIM:(j + 1) * tokens * CONV_DIM]
        return (flat if dtype == torch.float32 else flat.view(dtype)[:tokens * CONV_DIM]).view(tokens, CONV_DIM)

    def _o_view(self, j: int, dtype) -> torch.Tensor:
        tokens = ROWS * T_MAX
        flat = self.o_arena[j * tokens * HV * V:(j + 1) * tokens * HV * V]
        return (flat if dtype == torch.float32 else flat.view(dtype)[:tokens * HV * V]).view(tokens, HV, V)

    def realloc(self, j: int, dtype) -> None:
        """Output buffers ``j`` dropped and made again at the same addresses (in ``dtype``)."""
        self.y[j] = self._y_view(j, dtype)
        self.o[j] = self._o_view(j, dtype)

    def tensors(self) -> list:
        return [self.records.correction, self.records.key, self.records.decay, self.y_arena, self.o_arena]


class World:
    def __init__(self, backend: str, device: str, lanes: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.backend, self.device = backend, device
        num_slots = lanes * SLOTS_PER_LANE
        self.state = (torch.randn(num_slots, HV, V, K, generator=gen) * 0.5).to(device)
        self.conv_state = torch.randn(num_slots, CONV_DIM, WIDTH - 1 + T_MAX, generator=gen).to(device)
        self.weight = (torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5).to(device)
        self.bias = (torch.randn(CONV_DIM, generator=gen) * 0.1).to(device)
        self.A_log = (torch.randn(HV, generator=gen) * 0.5).to(device)
        self.dt_bias = torch.randn(HV, generator=gen).to(device)
        tokens = ROWS * T_MAX
        self.x = torch.randn(tokens, CONV_DIM, generator=gen).to(device)
        self.ab = torch.randn(tokens, 2 * HV, generator=gen).to(device)
        self.x1 = torch.randn(ROWS, CONV_DIM, generator=gen).to(device)
        self.lanes = [Lane(self, i, gen) for i in range(lanes)]

    def tensors(self) -> list:
        return [self.state, self.conv_state] + [t for lane in self.lanes for t in lane.tensors()]

    # ---- the step's pieces, as an engine calls them -------------------------------------------------
    def verify(self, lane: int, i: int, j: int, compiled: Optional[Callable] = None) -> None:
        ln = self.lanes[lane]
        slots, qsl = ln.index_sets[i]
        fn = compiled or verify_step
        fn(self.x, self.ab, self.conv_state, self.weight, self.bias, self.state, self.A_log, self.dt_bias,
           slots, qsl, ln.records.correction, ln.records.key, ln.records.decay, ln.y[j], ln.o[j], self.backend)

    def commit(self, lane: int, i: int, accepted: list, compiled: bool = False) -> None:
        ln = self.lanes[lane]
        slots, qsl = ln.index_sets[i]
        ln.accepted.copy_(torch.tensor(accepted, dtype=I32))
        (ln.compiled_commit if compiled else ln.ctx.commit)(ln.accepted, slots, qsl)

    def decode(self, lane: int, i: int, j: int) -> None:
        ln = self.lanes[lane]
        slots = ln.index_sets[i][0]
        y = ln.y[j][:ROWS]
        rs.conv_decode(self.x1, self.conv_state, self.weight, self.bias, state_indices=slots, out=y,
                       backend=self.backend)
        q, k, v = _split(y)
        rs.gdn_decode(q, k, v, state=self.state, state_indices=slots, query_start_loc=ln.one_each,
                      a=self.ab[:ROWS, :HV], b=self.ab[:ROWS, HV:], A_log=self.A_log, dt_bias=self.dt_bias,
                      out=ln.o[j][:ROWS], backend=self.backend)

    def new_values(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in (self.x, self.ab, self.x1):
            t.copy_(torch.randn(t.shape, generator=gen))


def verify_step(x, ab, conv_state, weight, bias, state, A_log, dt_bias, slots, qsl, correction, key, decay, y, o,
                backend):
    """One layer's conv and verify (the compiled tests compile this very function)."""
    rs.conv_verify(x, conv_state, weight, bias, state_indices=slots, query_start_loc=qsl, out=y, backend=backend)
    q, k, v = _split(y)
    rs.gdn_verify(q, k, v, state=state, state_indices=slots, query_start_loc=qsl,
                  records=rs.ReplayRecords(correction, key, decay), a=ab[:, :HV], b=ab[:, HV:], A_log=A_log,
                  dt_bias=dt_bias, out=o, backend=backend)


class Pair:
    """World ``on`` (the repeat cache on) and world ``off`` (inside ``rs.no_repeats()``), built alike."""

    def __init__(self, backend: str, device: str, lanes: int = 2, seed: int = 0):
        torch._dynamo.reset()      # Dynamo counts recompilations of a code object (ctx.commit) per process
        self.on = World(backend, device, lanes, seed)
        self.off = World(backend, device, lanes, seed)
        self.compiled_verify = torch.compile(verify_step, backend="eager", fullgraph=True)

    def both(self, action: Callable[[World], None]) -> None:
        action(self.on)
        with rs.no_repeats():
            action(self.off)

    def assert_equal(self, what: str) -> None:
        if self.on.device != "cpu":
            torch.cuda.synchronize()
        for n, (a, b) in enumerate(zip(self.on.tensors(), self.off.tensors())):
            assert torch.equal(a, b), f"{what}: tensor {n} differs"

    def in_threads(self, action: Callable[[World, int], None]) -> None:
        """``action(world, lane)`` for every lane, one thread per lane, in both worlds."""
        for world, off in ((self.on, False), (self.off, True)):
            errors = []

            def run(lane: int) -> None:
                try:
                    if off:
                        with rs.no_repeats():
                            action(world, lane)
                    else:
                        action(world, lane)
                except BaseException as exc:     # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(lane,)) for lane in range(len(world.lanes))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]


ACTIONS = ("verify", "verify", "compiled verify", "commit", "compiled commit", "decode", "realloc", "relayout",
           "values", "threads", "clear")


def random_actions(pair: Pair, rng: random.Random, steps: int, extra: Optional[dict] = None,
                   leave_out: tuple = ()) -> list[str]:
    """Apply ``steps`` random actions to both worlds, comparing after each; returns their names.
    ``extra``: more actions by name, each ``fn(pair, lane, index_set, buffer)``; ``leave_out``:
    actions not to take."""
    from recoverssm.core.repeats import REPEATS

    lanes = len(pair.on.lanes)
    kinds = [k for k in (*ACTIONS, *(extra or {})) if k not in leave_out]
    done = []
    for step in range(steps):
        kind = rng.choice(kinds)
        lane, i, j = rng.randrange(lanes), rng.randrange(INDEX_SETS), rng.randrange(BUFFERS)
        if kind == "verify":
            pair.both(lambda w: w.verify(lane, i, j))
        elif kind == "compiled verify":
            pair.both(lambda w: w.verify(lane, i, j, pair.compiled_verify))
        elif kind in ("commit", "compiled commit"):
            lens = (pair.on.lanes[lane].index_sets[i][1].diff()).tolist()
            accepted = [rng.randint(0, n) for n in lens]
            pair.both(lambda w: w.commit(lane, i, accepted, kind == "compiled commit"))
        elif kind == "decode":
            pair.both(lambda w: w.decode(lane, i, j))
        elif kind == "realloc":
            pair.both(lambda w: w.lanes[lane].realloc(j, torch.float32))
        elif kind == "relayout":
            dtype = rng.choice([torch.float32, torch.bfloat16])
            pair.both(lambda w: w.lanes[lane].realloc(j, dtype))
        elif kind == "values":
            pair.both(lambda w: w.new_values(step))
        elif kind == "threads":
            pair.in_threads(lambda w, ln: (w.verify(ln, i, j), w.commit(ln, i, [1] * ROWS), w.verify(ln, i, j)))
        elif kind == "clear":
            REPEATS.clear()
        else:
            extra[kind](pair, lane, i, j)
        pair.assert_equal(f"step {step} ({kind})")
        done.append(kind)
    return done
