"""The demo's target model: a tiny stack of Gated DeltaNet layers built from a fixed seed.

One layer (pre-norm, residual), for a token's hidden vector ``h`` (``[hidden]``)::

    proj        = rmsnorm(h) @ w_in                      fused in-projection -> q | k | v | a | b | z
    y           = silu(causal_conv(q | k | v))           conv over the q|k|v channels, width 4
    q, k, v     = strided views of y                     [H, K], [H, K], [HV, V]
    o           = GDN(q, k, v, a, b)                     the recurrent layer (verify or decode)
    h           = h + (rmsnorm_per_head(o) * silu(z)).flatten() @ w_out
    h           = h + silu(rmsnorm(h) @ w_up) @ w_down   small MLP

and at the top ``logits = rmsnorm(h) @ w_head``. The conv and the GDN step are the recurrent parts
(the speculative and the per-token paths call different ops for them); everything else is here.

**Batch invariance.** The demo asserts that speculative decoding leaves states *bit-identical* to
the per-token path. The recurrent ops are exact by construction, so the rest of the model must give
a token the same bits whether it is computed alone (per-token path) or inside a window of several
tokens of several requests (speculative path). On CPU a matmul or a reduction may choose another
blocking or vectorisation for another batch shape, and BLAS may even take another code path for
another memory alignment. So every non-recurrent op below runs on ONE token at a time, on a fresh
(hence allocator-aligned) contiguous ``[1, ...]`` copy of its row (:func:`rowwise`): both paths then
launch exactly the same kernels on the same shapes and get the same bits. This costs nothing that
matters at the demo's sizes; an engine gets the same property from batch-invariant kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model. ``H`` q/k heads of dim ``K``, ``HV`` value heads of dim ``V``."""

    vocab: int = 512
    hidden: int = 64
    num_layers: int = 4
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16
    conv_width: int = 4
    mlp_hidden: int = 128
    eps: float = 1e-6
    seed: int = 0

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def proj_dim(self) -> int:
        """Width of the fused in-projection: q | k | v | a | b | z."""
        return self.conv_dim + 2 * self.HV + self.HV * self.V

    @property
    def conv_history(self) -> int:
        return self.conv_width - 1

    def describe(self) -> str:
        return (f"{self.num_layers} GDN layers, hidden {self.hidden}, H={self.H} HV={self.HV} "
                f"K={self.K} V={self.V}, conv width {self.conv_width}, vocab {self.vocab}")


@dataclass
class LayerWeights:
    """One layer's weights (shapes in :class:`ModelConfig` terms)."""

    norm: torch.Tensor       # [hidden]
    w_in: torch.Tensor       # [hidden, proj_dim]
    conv_w: torch.Tensor     # [conv_dim, conv_width]; conv_w[:, -1] multiplies the current token
    conv_b: torch.Tensor     # [conv_dim]
    A_log: torch.Tensor      # [HV] fp32
    dt_bias: torch.Tensor    # [HV] fp32
    o_norm: torch.Tensor     # [V], gated RMSNorm weight (shared by the heads)
    w_out: torch.Tensor      # [HV * V, hidden]
    mlp_norm: torch.Tensor   # [hidden]
    w_up: torch.Tensor       # [hidden, mlp_hidden]
    w_down: torch.Tensor     # [mlp_hidden, hidden]


@dataclass
class LayerInputs:
    """The fused in-projection of a batch of tokens and its views (no copies).

    ``proj``: ``[T, proj_dim]``; ``qkv``: ``[T, conv_dim]`` (row stride ``proj_dim``);
    ``a``, ``b``: ``[T, HV]``; ``z``: ``[T, HV, V]``. All views have a contiguous last dim, as the
    ops require; the other strides are whatever the fused buffer gives.
    """

    proj: torch.Tensor
    qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    z: torch.Tensor


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``cat([fn(x0[t:t+1], x1[t:t+1], ...) for t])``, each row a fresh contiguous copy.

    The copy matters: a fresh tensor has the allocator's alignment, so a BLAS call cannot take
    another code path because a row happens to start mid-cache-line (see the module docstring).
    """
    T = xs[0].shape[0]
    if T == 0:
        return fn(*xs)
    return torch.cat([fn(*(x[t:t + 1].clone(memory_format=torch.contiguous_format) for x in xs))
                      for t in range(T)])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TinyGDN:
    """The demo's target model (weights drawn on CPU from ``cfg.seed``, then moved to ``device``)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(cfg.seed)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(self.device)

        def uniform(lo, hi, *shape):
            return (lo + (hi - lo) * torch.rand(*shape, generator=gen)).to(self.device)

        c = cfg
        # The layers add a modest correction (w_out, w_down scaled down) to what the token's own
        # embedding predicts: greedy text then has structure that a cheap draft can partly guess,
        # as real text does, while the recurrent state still changes the tokens.
        self.embedding = randn(c.vocab, c.hidden)
        self.layers: list[LayerWeights] = []
        for _ in range(c.num_layers):
            conv_w = randn(c.conv_dim, c.conv_width, std=0.4)
            conv_w[:, -1] += 1.0  # mostly pass the current token through, as trained convs do
            self.layers.append(LayerWeights(
                norm=1.0 + randn(c.hidden, std=0.1),
                w_in=randn(c.hidden, c.proj_dim, std=1 / math.sqrt(c.hidden)),
                conv_w=conv_w,
                conv_b=randn(c.conv_dim, std=0.1),
                A_log=torch.log(uniform(0.5, 8.0, c.HV)),
                dt_bias=randn(c.HV, std=0.5),
                o_norm=1.0 + randn(c.V, std=0.1),
                w_out=randn(c.HV * c.V, c.hidden, std=0.3 / math.sqrt(c.HV * c.V)),
                mlp_norm=1.0 + randn(c.hidden, std=0.1),
                w_up=randn(c.hidden, c.mlp_hidden, std=1 / math.sqrt(c.hidden)),
                w_down=randn(c.mlp_hidden, c.hidden, std=0.15 / math.sqrt(c.mlp_hidden)),
            ))
        self.final_norm = 1.0 + randn(c.hidden, std=0.1)
        self.w_head = randn(c.hidden, c.vocab, std=2.0 / math.sqrt(c.hidden))

    # ---- the non-recurrent pieces, one token at a time -------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: int64 ``[T]`` -> hidden ``[T, hidden]`` (a gather: exact, batch-invariant)."""
        return self.embedding[tokens]

    def in_proj(self, i: int, h: torch.Tensor) -> LayerInputs:
        """Layer ``i``'s fused in-projection of ``h`` ``[T, hidden]`` (one matmul per token)."""
        c, w = self.cfg, self.layers[i]
        proj = rowwise(lambda x: rmsnorm(x, w.norm, c.eps) @ w.w_in, h)
        a0 = c.conv_dim
        b0 = a0 + c.HV
        z0 = b0 + c.HV
        return LayerInputs(proj=proj, qkv=proj[:, :a0], a=proj[:, a0:b0], b=proj[:, b0:z0],
                           z=proj[:, z0:].unflatten(-1, (c.HV, c.V)))

    def split_qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Strided views ``q, k: [T, H, K]`` and ``v: [T, HV, V]`` of the conv output ``[T, conv_dim]``
        (read in place by the GDN ops: no copy)."""
        c = self.cfg
        hk = c.H * c.K
        return (y[:, :hk].unflatten(-1, (c.H, c.K)), y[:, hk:2 * hk].unflatten(-1, (c.H, c.K)),
                y[:, 2 * hk:].unflatten(-1, (c.HV, c.V)))

    def finish_layer(self, i: int, h: torch.Tensor, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm, out-projection, residual and MLP. ``h``: ``[T, hidden]``, ``o``, ``z``:
        ``[T, HV, V]``. Returns the layer's output ``[T, hidden]``."""
        c, w = self.cfg, self.layers[i]

        def one(h1, o1, z1):
            gated = rmsnorm(o1, w.o_norm, c.eps) * F.silu(z1)          # per head, [1, HV, V]
            h1 = h1 + gated.flatten(1) @ w.w_out
            return h1 + F.silu(rmsnorm(h1, w.mlp_norm, c.eps) @ w.w_up) @ w.w_down

        return rowwise(one, h, o, z)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, vocab]``."""
        return rowwise(lambda x: rmsnorm(x, self.final_norm, self.cfg.eps) @ self.w_head, h)

    def next_token_table(self, noise: float, seed: int) -> list[int]:
        """A stateless "draft model": for every token, the argmax of the LM head applied to its own
        embedding, with weights perturbed by ``noise`` (relative). Used by the draft as a fallback
        when its n-gram lookup finds nothing. Returns ``next[token]`` for all tokens."""
        gen = torch.Generator().manual_seed(seed)
        emb = self.embedding.cpu()
        head = self.w_head.cpu()
        emb = emb + noise * emb.std() * torch.randn(emb.shape, generator=gen)
        head = head + noise * head.std() * torch.randn(head.shape, generator=gen)
        logits = rmsnorm(emb, self.final_norm.cpu(), self.cfg.eps) @ head
        return logits.argmax(-1).tolist()
