"""``recoverssm demo``: speculative decoding of a tiny GDN, KDA or Mamba2-hybrid model, checked bit
for bit at every step.

Each step, for every request: the draft proposes ``k`` tokens; the speculative path verifies the
window ``[last accepted token, d_1 .. d_k]`` of all requests at once (``rs.conv_verify`` +
``rs.gdn_verify``, ``rs.kda_verify`` or ``rs.mamba2_verify`` per recurrent layer, records in one
``ReplayRecords`` per layer; the hybrid's attention layers write the window into their KV caches),
accepts drafts greedily (while the target's argmax agrees; ``num_accepted = accepted drafts + 1``,
the last token being the target's own prediction) and commits every layer of both KV-cache groups
in ONE ``CommitContext.commit`` in align mode. Beside it, the per-token reference path
(:mod:`recoverssm.demo.reference`) generates the same tokens one at a time.

After every step the demo checks with ``torch.equal`` that

* the emitted tokens, and the logits of every accepted position, equal the per-token path's;
* in every slot the commit wrote (final and block-boundary slots), every layer's recurrent state
  and conv history equal the per-token path's after the same number of tokens;
* every attention layer's KV cache holds the per-token path's keys and values for each request's
  computed tokens;

and at the end that every prefix-cache block written during the run still holds its state. Any
difference raises :class:`DemoMismatch` (the CLI exits 1 with its message).

``deferred=True`` (``--deferred``): the same loop with a context that defers its commits: each
step ends with ``CommitContext.defer``, the next step's verify of every layer replays it first,
and everything pending is flushed when the run ends (every request finishes then). The checks
are the same; a step's slots are read once its commit has run (:mod:`recoverssm.demo.deferred`).

Why the two paths can agree bit for bit: the recurrence is exact by the library's design (the
records hold the very values the per-token step used; the commit replays them with the same
fused multiply-add). What remains is to feed both paths the same bits: every non-recurrent op runs
one token at a time on identically shaped tensors (:mod:`recoverssm.demo.model`), so a token's
q/k/v/a/b do not depend on the window or batch it arrived in (nor an attention layer's output:
each token attends on its own, :mod:`recoverssm.demo.attention`); and the per-token conv rounds
like the backend's verify conv (:mod:`recoverssm.demo.reference`).
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from recoverssm.core.registry import registry

from .checks import DemoMismatch, SlotChecker, expect_equal
from .deferred import CommitChecks, boundary_writes
from .draft import NgramDraft
from .model import ModelConfig, TinyModel
from .reference import ReferenceEngine
from .spec import SpecEngine

__all__ = ["DemoConfig", "DemoLoop", "DemoMismatch", "DemoResult", "StepStats", "accept_greedy", "run_demo"]


@dataclass
class DemoConfig:
    """What ``recoverssm demo`` runs. ``model.seed`` is replaced by ``seed``."""

    requests: int = 4
    draft_tokens: int = 3
    steps: int = 12
    seed: int = 0
    device: str = "cpu"
    backend: Optional[str] = None
    block_sizes: tuple[int, ...] = (4, 5)      # group 0, group 1: every other recurrent layer
    prompt_len: tuple[int, int] = (5, 9)       # inclusive range, drawn per request
    # Per request (cycled): relative noise on the draft's copy of the weights, and the chance of
    # replacing a draft token by a random one. Different drafts -> different acceptance.
    draft_weight_noise: tuple[float, ...] = (0.02, 0.1, 0.3, 0.6)
    draft_token_noise: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
    ref_conv: str = "auto"                     # "kernel", "torch", or "auto" (see resolve_ref_conv)
    deferred: bool = False                     # defer each step's commit into the next step's verify
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class StepStats:
    step: int
    emitted: list[int]          # tokens added per request (accepted drafts + 1)
    accepted: list[int]         # accepted drafts per request
    drafted: int                # drafts proposed per request
    spec_ms: float              # draft + verify + plan + commit (or defer)
    ref_ms: float               # per-token reference path
    compared: int               # slot comparisons (state + conv per layer) this step (deferred: of the step before)
    boundary_writes: int        # block-boundary states the step's commit stores


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
    compared_kv: int = 0             # attention layers' KV-cache prefixes compared (Mamba2 hybrid)
    replayed_rows: int = 0           # deferred: pending row commits the next step's verify replayed
    flushed_rows: int = 0            # deferred: pending row commits a flush committed
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
            "prefix_blocks_checked": self.prefix_blocks_checked, "compared_kv": self.compared_kv,
            "memory": self.memory,
            "deferred": self.config.deferred, "replayed_rows": self.replayed_rows,
            "flushed_rows": self.flushed_rows,
        }


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


def _records_fraction(c: ModelConfig) -> float:
    """One token's replay records as a fraction of one state (both fp32, per request per layer)."""
    return c.records_per_token() / (c.HV * c.V * c.K)


def _memory(spec: SpecEngine, cfg: DemoConfig) -> dict:
    mem = spec.bytes_held()
    big = cfg.model.at_production_scale()
    mem.update({
        "slots_per_request_recoverssm": 1, "slots_per_request_snapshot": cfg.draft_tokens + 1,
        "records_per_token_fraction_of_state": _records_fraction(cfg.model),
        "production_heads": big.heads(),
        "records_per_token_fraction_of_state_at_production": _records_fraction(big),
    })
    return mem


def accept_greedy(windows: Sequence[Sequence[int]], preds: Sequence[int], qsl_host: Sequence[int],
                  k: int) -> tuple[list[int], list[list[int]]]:
    """Greedy acceptance of each window ``[last token, d_1 .. d_k]`` against the target's argmax
    ``preds`` (flat over the windows, ``qsl_host`` where each starts): drafts are accepted while
    the target predicts them. Returns the accepted drafts per request and the tokens it emits
    (those drafts, then the target's own next prediction)."""
    accepted, emitted = [], []
    for q, window in enumerate(windows):
        row = preds[qsl_host[q]:qsl_host[q + 1]]
        m = 0
        while m < k and window[1 + m] == row[m]:
            m += 1
        accepted.append(m)
        emitted.append(list(window[1:1 + m]) + [row[m]])
    return accepted, emitted


def resolve_ref_conv(ref_conv: str, backend) -> str:
    """``"auto"``: the per-token conv through the backend's ``rs.conv_decode`` (``"kernel"``), or in
    plain torch (bit-identical on cpu_ref only) where the backend has no ``conv_decode``."""
    if ref_conv == "auto":
        return "kernel" if "conv_decode" in backend.capabilities else "torch"
    return ref_conv


class DemoLoop:
    """The two paths of one demo run over the same model and prompts, and the checks between them.

    :meth:`prefill` once, then :meth:`step` per speculative step; :meth:`finish` checks the
    prefix cache and returns the result."""

    def __init__(self, cfg: DemoConfig, model: TinyModel, backend, ref_conv: str):
        self.cfg, self.device = cfg, torch.device(cfg.device)
        R, self.k = cfg.requests, cfg.draft_tokens
        self.T = self.k + 1
        vocab = cfg.model.vocab
        rng = random.Random(cfg.seed + 1)
        self.prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*cfg.prompt_len))] for _ in range(R)]
        max_tokens = max(len(p) for p in self.prompts) + cfg.steps * self.T + 1
        self.spec = SpecEngine(model, R, self.T, cfg.block_sizes, max_tokens, backend, seed=cfg.seed + 2,
                               deferred=cfg.deferred)
        self.ref = ReferenceEngine(model, R, backend, ref_conv, self.spec.block_sizes, self.spec.layers_of)
        self.checker = SlotChecker(self.spec, self.ref)
        self.commits = CommitChecks(self.spec, self.checker)
        self.drafts = [NgramDraft(model.next_token_table(_cycle(cfg.draft_weight_noise, q), cfg.seed + 3 + q),
                                  vocab, noise=_cycle(cfg.draft_token_noise, q), seed=cfg.seed + 100 + q)
                       for q in range(R)]
        self.history = [list(p) for p in self.prompts]          # speculative path: prompt + generated
        self.ref_history = [list(p) for p in self.prompts]      # per-token path, generated on its own
        self.compared_logits = 0
        self.prefill_rounds = 0
        self.steps: list[StepStats] = []

    @property
    def requests(self) -> int:
        return self.cfg.requests

    def reference_ticks(self, where: str, counts: Sequence[int],
                        token_of: Callable[[int, int, list[list[int]]], int], logits: torch.Tensor,
                        qsl_host: Sequence[int]) -> list[list[int]]:
        """Feed the per-token path ``counts[q]`` tokens per request, one call per position
        (``token_of(q, tick, generated so far)``); check each position's logits against the
        window's. Returns the tokens it generated per request."""
        generated = [[] for _ in range(self.requests)]
        for tick in range(max(counts, default=0)):
            active = [q for q in range(self.requests) if counts[q] > tick]
            lg = self.ref.feed(active, [token_of(q, tick, generated) for q in active])
            for j, q in enumerate(active):
                generated[q].append(int(lg[j].argmax()))
                expect_equal(logits[qsl_host[q] + tick], lg[j],
                             f"{where}, request {q}, window position {tick}: logits")
                self.compared_logits += 1
        return generated

    def prefill(self) -> int:
        """The prompts minus their last token, in windows of ``T``, every token accepted: the same
        verify + commit path as decoding (the last prompt token opens the first window). Returns
        the rounds it took."""
        prefix = [p[:-1] for p in self.prompts]
        done = [0] * self.requests
        while any(done[q] < len(prefix[q]) for q in range(self.requests)):
            self.prefill_rounds += 1
            where = f"prefill round {self.prefill_rounds}"
            chunks = [prefix[q][done[q]:done[q] + self.T] for q in range(self.requests)]   # some may be empty
            before = list(self.spec.num_computed)
            logits, qsl = self.spec.forward(chunks)
            self.commits.verified(where)        # deferred: the previous round's slots are written now
            plans = self.spec.commit([len(c) for c in chunks], qsl)
            self.reference_ticks(where, [len(c) for c in chunks], lambda q, t, gen: chunks[q][t], logits,
                                 qsl.tolist())
            self.commits.committed(where, plans, before)
            for q in range(self.requests):
                done[q] += len(chunks[q])
        return self.prefill_rounds

    def step(self, step: int) -> StepStats:
        """One speculative step of every request, checked against the per-token path."""
        where, k = f"step {step}", self.k
        _sync(self.device)
        t0 = time.perf_counter()
        windows = [[self.history[q][-1]] + self.drafts[q].propose(self.history[q], k) for q in range(self.requests)]
        logits, qsl = self.spec.forward(windows)
        compared_before = self.checker.compared
        # Deferred: this verify replayed the previous step's commit, and the host reads a row's
        # slots only once its commit has run (replayed or flushed): they are checked now, untimed.
        _sync(self.device)
        t_verified = time.perf_counter()
        self.commits.verified(where)
        t_checked = time.perf_counter()
        qsl_host = qsl.tolist()
        accepted, emitted = accept_greedy(windows, logits.argmax(-1).tolist(), qsl_host, k)
        before = list(self.spec.num_computed)
        plans = self.spec.commit([m + 1 for m in accepted], qsl)
        _sync(self.device)
        t1 = time.perf_counter()
        for q in range(self.requests):
            self.history[q] += emitted[q]

        # The per-token path feeds its OWN previous prediction; it never sees the drafts.
        generated = self.reference_ticks(
            where, [m + 1 for m in accepted],
            lambda q, t, gen: self.ref_history[q][-1] if t == 0 else gen[q][t - 1], logits, qsl_host)
        _sync(self.device)
        t2 = time.perf_counter()
        for q in range(self.requests):
            self.ref_history[q] += generated[q]
            if generated[q] != emitted[q]:
                raise DemoMismatch(f"{where}, request {q}: the speculative path emitted {emitted[q]} "
                                   f"but the per-token path generated {generated[q]}")
        self.commits.committed(where, plans, before)
        stats = StepStats(step=step, emitted=[len(e) for e in emitted], accepted=accepted, drafted=k,
                          spec_ms=1e3 * (t_verified - t0 + t1 - t_checked), ref_ms=1e3 * (t2 - t1),
                          compared=self.checker.compared - compared_before, boundary_writes=boundary_writes(plans))
        self.steps.append(stats)
        return stats

    def finish(self, backend_name: str, reason: str, ref_conv: str) -> DemoResult:
        """(Deferred) flush what is pending and check the last step; check that every
        prefix-cache block still holds its state; the run's result."""
        self.commits.finish()
        blocks = self.checker.prefix_cache()
        return DemoResult(
            config=self.cfg, backend=backend_name, backend_reason=reason, ref_conv=ref_conv,
            prompts=self.prompts, tokens=[h[len(p):] for h, p in zip(self.history, self.prompts)],
            ref_tokens=[h[len(p):] for h, p in zip(self.ref_history, self.prompts)],
            prefill_rounds=self.prefill_rounds, steps=self.steps, compared_slots=self.checker.compared,
            compared_logits=self.compared_logits, prefix_blocks_checked=blocks,
            compared_kv=self.checker.compared_kv,
            memory=_memory(self.spec, self.cfg), replayed_rows=self.commits.replayed_rows,
            flushed_rows=self.commits.flushed_rows)


def run_demo(cfg: DemoConfig, on_step: Optional[Callable[[StepStats], None]] = None,
             on_prefill: Optional[Callable[[int], None]] = None, *,
             make_model: Optional[Callable[[ModelConfig, torch.device], TinyModel]] = None) -> DemoResult:
    """Run the demo; raise :class:`DemoMismatch` at the first difference. ``on_prefill(rounds)``
    after the checked prefill, ``on_step(stats)`` after each checked step (progress reporting).
    ``make_model(model_cfg, device)`` replaces :class:`TinyModel` (the tensor-parallel demo passes
    its per-rank shard, :mod:`.tp`)."""
    if cfg.requests < 1 or cfg.draft_tokens < 0 or cfg.steps < 0 or cfg.model.num_layers < 1:
        raise ValueError("requests and layers must be >= 1, draft_tokens and steps >= 0")
    device = torch.device(cfg.device)
    backend, reason = registry().resolve(cfg.backend, device)
    ref_conv = resolve_ref_conv(cfg.ref_conv, backend)
    model = (make_model or TinyModel)(dataclasses.replace(cfg.model, seed=cfg.seed), device)
    loop = DemoLoop(cfg, model, backend, ref_conv)
    rounds = loop.prefill()
    if on_prefill:
        on_prefill(rounds)
    for step in range(1, cfg.steps + 1):
        stats = loop.step(step)
        if on_step:
            on_step(stats)
    return loop.finish(backend.name, reason, ref_conv)
