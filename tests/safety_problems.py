"""Building blocks of ``test_index_safety.py``: guarded buffers, index strategies and the oracles.

Everything a test asserts is derived here from the *stated* rules, never from the code under
test: the index rule (``recoverssm.core.indices.is_slot``; a value is padding, an index, or
anything else), the kernels' clamping of ``query_start_loc`` (both ends to ``[0, T]``, the length to
``[0, window]``), and the commit plan (``recoverssm.core.plan.plan_rows``, the written-out rule
that the ``cpu_ref`` backend and validation share with the kernels' twin). The value checks the
public API must run are written again from their documentation (``core/validation.py``,
``core/arguments.py`` docstrings, ``CommitContext`` / ``plan_commit`` docs).

Buffers that an op may write live inside larger buffers filled with a sentinel: a state pool is
``[G + num_slots + G, ...]`` with the op seeing the middle, outputs and replay records have guard
elements on both sides (and output rows have pad columns). After a call every byte outside the
writes the rule allows must be bit-for-bit what it was.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from hypothesis import strategies as st

from recoverssm.core.indices import INT32_MAX, INT32_MIN, is_slot
from recoverssm.core.plan import plan_rows

I32 = torch.int32
#: Outcomes of the public-API cases, by op (for a look at what the examples cover).
OUTCOMES: collections.Counter = collections.Counter()
F32, BF16 = torch.float32, torch.bfloat16
NULL_SLOTS = (-1, -3, -100, INT32_MIN)
GUARD_SLOTS = 1
SENTINEL = float("nan")          # a read of a guard shows up as NaN in every result
OUT_SENTINEL = -777.25           # exactly representable in bf16 and fp32
FP32_REL = 1e-4


def i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=I32)


# ------------------------------------------------------------------------------------------------
# bitwise comparison
# ------------------------------------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.int32: torch.int32, torch.int64: torch.int64, torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN payloads included), contiguous."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not same_bits(a, b):
        diff = (bits(a) != bits(b)).nonzero()[:8].tolist() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: bits changed (first differing indices {diff})")


class Snapshot:
    """Clones of named tensors, to assert later that none of them changed a bit."""

    def __init__(self, tensors: dict):
        self.before = {n: t.clone() for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        self.tensors = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}

    def assert_unchanged(self, context: str = "") -> None:
        for name, t in self.tensors.items():
            assert_same_bits(t, self.before[name], f"{context}{name}")


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = FP32_REL,
                     ulp_bf16: bool = False) -> None:
    """``|a - e| <= rel * max|e|`` (fp32 tolerance relative to the tensor's scale); with
    ``ulp_bf16`` (bf16 results) one more bf16 rounding step, ``2^-7 |e|``, per element."""
    assert actual.shape == expected.shape, what
    if actual.numel() == 0:
        return
    a, e = actual.double(), expected.double()
    assert torch.equal(torch.isfinite(a), torch.isfinite(e)), f"{what}: non-finite values differ"
    fin = torch.isfinite(e)
    a, e = a[fin], e[fin]
    if e.numel() == 0:
        return
    bound = rel * max(float(e.abs().max()), 1e-6) + (2.0 ** -7 * e.abs() if ulp_bf16 else 0.0)
    err = (a - e).abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: max error {float(err.max()):.3g} beyond the tolerance "
                                 f"(scale {float(e.abs().max()):.3g})")


# ------------------------------------------------------------------------------------------------
# guarded buffers
# ------------------------------------------------------------------------------------------------
class GuardedPool:
    """A pool ``[G + num_slots + G, *rest]``: guard slots on both sides hold the sentinel, the
    middle random values; ``view`` is the middle, what the op sees as the pool."""

    def __init__(self, num_slots: int, rest: Sequence[int], dtype: torch.dtype, gen: torch.Generator,
                 scale: float = 0.5):
        self.num_slots = num_slots
        self.buf = torch.full((GUARD_SLOTS + num_slots + GUARD_SLOTS, *rest), SENTINEL, dtype=dtype)
        self.buf[GUARD_SLOTS:GUARD_SLOTS + num_slots] = (torch.randn(num_slots, *rest, generator=gen)
                                                         * scale).to(dtype)
        self.initial = self.buf.clone()

    def clone(self) -> "GuardedPool":
        other = object.__new__(GuardedPool)
        other.num_slots = self.num_slots
        other.buf = self.initial.clone()
        other.initial = self.initial
        return other

    @property
    def view(self) -> torch.Tensor:
        return self.buf[GUARD_SLOTS:GUARD_SLOTS + self.num_slots]

    @property
    def initial_view(self) -> torch.Tensor:
        return self.initial[GUARD_SLOTS:GUARD_SLOTS + self.num_slots]

    def assert_guards(self, what: str) -> None:
        for part in (slice(0, GUARD_SLOTS), slice(GUARD_SLOTS + self.num_slots, None)):
            assert_same_bits(self.buf[part], self.initial[part], f"{what}: guard slot")

    def assert_only_slots_written(self, allowed, what: str) -> None:
        """Guards intact; every slot not in ``allowed`` bit-identical. ``allowed``: a set of
        slots, or a dict ``slot -> keep`` where ``keep(slot_tensor)`` returns the part of an
        allowed slot that must still be bit-identical (``None``: all of it may change)."""
        self.assert_guards(what)
        keeps = allowed if isinstance(allowed, dict) else dict.fromkeys(allowed)
        now, before = self.view, self.initial_view
        for s in range(self.num_slots):
            if s not in keeps:
                assert_same_bits(now[s], before[s], f"{what}: slot {s}, which no valid row writes,")
            elif keeps[s] is not None:
                assert_same_bits(keeps[s](now[s]), keeps[s](before[s]), f"{what}: slot {s} outside its written part")


class GuardedFlat:
    """A contiguous tensor of ``shape`` inside a flat buffer with ``guard`` sentinel elements on
    both sides (for replay records, which must be contiguous)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype = F32, guard: int = 16,
                 fill: float = SENTINEL, values: Optional[torch.Tensor] = None):
        self.shape = tuple(shape)
        self.guard = guard
        n = math.prod(self.shape)
        self.buf = torch.full((guard + n + guard,), fill, dtype=dtype)
        if values is not None:
            self.view.copy_(values)
        self.initial = self.buf.clone()

    @property
    def view(self) -> torch.Tensor:
        n = math.prod(self.shape)
        return self.buf[self.guard:self.guard + n].view(self.shape)

    @property
    def initial_view(self) -> torch.Tensor:
        n = math.prod(self.shape)
        return self.initial[self.guard:self.guard + n].view(self.shape)

    def assert_guards(self, what: str) -> None:
        n = math.prod(self.shape)
        assert_same_bits(self.buf[:self.guard], self.initial[:self.guard], f"{what}: leading guard")
        assert_same_bits(self.buf[self.guard + n:], self.initial[self.guard + n:], f"{what}: trailing guard")


class GuardedOut:
    """An output ``[T, *inner, width]`` as a view into ``[G + T + G, *inner, padded width]``
    filled with ``OUT_SENTINEL``: guard tokens on both sides and pad columns. ``padded width``
    keeps every row 16-byte aligned (a misaligned ``out`` is a separate test)."""

    def __init__(self, T: int, inner: Sequence[int], width: int, dtype: torch.dtype, guard_tokens: int = 1):
        vec = 16 // torch.empty((), dtype=dtype).element_size()
        self.T, self.width, self.g = T, width, guard_tokens
        self.padded = -(-width // vec) * vec
        self.buf = torch.full((guard_tokens + T + guard_tokens, *inner, self.padded), OUT_SENTINEL, dtype=dtype)
        self.initial = self.buf.clone()

    @property
    def view(self) -> torch.Tensor:
        return self.buf[self.g:self.g + self.T, ..., :self.width]

    def assert_outside_untouched(self, what: str) -> None:
        assert_same_bits(self.buf[:self.g], self.initial[:self.g], f"{what}: leading guard tokens")
        assert_same_bits(self.buf[self.g + self.T:], self.initial[self.g + self.T:], f"{what}: trailing guard tokens")
        assert_same_bits(self.buf[..., self.width:], self.initial[..., self.width:], f"{what}: pad columns")


# ------------------------------------------------------------------------------------------------
# rows and the kernels' clamping rule
# ------------------------------------------------------------------------------------------------
def clamped_rows(qsl: Sequence[int], T: int, window: Optional[int]) -> list[tuple[int, int]]:
    """Each row's ``(start, length)`` under the kernels' rule: both ends clamped to ``[0, T]``,
    the length to ``[0, window]`` (``None``: no window)."""
    ends = [min(max(x, 0), T) for x in qsl]
    rows = []
    for r in range(len(qsl) - 1):
        n = max(ends[r + 1] - ends[r], 0)
        if window is not None:
            n = min(n, window)
        rows.append((ends[r], n))
    return rows


def output_rows(qsl: Optional[Sequence[int]], T: int, window: Optional[int], live: Sequence[int],
                B: int) -> list[tuple[int, int]]:
    """Each row's ``(start, count)`` of output tokens it writes: a live row its clamped window
    (:func:`clamped_rows`), a padding row its whole span (both ends clamped to ``[0, T]``, no
    window). ``qsl`` ``None``: one token per row (decode)."""
    if qsl is None:
        return [(r, 1) for r in range(B)]
    spans = clamped_rows(qsl, T, None)
    windows = clamped_rows(qsl, T, window)
    return [windows[r] if r in live else spans[r] for r in range(B)]


def token_cover(rows: list[tuple[int, int]], T: int) -> list[list[int]]:
    """For each token, the rows whose clamped window holds it."""
    cover = [[] for _ in range(T)]
    for r, (start, n) in enumerate(rows):
        for t in range(start, start + n):
            cover[t].append(r)
    return cover


def slot_legal(v: int, null_slot: int, num_slots: int) -> bool:
    """Padding or a slot: anything else must be rejected where value checks run."""
    return v <= null_slot or is_slot(v, null_slot, num_slots)


def qsl_legal(qsl: Sequence[int], T: int, window: Optional[int]) -> bool:
    """Starts at 0 or later, never decreases, ends within the ``T`` tokens, no row longer than
    the window."""
    if not qsl:
        return True
    if qsl[0] < 0 or qsl[-1] > T:
        return False
    for a, b in zip(qsl, qsl[1:]):
        if b < a or (window is not None and b - a > window):
            return False
    return True


def conflicts(writes: list[tuple[int, int]], sources: list[tuple[int, int]]) -> bool:
    """Two rows write one slot, or a row writes a slot that another row reads."""
    writer: dict[int, int] = {}
    for r, s in writes:
        if writer.setdefault(s, r) != r:
            return True
    return any(s in writer and writer[s] != r for r, s in sources)


# ------------------------------------------------------------------------------------------------
# strategies of index values
# ------------------------------------------------------------------------------------------------
LEGAL_KINDS = ("slot", "slot", "slot", "pad")
ADVERSARIAL_KINDS = ("slot", "slot", "pad", "between", "big", "extreme")


def draw_slot(draw, num_slots: int, null_slot: int, adversarial: bool, bad_only: bool = False) -> int:
    """One slot index: a slot, padding (``<= null_slot``), or (adversarial) a value between
    ``null_slot`` and 0, one ``>= num_slots``, or an int32 extreme."""
    kinds = ("between", "big", "extreme") if bad_only else ADVERSARIAL_KINDS if adversarial else LEGAL_KINDS
    kind = draw(st.sampled_from(kinds))
    if kind == "between" and null_slot >= -1:
        kind = "big"
    if kind == "slot":
        return draw(st.integers(0, num_slots - 1))
    if kind == "pad":
        return draw(st.one_of(st.just(null_slot), st.integers(INT32_MIN, null_slot)))
    if kind == "between":
        return draw(st.integers(null_slot + 1, -1))
    if kind == "big":
        return draw(st.one_of(st.just(num_slots), st.integers(num_slots, INT32_MAX), st.just(INT32_MAX)))
    value = draw(st.sampled_from([INT32_MIN, INT32_MAX, -1, -2, 0, num_slots - 1, num_slots, null_slot,
                                  null_slot + 1]))
    return value if not bad_only or not slot_legal(value, null_slot, num_slots) else INT32_MAX


def draw_slots(draw, count: int, num_slots: int, null_slot: int, adversarial: bool) -> list[int]:
    """``count`` slot indices: distinct slots with some padding (most draws, where the pool has
    room), or independent draws (duplicates likely); adversarial draws then put values that are
    neither padding nor a slot at random places."""
    if count <= num_slots and draw(st.integers(0, 3)):
        values = list(draw(st.permutations(range(num_slots))))[:count]
        values = [draw_slot(draw, num_slots, null_slot, False) if draw(st.integers(0, 4)) == 0 else v for v in values]
    else:
        values = [draw_slot(draw, num_slots, null_slot, False) for _ in range(count)]
    if adversarial:
        values = [draw_slot(draw, num_slots, null_slot, True, bad_only=True) if draw(st.integers(0, 2)) == 0 else v
                  for v in values]
    return values


def draw_slots_like(draw, values: list, num_slots: int, null_slot: int, adversarial: bool) -> list:
    """``values``, with (adversarial) some entries turned into values that are neither padding
    nor a slot."""
    if not adversarial:
        return list(values)
    return [draw_slot(draw, num_slots, null_slot, True, bad_only=True) if draw(st.integers(0, 2)) == 0 else v
            for v in values]


CHECK_FLAGS = (None, False, True)   # value checks run on CPU tensors whatever ``check`` says


def corrupted(draw, fields, adversarial: Optional[bool] = None, only: Optional[str] = None) -> dict:
    """Which fields of an example get adversarial values: none (about half the examples: every
    value legal, but for duplicates), one field (most of the others), or several; ``only``:
    always that one field."""
    if only is not None:
        return {f: f == only for f in fields}
    adversarial = draw(st.booleans()) if adversarial is None else adversarial
    if not adversarial:
        return dict.fromkeys(fields, False)
    if draw(st.integers(0, 3)):
        chosen = [draw(st.sampled_from(fields))]
    else:
        chosen = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=len(fields), unique=True))
    return {f: f in chosen for f in fields}


def draw_pool_size(draw, needed: int) -> int:
    """A pool about as large as the distinct slots a batch needs (sometimes smaller: duplicates)."""
    return max(1, needed + draw(st.integers(-2, 2)))


QSL_MUTATIONS = ("decrease", "past_end", "negative", "too_long", "extreme", "gap_end", "huge_row", "huge_row")


def draw_qsl(draw, B: int, window: Optional[int], adversarial: bool, max_len: int = 3) -> tuple[list[int], int]:
    """``(query_start_loc, T)``: ragged rows of 0..``window`` tokens (``max_len`` without a
    window), tokens before the first and after the last row; adversarial draws mutate one
    entry (decreasing, past T, negative, a row longer than the window, int32 extremes, a row of
    2^31 tokens or more)."""
    top = window if window is not None else max_len
    lens = [draw_count(draw, top) for _ in range(B)]
    lead, tail = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    if adversarial:
        mutation = draw(st.sampled_from(QSL_MUTATIONS))
        if mutation == "too_long" and B:
            lens[draw(st.integers(0, B - 1))] = top + draw(st.integers(1, 2))
    else:
        mutation = None
    qsl = [lead]
    for n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1] + tail
    i = draw(st.integers(0, B))
    if mutation == "decrease" and B:
        r = draw(st.integers(0, B - 1))
        qsl[r], qsl[r + 1] = qsl[r + 1] + draw(st.integers(1, 2)), qsl[r]
    elif mutation == "past_end":
        qsl[i] = T + draw(st.integers(1, 3))
    elif mutation == "negative":
        qsl[i] = -draw(st.integers(1, 3))
    elif mutation == "extreme":
        qsl[i] = draw(st.sampled_from([INT32_MIN, INT32_MAX, -1, INT32_MAX - 1]))
    elif mutation == "gap_end":
        qsl[-1] = draw(st.integers(INT32_MIN, INT32_MAX))
    elif mutation == "huge_row" and B:   # a row of 2^31 tokens or more (its length overflows int32)
        r = draw(st.integers(0, B - 1))
        qsl[r] = draw(st.sampled_from([INT32_MIN, INT32_MIN + 1, -(2**30)]))
        qsl[r + 1] = max(qsl[r + 1], draw(st.sampled_from([0, 1, 2**30, INT32_MAX])))
    return qsl, T


def draw_accepted(draw, count: int, adversarial: bool, top: int = 4) -> list[int]:
    """``num_accepted`` entries: 0..``top`` or (adversarial) negative, past any window, huge."""
    if adversarial:
        return [draw(st.one_of(st.integers(0, top), st.integers(0, top),
                               st.sampled_from([-1, top + 1, INT32_MAX, INT32_MIN]),
                               st.integers(INT32_MIN, INT32_MAX)))
                for _ in range(count)]
    return [draw(st.integers(0, top)) for _ in range(count)]


def draw_count(draw, top: int) -> int:
    """0..``top``, mostly at least 1 (rows that commit something)."""
    if top <= 0:
        return 0
    return draw(st.integers(1, top)) if draw(st.integers(0, 4)) else 0


# ------------------------------------------------------------------------------------------------
# the offenders: which arguments hold values the checks must refuse
# ------------------------------------------------------------------------------------------------
def recurrence_offenders(mode: str, slots: list[int], qsl: list[int], T: int, num_slots: int, null_slot: int,
                         window: Optional[int], snaps: Optional[list[list[int]]]) -> set:
    """verify / decode / snapshot (``core/indices.py``, ``gdn_decode`` and
    ``gdn_spec_decode_snapshot`` docs: no two rows write one slot, none writes a slot another
    row reads)."""
    bad = set()
    if not all(slot_legal(s, null_slot, num_slots) for s in slots):
        bad.add("state_indices")
    if not qsl_legal(qsl, T, window):
        bad.add("query_start_loc")
    if snaps is not None and not all(slot_legal(s, null_slot, num_slots) for row in snaps for s in row):
        bad.add("snapshot_slots")
    if bad or mode == "verify":
        return bad
    live = [r for r, s in enumerate(slots) if s > null_slot and qsl[r + 1] > qsl[r]]
    if mode == "decode":
        if conflicts([(r, slots[r]) for r in live], []):
            bad.add("state_indices")
    else:
        writes = [(r, s) for r in live for s in snaps[r][:qsl[r + 1] - qsl[r]] if s > null_slot]
        if conflicts(writes, [(r, slots[r]) for r in live]):
            bad.add("snapshot_slots")
    return bad


def conv_offenders(slots: list[int], qsl: Optional[list[int]], T: int, num_slots: int, null_slot: int,
                   window: int) -> set:
    bad = set()
    if not all(slot_legal(s, null_slot, num_slots) for s in slots):
        bad.add("state_indices")
    if qsl is not None and not qsl_legal(qsl, T, window):
        bad.add("query_start_loc")
    if bad:
        return bad
    lengths = [1] * len(slots) if qsl is None else [qsl[r + 1] - qsl[r] for r in range(len(slots))]
    if conflicts([(r, s) for r, s in enumerate(slots) if s > null_slot and lengths[r] > 0], []):
        bad.add("state_indices")
    return bad


@dataclass
class Step:
    """One KV-cache group's commit metadata, as host lists."""
    state_indices: list
    request_indices: Optional[list] = None
    block_table: Optional[list] = None
    num_computed_tokens: Optional[list] = None
    block_size: Optional[int] = None

    def tensors(self) -> dict:
        d = {"state_indices": i32(self.state_indices)}
        d["request_indices"] = None if self.request_indices is None else i32(self.request_indices)
        d["block_table"] = (None if self.block_table is None
                            else torch.tensor(self.block_table, dtype=I32).reshape(len(self.block_table), -1))
        d["num_computed_tokens"] = None if self.num_computed_tokens is None else i32(self.num_computed_tokens)
        return d

    def plan(self, accepted: list, qsl: list, null_slot: int, num_slots: int, max_len: int = INT32_MAX) -> list:
        """The commit plan of the rule (``core/plan.py``)."""
        return plan_rows(accepted, self.state_indices, qsl, self.request_indices, self.block_table,
                         self.num_computed_tokens, self.block_size or 1, null_slot, num_slots, max_len)


def step_offenders(accepted: list, qsl: list, step: Step, null_slot: int, pools: Sequence[int],
                   max_len: Optional[int], suffix: str = "") -> set:
    """The value checks of one group's commit step (``plan_commit``, ``CommitContext.commit``).

    ``pools``: the pool sizes of the group's layers (every index must be a slot of each);
    ``max_len``: the records' window (``None`` for ``plan_commit``). Block-table entries follow
    the index rule like every other index: each entry the plan *reads* (a live row's final
    block and, where the row crosses a block boundary, its first block) must be padding or a
    slot."""
    bad = set()
    B, R = len(step.state_indices), len(accepted)
    if not qsl_legal(qsl, INT32_MAX, max_len):
        bad.add("query_start_loc")
    if not all(slot_legal(s, null_slot, n) for s in step.state_indices for n in pools):
        bad.add("state_indices" + suffix)
    req = step.request_indices if step.request_indices is not None else list(range(B))
    # a request index <= null_slot is padding (the row commits nothing), like any other index
    if step.request_indices is not None and not all(q <= null_slot or 0 <= q < R for q in req):
        bad.add("request_indices" + suffix)
    align = step.block_table is not None
    live = [r for r, src in enumerate(step.state_indices) if src > null_slot and 0 <= req[r] < R]
    if align and any(step.num_computed_tokens[req[r]] < 0 for r in live):
        bad.add("num_computed_tokens" + suffix)
    if "query_start_loc" in bad:
        return bad
    smallest = min(pools)
    for r, src in enumerate(step.state_indices):
        q = req[r]
        if not 0 <= q < R or src <= null_slot or not slot_legal(src, null_slot, smallest):
            continue
        if not 0 <= accepted[q] <= qsl[r + 1] - qsl[r]:
            bad.add("num_accepted")
        elif align and accepted[q] > 0 and step.num_computed_tokens[q] >= 0 and not _blocks_read_legal(
                step.block_table[q], step.num_computed_tokens[q], accepted[q], step.block_size, null_slot, pools):
            bad.add("block_table" + suffix)
    if bad:
        return bad
    plan = step.plan(accepted, qsl, null_slot, smallest)
    writes = [(r, s) for r, p in enumerate(plan) for s in (p[1], p[2]) if s > null_slot]
    sources = [(r, step.state_indices[r]) for r, p in enumerate(plan) if p[0] > 0]
    if conflicts(writes, sources):
        bad.add(("block_table" if align else "state_indices") + suffix)
    return bad


def _blocks_read_legal(blocks: list, nc: int, n: int, block_size: int, null_slot: int, pools: Sequence[int]) -> bool:
    """The block-table entries a live row's commit reads (its final block, and its first block
    where the window crosses a block boundary) are padding or slots, and the final block is a
    column of the table."""
    last = (nc + n - 1) // block_size
    if last >= len(blocks):
        return False
    final = blocks[last]
    if not all(slot_legal(final, null_slot, m) for m in pools):
        return False
    first = nc // block_size
    if final > null_slot and nc + n >= (first + 1) * block_size and first < len(blocks):
        return all(slot_legal(blocks[first], null_slot, m) for m in pools)
    return True


def plan_writes(plan: list, sources: list, null_slot: int) -> tuple[set, bool]:
    """``(slots the plan writes, whether two rows race)``: a race is two rows writing one slot
    or a row writing a slot another live row reads (its value then depends on the order)."""
    writes = [(r, s) for r, p in enumerate(plan) if p[0] > 0 for s in (p[1], p[2]) if s > null_slot]
    reads = [(r, sources[r]) for r, p in enumerate(plan) if p[0] > 0]
    return {s for _, s in writes}, conflicts(writes, reads)


def error_names(exc: BaseException, op: str) -> str:
    """The argument an error names: the word after ``"<op>: "``."""
    msg = str(exc)
    prefix = f"{op}: "
    assert msg.startswith(prefix), f"error message does not start with {prefix!r}: {msg!r}"
    return msg[len(prefix):].split(" ", 1)[0]


def expect_outcome(call: Callable, op: str, offenders: set, snapshot: Snapshot) -> bool:
    """Run a public-API ``call``: with no offender it must succeed (returns True); otherwise it
    must raise a ``ValueError`` that starts with ``op`` and names one of the offenders, having
    written nothing (returns False)."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        if not offenders:
            raise AssertionError(f"{op} refused legal values: {exc}") from exc
        assert isinstance(exc, ValueError), f"{op}: a bad value raised {type(exc).__name__}: {exc}"
        name = error_names(exc, op)
        assert name in offenders, \
            f"{op}: the error names {name!r}, the offending arguments are {sorted(offenders)}: {exc}"
        snapshot.assert_unchanged(f"{op} raised, but wrote ")
        OUTCOMES[(op, "refused: " + name.split('[')[0])] += 1
        return False
    assert not offenders, f"{op} accepted illegal values in {sorted(offenders)}"
    OUTCOMES[(op, "accepted")] += 1
    return True


@dataclass
class Dims:
    H: int
    HV: int
    K: int
    V: int


HEADS = ((1, 1), (1, 2), (2, 2), (1, 4), (2, 4))
HEAD_SIZES = (4, 8, 12, 16)


def draw_dims(draw, heads=HEADS, sizes=HEAD_SIZES, v_sizes=(4, 8, 12)) -> Dims:
    H, HV = draw(st.sampled_from(heads))
    return Dims(H, HV, draw(st.sampled_from(sizes)), draw(st.sampled_from(v_sizes)))


@dataclass
class Gates:
    kind: str
    tensors: dict = field(default_factory=dict)
    lower_bound: Optional[float] = None


def make_gates(kind: str, T: int, HV: int, K: int, act_dtype: torch.dtype, precomputed: bool,
               lower_bound: Optional[float], gen: torch.Generator) -> Gates:
    per_token = (T, HV, K) if kind == "kda" else (T, HV)
    if kind == "mamba2":          # raw dt, its bias, the decay rate and the skip D per head
        return Gates(kind, {"dt": torch.randn(T, HV, generator=gen).to(act_dtype),
                            "dt_bias": torch.randn(HV, generator=gen).float(),
                            "A_log": (torch.randn(HV, generator=gen) * 0.5).float(),
                            "D": torch.randn(HV, generator=gen).float()})
    if precomputed:
        g = (-torch.rand(*per_token, generator=gen) * 2).float()
        beta = torch.rand(T, HV, generator=gen).float()
        return Gates(kind, {"g": g, "beta": beta})
    return Gates(kind, {"a": torch.randn(*per_token, generator=gen).to(act_dtype),
                        "b": torch.randn(T, HV, generator=gen).to(act_dtype),
                        "A_log": (torch.randn(HV, generator=gen) * 0.5).float(),
                        "dt_bias": torch.randn(*((HV, K) if kind == "kda" else (HV,)), generator=gen).float()},
                 lower_bound if kind == "kda" else None)
