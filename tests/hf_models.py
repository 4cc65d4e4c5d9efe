"""Tiny random-weight transformers models for ``tests/test_transformers_integration.py``.

transformers binds flash-linear-attention's kernels when its modeling modules are imported and
fla imports; fla's kernels need a GPU. On the CPU the modeling modules are imported here with
fla hidden, so the models use transformers' own torch paths (whatever else imported fla before).
"""
from __future__ import annotations

import importlib
import sys

import torch

VOCAB = 96

_MODULES = {"qwen3_next": "Qwen3Next", "qwen3_5": "Qwen3_5", "qwen4_exp": "Qwen4Exp", "kimi_linear": "KimiLinear",
            "olmo_hybrid": "OlmoHybrid", "llama": "Llama"}


def modeling(name: str):
    """transformers' modeling module of ``name``, imported without fla on a machine without CUDA."""
    path = f"transformers.models.{name}.modeling_{name}"
    if path in sys.modules or torch.cuda.is_available():
        return importlib.import_module(path)
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(path)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def _config(name: str, **kw):
    text = "Text" if name in ("qwen3_5", "qwen4_exp") else ""
    return getattr(importlib.import_module(f"transformers.models.{name}.configuration_{name}"),
                   f"{_MODULES[name]}{text}Config")(**kw)


LINEAR = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def build(name: str, *, seed: int = 0, dtype=torch.float32, eos: int | None = None):
    """A 4-layer model (three linear-attention layers, one attention layer), eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  eos_token_id=eos, pad_token_id=0, layer_types=LINEAR)
    gdn = dict(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128)
    if name == "qwen3_next":
        cfg = _config(name, **common, **gdn, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
        cls = modeling(name).Qwen3NextForCausalLM
    elif name == "qwen3_5":
        cfg = _config(name, **common, **gdn)
        cls = modeling(name).Qwen3_5ForCausalLM
    elif name == "qwen4_exp":
        # per-layer embeddings on layers 1 and 3 (1-indexed): a dilated conv and an n-gram id history
        common = dict(common, eos_token_id=VOCAB - 1 if eos is None else eos,
                      layer_types=LINEAR[:3] + ["indexed_attention"])
        cfg = _config(name, **common, **{k: v for k, v in gdn.items() if k != "intermediate_size"}, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      hc_count=2, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3,
                      heads_per_ngram=2, ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8,
                      ple_conv_kernel_size=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=8, indexer_compress_ratio=4)
        cls = modeling(name).Qwen4ExpForCausalLM
    elif name == "olmo_hybrid":
        cfg = _config(name, **common, **{k: v for k, v in gdn.items() if k != "head_dim"})
        cls = modeling(name).OlmoHybridForCausalLM
    elif name == "kimi_linear":
        cfg = _config(name, **common, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
                      kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, linear_head_dim=16,
                      linear_num_heads=4, linear_conv_kernel_dim=4, mlp_layer_types=["dense", "sparse"] * 2,
                      bos_token_id=1)
        cls = modeling(name).KimiLinearForCausalLM
    else:
        raise ValueError(name)
    model = cls(cfg)
    with torch.no_grad():           # Qwen4Exp's PLE convs start at zero: give them weights
        for m in model.modules():
            if type(m).__name__ == "Qwen4ExpTextPLELayer":
                m.conv1d.weight.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def assistant(*, seed: int = 1):
    """A 2-layer Llama with the same vocabulary: a draft model without recurrent layers."""
    torch.manual_seed(seed)
    cfg = _config("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=None)
    return modeling("llama").LlamaForCausalLM(cfg).eval()
