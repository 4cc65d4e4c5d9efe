"""Check and time the Gluon recurrence on an H200 (one device call, a few minutes).

    PYTHONPATH=. python3 benchmarks/gluon/h200_check.py                  # everything
    PYTHONPATH=. python3 benchmarks/gluon/h200_check.py --variants rs8x8 rs8x4 --no-timing
    PYTHONPATH=. python3 benchmarks/gluon/h200_check.py --self-test      # CPU: the script's plumbing

1. **Against the reference.** Each variant's verify, decode and snapshot against the library's
   ``cpu_ref`` backend on CPU copies: ragged windows, padding rows (slot -1, with and without
   tokens), fp32 and bf16 states, raw and precomputed gates, K = V = 128 and 64 (the first two
   variants; the others at K = V = 128, raw gates). fp32 token inputs: outputs and records within
   a normwise relative error of 1e-4, bf16-stored states within 8e-3 (one bf16 rounding); plus one
   bf16-input case (outputs in bf16, 8e-3). Padding rows' outputs must be exactly zero, state slots
   nobody writes exactly unchanged. Then bad index values (slots past the pool, below the null
   slot, query_start_loc outside the tokens) straight into the launcher: nothing but the rows' own
   outputs may change.
2. **Bit-identity within a variant.** The library's commit of the Gluon verify's records after n
   tokens == Gluon decode of those n tokens == Gluon snapshot at position n - 1 (``torch.equal``),
   n = 1..T, fp32 and bf16 states, bf16 inputs; the outputs of all three alike; 20 repeated runs of
   each mode identical. Variants with the same lanes along K are also compared with each other
   (reported, not required: they run the same additions, so they should agree).
3. **Time.** Verify at N = 1, 8, 64, 256, T = 2, 4, 8, HV = 32, 48 (H = 16, K = V = 128, bf16
   q/k/v, fp32 state), and snapshot at N = 64, T = 4, 8, HV = 48: each Gluon variant and the
   library's Triton kernel (``backend="cuda"``), medians of CUDA-graph replays over rotated input
   sets (recoverssm.bench.timing), each against a device copy of the same bytes: ``vs_copy_state``
   counts the state read once (the library's bench convention, docs/BENCHMARKS.md), ``vs_copy_all``
   adds token inputs, outputs and records.

Prints a table last and writes ``gluon_check.json`` under ``$OUT`` (or the working directory).
Exit status: 1 if a correctness or bit-identity check failed, 3 if a variant did not compile (and
nothing failed), 0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import recoverssm as rs
from recoverssm.core.backend import GateInputs, RecurrenceCall

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recurrence as gluon_recurrence  # noqa: E402

NULL_SLOT = -1
REL_TOL_FP32 = 1e-4
REL_TOL_BF16 = 8e-3
REPEATS = 20


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------

@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: GateInputs
    state: torch.Tensor
    state_indices: torch.Tensor
    qsl: torch.Tensor
    lengths: list
    snapshot_slots: torch.Tensor
    H: int
    HV: int
    K: int
    V: int
    T: int
    scale: float

    @property
    def N(self) -> int:
        return self.state_indices.shape[0]

    def live_rows(self) -> list:
        return [r for r, s in enumerate(self.state_indices.tolist()) if s > NULL_SLOT]

    def row_tokens(self, r: int) -> range:
        start = int(self.qsl[r])
        return range(start, start + self.lengths[r])

    def to(self, device) -> "Problem":
        gates = GateInputs(**{n: (getattr(self.gates, n).to(device) if getattr(self.gates, n) is not None else None)
                              for n in ("a", "b", "A_log", "dt_bias", "g", "beta")})
        return Problem(self.q.to(device), self.k.to(device), self.v.to(device), gates, self.state.to(device),
                       self.state_indices.to(device), self.qsl.to(device), list(self.lengths),
                       self.snapshot_slots.to(device), self.H, self.HV, self.K, self.V, self.T, self.scale)

    def records(self, device) -> tuple:
        rec = rs.ReplayRecords.allocate(self.N, self.T, self.H, self.HV, self.K, self.V, device=device)
        for t in (rec.correction, rec.key, rec.decay):   # a value no kernel writes: unwritten entries show
            t.fill_(-7.0)
        return rec.correction, rec.key, rec.decay


def make_problem(lengths: list, padding: set, *, H: int, HV: int, K: int, V: int, state_dtype, token_dtype,
                 precomputed: bool, seed: int = 0) -> Problem:
    """A batch of rows with the given window lengths; rows in ``padding`` get slot -1. Live rows
    read slots in a shuffled order; the pool also has one snapshot slot per (row, position) and a
    spare slot nobody writes. Built on the CPU."""
    g = torch.Generator().manual_seed(seed)
    N, T = len(lengths), max(max(lengths), 1)
    total = sum(lengths)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q = randn(total, H, K).to(token_dtype)
    k = randn(total, H, K).to(token_dtype)
    v = randn(total, HV, V).to(token_dtype)
    if precomputed:
        gates = GateInputs(g=-torch.rand(total, HV, generator=g) * 0.7,
                           beta=torch.sigmoid(randn(total, HV)))
    else:
        gates = GateInputs(a=randn(total, HV).to(token_dtype), b=randn(total, HV).to(token_dtype),
                           A_log=randn(HV) * 0.5, dt_bias=randn(HV) * 0.5)
    num_slots = N + N * T + 1
    state = (randn(num_slots, HV, V, K) * 0.1).to(state_dtype)
    order = torch.randperm(N, generator=g).tolist()
    state_indices = torch.tensor([NULL_SLOT if r in padding else order[r] for r in range(N)], dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    snapshot_slots = (torch.arange(N * T, dtype=torch.int32).view(N, T) + N).contiguous()
    return Problem(q, k, v, gates, state, state_indices, qsl, list(lengths), snapshot_slots, H, HV, K, V, T,
                   K ** -0.5)


# ---------------------------------------------------------------------------------------------
# Kernels under test: a runner takes (mode, problem, state, out, records, snapshot_slots)
# ---------------------------------------------------------------------------------------------

Runner = Callable[..., None]


def gluon_runner(variant: str) -> Runner:
    def run(mode, p: Problem, state, out, records, snapshot_slots):
        gluon_recurrence.launch(mode, p.q, p.k, p.v, state, p.state_indices, p.qsl, p.gates, p.scale, True,
                                NULL_SLOT, out, records, snapshot_slots, variant=variant)
    return run


def reference_runner() -> Runner:
    """The library's cpu_ref backend (the readable reference), on whatever device the tensors are
    (the CPU)."""
    backend = rs.get_backend("cpu_ref")

    def run(mode, p: Problem, state, out, records, snapshot_slots):
        backend.recurrence(RecurrenceCall(mode, p.q, p.k, p.v, state, p.state_indices, p.qsl, p.gates, p.scale, True,
                                          NULL_SLOT, out, records, snapshot_slots))
    return run


def run_mode(runner: Runner, mode: str, p: Problem, device) -> dict:
    """One call on fresh copies; returns the written tensors on the CPU."""
    state = p.state.clone()
    out = torch.full(p.v.shape, -3.0, dtype=p.v.dtype, device=device)   # tokens no row covers stay -3
    records = p.records(device) if mode == "verify" else None
    runner(mode, p, state, out, records, p.snapshot_slots if mode == "snapshot" else None)
    result = dict(out=out.cpu(), state=state.cpu())
    if records is not None:
        result.update(corr=records[0].cpu(), key=records[1].cpu(), decay=records[2].cpu())
    return result


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------

def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if x.numel() == 0:
        return 0.0
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def compare_to_reference(mode: str, p: Problem, got: dict, ref: dict, out_tol: float, state_tol: float) -> dict:
    """Normwise relative errors of one mode's results against the reference (outputs and records
    of live rows, written state slots), and the exact checks: padding rows' outputs zero, verify
    leaves the state alone, slots nobody writes unchanged."""
    live = [r for r in p.live_rows() if p.lengths[r] > 0]
    live_tokens = [t for r in live for t in p.row_tokens(r)]
    pad_tokens = [t for r in range(p.N) if r not in p.live_rows() for t in p.row_tokens(r)]
    errors = dict(out=rel_error(got["out"][live_tokens].float(), ref["out"][live_tokens].float()))
    exact_ok = bool((got["out"][pad_tokens] == 0).all()) if pad_tokens else True
    if mode == "verify":
        for name in ("corr", "key", "decay"):
            parts_got, parts_ref = [], []
            for r in live:
                n = p.lengths[r]
                parts_got.append(got[name][r, :, :n].reshape(-1))
                parts_ref.append(ref[name][r, :, :n].reshape(-1))
            errors[name] = rel_error(torch.cat(parts_got), torch.cat(parts_ref)) if parts_got else 0.0
        exact_ok &= torch.equal(got["state"], p.state.cpu())          # verify never writes the state
    else:
        written = set()
        for r in live:
            if mode == "decode":
                written.add(int(p.state_indices[r]))
            else:
                written.update(int(s) for s in p.snapshot_slots[r, :p.lengths[r]])
        written = sorted(written)
        errors["state"] = rel_error(got["state"][written].float(), ref["state"][written].float()) if written else 0.0
        untouched = [s for s in range(p.state.shape[0]) if s not in written]
        exact_ok &= torch.equal(got["state"][untouched], p.state.cpu()[untouched])
    tol = {"out": out_tol, "state": state_tol}
    ok = exact_ok and all(e < tol.get(n, REL_TOL_FP32) for n, e in errors.items())
    return dict(ok=bool(ok), exact_ok=bool(exact_ok), errors=errors)


# ---------------------------------------------------------------------------------------------
# 1. Against the reference
# ---------------------------------------------------------------------------------------------

CASE_LENGTHS = [5, 1, 0, 3, 5, 2, 4, 5]
CASE_PADDING = {5, 6}          # row 5: slot -1 with tokens; row 2: a live row with no tokens


def correctness_cases(variants: list) -> list:
    cases = []
    for i, name in enumerate(variants):
        full = i < 2
        for kv in ((128, 64) if full else (128,)):
            for state_dtype in (torch.float32, torch.bfloat16):
                for precomputed in ((False, True) if full else (False,)):
                    cases.append((name, kv, state_dtype, torch.float32, precomputed))
        cases.append((name, 128, torch.float32, torch.bfloat16, False))
    return cases


def check_against_reference(run: Callable[[str], Runner], variants: list, device, log) -> list:
    reference = reference_runner()
    ref_cache: dict = {}
    rows = []
    for name, kv, state_dtype, token_dtype, precomputed in correctness_cases(variants):
        key = (kv, state_dtype, token_dtype, precomputed)
        cpu = make_problem(CASE_LENGTHS, CASE_PADDING, H=4, HV=12, K=kv, V=kv, state_dtype=state_dtype,
                           token_dtype=token_dtype, precomputed=precomputed, seed=kv)
        if key not in ref_cache:
            ref_cache[key] = {mode: run_mode(reference, mode, cpu, "cpu") for mode in ("verify", "decode", "snapshot")}
        dev = cpu.to(device)
        out_tol = REL_TOL_FP32 if token_dtype == torch.float32 else REL_TOL_BF16
        state_tol = REL_TOL_FP32 if state_dtype == torch.float32 else REL_TOL_BF16
        for mode in ("verify", "decode", "snapshot"):
            row = dict(variant=name, K=kv, V=kv, state=str(state_dtype).split(".")[-1],
                       tokens=str(token_dtype).split(".")[-1], gates="precomputed" if precomputed else "raw", mode=mode)
            try:
                got = run_mode(run(name), mode, dev, device)
                row.update(compare_to_reference(mode, dev, got, ref_cache[key][mode], out_tol, state_tol))
            except Exception as exc:  # noqa: BLE001 - a compile or launch failure is reported, not fatal
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                if is_fatal(exc):
                    raise
            rows.append(row)
            log(f"ref   {_fmt_case(row)} " + ("ok" if row["ok"] else "FAILED") + "  "
                + " ".join(f"{n}={e:.1e}" for n, e in row.get("errors", {}).items())
                + (f"  {row['error']}" if "error" in row else ""))
    return rows


def check_index_safety(run: Callable[[str], Runner], variants: list, device, log) -> list:
    """Slot and window values that validation would refuse go straight to the launcher: rows whose
    slot is past the pool, between null_slot and 0, or far negative are padding (their outputs
    zero); query_start_loc values outside [0, T] are clamped. Nothing else may change."""
    rows = []
    cpu = make_problem([2, 3, 2, 3], set(), H=4, HV=12, K=128, V=128, state_dtype=torch.float32,
                       token_dtype=torch.float32, precomputed=False, seed=3)
    num_slots = cpu.state.shape[0]
    cpu.state_indices = torch.tensor([num_slots, num_slots + 1000, -2, -(2**31)], dtype=torch.int32)
    cpu.qsl = torch.tensor([-5, 2, 5, 7, 10 + 9999], dtype=torch.int32)   # first row starts at -5, last ends past T
    for name in variants:
        row = dict(variant=name, mode="index_safety")
        try:
            dev = cpu.to(device)
            ok = True
            for mode in ("verify", "decode", "snapshot"):
                snap = torch.full((4, 8), num_slots + 7, dtype=torch.int32, device=device)
                state = dev.state.clone()
                out = torch.full(dev.v.shape, -3.0, dtype=dev.v.dtype, device=device)
                records = dev.records(device) if mode == "verify" else None
                run(name)(mode, dev, state, out, records, snap if mode == "snapshot" else None)
                if device != "cpu":
                    torch.cuda.synchronize()
                ok &= torch.equal(state.cpu(), cpu.state) and bool((out.cpu() == 0).all())
                if records is not None:
                    ok &= all(bool((r.cpu() == -7.0).all()) for r in records)
            row["ok"] = bool(ok)
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            if is_fatal(exc):
                raise
        rows.append(row)
        log(f"index {name}: " + ("ok" if row["ok"] else "FAILED " + row.get("error", "")))
    return rows


# ---------------------------------------------------------------------------------------------
# 2. Bit-identity within the Gluon family
# ---------------------------------------------------------------------------------------------

def commit_records(state, records, num_accepted, state_indices, qsl, N) -> None:
    correction, key, decay = records
    layer = rs.LayerCache(state, rs.ReplayRecords(correction, key, decay))
    rs.CommitContext([[layer]], max_batch=N).commit(num_accepted, state_indices, qsl)


def check_bit_identity(run: Callable[[str], Runner], variants: list, device, log, T: int = 5, N: int = 4) -> list:
    rows = []
    firsts: dict = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        cpu = make_problem([T] * N, set(), H=4, HV=12, K=128, V=128, state_dtype=state_dtype,
                           token_dtype=torch.bfloat16, precomputed=False, seed=11)
        p = cpu.to(device)
        for name in variants:
            row = dict(variant=name, state=str(state_dtype).split(".")[-1], mode="bit_identity")
            try:
                fails = []
                verify = run_mode(run(name), "verify", p, device)
                snapshot = run_mode(run(name), "snapshot", p, device)
                records_dev = tuple(verify[n].to(device) for n in ("corr", "key", "decay"))
                slots = p.state_indices.cpu().long()
                for n in range(1, T + 1):
                    committed = p.state.clone()
                    commit_records(committed, records_dev, torch.full((N,), n, dtype=torch.int32, device=device),
                                   p.state_indices, p.qsl, N)
                    tokens = torch.tensor([r * T + t for r in range(N) for t in range(n)], device=device)
                    sub = Problem(p.q[tokens].contiguous(), p.k[tokens].contiguous(), p.v[tokens].contiguous(),
                                  GateInputs(a=p.gates.a[tokens].contiguous(), b=p.gates.b[tokens].contiguous(),
                                             A_log=p.gates.A_log, dt_bias=p.gates.dt_bias),
                                  p.state, p.state_indices,
                                  torch.arange(0, (N + 1) * n, n, dtype=torch.int32, device=device), [n] * N,
                                  p.snapshot_slots, p.H, p.HV, p.K, p.V, n, p.scale)
                    decode = run_mode(run(name), "decode", sub, device)
                    c = committed.cpu()[slots]
                    d = decode["state"][slots]
                    s = snapshot["state"][p.snapshot_slots.cpu()[:, n - 1].long()]
                    if not torch.equal(c, d):
                        fails.append(f"n={n}: commit != decode ({(c != d).sum().item()} elements)")
                    if not torch.equal(c, s):
                        fails.append(f"n={n}: commit != snapshot ({(c != s).sum().item()} elements)")
                    tok_cpu = tokens.cpu()
                    if not torch.equal(decode["out"], verify["out"][tok_cpu]):
                        fails.append(f"n={n}: decode outputs != verify outputs")
                    if not torch.equal(snapshot["out"][tok_cpu], verify["out"][tok_cpu]):
                        fails.append(f"n={n}: snapshot outputs != verify outputs")
                for mode, first in (("verify", verify), ("snapshot", snapshot),
                                    ("decode", run_mode(run(name), "decode", p, device))):
                    for i in range(REPEATS - 1):
                        again = run_mode(run(name), mode, p, device)
                        if any(not torch.equal(again[key], first[key]) for key in first):
                            fails.append(f"{mode}: repeat {i + 1} differs")
                            break
                firsts[(name, row["state"])] = verify
                row.update(ok=not fails, failures=fails[:10])
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                if is_fatal(exc):
                    raise
            rows.append(row)
            log(f"bits  {name:13s} state={row['state']:8s} " + ("ok" if row["ok"] else "FAILED ")
                + "; ".join(row.get("failures", [])) + row.get("error", ""))
    # Same lanes along K and K_PAD -> the same additions: the variants should agree (reported only).
    for (name, state), verify in firsts.items():
        for (other, state2), verify2 in firsts.items():
            if other <= name or state2 != state:
                continue
            if gluon_recurrence.VARIANTS[name].lanes_k != gluon_recurrence.VARIANTS[other].lanes_k:
                continue
            same = all(torch.equal(verify[key], verify2[key]) for key in verify)
            rows.append(dict(variant=f"{name} vs {other}", state=state, mode="cross_variant", ok=True, equal=same))
            log(f"bits  {name} vs {other} state={state}: verify results " + ("equal" if same else "DIFFER (informative)"))
    return rows


# ---------------------------------------------------------------------------------------------
# 3. Time
# ---------------------------------------------------------------------------------------------

H_BENCH, K_BENCH, V_BENCH = 16, 128, 128


def bench_shapes(quick: bool) -> list:
    shapes = []
    for HV in (32, 48):
        for T in (2, 4, 8):
            for N in ((8, 64) if quick else (1, 8, 64, 256)):
                shapes.append(("verify", N, T, HV))
    shapes += [("snapshot", 64, 4, 48), ("snapshot", 64, 8, 48)]
    return shapes


def traffic_bytes(mode: str, N: int, T: int, HV: int) -> tuple[int, int]:
    """(state bytes the copy is compared with in the library's bench, all bytes moved)."""
    H, K, V = H_BENCH, K_BENCH, V_BENCH
    state = N * HV * V * K * 4
    tokens = N * T * ((2 * H * K + HV * V + 2 * HV) * 2)          # bf16 q, k, v, a, b
    outputs = N * T * HV * V * 2
    if mode == "verify":
        records = N * T * (HV * V + H * K + HV) * 4
        return state, state + tokens + outputs + records
    return state * (1 + T), state * (1 + T) + tokens + outputs


def time_all(variants: list, log, quick: bool) -> list:
    from recoverssm.bench.problems import window
    from recoverssm.bench.timing import CopyCeiling, copies_for, median_us

    ceiling = CopyCeiling("cuda")
    rows = []
    for mode, N, T, HV in bench_shapes(quick):
        state_bytes = N * HV * V_BENCH * K_BENCH * 4
        wins = [window(N, T, H_BENCH, HV, K_BENCH, V_BENCH, extra_slots=N * T if mode == "snapshot" else 0, seed=i)
                for i in range(copies_for(state_bytes))]
        outs = [torch.empty_like(w.v) for w in wins]
        snaps = [torch.arange(N * T, dtype=torch.int32, device="cuda").view(N, T) + N for _ in wins]
        state_traffic, all_traffic = traffic_bytes(mode, N, T, HV)
        copy_state, copy_all = ceiling.us(state_traffic), ceiling.us(all_traffic)

        def library(w, o, s):
            if mode == "verify":
                return rs.gdn_verify(w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                                     query_start_loc=w.query_start_loc, records=w.records, out=o, backend="cuda",
                                     **w.gates())
            return rs.gdn_spec_decode_snapshot(w.q, w.k, w.v, state=w.state, state_indices=w.state_indices,
                                               query_start_loc=w.query_start_loc, snapshot_slots=s, out=o,
                                               backend="cuda", **w.gates())

        def gluon(name):
            def call(w, o, s):
                records = (w.records.correction, w.records.key, w.records.decay) if mode == "verify" else None
                gluon_recurrence.launch(mode, w.q, w.k, w.v, w.state, w.state_indices, w.query_start_loc,
                                        GateInputs(**w.gates()), K_BENCH ** -0.5, True, NULL_SLOT, o, records,
                                        s if mode == "snapshot" else None, variant=name)
            return call

        library_us = None
        for name, fn in [("triton (library)", library)] + [(v, gluon(v)) for v in variants]:
            row = dict(kernel=name, mode=mode, N=N, T=T, HV=HV)
            try:
                us = median_us([lambda w=w, o=o, s=s: fn(w, o, s) for w, o, s in zip(wins, outs, snaps)])
                row.update(us=round(us, 2), vs_copy_state=round(copy_state / us, 3), vs_copy_all=round(copy_all / us, 3))
                if library_us is None:
                    library_us = us
                else:
                    row["speedup_vs_library"] = round(library_us / us, 3)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if is_fatal(exc):
                    raise
            rows.append(row)
            log(f"time  {mode:8s} N={N:3d} T={T} HV={HV} {name:17s} "
                + (f"{row['us']:8.1f} us  {row['vs_copy_state']:.3f}x copy(state)  {row['vs_copy_all']:.3f}x copy(all)"
                   + (f"  {row['speedup_vs_library']:.3f}x library" if "speedup_vs_library" in row else "")
                   if "us" in row else row["error"]))
        del wins, outs, snaps
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def is_fatal(exc: Exception) -> bool:
    """A CUDA error poisons the context: nothing after it can be trusted, so it ends the run."""
    text = str(exc)
    return isinstance(exc, torch.cuda.OutOfMemoryError) is False and (
        "CUDA error" in text or "illegal memory access" in text or "unspecified launch failure" in text)


def compile_all(variants: list, log) -> dict:
    """Compile each variant once on a tiny problem (verify, bf16 inputs, fp32 state); the failures
    are reported and the variant left out of everything else."""
    failures = {}
    p = make_problem([2, 1], set(), H=4, HV=12, K=128, V=128, state_dtype=torch.float32, token_dtype=torch.bfloat16,
                     precomputed=False).to("cuda")
    for name in variants:
        t0 = time.time()
        try:
            run_mode(gluon_runner(name), "verify", p, "cuda")
            torch.cuda.synchronize()
            log(f"compile {name}: ok ({time.time() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001
            failures[name] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"compile {name}: FAILED {failures[name][:500]}")
            if is_fatal(exc):
                raise
    return failures


def render(result: dict) -> str:
    lines = []
    checks = result["correctness"] + result["index_safety"] + result["bit_identity"]
    failed = [r for r in checks if not r.get("ok", False)]
    lines.append(f"correctness: {len(checks) - len(failed)} passed, {len(failed)} failed"
                 + (f"; compile failures: {', '.join(result['compile_failures'])}" if result["compile_failures"] else ""))
    for r in failed[:20]:
        lines.append(f"  FAILED {r.get('variant')} {r.get('mode')} {_fmt_case(r)} {r.get('error', '')} "
                     + "; ".join(r.get("failures", [])))
    timing = result.get("timing", [])
    if timing:
        kernels = list(dict.fromkeys(r["kernel"] for r in timing))
        lines.append("")
        lines.append(f"{'case':26s}" + "".join(f"{k[:17]:>19s}" for k in kernels))
        lines.append(f"{'':26s}" + "".join(f"{'us  x copy(state)':>19s}" for _ in kernels))
        cases = list(dict.fromkeys((r["mode"], r["N"], r["T"], r["HV"]) for r in timing))
        for case in cases:
            cells = []
            for k in kernels:
                r = next((x for x in timing if x["kernel"] == k and (x["mode"], x["N"], x["T"], x["HV"]) == case), None)
                cells.append(f"{r['us']:9.1f} {r['vs_copy_state']:6.3f}x" if r and "us" in r else f"{'-':>17s}")
            lines.append(f"{case[0][:4]} N={case[1]:<3d} T={case[2]} HV={case[3]:<3d}    " + "".join(f"{c:>19s}" for c in cells))
    return "\n".join(lines)


def _fmt_case(r: dict) -> str:
    return " ".join(f"{k}={r[k]}" for k in ("variant", "K", "state", "tokens", "gates", "mode") if k in r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=list(gluon_recurrence.VARIANTS))
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--quick", action="store_true", help="time N = 8 and 64 only")
    ap.add_argument("--self-test", action="store_true",
                    help="no GPU: run the checks' plumbing on the CPU with stand-in kernels (the reference itself, "
                         "and a perturbed one that must fail)")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    started = time.time()
    out_dir = os.environ.get("OUT") or "."
    log = lambda msg: print(f"[{time.time() - started:6.1f}s] {msg}", flush=True)  # noqa: E731
    import triton
    result = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                  variants={n: vars(gluon_recurrence.VARIANTS[n]) for n in args.variants},
                  compile_failures={}, correctness=[], index_safety=[], bit_identity=[], timing=[])
    fatal = None
    try:
        result["compile_failures"] = compile_all(args.variants, log)
        ok_variants = [v for v in args.variants if v not in result["compile_failures"]]
        result["correctness"] = check_against_reference(gluon_runner, ok_variants, "cuda", log)
        result["index_safety"] = check_index_safety(gluon_runner, ok_variants, "cuda", log)
        result["bit_identity"] = check_bit_identity(gluon_runner, ok_variants, "cuda", log)
        if not args.no_timing:
            result["timing"] = time_all(ok_variants, log, args.quick)
    except Exception as exc:  # noqa: BLE001 - a CUDA error ends the run; report what was done
        fatal = f"{type(exc).__name__}: {exc}"
        result["fatal"] = fatal + "\n" + traceback.format_exc()
        log(f"FATAL {fatal[:500]}")
    result["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out_dir, "gluon_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(render(result))
    checks = result["correctness"] + result["index_safety"] + result["bit_identity"]
    if fatal or any(not r.get("ok", False) for r in checks):
        return 1
    return 3 if result["compile_failures"] else 0


# ---------------------------------------------------------------------------------------------
# Self-test of the plumbing (CPU, no Gluon)
# ---------------------------------------------------------------------------------------------

def self_test() -> int:
    """Runs the reference and bit-identity checks on the CPU with stand-ins for the kernel: the
    reference itself must pass everything, a kernel whose outputs are off by 1e-3 must fail the
    reference check, and one whose decode differs by one bit must fail the bit check."""
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    reference = reference_runner()

    def perturbed(mode, p, state, out, records, snapshot_slots):
        reference(mode, p, state, out, records, snapshot_slots)
        out.mul_(1.001)

    def one_bit_off(mode, p, state, out, records, snapshot_slots):
        reference(mode, p, state, out, records, snapshot_slots)
        if mode == "decode":
            flat = state.view(-1)
            idx = int(p.state_indices[0]) * state[0].numel()
            flat[idx] = torch.nextafter(flat[idx], torch.tensor(float("inf"), dtype=flat.dtype))

    def bad_padding(mode, p, state, out, records, snapshot_slots):
        reference(mode, p, state, out, records, snapshot_slots)
        out[int(p.qsl[5])] = 1.0        # row 5 is a padding row with tokens

    saved = dict(gluon_recurrence.VARIANTS)
    fake = {"ref": gluon_recurrence.Variant(), "perturbed": gluon_recurrence.Variant(),
            "one_bit_off": gluon_recurrence.Variant(), "bad_padding": gluon_recurrence.Variant()}
    runners = {"ref": reference, "perturbed": perturbed, "one_bit_off": one_bit_off, "bad_padding": bad_padding}
    gluon_recurrence.VARIANTS.clear()
    gluon_recurrence.VARIANTS.update(fake)
    try:
        run = runners.__getitem__
        expect = {"ref": True, "perturbed": False, "one_bit_off": True, "bad_padding": False}
        ok = True
        ref_rows = check_against_reference(run, ["ref", "perturbed", "one_bit_off", "bad_padding"], "cpu", log)
        for name, want in expect.items():
            got = all(r["ok"] for r in ref_rows if r["variant"] == name)
            ok &= got == want
            log(f"self-test reference check {name}: {'pass' if got else 'fail'} (expected {'pass' if want else 'fail'})")
        bit_rows = check_bit_identity(run, ["ref", "one_bit_off"], "cpu", log, T=3, N=2)
        for name, want in (("ref", True), ("one_bit_off", False)):
            got = all(r["ok"] for r in bit_rows if r["variant"] == name)
            ok &= got == want
            log(f"self-test bit check {name}: {'pass' if got else 'fail'} (expected {'pass' if want else 'fail'})")
        safety = check_index_safety(lambda name: _padding_only, ["ref"], "cpu", log)
        ok &= all(r["ok"] for r in safety)
        print(render(dict(correctness=ref_rows, index_safety=safety, bit_identity=bit_rows, compile_failures={})))
        log("self-test " + ("passed" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        gluon_recurrence.VARIANTS.clear()
        gluon_recurrence.VARIANTS.update(saved)


def _padding_only(mode, p, state, out, records, snapshot_slots):
    """What the kernel must do with the index-safety problem: every row is padding, so zeros out
    for every covered token (clamped to the tokens that exist) and nothing else."""
    T = p.q.shape[0]
    qsl = p.qsl.tolist()
    for r in range(p.N):
        start, end = max(qsl[r], 0), min(qsl[r + 1], T)
        if end > start:
            out[start:end] = 0


if __name__ == "__main__":
    sys.exit(main())
