"""The tests' problem builders, and an independent float64 reference for the cpu_ref tests.

Nothing here calls the math of the code under test: the reference recurrence, gates, l2norm and
conv are written again in float64, straight from the math in docs/API.md.

Two ways to build a GDN :class:`Problem`:

* :func:`make_problem` / :func:`assemble` (the cpu_ref tests): a batch assembled from per-row
  data (each row's tokens and starting state come from its own seed), so the same row can be
  placed in different batches and compared bit for bit;
* :func:`make_batch_problem` (the kernel and backend tests): the whole batch from one seed, on any
  device, with q/k/v strided views of one fused projection, shuffled source slots, padding rows
  and optionally gates at the edges of their range.

:func:`conv_problem` and :func:`align_case` give the kernel tests' conv and align-mode inputs.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

import recoverssm as rs

F32, BF16 = torch.float32, torch.bfloat16
I32 = torch.int32


def backends() -> list:
    """The backends whose kernels run here: ``cpu_ref``, and ``cuda`` on a GPU or under the interpreter."""
    names = ["cpu_ref"]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.cuda.is_available():
        names.append("cuda")
    return names


def device_of(backend: str) -> str:
    """The device of a backend's tensors: the GPU for ``cuda`` where one is present, else the CPU."""
    return "cuda" if backend == "cuda" and torch.cuda.is_available() else "cpu"


def i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=I32)


def qsl_of(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return i32(out)


@dataclass(frozen=True)
class Dims:
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16


# ------------------------------------------------------------------------------------------------
# per-layer gate parameters and per-row data
# ------------------------------------------------------------------------------------------------
# "extreme" regime: per token and head, a and b are drawn from these menus; A_log per head is fixed
# so that every combination (decay ~1, decay ~0 / underflow, softplus linear branch, beta ~0 / ~1)
# shows up.
EXTREME_A = (-40.0, -12.0, -3.0, 5.0, 25.0, 30.0, 95.0)
EXTREME_B = (-40.0, -15.0, 0.0, 15.0, 40.0)
EXTREME_A_LOG = (-10.0, -6.0, 0.5, 3.0)


def layer_params(seed: int, HV: int, regime: str = "normal") -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log, dt_bias)``, fp32 ``[HV]``."""
    g = torch.Generator().manual_seed(10_000 + seed)
    if regime == "extreme":
        A_log = torch.tensor([EXTREME_A_LOG[h % len(EXTREME_A_LOG)] for h in range(HV)], dtype=F32)
        dt_bias = (torch.rand(HV, generator=g) - 0.5).float()
    else:
        A_log = (torch.randn(HV, generator=g) * 0.5 - 1.0).float()
        dt_bias = (torch.randn(HV, generator=g) * 0.5).float()
    return A_log, dt_bias


def row_data(seed: int, length: int, dims: Dims = Dims(), *, act_dtype=F32, state_dtype=F32,
             gate_form: str = "raw", regime: str = "normal", state_scale: float = 0.3) -> dict:
    """One row's inputs (``length`` tokens) and its starting state ``[HV, V, K]``."""
    H, HV, K, V = dims.H, dims.HV, dims.K, dims.V
    g = torch.Generator().manual_seed(seed)
    d = {
        "q": torch.randn(length, H, K, generator=g).to(act_dtype),
        "k": torch.randn(length, H, K, generator=g).to(act_dtype),
        "v": torch.randn(length, HV, V, generator=g).to(act_dtype),
        "state0": (torch.randn(HV, V, K, generator=g) * state_scale).to(state_dtype),
    }
    if regime == "extreme":
        ia = torch.randint(0, len(EXTREME_A), (length, HV), generator=g)
        ib = torch.randint(0, len(EXTREME_B), (length, HV), generator=g)
        a = torch.tensor(EXTREME_A)[ia]
        b = torch.tensor(EXTREME_B)[ib]
    else:
        a = torch.randn(length, HV, generator=g)
        b = torch.randn(length, HV, generator=g) * 2
    if gate_form == "raw":
        d["a"], d["b"] = a.to(act_dtype), b.to(act_dtype)
    else:
        # precomputed gates: g <= 0, beta in (0, 1)
        d["g"] = (-torch.rand(length, HV, generator=g) * 3 if regime == "normal"
                  else -torch.tensor((0.0, 1e-7, 30.0, 200.0))[ia % 4]).float()
        d["beta"] = torch.sigmoid(b).float()
    return d


@dataclass
class Problem:
    dims: Dims
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: dict
    state: torch.Tensor
    state_indices: torch.Tensor
    qsl: torch.Tensor
    lens: list
    rows: list = field(default_factory=list)
    window: Optional[int] = None            # the records' window (default: the longest row)

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def T(self) -> int:
        """The window the records are allocated for."""
        return self.window or max(max(self.lens, default=1), 1)

    @property
    def T_total(self) -> int:
        return self.q.shape[0]

    def call_kwargs(self, state: Optional[torch.Tensor] = None, **over) -> dict:
        """Keyword arguments of the GDN ops (state, indices, gates), ``over`` taking precedence."""
        kw = dict(state=self.state if state is None else state, state_indices=self.state_indices,
                  query_start_loc=self.qsl)
        kw.update(self.gates)
        kw.update(over)
        return kw

    def records(self, max_batch: Optional[int] = None, max_window: Optional[int] = None):
        d = self.dims
        return rs.ReplayRecords.allocate(max_batch or max(self.B, 1), max_window or self.T,
                                         d.H, d.HV, d.K, d.V, device=self.q.device)


def assemble(rows: list, slots: list, *, dims: Dims = Dims(), num_slots: Optional[int] = None,
             layer_seed: int = 0, regime: str = "normal", fused: bool = False,
             state_dtype=None, junk_seed: int = 123) -> Problem:
    """Build a batch from per-row data. ``slots[r] <= -1`` makes row ``r`` a padding row (its
    tokens are still present). Slots not used by any row hold random junk state.

    ``fused``: q/k/v are views into one fused projection tensor ``[T, 2*H*K + HV*V + 3]`` and
    a/b (or g/beta) views into one ``[T, 2*HV + 1]`` tensor (same values as unfused)."""
    H, HV, K, V = dims.H, dims.HV, dims.K, dims.V
    lens = [r["q"].shape[0] for r in rows]
    act_dtype = rows[0]["q"].dtype
    if state_dtype is None:
        state_dtype = rows[0]["state0"].dtype
    if num_slots is None:
        num_slots = max([s for s in slots] + [0]) + 3
    gen = torch.Generator().manual_seed(junk_seed)
    state = (torch.randn(num_slots, HV, V, K, generator=gen) * 0.3).to(state_dtype)
    for r, s in enumerate(slots):
        if s >= 0:
            state[s] = rows[r]["state0"].to(state_dtype)

    def cat(name, shape):
        parts = [r[name] for r in rows]
        if not parts:
            return torch.zeros(0, *shape, dtype=act_dtype)
        return torch.cat(parts, 0)

    q, k, v = cat("q", (H, K)), cat("k", (H, K)), cat("v", (HV, V))
    T = q.shape[0]
    gate_form = "raw" if "a" in rows[0] else "pre"
    names = ("a", "b") if gate_form == "raw" else ("g", "beta")
    gate_vals = [torch.cat([r[n] for r in rows], 0) for n in names]
    if fused:
        proj = torch.full((T, 2 * H * K + HV * V + 3), float("nan"), dtype=act_dtype)
        proj[:, :H * K] = q.reshape(T, H * K)
        proj[:, H * K:2 * H * K] = k.reshape(T, H * K)
        proj[:, 2 * H * K:2 * H * K + HV * V] = v.reshape(T, HV * V)
        q = proj[:, :H * K].view(T, H, K)
        k = proj[:, H * K:2 * H * K].view(T, H, K)
        v = proj[:, 2 * H * K:2 * H * K + HV * V].view(T, HV, V)
        gp = torch.full((T, 2 * HV + 1), float("nan"), dtype=gate_vals[0].dtype)
        gp[:, :HV] = gate_vals[0]
        gp[:, HV + 1:] = gate_vals[1]
        gate_vals = [gp[:, :HV], gp[:, HV + 1:]]
    gates = dict(zip(names, gate_vals))
    if gate_form == "raw":
        gates["A_log"], gates["dt_bias"] = layer_params(layer_seed, HV, regime)
    return Problem(dims, q, k, v, gates, state, i32(slots), qsl_of(lens), lens, rows)


def make_problem(lens, slots=None, *, dims: Dims = Dims(), seed: int = 0, act_dtype=F32,
                 state_dtype=F32, gate_form: str = "raw", regime: str = "normal",
                 fused: bool = False, num_slots: Optional[int] = None) -> Problem:
    if slots is None:
        slots = [2 * r + 1 for r in range(len(lens))]
    rows = [row_data(seed * 1000 + r, n, dims, act_dtype=act_dtype, state_dtype=state_dtype,
                     gate_form=gate_form, regime=regime) for r, n in enumerate(lens)]
    return assemble(rows, slots, dims=dims, num_slots=num_slots, layer_seed=seed, regime=regime,
                    fused=fused, state_dtype=state_dtype)


def make_batch_problem(lengths, *, H=2, HV=4, K=16, V=16, T=None, padding=(), state_dtype=F32,
                       act_dtype=F32, precomputed_gates=False, device="cpu", seed=0,
                       num_slots: Optional[int] = None, extreme=False,
                       sources_below: Optional[int] = None) -> Problem:
    """The whole batch from one seed. ``lengths``: tokens per row; rows listed in ``padding`` get
    ``state_indices = -1``; ``T``: the records' window (default: the longest row).

    q, k, v are strided views into one fused projection output ``[T_total, 2*H*K + HV*V + pad]``,
    as an engine's in-projection would give them. Source slots are distinct and shuffled, drawn
    from ``[1, sources_below)`` (default: the whole pool but slot 0). ``extreme``: gates at the
    edges (decay ~1 and ~0, beta ~0 and ~1, ``a`` past the softplus switch).
    """
    g = torch.Generator().manual_seed(seed)
    T = T or max(max(lengths), 1)
    total = sum(lengths)
    width = 2 * H * K + HV * V + 8
    fused = torch.randn(total, width, generator=g).to(act_dtype)
    q = fused[:, :H * K].view(total, H, K)
    k = fused[:, H * K:2 * H * K].view(total, H, K)
    v = fused[:, 2 * H * K:2 * H * K + HV * V].view(total, HV, V)
    if extreme:
        a = torch.tensor([-30.0, 25.0, 0.0, 60.0], dtype=F32).repeat(total, (HV + 3) // 4)[:, :HV]
        b = torch.tensor([-20.0, 20.0, 0.5, -0.5], dtype=F32).repeat(total, (HV + 3) // 4)[:, :HV]
        A_log = torch.linspace(-4, 3, HV)
    else:
        a = torch.randn(total, HV, generator=g) * 2
        b = torch.randn(total, HV, generator=g) * 2
        A_log = torch.randn(HV, generator=g)
    dt_bias = torch.randn(HV, generator=g)
    if precomputed_gates:
        x = a + dt_bias
        sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
        gates = dict(g=(-torch.exp(A_log) * sp).contiguous(), beta=torch.sigmoid(b))
    else:
        gates = dict(a=a.to(act_dtype), b=b.to(act_dtype), A_log=A_log, dt_bias=dt_bias)
    num_slots = num_slots or 2 * len(lengths) + 3
    state = (torch.randn(num_slots, HV, V, K, generator=g) * 0.5).to(state_dtype)
    perm = torch.randperm((sources_below or num_slots) - 1, generator=g)[:len(lengths)] + 1
    slots = [(-1 if r in padding else int(perm[r])) for r in range(len(lengths))]
    to = dict(device=device)
    return Problem(Dims(H, HV, K, V), q.to(**to), k.to(**to), v.to(**to),
                   {n: t.to(**to) for n, t in gates.items()}, state.to(**to), i32(slots).to(**to),
                   qsl_of(lengths).to(**to), list(lengths), window=T)


def conv_problem(device, lens, dim=24, width=4, T=4, dtype=F32, seed=0):
    """``(x, conv_state, weight, bias, state_indices, query_start_loc)`` of a conv layer on
    ``device``: ``x`` a strided view, row 1 padding, a history of ``width - 1`` plus ``T`` columns."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    num_slots = 2 * len(lens) + 2
    conv_state = torch.randn(num_slots, dim, width - 1 + T, generator=g).to(dtype)
    x = torch.randn(total, dim + 5, generator=g).to(dtype)[:, 2:2 + dim]
    weight = torch.randn(dim, width, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g).to(dtype)
    slots = torch.tensor([2 * r + 1 if r != 1 else -1 for r in range(len(lens))], dtype=I32)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)
    return [t.to(device) for t in (x, conv_state, weight, bias, slots, qsl)]


def align_case(device, num_slots):
    """Five requests, block size 4: inside a block; crossing a boundary; starting and ending exactly
    on boundaries (the final block holds the boundary state, so no separate boundary write); a
    boundary block that is the source slot itself; a null final block (writes nothing).

    Returns ``(align-mode keyword arguments, num_accepted, source slots)``."""
    bs = 4
    block_table = torch.tensor([[1, 2, 3, -1], [4, 5, 6, -1], [7, 8, 9, -1], [10, 11, 12, -1],
                                [13, -1, -1, -1]], dtype=I32)
    num_computed = torch.tensor([1, 2, 4, 6, 3], dtype=I32)
    accepted = torch.tensor([2, 4, 4, 3, 2], dtype=I32)
    sources = [1, 4, 14, 11, 13]      # row 3: source is block 11, also its boundary block
    return dict(block_table=block_table.to(device), num_computed_tokens=num_computed.to(device),
                block_size=bs), accepted.to(device), sources


# ------------------------------------------------------------------------------------------------
# running the library
# ------------------------------------------------------------------------------------------------
def run_verify(p: Problem, records=None, **kw):
    """``gdn_verify`` of ``p`` into ``records`` (default: new ones); ``kw`` adds or overrides
    arguments (``backend``, ``scale``, ``out``, ``state``, ...). Returns ``(out, records)``."""
    if records is None:
        records = p.records()
    out = rs.gdn_verify(p.q, p.k, p.v, records=records, **p.call_kwargs(**kw))
    return out, records


def take_prefix(p: Problem, ns) -> tuple:
    """Inputs of a batch that keeps only the first ``min(ns[r], len_r)`` tokens of each row:
    ``(q, k, v, gates, qsl)``, on the problem's device."""
    qsl = p.qsl.tolist()
    device = p.q.device
    keep = [min(max(int(n), 0), p.lens[r]) for r, n in enumerate(ns)]
    idx = torch.tensor([qsl[r] + t for r in range(p.B) for t in range(keep[r])], dtype=torch.long,
                       device=device)
    gates = {}
    for name, t in p.gates.items():
        gates[name] = t if name in ("A_log", "dt_bias") else t[idx]
    return p.q[idx], p.k[idx], p.v[idx], gates, qsl_of(keep).to(device)


def decode_after(p: Problem, ns, pool: Optional[torch.Tensor] = None, **kw) -> torch.Tensor:
    """A copy of the state pool after the native per-token path ran the first ``ns[r]`` tokens
    of every row (``rs.gdn_decode``)."""
    pool = (p.state if pool is None else pool).clone()
    q, k, v, gates, qsl = take_prefix(p, ns)
    rs.gdn_decode(q, k, v, state=pool, state_indices=p.state_indices, query_start_loc=qsl,
                  **gates, **kw)
    return pool


def legal_accepted(ns, lens) -> list:
    """``ns`` clamped to each row's window ``[0, len]``, as the commit's value checks require."""
    return [min(max(int(n), 0), length) for n, length in zip(ns, lens)]


def commit_unchecked(state, records, num_accepted, state_indices, qsl, *, backend=None, request_indices=None,
                     block_table=None, num_computed_tokens=None, block_size=None, conv_state=None, conv_width=None,
                     max_batch=None) -> None:
    """One single-layer commit through the backend's committer, with no value checks (what a GPU
    commit does with ``check`` off): values outside the rules follow the kernels' index rule
    (clamped counts, padding for anything that is not a slot)."""
    from recoverssm.core.backend import GroupStep

    ctx = rs.CommitContext([[rs.LayerCache(state, records, conv_state=conv_state, conv_width=conv_width)]],
                           max_batch=max_batch or state_indices.shape[0], backend=backend)
    ctx.committer.commit(num_accepted, qsl, [GroupStep(state_indices, request_indices, block_table,
                                                       num_computed_tokens, block_size)])


def plan_unchecked(num_accepted, state_indices, qsl, *, backend="cpu_ref", request_indices=None, block_table=None,
                   num_computed_tokens=None, block_size=None, null_slot=-1, num_slots=2**31 - 1) -> rs.CommitPlan:
    """The backend's plan with no value checks (the kernels' rule for any values)."""
    B = state_indices.shape[0]
    out = tuple(torch.empty(B, dtype=torch.int32, device=state_indices.device) for _ in range(4))
    rs.get_backend(backend, state_indices.device).plan_commit(
        num_accepted, state_indices, qsl, request_indices, block_table, num_computed_tokens, block_size or 1,
        null_slot, num_slots, out)
    return rs.CommitPlan(*out, null_slot=null_slot)


def commit_one(state, records, num_accepted, state_indices, qsl, conv_state=None, max_batch=None,
               conv_width=None, **kw):
    ctx = rs.CommitContext([[rs.LayerCache(state, records, conv_state=conv_state, conv_width=conv_width)]],
                           max_batch=max_batch or state_indices.shape[0])
    ctx.commit(num_accepted, state_indices, qsl, **kw)


# ------------------------------------------------------------------------------------------------
# the independent float64 reference
# ------------------------------------------------------------------------------------------------
def _softplus64(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def ref_gdn(p: Problem, *, scale: Optional[float] = None, use_qk_l2norm: bool = True,
            null_slot: int = -1) -> dict:
    """Step-by-step float64 GDN over every row (the recurrence of docs/API.md; with a non-fp32
    pool the state is rounded to the pool's dtype after every token, the output taken before).

    Returns ``out`` [T, HV, V] f64, and per live row ``r``: ``corr[r]`` [HV, len, V],
    ``key[r]`` [H, len, K], ``decay[r]`` [HV, len], ``states[r]`` (list of len+1 f64 states,
    ``states[r][t]`` = after ``t`` tokens)."""
    H, HV, K, V = p.dims.H, p.dims.HV, p.dims.K, p.dims.V
    grp = HV // H
    if scale is None:
        scale = K ** -0.5
    out = torch.zeros(p.T_total, HV, V, dtype=torch.float64)
    res = {"out": out, "corr": {}, "key": {}, "decay": {}, "states": {}}
    qsl = p.qsl.tolist()
    for r, slot in enumerate(p.state_indices.tolist()):
        s, e = qsl[r], qsl[r + 1]
        if slot <= null_slot or e == s:
            continue
        S = p.state[slot].double().clone()
        states, corr, key, dec = [S.clone()], [], [], []
        for i in range(s, e):
            qt, kt = p.q[i].double(), p.k[i].double()          # [H, K]
            if use_qk_l2norm:
                kh = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
                qh = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * scale
            else:
                kh, qh = kt, qt * scale
            if "a" in p.gates:
                x = p.gates["a"][i].double() + p.gates["dt_bias"].double()
                g = -torch.exp(p.gates["A_log"].double()) * _softplus64(x)
                beta = 1.0 / (1.0 + torch.exp(-p.gates["b"][i].double()))
            else:
                g = p.gates["g"][i].double()
                beta = p.gates["beta"][i].double()
            d = torch.exp(g)                                      # [HV]
            vt = p.v[i].double()                                  # [HV, V]
            c = torch.empty(HV, V, dtype=torch.float64)
            o = torch.empty(HV, V, dtype=torch.float64)
            for hv in range(HV):
                h = hv // grp
                Sp = S[hv] * d[hv]                                # [V, K]
                c[hv] = beta[hv] * (vt[hv] - Sp @ kh[h])
                S[hv] = Sp + torch.outer(c[hv], kh[h])
                o[hv] = S[hv] @ qh[h]
            if p.state.dtype != torch.float32:
                S = S.to(p.state.dtype).double()
            out[i] = o
            corr.append(c)
            key.append(kh.clone())
            dec.append(d)
            states.append(S.clone())
        res["corr"][r] = torch.stack(corr, 1)       # [HV, len, V]
        res["key"][r] = torch.stack(key, 1)         # [H, len, K]
        res["decay"][r] = torch.stack(dec, 1)       # [HV, len]
        res["states"][r] = states
    return res


def ref_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """One row's conv in float64 with an explicit loop: ``x`` [len, dim], ``history`` [dim, hist]."""
    seq = torch.cat([history.double(), x.double().t()], 1)       # [dim, hist + len]
    w = weight.double()
    width = w.shape[1]
    L = x.shape[0]
    y = torch.zeros(L, x.shape[1], dtype=torch.float64)
    for p in range(L):
        acc = torch.zeros(x.shape[1], dtype=torch.float64) if bias is None else bias.double().clone()
        for j in range(width):
            acc = acc + w[:, j] * seq[:, p + j]
        y[p] = acc * torch.sigmoid(acc) if silu else acc
    return y


# ------------------------------------------------------------------------------------------------
# comparisons
# ------------------------------------------------------------------------------------------------
def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` (Frobenius norms) in float64 on the CPU (``x`` may be on a device)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    denom = ref.norm().item()
    assert denom > 0, "reference is all zeros: the comparison would be meaningless"
    return (x - ref).norm().item() / denom


def assert_close_rel(x, ref, tol, what=""):
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    err = rel_err(x, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_bf16_rounded(x: torch.Tensor, ref: torch.Tensor, fp32_tol: float = 1e-5, what=""):
    """``x`` (bf16) is ``ref`` (f64) rounded to bf16, up to the fp32 computation error: each element
    within half a bf16 ulp (2^-8 relative) of the reference plus a small fp32-level slack."""
    assert x.dtype == BF16
    xd, rd = x.double(), ref.double()
    slack = fp32_tol * rd.abs().max().item()
    bound = rd.abs() * 2.0 ** -8 + slack
    bad = (xd - rd).abs() > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than half a bf16 ulp"


def clone_all(obj):
    """Deep clone of every tensor inside ``obj`` (tensors, lists, tuples, dicts, records, caches)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.device.type != "meta" else obj
    if isinstance(obj, rs.ReplayRecords):
        return dataclasses.replace(obj, correction=clone_all(obj.correction), key=clone_all(obj.key),
                                   decay=clone_all(obj.decay))
    if isinstance(obj, rs.LayerCache):
        return dataclasses.replace(obj, state=clone_all(obj.state), records=clone_all(obj.records),
                                   conv_state=clone_all(obj.conv_state))
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_all(o) for o in obj)
    if isinstance(obj, dict):
        return {k: clone_all(v) for k, v in obj.items()}
    return obj


def tensors_of(obj, prefix="") -> list:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, rs.ReplayRecords):
        return (tensors_of(obj.correction, prefix + ".correction") + tensors_of(obj.key, prefix + ".key")
                + tensors_of(obj.decay, prefix + ".decay"))
    if isinstance(obj, rs.LayerCache):
        return (tensors_of(obj.state, prefix + ".state") + tensors_of(obj.records, prefix + ".records")
                + tensors_of(obj.conv_state, prefix + ".conv_state"))
    if isinstance(obj, (list, tuple)):
        return [x for i, o in enumerate(obj) for x in tensors_of(o, f"{prefix}[{i}]")]
    if isinstance(obj, dict):
        return [x for k, o in obj.items() for x in tensors_of(o, f"{prefix}.{k}")]
    return []


def assert_unchanged(before, after):
    tb, ta = tensors_of(before), tensors_of(after)
    assert len(tb) == len(ta)
    for (name, b), (_, a) in zip(tb, ta):
        if a.device.type == "meta":
            continue
        assert torch.equal(b, a) or (b.is_floating_point() and torch.equal(b.isnan(), a.isnan())
                                     and torch.equal(b.nan_to_num(), a.nan_to_num())), \
            f"{name} was modified by a call that raised"
