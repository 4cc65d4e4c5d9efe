"""``recoverssm demo --arch mamba2``: a tiny Nemotron-H-like hybrid (Mamba2 layers with grouped B/C,
and attention layers) decoded speculatively and checked bit for bit against per-token decoding,
eager and deferred, fp32 and bf16 states."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from recoverssm import cli
from recoverssm.cli_support import torch_threads
from recoverssm.core.registry import registry
from recoverssm.demo import DemoConfig, DemoMismatch, ModelConfig, TinyModel, model_config, run_demo
from recoverssm.demo.attention import KVCache
from recoverssm.demo.model import hybrid_pattern
from recoverssm.demo.spec import SpecEngine
from recoverssm.demo.tp import TPSetupError, shard_config


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


#: pattern M*M: two Mamba2 layers (one per KV-cache group) around an attention layer; 2 groups of
#: 2 heads, headdim 4 unlike dstate 8; 2 query heads sharing 1 KV head
TINY_MAMBA2 = ModelConfig(vocab=64, hidden=32, num_layers=2, H=2, HV=4, K=8, V=4, mlp_hidden=32, arch="mamba2",
                          attn_heads=2, attn_kv_heads=1, attn_head_dim=8)


def mamba2_config(**kw) -> DemoConfig:
    base = dict(requests=3, draft_tokens=3, steps=5, seed=1, prompt_len=(3, 7), model=TINY_MAMBA2)
    base.update(kw)
    return DemoConfig(**base)


# ---- the model -------------------------------------------------------------------------------------
def test_hybrid_pattern():
    assert [hybrid_pattern(n) for n in range(1, 6)] == ["M", "M*M", "M*MM", "M*MM*M", "M*MM*MM"]
    c = model_config("mamba2", 4)
    assert (c.pattern, c.recurrent_layers, c.attention_layers) == ("M*MM*M", [0, 2, 3, 5], [1, 4])
    assert model_config("gdn", 3).pattern == "MMM" and model_config("gdn", 3).attention_layers == []


def test_mamba2_layer_layout():
    """In-projection z | x | B | C | dt, conv channels x | B | C: the op's operands are views into
    the conv output, the raw dt and z views into the projection (nothing copied)."""
    c = model_config("mamba2", 2)
    assert (c.H, c.HV, c.K, c.V) == (2, 4, 16, 8) and not c.vector_decay
    m = TinyModel(c)
    x = m.in_proj(0, torch.randn(3, c.hidden))
    assert x.proj.shape == (3, c.proj_dim) and c.proj_dim == 2 * c.HV * c.V + 2 * c.H * c.K + c.HV
    assert x.z.shape == (3, c.HV, c.V) and x.dt.shape == (3, c.HV) and x.conv_in.shape == (3, c.conv_dim)
    assert x.z.data_ptr() == x.proj.data_ptr()
    assert x.conv_in.data_ptr() == x.proj[:, c.HV * c.V:].data_ptr()
    assert x.dt.data_ptr() == x.proj[:, c.HV * c.V + c.conv_dim:].data_ptr()
    y = torch.randn(3, c.conv_dim)
    xs, B, C = m.operands(y)
    assert (xs.shape, B.shape, C.shape) == ((3, c.HV, c.V), (3, c.H, c.K), (3, c.H, c.K))
    assert torch.equal(torch.cat([xs.flatten(1), B.flatten(1), C.flatten(1)], 1), y)
    assert m.layers[0].D.shape == (c.HV,) and m.layers[0].o_norm.shape == (c.HV * c.V,)
    gates = m.gates(0, x)
    assert gates["dt_limit"] == (0.001, None) and "z" not in gates      # Nemotron-H: z gates the norm
    with pytest.raises(ValueError, match="multiple of its ngroups"):
        ModelConfig(arch="mamba2", H=3, HV=4)


def test_mamba2_dt_reaches_the_clamp():
    """Mamba2's dt initialisation puts some tokens' softplus(dt + dt_bias) under dt_min, so the
    clamp is exercised (both paths clamp alike)."""
    c = model_config("mamba2", 2)
    m = TinyModel(c)
    x = m.in_proj(0, m.embedding)
    dt = F.softplus(x.dt + m.layers[0].dt_bias)
    assert (dt < c.dt_min).any() and (dt > c.dt_min).any()


def test_kv_cache_overwrites_and_grows():
    cache = KVCache(2, 1, 4, torch.device("cpu"), capacity=2)
    cache.write(1, 0, torch.ones(3, 1, 4), torch.ones(3, 1, 4))           # grows past 2
    cache.write(1, 1, torch.full((3, 1, 4), 2.0), torch.full((3, 1, 4), 2.0))   # a rejected draft overwritten
    k, v = cache.prefix(1, 4)
    assert k[:, 0, 0].tolist() == [1, 2, 2, 2] and k.is_contiguous() and not cache.prefix(0, 4)[0].any()


# ---- the demo on cpu_ref ---------------------------------------------------------------------------
def test_mamba2_demo_is_bit_identical_to_per_token_decoding():
    res = run_demo(mamba2_config())
    assert res.ok and res.ref_conv == "kernel" and res.tokens == res.ref_tokens
    assert res.compared_slots > 0 and res.compared_logits > 0 and res.prefix_blocks_checked > 0
    assert res.drafts_accepted > 0 and sum(s.boundary_writes for s in res.steps) > 0
    # the attention layer's KV cache: every request after every prefill round and step
    assert res.compared_kv == 3 * (res.prefill_rounds + len(res.steps))
    # scalar-decay records of the 2 Mamba2 layers: [R, HV, T, V] corrections, [R, H, T, K] keys (B), [R, HV, T] decay
    c, R, T = TINY_MAMBA2, 3, 4
    assert res.memory["recoverssm_records"] == c.num_layers * 4 * R * T * (c.HV * c.V + c.H * c.K + c.HV)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_mamba2_demo_eager_and_deferred(state_dtype):
    """fp32 and bf16 states, eager and deferred commits: each run bit-identical to its per-token
    path, and the deferred run the eager one (the same tokens and comparisons, each step's slots
    checked one step later, the last after the flush)."""
    model = dataclasses.replace(TINY_MAMBA2, state_dtype=state_dtype)
    eager = run_demo(mamba2_config(model=model))
    res = run_demo(mamba2_config(model=model, deferred=True))
    assert eager.ok and res.ok and res.tokens == res.ref_tokens == eager.tokens
    assert (res.compared_slots, res.compared_logits, res.compared_kv, res.prefix_blocks_checked) == \
        (eager.compared_slots, eager.compared_logits, eager.compared_kv, eager.prefix_blocks_checked)
    assert res.replayed_rows > 0 and res.flushed_rows == res.config.requests


def test_mamba2_demo_reference_conv_in_plain_torch_agrees_too():
    res = run_demo(mamba2_config(ref_conv="torch", steps=2))
    assert res.ref_conv == "torch" and res.tokens == res.ref_tokens


def test_mamba2_demo_detects_a_one_ulp_difference(monkeypatch):
    original = SpecEngine.commit

    def corrupting_commit(self, num_accepted, qsl):
        plans = original(self, num_accepted, qsl)
        s = self.state[self.layers_of[1][0]][plans[1].final_slot[1]]
        s[3, 1, 2] = torch.nextafter(s[3, 1, 2], torch.tensor(float("inf")))
        return plans

    monkeypatch.setattr(SpecEngine, "commit", corrupting_commit)
    with pytest.raises(DemoMismatch, match="layer 2 .*recurrent state"):
        run_demo(mamba2_config(steps=2))


def test_mamba2_demo_detects_a_stale_attention_key(monkeypatch):
    """A key of an accepted position that differs from the per-token path's is caught."""
    original = SpecEngine.commit

    def corrupting_commit(self, num_accepted, qsl):
        plans = original(self, num_accepted, qsl)
        self.kv[1].k[0, self.num_computed[0] - 1, 0, 0] += 1.0
        return plans

    monkeypatch.setattr(SpecEngine, "commit", corrupting_commit)
    with pytest.raises(DemoMismatch, match="attention layer 1 cached keys"):
        run_demo(mamba2_config(steps=2))


def test_mamba2_demo_cli(capsys):
    rc = cli.main(["demo", "--arch", "mamba2", "--state-dtype", "bf16", "--deferred", "--requests", "2",
                   "--draft-tokens", "2", "--steps", "2", "--layers", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2 Mamba2 layers + 1 attention layer (4 heads, 2 KV heads" in out and "pattern M*M" in out
    assert "rs.mamba2_verify per window" in out and "rs.mamba2_decode + rs.conv_decode" in out
    assert "Mamba2 layers 0 (block size 4), Mamba2 layers 2 (block size 5)" in out
    assert "bit-identity: OK" in out and "attention KV-cache prefixes" in out
    assert "at ngroups=8 nheads=128 dstate=128 headdim=64" in out and "flushed at the end of the run" in out


def test_mamba2_demo_cli_json(capsys):
    rc = cli.main(["demo", "--arch", "mamba2", "--requests", "2", "--steps", "2", "--layers", "1", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["ok"] and summary["tokens_match"]
    assert summary["config"]["model"]["arch"] == "mamba2" and summary["compared_kv"] == 0   # pattern M


def test_mamba2_demo_refuses_tensor_parallelism(capsys):
    assert cli.main(["demo", "--arch", "mamba2", "--tp", "1", "--steps", "1", "--device", "cpu"]) == 2
    assert "not --arch mamba2" in capsys.readouterr().err
    with pytest.raises(TPSetupError, match="GDN and KDA models only"):
        shard_config(model_config("mamba2"), 1)


# ---- the Triton kernels under the interpreter ------------------------------------------------------
@pytest.mark.interpreter
def test_mamba2_demo_with_the_triton_kernels():
    """The cuda backend's kernels (verify, decode, conv, commit) in the interpreter, bf16 states."""
    if "cuda" not in registry().backends():
        pytest.skip("the cuda backend is not registered")
    model = dataclasses.replace(TINY_MAMBA2, state_dtype="bf16")
    res = run_demo(mamba2_config(backend="cuda", requests=2, draft_tokens=2, steps=2, prompt_len=(3, 5),
                                 model=model))
    assert res.backend == "cuda" and res.ref_conv == "kernel" and res.tokens == res.ref_tokens
    assert res.compared_slots > 0 and res.compared_kv > 0
