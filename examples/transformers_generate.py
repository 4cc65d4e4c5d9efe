"""Speculative ``generate`` on a hybrid model in Hugging Face transformers, checked against plain
greedy decoding.

transformers refuses ``prompt_lookup_num_tokens=`` and ``assistant_model=`` for models with
recurrent layers; inside ``recoverssm.integrations.transformers.speculative(model)`` they work,
and greedy output equals plain greedy ``generate`` token for token (fp32 models).

The model here is a small random-weight Qwen3.5 (Gated DeltaNet and attention layers) built from
transformers' own config class, so the script runs anywhere without a download; a pretrained
checkpoint works the same way (``AutoModelForCausalLM.from_pretrained(...)``).

    pip install "recoverssm[transformers]"
    python examples/transformers_generate.py               # on a GPU where one is present, else the CPU
"""
from __future__ import annotations

import sys

import torch


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        sys.modules["fla"] = None     # flash-linear-attention's kernels need a GPU: use transformers' torch paths
    from transformers.models.llama import LlamaConfig, LlamaForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from recoverssm.integrations.transformers import speculative

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=256,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0,
                               eos_token_id=None)
    model = Qwen3_5ForCausalLM(config).to(device).eval()
    # a draft model without recurrent layers, sharing the vocabulary (random too: it rarely agrees)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                         eos_token_id=None)).to(device).eval()
    prompt = torch.tensor([[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]], device=device)

    with torch.no_grad():
        plain = model.generate(prompt, do_sample=False, max_new_tokens=48)
        with speculative(model):                              # this instance only, undone on exit
            lookup = model.generate(prompt, do_sample=False, max_new_tokens=48, prompt_lookup_num_tokens=4)
            assisted = model.generate(prompt, do_sample=False, max_new_tokens=48, assistant_model=draft)

    for name, tokens in (("prompt lookup", lookup), ("assistant model", assisted)):
        if not torch.equal(tokens, plain):
            print(f"MISMATCH: {name} gave other tokens than plain greedy generate")
            return 1
    print(f"plain greedy:   {plain[0, prompt.shape[1]:].tolist()}")
    print(f"OK: prompt lookup and an assistant model give plain greedy generate's {plain.shape[1] - prompt.shape[1]} "
          f"tokens ({device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
