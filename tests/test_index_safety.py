"""Index safety: the index rule and the value checks, as bounded property tests (hypothesis).

Every index an op reads from a tensor (``state_indices``, ``snapshot_slots``, block-table
entries, ``request_indices``) is padding (``<= null_slot``), an index, or anything else; anything
else is refused with a ``ValueError`` naming the argument wherever value checks run, and is
padding to every kernel. ``num_accepted`` and ``query_start_loc`` are checked likewise, and
clamped by the kernels. Two kinds of properties, each over random ragged, padded and align-mode
batches with adversarial values (the whole int32 range, values between ``null_slot`` and 0,
values past the pool, duplicates, decreasing or out-of-range ``query_start_loc``, ...):

* **public API** (value checks on, CPU tensors): the call succeeds exactly when every value is
  legal (by an oracle written from the rule, ``safety_problems.py``); otherwise it raises a
  ``ValueError`` whose message starts with the op and names an offending argument, and every
  tensor is bit-for-bit unchanged;
* **kernel-facing functions** (``rs.get_backend(name).recurrence`` etc., no checks): the padding
  semantics, with every byte outside the writes the rule allows unchanged (pools with guard
  slots, outputs and records inside sentinel-filled buffers), padding rows' outputs zero, tokens
  outside every row untouched, and the ``cuda`` backend (Triton's interpreter on CPU tensors)
  equal to ``cpu_ref`` on the same inputs wherever the result is determined: states, records
  and outputs within fp32 tolerance (rel 1e-4, plus one rounding step for bf16 storage), commits
  and conv states bit-exact.

Both run for ``cpu_ref`` and for ``cuda`` (interpreter; marked ``interpreter``). Hypothesis is
derandomized, so CI runs the same examples every time (``RECOVERSSM_SAFETY_EXAMPLES=<factor>``
searches fresh ones, more of them). Explicit regression cases at the end: among them, block-table
entries between ``null_slot`` and 0 or equal to ``INT32_MAX`` that the plan reads, and a
misaligned ``out`` whose tokens outside every row must keep their values.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import recoverssm as rs  # noqa: E402
from recoverssm.core.backend import CommitLayer, GateInputs, GroupStep, RecurrenceCall  # noqa: E402
from recoverssm.core.indices import INT32_MAX, INT32_MIN, is_slot  # noqa: E402
from safety_problems import (BF16, CHECK_FLAGS, F32, I32, NULL_SLOTS, OUT_SENTINEL, Dims,  # noqa: E402
                             GuardedFlat, GuardedOut, GuardedPool, Snapshot, Step, assert_close_rel,
                             assert_same_bits, clamped_rows, conflicts, conv_offenders, corrupted, draw_accepted,
                             draw_count, draw_dims, draw_pool_size, draw_qsl, draw_slots, draw_slots_like,
                             expect_outcome, i32, make_gates, plan_writes, recurrence_offenders, same_bits,
                             step_offenders, token_cover, output_rows)

CUDA = pytest.param("cuda", marks=pytest.mark.interpreter)
BACKENDS = ["cpu_ref", CUDA]

#: Examples per property: (cpu_ref, cuda under the interpreter). The interpreter runs a kernel
#: program in Python (tens of ms per program and token), so its budgets are smaller.
EXAMPLES = {
    "recurrence_kernels": (80, 32),
    "recurrence_api": (80, 24),
    "conv_kernels": (120, 60),
    "conv_api": (120, 50),
    "plan_kernels": (300, 300),
    "plan_api": (300, 200),
    "commit_kernels": (120, 60),
    "commit_api": (120, 40),
}


#: ``RECOVERSSM_SAFETY_EXAMPLES=<factor>``: scale every budget and draw fresh random examples
#: (a longer local search; CI leaves it unset and runs the same examples every time).
EXPLORE = float(os.environ.get("RECOVERSSM_SAFETY_EXAMPLES", "0") or 0)


def run_property(body, name: str, backend: str, shrink: Optional[bool] = None) -> None:
    """Run ``body(draw)`` as a derandomized hypothesis property (no example database, no
    deadline), with the example budget of ``name`` for ``backend``. A failing example is shrunk
    for ``cpu_ref`` only (unless ``shrink`` says otherwise): shrinking through the interpreter
    would take minutes, and the failing example is printed either way."""
    n = EXAMPLES[name][0 if backend == "cpu_ref" else 1]
    n = max(1, round(n * EXPLORE)) if EXPLORE else n
    shrink = backend == "cpu_ref" if shrink is None else shrink

    @settings(max_examples=n, deadline=None, derandomize=not EXPLORE, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else []))
    @given(data=st.data())
    def prop(data):
        body(data.draw)

    prop()


def backend(name: str):
    return rs.get_backend(name)


@dataclass(frozen=True)
class OpFamily:
    """How the tests drive one family of ops (the recurrence, the short conv, the commit): fresh
    output buffers for a case, the kernel-facing call, the public-API call, the padding checks of
    one run (returning what ``compare`` needs) and the comparison of a run against cpu_ref's."""

    new_run: Callable
    call_kernel: Callable
    call_api: Callable
    check_run: Callable
    compare: Callable
    api_name: Callable        # case -> the name the API's errors start with


def kernels_follow_padding(fam: OpFamily, c, name: str) -> list:
    """cpu_ref's kernel-facing call and ``name``'s follow the padding semantics, ``name``'s run
    equals cpu_ref's, and no input changes. Returns cpu_ref's ``check_run`` result."""
    inputs = Snapshot(c.inputs())
    ref = fam.new_run(c)
    fam.call_kernel(c, ref, "cpu_ref")
    single = fam.check_run(c, ref, "cpu_ref")
    run = fam.new_run(c)
    fam.call_kernel(c, run, name)
    fam.check_run(c, run, name)
    fam.compare(c, run, ref, single)
    inputs.assert_unchanged("an input changed: ")
    return single


def api_follows_the_rule(fam: OpFamily, c, name: str, offenders: set, check: Optional[bool]) -> None:
    """The API refuses the case naming one of ``offenders`` and writes nothing, or (none) accepts
    it and writes what the backend's kernel-facing call writes."""
    run = fam.new_run(c)
    everything = Snapshot({**c.inputs(), **run.buffers()})
    op = fam.api_name(c)
    if not expect_outcome(lambda: fam.call_api(c, run, name, check), op, offenders, everything):
        return
    single = fam.check_run(c, run, f"{op}({name})")
    ref = fam.new_run(c)
    fam.call_kernel(c, ref, "cpu_ref")
    if name == "cpu_ref":
        for key, buf in run.buffers().items():
            assert_same_bits(buf, ref.buffers()[key], f"the API and the backend differ in {key}")
    else:
        fam.compare(c, run, ref, single)


def api_refuses(fam: OpFamily, c, name: str, culprit: str) -> None:
    """The API refuses the case with an error that starts with its name and ``culprit``, having
    written nothing."""
    run = fam.new_run(c)
    everything = Snapshot({**c.inputs(), **run.buffers()})
    op = fam.api_name(c)
    with pytest.raises(ValueError) as err:
        fam.call_api(c, run, name)
    assert str(err.value).startswith(f"{op}: {culprit} "), str(err.value)
    everything.assert_unchanged(f"{op} raised, but wrote ")


# ================================================================================================
# the recurrence: verify, decode, snapshot (GDN and KDA)
# ================================================================================================
RECURRENCE_OPS = {("gdn", "verify"): "gdn_verify", ("gdn", "decode"): "gdn_decode",
                  ("gdn", "snapshot"): "gdn_spec_decode_snapshot", ("kda", "verify"): "kda_verify",
                  ("kda", "decode"): "kda_decode", ("kda", "snapshot"): "kda_spec_decode_snapshot",
                  ("mamba2", "verify"): "mamba2_verify", ("mamba2", "decode"): "mamba2_decode",
                  ("mamba2", "snapshot"): "mamba2_spec_decode_snapshot"}


@dataclass
class RecurrenceCase:
    kind: str
    mode: str
    d: Dims
    T: int
    slots: list
    qsl: list
    null_slot: int
    num_slots: int
    window: Optional[int]          # the kernels' length clamp: records' window, snapshot width, none
    snaps: Optional[list]
    mb: int
    scale: Optional[float]
    l2: bool
    act_dtype: torch.dtype
    state_dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: object
    pool: GuardedPool

    def __post_init__(self):
        self.si = i32(self.slots)
        self.qsl_t = i32(self.qsl)
        self.snap_t = None if self.snaps is None else torch.tensor(self.snaps, dtype=I32).reshape(len(self.slots), -1)

    @property
    def op(self) -> str:
        return RECURRENCE_OPS[(self.kind, self.mode)]

    @property
    def B(self) -> int:
        return len(self.slots)

    def inputs(self) -> dict:
        return dict(q=self.q, k=self.k, v=self.v, state_indices=self.si, query_start_loc=self.qsl_t,
                    snapshot_slots=self.snap_t, **self.gates.tensors)

    def rows(self):
        return clamped_rows(self.qsl, self.T, self.window)

    def live(self) -> list:
        return [r for r, (_, n) in enumerate(self.rows()) if n > 0 and is_slot(self.slots[r], self.null_slot,
                                                                                 self.num_slots)]

    def written(self) -> tuple[set, bool]:
        """``(slots the rule lets this call write, whether two rows race on a slot)``."""
        rows, live = self.rows(), self.live()
        if self.mode == "verify":
            return set(), False
        if self.mode == "decode":
            writes = [(r, self.slots[r]) for r in live]
            return {s for _, s in writes}, conflicts(writes, [])
        writes = [(r, s) for r in live for s in self.snaps[r][:rows[r][1]]
                  if is_slot(s, self.null_slot, self.num_slots)]
        return {s for _, s in writes}, conflicts(writes, [(r, self.slots[r]) for r in live])


def draw_recurrence(draw, kind: str, mode: str, adversarial: Optional[bool] = None) -> RecurrenceCase:
    bad = corrupted(draw, ("qsl", "slots", "snaps"), adversarial)
    d = draw_dims(draw)
    B = draw(st.integers(1, 4))
    null_slot = draw(st.sampled_from(NULL_SLOTS))
    window = None if mode == "decode" else draw(st.integers(1, 3))
    qsl, T = draw_qsl(draw, B, window, bad["qsl"])
    per_row = window if mode == "snapshot" else 0
    N = draw_pool_size(draw, B * (1 + per_row))
    values = draw_slots(draw, B * (1 + per_row), N, null_slot, False)
    slots = draw_slots_like(draw, values[:B], N, null_slot, bad["slots"])
    snaps = ([draw_slots_like(draw, values[B + r * per_row:B + (r + 1) * per_row], N, null_slot, bad["snaps"])
              for r in range(B)] if mode == "snapshot" else None)
    act_dtype = draw(st.sampled_from([F32, F32, BF16]))
    state_dtype = draw(st.sampled_from([F32, F32, BF16]))
    precomputed = draw(st.booleans()) and kind != "mamba2"      # Mamba2 has one gate form
    lower_bound = draw(st.sampled_from([None, -4.0])) if kind == "kda" and not precomputed else None
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(T, d.H, d.K, generator=gen).to(act_dtype)
    k = torch.randn(T, d.H, d.K, generator=gen).to(act_dtype)
    v = torch.randn(T, d.HV, d.V, generator=gen).to(act_dtype)
    gates = make_gates(kind, T, d.HV, d.K, act_dtype, precomputed, lower_bound, gen)
    pool = GuardedPool(N, (d.HV, d.V, d.K), state_dtype, gen)
    return RecurrenceCase(kind, mode, d, T, slots, qsl, null_slot, N, window, snaps,
                          B + draw(st.integers(0, 1)), draw(st.sampled_from([None, 0.5])), draw(st.booleans()),
                          act_dtype, state_dtype, q, k, v, gates, pool)


class RecurrenceRun:
    """The buffers one call writes: a fresh copy of the pool, a guarded out, guarded records."""

    def __init__(self, c: RecurrenceCase):
        d = c.d
        self.pool = c.pool.clone()
        self.out = GuardedOut(c.T, (d.HV,), d.V, c.act_dtype)
        self.records = None
        if c.mode == "verify":
            mw = c.window
            decay = (c.mb, d.HV, mw, d.K) if c.kind == "kda" else (c.mb, d.HV, mw)
            self.records = [GuardedFlat((c.mb, d.HV, mw, d.V)), GuardedFlat((c.mb, d.H, mw, d.K)), GuardedFlat(decay)]

    def buffers(self) -> dict:
        d = {"state pool": self.pool.buf, "out buffer": self.out.buf}
        for name, r in zip(("records.correction", "records.key", "records.decay"), self.records or ()):
            d[name] = r.buf
        return d

    def record_views(self):
        return None if self.records is None else tuple(r.view for r in self.records)


def call_recurrence_kernel(c: RecurrenceCase, run: RecurrenceRun, name: str) -> None:
    if c.kind == "mamba2":       # q, k, v in the roles of C, B, x; no scale, no norm
        t = c.gates.tensors
        gates = GateInputs(a=t["dt"], dt_bias=t["dt_bias"], A_log=t["A_log"], D=t["D"], kind="mamba2")
        scale, l2 = 1.0, False
    else:
        gates = GateInputs(**c.gates.tensors, kind=c.kind, lower_bound=c.gates.lower_bound)
        scale, l2 = c.d.K ** -0.5 if c.scale is None else c.scale, c.l2
    backend(name).recurrence(RecurrenceCall(c.mode, c.q, c.k, c.v, run.pool.view, c.si, c.qsl_t, gates, scale, l2,
                                            c.null_slot, run.out.view, run.record_views(), c.snap_t))


def call_recurrence_api(c: RecurrenceCase, run: RecurrenceRun, name: str, check: Optional[bool] = None) -> None:
    kw = dict(state=run.pool.view, state_indices=c.si, query_start_loc=c.qsl_t, null_slot=c.null_slot,
              out=run.out.view, backend=name, check=check, **c.gates.tensors)
    if c.kind == "kda":
        kw["lower_bound"] = c.gates.lower_bound
    if c.mode == "verify":
        kw["records"] = rs.ReplayRecords(*run.record_views())
    if c.mode == "snapshot":
        kw["snapshot_slots"] = c.snap_t
    if c.kind == "mamba2":       # x, B, C, dt: the tensors in the roles of v, k, q
        getattr(rs, c.op)(c.v, c.k, c.q, kw.pop("dt"), **kw)
    else:
        getattr(rs, c.op)(c.q, c.k, c.v, scale=c.scale, use_qk_l2norm=c.l2, **kw)


def check_tokens(out: GuardedOut, rows, live: list, T: int, what: str) -> list:
    """Tokens outside every row untouched, tokens only padding rows hold zero, tokens of a live
    row written. Returns the tokens exactly one row holds."""
    out.assert_outside_untouched(what)
    before = out.initial[out.g:out.g + T, ..., :out.width]
    single = []
    for t, holders in enumerate(token_cover(rows, T)):
        now = out.view[t]
        if not holders:
            assert_same_bits(now, before[t], f"{what}: token {t}, outside every row,")
        elif not any(r in live for r in holders):
            assert bool((now == 0).all()), f"{what}: token {t} of a padding row is not zero"
        else:
            assert bool(torch.isfinite(now).all()) and not same_bits(now, before[t]), \
                f"{what}: token {t} of a live row was not written"
        if len(holders) == 1:
            single.append(t)
    return single


def check_recurrence_run(c: RecurrenceCase, run: RecurrenceRun, what: str) -> list:
    """The rule's promises on one call's buffers; returns the tokens held by exactly one row."""
    rows, live = c.rows(), c.live()
    allowed, _ = c.written()
    run.pool.assert_only_slots_written(allowed, f"{what} state")
    single = check_tokens(run.out, output_rows(c.qsl, c.T, c.window, live, c.B), live, c.T, f"{what} out")
    if run.records is not None:
        lengths = {r: rows[r][1] for r in live}
        for buf, name in zip(run.records, ("correction", "key", "decay")):
            buf.assert_guards(f"{what} records.{name}")
            now, before = buf.view, buf.initial_view
            for r in range(c.mb):
                for t in range(c.window):
                    if t < lengths.get(r, 0):
                        assert bool(torch.isfinite(now[r, :, t]).all()), \
                            f"{what}: records.{name}[{r}, :, {t}] not written"
                    else:
                        assert_same_bits(now[r, :, t], before[r, :, t], f"{what}: records.{name}[{r}, :, {t}] "
                                                                          "(padding row or past the row's window)")
    return single


def compare_recurrence(c: RecurrenceCase, run: RecurrenceRun, ref: RecurrenceRun, single: list) -> None:
    """``run`` against ``cpu_ref``'s ``ref`` where the result is determined (no two rows racing
    on a slot; tokens held by one row only)."""
    _, racy = c.written()
    if racy:
        return
    assert_close_rel(run.pool.view.float(), ref.pool.view.float(), "state", ulp_bf16=c.state_dtype == BF16)
    if single:
        idx = torch.tensor(single)
        assert_close_rel(run.out.view[idx].float(), ref.out.view[idx].float(), "out", ulp_bf16=c.act_dtype == BF16)
    for a, b, name in zip(run.records or (), ref.records or (), ("correction", "key", "decay")):
        assert_close_rel(a.view, b.view, f"records.{name}")


RECURRENCE = OpFamily(RecurrenceRun, call_recurrence_kernel, call_recurrence_api, check_recurrence_run,
                      compare_recurrence, lambda c: c.op)


RECURRENCE_KERNEL_CASES = [("gdn", "verify"), ("gdn", "decode"), ("gdn", "snapshot"), ("kda", "verify"),
                           ("kda", "snapshot"), ("mamba2", "verify"), ("mamba2", "decode"), ("mamba2", "snapshot")]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind,mode", RECURRENCE_KERNEL_CASES)
def test_recurrence_kernels_treat_bad_indices_as_padding(name, kind, mode):
    def body(draw):
        kernels_follow_padding(RECURRENCE, draw_recurrence(draw, kind, mode), name)

    run_property(body, "recurrence_kernels", name)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind,mode", [("gdn", "verify"), ("gdn", "decode"), ("gdn", "snapshot"), ("kda", "verify"),
                                       ("mamba2", "verify"), ("mamba2", "snapshot")])
def test_recurrence_api_refuses_bad_values_and_writes_nothing(name, kind, mode):
    def body(draw):
        c = draw_recurrence(draw, kind, mode)
        bad = recurrence_offenders(c.mode, c.slots, c.qsl, c.T, c.num_slots, c.null_slot, c.window, c.snaps)
        api_follows_the_rule(RECURRENCE, c, name, bad, draw(st.sampled_from(CHECK_FLAGS)))

    run_property(body, "recurrence_api", name)


# ================================================================================================
# the short conv: conv_verify, conv_decode
# ================================================================================================
@dataclass
class ConvCase:
    mode: str
    slots: list
    qsl: Optional[list]
    T: int
    null_slot: int
    num_slots: int
    width: int
    window: Optional[int]         # conv_verify: columns after the history; conv_decode: None
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    silu: bool
    pool: GuardedPool

    def __post_init__(self):
        self.si = i32(self.slots)
        self.qsl_t = None if self.qsl is None else i32(self.qsl)

    @property
    def op(self) -> str:
        return f"conv_{self.mode}"

    @property
    def history(self) -> int:
        return self.width - 1

    def inputs(self) -> dict:
        return dict(x=self.x, weight=self.weight, bias=self.bias, state_indices=self.si, query_start_loc=self.qsl_t)

    def rows(self):
        if self.qsl is None:
            return [(r, 1) for r in range(len(self.slots))]
        return clamped_rows(self.qsl, self.T, self.window)

    def live(self) -> list:
        return [r for r, (_, n) in enumerate(self.rows()) if n > 0 and is_slot(self.slots[r], self.null_slot,
                                                                                 self.num_slots)]

    def written(self) -> tuple[dict, set]:
        """``(slot -> the part of it that must stay unchanged, rows whose slot another live row
        also writes)``: verify writes window columns ``[history, history + len)``, decode the
        history columns."""
        rows, live, h = self.rows(), self.live(), self.history
        by_slot: dict = {}
        for r in live:
            by_slot.setdefault(self.slots[r], []).append(r)
        allowed = {}
        for s, rs_ in by_slot.items():
            if self.mode == "verify":
                m = max(rows[r][1] for r in rs_)
                allowed[s] = lambda x, m=m: torch.cat([x[:, :h], x[:, h + m:]], dim=1)
            else:
                allowed[s] = lambda x: x[:, h:]
        racy = {r for rs_ in by_slot.values() if len(rs_) > 1 for r in rs_}
        return allowed, racy


def draw_conv(draw, mode: str) -> ConvCase:
    bad = corrupted(draw, ("qsl", "slots"))
    B = draw(st.integers(1, 5))
    null_slot = draw(st.sampled_from(NULL_SLOTS))
    N = draw_pool_size(draw, B)
    dim = draw(st.sampled_from([3, 8, 12]))
    width = draw(st.integers(1, 4))
    if mode == "verify":
        window = draw(st.integers(1, 4))
        cols = width - 1 + window
        qsl, T = draw_qsl(draw, B, window, bad["qsl"])
    else:
        window, qsl, T = None, None, B
        cols = max(width - 1 + draw(st.integers(0, 2)), 1)
    slots = draw_slots(draw, B, N, null_slot, bad["slots"])
    x_dtype = draw(st.sampled_from([F32, F32, BF16]))
    conv_dtype = draw(st.sampled_from([F32, BF16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(T, dim, generator=gen).to(x_dtype)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen) if draw(st.booleans()) else None
    pool = GuardedPool(N, (dim, cols), conv_dtype, gen, scale=1.0)
    return ConvCase(mode, slots, qsl, T, null_slot, N, width, window, x, weight, bias, draw(st.booleans()), pool)


class ConvRun:
    def __init__(self, c: ConvCase):
        self.pool = c.pool.clone()
        self.out = GuardedOut(c.T, (), c.x.shape[1], c.x.dtype)

    def buffers(self) -> dict:
        return {"conv_state pool": self.pool.buf, "out buffer": self.out.buf}


def call_conv_kernel(c: ConvCase, run: ConvRun, name: str) -> None:
    be = backend(name)
    if c.mode == "verify":
        be.conv_verify(c.x, run.pool.view, c.weight, c.bias, c.si, c.qsl_t, c.silu, 1, c.null_slot, run.out.view)
    else:
        be.conv_decode(c.x, run.pool.view, c.weight, c.bias, c.si, c.silu, 1, c.null_slot, run.out.view)


def call_conv_api(c: ConvCase, run: ConvRun, name: str, check: Optional[bool] = None) -> None:
    kw = dict(state_indices=c.si, activation="silu" if c.silu else None, null_slot=c.null_slot, out=run.out.view,
              backend=name, check=check)
    if c.mode == "verify":
        rs.conv_verify(c.x, run.pool.view, c.weight, c.bias, query_start_loc=c.qsl_t, **kw)
    else:
        rs.conv_decode(c.x, run.pool.view, c.weight, c.bias, **kw)


def check_conv_run(c: ConvCase, run: ConvRun, what: str) -> list:
    allowed, _ = c.written()
    run.pool.assert_only_slots_written(allowed, f"{what} conv_state")
    live = c.live()
    return check_tokens(run.out, output_rows(c.qsl, c.T, c.window, live, len(c.slots)), live, c.T, f"{what} out")


def compare_conv(c: ConvCase, run: ConvRun, ref: ConvRun, single: list) -> None:
    """Conv states bit-exact (copies of inputs) in slots one row writes; outputs of tokens one
    row holds (decode: whose slot no other row writes) within fp32 tolerance."""
    allowed, racy = c.written()
    racy_slots = {c.slots[r] for r in racy}
    for s in range(c.num_slots):
        if s not in racy_slots:
            assert_same_bits(run.pool.view[s], ref.pool.view[s], f"conv_state slot {s} differs from cpu_ref")
    if c.mode == "verify":
        tokens = single
    else:
        tokens = [r for r in range(len(c.slots)) if r not in racy]
    if tokens:
        idx = torch.tensor(tokens)
        assert_close_rel(run.out.view[idx].float(), ref.out.view[idx].float(), "conv out", ulp_bf16=c.x.dtype == BF16)


CONV = OpFamily(ConvRun, call_conv_kernel, call_conv_api, check_conv_run, compare_conv, lambda c: c.op)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", ["verify", "decode"])
def test_conv_kernels_treat_bad_indices_as_padding(name, mode):
    def body(draw):
        kernels_follow_padding(CONV, draw_conv(draw, mode), name)

    run_property(body, "conv_kernels", name)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", ["verify", "decode"])
def test_conv_api_refuses_bad_values_and_writes_nothing(name, mode):
    def body(draw):
        c = draw_conv(draw, mode)
        bad = conv_offenders(c.slots, c.qsl, c.T, c.num_slots, c.null_slot, c.window or 0)
        api_follows_the_rule(CONV, c, name, bad, draw(st.sampled_from(CHECK_FLAGS)))

    run_property(body, "conv_api", name)


# ================================================================================================
# the commit plan and the grouped commit
# ================================================================================================
BLOCK_SIZES = (1, 2, 4, 16, 2**30, 2**30)


def draw_request(draw, R: int, adversarial: bool) -> int:
    if adversarial and draw(st.booleans()):
        return draw(st.one_of(st.sampled_from([-1, R, INT32_MIN, INT32_MAX]), st.integers(INT32_MIN, INT32_MAX)))
    return draw(st.integers(0, R - 1))


def draw_computed(draw, block_size: int, adversarial: bool) -> int:
    """``num_computed_tokens``: a few blocks, or (adversarial) negative, near 2^31, any int32."""
    if adversarial and draw(st.booleans()):
        return draw(st.one_of(st.sampled_from([-1, INT32_MIN, INT32_MAX, 2**31 - 2, 2**31 - 1 - block_size]),
                              st.integers(INT32_MIN, INT32_MAX)))
    if block_size >= 2**30:   # near 2^31: num_computed_tokens + n passes the int32 range
        return draw(st.sampled_from([0, 2**30 - 1, 2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1]))
    # mostly just before a block boundary, so that rows cross it
    near = sorted({max(0, x) for x in (block_size - 1, block_size - 2, 2 * block_size - 1, 2 * block_size - 3)})
    return draw(st.one_of(st.sampled_from(near), st.integers(0, 2 * block_size)))


MAX_ROW = 4   # the longest row of a commit step (tokens)


@dataclass
class StepLayout:
    """The shape of one group's step, drawn before its values: rows, requests, align mode."""
    B: int
    R: int
    align: bool
    use_requests: bool
    block_size: Optional[int] = None
    computed: Optional[list] = None
    width: int = 0

    @property
    def indices(self) -> int:
        """Slot indices the step holds: sources and block-table entries."""
        return self.B + self.R * self.width


def draw_layout(draw, B: int, R: int, bad: dict, align: bool, use_requests: bool) -> StepLayout:
    if not align:
        return StepLayout(B, R, False, use_requests)
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    computed = [draw_computed(draw, block_size, bad["computed"]) for _ in range(R)]
    # wide enough for the longest row, give or take a column (too narrow is a refusal)
    needed = max([(n + MAX_ROW - 1) // block_size + 1 for n in computed if 0 <= n <= 2**31 - 1] or [1])
    width = max(1, min(needed + draw(st.integers(-1, 1)), 8))
    return StepLayout(B, R, True, use_requests, block_size, computed, width)


def draw_step(draw, lay: StepLayout, num_slots: int, null_slot: int, bad: dict, block_entries_bad: bool) -> Step:
    """One group's step. Sources and block-table entries are drawn together (distinct where the
    pool has room). ``bad``: which fields get adversarial values; ``block_entries_bad``: whether
    block-table entries may be values between ``null_slot`` and 0 or ``INT32_MAX`` (the known
    bug of ``test_block_table_entries_that_are_not_slots_are_refused``); otherwise bad entries are
    just past the pool."""
    values = draw_slots(draw, lay.indices, num_slots, null_slot, False)
    slots = draw_slots_like(draw, values[:lay.B], num_slots, null_slot, bad["slots"])
    req = [draw_request(draw, lay.R, bad["requests"]) for _ in range(lay.B)] if lay.use_requests else None
    if not lay.align:
        return Step(slots, req)
    table = [values[lay.B + q * lay.width:lay.B + (q + 1) * lay.width] for q in range(lay.R)]
    if bad["blocks"]:
        if block_entries_bad:
            table = [draw_slots_like(draw, row, num_slots, null_slot, True) for row in table]
        else:
            table = [[draw(st.integers(num_slots, num_slots + 1)) if draw(st.integers(0, 2)) == 0 else s for s in row]
                     for row in table]
    return Step(slots, req, table, lay.computed, lay.block_size)


def draw_accepted_for(draw, steps: list, qsl: list, R: int, adversarial: bool) -> list:
    """``num_accepted``: within every window of the request's rows (in every group), mostly at
    least 1, or (adversarial) anything."""
    if adversarial:
        return draw_accepted(draw, R, True)
    top = [MAX_ROW] * R
    for step in steps:
        req = step.request_indices or list(range(len(step.state_indices)))
        for r, q in enumerate(req):
            if 0 <= q < R:
                top[q] = max(0, min(top[q], qsl[r + 1] - qsl[r]))
    return [draw_count(draw, t) for t in top]


@dataclass
class PlanCase:
    accepted: list
    qsl: list
    step: Step
    null_slot: int
    num_slots: Optional[int]      # None: plan_commit's default (every int32 slot below INT32_MAX)

    def __post_init__(self):
        self.acc_t = i32(self.accepted)
        self.qsl_t = i32(self.qsl)
        self.t = self.step.tensors()

    def inputs(self) -> dict:
        return dict(num_accepted=self.acc_t, query_start_loc=self.qsl_t, **self.t)

    def expected(self) -> list:
        return self.step.plan(self.accepted, self.qsl, self.null_slot,
                              INT32_MAX if self.num_slots is None else self.num_slots)


STEP_FIELDS = ("slots", "requests", "blocks", "computed", "accepted", "qsl")


def draw_plan(draw, block_entries_bad: bool = True, only: Optional[str] = None) -> PlanCase:
    bad = corrupted(draw, STEP_FIELDS, only=only)
    B = draw(st.integers(1, 5))
    use_requests = bad["requests"] or draw(st.booleans())
    R = draw(st.integers(1, 5)) if use_requests else B + draw(st.integers(0, 1))
    null_slot = draw(st.sampled_from(NULL_SLOTS))
    lay = draw_layout(draw, B, R, bad, bad["blocks"] or bad["computed"] or draw(st.booleans()), use_requests)
    num_slots = draw(st.one_of(st.none(), st.just(draw_pool_size(draw, lay.indices))))
    step = draw_step(draw, lay, num_slots if num_slots is not None else draw_pool_size(draw, lay.indices),
                     null_slot, bad, block_entries_bad)
    qsl, _ = draw_qsl(draw, B, None, bad["qsl"], max_len=MAX_ROW)
    accepted = draw_accepted_for(draw, [step], qsl, R, bad["accepted"])
    return PlanCase(accepted, qsl, step, null_slot, num_slots)


def plan_outputs(B: int) -> list:
    return [GuardedFlat((B,), I32, guard=4, fill=-123456) for _ in range(4)]


@pytest.mark.parametrize("name", BACKENDS)
def test_plan_kernels_follow_the_rule(name):
    """The plan of every row, whatever the values, equals the rule (``core/plan.py``) exactly;
    nothing outside the four outputs is written."""
    def body(draw):
        c = draw_plan(draw)
        inputs = Snapshot(c.inputs())
        outs = plan_outputs(len(c.step.state_indices))
        backend(name).plan_commit(c.acc_t, c.t["state_indices"], c.qsl_t, c.t["request_indices"], c.t["block_table"],
                                  c.t["num_computed_tokens"], c.step.block_size or 1, c.null_slot,
                                  INT32_MAX if c.num_slots is None else c.num_slots, tuple(o.view for o in outs))
        for o, column, what in zip(outs, zip(*c.expected()), ("commit_len", "final", "boundary", "boundary_len")):
            o.assert_guards(f"plan {what}")
            assert o.view.tolist() == list(column), f"plan {what}: {o.view.tolist()} != the rule's {list(column)}"
        inputs.assert_unchanged("an input changed: ")

    run_property(body, "plan_kernels", name)


#: (backend, whether block-table entries may be any int32). The twin with any int32 puts bad
#: values in the block tables only (every other value legal); the checks are backend-independent
#: code, so it runs for cpu_ref (the explicit regression cases cover both backends).
API_STEP_CASES = [pytest.param("cpu_ref", False, id="cpu_ref-entries-padding-slots-or-past-the-pool"),
                  pytest.param("cuda", False, id="cuda-entries-padding-slots-or-past-the-pool",
                               marks=pytest.mark.interpreter),
                  pytest.param("cpu_ref", True, id="cpu_ref-entries-any-int32")]


@pytest.mark.parametrize("name,any_entries", API_STEP_CASES)
def test_plan_api_refuses_bad_values(name, any_entries):
    def body(draw):
        c = draw_plan(draw, block_entries_bad=any_entries, only="blocks" if any_entries else None)
        bad = step_offenders(c.accepted, c.qsl, c.step, c.null_slot,
                             [INT32_MAX if c.num_slots is None else c.num_slots], None)
        result = {}
        check = draw(st.sampled_from(CHECK_FLAGS))

        def call():
            result["plan"] = rs.plan_commit(c.acc_t, c.t["state_indices"], c.qsl_t,
                                            request_indices=c.t["request_indices"], block_table=c.t["block_table"],
                                            num_computed_tokens=c.t["num_computed_tokens"],
                                            block_size=c.step.block_size, null_slot=c.null_slot,
                                            num_slots=c.num_slots, backend=name, check=check)

        if expect_outcome(call, "plan_commit", bad, Snapshot(c.inputs())):
            got = result["plan"].as_dict()
            for what, column in zip(("commit_len", "final_slot", "boundary_slot", "boundary_len"), zip(*c.expected())):
                assert got[what] == list(column), f"plan_commit {what}: {got[what]} != the rule's {list(column)}"

    run_property(body, "plan_api", name, shrink=False if any_entries else None)


@dataclass
class LayerSpec:
    group: int
    num_slots: int
    state_dtype: torch.dtype
    vector_decay: bool
    max_window: int
    conv_width: Optional[int]      # None: no conv state
    conv_dim: int
    conv_cols: int


@dataclass
class CommitCase:
    d: Dims
    layers: list
    steps: list                    # one Step per group
    accepted: list
    qsl: list
    null_slot: int
    max_batch: int
    pools: list                    # per layer: (state GuardedPool, conv GuardedPool or None)
    records: list                  # per layer: three GuardedFlat

    def __post_init__(self):
        self.acc_t = i32(self.accepted)
        self.qsl_t = i32(self.qsl)
        self.t = [s.tensors() for s in self.steps]

    def inputs(self) -> dict:
        d = {"num_accepted": self.acc_t, "query_start_loc": self.qsl_t}
        for g, t in enumerate(self.t):
            d.update({f"{n}[{g}]": x for n, x in t.items()})
        for i, rec in enumerate(self.records):
            d.update({f"layer {i} records.{n}": r.buf for n, r in zip(("correction", "key", "decay"), rec)})
        return d

    def plan(self, i: int) -> list:
        spec = self.layers[i]
        return self.steps[spec.group].plan(self.accepted, self.qsl, self.null_slot, spec.num_slots, spec.max_window)

    def offenders(self) -> set:
        bad = set()
        for g, step in enumerate(self.steps):
            members = [s for s in self.layers if s.group == g]
            bad |= step_offenders(self.accepted, self.qsl, step, self.null_slot, sorted({s.num_slots for s in members}),
                                  min(s.max_window for s in members), f"[{g}]")
        return bad


def draw_commit(draw, block_entries_bad: bool = True, only: Optional[str] = None) -> CommitCase:
    """Two KV-cache groups; two or three layers (GDN or KDA records, fp32 or bf16 states, some
    with a conv state); group 1 in align mode or not; every index as in ``draw_step``."""
    bad = corrupted(draw, STEP_FIELDS, only=only)
    null_slot = draw(st.sampled_from(NULL_SLOTS))
    B = draw(st.integers(1, 4))
    max_batch = B + draw(st.integers(0, 1))
    d = draw_dims(draw, v_sizes=(4, 8, 12))
    group_of = [0, 1] + ([draw(st.integers(0, 1))] if draw(st.booleans()) else [])
    use_requests = [bad["requests"] or draw(st.booleans()) for _ in range(2)]
    R = draw(st.integers(1, 5)) if all(use_requests) else B + draw(st.integers(0, 1))
    align = [draw(st.booleans()), bad["blocks"] or bad["computed"] or draw(st.booleans())]
    layouts = [draw_layout(draw, B, R, bad, align[g], use_requests[g]) for g in range(2)]
    group_slots = [draw_pool_size(draw, lay.indices) for lay in layouts]
    conv_dtype = draw(st.sampled_from([F32, BF16]))
    layers = []
    for g in group_of:
        width = draw(st.sampled_from([None, 2, 3, 4]))
        mw = draw(st.integers(1, 4)) if draw(st.integers(0, 3)) == 0 else 4
        layers.append(LayerSpec(g, group_slots[g] + draw(st.integers(0, 1)), draw(st.sampled_from([F32, BF16])),
                                draw(st.booleans()), mw, width, draw(st.sampled_from([3, 8])),
                                (width or 1) - 1 + mw + draw(st.integers(0, 1))))
    steps = [draw_step(draw, layouts[g], group_slots[g], null_slot, bad, block_entries_bad) for g in range(2)]
    window = min(s.max_window for s in layers)     # a longer row is refused (and clamped by kernels)
    qsl, _ = draw_qsl(draw, B, window, bad["qsl"])
    accepted = draw_accepted_for(draw, steps, qsl, R, bad["accepted"])
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pools, records = [], []
    for s in layers:
        state = GuardedPool(s.num_slots, (d.HV, d.V, d.K), s.state_dtype, gen)
        conv = (GuardedPool(s.num_slots, (s.conv_dim, s.conv_cols), conv_dtype, gen, scale=1.0)
                if s.conv_width else None)
        pools.append((state, conv))
        decay_shape = (max_batch, d.HV, s.max_window) + ((d.K,) if s.vector_decay else ())
        key = torch.randn(max_batch, d.H, s.max_window, d.K, generator=gen)
        records.append([
            GuardedFlat((max_batch, d.HV, s.max_window, d.V), values=torch.randn(max_batch, d.HV, s.max_window, d.V,
                                                                                 generator=gen) * 0.3),
            GuardedFlat(key.shape, values=key / key.norm(dim=-1, keepdim=True)),
            GuardedFlat(decay_shape, values=0.5 + 0.5 * torch.rand(decay_shape, generator=gen))])
    return CommitCase(d, layers, steps, accepted, qsl, null_slot, max_batch, pools, records)


class CommitRun:
    def __init__(self, c: CommitCase):
        self.pools = [(s.clone(), None if v is None else v.clone()) for s, v in c.pools]

    def buffers(self) -> dict:
        d = {}
        for i, (s, v) in enumerate(self.pools):
            d[f"layer {i} state pool"] = s.buf
            if v is not None:
                d[f"layer {i} conv_state pool"] = v.buf
        return d


def call_commit_kernel(c: CommitCase, run: CommitRun, name: str) -> None:
    layers = [CommitLayer(s.group, state.view, *(r.view for r in rec), None if conv is None else conv.view,
                          (s.conv_width - 1) if s.conv_width else 0)
              for s, (state, conv), rec in zip(c.layers, run.pools, c.records)]
    committer = backend(name).make_committer(layers, 2, c.max_batch, c.null_slot)
    steps = [GroupStep(t["state_indices"], t["request_indices"], t["block_table"], t["num_computed_tokens"],
                       s.block_size) for s, t in zip(c.steps, c.t)]
    committer.commit(c.acc_t, c.qsl_t, steps)


def call_commit_api(c: CommitCase, run: CommitRun, name: str, check: Optional[bool] = None) -> None:
    groups = [[], []]
    for s, (state, conv), rec in zip(c.layers, run.pools, c.records):
        groups[s.group].append(rs.LayerCache(state.view, rs.ReplayRecords(*(r.view for r in rec)),
                                             None if conv is None else conv.view, s.conv_width))
    ctx = rs.CommitContext(groups, max_batch=c.max_batch, backend=name, null_slot=c.null_slot)
    ctx.commit(c.acc_t, [t["state_indices"] for t in c.t], c.qsl_t,
               request_indices=[t["request_indices"] for t in c.t], block_table=[t["block_table"] for t in c.t],
               num_computed_tokens=[t["num_computed_tokens"] for t in c.t],
               block_size=[s.block_size for s in c.steps], check=check)


def check_commit_run(c: CommitCase, run: CommitRun, what: str) -> list:
    """Only the final and boundary slots of the rule's plan are written (conv states: only
    their history columns); returns, per layer, whether two rows race on a slot."""
    racy = []
    for i, (spec, (state, conv)) in enumerate(zip(c.layers, run.pools)):
        slots, race = plan_writes(c.plan(i), c.steps[spec.group].state_indices, c.null_slot)
        state.assert_only_slots_written(slots, f"{what} layer {i} state")
        if conv is not None:
            h = spec.conv_width - 1
            conv.assert_only_slots_written({s: (lambda x: x[:, h:]) for s in slots}, f"{what} layer {i} conv_state")
        racy.append(race)
    return racy


def compare_commit(c: CommitCase, run: CommitRun, ref: CommitRun, racy: list) -> None:
    """Bit-exact against cpu_ref in every layer where no two rows race."""
    for i, race in enumerate(racy):
        if race:
            continue
        for mine, theirs, what in zip(run.pools[i], ref.pools[i], ("state", "conv_state")):
            if mine is not None:
                assert_same_bits(mine.view, theirs.view, f"layer {i} {what} differs from cpu_ref's commit")


COMMIT = OpFamily(CommitRun, call_commit_kernel, call_commit_api, check_commit_run, compare_commit,
                  lambda c: "CommitContext.commit")


@pytest.mark.parametrize("name", BACKENDS)
def test_commit_kernels_write_only_the_planned_slots(name):
    def body(draw):
        kernels_follow_padding(COMMIT, draw_commit(draw), name)

    run_property(body, "commit_kernels", name)


@pytest.mark.parametrize("name,any_entries", API_STEP_CASES)
def test_commit_api_refuses_bad_values_and_writes_nothing(name, any_entries):
    def body(draw):
        c = draw_commit(draw, block_entries_bad=any_entries, only="blocks" if any_entries else None)
        api_follows_the_rule(COMMIT, c, name, c.offenders(), draw(st.sampled_from(CHECK_FLAGS)))

    run_property(body, "commit_api", name, shrink=False if any_entries else None)


# ================================================================================================
# explicit regression cases
# ================================================================================================
def fixed_recurrence(kind: str, mode: str, slots: list, qsl: list, T: int, null_slot: int, num_slots: int,
                     window: Optional[int] = None, snaps: Optional[list] = None, d: Dims = Dims(1, 2, 12, 8),
                     act_dtype=F32, seed: int = 0) -> RecurrenceCase:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, d.H, d.K, generator=gen).to(act_dtype), torch.randn(T, d.H, d.K, generator=gen).to(act_dtype)
    v = torch.randn(T, d.HV, d.V, generator=gen).to(act_dtype)
    gates = make_gates(kind, T, d.HV, d.K, act_dtype, False, None, gen)
    pool = GuardedPool(num_slots, (d.HV, d.V, d.K), F32, gen)
    return RecurrenceCase(kind, mode, d, T, slots, qsl, null_slot, num_slots, window, snaps, len(slots), None, True,
                          act_dtype, F32, q, k, v, gates, pool)


def fixed_conv(mode: str, slots: list, qsl: Optional[list], T: int, null_slot: int, num_slots: int,
               width: int = 3, window: Optional[int] = 3, dim: int = 12, seed: int = 0) -> ConvCase:
    gen = torch.Generator().manual_seed(seed)
    cols = width - 1 + (window or 0)
    return ConvCase(mode, slots, qsl, T, null_slot, num_slots, width, window, torch.randn(T, dim, generator=gen),
                    torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen), True,
                    GuardedPool(num_slots, (dim, cols), F32, gen, scale=1.0))


def fixed_commit(steps: list, accepted: list, qsl: list, null_slot: int, num_slots: int, max_window: int = 4,
                 seed: int = 0) -> CommitCase:
    """Two groups (one layer each, GDN fp32 with a conv state; KDA bf16 with a conv state) over
    pools of ``num_slots``."""
    gen = torch.Generator().manual_seed(seed)
    d = Dims(1, 2, 12, 8)
    B = len(steps[0].state_indices)
    layers = [LayerSpec(0, num_slots, F32, False, max_window, 3, 8, 2 + max_window),
              LayerSpec(1, num_slots, BF16, True, max_window, 4, 3, 3 + max_window)]
    pools, records = [], []
    for s in layers:
        pools.append((GuardedPool(num_slots, (d.HV, d.V, d.K), s.state_dtype, gen),
                      GuardedPool(num_slots, (s.conv_dim, s.conv_cols), F32, gen, scale=1.0)))
        decay_shape = (B, d.HV, max_window) + ((d.K,) if s.vector_decay else ())
        key = torch.randn(B, d.H, max_window, d.K, generator=gen)
        records.append([GuardedFlat((B, d.HV, max_window, d.V), values=torch.randn(B, d.HV, max_window, d.V,
                                                                                   generator=gen) * 0.3),
                        GuardedFlat(key.shape, values=key / key.norm(dim=-1, keepdim=True)),
                        GuardedFlat(decay_shape, values=0.5 + 0.5 * torch.rand(decay_shape, generator=gen))])
    return CommitCase(d, layers, steps, accepted, qsl, null_slot, B, pools, records)


def check_commit_kernels(c: CommitCase, name: str) -> None:
    """The kernel-facing commit of ``name`` writes only the rule's slots, equal to cpu_ref's bit
    for bit, and the plan kernel gives the rule's plan."""
    inputs = Snapshot(c.inputs())
    assert not any(kernels_follow_padding(COMMIT, c, name))
    for g, (step, t) in enumerate(zip(c.steps, c.t)):
        outs = plan_outputs(len(step.state_indices))
        backend(name).plan_commit(c.acc_t, t["state_indices"], c.qsl_t, t["request_indices"], t["block_table"],
                                  t["num_computed_tokens"], step.block_size or 1, c.null_slot, c.layers[g].num_slots,
                                  tuple(o.view for o in outs))
        expected = step.plan(c.accepted, c.qsl, c.null_slot, c.layers[g].num_slots)
        assert [o.view.tolist() for o in outs] == [list(col) for col in zip(*expected)]
    inputs.assert_unchanged("an input changed: ")


def check_commit_api_refuses(c: CommitCase, name: str, argument: str) -> None:
    """``plan_commit`` and ``CommitContext.commit`` refuse the step naming ``argument`` (group 1's
    for the commit), and write nothing."""
    assert argument in c.offenders() or f"{argument}[1]" in c.offenders()
    run = CommitRun(c)
    everything = Snapshot({**c.inputs(), **run.buffers()})
    step, t = c.steps[1], c.t[1]
    calls = {"CommitContext.commit": (argument, lambda: call_commit_api(c, run, name)),
             "plan_commit": (argument.split("[")[0], lambda: rs.plan_commit(
                 c.acc_t, t["state_indices"], c.qsl_t, request_indices=t["request_indices"],
                 block_table=t["block_table"], num_computed_tokens=t["num_computed_tokens"],
                 block_size=step.block_size, null_slot=c.null_slot, num_slots=c.layers[1].num_slots, backend=name))}
    for op, (named, call) in calls.items():
        try:
            call()
        except ValueError as err:
            assert str(err).startswith(f"{op}: {named} "), str(err)
        else:
            raise AssertionError(f"{op} accepted the step (plan {step.plan(c.accepted, c.qsl, c.null_slot, 6)})")
        everything.assert_unchanged(f"{op} raised, but wrote ")


# (a) an align-mode block-table entry that is neither padding nor a slot. One request, 3 tokens
# accepted from slot 3, num_computed_tokens 1, block size 2: tokens 1..3 end in block 1 (the
# final slot) and cross the boundary of block 0 after 1 token (the boundary slot).
NULL = -3
BAD_BLOCK_ENTRIES = {
    "final entry -2": [[0, -2]],
    "boundary entry -2": [[-2, 1]],
    "final entry INT32_MAX": [[0, INT32_MAX]],
    "boundary entry INT32_MAX": [[INT32_MAX, 1]],
}


def bad_entry_case(table: list) -> CommitCase:
    steps = [Step([3]), Step([3], None, table, [1], 2)]
    return fixed_commit(steps, [3], [0, 3], NULL, 6)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("table", list(BAD_BLOCK_ENTRIES.values()), ids=list(BAD_BLOCK_ENTRIES))
def test_block_table_entries_that_are_not_slots_are_padding_in_kernels(name, table):
    c = bad_entry_case(table)
    plan = c.plan(1)
    if table[0][1] in (-2, INT32_MAX):
        assert plan == [(0, NULL, NULL, 0)]          # the final block is padding: the row commits nothing
    else:
        assert plan == [(3, 1, NULL, 0)]             # the boundary is padding: the final state only
    check_commit_kernels(c, name)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("table", list(BAD_BLOCK_ENTRIES.values()), ids=list(BAD_BLOCK_ENTRIES))
def test_block_table_entries_that_are_not_slots_are_refused(name, table):
    check_commit_api_refuses(bad_entry_case(table), name, "block_table[1]")


@pytest.mark.parametrize("name", BACKENDS)
def test_block_table_entry_past_the_pool_is_refused(name):
    """The same step with the final entry ``num_slots`` (past the pool, above ``null_slot``)."""
    check_commit_api_refuses(bad_entry_case([[0, 6]]), name, "block_table[1]")


# (b) num_computed_tokens = 2^31 - 2 with 3 tokens accepted: nc + n passes the int32 range.
def huge_computed_case(block_size: int, width: int) -> CommitCase:
    table = [list(range(width))]
    steps = [Step([5]), Step([5], None, table, [2**31 - 2], block_size)]
    return fixed_commit(steps, [3], [0, 3], NULL, 6)


@pytest.mark.parametrize("name", BACKENDS)
def test_computed_tokens_near_int32_max_in_kernels(name):
    """Block size 16, 4 columns: the last block (134217728) is clamped to the table's last
    column; the first block is past the table, so no boundary. No crash, nothing else written."""
    c = huge_computed_case(16, 4)
    assert c.plan(1) == [(3, 3, NULL, 0)]
    check_commit_kernels(c, name)


@pytest.mark.parametrize("name", BACKENDS)
def test_computed_tokens_near_int32_max_past_the_table_is_refused(name):
    check_commit_api_refuses(huge_computed_case(16, 4), name, "block_table[1]")


@pytest.mark.parametrize("name", BACKENDS)
def test_computed_tokens_near_int32_max_within_the_table(name):
    """Block size 2^30, 3 columns: tokens 2^31 - 2 .. 2^31 end in block 2 and cross the block-1
    boundary after 2 tokens; legal, so the API commits it, as the rule and cpu_ref say."""
    c = huge_computed_case(2**30, 3)
    assert c.plan(1) == [(3, 2, 1, 2)] and not c.offenders()
    check_commit_kernels(c, name)
    run = CommitRun(c)
    call_commit_api(c, run, name)
    check_commit_run(c, run, name)
    ref = CommitRun(c)
    call_commit_kernel(c, ref, "cpu_ref")
    compare_commit(c, run, ref, [False, False])


# (c) state_indices / snapshot_slots entry -2 with null_slot = -3: rows 0 and 2 are padding
# (-2, -3), rows 1 and 3 live.
SLOTS_C = [-2, 1, NULL, 3]
QSL_C = [1, 3, 4, 6, 8]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind,mode", [("gdn", "verify"), ("gdn", "decode"), ("gdn", "snapshot"), ("kda", "verify")])
def test_slot_between_null_and_zero_in_recurrence(name, kind, mode):
    snaps = [[0, 2], [4, NULL], [NULL, 5], [6, NULL]] if mode == "snapshot" else None
    bad_snaps = [[0, 2], [4, -2], [-2, 5], [6, NULL]]
    window = None if mode == "decode" else 2
    for slots, snap, culprit in ((SLOTS_C, snaps, "state_indices"),
                                 ([0, 1, NULL, 3], bad_snaps, "snapshot_slots")):
        if mode != "snapshot" and culprit == "snapshot_slots":
            continue
        c = fixed_recurrence(kind, mode, slots, QSL_C, 9, NULL, 7, window, snap)
        assert recurrence_offenders(mode, slots, QSL_C, 9, 7, NULL, window, snap) == {culprit}
        kernels_follow_padding(RECURRENCE, c, name)
        api_refuses(RECURRENCE, c, name, culprit)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", ["verify", "decode"])
def test_slot_between_null_and_zero_in_conv(name, mode):
    qsl = QSL_C if mode == "verify" else None
    c = fixed_conv(mode, SLOTS_C, qsl, 9 if qsl else 4, NULL, 5, window=2 if qsl else None)
    assert conv_offenders(SLOTS_C, qsl, c.T, 5, NULL, 2) == {"state_indices"}
    kernels_follow_padding(CONV, c, name)
    api_refuses(CONV, c, name, "state_indices")


@pytest.mark.parametrize("name", BACKENDS)
def test_slot_between_null_and_zero_in_commit(name):
    steps = [Step([-2, 1]), Step([4, -2], None, [[0, 2], [3, 5]], [0, 0], 2)]
    c = fixed_commit(steps, [2, 1], [0, 2, 3], NULL, 6)
    assert c.plan(0) == [(0, NULL, NULL, 0), (1, 1, NULL, 0)]
    assert c.plan(1) == [(2, 0, NULL, 0), (0, NULL, NULL, 0)]
    check_commit_kernels(c, name)
    api_refuses(COMMIT, c, name, "state_indices[0]")


# A misaligned ``out``: the Triton launcher writes the kernel's output through a packed copy of
# ``out`` and copies it back, so tokens outside every row must keep their values.
MISALIGNED = {"fp32, out 4 bytes off": (F32, 8, 1), "bf16, V = 12": (BF16, 12, 0)}


@pytest.mark.parametrize("name", ["cpu_ref", pytest.param("cuda", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("how", list(MISALIGNED), ids=list(MISALIGNED))
@pytest.mark.parametrize("api", [False, True], ids=["kernel", "api"])
def test_misaligned_out_keeps_tokens_outside_every_row(name, how, api):
    dtype, V, offset = MISALIGNED[how]
    c = fixed_recurrence("gdn", "verify", [0, 2], [1, 3, 4], 6, -1, 4, 3, d=Dims(1, 1, 8, V), act_dtype=dtype)
    flat = torch.full((offset + c.T * V + 4,), OUT_SENTINEL, dtype=dtype)
    out = flat[offset:offset + c.T * V].view(c.T, 1, V)
    run = RecurrenceRun(c)
    before = flat.clone()
    if api:
        rs.gdn_verify(c.q, c.k, c.v, state=run.pool.view, state_indices=c.si, query_start_loc=c.qsl_t,
                      records=rs.ReplayRecords(*run.record_views()), out=out, backend=name, **c.gates.tensors)
    else:
        backend(name).recurrence(RecurrenceCall("verify", c.q, c.k, c.v, run.pool.view, c.si, c.qsl_t,
                                                GateInputs(**c.gates.tensors, kind="gdn"), 8 ** -0.5, True, -1, out,
                                                run.record_views(), None))
    for t in (0, 4, 5):                     # before the first row, after the last
        assert_same_bits(out[t], before[offset + t * V:offset + (t + 1) * V].view(1, V),
                         f"token {t}, outside every row,")
    assert_same_bits(flat[:offset], before[:offset], "elements before out")
    assert_same_bits(flat[offset + c.T * V:], before[offset + c.T * V:], "elements after out")
    assert bool(torch.isfinite(out[1:4]).all())
