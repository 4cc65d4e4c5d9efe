"""The command line: ``info``, ``demo`` (bit-identity of speculative vs per-token decoding),
``check`` and the ``bench`` placeholder."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from recoverssm import cli
from recoverssm.backends.cpu_ref.plugin import CpuRefBackend
from recoverssm.core.hookspecs import hookimpl
from recoverssm.core.registry import registry
from recoverssm.demo import DemoConfig, DemoMismatch, ModelConfig, run_demo
from recoverssm.demo.spec import SpecEngine
from recoverssm.cli_support import torch_threads

@pytest.fixture(autouse=True)
def one_thread():
    """The demo's ops are tiny: one intra-op thread is much faster (and restored afterwards)."""
    with torch_threads(1):
        yield


TINY = ModelConfig(vocab=64, hidden=32, num_layers=2, H=1, HV=2, K=8, V=8, mlp_hidden=32)


def tiny_config(**kw) -> DemoConfig:
    base = dict(requests=3, draft_tokens=2, steps=4, seed=1, prompt_len=(3, 7), model=TINY)
    base.update(kw)
    return DemoConfig(**base)


# ---- demo ------------------------------------------------------------------------------------------
def test_demo_is_bit_identical_to_per_token_decoding():
    res = run_demo(tiny_config())
    assert res.ok and res.backend == "cpu_ref" and res.ref_conv == "kernel"
    assert res.tokens == res.ref_tokens
    assert len(res.steps) == 4
    # every step emits accepted drafts + 1 per request, and the checks really ran
    for s in res.steps:
        assert s.emitted == [a + 1 for a in s.accepted]
    assert all(len(t) == sum(s.emitted[q] for s in res.steps) for q, t in enumerate(res.tokens))
    assert res.compared_slots > 0 and res.compared_logits > 0 and res.prefix_blocks_checked > 0


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_bf16_state_demo_is_bit_identical_to_per_token_decoding(arch, deferred):
    """bf16 state pools: the speculative path (eager or deferred commits) gives the states,
    logits and tokens of one-token-per-call decoding, which stores a bf16 state after every token."""
    model = dataclasses.replace(TINY, state_dtype="bf16", arch=arch, H=2 if arch == "kda" else TINY.H)
    res = run_demo(tiny_config(model=model, draft_tokens=3, steps=5, deferred=deferred))
    assert res.ok and res.tokens == res.ref_tokens and res.compared_slots > 0


def test_demo_windows_cross_and_end_on_block_boundaries():
    # k + 1 = block size 4 (group 0): windows end exactly on boundaries and cross them.
    res = run_demo(tiny_config(draft_tokens=3, steps=6, requests=4))
    assert res.tokens == res.ref_tokens
    assert sum(s.boundary_writes for s in res.steps) > 0


def test_demo_reference_conv_in_plain_torch_agrees_too():
    """The per-token conv written out in torch (no library code) matches cpu_ref's verify conv."""
    res = run_demo(tiny_config(ref_conv="torch", steps=3))
    assert res.ref_conv == "torch" and res.tokens == res.ref_tokens


def test_demo_detects_a_one_ulp_difference(monkeypatch):
    original = SpecEngine.commit

    def corrupting_commit(self, num_accepted, qsl):
        plans = original(self, num_accepted, qsl)
        slot = plans[1].final_slot[0]
        layer = self.layers_of[1][0]
        s = self.state[layer][slot]
        s[0, 0, 0] = torch.nextafter(s[0, 0, 0], torch.tensor(float("inf")))
        return plans

    monkeypatch.setattr(SpecEngine, "commit", corrupting_commit)
    with pytest.raises(DemoMismatch, match="recurrent state"):
        run_demo(tiny_config(steps=2))


def test_demo_cli_json(capsys):
    rc = cli.main(["demo", "--device", "cpu", "--requests", "2", "--draft-tokens", "2", "--steps", "2",
                   "--layers", "2", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["tokens_match"] and summary["backend"] == "cpu_ref"
    assert summary["memory"]["slots_per_request_snapshot"] == 3
    assert summary["deferred"] is False and summary["replayed_rows"] == summary["flushed_rows"] == 0


# ---- demo --deferred ----------------------------------------------------------------------------------
def _row_commits(res) -> int:
    """Row commits of a run: one per request per prefill round with a non-empty chunk (prompt minus
    its last token, in windows of k + 1), one per request per step (accepted drafts + 1 >= 1)."""
    T = res.config.draft_tokens + 1
    return sum(-(-(len(p) - 1) // T) for p in res.prompts) + len(res.steps) * res.config.requests


def test_deferred_demo_is_bit_identical_to_per_token_decoding():
    """Every step's commit deferred into the next step's verify: the same tokens, logits and
    states (checked once written) as the per-token path, and as the eager run."""
    cfg = dict(draft_tokens=3, steps=6, requests=4)      # windows cross block boundaries
    eager = run_demo(tiny_config(**cfg))
    res = run_demo(tiny_config(**cfg, deferred=True))
    assert res.ok and res.tokens == res.ref_tokens == eager.tokens
    assert [s.accepted for s in res.steps] == [s.accepted for s in eager.steps]
    # the same comparisons (each step's slots checked one step later, the last after the flush)
    assert (res.compared_slots, res.compared_logits, res.prefix_blocks_checked) == \
        (eager.compared_slots, eager.compared_logits, eager.prefix_blocks_checked)
    assert sum(s.boundary_writes for s in res.steps) > 0
    # every row commit but the last step's was replayed by the next verify; the last step's
    # (every request emits a token) were flushed when the run ended
    assert res.flushed_rows == res.config.requests
    assert res.replayed_rows + res.flushed_rows == _row_commits(res) and res.replayed_rows > 0
    assert eager.replayed_rows == eager.flushed_rows == 0
    # double-buffered records
    assert res.memory["recoverssm_records"] == 2 * eager.memory["recoverssm_records"]


def test_deferred_demo_without_steps_flushes_the_prefill():
    res = run_demo(tiny_config(steps=0, deferred=True))
    assert res.ok and res.flushed_rows > 0 and res.replayed_rows + res.flushed_rows == _row_commits(res)


def test_deferred_demo_detects_a_one_ulp_difference(monkeypatch):
    """A state nudged by one ulp after the verify replayed it is caught by the deferred check."""
    original = SpecEngine.forward

    def corrupting_forward(self, windows):
        out = original(self, windows)
        layer = self.layers_of[1][0]
        s = self.state[layer][self.source[1][0]]           # where the replay put request 0's state
        s[0, 0, 0] = torch.nextafter(s[0, 0, 0], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(SpecEngine, "forward", corrupting_forward)
    with pytest.raises(DemoMismatch, match="replayed by .* verify.*recurrent state"):
        run_demo(tiny_config(steps=2, deferred=True))


def test_demo_cli_deferred_json(capsys):
    rc = cli.main(["demo", "--device", "cpu", "--requests", "2", "--draft-tokens", "2", "--steps", "2",
                   "--layers", "2", "--deferred", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["tokens_match"] and summary["deferred"] is True
    assert summary["config"]["deferred"] is True
    assert summary["replayed_rows"] > 0 and summary["flushed_rows"] == 2


def test_demo_cli_deferred_text(capsys):
    assert cli.main(["demo", "--device", "cpu", "--requests", "2", "--draft-tokens", "1", "--steps", "2",
                     "--layers", "1", "--deferred"]) == 0
    out = capsys.readouterr().out
    assert "one defer per step" in out and "verify+defer rounds" in out
    assert "pending row commits replayed inside the next step's verify, 2 flushed at the end" in out


@pytest.mark.parametrize("present, want", [(("cuda", "xpu"), "cuda"), (("xpu",), "xpu"), ((), "cpu")])
def test_commands_default_to_the_gpu(monkeypatch, present, want):
    """Without ``--device``, demo and check run where the default backend is: cuda if torch sees
    an NVIDIA GPU, else xpu if it sees an Intel GPU, else the CPU; the TP demo only on cuda (NCCL)."""
    import recoverssm.cli_support as support
    from recoverssm.check.cli import default_device as check_default

    monkeypatch.setattr(support, "accelerator_available", lambda device_type: device_type in present)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert support.default_device() == torch.device(want)
    assert check_default(None) == torch.device(want)
    assert support.default_device(("cuda",)).type == ("cuda" if "cuda" in present else "cpu")


# ---- info ------------------------------------------------------------------------------------------
def test_info_mentions_cpu_ref(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu_ref" in out and "torch" in out and "selected" in out


def test_info_json():
    info = cli.collect_info()
    names = [b["name"] for b in info["backends"]]
    assert "cpu_ref" in names
    assert info["selected"]["cpu"]["backend"] in ("cpu_ref",) or os.environ.get("RECOVERSSM_BACKEND")
    assert any(d["type"] == "cpu" for d in info["devices"])


def test_python_dash_m_runs():
    out = subprocess.run([sys.executable, "-m", "recoverssm", "info", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert "cpu_ref" in json.loads(out)["selected"]["cpu"]["backend"] or os.environ.get("RECOVERSSM_BACKEND")


# ---- check -----------------------------------------------------------------------------------------
def test_check_cpu_ref_passes(capsys):
    rc = cli.main(["check", "--backend", "cpu_ref", "--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"], [i for i in report["items"] if i["status"] != "pass"]
    assert report["counts"]["pass"] > 20


def test_check_bad_device_is_a_usage_error(capsys):
    """A ``--device`` torch cannot parse: one line naming it and exit 2, as the other commands."""
    assert cli.main(["check", "--device", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "--device 'bogus'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


class _OneUlpOffDecode(CpuRefBackend):
    """cpu_ref whose decode nudges one state element by one ulp: within every tolerance, but no
    longer bit-identical to the commit."""

    name = "cpu_ref_off_by_one_ulp"

    def recurrence(self, call, **kwargs):
        super().recurrence(call, **kwargs)
        state = call.state
        if call.mode == "decode":
            for slot in call.state_indices.tolist():
                if slot >= 0:
                    state[slot, 0, 0, 0] = torch.nextafter(state[slot, 0, 0, 0].float(),
                                                           torch.tensor(float("inf"))).to(state.dtype)


class _Plugin:
    @hookimpl
    def recoverssm_backends(self):
        return [_OneUlpOffDecode()]


def test_check_catches_a_backend_that_is_not_bit_exact(capsys):
    registry().register(_Plugin(), name="test-off-by-one-ulp")
    try:
        rc = cli.main(["check", "--backend", _OneUlpOffDecode.name, "--device", "cpu", "--json"])
    finally:
        registry().unregister("test-off-by-one-ulp")
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["passed"]
    failed = {i["name"] for i in report["items"] if i["status"] == "FAIL"}
    assert "commit == own decode (bit-exact)" in failed
    # ... while the tolerance items against cpu_ref still pass
    assert not any(i["status"] == "FAIL" and "vs cpu_ref" in i["name"] and "decode" in i["name"]
                   for i in report["items"])


#: the items of every deferred case (``recoverssm/check/deferred.py``)
DEFERRED_ITEMS = {"deferred outputs == own eager (every step)", "deferred states == own eager (after flush)",
                  "deferred conv states == own eager (after flush)", "deferred outputs vs cpu_ref",
                  "deferred states vs cpu_ref", "deferred conv histories vs cpu_ref"}


def _deferred_items(report: dict) -> dict[str, list[dict]]:
    """The deferred cases' items, by case."""
    cases: dict[str, list[dict]] = {}
    for item in report["items"]:
        if item["case"].startswith("deferred"):
            cases.setdefault(item["case"], []).append(item)
    return cases


def test_check_covers_deferred_commits_on_cpu_ref(capsys):
    """The deferred check runs random step sequences deferring against eager: every item passes,
    and the sequences replayed, flushed and (align mode) stored block-boundary states."""
    rc = cli.main(["check", "--backend", "cpu_ref", "--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    cases = _deferred_items(report)
    assert rc == 0 and len(cases) == 4 and any("align bs" in c for c in cases)
    assert any("mamba2" in c and "gdn" in c and "kda" in c for c in cases)     # the families share a context
    for case, items in cases.items():
        assert {i["name"] for i in items if i["status"] == "pass"} == DEFERRED_ITEMS, items
        note = next(i["note"] for i in items if i["name"] == "deferred outputs == own eager (every step)")
        counts = [int(n) for n in re.findall(r"\d+", note)]
        assert len(counts) == (3 if "align bs" in case else 2) and min(counts) > 0, note


class _OneUlpOffReplay(CpuRefBackend):
    """cpu_ref whose verify nudges each state it replayed from a pending step by one ulp of the
    state's dtype: every other op is cpu_ref's, so only the deferred check can notice."""

    name = "cpu_ref_replay_off_by_one_ulp"

    def recurrence(self, call, **kwargs):
        super().recurrence(call, **kwargs)
        pending, state = call.pending, call.state
        if pending is None or pending.rows is None:
            return
        commit_len = pending.plan[0, 0].tolist()
        for slot, prev in zip(call.state_indices.tolist(), pending.rows.tolist()):
            if slot >= 0 and prev >= 0 and commit_len[prev] > 0:
                state.view({2: torch.int16, 4: torch.int32}[state.element_size()])[slot, 0, 0, 0] += 1


class _ReplayPlugin:
    @hookimpl
    def recoverssm_backends(self):
        return [_OneUlpOffReplay()]


def test_check_catches_a_replay_that_is_not_bit_exact(capsys):
    registry().register(_ReplayPlugin(), name="test-replay-off-by-one-ulp")
    try:
        rc = cli.main(["check", "--backend", _OneUlpOffReplay.name, "--device", "cpu", "--json"])
    finally:
        registry().unregister("test-replay-off-by-one-ulp")
    report = json.loads(capsys.readouterr().out)
    failed = {(i["case"], i["name"]) for i in report["items"] if i["status"] != "pass"}
    assert rc == 1 and not report["passed"]
    assert {case for case, _ in failed} == set(_deferred_items(report))      # only the deferred cases
    names = {name for _, name in failed}
    assert "deferred states == own eager (after flush)" in names
    assert all("own eager" in name for name in names)      # within tolerance of cpu_ref all the same


def test_check_covers_mamba2(capsys):
    """Mamba2 in every kind of recurrent case (one layer, align mode, deferred sequences mixed with
    GDN and KDA layers), with its optional inputs and bf16 states; every item passes."""
    rc = cli.main(["check", "--backend", "cpu_ref", "--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    items = [i for i in report["items"] if "mamba2" in i["case"]]
    assert rc == 0 and all(i["status"] == "pass" for i in items), items
    names = {i["name"] for i in items}
    assert {"mamba2_verify out vs cpu_ref", "mamba2_verify records vs cpu_ref", "mamba2_decode state vs cpu_ref",
            "snapshot last state == own decode", "commit == own one-token decode steps",
            "commit == own decode (final+boundary)", "deferred states == own eager (after flush)"} <= names
    cases = {i["case"] for i in items}
    assert any("D/channel z dt[" in c and c.startswith("mamba2") for c in cases)
    assert any("state bf16" in c and c.startswith("mamba2") for c in cases)
    assert any(c.startswith("align") for c in cases) and any(c.startswith("deferred") for c in cases)


class _NoMamba2(CpuRefBackend):
    """cpu_ref without the Mamba2 recurrence."""

    name = "cpu_ref_no_mamba2"
    capabilities = CpuRefBackend.capabilities - {"mamba2"}


class _NoMamba2Plugin:
    @hookimpl
    def recoverssm_backends(self):
        return [_NoMamba2()]


def test_check_skips_the_mamba2_cases_of_a_backend_without_it(capsys):
    """Exactly the cases with a Mamba2 layer are skipped (each as one item), the rest pass."""
    registry().register(_NoMamba2Plugin(), name="test-no-mamba2")
    try:
        rc = cli.main(["check", "--backend", _NoMamba2.name, "--device", "cpu", "--json"])
    finally:
        registry().unregister("test-no-mamba2")
    report = json.loads(capsys.readouterr().out)
    skipped = [i for i in report["items"] if i["status"] == "skip"]
    assert rc == 0 and skipped and all("mamba2" in i["note"] for i in skipped)
    assert {i["case"] for i in skipped} == {i["case"] for i in report["items"] if "mamba2" in i["case"]}
    assert len(skipped) == len({i["case"] for i in skipped})


def _cuda_backend_under_interpreter() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        importlib.import_module("recoverssm.backends.cuda")
    except Exception:
        return False
    return "cuda" in registry().backends()


@pytest.mark.interpreter
@pytest.mark.skipif(not _cuda_backend_under_interpreter(),
                    reason="needs TRITON_INTERPRET=1 and the cuda backend registered")
def test_check_cuda_backend_under_the_interpreter(capsys):
    rc = cli.main(["check", "--backend", "cuda", "--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    bad = [i for i in report["items"] if i["status"] not in ("pass", "skip")]
    assert rc == 0 and report["passed"], bad
    passed = {i["name"] for i in report["items"] if i["status"] == "pass"}
    assert {"kda_verify out vs cpu_ref", "kda_decode state vs cpu_ref", "mamba2_verify out vs cpu_ref",
            "mamba2_decode state vs cpu_ref", "conv_decode out vs cpu_ref",
            "conv_decode history == own conv_verify window"} <= passed
    # the deferred check: the kernels deferring against their own eager path, and against cpu_ref
    cases = _deferred_items(report)
    assert len(cases) == 4 and all({i["name"] for i in items if i["status"] == "pass"} == DEFERRED_ITEMS
                                   for items in cases.values()), cases


# ---- bench -----------------------------------------------------------------------------------------
def test_bench_needs_a_gpu(capsys):
    """Without a CUDA GPU the benchmark says so and exits 2 (it times the cuda backend's kernels)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_table_renders():
    """The benchmark's table and memory rows render from a results dict (no GPU involved)."""
    from recoverssm.bench import suites

    results = dict(date="2026-11-29", commit="abc", gpu="test", torch="x", triton="y", copy_tbps_1GiB=4.2,
                   rows=suites.bench_memory())
    text = suites.render(results)
    assert "T=4 HV=48 fp32" in text and "snapshot 12582912 B" in text


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out
