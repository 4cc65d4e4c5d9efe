"""What the demo prints: the opening lines, a table row per step, and the closing summary, for the
single-process and the tensor-parallel front end (:mod:`.cli`)."""
from __future__ import annotations

from typing import Callable

from recoverssm.console import ProgressBar, Table

from .model import ModelConfig
from .run import DemoConfig, DemoResult, StepStats
from .tp import TPDemoResult


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def per_token_ops(mcfg: ModelConfig, ref_conv: str) -> str:
    """The ops of the per-token path, e.g. ``rs.kda_decode + rs.conv_decode``."""
    conv = "rs.conv_decode" if ref_conv == "kernel" else "the conv in plain torch"
    return f"rs.{mcfg.arch}_decode + {conv}"


def intro_lines(cfg: DemoConfig, backend_name: str, reason: str, ref_conv: str) -> list[str]:
    """The single-process demo's opening: what runs where, the model, the KV-cache groups, the
    per-token path (``ref_conv`` resolved)."""
    mcfg = cfg.model
    lines = [f"recoverssm demo: {cfg.requests} requests, k={cfg.draft_tokens} draft tokens, {cfg.steps} steps; "
             f"backend {backend_name} on {cfg.device} ({reason})",
             f"model: {mcfg.describe()}, seed {cfg.seed}",
             f"speculative path: rs.conv_verify + rs.{mcfg.arch}_verify per window; "
             f"per-token path: {per_token_ops(mcfg, ref_conv)}, one token per call"]
    ending = "one defer per step" if cfg.deferred else "one commit per step"
    if mcfg.num_layers > 1:
        first, second = _group_layers(mcfg)
        lines.append(f"KV-cache groups: {first} (block size {cfg.block_sizes[0]}), {second} "
                     f"(block size {cfg.block_sizes[1]}); align mode (prefix caching), {ending}")
    else:
        lines.append(f"one KV-cache group (block size {cfg.block_sizes[0]}); align mode (prefix caching)"
                     + (f", {ending}" if cfg.deferred else ""))
    return lines + attention_intro(mcfg) + deferred_intro(cfg)


def _group_layers(mcfg: ModelConfig) -> tuple[str, str]:
    """The layers of the two KV-cache groups (every other recurrent layer, as :mod:`.spec` splits
    them), e.g. ``even layers`` or, in the Mamba2 hybrid, ``Mamba2 layers 0, 3``."""
    if not mcfg.attention_layers:
        return "even layers", "odd layers"
    return tuple("Mamba2 layers " + ", ".join(map(str, mcfg.recurrent_layers[g::2])) for g in range(2))


def attention_intro(mcfg: ModelConfig) -> list[str]:
    """How the hybrid's attention layers roll back (nothing without attention layers)."""
    if not mcfg.attention_layers:
        return []
    layers = ", ".join(map(str, mcfg.attention_layers))
    return [f"attention layers {layers}: a KV cache per request, no commit (the next window overwrites "
            f"rejected drafts' keys); checked against the per-token path's caches after every step"]


def deferred_intro(cfg: DemoConfig) -> list[str]:
    """How a deferred run commits (nothing without ``--deferred``)."""
    if not cfg.deferred:
        return []
    return ["deferred commits: each step's commit is replayed by the next step's verify of every layer "
            "(double-buffered records), everything pending flushed at the end; a step's slots are "
            "checked once written"]


def tp_intro_lines(cfg: DemoConfig, world: int, device_type: str, backend_name: str, reason: str,
                   dist_backend: str, ref_conv: str) -> list[str]:
    """The tensor-parallel demo's opening: what runs where, the model, how it is sharded."""
    mcfg: ModelConfig = cfg.model
    return [
        f"recoverssm demo --tp {world}: {cfg.requests} requests, k={cfg.draft_tokens} draft tokens, "
        f"{cfg.steps} steps; backend {backend_name} on {device_type} ({reason}); "
        f"{dist_backend} process group of {world}",
        f"model: {mcfg.describe()}, seed {cfg.seed}",
        f"sharding: each rank holds H/{world} q/k heads, HV/{world} value heads and their conv channels "
        f"of every layer (column-parallel in-projection, row-parallel out-projection + all_reduce); "
        f"embedding, MLP, head and sampling replicated",
        f"reference: each rank's own per-token path on the same shard ({per_token_ops(mcfg, ref_conv)}, "
        f"same all-reduces)",
    ] + deferred_intro(cfg)


def step_table(requests: int) -> Table:
    """The per-step table; its widths are fixed up front because rows print as steps finish."""
    headers = ["step", "tokens/req", "total", "accepted", "rate", "spec ms", "ref ms", "bit-identity"]
    widths = [4, 2 * requests, 5, 8, 5, 8, 8, 0]
    return Table(headers, widths, align="><>>>>><")


def step_cells(s: StepStats) -> list[object]:
    """One step's row of :func:`step_table`."""
    R = len(s.accepted)
    rate = sum(s.accepted) / max(s.drafted * R, 1)
    return [s.step, " ".join(f"{e}" for e in s.emitted), sum(s.emitted), f"{sum(s.accepted)}/{s.drafted * R}",
            f"{rate:.0%}", f"{s.spec_ms:.1f}", f"{s.ref_ms:.1f}",
            f"ok ({s.compared} slots, {s.boundary_writes} boundary)"]


class StepPrinter:
    """The ``on_prefill`` and ``on_step`` callbacks of :func:`~recoverssm.demo.run_demo`: the
    prefill line, the table header before the first step, then one row per step, advancing
    ``bar``. ``prefill_note`` ends the prefill line (the TP demo says where it was checked)."""

    def __init__(self, out: Callable[[str], None], cfg: DemoConfig, bar: ProgressBar, prefill_note: str = ""):
        self.out, self.bar, self.prefill_note = out, bar, prefill_note
        self.ending = "defer" if cfg.deferred else "commit"
        self.table = step_table(cfg.requests)
        self.header_done = False

    def on_prefill(self, rounds: int) -> None:
        self.out(f"prefill: prompts minus their last token in {rounds} verify+{self.ending} rounds, "
                 f"bit-identical to per-token decoding{self.prefill_note}")

    def on_step(self, s: StepStats) -> None:
        if not self.header_done:
            self.out("")
            self.out(self.table.header())
            self.header_done = True
        self.out(self.table.line(step_cells(s)))
        self.bar.update(1, f"{sum(s.emitted)} tokens")


def summary_lines(res: DemoResult) -> list[str]:
    """The closing summary: tokens per step, acceptance, memory, time, and the bit-identity count."""
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
        f"{mem['records_per_token_fraction_of_state_at_production']:.1%} at {mem['production_heads']}",
        f"time per step: speculative path {spec_ms:.1f} ms (draft, verify, plan, commit), "
        f"per-token reference {ref_ms:.1f} ms",
        f"bit-identity: OK: {res.compared_slots} state/conv slot comparisons, {res.compared_logits} logits rows, "
        f"{_kv_count(res)}tokens equal, {res.prefix_blocks_checked} cached blocks intact at the end",
    ] + deferred_lines(res)


def _kv_count(res: DemoResult) -> str:
    """The attention KV-cache comparisons of the bit-identity line (none without attention layers)."""
    return f"{res.compared_kv} attention KV-cache prefixes, " if res.compared_kv else ""


def deferred_lines(res: DemoResult) -> list[str]:
    """What the deferred commits did (nothing without ``--deferred``)."""
    if not res.config.deferred:
        return []
    return [f"deferred commits: {res.replayed_rows} pending row commits replayed inside the next step's verify, "
            f"{res.flushed_rows} flushed at the end of the run"]


def tp_lines(tpr: TPDemoResult) -> list[str]:
    """The tensor-parallel part of the summary: each rank's checks, and the checks across ranks."""
    lines = [f"tensor parallel: {tpr.world} ranks over {tpr.dist_backend}; per rank: one state pool, "
             f"conv state, records workspace and CommitContext per layer shard"]
    for r in tpr.ranks:
        mem = r["memory"]
        lines.append(
            f"  rank {r['rank']}: {r['shard']}; {r['compared_slots']} state/conv slot comparisons, "
            f"{r['compared_logits']} logits rows, {r['prefix_blocks_checked']} cached blocks: OK "
            f"(own per-token path); {r['all_reduces']} all-reduces; holds "
            f"{_kib(mem['recoverssm_states'] + mem['recoverssm_records'])} states + records")
    differing = (f"{tpr.logits_rows_differing} differ" if tpr.logits_rows_differing
                 else "all bit-identical")
    lines.append(f"across ranks: greedy tokens equal in {tpr.token_rows_checked} logits rows "
                 f"(all_gather at every logits call) and in the generated text; logits rows: "
                 f"{differing}")
    return lines
