"""Tokens per second of greedy ``generate`` in Hugging Face transformers for a Qwen3.5-like
random-weight model: plain decoding against prompt lookup and against a small assistant model,
both through ``recoverssm.integrations.transformers.speculative``.

    python benchmarks/hf_generate.py                 # the H200 run quoted in docs/BENCHMARKS.md
    python benchmarks/hf_generate.py --tiny          # a 4-layer model on the CPU: checks that it runs

Per mode it prints new tokens per second, the target model's forward calls per generated token
("steps/token"), the acceptance rate of the proposed candidates, the mean time of one target step,
and whether the tokens equal plain greedy ``generate``'s. An "assistant alone" row times plain
``generate`` of the draft model: the draft's own cost per token. JSON goes to ``$OUT/hf_generate.json``.

Random weights decide acceptance: the random target soon repeats itself, which prompt lookup
exploits, while a random assistant almost never agrees with it, so the assistant row is the cost
of speculating with nearly every candidate rejected.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from common import print_table, write_json


def target_model(tiny: bool, layers: int, hidden: int, dtype: torch.dtype, device: str):
    """A Qwen3.5-like model: three GDN layers then one attention layer, repeated."""
    from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5
    if tiny:
        geometry = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128)
    else:
        geometry = dict(vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3 * hidden)
    n = geometry["num_hidden_layers"]
    cfg = configuration_qwen3_5.Qwen3_5TextConfig(
        **geometry, layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)],
        eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        return modeling_qwen3_5.Qwen3_5ForCausalLM(cfg).to(dtype).eval()


def assistant_model(tiny: bool, vocab: int, dtype: torch.dtype, device: str):
    """A small Llama with the target's vocabulary (no recurrent layers)."""
    from transformers.models.llama import configuration_llama, modeling_llama
    width = 32 if tiny else 1024
    cfg = configuration_llama.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                          num_hidden_layers=2, num_attention_heads=max(2, width // 128),
                                          num_key_value_heads=1, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        return modeling_llama.LlamaForCausalLM(cfg).to(dtype).eval()


class StepCounter:
    """Counts a model's forward calls in one ``generate`` and the candidates they verify."""

    def __init__(self, model: torch.nn.Module):
        self.prompt_length, self.calls, self.candidates = 0, 0, 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        length = kwargs.get("input_ids", args[0] if args else None).shape[1]
        # the first call holds the prompt (and, with an assistant, the first candidates); each later
        # call the last accepted token and the candidates
        self.candidates += length - (self.prompt_length if self.calls == 0 else 1)
        self.calls += 1

    def reset(self, prompt_length: int) -> None:
        self.prompt_length, self.calls, self.candidates = prompt_length, 0, 0

    def remove(self) -> None:
        self._handle.remove()


def timed_generate(model, prompt, kwargs, device, repeat: int, counter: StepCounter | None = None):
    """The best of ``repeat`` timed calls (after one warm-up) and the generated tokens (``counter``
    holds the last call's counts)."""
    out, best = None, float("inf")
    for i in range(repeat + 1):
        if counter is not None:
            counter.reset(prompt.shape[1])
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, do_sample=False, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best, out[:, prompt.shape[1]:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model on the CPU (checks that the script runs)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="candidates per step (prompt lookup and assistant)")
    ap.add_argument("--repeat", type=int, default=2, help="timed calls per mode (the best is kept)")
    args = ap.parse_args()

    from recoverssm.integrations.transformers import speculative

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        sys.modules["fla"] = None       # fla's kernels need a GPU: transformers then uses its torch paths
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    new_tokens = min(args.new_tokens, 24) if args.tiny else args.new_tokens
    torch.manual_seed(0)
    target = target_model(args.tiny, args.layers, args.hidden, dtype, device)
    vocab = target.config.vocab_size
    draft = assistant_model(args.tiny, vocab, dtype, device)
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(1, vocab, (16,), generator=g)
    prompts = {"repetitive": motif.repeat(4)[None].to(device),
               "random": torch.randint(1, vocab, (1, 64), generator=g).to(device)}
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    modes = {"plain": (contextlib.nullcontext, {}),
             "prompt lookup": (lambda: speculative(target), dict(prompt_lookup_num_tokens=args.k)),
             "assistant": (lambda: speculative(target), dict(assistant_model=draft))}

    rows = []
    counter = StepCounter(target)
    for name, prompt in prompts.items():
        reference = None
        for mode, (scope, extra) in modes.items():
            with scope():
                seconds, tokens = timed_generate(target, prompt, {**common, **extra}, device, args.repeat, counter)
            steps = counter.calls
            accepted = new_tokens - steps                  # every call yields its accepted tokens + 1
            if reference is None:
                reference = tokens
            same = int((tokens == reference).long().cumprod(-1).sum())
            rows.append({"prompt": name, "mode": mode, "tokens/s": round(new_tokens / seconds, 1),
                         "steps/token": round(steps / new_tokens, 3),
                         "acceptance": round(accepted / counter.candidates, 3) if counter.candidates else None,
                         "ms/step": round(1e3 * seconds / steps, 2),
                         "same tokens as plain": f"{same}/{new_tokens}"})
            print(rows[-1], flush=True)
        seconds, _ = timed_generate(draft, prompt, common, device, args.repeat)
        rows.append({"prompt": name, "mode": "assistant alone", "tokens/s": round(new_tokens / seconds, 1),
                     "steps/token": 1.0, "ms/step": round(1e3 * seconds / new_tokens, 2)})
    counter.remove()

    print(f"greedy generate, {args.dtype} weights, {target.config.num_hidden_layers} layers, hidden "
          f"{target.config.hidden_size}, vocab {vocab}, {new_tokens} new tokens, k = {args.k}, device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else ""))
    print_table(rows)
    import transformers
    write_json("hf_generate.json", {"rows": rows, "dtype": args.dtype, "layers": target.config.num_hidden_layers,
                                    "hidden": target.config.hidden_size, "vocab": vocab, "k": args.k,
                                    "new_tokens": new_tokens, "device": device,
                                    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
                                    "torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
    main()
