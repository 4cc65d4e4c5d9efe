"""The attention layers of the Mamba2 hybrid (``--arch mamba2``, Nemotron-H-like): weights, the
KV cache and the attention of one token.

Nemotron-H's attention layers are plain causal attention with grouped KV heads and no positional
encoding (no RoPE: the Mamba2 layers carry position), so neither is there one here. Per layer
(pre-norm, residual), for a token's hidden vector ``h``::

    q | k | v   = rmsnorm(h) @ w_qkv                      q [heads, dim], k, v [kv_heads, dim]
    cache[pos]  = k, v                                    pos: the token's position in its request
    o           = softmax(q . cache[:pos + 1].k * dim ** -0.5) @ cache[:pos + 1].v
    h           = h + o.flatten() @ w_o, then the small MLP every layer ends with

**Rollback.** Attention needs no commit: a window writes the keys and values of all its positions,
and the next window of the request starts at its first rejected position and overwrites them.
Nothing reads past a request's computed tokens plus its own window, so rejected keys are never seen.

**Batch invariance** (as :mod:`.model` explains): every token attends on its own, to a fresh
contiguous copy of its request's ``pos + 1`` cached keys and values, so the speculative path (a
window's tokens) and the per-token path (one token per call) run the same kernels on the same
shapes and get the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class AttentionWeights:
    """One attention layer's weights (``heads``, ``kv_heads``, ``dim``: :class:`~.model.ModelConfig`'s
    ``attn_heads``, ``attn_kv_heads``, ``attn_head_dim``)."""

    norm: torch.Tensor       # [hidden]
    w_qkv: torch.Tensor      # [hidden, (heads + 2 * kv_heads) * dim], fused q | k | v
    w_o: torch.Tensor        # [heads * dim, hidden]
    mlp_norm: torch.Tensor   # [hidden]
    w_up: torch.Tensor       # [hidden, mlp_hidden]
    w_down: torch.Tensor     # [mlp_hidden, hidden]


class KVCache:
    """One attention layer's keys and values of every request, by token position:
    ``[num_requests, capacity, kv_heads, dim]`` each, grown (doubled) when a window reaches past the
    end, so neither path has to know the run's length up front."""

    def __init__(self, num_requests: int, kv_heads: int, dim: int, device: torch.device, capacity: int = 16):
        self.k = torch.zeros(num_requests, capacity, kv_heads, dim, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, request: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[n, kv_heads, dim]``) at positions ``[start, start + n)`` of
        ``request``, over whatever a rejected draft left there."""
        end = start + k.shape[0]
        if end > self.k.shape[1]:
            grown = max(end, 2 * self.k.shape[1])
            self.k, self.v = (torch.cat([t, t.new_zeros(t.shape[0], grown - t.shape[1], *t.shape[2:])], 1)
                              for t in (self.k, self.v))
        self.k[request, start:end] = k
        self.v[request, start:end] = v

    def prefix(self, request: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh contiguous copies of ``request``'s first ``n`` keys and values ``[n, kv_heads, dim]``
        (fresh: the same allocation on both paths, see the module docstring)."""
        return (self.k[request, :n].clone(memory_format=torch.contiguous_format),
                self.v[request, :n].clone(memory_format=torch.contiguous_format))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One token's attention: ``q`` ``[heads, dim]`` over ``k``, ``v`` ``[n, kv_heads, dim]`` (the
    token itself last); query head ``h`` reads KV head ``h // (heads // kv_heads)``. Returns
    ``[heads, dim]``."""
    share = q.shape[0] // k.shape[1]
    k = k.transpose(0, 1).repeat_interleave(share, 0)           # [heads, n, dim]
    v = v.transpose(0, 1).repeat_interleave(share, 0)
    scores = (q[:, None, :] @ k.transpose(1, 2)) * q.shape[-1] ** -0.5   # [heads, 1, n]
    return (torch.softmax(scores, dim=-1) @ v)[:, 0]


def attend_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, requests: Sequence[int],
                   positions: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
    """The attention of a batch of windows: ``requests[r]`` owns token rows ``[starts[r],
    starts[r + 1])`` of ``q`` ``[T, heads, dim]``, ``k``, ``v`` ``[T, kv_heads, dim]``, at positions
    ``positions[r], positions[r] + 1, ...`` of that request. Writes each window's keys and values
    into ``cache`` first, then every token attends to its request's keys up to itself, one token at
    a time. Returns ``[T, heads, dim]``."""
    out = torch.zeros_like(q)
    for r, request in enumerate(requests):
        first, end = starts[r], starts[r + 1]
        cache.write(request, positions[r], k[first:end], v[first:end])
        for j in range(end - first):
            keys, values = cache.prefix(request, positions[r] + j + 1)
            out[first + j] = attend(q[first + j].clone(), keys, values)
    return out
