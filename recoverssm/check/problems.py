"""The random problems of ``recoverssm check``: case descriptions and their inputs, built on CPU
from the run's generators and copied to the device under test by the checkers."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import recoverssm as rs
from recoverssm.core.types import FAMILIES

from .report import dtype_name


def i32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def query_start_loc(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each row's tokens start, and the total at the end."""
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return qsl


def prefix(tokens: dict[str, torch.Tensor], qsl: Sequence[int], counts: Sequence[int]):
    """The first ``counts[r]`` tokens of each row (contiguous copies) and their ``query_start_loc``."""
    idx = [qsl[r] + t for r in range(len(counts)) for t in range(counts[r])]
    first = next(iter(tokens.values()))
    index = torch.tensor(idx, dtype=torch.long, device=first.device)
    return {k: v.index_select(0, index) for k, v in tokens.items()}, query_start_loc(counts)


@dataclass(frozen=True)
class _Rows:
    """A batch described by its rows' window lengths."""

    lengths: tuple[int, ...]

    @property
    def B(self) -> int:
        return len(self.lengths)

    @property
    def T(self) -> int:
        return max(max(self.lengths), 1)


# ------------------------------------------------------------------------------------------------
# the recurrences (GDN, KDA, Mamba2): verify, decode, snapshot, non-align commit
# ------------------------------------------------------------------------------------------------
#: a layer's per-head parameters, as the ops name them (the rest of a layer's weights are conv's)
HEAD_PARAMS = ("A_log", "A", "dt_bias", "D")


def heads_of(params: dict) -> dict:
    """The per-head parameters among a layer's weights ``params`` (:data:`HEAD_PARAMS`)."""
    return {name: value for name, value in params.items() if name in HEAD_PARAMS}


@dataclass(frozen=True)
class Mamba2Options:
    """What a Mamba2 layer may add to its ops' inputs: ``D`` (the skip) per head (``"head"``),
    per channel (``"channel"``) or none (None); the output gate ``z``; ``dt_limit``, the clamp
    of ``dt``; ``A``: the decay rate given as ``A = -exp(A_log)`` instead of ``A_log``."""

    D: Optional[str] = "head"
    z: bool = False
    dt_limit: Optional[tuple[Optional[float], Optional[float]]] = None
    A: bool = False

    def __post_init__(self):
        if self.D not in (None, "head", "channel"):
            raise ValueError(f"Mamba2Options: D must be None, 'head' or 'channel', got {self.D!r}")

    @property
    def label(self) -> str:
        parts = [f"D/{self.D}" if self.D else "no D"]
        if self.z:
            parts.append("z")
        if self.dt_limit is not None:
            parts.append("dt[" + ",".join("-" if x is None else f"{x:g}" for x in self.dt_limit) + "]")
        if self.A:
            parts.append("A")
        return " ".join(parts)


@dataclass(frozen=True)
class _Layer:
    """One recurrent layer's family and shapes: ``kind`` ``"gdn"`` (a decay per value head),
    ``"kda"`` (a decay per K channel) or ``"mamba2"`` (a decay per head, no delta rule). ``H``
    q/k heads (Mamba2: ``ngroups`` of ``B`` and ``C``), ``HV`` value heads (``nheads``), ``K``
    (``dstate``), ``V`` (``headdim``); ``lower_bound``: KDA's bounded gate; ``mamba2``: a Mamba2
    layer's optional inputs. Every fact that depends on the family is one method here."""

    kind: str = "gdn"
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16
    lower_bound: Optional[float] = None
    mamba2: Mamba2Options = Mamba2Options()

    @property
    def gate_shape(self) -> tuple[int, ...]:
        """One token's decay input (``a``, or Mamba2's ``dt``) and gate ``g`` (and ``dt_bias``):
        ``[HV]`` or, with a vector decay, ``[HV, K]``."""
        return (self.HV, self.K) if self.vector_decay else (self.HV,)

    @property
    def gate_width(self) -> int:
        return math.prod(self.gate_shape)

    @property
    def vector_decay(self) -> bool:
        return FAMILIES[self.kind].vector_decay

    def capabilities(self) -> tuple[str, ...]:
        """What a backend must declare to run this layer's recurrence and commit it."""
        return (self.kind, "commit") + (("vector_decay",) if self.vector_decay else ())

    def op_kwargs(self) -> dict:
        """The recurrent ops' keyword arguments of this kind beyond the tensors (KDA's
        ``lower_bound``, Mamba2's ``dt_limit``)."""
        if self.kind == "kda":
            return {"lower_bound": self.lower_bound}
        if self.kind == "mamba2":
            return {"dt_limit": self.mamba2.dt_limit}
        return {}

    def heads_label(self) -> str:
        lb = "" if self.lower_bound is None else f" lb{self.lower_bound:g}"
        opts = f" {self.mamba2.label}" if self.kind == "mamba2" else ""
        return f"{self.kind}{lb}{opts} H{self.H}/{self.HV} K{self.K} V{self.V}"

    def allocate_records(self, B: int, T: int, device, buffers: int = 1) -> rs.ReplayRecords:
        """A records workspace for ``B`` rows of ``T`` tokens of this layer."""
        return rs.ReplayRecords.allocate(B, T, self.H, self.HV, self.K, self.V, device=device,
                                         vector_decay=self.vector_decay, buffers=buffers)

    @property
    def qkv_width(self) -> int:
        """Channels of the three token inputs (conv's output): q, k ``[H, K]`` and v ``[HV, V]``."""
        return 2 * self.H * self.K + self.HV * self.V

    def token_gates(self) -> dict[str, tuple[int, ...]]:
        """The per-token inputs beyond q, k, v, by name, with one token's shape, in the order of
        their columns in a fused in-projection: GDN, KDA: ``a`` and ``b``; Mamba2: ``dt`` and,
        where the layer gates its output, ``z``."""
        if self.kind == "mamba2":
            return {"dt": self.gate_shape, **({"z": (self.HV, self.V)} if self.mamba2.z else {})}
        return {"a": self.gate_shape, "b": (self.HV,)}

    @property
    def token_gates_width(self) -> int:
        return sum(math.prod(shape) for shape in self.token_gates().values())

    def split_tokens(self, qkv: torch.Tensor, gates: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ops' per-token inputs by name, as views: ``qkv`` holds q, k, v in that order (Mamba2
        takes them in the roles of ``C``, ``B``, ``x``, as the family names them), ``gates`` the
        columns of :meth:`token_gates` (None: none taken; more columns may follow)."""
        hk = self.H * self.K
        qkv_views = (qkv[:, :hk].unflatten(-1, (self.H, self.K)), qkv[:, hk:2 * hk].unflatten(-1, (self.H, self.K)),
                     qkv[:, 2 * hk:self.qkv_width].unflatten(-1, (self.HV, self.V)))
        tok = dict(zip(FAMILIES[self.kind].tokens, qkv_views))
        col = 0
        for name, shape in (self.token_gates() if gates is not None else {}).items():
            n = math.prod(shape)
            tok[name] = gates[:, col:col + n].unflatten(-1, shape)
            col += n
        return tok

    def draw_heads(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """The per-head parameters (:data:`HEAD_PARAMS`), on CPU: ``A_log`` (decay rates 0.5 to 8)
        and ``dt_bias``; a Mamba2 layer also its ``D`` and, by its options, ``A`` in place of
        ``A_log`` (the same values)."""
        heads = {"A_log": torch.log(0.5 + 7.5 * torch.rand(self.HV, generator=gen)),
                 "dt_bias": torch.randn(*self.gate_shape, generator=gen) * 0.5}
        if self.kind != "mamba2":
            return heads
        if self.mamba2.D is not None:       # drawn after the others: GDN and KDA draw what they drew before
            shape = (self.HV,) if self.mamba2.D == "head" else (self.HV, self.V)
            heads["D"] = torch.randn(*shape, generator=gen)
        if self.mamba2.A:
            heads["A"] = -torch.exp(heads.pop("A_log"))
        return heads


@dataclass(frozen=True)
class _Heads(_Layer, _Rows):
    """A batch of windows (``lengths``) of one recurrent layer (fields: ``lengths``, then those of
    :class:`_Layer`)."""

    def records(self, device) -> rs.ReplayRecords:
        """A records workspace for ``B`` rows of ``T`` tokens of this layer."""
        return self.allocate_records(self.B, self.T, device)


@dataclass(frozen=True)
class RecurrenceCase(_Heads):
    """A batch of windows for one GDN, KDA or Mamba2 layer. ``lengths[r]``: tokens of row ``r`` (0
    allowed); ``pad_rows``: rows whose ``state_indices`` is the null slot; ``gates``: ``"raw"``
    or ``"pre"`` (precomputed ``g``, ``beta``), ``l2norm``: of q and k (GDN and KDA: Mamba2 has
    neither option)."""

    pad_rows: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32
    act_dtype: torch.dtype = torch.float32
    gates: str = "raw"
    l2norm: bool = True

    def __post_init__(self):
        if not self.has_qk_options and (self.gates != "raw" or not self.l2norm):
            raise ValueError(f"RecurrenceCase: {self.kind} takes raw gates only, and no use_qk_l2norm")

    @property
    def has_qk_options(self) -> bool:
        """Whether the family's ops take ``scale`` and ``use_qk_l2norm`` (and precomputed gates)."""
        return bool(FAMILIES[self.kind].options)

    def op_kwargs(self) -> dict:
        qk = {"use_qk_l2norm": self.l2norm} if self.has_qk_options else {}
        return {**qk, **super().op_kwargs()}

    @property
    def label(self) -> str:
        extra = [f"state {dtype_name(self.state_dtype)}", f"act {dtype_name(self.act_dtype)}"]
        if self.has_qk_options:              # Mamba2 has one gate form
            extra.append(f"{self.gates} gates")
        if not self.l2norm:
            extra.append("no l2norm")
        if self.pad_rows:
            extra.append("pad")
        lens = ",".join(map(str, self.lengths))
        return f"{self.heads_label()} B{self.B} T[{lens}] " + " ".join(extra)


class RecurrenceProblem:
    """Inputs of a :class:`RecurrenceCase`. The token inputs (q/k/v/a/b, Mamba2's C/B/x/dt/z) are
    strided views of one fused buffer (as an engine's in-projection gives them), re-sliced after
    the buffer is copied to a device."""

    def __init__(self, case: RecurrenceCase, gen: torch.Generator):
        c = self.case = case
        self.T_total = sum(c.lengths)
        self.width = c.qkv_width + c.token_gates_width + 3      # +3: odd row stride
        fused = torch.randn(self.T_total, self.width, generator=gen)
        if not c.l2norm:   # keep the raw delta rule stable: |k|^2 * beta < 2
            fused[:, c.H * c.K:2 * c.H * c.K] *= 0.5 / c.K ** 0.5
        self.fused = fused.to(c.act_dtype)
        self.heads = c.draw_heads(gen)
        self.g = -F.softplus(torch.randn(self.T_total, *c.gate_shape, generator=gen)) * 0.5
        self.beta = torch.sigmoid(torch.randn(self.T_total, c.HV, generator=gen))
        self.num_slots = c.B * (c.T + 1) + 2
        self.state = (torch.randn(self.num_slots, c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype)
        slots = torch.randperm(self.num_slots, generator=gen).tolist()
        self.sources = [-1 if r in c.pad_rows else slots[r] for r in range(c.B)]
        spare = slots[c.B:]
        self.snapshot_slots = [[spare[r * c.T + t] for t in range(c.T)] for r in range(c.B)]
        if c.B and c.T > 1:
            self.snapshot_slots[0][0] = -1            # an entry <= null_slot is skipped
        self.qsl = query_start_loc(c.lengths)
        # accepted tokens per row: 0 .. len (the row's window)
        self.num_accepted = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in c.lengths]

    def live_rows(self) -> list[int]:
        return [r for r in range(self.case.B) if self.sources[r] > -1 and self.case.lengths[r] > 0]

    def token_inputs(self, device) -> dict[str, torch.Tensor]:
        """Per-token tensors ``[T_total, ...]`` on ``device`` (views of the fused buffer; the
        precomputed gates ``g``, ``beta`` their own tensors)."""
        c = self.case
        f = self.fused.to(device)
        if c.gates == "raw":
            return c.split_tokens(f, f[:, c.qkv_width:])
        return {**c.split_tokens(f, None), "g": self.g.to(device), "beta": self.beta.to(device)}

    def head_inputs(self, device) -> dict[str, torch.Tensor]:
        if self.case.gates == "raw":
            return {name: t.to(device) for name, t in self.heads.items()}
        return {}


# ------------------------------------------------------------------------------------------------
# conv_verify, conv_decode
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvCase(_Rows):
    """Windows of a causal conv layer of ``dim`` channels; the conv state pool in ``state_dtype``
    (None: ``act_dtype``)."""

    dim: int = 96
    width: int = 4
    pad_rows: tuple[int, ...] = ()
    act_dtype: torch.dtype = torch.float32
    state_dtype: Optional[torch.dtype] = None
    silu: bool = True
    bias: bool = True

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.state_dtype or self.act_dtype

    def _extra(self) -> str:
        extra = [dtype_name(self.act_dtype), "silu" if self.silu else "no act", "bias" if self.bias else "no bias"]
        if self.pool_dtype != self.act_dtype:
            extra.append(f"state {dtype_name(self.pool_dtype)}")
        if self.pad_rows:
            extra.append("pad")
        return " ".join(extra)

    @property
    def label(self) -> str:
        lens = ",".join(map(str, self.lengths))
        return f"conv B{len(self.lengths)} T[{lens}] dim{self.dim} width{self.width} " + self._extra()


@dataclass(frozen=True)
class ConvDecodeCase(ConvCase):
    """``conv_decode`` of the same tokens: every row decodes its window one token per call (all
    rows the same length, one token each per call)."""

    def __post_init__(self):
        if len(set(self.lengths)) > 1:
            raise ValueError(f"ConvDecodeCase: every row decodes as many tokens, got {self.lengths}")

    @property
    def label(self) -> str:
        return (f"conv_decode B{self.B} x{self.T} tokens dim{self.dim} width{self.width} " + self._extra())


class ConvProblem:
    """Inputs of a :class:`ConvCase`; ``x`` is a strided view of a wider buffer."""

    def __init__(self, case: ConvCase, gen: torch.Generator):
        self.case = case
        B, hist = len(case.lengths), case.width - 1
        T_total = sum(case.lengths)
        self.fused = torch.randn(T_total, case.dim + 5, generator=gen).to(case.act_dtype)
        self.weight = torch.randn(case.dim, case.width, generator=gen).to(case.act_dtype)
        self.bias = torch.randn(case.dim, generator=gen).to(case.act_dtype) if case.bias else None
        num_slots = B + 2
        self.pool = torch.randn(num_slots, case.dim, hist + case.T, generator=gen).to(case.pool_dtype)
        slots = torch.randperm(num_slots, generator=gen).tolist()
        self.sources = [-1 if r in case.pad_rows else slots[r] for r in range(B)]
        self.qsl = query_start_loc(case.lengths)


# ------------------------------------------------------------------------------------------------
# align-mode grouped commit: conv + GDN, KDA or Mamba2 layers in two KV-cache groups, as an engine runs them
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlignCase(_Heads):
    """``lengths[r]``: window of batch row ``r``; row ``r`` serves request ``request_of[r]`` (all
    requests, permuted, when ``permute``). Layer ``l`` belongs to group ``l % 2``."""

    block_sizes: tuple[int, int] = (4, 3)
    layers: int = 3
    conv_width: int = 4
    state_dtype: torch.dtype = torch.float32
    permute: bool = False
    pad_row: bool = False
    unallocated: bool = True

    @property
    def label(self) -> str:
        lens = ",".join(map(str, self.lengths))
        extra = [f"state {dtype_name(self.state_dtype)}", f"bs {self.block_sizes[0]}/{self.block_sizes[1]}"]
        if self.permute:
            extra.append("request_indices")
        if self.pad_row:
            extra.append("pad")
        return f"align {self.layers}L/2G {self.heads_label()} B{self.B} T[{lens}] " + " ".join(extra)

    def capabilities(self) -> tuple[str, ...]:
        return ("conv_verify", "plan_commit") + super().capabilities()

    @property
    def conv_dim(self) -> int:
        return self.qkv_width


def random_align_step(B: int, lengths: Sequence[int], block_sizes: Sequence[int], rng: random.Random,
                      *, permute: bool, pad_row: bool, unallocated: bool) -> dict:
    """Host-side metadata of one align-mode step for ``len(block_sizes)`` groups.

    Every request owns its own slots in every group (so no two rows can write one slot), has
    ``num_computed_tokens`` at a random offset (on and off block boundaries) and its source slot
    where align mode keeps it: the block holding its last computed token. ``unallocated``: some
    requests have ``-1`` blocks past their source (the final block may then be null: no write).
    """
    T = max(max(lengths), 1)
    request_of = list(range(B))
    if permute:
        rng.shuffle(request_of)
    nct = [rng.randrange(0, 4 * max(block_sizes)) for _ in range(B)]
    if B > 1:
        nct[0] = 2 * block_sizes[0]                     # window starts exactly on a boundary
    num_accepted = [0] * B
    for r in range(B):
        num_accepted[request_of[r]] = rng.randint(0, lengths[r])
    groups = []
    for g, bs in enumerate(block_sizes):
        width = (max(nct) + T) // bs + 2
        slots = list(range(B * width))
        rng.shuffle(slots)
        table = [slots[q * width:(q + 1) * width] for q in range(B)]
        if unallocated:
            for q in range(1, B, 2 if g == 0 else 3):
                first = (nct[q] // bs) + 1
                for j in range(first, width):
                    table[q][j] = -1
        sources = [table[q][(nct[q] - 1) // bs] if nct[q] > 0 else table[q][0] for q in range(B)]
        state_indices = [sources[request_of[r]] for r in range(B)]
        if pad_row:
            state_indices[-1] = -1
        groups.append({"block_size": bs, "block_table": table, "state_indices": state_indices,
                       "num_slots": B * width})
    return {"request_of": request_of, "num_computed_tokens": nct, "num_accepted": num_accepted,
            "groups": groups, "permute": permute}


def align_layers(case: AlignCase, meta: dict, gen: torch.Generator) -> tuple[list[dict], list[dict]]:
    """Per layer: the weights (fused in-projection output, conv and gate parameters) and the
    pools (recurrent states, conv states) of an :class:`AlignCase` step described by ``meta``."""
    c = case
    T_total = sum(c.lengths)
    weights, pools = [], []
    for layer in range(c.layers):
        num_slots = meta["groups"][layer % 2]["num_slots"]
        weights.append({
            "proj": torch.randn(T_total, c.conv_dim + c.token_gates_width + 1, generator=gen),
            "conv_w": torch.randn(c.conv_dim, c.conv_width, generator=gen) * 0.5,
            "conv_b": torch.randn(c.conv_dim, generator=gen) * 0.1,
            **c.draw_heads(gen),
        })
        pools.append({
            "state": (torch.randn(num_slots, c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype),
            "conv": torch.randn(num_slots, c.conv_dim, c.conv_width - 1 + c.T, generator=gen),
        })
    return weights, pools


# ------------------------------------------------------------------------------------------------
# plan_commit
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanCase:
    """``count`` random align and non-align steps through ``plan_commit``."""

    count: int = 24

    @property
    def label(self) -> str:
        return f"plan_commit {self.count} random steps"


# ------------------------------------------------------------------------------------------------
# deferred commits: a random sequence of engine steps, deferring against eager
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeferredCase:
    """``steps`` engine steps (``sequence.py``): requests join, leave and sit steps out, rows are
    ragged (windows of up to ``T`` tokens, up to ``max_batch`` rows), some are padding. One layer
    of each of ``kinds``, each with a conv of ``conv_width``; layer ``l`` in KV-cache group
    ``l % len(block_sizes)``. ``align``: prefix caching, block size ``block_sizes[g]`` in group
    ``g`` (without it the block sizes only count the groups)."""

    kinds: tuple[str, ...] = ("gdn", "kda")
    block_sizes: tuple[int, ...] = (3,)
    align: bool = False
    steps: int = 6
    max_batch: int = 4
    T: int = 3
    H: int = 1
    HV: int = 2
    K: int = 8
    V: int = 8
    conv_width: int = 3
    state_dtype: torch.dtype = torch.float32
    lower_bound: Optional[float] = None          # KDA layers' bounded gate (None: softplus)
    mamba2: Mamba2Options = Mamba2Options()      # Mamba2 layers' optional inputs

    @property
    def groups(self) -> int:
        return len(self.block_sizes)

    def layer(self, kind: str) -> _Layer:
        """The family and shapes of a layer of ``kind`` (every layer has the case's heads)."""
        return _Layer(kind, self.H, self.HV, self.K, self.V, self.lower_bound, self.mamba2)

    @property
    def conv_dim(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    def proj_width(self, kind: str) -> int:
        """Columns of a layer's fused input: conv channels, per-token gate inputs (``a``, ``b``;
        Mamba2: ``dt``, ``z``), and one more (an odd row stride, as an engine's fused
        in-projection may give)."""
        return self.conv_dim + self.layer(kind).token_gates_width + 1

    def capabilities(self) -> tuple[str, ...]:
        kinds = sorted(set(self.kinds))
        caps = ("deferred", "commit", "conv_verify") + tuple(kinds)
        if any(self.layer(kind).vector_decay for kind in kinds):
            caps += ("vector_decay",)
        if self.state_dtype == torch.bfloat16:
            caps += ("bf16_state",)
        return caps

    @property
    def label(self) -> str:
        lb = "" if self.lower_bound is None else f" lb{self.lower_bound:g}"
        opts = f" {self.mamba2.label}" if "mamba2" in self.kinds else ""
        mode = "align bs " + "/".join(map(str, self.block_sizes)) if self.align else "non-align"
        return (f"deferred {self.steps} steps {'+'.join(self.kinds)}{lb}{opts} {self.groups}G H{self.H}/{self.HV} "
                f"K{self.K} V{self.V} B{self.max_batch} T{self.T} state {dtype_name(self.state_dtype)} {mode}")
