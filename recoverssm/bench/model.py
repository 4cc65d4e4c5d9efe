"""``recoverssm bench --only model``: one speculative decode step of a whole model's recurrent
layers, RecoverSSM against the snapshot method, per tensor-parallel rank.

A step of ``N`` requests with windows of ``T`` tokens (the last accepted token and ``T - 1``
drafts), for every recurrent layer of the model:

* **RecoverSSM**: per layer ``rs.conv_verify`` + ``rs.{gdn,kda}_verify`` from one state slot per
  request, then ONE :meth:`~recoverssm.CommitContext.commit` of all layers (conv compaction
  included). Each request owns 1 state slot and 1 conv slot per layer, plus its share of the
  replay records.
* **deferred**: RecoverSSM with deferred commits (:meth:`~recoverssm.CommitContext.defer`): per
  layer ``rs.conv_verify`` + ``rs.{gdn,kda}_verify`` with the step before pending (every request
  continues in its own row, as in a steady batch), each first replaying that step's accepted
  tokens in registers, then ONE small ``ctx.defer``. The records are double-buffered.
* **snapshot**: per layer the same ``rs.conv_verify`` (into a conv pool of ``T`` slots per
  request) + ``rs.{gdn,kda}_spec_decode_snapshot``, which stores the state after every position.
  Each request owns ``1 + k = T`` slots per layer; the one holding its current state is one of
  them, as in an engine that rotates through them.

The methods run on the same activations (bf16; q, k, v are views into the conv output, as in a
model), from the same starting states, with ``num_accepted`` drawn per request in ``[1, T]``; the
states after the step are compared bit for bit (commit of ``n`` tokens == snapshot of position
``n - 1``, state and conv history; the deferred step after a flush == the commit). Each method's
step is timed from one CUDA graph (the deferred step in its steady state: every row replaying the
step before) and launched eagerly (what an engine that does not capture pays in host time).
Cases whose pools exceed the device memory budget are reported as not fitting rather than run.

The case building and the eager steps (:func:`run_case_eagerly`) run on any device and backend;
only :func:`bench_model` and the timing under it need a CUDA GPU.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

import torch

import recoverssm as rs
from recoverssm.console import ProgressBar, format_table

from .timing import CopyCeiling, copies_for, median_us

METHODS = ("recoverssm", "deferred", "snapshot")
GiB = 2**30
#: device memory a method's pools (all rotated copies) may take; more is reported as not fitting
POOL_BUDGET_BYTES = 100 * GiB
#: the memory budget of the concurrency comparison (how many requests' states fit)
CONCURRENCY_BUDGET_BYTES = 40 * GiB
#: what the suite leaves free beside the pools (activations, saved states of the check, the graphs)
DEVICE_MARGIN_BYTES = 6 * GiB
#: a time limit for the default grid (it shares a 10-minute device call with the other suites);
#: cases past it are reported as not run
TIME_LIMIT_S = {False: 270.0, True: 120.0}
ACT_DTYPE = torch.bfloat16           # activations, conv weights and conv states, as in the models
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
#: device time one graph timing aims for (replays of one or more steps), and eager step timings
GRAPH_TARGET_US = 50_000.0
GRAPH_ITERS = (5, 40)
EAGER_ITERS = 3
LAUNCH_US = 3.0                      # device time of one launch, for the iteration estimate only


# ------------------------------------------------------------------------------------------------
# geometries and cases
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """A model's recurrent layers, whole or one tensor-parallel shard of them.

    ``kind``: ``"gdn"`` (scalar decay per head), ``"kda"`` (a decay per K channel) or ``"mamba2"``
    (``H`` = ngroups, ``HV`` = nheads, ``K`` = dstate, ``V`` = headdim); ``H`` q/k heads, ``HV``
    value heads, head dims ``K`` and ``V``; the conv runs over q, k and v channels (Mamba2: x, B
    and C): ``conv_dim = 2 * H * K + HV * V`` of width ``conv_width``.
    """

    name: str
    kind: str
    layers: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    conv_width: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    def shard(self, tp: int) -> "Geometry":
        """One rank's share under ``tp``-way tensor parallelism: ``H``, ``HV`` (and so
        ``conv_dim``) divided by ``tp``; every rank holds every layer."""
        if self.H % tp or self.HV % tp:
            raise ValueError(f"{self.name}: H = {self.H} and HV = {self.HV} do not split {tp} ways")
        return replace(self, H=self.H // tp, HV=self.HV // tp)


#: Qwen3-Next-80B-A3B; a large-head GDN geometry (64 value heads); a Kimi-Linear-like KDA model
QWEN3_NEXT = Geometry("qwen3-next-80b-a3b", "gdn", layers=36, H=16, HV=32)
LARGE_HEAD = Geometry("gdn-hv64-45l", "gdn", layers=45, H=16, HV=64)
KIMI_LINEAR = Geometry("kimi-linear-like", "kda", layers=27, H=32, HV=32)
#: Nemotron-H-8B's 24 Mamba2 layers: 128 heads of 64 channels, dstate 128, 8 groups
NEMOTRON_H = Geometry("nemotron-h-8b", "mamba2", layers=24, H=8, HV=128, K=128, V=64)
GEOMETRIES = (QWEN3_NEXT, LARGE_HEAD, KIMI_LINEAR, NEMOTRON_H)
TPS = (1, 2, 4)
STATE_DTYPES = (torch.float32, torch.bfloat16)
NS = (1, 8, 32, 64, 128, 256)
TS = (2, 4, 8)


@dataclass(frozen=True)
class Case:
    """One timed configuration: ``geometry`` is the full model, ``shard`` what one rank holds."""

    geometry: Geometry
    tp: int
    state_dtype: torch.dtype
    N: int
    T: int

    @property
    def shard(self) -> Geometry:
        return self.geometry.shard(self.tp)

    @property
    def label(self) -> str:
        return f"{self.geometry.name} TP={self.tp} {DTYPE_NAMES[self.state_dtype]} N={self.N} T={self.T}"


def grid(quick: bool = False, geometries: Sequence[str] = ()) -> list[Case]:
    """The suite's cases. Full: every geometry, TP, state dtype, ``T`` and ``N`` (324 cases).
    Quick: Qwen3-Next at TP = 1, both state dtypes, N = 8 and 64, T = 4 and 8, and one KDA case.
    ``geometries``: names (``Geometry.name``) to keep; empty keeps all."""
    if quick:
        cases = [Case(QWEN3_NEXT, 1, dtype, N, T) for dtype in STATE_DTYPES for T in (4, 8) for N in (8, 64)]
        cases += [Case(KIMI_LINEAR, 1, torch.float32, 64, 4)]
    else:
        cases = [Case(g, tp, dtype, N, T) for g in GEOMETRIES for tp in TPS for dtype in STATE_DTYPES
                 for T in TS for N in NS]
    unknown = set(geometries) - {g.name for g in GEOMETRIES}
    if unknown:
        raise ValueError(f"unknown model geometry {sorted(unknown)}; known: {[g.name for g in GEOMETRIES]}")
    return [c for c in cases if not geometries or c.geometry.name in geometries]


# ------------------------------------------------------------------------------------------------
# bytes: pools, per request, traffic
# ------------------------------------------------------------------------------------------------
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_slot_bytes(g: Geometry, state_dtype: torch.dtype) -> int:
    """One layer's recurrent state of one slot: ``[HV, V, K]``."""
    return g.HV * g.V * g.K * _itemsize(state_dtype)


def conv_slot_bytes(g: Geometry, T: int) -> int:
    """One layer's conv state of one slot: ``[conv_dim, width - 1 + T]`` bf16 (history and the
    window's inputs; ``conv_verify``'s layout)."""
    return g.conv_dim * (g.conv_width - 1 + T) * _itemsize(ACT_DTYPE)


def record_token_bytes(g: Geometry) -> int:
    """One layer's replay records of one token (fp32): correction ``[HV, V]``, key ``[H, K]``,
    decay ``[HV]`` (GDN) or ``[HV, K]`` (KDA)."""
    decay = g.HV * (g.K if g.kind == "kda" else 1)
    return (g.HV * g.V + g.H * g.K + decay) * 4


def slots_per_request(method: str, T: int) -> int:
    """State (and conv) slots a request owns per layer: 1 for RecoverSSM (both commit modes),
    ``1 + k = T`` for the snapshot method."""
    return T if method == "snapshot" else 1


def record_buffers(method: str) -> int:
    """Records workspaces per layer: 1 (eager commits), 2 (deferred: one pending, one written),
    none for the snapshot method."""
    return {"recoverssm": 1, "deferred": 2}.get(method, 0)


def bytes_per_request(g: Geometry, state_dtype: torch.dtype, T: int, method: str) -> int:
    """Device memory one request's recurrent caches take over all layers: its slots (state and
    conv) and, for RecoverSSM, its share of the records workspaces (``T`` tokens each)."""
    slot = state_slot_bytes(g, state_dtype) + conv_slot_bytes(g, T)
    records = record_buffers(method) * T * record_token_bytes(g)
    return g.layers * (slots_per_request(method, T) * slot + records)


def pool_bytes(case: Case, method: str) -> int:
    """Bytes of one copy of a method's pools for ``N`` requests (see :func:`bytes_per_request`)."""
    return case.N * bytes_per_request(case.shard, case.state_dtype, case.T, method)


def activation_bytes(case: Case) -> int:
    """The shared activations of a case (:class:`Activations`): conv inputs of every layer, gate
    inputs of every layer, one conv output and one recurrence output buffer."""
    g, tokens, e = case.shard, case.N * case.T, _itemsize(ACT_DTYPE)
    gate_a = g.HV * (g.K if g.kind == "kda" else 1)
    per_layer = tokens * (g.conv_dim + gate_a + g.HV) * e
    return g.layers * per_layer + tokens * (g.conv_dim + g.HV * g.V) * e


def conv_traffic(g: Geometry, N: int, T: int, method: str) -> int:
    """One layer's conv bytes: ``conv_verify`` reads the inputs and each request's history and
    writes the outputs and the window's inputs into the conv state; RecoverSSM then reads and
    writes each request's new history (the compaction: in the commit, or deferred, in the next
    ``conv_verify``)."""
    e, history = _itemsize(ACT_DTYPE), g.conv_width - 1
    verify = (3 * N * T + N * history) * g.conv_dim * e
    compaction = 2 * N * history * g.conv_dim * e if method != "snapshot" else 0
    return verify + compaction


def traffic_bytes(case: Case, method: str, accepted_tokens: int) -> int:
    """Bytes one step reads and writes over all layers (the copy-bandwidth floor's traffic).

    RecoverSSM, per layer: the state read once in verify, read and written once in the commit,
    records written for every token and read for the ``accepted_tokens`` replayed, the conv.
    Deferred: the state read once and written once (in the verify that replays the step before),
    the same records and conv. Snapshot: the state read once and written after each of the ``T``
    positions, the conv. The recurrence's activation reads and output writes (the same in all
    three) are left out.
    """
    g, N, T = case.shard, case.N, case.T
    state = state_slot_bytes(g, case.state_dtype)
    records = (N * T + accepted_tokens) * record_token_bytes(g)
    if method == "recoverssm":
        per_layer = 3 * N * state + records
    elif method == "deferred":
        per_layer = 2 * N * state + records
    else:
        per_layer = (1 + T) * N * state
    return g.layers * (per_layer + conv_traffic(g, N, T, method))


def launches_per_step(g: Geometry, method: str) -> int:
    """Kernel launches of one step: a conv and a recurrence per layer, plus RecoverSSM's commit
    (or the deferred step's defer)."""
    return 2 * g.layers + (0 if method == "snapshot" else 1)


# ------------------------------------------------------------------------------------------------
# building one case: activations, pools, steps
# ------------------------------------------------------------------------------------------------
@dataclass
class Activations:
    """The layer inputs of a case, shared by both methods and by every rotated pool copy: only the
    pools rotate, since in a model these come from the projection that runs just before (likely
    still in L2), while the states were last touched a whole step earlier.

    ``x``: ``[L, N*T, conv_dim]`` the conv inputs; ``a``: ``[L, N*T, HV]`` (GDN) or ``[L, N*T,
    HV, K]`` (KDA) and ``b``: ``[L, N*T, HV]`` the raw gate inputs; ``conv_weight``: ``[L,
    conv_dim, width]``; all bf16. ``A_log``: fp32 ``[L, HV]``; ``dt_bias``: fp32 ``[L, HV]`` or
    ``[L, HV, K]``. ``y``: ``[N*T, conv_dim]`` the conv output, ``o``: ``[N*T, HV, V]`` the
    recurrence output, both reused by every layer as a model reuses its buffers.
    ``query_start_loc``: int32 ``[N + 1]``; ``num_accepted``: int32 ``[N]`` in ``[1, T]``.
    """

    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    y: torch.Tensor
    o: torch.Tensor
    query_start_loc: torch.Tensor
    num_accepted: torch.Tensor

    def gates(self, layer: int) -> dict:
        return dict(a=self.a[layer], b=self.b[layer], A_log=self.A_log[layer], dt_bias=self.dt_bias[layer])


def make_activations(case: Case, device, seed: int = 0) -> Activations:
    """Random activations of ``case`` on ``device``; ``num_accepted`` drawn per request in ``[1, T]``."""
    g, N, T, L = case.shard, case.N, case.T, case.shard.layers
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    tokens = N * T
    gate_shape = (L, tokens, g.HV, g.K) if g.kind == "kda" else (L, tokens, g.HV)
    dt_shape = (L, g.HV, g.K) if g.kind == "kda" else (L, g.HV)
    host = torch.Generator().manual_seed(seed)
    accepted = torch.randint(1, T + 1, (N,), generator=host, dtype=torch.int32)
    return Activations(
        x=torch.randn(L, tokens, g.conv_dim, **kw).to(ACT_DTYPE),
        a=torch.randn(gate_shape, **kw).to(ACT_DTYPE),
        b=torch.randn(L, tokens, g.HV, **kw).to(ACT_DTYPE),
        conv_weight=(torch.randn(L, g.conv_dim, g.conv_width, **kw) / g.conv_width ** 0.5).to(ACT_DTYPE),
        A_log=torch.randn(L, g.HV, **kw) * 0.5 - 1.0,
        dt_bias=torch.randn(dt_shape, **kw) * 0.5,
        y=torch.empty(tokens, g.conv_dim, dtype=ACT_DTYPE, device=device),
        o=torch.empty(tokens, g.HV, g.V, dtype=ACT_DTYPE, device=device),
        query_start_loc=torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=device),
        num_accepted=accepted.to(device))


def split_qkv(y: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` ``[N*T, H, K]`` and ``v`` ``[N*T, HV, V]``: views into the conv output ``y``
    ``[N*T, conv_dim]`` (channels q | k | v; Mamba2's x | B | C, returned as C, B, x), read in
    place by the recurrence."""
    hk, hv = g.H * g.K, g.HV * g.V
    if g.kind == "mamba2":
        return (y[:, hv + hk:].unflatten(1, (g.H, g.K)), y[:, hv:hv + hk].unflatten(1, (g.H, g.K)),
                y[:, :hv].unflatten(1, (g.HV, g.V)))
    return (y[:, :hk].unflatten(1, (g.H, g.K)), y[:, hk:2 * hk].unflatten(1, (g.H, g.K)),
            y[:, 2 * hk:].unflatten(1, (g.HV, g.V)))


def recurrence_call(g: Geometry, method: str, q, k, v, gates: dict, **common) -> tuple[Callable, dict]:
    """The layer's verify (``method`` RecoverSSM or deferred) or snapshot op and its arguments
    (``q``, ``k``, ``v`` in the roles of Mamba2's ``C``, ``B``, ``x``; its ``dt`` is GDN's gate
    input ``a``, its ``D`` the layer's ``dt_bias`` values: any ``[HV]`` fp32 values cost the same)."""
    mode = "spec_decode_snapshot" if method == "snapshot" else "verify"
    fn = getattr(rs, f"{g.kind}_{mode}")
    if g.kind == "mamba2":
        return fn, dict(x=v, B=k, C=q, dt=gates["a"], dt_bias=gates["dt_bias"], A_log=gates["A_log"],
                        D=gates["dt_bias"], **common)
    return fn, dict(q=q, k=k, v=v, **gates, **common)


@dataclass
class Pools:
    """One method's caches for every layer, each kind one allocation with a view per layer.

    ``state``: ``[L, slots, HV, V, K]``; ``conv``: ``[L, slots, conv_dim, width - 1 + T]`` bf16;
    ``source``: int32 ``[N]``, the slot holding each request's current state; RecoverSSM:
    ``records``, one :class:`~recoverssm.ReplayRecords` per layer; snapshot: ``snapshot_slots``
    int32 ``[N, T]``, the request's own ``T`` slots, position ``t`` stored into column ``t``.
    """

    state: torch.Tensor
    conv: torch.Tensor
    source: torch.Tensor
    records: Optional[list] = None
    snapshot_slots: Optional[torch.Tensor] = None


def _records(g: Geometry, N: int, T: int, device, buffers: int = 1) -> list:
    """The records workspace of every layer: views into three allocations (written by verify
    before the commit reads them, so they start uninitialized); ``buffers = 2``: double-buffered."""
    L, R, kw = g.layers, buffers * N, dict(dtype=torch.float32, device=device)
    correction = torch.empty(L, R, g.HV, T, g.V, **kw)
    key = torch.empty(L, R, g.H, T, g.K, **kw)
    decay = torch.empty((L, R, g.HV, T, g.K) if g.kind == "kda" else (L, R, g.HV, T), **kw)
    return [rs.ReplayRecords(correction[i], key[i], decay[i], buffers) for i in range(L)]


def make_pools(case: Case, method: str, device, seed: int = 0) -> Pools:
    """Empty pools for ``method`` with each request's current slot filled by :func:`fill_sources`.

    Slots no request reads start uninitialized: the snapshot method writes them before any read."""
    g, N, T = case.shard, case.N, case.T
    slots = N * slots_per_request(method, T)
    state = torch.empty(g.layers, slots, g.HV, g.V, g.K, dtype=case.state_dtype, device=device)
    conv = torch.empty(g.layers, slots, g.conv_dim, g.conv_width - 1 + T, dtype=ACT_DTYPE, device=device)
    if method != "snapshot":
        source = torch.arange(N, dtype=torch.int32, device=device)
        pools = Pools(state, conv, source, records=_records(g, N, T, device, record_buffers(method)))
    else:
        # The current state sits in whichever of the request's T slots the last step accepted.
        host = torch.Generator().manual_seed(seed + 1)
        column = torch.randint(0, T, (N,), generator=host, dtype=torch.int32)
        own = torch.arange(N * T, dtype=torch.int32).view(N, T)
        pools = Pools(state, conv, (own[:, 0] + column).to(device), snapshot_slots=own.to(device))
    fill_sources(case, pools, seed)
    return pools


def fill_sources(case: Case, pools: Pools, seed: int) -> None:
    """Give each request's current slot its starting state and conv history, drawn per layer from
    ``seed``: both methods start from the same values, whichever slots hold them."""
    g, N = case.shard, case.N
    device = pools.state.device
    history = g.conv_width - 1
    for layer in range(g.layers):
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + layer)
        start = torch.randn(N, g.HV, g.V, g.K, device=device, generator=gen) * 0.1
        pools.state[layer][pools.source] = start.to(case.state_dtype)
        conv = torch.randn(N, g.conv_dim, history, device=device, generator=gen)
        pools.conv[layer, :, :, :history][pools.source] = conv.to(ACT_DTYPE)


class Step:
    """One speculative decode step of every recurrent layer: a fixed list of library calls (all
    arguments bound up front, outputs included, so the calls allocate nothing and can be captured
    in a CUDA graph). ``ctx``: the step's commit context (None for the snapshot method)."""

    def __init__(self, calls: Sequence[tuple[Callable, dict]], ctx: Optional[rs.CommitContext] = None):
        self.calls = list(calls)
        self.ctx = ctx

    def __call__(self) -> None:
        for fn, kwargs in self.calls:
            fn(**kwargs)


def _conv_call(acts: Activations, pools: Pools, layer: int, backend: str) -> tuple[Callable, dict]:
    return rs.conv_verify, dict(x=acts.x[layer], conv_state=pools.conv[layer], weight=acts.conv_weight[layer],
                                bias=None, state_indices=pools.source, query_start_loc=acts.query_start_loc,
                                out=acts.y, backend=backend)


def make_step(case: Case, method: str, acts: Activations, pools: Pools, backend: str) -> Step:
    """The step of ``method`` over ``pools`` (RecoverSSM: builds the layers' CommitContext; the
    deferred one replays, in every row, the step before of the same row)."""
    g = case.shard
    q, k, v = split_qkv(acts.y, g)
    common = dict(state_indices=pools.source, query_start_loc=acts.query_start_loc, out=acts.o, backend=backend)
    ctx, pending = None, {}
    if method != "snapshot":
        caches = [rs.LayerCache(pools.state[i], pools.records[i], conv_state=pools.conv[i], conv_width=g.conv_width)
                  for i in range(g.layers)]
        ctx = rs.CommitContext([caches], max_batch=case.N, backend=backend, deferred=method == "deferred")
        if method == "deferred":
            pending = dict(pending=ctx.pending, pending_rows=torch.arange(case.N, dtype=torch.int32,
                                                                          device=pools.source.device))
    calls = []
    for layer in range(g.layers):
        fn, conv = _conv_call(acts, pools, layer, backend)
        calls.append((fn, dict(conv, **pending)))
        extra = (dict(snapshot_slots=pools.snapshot_slots) if method == "snapshot"
                 else dict(records=pools.records[layer], **pending))
        calls.append(recurrence_call(g, method, q, k, v, acts.gates(layer), state=pools.state[layer], **common,
                                     **extra))
    if ctx is not None:
        end = ctx.defer if method == "deferred" else ctx.commit
        calls.append((end, dict(num_accepted=acts.num_accepted, state_indices=pools.source,
                                query_start_loc=acts.query_start_loc)))
    return Step(calls, ctx)


def settle(step: Step) -> None:
    """Leave the states where the step accepted them: a deferred step's pending commit flushed."""
    if step.ctx is not None and step.ctx.deferred:
        step.ctx.flush()


# ------------------------------------------------------------------------------------------------
# the states after a step, and their comparison
# ------------------------------------------------------------------------------------------------
@dataclass
class AcceptedStates:
    """Each checked layer's caches after ``num_accepted`` tokens: ``state`` ``[N, HV, V, K]`` and
    ``conv`` ``[N, conv_dim, width - 1]`` (the history a next step reads), copies."""

    layers: list
    state: list
    conv: list


def accepted_states(case: Case, method: str, acts: Activations, pools: Pools,
                    layers: Iterable[int]) -> AcceptedStates:
    """Where each method leaves the accepted state: RecoverSSM in the request's slot (the commit
    replayed ``n`` tokens into it), at the front of its conv state; the snapshot method in the
    slot of position ``n - 1``, with the history ending at token ``n - 1`` still in the source's
    conv window (columns ``[n, n + width - 1)``)."""
    history = case.shard.conv_width - 1
    layers = list(layers)
    n = acts.num_accepted.long()
    if method != "snapshot":
        slots = pools.source.long()
        columns = torch.arange(history, device=n.device).expand(case.N, history)
    else:
        slots = pools.snapshot_slots.long().gather(1, (n - 1)[:, None]).squeeze(1)
        columns = n[:, None] + torch.arange(history, device=n.device)
    states, convs = [], []
    for layer in layers:
        states.append(pools.state[layer][slots])          # indexing with a tensor copies
        conv = pools.conv[layer][pools.source.long()]
        convs.append(conv.gather(2, columns[:, None, :].expand(-1, conv.shape[1], -1)))
    return AcceptedStates(layers, states, convs)


def states_agree(a: AcceptedStates, b: AcceptedStates) -> bool:
    """True when both hold the same layers with every state and conv history equal bit for bit."""
    return (a.layers == b.layers and all(torch.equal(x, y) for x, y in zip(a.state, b.state))
            and all(torch.equal(x, y) for x, y in zip(a.conv, b.conv)))


def run_case_eagerly(case: Case, device="cpu", backend: str = "cpu_ref",
                     layers: Optional[Iterable[int]] = None, seed: int = 0) -> dict:
    """Build ``case`` on ``device``, run one step of each method eagerly from the same starting
    states, and return ``{method: AcceptedStates}`` for ``layers`` (default: all)."""
    layers = list(range(case.shard.layers) if layers is None else layers)
    acts = make_activations(case, device, seed)
    out = {}
    for method in METHODS:
        pools = make_pools(case, method, device, seed)
        step = make_step(case, method, acts, pools, backend)
        step()
        settle(step)
        out[method] = accepted_states(case, method, acts, pools, layers)
    return out


# ------------------------------------------------------------------------------------------------
# memory: requests that fit a budget
# ------------------------------------------------------------------------------------------------
def memory_rows(cases: Sequence[Case], budget: int = CONCURRENCY_BUDGET_BYTES) -> list[dict]:
    """Per (geometry, TP, state dtype, T) of ``cases``: bytes per request of each method, the most
    concurrent requests whose recurrent caches fit ``budget``, and their ratio."""
    rows, seen = [], set()
    for c in cases:
        key = (c.geometry.name, c.tp, c.state_dtype, c.T)
        if key in seen:
            continue
        seen.add(key)
        per = {m: bytes_per_request(c.shard, c.state_dtype, c.T, m) for m in METHODS}
        fit = {m: budget // per[m] for m in METHODS}
        rows.append(dict(geometry=c.geometry.name, tp=c.tp, state=DTYPE_NAMES[c.state_dtype], T=c.T,
                         **{f"{m}_bytes_per_request": per[m] for m in METHODS},
                         **{f"{m}_max_requests": fit[m] for m in METHODS},
                         concurrency_gain=round(fit["recoverssm"] / max(fit["snapshot"], 1), 3),
                         budget_gib=round(budget / GiB, 1)))
    return rows


# ------------------------------------------------------------------------------------------------
# targets (reported, not asserted)
# ------------------------------------------------------------------------------------------------
#: (target, threshold, the row field it reads, which rows it covers): speedups over the timed
#: cases, the concurrency gain over the memory rows
def _qwen_n64(state: str, T: int):
    return lambda r: r["geometry"] == QWEN3_NEXT.name and r["state"] == state and r["T"] == T and r["N"] >= 64


TARGETS = (
    ("speedup >= 0.97x at every N and T", 0.97, "speedup", lambda r: True),
    ("speedup >= 1.4x at T = 4, N >= 64", 1.4, "speedup", lambda r: r["T"] == 4 and r["N"] >= 64),
    ("speedup >= 1.8x at T = 8, N >= 64", 1.8, "speedup", lambda r: r["T"] == 8 and r["N"] >= 64),
    ("speedup >= 1.2x at T = 4, N = 8, fp32 state", 1.2, "speedup",
     lambda r: r["T"] == 4 and r["N"] == 8 and r["state"] == "fp32"),
    ("speedup >= 1.2x at T = 4, N = 8, bf16 state", 1.2, "speedup",
     lambda r: r["T"] == 4 and r["N"] == 8 and r["state"] == "bf16"),
    ("deferred speedup >= 1.0x at every N, T and dtype", 1.0, "deferred_speedup", lambda r: True),
    *((f"deferred speedup >= {x}x, Qwen3-Next, {state}, T = {T}, N >= 64", x, "deferred_speedup",
       _qwen_n64(state, T))
      for state, targets in (("fp32", ((2, 1.5), (4, 2.2), (8, 3.0))), ("bf16", ((2, 1.3), (4, 1.6), (8, 2.0))))
      for T, x in targets),
    ("concurrent requests >= 3x at T = 4", 3.0, "concurrency_gain", lambda r: r["T"] == 4),
)


def evaluate_targets(cases: Sequence[dict], memory: Sequence[dict]) -> list[dict]:
    """Each target's worst value over the rows it covers (speedups: the cases where both methods
    were timed), the row it comes from, and whether it is met (None: nothing measured)."""
    out = []
    for label, threshold, key, select in TARGETS:
        rows = [r for r in (memory if key == "concurrency_gain" else cases)
                if r.get(key) is not None and select(r)]
        worst = min(rows, key=lambda r: r[key], default=None)
        out.append(dict(target=label, threshold=threshold, rows=len(rows),
                        measured=None if worst is None else worst[key],
                        worst=None if worst is None else _row_label(worst),
                        met=None if worst is None else worst[key] >= threshold))
    checked = [r for r in cases if r.get("check") in ("bit-exact", "MISMATCH")]
    bad = [r for r in checked if r["check"] == "MISMATCH"]
    out.append(dict(target="commit of n == deferred + flush == snapshot of position n - 1, bit for bit",
                    threshold=None,
                    rows=len(checked), measured=f"{len(checked) - len(bad)} of {len(checked)} cases",
                    worst=_row_label(bad[0]) if bad else None, met=None if not checked else not bad))
    return out


def _row_label(r: dict) -> str:
    n = f" N={r['N']}" if "N" in r else ""
    return f"{r['geometry']} TP={r['tp']} {r['state']}{n} T={r['T']}"


# ------------------------------------------------------------------------------------------------
# timing (CUDA only)
# ------------------------------------------------------------------------------------------------
def graph_us(steps: Sequence[Step], iters: int) -> float:
    """Device time of one step: every copy's step captured once, back to back, in ONE CUDA graph;
    the median replay divided by the steps in it. Each step must have run eagerly before (Triton
    compiled, the commit's tables uploaded)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    us = median_us([graph.replay], warmup=1, iters=iters, graph=False) / len(steps)
    del graph
    return us


def eager_us(steps: Sequence[Step], iters: int = EAGER_ITERS) -> float:
    """Time of one step launched eagerly (CUDA events around the Python that launches it, so the
    host time shows wherever it exceeds the kernels'), rotating through the copies."""
    return median_us(steps, warmup=1, iters=iters, graph=False)


def graph_iters(expected_us: float, copies: int) -> int:
    """Replays for a graph timing of about :data:`GRAPH_TARGET_US` of device time, within
    :data:`GRAPH_ITERS`: large steps are stable in few replays, small ones get more."""
    lo, hi = GRAPH_ITERS
    return max(lo, min(hi, math.ceil(GRAPH_TARGET_US / max(expected_us * copies, 1.0))))


def _free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def measure_method(case: Case, method: str, acts: Activations, copies: int, bytes_per_us: float,
                   fit_budget: int, keep_layers: Sequence[int], device="cuda",
                   backend: str = "cuda") -> tuple[dict, Optional[AcceptedStates]]:
    """Time ``method`` on ``case``: ``copies`` pool copies (rotated so L2 does not serve the
    states), the step run eagerly once on copy 0 (its accepted states kept for the check), then
    timed from one graph and eagerly. Returns the method's result (or why it was not run) and
    copy 0's accepted states (None when not run)."""
    need = copies * pool_bytes(case, method)
    if need > fit_budget:
        return dict(status=f"does not fit: {need / GiB:.1f} GiB of pools > {fit_budget / GiB:.1f} GiB"), None
    traffic = traffic_bytes(case, method, int(acts.num_accepted.sum()))
    expected = traffic / bytes_per_us + launches_per_step(case.shard, method) * LAUNCH_US
    pools = steps = None
    try:
        pools = [make_pools(case, method, device) for _ in range(copies)]
        steps = [make_step(case, method, acts, p, backend) for p in pools]
        steps[0]()
        settle(steps[0])
        states = accepted_states(case, method, acts, pools[0], keep_layers)
        for step in steps:           # a deferred step then has its step before pending (steady state)
            step()
        result = dict(status="ok", us=round(graph_us(steps, graph_iters(expected, copies)), 2),
                      eager_us=round(eager_us(steps), 2))
    except torch.cuda.OutOfMemoryError:
        return dict(status=f"does not fit: out of device memory ({need / GiB:.1f} GiB of pools)"), None
    finally:
        del pools, steps
        _free_device_memory()
    result.update(floor_us=round(traffic / bytes_per_us, 2), traffic_bytes=traffic, pool_bytes=need)
    return result, states


def _row(case: Case, **fields) -> dict:
    return dict(geometry=case.geometry.name, kind=case.shard.kind, tp=case.tp, state=DTYPE_NAMES[case.state_dtype],
                N=case.N, T=case.T, layers=case.shard.layers, **fields)


def bench_case(case: Case, bytes_per_us: float, fit_budget: int, device="cuda", backend: str = "cuda") -> dict:
    """Both methods on one case from the same activations, their accepted states compared (first
    and last layer), and the speedups (snapshot time / RecoverSSM time). ``case_s``: the wall time
    of the whole case (building, Triton compiles, checks, timings), for the suite's budget."""
    start = time.perf_counter()
    acts = make_activations(case, device)
    copies = copies_for(pool_bytes(case, "recoverssm"))
    budget = fit_budget - activation_bytes(case)
    row = _row(case, copies=copies)
    states = {}
    for method in METHODS:
        row[method], states[method] = measure_method(case, method, acts, copies, bytes_per_us, budget,
                                                     (0, case.shard.layers - 1), device, backend)
    del acts
    _free_device_memory()
    measured = [states[m] for m in METHODS if states[m] is not None]
    row["check"] = ("n/a" if len(measured) < 2 else
                    "bit-exact" if all(states_agree(measured[0], other) for other in measured[1:]) else "MISMATCH")
    for method, key in (("recoverssm", "speedup"), ("deferred", "deferred_speedup")):
        if row[method]["status"] == "ok" and row["snapshot"]["status"] == "ok":
            row[key] = round(row["snapshot"]["us"] / row[method]["us"], 3)
            row["eager_" + key] = round(row["snapshot"]["eager_us"] / row[method]["eager_us"], 3)
    row["case_s"] = round(time.perf_counter() - start, 2)
    return row


def run_cases(cases: Sequence[Case], bytes_per_us: float, fit_budget: int, progress: ProgressBar,
              time_limit_s: float, device="cuda", backend: str = "cuda") -> list[dict]:
    """:func:`bench_case` of each case in turn; once ``time_limit_s`` has passed the rest are
    reported as not run. Prints a line as each (geometry, TP, state dtype) group finishes."""
    start = group_start = time.perf_counter()
    rows = []
    for i, case in enumerate(cases):
        if time.perf_counter() - start > time_limit_s:
            why = f"not run: suite time limit ({time_limit_s:.0f} s) reached"
            rows.append(_row(case, check="n/a", **{m: dict(status=why) for m in METHODS}))
        else:
            rows.append(bench_case(case, bytes_per_us, fit_budget, device, backend))
        progress.update(1, case.label)
        if i + 1 == len(cases) or _group(cases[i + 1]) != _group(case):
            now = time.perf_counter()
            progress.print(f"model: {_group(case)} done in {now - group_start:.1f} s (suite {now - start:.1f} s)")
            group_start = now
    return rows


def _group(case: Case) -> str:
    return f"{case.geometry.name} TP={case.tp} {DTYPE_NAMES[case.state_dtype]}"


def fit_budget_bytes() -> int:
    """Device memory the suite gives a method's pools: :data:`POOL_BUDGET_BYTES`, or what is
    free less :data:`DEVICE_MARGIN_BYTES` on a smaller device."""
    _free_device_memory()
    free, _ = torch.cuda.mem_get_info()
    return min(POOL_BUDGET_BYTES, free - DEVICE_MARGIN_BYTES)


def summarize(rows: Sequence[dict], cases: Sequence[Case], fit_budget: int, bytes_per_us: float,
              time_limit_s: float, elapsed_s: float) -> dict:
    """The suite's JSON: the settings, the case rows, the memory rows and the targets."""
    memory = memory_rows(cases)
    return dict(pool_budget_gib=round(fit_budget / GiB, 1), concurrency_budget_gib=CONCURRENCY_BUDGET_BYTES // GiB,
                copy_tbps=round(bytes_per_us / 1e6, 3), time_limit_s=time_limit_s, elapsed_s=round(elapsed_s, 1),
                cases=list(rows), memory=memory, targets=evaluate_targets(rows, memory))


def bench_model(ceiling: CopyCeiling, quick: bool, progress: ProgressBar,
                time_limit_s: Optional[float] = None, geometries: Sequence[str] = ()) -> dict:
    """The model suite on the CUDA GPU: every case of :func:`grid` (time limit: ``time_limit_s``,
    default :data:`TIME_LIMIT_S`), the memory rows, the targets."""
    limit = TIME_LIMIT_S[quick] if time_limit_s is None else time_limit_s
    bytes_per_us = ceiling.tbps(GiB) * 1e6
    budget = fit_budget_bytes()
    cases = grid(quick, geometries)
    start = time.perf_counter()
    rows = run_cases(cases, bytes_per_us, budget, progress, limit)
    return summarize(rows, cases, budget, bytes_per_us, limit, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------
# output: tables, targets, plot
# ------------------------------------------------------------------------------------------------
def _method_cells(m: dict) -> list:
    """Graph us, eager us, floor us of one method, or its status in place of the times."""
    if m.get("status") != "ok":      # the reason in short ("does not fit", "not run"); the JSON has it whole
        return [m.get("status", "-").split(":")[0], "", ""]
    return [m["us"], m["eager_us"], m["floor_us"]]


def case_table(rows: Sequence[dict]) -> list[str]:
    headers = ["geometry", "TP", "state", "N", "T", "ours us", "ours eager", "ours floor", "defer us",
               "defer eager", "defer floor", "snap us", "snap eager", "snap floor", "speedup", "deferred x",
               "eager x", "deferred eager x", "check"]
    cells = [[r["geometry"], r["tp"], r["state"], r["N"], r["T"], *_method_cells(r["recoverssm"]),
              *_method_cells(r.get("deferred", {})), *_method_cells(r["snapshot"]), r.get("speedup", "-"),
              r.get("deferred_speedup", "-"), r.get("eager_speedup", "-"), r.get("eager_deferred_speedup", "-"),
              r["check"]] for r in rows]
    return format_table(headers, cells, align="<><>>" + ">" * 13 + "<")


def memory_table(rows: Sequence[dict]) -> list[str]:
    headers = ["geometry", "TP", "state", "T", "ours MiB/req", "defer MiB/req", "snap MiB/req", "ours max req",
               "defer max req", "snap max req", "gain"]
    cells = [[r["geometry"], r["tp"], r["state"], r["T"], round(r["recoverssm_bytes_per_request"] / 2**20, 2),
              round(r["deferred_bytes_per_request"] / 2**20, 2), round(r["snapshot_bytes_per_request"] / 2**20, 2),
              r["recoverssm_max_requests"], r["deferred_max_requests"], r["snapshot_max_requests"],
              r["concurrency_gain"]] for r in rows]
    return format_table(headers, cells, align="<><>>>>>>>>")


def targets_table(targets: Sequence[dict]) -> list[str]:
    verdict = {True: "met", False: "NOT MET", None: "not measured"}
    cells = [[t["target"], "-" if t["measured"] is None else t["measured"], t["worst"] or "-", verdict[t["met"]]]
             for t in targets]
    return format_table(["target", "measured (worst)", "worst case", "status"], cells, align="<><<")


def render(model: dict) -> list[str]:
    """The suite's printout: the step table, the memory table and the targets."""
    lines = [f"model: one speculative decode step of all recurrent layers, per TP rank; times in us "
             f"(graph replay, eager launch, copy-bandwidth floor at {model['copy_tbps']} TB/s); "
             f"speedup = snapshot / RecoverSSM (deferred x: snapshot / RecoverSSM with deferred commits); "
             f"pools limited to {model['pool_budget_gib']} GiB; {model['elapsed_s']} s"]
    lines += case_table(model["cases"])
    lines += ["", f"model memory: recurrent caches per request over all layers (state + conv, + records "
                  f"for RecoverSSM), requests fitting {model['concurrency_budget_gib']} GiB"]
    lines += memory_table(model["memory"])
    lines += ["", "model targets (reported, not asserted)"]
    lines += targets_table(model["targets"])
    return lines


def plot(model: dict, path: str, title: str) -> None:
    """``path``: step time against N, one row of panels per geometry (its smallest TP measured),
    one panel per T; both methods per state dtype, with each method's copy-bandwidth floor."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in model["cases"] if any(r[m].get("status") == "ok" for m in METHODS)]
    geometries = list(dict.fromkeys(r["geometry"] for r in rows))
    Ts = sorted({r["T"] for r in rows})
    Ns_all = sorted({r["N"] for r in rows})
    if not rows:
        return
    fig, axes = plt.subplots(len(geometries), len(Ts), figsize=(5 * len(Ts), 4 * len(geometries)), squeeze=False)
    colors = {"recoverssm": "tab:blue", "deferred": "tab:green", "snapshot": "tab:red"}
    styles = {"fp32": "-", "bf16": "--"}
    for gi, geometry in enumerate(geometries):
        tp = min(r["tp"] for r in rows if r["geometry"] == geometry)
        for ti, T in enumerate(Ts):
            ax = axes[gi][ti]
            for state, style in styles.items():
                sel = sorted((r for r in rows if r["geometry"] == geometry and r["tp"] == tp and r["T"] == T
                              and r["state"] == state), key=lambda r: r["N"])
                for method in METHODS:
                    pts = [(r["N"], r[method]) for r in sel if r[method].get("status") == "ok"]
                    if not pts:
                        continue
                    Ns = [n for n, _ in pts]
                    ax.plot(Ns, [m["us"] for _, m in pts], style, marker="o", ms=3, color=colors[method],
                            label=f"{method} {state}")
                    ax.plot(Ns, [m["floor_us"] for _, m in pts], style, lw=0.8, alpha=0.5, color=colors[method],
                            label=f"{method} {state} copy floor")
            ax.set_xscale("log", base=2)
            ax.set_xticks(Ns_all, [str(n) for n in Ns_all])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_yscale("log")
            ax.set_title(f"{geometry} TP={tp}, T = {T}", fontsize=9)
            ax.set_xlabel("requests N")
            ax.set_ylabel("step time (us)")
            ax.grid(True, which="both", lw=0.3)
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
