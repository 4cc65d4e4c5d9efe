"""``recoverssm check``: run one backend against the ``cpu_ref`` reference on random problems.

Inputs are drawn on CPU (fixed seed), copied to the target device, and the results copied back.
Two kinds of items:

* **against cpu_ref** (``vs cpu_ref``): fp32 outputs, records and states must agree within a
  relative tolerance, ``max |got - ref| / max |ref| <= tol`` (1e-5 for fp32; 1e-2 where a value is
  stored in bf16, one bf16 ulp being 2**-8), since another device may round ``exp`` or order a sum
  differently. Conv states (pure copies) and commit plans must be equal.
* **bit-exact** (``== own ...``): the backend against itself. Its commit must leave exactly the
  states its own per-token ``gdn_decode`` leaves after the same tokens (the library's promise), and
  ``gdn_verify`` must not write the state.

With ``--backend cpu_ref`` on CPU the reference is checked against itself (a smoke test of the
API paths and of the bit-exact promises, which do not compare against cpu_ref).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import recoverssm as rs
from recoverssm.core.registry import registry
from recoverssm.cli_support import torch_threads

REF = "cpu_ref"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """One row of the report. ``tol`` None means exact (``torch.equal``)."""

    case: str
    name: str
    status: str                      # "pass", "FAIL", "skip", "error"
    max_abs: Optional[float] = None
    rel: Optional[float] = None
    tol: Optional[float] = None
    note: str = ""


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want|, that / max |want|)`` on CPU in float64; inf on shape mismatch or NaN."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if got.numel() == 0:
        return 0.0, 0.0
    d = (got.double() - want.double()).abs()
    if torch.isnan(d).any():
        return float("inf"), float("inf")
    max_abs = d.max().item()
    scale = want.double().abs().max().item()
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return max_abs, rel


class Report:
    def __init__(self):
        self.items: list[Item] = []

    def close(self, case: str, name: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
              tol: float) -> Item:
        """Worst relative difference over ``(got, want)`` pairs must be ``<= tol``."""
        worst_abs, worst_rel = 0.0, 0.0
        for got, want in pairs:
            a, r = _diff(got, want)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
        return self._add(Item(case, name, "pass" if worst_rel <= tol else "FAIL", worst_abs, worst_rel, tol))

    def exact(self, case: str, name: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Item:
        """Every ``(got, want)`` pair must be ``torch.equal`` (same shape, dtype and bits)."""
        ok = True
        worst_abs, worst_rel = 0.0, 0.0
        for got, want in pairs:
            got, want = got.detach().cpu(), want.detach().cpu()
            ok &= got.dtype == want.dtype and torch.equal(got, want)
            a, r = _diff(got, want)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
        return self._add(Item(case, name, "pass" if ok else "FAIL", worst_abs, worst_rel, None))

    def skip(self, case: str, name: str, why: str) -> Item:
        return self._add(Item(case, name, "skip", note=why))

    def error(self, case: str, name: str, exc: BaseException) -> Item:
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return self._add(Item(case, name, "error", note=msg[:200]))

    def _add(self, item: Item) -> Item:
        self.items.append(item)
        return item

    @property
    def passed(self) -> bool:
        return all(i.status in ("pass", "skip") for i in self.items)


# ------------------------------------------------------------------------------------------------
# random problems (built on CPU)
# ------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class GdnCase(_Rows):
    """A batch of windows for one GDN layer. ``lengths[r]``: tokens of row ``r`` (0 allowed);
    ``pad_rows``: rows whose ``state_indices`` is the null slot."""

    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16
    pad_rows: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32
    act_dtype: torch.dtype = torch.float32
    gates: str = "raw"
    l2norm: bool = True

    @property
    def label(self) -> str:
        extra = [f"state {_name(self.state_dtype)}", f"act {_name(self.act_dtype)}", f"{self.gates} gates"]
        if not self.l2norm:
            extra.append("no l2norm")
        if self.pad_rows:
            extra.append("pad")
        lens = ",".join(map(str, self.lengths))
        return f"gdn B{self.B} T[{lens}] H{self.H}/{self.HV} K{self.K} V{self.V} " + " ".join(extra)


class GdnProblem:
    """Inputs of a :class:`GdnCase`. q/k/v/a/b are strided views of one fused buffer (as an
    engine's in-projection gives them), re-sliced after the buffer is copied to a device."""

    def __init__(self, case: GdnCase, gen: torch.Generator):
        c = self.case = case
        self.T_total = sum(c.lengths)
        self.width = 2 * c.H * c.K + c.HV * c.V + 2 * c.HV + 3      # +3: odd row stride
        fused = torch.randn(self.T_total, self.width, generator=gen)
        if not c.l2norm:   # keep the raw delta rule stable: |k|^2 * beta < 2
            fused[:, c.H * c.K:2 * c.H * c.K] *= 0.5 / c.K ** 0.5
        self.fused = fused.to(c.act_dtype)
        self.A_log = torch.log(0.5 + 7.5 * torch.rand(c.HV, generator=gen))
        self.dt_bias = torch.randn(c.HV, generator=gen) * 0.5
        self.g = -F.softplus(torch.randn(self.T_total, c.HV, generator=gen)) * 0.5
        self.beta = torch.sigmoid(torch.randn(self.T_total, c.HV, generator=gen))
        self.num_slots = c.B * (c.T + 1) + 2
        self.state = (torch.randn(self.num_slots, c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype)
        slots = torch.randperm(self.num_slots, generator=gen).tolist()
        self.sources = [-1 if r in c.pad_rows else slots[r] for r in range(c.B)]
        spare = slots[c.B:]
        self.snapshot_slots = [[spare[r * c.T + t] for t in range(c.T)] for r in range(c.B)]
        if c.B and c.T > 1:
            self.snapshot_slots[0][0] = -1            # an entry <= null_slot is skipped
        self.qsl = [0]
        for n in c.lengths:
            self.qsl.append(self.qsl[-1] + n)
        # accepted tokens per row: 0 .. len + 1 (over-long values must clamp to len)
        self.num_accepted = [int(torch.randint(0, n + 2, (1,), generator=gen)) for n in c.lengths]

    def live_rows(self) -> list[int]:
        return [r for r in range(self.case.B) if self.sources[r] > -1 and self.case.lengths[r] > 0]

    def token_inputs(self, device) -> dict[str, torch.Tensor]:
        """Per-token tensors ``[T_total, ...]`` on ``device`` (views of the fused buffer)."""
        c = self.case
        f = self.fused.to(device)
        hk, o = c.H * c.K, 2 * c.H * c.K + c.HV * c.V
        x = {"q": f[:, :hk].unflatten(-1, (c.H, c.K)), "k": f[:, hk:2 * hk].unflatten(-1, (c.H, c.K)),
             "v": f[:, 2 * hk:o].unflatten(-1, (c.HV, c.V))}
        if c.gates == "raw":
            x.update(a=f[:, o:o + c.HV], b=f[:, o + c.HV:o + 2 * c.HV])
        else:
            x.update(g=self.g.to(device), beta=self.beta.to(device))
        return x

    def head_inputs(self, device) -> dict[str, torch.Tensor]:
        if self.case.gates == "raw":
            return {"A_log": self.A_log.to(device), "dt_bias": self.dt_bias.to(device)}
        return {}


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _prefix(tokens: dict[str, torch.Tensor], qsl: Sequence[int], counts: Sequence[int]):
    """The first ``counts[r]`` tokens of each row (contiguous copies) and their ``query_start_loc``."""
    idx = [qsl[r] + t for r in range(len(counts)) for t in range(counts[r])]
    first = next(iter(tokens.values()))
    index = torch.tensor(idx, dtype=torch.long, device=first.device)
    new_qsl = [0]
    for n in counts:
        new_qsl.append(new_qsl[-1] + n)
    return {k: v.index_select(0, index) for k, v in tokens.items()}, new_qsl


# ------------------------------------------------------------------------------------------------
# GDN ops: verify, decode, snapshot, non-align commit
# ------------------------------------------------------------------------------------------------
class GdnRun:
    """Every GDN op of one problem on one backend and device; results stay on that device."""

    def __init__(self, p: GdnProblem, backend: str, device: torch.device):
        self.p, self.backend, self.device = p, backend, device
        self.tok = p.token_inputs(device)
        self.heads = p.head_inputs(device)
        self.si = _i32(p.sources, device)
        self.qsl = _i32(p.qsl, device)
        self.common = dict(use_qk_l2norm=p.case.l2norm, backend=backend)

    def verify(self):
        c = self.p.case
        state = self.p.state.to(self.device)
        rec = rs.ReplayRecords.allocate(c.B, c.T, c.H, c.HV, c.K, c.V, device=self.device)
        out = rs.gdn_verify(**self.tok, **self.heads, state=state, state_indices=self.si,
                            query_start_loc=self.qsl, records=rec, **self.common)
        return out, rec, state

    def decode(self, counts: Optional[Sequence[int]] = None, state: Optional[torch.Tensor] = None):
        """Native per-token path over the first ``counts[r]`` tokens of each row (default: all)."""
        counts = self.p.case.lengths if counts is None else counts
        tok, qsl = _prefix(self.tok, self.p.qsl, counts)
        state = (self.p.state if state is None else state).to(self.device).clone()
        out = rs.gdn_decode(**tok, **self.heads, state=state, state_indices=self.si,
                            query_start_loc=_i32(qsl, self.device), **self.common)
        return out, state

    def snapshot(self):
        state = self.p.state.to(self.device).clone()
        out = rs.gdn_spec_decode_snapshot(**self.tok, **self.heads, state=state, state_indices=self.si,
                                          query_start_loc=self.qsl,
                                          snapshot_slots=torch.tensor(self.p.snapshot_slots, dtype=torch.int32,
                                                                      device=self.device),
                                          **self.common)
        return out, state

    def commit(self, rec: rs.ReplayRecords):
        state = self.p.state.to(self.device).clone()
        ctx = rs.CommitContext([[rs.LayerCache(state, rec)]], max_batch=self.p.case.B, backend=self.backend)
        ctx.commit(_i32(self.p.num_accepted, self.device), self.si, self.qsl)
        return state


def _record_pairs(p: GdnProblem, got: rs.ReplayRecords, want: rs.ReplayRecords):
    """The records of live rows at positions ``t < len`` (the rest of the workspace is free)."""
    rows, ts = [], []
    for r in p.live_rows():
        for t in range(p.case.lengths[r]):
            rows.append(r)
            ts.append(t)
    pairs = []
    for field_ in ("correction", "key", "decay"):
        g, w = getattr(got, field_).cpu(), getattr(want, field_)
        pairs.append((g[rows, :, ts], w[rows, :, ts]))
    return pairs


def check_gdn(report: Report, case: GdnCase, backend, device, gen) -> None:
    label = case.label
    caps = backend.capabilities
    if case.state_dtype == torch.bfloat16 and "bf16_state" not in caps:
        report.skip(label, "all", "no bf16_state capability")
        return
    p = GdnProblem(case, gen)
    ref, dut = GdnRun(p, REF, torch.device("cpu")), GdnRun(p, backend.name, device)
    out_tol = TOL[case.act_dtype]
    state_tol = TOL[case.state_dtype]

    def guarded(name, fn):
        try:
            fn()
        except Exception as e:   # report, and go on with the next item
            report.error(label, name, e)

    rec_ref = rec_dut = None

    def verify():
        nonlocal rec_ref, rec_dut
        o_ref, rec_ref, _ = ref.verify()
        o_dut, rec_dut, st_dut = dut.verify()
        report.close(label, "gdn_verify out vs cpu_ref", [(o_dut, o_ref)], out_tol)
        report.close(label, "gdn_verify records vs cpu_ref", _record_pairs(p, rec_dut, rec_ref), TOL[torch.float32])
        report.exact(label, "gdn_verify leaves state unwritten", [(st_dut, p.state)])

    guarded("gdn_verify", verify)

    if "gdn_decode" in caps:
        def decode():
            o_ref, s_ref = ref.decode()
            o_dut, s_dut = dut.decode()
            report.close(label, "gdn_decode out vs cpu_ref", [(o_dut, o_ref)], out_tol)
            report.close(label, "gdn_decode state vs cpu_ref", [(s_dut, s_ref)], state_tol)
        guarded("gdn_decode", decode)
    else:
        report.skip(label, "gdn_decode", "no gdn_decode capability")

    if "gdn_spec_decode_snapshot" in caps and "gdn_decode" in caps:
        def snapshot():
            o_ref, s_ref = ref.snapshot()
            o_dut, s_dut = dut.snapshot()
            report.close(label, "snapshot states vs cpu_ref", [(s_dut, s_ref)], state_tol)
            # The state after a row's last position is what decode leaves in the row's slot.
            _, dec = dut.decode()
            pairs = [(s_dut[p.snapshot_slots[r][case.lengths[r] - 1]], dec[p.sources[r]])
                     for r in p.live_rows() if p.snapshot_slots[r][case.lengths[r] - 1] > -1]
            report.exact(label, "snapshot last state == own decode", pairs)
        guarded("snapshot", snapshot)
    else:
        report.skip(label, "snapshot", "no gdn_spec_decode_snapshot capability")

    if "commit" in caps and rec_dut is not None:
        def commit():
            c_ref = ref.commit(rec_ref)
            c_dut = dut.commit(rec_dut)
            report.close(label, "commit vs cpu_ref", [(c_dut, c_ref)], state_tol)
            # The promise: commit of n accepted tokens == per-token decode of those n tokens.
            n = [min(a, length) for a, length in zip(p.num_accepted, case.lengths)]
            _, dec = dut.decode(n)
            report.exact(label, "commit == own decode (bit-exact)", [(c_dut, dec)])
        guarded("commit", commit)
    elif "commit" not in caps:
        report.skip(label, "commit", "no commit capability")


# ------------------------------------------------------------------------------------------------
# conv_verify
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvCase(_Rows):
    """Windows of a causal conv layer of ``dim`` channels."""

    dim: int = 96
    width: int = 4
    pad_rows: tuple[int, ...] = ()
    act_dtype: torch.dtype = torch.float32
    silu: bool = True
    bias: bool = True

    @property
    def label(self) -> str:
        lens = ",".join(map(str, self.lengths))
        extra = [_name(self.act_dtype), "silu" if self.silu else "no act", "bias" if self.bias else "no bias"]
        if self.pad_rows:
            extra.append("pad")
        return f"conv B{len(self.lengths)} T[{lens}] dim{self.dim} width{self.width} " + " ".join(extra)


def check_conv(report: Report, case: ConvCase, backend, device, gen) -> None:
    label = case.label
    if "conv_verify" not in backend.capabilities:
        report.skip(label, "conv_verify", "no conv_verify capability")
        return
    B, hist = len(case.lengths), case.width - 1
    T_total = sum(case.lengths)
    fused = torch.randn(T_total, case.dim + 5, generator=gen).to(case.act_dtype)   # x: a strided view
    weight = torch.randn(case.dim, case.width, generator=gen).to(case.act_dtype)
    bias = torch.randn(case.dim, generator=gen).to(case.act_dtype) if case.bias else None
    num_slots = B + 2
    pool = torch.randn(num_slots, case.dim, hist + case.T, generator=gen).to(case.act_dtype)
    slots = torch.randperm(num_slots, generator=gen).tolist()
    si = [-1 if r in case.pad_rows else slots[r] for r in range(B)]
    qsl = [0]
    for n in case.lengths:
        qsl.append(qsl[-1] + n)

    def run(name, dev):
        cs = pool.to(dev).clone()
        y = rs.conv_verify(fused.to(dev)[:, :case.dim], cs, weight.to(dev),
                           None if bias is None else bias.to(dev), state_indices=_i32(si, dev),
                           query_start_loc=_i32(qsl, dev), activation="silu" if case.silu else None,
                           backend=name)
        return y, cs

    try:
        y_ref, cs_ref = run(REF, torch.device("cpu"))
        y_dut, cs_dut = run(backend.name, device)
    except Exception as e:
        report.error(label, "conv_verify", e)
        return
    report.close(label, "conv_verify out vs cpu_ref", [(y_dut, y_ref)], TOL[case.act_dtype])
    report.exact(label, "conv_verify conv_state vs cpu_ref", [(cs_dut, cs_ref)])


# ------------------------------------------------------------------------------------------------
# align-mode grouped commit: conv + GDN layers in two KV-cache groups, as an engine runs them
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlignCase(_Rows):
    """``lengths[r]``: window of batch row ``r``; row ``r`` serves request ``request_of[r]`` (all
    requests, permuted, when ``permute``). Layer ``l`` belongs to group ``l % 2``."""

    block_sizes: tuple[int, int] = (4, 3)
    layers: int = 3
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16
    conv_width: int = 4
    state_dtype: torch.dtype = torch.float32
    permute: bool = False
    pad_row: bool = False
    unallocated: bool = True

    @property
    def label(self) -> str:
        lens = ",".join(map(str, self.lengths))
        extra = [f"state {_name(self.state_dtype)}", f"bs {self.block_sizes[0]}/{self.block_sizes[1]}"]
        if self.permute:
            extra.append("request_indices")
        if self.pad_row:
            extra.append("pad")
        return (f"align {self.layers}L/2G B{self.B} T[{lens}] H{self.H}/{self.HV} K{self.K} V{self.V} "
                + " ".join(extra))


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
        num_accepted[request_of[r]] = rng.randint(0, lengths[r] + 1)
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


class AlignRun:
    """One verify (conv + GDN per layer) and one grouped align-mode commit on a backend."""

    def __init__(self, case: AlignCase, meta: dict, weights: list[dict], pools: list[dict],
                 backend: str, device: torch.device):
        self.case, self.meta, self.backend, self.device = case, meta, backend, device
        d = device
        self.weights = [{k: v.to(d) for k, v in w.items()} for w in weights]
        self.state = [p["state"].to(d).clone() for p in pools]
        self.conv = [p["conv"].to(d).clone() for p in pools]
        self.qsl_host = [0]
        for n in case.lengths:
            self.qsl_host.append(self.qsl_host[-1] + n)
        self.qsl = _i32(self.qsl_host, d)
        G = len(meta["groups"])
        self.si = [_i32(g["state_indices"], d) for g in meta["groups"]]
        self.tables = [torch.tensor(g["block_table"], dtype=torch.int32, device=d) for g in meta["groups"]]
        self.nct = _i32(meta["num_computed_tokens"], d)
        self.na = _i32(meta["num_accepted"], d)
        self.ri = [_i32(meta["request_of"], d)] * G if meta["permute"] else None
        self.records = [rs.ReplayRecords.allocate(case.B, case.T, case.H, case.HV, case.K, case.V, device=d)
                        for _ in range(case.layers)]
        self.tokens: list[dict] = []

    def group(self, layer: int) -> int:
        return layer % 2

    def verify(self) -> None:
        c = self.case
        hk, conv_dim = c.H * c.K, 2 * c.H * c.K + c.HV * c.V
        for l, w in enumerate(self.weights):
            g = self.group(l)
            proj = w["proj"]
            y = rs.conv_verify(proj[:, :conv_dim], self.conv[l], w["conv_w"], w["conv_b"],
                               state_indices=self.si[g], query_start_loc=self.qsl, backend=self.backend)
            tok = {"q": y[:, :hk].unflatten(-1, (c.H, c.K)), "k": y[:, hk:2 * hk].unflatten(-1, (c.H, c.K)),
                   "v": y[:, 2 * hk:].unflatten(-1, (c.HV, c.V)),
                   "a": proj[:, conv_dim:conv_dim + c.HV], "b": proj[:, conv_dim + c.HV:conv_dim + 2 * c.HV]}
            rs.gdn_verify(**tok, A_log=w["A_log"], dt_bias=w["dt_bias"], state=self.state[l],
                          state_indices=self.si[g], query_start_loc=self.qsl, records=self.records[l],
                          backend=self.backend)
            self.tokens.append(tok)

    def plans(self) -> list[rs.CommitPlan]:
        return [rs.plan_commit(self.na, self.si[g], self.qsl,
                               request_indices=None if self.ri is None else self.ri[g],
                               block_table=self.tables[g], num_computed_tokens=self.nct,
                               block_size=grp["block_size"], num_slots=grp["num_slots"], backend=self.backend)
                for g, grp in enumerate(self.meta["groups"])]

    def commit(self) -> None:
        groups = [[] for _ in self.meta["groups"]]
        for l in range(self.case.layers):
            groups[self.group(l)].append(rs.LayerCache(self.state[l], self.records[l], conv_state=self.conv[l]))
        ctx = rs.CommitContext(groups, max_batch=self.case.B, backend=self.backend)
        ctx.commit(self.na, self.si, self.qsl, request_indices=self.ri, block_table=self.tables,
                   num_computed_tokens=self.nct,
                   block_size=[g["block_size"] for g in self.meta["groups"]])

    def decode_prefix(self, layer: int, counts: Sequence[int], state_before: torch.Tensor) -> torch.Tensor:
        """This backend's per-token decode of each row's first ``counts[r]`` tokens of ``layer``,
        from ``state_before``; returns the pool (the rows' states in their source slots)."""
        w = self.weights[layer]
        tok, qsl = _prefix(self.tokens[layer], self.qsl_host, counts)
        state = state_before.to(self.device).clone()
        rs.gdn_decode(**tok, A_log=w["A_log"], dt_bias=w["dt_bias"], state=state,
                      state_indices=self.si[self.group(layer)], query_start_loc=_i32(qsl, self.device),
                      backend=self.backend)
        return state


def check_align(report: Report, case: AlignCase, backend, device, gen, rng: random.Random) -> None:
    label = case.label
    caps = backend.capabilities
    missing = [c for c in ("conv_verify", "gdn_verify", "gdn_decode", "plan_commit", "commit", "grouped_commit")
               if c not in caps]
    if case.state_dtype == torch.bfloat16 and "bf16_state" not in caps:
        missing.append("bf16_state")
    if missing:
        report.skip(label, "all", "missing capabilities: " + ", ".join(missing))
        return
    c = case
    meta = random_align_step(c.B, c.lengths, c.block_sizes, rng, permute=c.permute, pad_row=c.pad_row,
                             unallocated=c.unallocated)
    T_total = sum(c.lengths)
    conv_dim = 2 * c.H * c.K + c.HV * c.V
    weights, pools = [], []
    for l in range(c.layers):
        num_slots = meta["groups"][l % 2]["num_slots"]
        weights.append({
            "proj": torch.randn(T_total, conv_dim + 2 * c.HV + 1, generator=gen),
            "conv_w": torch.randn(conv_dim, c.conv_width, generator=gen) * 0.5,
            "conv_b": torch.randn(conv_dim, generator=gen) * 0.1,
            "A_log": torch.log(0.5 + 7.5 * torch.rand(c.HV, generator=gen)),
            "dt_bias": torch.randn(c.HV, generator=gen) * 0.5,
        })
        pools.append({
            "state": (torch.randn(num_slots, c.HV, c.V, c.K, generator=gen) * 0.3).to(c.state_dtype),
            "conv": torch.randn(num_slots, conv_dim, c.conv_width - 1 + c.T, generator=gen),
        })
    phase = "setup"
    try:
        ref = AlignRun(c, meta, weights, pools, REF, torch.device("cpu"))
        dut = AlignRun(c, meta, weights, pools, backend.name, device)
        phase = "conv_verify + gdn_verify"
        for run in (ref, dut):
            run.verify()
        phase = "plan_commit"
        plans_ref, plans_dut = ref.plans(), dut.plans()
        after_verify = [(s.clone(), cv.clone()) for s, cv in zip(dut.state, dut.conv)]
        phase = "grouped align commit"
        for run in (ref, dut):
            run.commit()
    except Exception as e:
        report.error(label, phase, e)
        return

    fields = ("commit_len", "final_slot", "boundary_slot", "boundary_len")
    report.exact(label, "plan_commit vs cpu_ref (2 groups)",
                 [(getattr(pd, f), getattr(pr, f)) for pd, pr in zip(plans_dut, plans_ref) for f in fields])
    report.close(label, "commit states vs cpu_ref", list(zip(dut.state, ref.state)), TOL[c.state_dtype])

    # Bit-exact: final slot == own decode of commit_len tokens from the source, boundary slot ==
    # own decode of boundary_len tokens; every other slot untouched. Conv: the contract's rule.
    try:
        state_pairs, conv_pairs = [], []
        hist = c.conv_width - 1
        for l in range(c.layers):
            plan = plans_ref[l % 2].as_dict()
            src = meta["groups"][l % 2]["state_indices"]
            state0, conv0 = after_verify[l]
            dec_n = dut.decode_prefix(l, plan["commit_len"], state0)
            dec_b = dut.decode_prefix(l, [bl if bs > -1 else 0 for bl, bs in
                                          zip(plan["boundary_len"], plan["boundary_slot"])], state0)
            want_state, want_conv = state0.clone(), conv0.clone()
            for r in range(c.B):
                n, final, bslot, blen = (plan[f][r] for f in fields)
                if n == 0:
                    continue
                window = conv0[src[r]].clone()
                if bslot > -1:
                    want_state[bslot] = dec_b[src[r]]
                    want_conv[bslot, :, :hist] = window[:, blen:blen + hist]
                want_state[final] = dec_n[src[r]]
                want_conv[final, :, :hist] = window[:, n:n + hist]
            state_pairs.append((dut.state[l], want_state))
            conv_pairs.append((dut.conv[l], want_conv))
        report.exact(label, "commit == own decode (final+boundary)", state_pairs)
        report.exact(label, "conv compaction (contract rule)", conv_pairs)
    except Exception as e:
        report.error(label, "commit == own decode", e)


def check_plans(report: Report, backend, device, rng: random.Random, count: int = 24) -> None:
    """``plan_commit`` on random align and non-align steps, exact against cpu_ref."""
    label = f"plan_commit {count} random steps"
    if "plan_commit" not in backend.capabilities:
        report.skip(label, "plan_commit", "no plan_commit capability")
        return
    pairs = []
    try:
        for i in range(count):
            B = rng.randint(1, 6)
            lengths = [rng.randint(0, 5) for _ in range(B)]
            meta = random_align_step(B, lengths, (rng.randint(1, 5),), rng, permute=i % 3 == 1,
                                     pad_row=i % 4 == 2, unallocated=i % 2 == 0)
            grp = meta["groups"][0]
            qsl = [0]
            for n in lengths:
                qsl.append(qsl[-1] + n)
            align = i % 5 != 4
            for name, dev in ((REF, torch.device("cpu")), (backend.name, device)):
                plan = rs.plan_commit(
                    _i32(meta["num_accepted"], dev), _i32(grp["state_indices"], dev), _i32(qsl, dev),
                    request_indices=_i32(meta["request_of"], dev) if meta["permute"] else None,
                    block_table=torch.tensor(grp["block_table"], dtype=torch.int32, device=dev) if align else None,
                    num_computed_tokens=_i32(meta["num_computed_tokens"], dev) if align else None,
                    block_size=grp["block_size"] if align else None, num_slots=grp["num_slots"], backend=name)
                if name == REF:
                    want = plan
                else:
                    pairs += [(getattr(plan, f), getattr(want, f))
                              for f in ("commit_len", "final_slot", "boundary_slot", "boundary_len")]
    except Exception as e:
        report.error(label, "plan_commit", e)
        return
    report.exact(label, "plan_commit vs cpu_ref", pairs)


# ------------------------------------------------------------------------------------------------
# the suite
# ------------------------------------------------------------------------------------------------
def cases(device: torch.device) -> list:
    """Small shapes everywhere (the Triton interpreter runs these on CPU); larger ones on a GPU."""
    bf16 = torch.bfloat16
    suite = [
        GdnCase(lengths=(4, 3, 0, 4), pad_rows=(3,)),
        GdnCase(lengths=(3, 1, 2), H=1, HV=2, K=16, V=8, gates="pre", l2norm=False),
        GdnCase(lengths=(4, 2), state_dtype=bf16),
        GdnCase(lengths=(2, 1, 2, 2), H=2, HV=2, K=8, V=16, act_dtype=bf16),
        ConvCase(lengths=(4, 0, 3, 2), pad_rows=(3,)),
        ConvCase(lengths=(1, 4), dim=40, width=2, silu=False, bias=False),
        ConvCase(lengths=(3, 3), dim=64, act_dtype=bf16),
        AlignCase(lengths=(4, 4, 3, 4)),
        AlignCase(lengths=(4, 2, 4), block_sizes=(2, 5), permute=True, pad_row=True),
        AlignCase(lengths=(3, 4), state_dtype=bf16, block_sizes=(3, 4)),
        "plans",
    ]
    if device.type != "cpu":
        suite += [
            GdnCase(lengths=(8,) * 12 + (5, 0, 3, 8), pad_rows=(14,), H=4, HV=8, K=128, V=128),
            GdnCase(lengths=(4,) * 16, H=16, HV=32, K=128, V=128, state_dtype=bf16),
            GdnCase(lengths=(6, 1, 6, 4), H=4, HV=8, K=64, V=128, act_dtype=bf16, gates="pre"),
            ConvCase(lengths=(8,) * 8 + (3, 0), dim=4096 + 2048),
            AlignCase(lengths=(4,) * 8, block_sizes=(8, 5), layers=4, H=4, HV=8, K=128, V=128),
            AlignCase(lengths=(6, 6, 2, 6), block_sizes=(4, 16), H=4, HV=8, K=64, V=128,
                      state_dtype=bf16, permute=True),
        ]
    return suite


def run_check(backend_name: Optional[str], device: torch.device, seed: int = 0,
              on_case: Optional[Callable[[str], None]] = None) -> tuple[Report, object, str]:
    """Run the suite; returns ``(report, backend, reason)``."""
    backend, reason = registry().resolve(backend_name, device)
    report = Report()
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for case in cases(device):
        if case == "plans":
            check_plans(report, backend, device, rng)
            label = "plan_commit"
        elif isinstance(case, GdnCase):
            check_gdn(report, case, backend, device, gen)
            label = case.label
        elif isinstance(case, ConvCase):
            check_conv(report, case, backend, device, gen)
            label = case.label
        else:
            check_align(report, case, backend, device, gen, rng)
            label = case.label
        if on_case:
            on_case(label)
    return report, backend, reason


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend to check (default: the one selected for the device)")
    p.add_argument("--device", default=None,
                   help="device of the backend's tensors (default: cpu under TRITON_INTERPRET=1 or for "
                        "cpu backends, else the backend's device type, else cuda if present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random problems (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; the problems are tiny)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def default_device(backend_name: Optional[str]) -> torch.device:
    if os.environ.get("TRITON_INTERPRET") == "1" and backend_name not in (None, REF):
        return torch.device("cpu")
    if backend_name is not None:
        try:
            be = registry().backends().get(backend_name)
        except Exception:
            be = None
        if be is not None and be.device_types:
            return torch.device(be.device_types[0])
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fmt(x: Optional[float], spec: str = ".1e") -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return format(x, spec)


def format_table(report: Report) -> list[str]:
    """One heading line per case, its items indented below it."""
    name_w = max([len(i.name) for i in report.items] + [4]) + 2
    lines = [f"{'case / item':<{name_w}}  {'max|diff|':>9}  {'rel':>8}  {'tol':>7}  result"]
    last_case = None
    for i in report.items:
        if i.case != last_case:
            lines.append(i.case)
            last_case = i.case
        tol = "exact" if i.tol is None and i.status in ("pass", "FAIL") else _fmt(i.tol, ".0e")
        status = i.status + (f" ({i.note})" if i.note else "")
        lines.append(f"  {i.name:<{name_w - 2}}  {_fmt(i.max_abs):>9}  {_fmt(i.rel):>8}  {tol:>7}  {status}")
    return lines


def _main(args: argparse.Namespace) -> int:
    from recoverssm.demo.progress import ProgressBar

    device = torch.device(args.device) if args.device else default_device(args.backend)
    bar = ProgressBar(len(cases(device)), "cases", enabled=False if args.json else None)
    t0 = time.perf_counter()
    try:
        with bar:
            report, backend, reason = run_check(args.backend, device, args.seed,
                                                on_case=lambda label: bar.update(1, label[:40]))
    except (rs.BackendError, RuntimeError) as e:
        bar.close()
        print(f"recoverssm check: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    counts = {s: sum(i.status == s for i in report.items) for s in ("pass", "FAIL", "error", "skip")}
    if args.json:
        print(json.dumps({"backend": backend.name, "device": str(device), "reason": reason,
                          "passed": report.passed, "counts": counts, "elapsed_s": elapsed,
                          "items": [asdict(i) for i in report.items]}, indent=2))
    else:
        against = " (cpu_ref against itself: a smoke test)" if backend.name == REF else ""
        print(f"recoverssm check: backend {backend.name} on {device} ({reason}) against cpu_ref{against}")
        print()
        for line in format_table(report):
            print(line)
        print()
        verdict = "PASSED" if report.passed else "FAILED"
        print(f"{verdict}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['error']} errors, "
              f"{counts['skip']} skipped in {elapsed:.1f} s")
    return 0 if report.passed else 1


def main(args: argparse.Namespace) -> int:
    """Run with ``args.threads`` torch threads, restoring the caller's setting afterwards."""
    with torch_threads(args.threads):
        return _main(args)
