"""``recoverssm demo --arch kda`` (a tiny Kimi-Linear-like model: KDA layers, H = HV, K = V, a gate
per K channel) and the KDA and ``conv_decode`` items of ``recoverssm check``."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from recoverssm import cli
from recoverssm.backends.cpu_ref.plugin import CpuRefBackend
from recoverssm.check import run_check
from recoverssm.cli_support import torch_threads
from recoverssm.core.hookspecs import hookimpl
from recoverssm.core.registry import registry
from recoverssm.demo import DemoConfig, DemoMismatch, ModelConfig, TinyModel, model_config, run_demo
from recoverssm.demo.spec import SpecEngine
from recoverssm.demo.tp import HeadShard, ShardedTinyModel, shard_config


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


TINY_KDA = ModelConfig(vocab=64, hidden=32, num_layers=2, H=2, HV=2, K=8, V=8, mlp_hidden=32, arch="kda")


def kda_config(**kw) -> DemoConfig:
    base = dict(requests=3, draft_tokens=3, steps=5, seed=1, prompt_len=(3, 7), model=TINY_KDA)
    base.update(kw)
    return DemoConfig(**base)


# ---- the model -------------------------------------------------------------------------------------
def test_kda_model_layout():
    c = model_config("kda", 2)
    assert (c.H, c.K) == (c.HV, c.V) and c.gate_shape == (c.HV, c.K) and c.vector_decay
    x = TinyModel(c).in_proj(0, torch.randn(3, c.hidden))
    assert x.a.shape == (3, c.HV, c.K) and x.b.shape == (3, c.HV) and x.z.shape == (3, c.HV, c.V)
    assert x.proj.shape[1] == c.proj_dim
    with pytest.raises(ValueError, match="H = HV and K = V"):
        ModelConfig(arch="kda", H=2, HV=4)
    with pytest.raises(ValueError, match="needs arch 'kda'"):
        ModelConfig(lower_bound=-5.0)


# ---- the demo on cpu_ref ---------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_demo_is_bit_identical_to_per_token_decoding(lower_bound):
    cfg = kda_config(model=dataclasses.replace(TINY_KDA, lower_bound=lower_bound))
    res = run_demo(cfg)
    assert res.ok and res.ref_conv == "kernel" and res.tokens == res.ref_tokens
    assert res.compared_slots > 0 and res.compared_logits > 0 and res.prefix_blocks_checked > 0
    assert sum(s.boundary_writes for s in res.steps) > 0
    # vector-decay records: [R, HV, T, K] decay beside [R, HV, T, V] corrections, [R, H, T, K] keys
    c, R, T = TINY_KDA, 3, 4
    assert res.memory["recoverssm_records"] == c.num_layers * 4 * R * T * (c.HV * c.V + c.H * c.K + c.HV * c.K)


def test_kda_demo_reference_conv_in_plain_torch_agrees_too():
    res = run_demo(kda_config(ref_conv="torch", steps=2))
    assert res.ref_conv == "torch" and res.tokens == res.ref_tokens


def test_kda_demo_detects_a_one_ulp_difference(monkeypatch):
    original = SpecEngine.commit

    def corrupting_commit(self, num_accepted, qsl):
        plans = original(self, num_accepted, qsl)
        s = self.state[self.layers_of[0][0]][plans[0].final_slot[1]]
        s[0, 1, 2] = torch.nextafter(s[0, 1, 2], torch.tensor(float("inf")))
        return plans

    monkeypatch.setattr(SpecEngine, "commit", corrupting_commit)
    with pytest.raises(DemoMismatch, match="recurrent state"):
        run_demo(kda_config(steps=2))


def test_kda_demo_cli(capsys):
    rc = cli.main(["demo", "--arch", "kda", "--lower-bound", "--requests", "2", "--draft-tokens", "2",
                   "--steps", "2", "--layers", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2 KDA layers" in out and "lower_bound -5" in out and "rs.kda_decode + rs.conv_decode" in out
    assert "bit-identity: OK" in out and "at H=32 HV=32 K=V=128" in out


def test_kda_demo_cli_json(capsys):
    rc = cli.main(["demo", "--arch", "kda", "--requests", "2", "--steps", "2", "--layers", "1", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["ok"] and summary["tokens_match"]
    assert summary["config"]["model"]["arch"] == "kda" and summary["ref_conv"] == "kernel"


@pytest.mark.parametrize("argv, message", [
    (["--lower-bound", "-3"], "needs --arch kda"),
    (["--arch", "kda", "--lower-bound", "0.5"], "must be < 0"),
])
def test_kda_demo_cli_usage_errors(capsys, argv, message):
    assert cli.main(["demo", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


# ---- the Triton kernels under the interpreter ------------------------------------------------------
@pytest.mark.interpreter
def test_kda_demo_with_the_triton_kernels():
    if "cuda" not in registry().backends():
        pytest.skip("the cuda backend is not registered")
    res = run_demo(kda_config(backend="cuda", requests=2, draft_tokens=2, steps=2, prompt_len=(3, 5)))
    assert res.backend == "cuda" and res.ref_conv == "kernel" and res.tokens == res.ref_tokens
    assert res.compared_slots > 0 and res.prefix_blocks_checked > 0


# ---- tensor parallelism: the shard's columns ----------------------------------------------------------
def test_kda_shard_holds_the_columns_of_its_heads():
    """A rank's in-projection gives exactly its value heads' q, k, v, per-channel gate inputs, b and z
    (no process group needed: the in-projection is local)."""
    c = dataclasses.replace(model_config("kda", 1), hidden=32)
    full = TinyModel(c)
    h = torch.randn(2, c.hidden)
    want = full.in_proj(0, h)
    cols = [HeadShard.of(c, r, 2).proj_columns() for r in range(2)]
    assert sorted(torch.cat(cols).tolist()) == list(range(c.proj_dim))
    assert cols[0].numel() == shard_config(c, 2).proj_dim
    for rank in range(2):
        got = ShardedTinyModel(full, rank, 2).in_proj(0, h)
        hv = HeadShard.of(c, rank, 2).v_heads
        for name in ("a", "b", "z"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name)[:, hv])
        torch.testing.assert_close(got.qkv, want.qkv[:, HeadShard.of(c, rank, 2).conv_channels()])


# ---- recoverssm check ----------------------------------------------------------------------------------
def test_check_covers_the_kda_ops_and_conv_decode():
    report, _, _ = run_check("cpu_ref", torch.device("cpu"))
    assert report.passed
    kda = [i for i in report.items if i.case.startswith("kda") or " kda " in i.case]
    decode = [i for i in report.items if i.case.startswith("conv_decode")]
    names = {i.name for i in kda}
    assert {"kda_verify out vs cpu_ref", "kda_verify records vs cpu_ref", "kda_decode state vs cpu_ref",
            "snapshot last state == own decode", "commit == own decode (bit-exact)",
            "commit == own decode (final+boundary)"} <= names
    assert any("lb-5" in i.case for i in kda) and any("pre gates" in i.case for i in kda)
    assert any("bf16" in i.case for i in kda)
    assert {"conv_decode out vs cpu_ref", "conv_decode conv_state vs cpu_ref",
            "conv_decode history == own conv_verify window", "conv_decode out == own conv_verify"} <= {
        i.name for i in decode}
    assert all(i.status == "pass" for i in kda + decode)


class _NoKda(CpuRefBackend):
    """cpu_ref without the KDA recurrence, vector-decay commits and conv_decode."""

    name = "cpu_ref_no_kda"
    capabilities = CpuRefBackend.capabilities - {"kda", "vector_decay", "conv_decode"}


class _Plugin:
    @hookimpl
    def recoverssm_backends(self):
        return [_NoKda()]


def test_check_skips_what_a_backend_lacks():
    registry().register(_Plugin(), name="test-no-kda")
    try:
        report, _, _ = run_check(_NoKda.name, torch.device("cpu"))
    finally:
        registry().unregister("test-no-kda")
    assert report.passed
    skipped = [i for i in report.items if i.status == "skip"]
    assert {i.case.split()[0] for i in skipped} == {"kda", "conv_decode", "align", "deferred"}   # deferred: KDA layers
    assert all(i.status == "pass" for i in report.items if i.case.startswith("gdn"))
