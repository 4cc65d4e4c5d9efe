"""``recoverssm demo``: speculative decoding of a tiny GDN model, checked bit for bit at every step.

Each step, for every request: the draft proposes ``k`` tokens; the speculative path verifies the
window ``[last accepted token, d_1 .. d_k]`` of all requests at once (``rs.conv_verify`` +
``rs.gdn_verify`` per layer, records in one ``ReplayRecords`` per layer), accepts drafts greedily
(while the target's argmax agrees; ``num_accepted = accepted drafts + 1``, the last token being the
target's own prediction) and commits every layer of both KV-cache groups in ONE
``CommitContext.commit`` in align mode. Beside it, the per-token reference path
(:mod:`recoverssm.demo.reference`) generates the same tokens one at a time.

After every step the demo checks with ``torch.equal`` that

* the emitted tokens, and the logits of every accepted position, equal the per-token path's;
* in every slot the commit wrote (final and block-boundary slots), every layer's recurrent state
  and conv history equal the per-token path's after the same number of tokens;

and at the end that every prefix-cache block written during the run still holds its state. Any
difference raises :class:`DemoMismatch` (the CLI exits 1 with its message).

Why the two paths can agree bit for bit: the GDN recurrence is exact by the library's design (the
records hold the very values the per-token step used; the commit replays them with the same
fused multiply-add). What remains is to feed both paths the same bits: every non-recurrent op runs
one token at a time on identically shaped tensors (:mod:`recoverssm.demo.model`), so a token's
q/k/v/a/b do not depend on the window or batch it arrived in; and the per-token conv rounds like
the backend's conv (:mod:`recoverssm.demo.reference`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

import recoverssm as rs
from recoverssm.core.registry import registry
from recoverssm.cli_support import torch_threads

from .draft import NgramDraft
from .model import ModelConfig, TinyGDN
from .progress import ProgressBar
from .reference import ReferenceEngine
from .spec import GroupPlan, SpecEngine


class DemoMismatch(RuntimeError):
    """The speculative path and the per-token path disagree (tokens, logits, states or conv)."""


@dataclass
class DemoConfig:
    """What ``recoverssm demo`` runs. ``model.seed`` is replaced by ``seed``."""

    requests: int = 4
    draft_tokens: int = 3
    steps: int = 12
    seed: int = 0
    device: str = "cpu"
    backend: Optional[str] = None
    block_sizes: tuple[int, ...] = (4, 5)      # group 0 (even layers), group 1 (odd layers)
    prompt_len: tuple[int, int] = (5, 9)       # inclusive range, drawn per request
    # Per request (cycled): relative noise on the draft's copy of the weights, and the chance of
    # replacing a draft token by a random one. Different drafts -> different acceptance.
    draft_weight_noise: tuple[float, ...] = (0.02, 0.1, 0.3, 0.6)
    draft_token_noise: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
    ref_conv: str = "auto"                     # "torch", "kernel", or "auto" (torch on cpu_ref)
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class StepStats:
    step: int
    emitted: list[int]          # tokens added per request (accepted drafts + 1)
    accepted: list[int]         # accepted drafts per request
    drafted: int                # drafts proposed per request
    spec_ms: float              # draft + verify + plan + commit
    ref_ms: float               # per-token reference path
    compared: int               # slot comparisons (state + conv per layer) this step
    boundary_writes: int        # block-boundary states the commit stored


@dataclass
class DemoResult:
    config: DemoConfig
    backend: str
    backend_reason: str
    ref_conv: str
    prompts: list[list[int]]
    tokens: list[list[int]]          # generated tokens per request (speculative path)
    ref_tokens: list[list[int]]      # generated tokens per request (per-token path)
    prefill_rounds: int
    steps: list[StepStats]
    compared_slots: int
    compared_logits: int
    prefix_blocks_checked: int
    memory: dict
    ok: bool = True

    @property
    def drafts_proposed(self) -> int:
        return sum(s.drafted * len(s.accepted) for s in self.steps)

    @property
    def drafts_accepted(self) -> int:
        return sum(sum(s.accepted) for s in self.steps)

    def acceptance_per_request(self) -> list[float]:
        R = self.config.requests
        proposed = sum(s.drafted for s in self.steps)
        return [sum(s.accepted[q] for s in self.steps) / max(proposed, 1) for q in range(R)]

    def to_json(self) -> dict:
        cfg = dataclasses.asdict(self.config)
        return {
            "ok": self.ok, "backend": self.backend, "backend_reason": self.backend_reason,
            "ref_conv": self.ref_conv, "config": cfg,
            "prompts": self.prompts, "tokens": self.tokens,
            "tokens_match": self.tokens == self.ref_tokens,
            "prefill_rounds": self.prefill_rounds,
            "steps": [dataclasses.asdict(s) for s in self.steps],
            "drafts_proposed": self.drafts_proposed, "drafts_accepted": self.drafts_accepted,
            "acceptance_rate": self.drafts_accepted / max(self.drafts_proposed, 1),
            "acceptance_per_request": self.acceptance_per_request(),
            "compared_slots": self.compared_slots, "compared_logits": self.compared_logits,
            "prefix_blocks_checked": self.prefix_blocks_checked, "memory": self.memory,
        }


# ------------------------------------------------------------------------------------------------
# comparisons
# ------------------------------------------------------------------------------------------------
def _expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if torch.equal(got, want):
        return
    diff = (got.double() - want.double()).abs()
    raise DemoMismatch(
        f"{what} differs from the per-token path: {int((got != want).sum())} of {got.numel()} "
        f"elements, max |diff| {diff.max().item():.3e} (bit-identity broken)")


class _SlotChecker:
    """Compares the slots a commit wrote with the reference, and remembers them for the end."""

    def __init__(self, spec: SpecEngine, ref: ReferenceEngine):
        self.spec, self.ref = spec, ref
        self.compared = 0
        #: per group: slot -> (request, tokens it holds the state after)
        self.written: list[dict[int, tuple[int, int]]] = [{} for _ in spec.block_sizes]

    def _compare(self, where: str, g: int, slot: int, want) -> None:
        for layer, (state, conv) in zip(self.spec.layers_of[g], want):
            _expect_equal(self.spec.slot_state(layer, slot), state,
                          f"{where}: layer {layer} (group {g}) recurrent state in slot {slot}")
            _expect_equal(self.spec.slot_conv_history(layer, slot), conv,
                          f"{where}: layer {layer} (group {g}) conv history in slot {slot}")
            self.compared += 2

    def _want(self, where: str, g: int, q: int, tokens: int):
        if tokens == self.ref.num_computed[q]:
            return self.ref.current(g, q)
        key = (g, q, tokens)
        if key not in self.ref.block_states:
            raise DemoMismatch(f"{where}: group {g} slot holds request {q}'s state after {tokens} "
                               f"tokens, which is neither current nor a block boundary")
        return self.ref.block_states[key]

    def after_commit(self, where: str, plans: Sequence[GroupPlan], computed_before: Sequence[int]) -> int:
        """Check the final and boundary slots of every group and request; return boundary writes."""
        boundaries = 0
        for q, before in enumerate(computed_before):
            if self.spec.num_computed[q] != self.ref.num_computed[q]:
                raise DemoMismatch(f"{where}: request {q} has {self.spec.num_computed[q]} tokens "
                                   f"committed but the per-token path computed {self.ref.num_computed[q]}")
        for g, plan in enumerate(plans):
            for q, before in enumerate(computed_before):
                n = plan.commit_len[q]
                if n == 0:
                    continue
                if plan.boundary_slot[q] > -1:
                    tokens = before + plan.boundary_len[q]
                    self._compare(f"{where}, request {q}, boundary block (after {tokens} tokens)",
                                  g, plan.boundary_slot[q], self._want(where, g, q, tokens))
                    self.written[g][plan.boundary_slot[q]] = (q, tokens)
                    boundaries += 1
                tokens = before + n
                self._compare(f"{where}, request {q}, final slot (after {tokens} tokens)",
                              g, plan.final_slot[q], self._want(where, g, q, tokens))
                self.written[g][plan.final_slot[q]] = (q, tokens)
        return boundaries

    def prefix_cache(self) -> int:
        """Every slot written during the run still holds its state (verify never wrote a state,
        no commit clobbered another block). Returns the number of blocks checked."""
        blocks = 0
        for g, slots in enumerate(self.written):
            for slot, (q, tokens) in sorted(slots.items()):
                self._compare(f"end of run, request {q}, block slot (after {tokens} tokens)",
                              g, slot, self._want("end of run", g, q, tokens))
                blocks += 1
        return blocks


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def _cycle(values: Sequence[float], q: int) -> float:
    return values[q % len(values)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def _memory(spec: SpecEngine, cfg: DemoConfig) -> dict:
    mem = spec.bytes_held()
    c, T = cfg.model, cfg.draft_tokens + 1
    # The same accounting at production head sizes (Qwen3-Next-like GDN: H=16, HV=32, K=V=128).
    state_big = 32 * 128 * 128 * 4
    record_big = (32 * 128 + 16 * 128 + 32) * 4          # one token's records, per request per layer
    mem.update({
        "slots_per_request_recoverssm": 1, "slots_per_request_snapshot": T,
        "records_per_token_fraction_of_state": (c.HV * c.V + c.H * c.K + c.HV) / (c.HV * c.V * c.K),
        "records_per_token_fraction_of_state_at_H16_HV32_K128_V128": record_big / state_big,
    })
    return mem


def run_demo(cfg: DemoConfig, on_step: Optional[Callable[[StepStats], None]] = None,
             on_prefill: Optional[Callable[[int], None]] = None, *,
             make_model: Optional[Callable[[ModelConfig, torch.device], TinyGDN]] = None) -> DemoResult:
    """Run the demo; raise :class:`DemoMismatch` at the first difference. ``on_step`` is called
    after each checked step (progress reporting). ``make_model(model_cfg, device)`` replaces
    :class:`TinyGDN` (the tensor-parallel demo passes its per-rank shard, :mod:`.tp`)."""
    if cfg.requests < 1 or cfg.draft_tokens < 0 or cfg.steps < 0 or cfg.model.num_layers < 1:
        raise ValueError("requests and layers must be >= 1, draft_tokens and steps >= 0")
    device = torch.device(cfg.device)
    backend, reason = registry().resolve(cfg.backend, device)
    ref_conv = cfg.ref_conv
    if ref_conv == "auto":
        ref_conv = "torch" if backend.name == "cpu_ref" else "kernel"
    mcfg = dataclasses.replace(cfg.model, seed=cfg.seed)
    model = (make_model or TinyGDN)(mcfg, device)
    R, k = cfg.requests, cfg.draft_tokens
    T = k + 1

    rng = random.Random(cfg.seed + 1)
    prompts = [[rng.randrange(mcfg.vocab) for _ in range(rng.randint(*cfg.prompt_len))] for _ in range(R)]
    max_tokens = max(len(p) for p in prompts) + cfg.steps * T + 1
    spec = SpecEngine(model, R, T, cfg.block_sizes, max_tokens, backend, seed=cfg.seed + 2)
    ref = ReferenceEngine(model, R, backend, ref_conv, spec.block_sizes, spec.layers_of)
    checker = _SlotChecker(spec, ref)
    drafts = [NgramDraft(model.next_token_table(_cycle(cfg.draft_weight_noise, q), cfg.seed + 3 + q),
                         mcfg.vocab, noise=_cycle(cfg.draft_token_noise, q), seed=cfg.seed + 100 + q)
              for q in range(R)]
    compared_logits = 0

    def reference_ticks(where, counts, token_of, logits, qsl_host):
        """Feed the per-token path ``counts[q]`` tokens per request, one call per position; check
        each position's logits against the window's. Returns the tokens it generated per request."""
        nonlocal compared_logits
        generated = [[] for _ in range(R)]
        for tick in range(max(counts, default=0)):
            active = [q for q in range(R) if counts[q] > tick]
            lg = ref.feed(active, [token_of(q, tick, generated) for q in active])
            for j, q in enumerate(active):
                generated[q].append(int(lg[j].argmax()))
                _expect_equal(logits[qsl_host[q] + tick], lg[j],
                              f"{where}, request {q}, window position {tick}: logits")
                compared_logits += 1
        return generated

    # ---- prefill: the prompt minus its last token, in windows of T, every token accepted -------
    # (the same verify + commit path as decoding; the last prompt token opens the first window)
    prefix = [p[:-1] for p in prompts]
    done = [0] * R
    rounds = 0
    while any(done[q] < len(prefix[q]) for q in range(R)):
        rounds += 1
        chunks = [prefix[q][done[q]:done[q] + T] for q in range(R)]    # some rows may be empty
        before = list(spec.num_computed)
        logits, qsl = spec.forward(chunks)
        plans = spec.commit([len(c) for c in chunks], qsl)
        reference_ticks(f"prefill round {rounds}", [len(c) for c in chunks],
                        lambda q, t, gen: chunks[q][t], logits, qsl.tolist())
        checker.after_commit(f"prefill round {rounds}", plans, before)
        for q in range(R):
            done[q] += len(chunks[q])
    if on_prefill:
        on_prefill(rounds)

    # ---- speculative decoding ---------------------------------------------------------------------
    history = [list(p) for p in prompts]          # speculative path: prompt + generated
    ref_history = [list(p) for p in prompts]      # per-token path, generated on its own
    steps = []
    for step in range(1, cfg.steps + 1):
        where = f"step {step}"
        _sync(device)
        t0 = time.perf_counter()
        windows = [[history[q][-1]] + drafts[q].propose(history[q], k) for q in range(R)]
        logits, qsl = spec.forward(windows)
        preds = logits.argmax(-1).tolist()
        qsl_host = qsl.tolist()
        accepted, emitted = [], []
        for q in range(R):
            row = preds[qsl_host[q]:qsl_host[q + 1]]
            m = 0
            while m < k and windows[q][1 + m] == row[m]:
                m += 1
            accepted.append(m)
            emitted.append(windows[q][1:1 + m] + [row[m]])
        before = list(spec.num_computed)
        plans = spec.commit([m + 1 for m in accepted], qsl)
        _sync(device)
        t1 = time.perf_counter()
        for q in range(R):
            history[q] += emitted[q]

        # The per-token path feeds its OWN previous prediction; it never sees the drafts.
        generated = reference_ticks(
            where, [m + 1 for m in accepted],
            lambda q, t, gen: ref_history[q][-1] if t == 0 else gen[q][t - 1], logits, qsl_host)
        _sync(device)
        t2 = time.perf_counter()
        for q in range(R):
            ref_history[q] += generated[q]
            if generated[q] != emitted[q]:
                raise DemoMismatch(f"{where}, request {q}: the speculative path emitted {emitted[q]} "
                                   f"but the per-token path generated {generated[q]}")
        compared_before = checker.compared
        boundaries = checker.after_commit(where, plans, before)
        stats = StepStats(step=step, emitted=[len(e) for e in emitted], accepted=accepted, drafted=k,
                          spec_ms=1e3 * (t1 - t0), ref_ms=1e3 * (t2 - t1),
                          compared=checker.compared - compared_before, boundary_writes=boundaries)
        steps.append(stats)
        if on_step:
            on_step(stats)

    blocks = checker.prefix_cache()
    return DemoResult(
        config=cfg, backend=backend.name, backend_reason=reason, ref_conv=ref_conv,
        prompts=prompts, tokens=[h[len(p):] for h, p in zip(history, prompts)],
        ref_tokens=[h[len(p):] for h, p in zip(ref_history, prompts)], prefill_rounds=rounds,
        steps=steps, compared_slots=checker.compared, compared_logits=compared_logits,
        prefix_blocks_checked=blocks, memory=_memory(spec, cfg))


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device of the model and caches (default: cpu)")
    p.add_argument("--backend", default=None,
                   help="backend name (default: the one selected for the device, cpu -> cpu_ref)")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default: 4)")
    p.add_argument("--draft-tokens", type=int, default=3, help="draft tokens per window, k (default: 3)")
    p.add_argument("--steps", type=int, default=12, help="speculative steps (default: 12)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and drafts (default: 0)")
    p.add_argument("--layers", type=int, default=4, help="GDN layers, split into 2 KV-cache groups (default: 4)")
    p.add_argument("--ref-conv", choices=("auto", "torch", "kernel"), default="auto",
                   help="per-token conv of the reference path: plain torch, or the backend's kernel "
                        "(default: torch on cpu_ref, kernel elsewhere)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; the demo's ops are tiny, and extra intra-op "
                        "threads only add synchronisation, which spins badly on a busy machine)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism over N ranks, one process each: start with torchrun "
                        "--nproc-per-node N (gloo on cpu, nccl on cuda); see docs/PARALLELISM.md")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _tokens_width(R: int) -> int:
    return max(2 * R, len("tokens/req")) + 1


def _step_line(s: StepStats) -> str:
    R = len(s.accepted)
    rate = sum(s.accepted) / max(s.drafted * R, 1)
    return (f"{s.step:>4}  {' '.join(f'{e}' for e in s.emitted):<{_tokens_width(R)}}"
            f"{sum(s.emitted):>5}  {f'{sum(s.accepted)}/{s.drafted * R}':>8}  {rate:>5.0%}"
            f"  {s.spec_ms:>8.1f}  {s.ref_ms:>8.1f}  ok ({s.compared} slots, {s.boundary_writes} boundary)")


def _header(cfg: DemoConfig, R: int) -> str:
    return (f"{'step':>4}  {'tokens/req':<{_tokens_width(R)}}{'total':>5}  {'accepted':>8}  {'rate':>5}"
            f"  {'spec ms':>8}  {'ref ms':>8}  bit-identity")


def _summary(res: DemoResult) -> list[str]:
    cfg, mem = res.config, res.memory
    R, k, L = cfg.requests, cfg.draft_tokens, cfg.model.num_layers
    steps = len(res.steps) or 1
    total = sum(len(t) for t in res.tokens)
    spec_ms = sum(s.spec_ms for s in res.steps) / steps
    ref_ms = sum(s.ref_ms for s in res.steps) / steps
    rs_total = mem["recoverssm_states"] + mem["recoverssm_records"]
    per_req = " ".join(f"{a:.0%}" for a in res.acceptance_per_request())
    return [
        f"tokens: {total} generated in {len(res.steps)} steps = {total / steps / R:.2f} per request per step "
        f"(per-token decoding: 1.00)",
        f"acceptance: {res.drafts_accepted}/{res.drafts_proposed} drafts "
        f"({res.drafts_accepted / max(res.drafts_proposed, 1):.0%}); per request: {per_req}",
        f"state slots per request per layer: RecoverSSM 1 (+ records), snapshot method {k + 1} (1 + k)",
        f"bytes held ({L} layers x {R} requests, {mem['state_bytes_per_slot']} B per state): "
        f"RecoverSSM {_kib(mem['recoverssm_states'])} states + {_kib(mem['recoverssm_records'])} records "
        f"= {_kib(rs_total)}; snapshot {_kib(mem['snapshot_states'])} ({mem['snapshot_states'] / rs_total:.1f}x)",
        f"records per token: {mem['records_per_token_fraction_of_state']:.1%} of a state at these dims, "
        f"{mem['records_per_token_fraction_of_state_at_H16_HV32_K128_V128']:.1%} at H=16 HV=32 K=V=128",
        f"time per step: speculative path {spec_ms:.1f} ms (draft, verify, plan, commit), "
        f"per-token reference {ref_ms:.1f} ms",
        f"bit-identity: OK: {res.compared_slots} state/conv slot comparisons, {res.compared_logits} logits rows, "
        f"tokens equal, {res.prefix_blocks_checked} cached blocks intact at the end",
    ]


def step_printers(out: Callable[[str], None], cfg: "DemoConfig", bar, prefill_note: str = ""):
    """The demo's ``on_prefill`` and ``on_step`` callbacks: a header before the first step, then
    one table line per step, and the progress bar advanced."""
    header_done = False

    def on_prefill(rounds: int) -> None:
        out(f"prefill: prompts minus their last token in {rounds} verify+commit rounds, "
            f"bit-identical to per-token decoding{prefill_note}")

    def on_step(s: StepStats) -> None:
        nonlocal header_done
        if not header_done:
            out("")
            out(_header(cfg, cfg.requests))
            header_done = True
        out(_step_line(s))
        bar.update(1, f"{sum(s.emitted)} tokens")

    return on_prefill, on_step


def _main(args: argparse.Namespace) -> int:
    for flag, value, low in (("--requests", args.requests, 1), ("--draft-tokens", args.draft_tokens, 0),
                             ("--steps", args.steps, 0), ("--layers", args.layers, 1)):
        if value < low:
            print(f"recoverssm demo: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    mcfg = dataclasses.replace(ModelConfig(), num_layers=args.layers)
    cfg = DemoConfig(requests=args.requests, draft_tokens=args.draft_tokens, steps=args.steps,
                     seed=args.seed, device=args.device, backend=args.backend,
                     ref_conv=args.ref_conv, model=mcfg)
    quiet = args.json
    bar = ProgressBar(cfg.steps, "steps", enabled=False if quiet else None)

    def out(line: str = "") -> None:
        if not quiet:
            bar.print(line)

    try:
        backend, reason = registry().resolve(cfg.backend, cfg.device)
    except (rs.BackendError, RuntimeError) as e:
        print(f"recoverssm demo: {e}", file=sys.stderr)
        return 2
    out(f"recoverssm demo: {cfg.requests} requests, k={cfg.draft_tokens} draft tokens, {cfg.steps} steps; "
        f"backend {backend.name} on {cfg.device} ({reason})")
    out(f"model: {mcfg.describe()}, seed {cfg.seed}")
    if mcfg.num_layers > 1:
        out(f"KV-cache groups: even layers (block size {cfg.block_sizes[0]}), odd layers "
            f"(block size {cfg.block_sizes[1]}); align mode (prefix caching), one commit per step")
    else:
        out(f"one KV-cache group (block size {cfg.block_sizes[0]}); align mode (prefix caching)")
    on_prefill, on_step = step_printers(out, cfg, bar)

    t0 = time.perf_counter()
    try:
        with bar:
            res = run_demo(cfg, on_step=on_step, on_prefill=on_prefill)
    except DemoMismatch as e:
        bar.close()
        if quiet:
            print(json.dumps({"ok": False, "error": str(e)}))
        print(f"recoverssm demo: MISMATCH: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    if quiet:
        summary = res.to_json()
        summary["elapsed_s"] = elapsed
        print(json.dumps(summary, indent=2))
        return 0
    out("")
    for line in _summary(res):
        out(line)
    out(f"total {elapsed:.1f} s")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run with ``args.threads`` torch threads, restoring the caller's setting afterwards."""
    with torch_threads(args.threads):
        return _main(args)
