"""The demo's target model: a tiny stack of recurrent layers built from a fixed seed, either
Gated DeltaNet (``arch="gdn"``, Qwen3-Next-like) or Kimi Delta Attention (``arch="kda"``,
Kimi-Linear-like: ``H = HV``, ``K = V``, a decay per K channel).

One layer (pre-norm, residual), for a token's hidden vector ``h`` (``[hidden]``)::

    proj        = rmsnorm(h) @ w_in                      fused in-projection -> q | k | v | a | b | z
    y           = silu(causal_conv(q | k | v))           conv over the q|k|v channels, width 4
    q, k, v     = strided views of y                     [H, K], [H, K], [HV, V]
    o           = GDN or KDA(q, k, v, a, b)              the recurrent layer (verify or decode)
    h           = h + (rmsnorm_per_head(o) * silu(z)).flatten() @ w_out
    h           = h + silu(rmsnorm(h) @ w_up) @ w_down   small MLP

and at the top ``logits = rmsnorm(h) @ w_head``. The gate input ``a`` is ``[HV]`` per token for
GDN (a scalar decay per value head) and ``[HV, K]`` for KDA (a plain projection to one gate input
per K channel; Kimi-Linear factors that projection through a low rank, which changes nothing
here). The conv and the recurrence are the recurrent parts (the speculative and the per-token
paths call different ops for them, :data:`RECURRENCES`); everything else is here.

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

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import recoverssm as rs

#: the recurrent layer kinds, as ``--arch`` names them
ARCHS = ("gdn", "kda")
#: the recurrent state pools' dtypes the demo runs (``--state-dtype``)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: the library's ops of each layer kind: the speculative path verifies, the per-token path decodes
RECURRENCES: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "gdn": {"verify": rs.gdn_verify, "decode": rs.gdn_decode},
    "kda": {"verify": rs.kda_verify, "decode": rs.kda_decode},
}

#: head sizes of each kind's own model at production scale (the demo's memory accounting):
#: Qwen3-Next's GDN layers and Kimi-Linear's KDA layers
PRODUCTION_HEADS = {"gdn": dict(H=16, HV=32, K=128, V=128), "kda": dict(H=32, HV=32, K=128, V=128)}

#: sizes each kind changes from :class:`ModelConfig`'s defaults (KDA: as many q/k heads as value heads)
ARCH_SIZES = {"gdn": {}, "kda": dict(H=4, HV=4)}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model. ``H`` q/k heads of dim ``K``, ``HV`` value heads of dim ``V``;
    ``arch``: the recurrent layers' kind; ``lower_bound``: KDA's bounded gate (None: the softplus
    gate); ``state_dtype``: the recurrent state pools' dtype, ``"fp32"`` or ``"bf16"``."""

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
    arch: str = "gdn"
    lower_bound: Optional[float] = None
    state_dtype: str = "fp32"

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "kda" and (self.H != self.HV or self.K != self.V):
            raise ValueError(f"the KDA model has H = HV and K = V (as Kimi-Linear), got H={self.H} "
                             f"HV={self.HV} K={self.K} V={self.V}")
        if self.lower_bound is not None and self.arch != "kda":
            raise ValueError("lower_bound selects KDA's bounded gate: it needs arch 'kda'")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {self.state_dtype!r}")

    @property
    def state_torch_dtype(self) -> torch.dtype:
        """The recurrent state pools' torch dtype."""
        return STATE_DTYPES[self.state_dtype]

    @property
    def gate_shape(self) -> tuple[int, ...]:
        """Shape of one token's gate input ``a`` (and of ``dt_bias``): ``[HV]`` for GDN, ``[HV, K]``
        for KDA."""
        return (self.HV,) if self.arch == "gdn" else (self.HV, self.K)

    @property
    def gate_channels(self) -> int:
        """Gate inputs per value head: 1 (GDN) or ``K`` (KDA)."""
        return math.prod(self.gate_shape) // self.HV

    @property
    def vector_decay(self) -> bool:
        """True when the decay is a K-vector (KDA): the records hold one decay per K channel."""
        return self.gate_channels > 1

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def proj_dim(self) -> int:
        """Width of the fused in-projection: q | k | v | a | b | z."""
        return self.conv_dim + self.HV * self.gate_channels + self.HV + self.HV * self.V

    @property
    def conv_history(self) -> int:
        return self.conv_width - 1

    def records_per_token(self) -> int:
        """fp32 values one token's replay records hold per layer: correction ``[HV, V]``, key
        ``[H, K]``, decay ``[HV]`` or ``[HV, K]``."""
        return self.HV * self.V + self.H * self.K + self.HV * self.gate_channels

    def at_production_scale(self) -> "ModelConfig":
        """These layers with :data:`PRODUCTION_HEADS`' head sizes (for the memory accounting)."""
        return dataclasses.replace(self, **PRODUCTION_HEADS[self.arch])

    def heads(self) -> str:
        """The head sizes, e.g. ``H=2 HV=4 K=V=16``."""
        dims = f"K=V={self.K}" if self.K == self.V else f"K={self.K} V={self.V}"
        return f"H={self.H} HV={self.HV} {dims}"

    def describe(self) -> str:
        gate = ""
        if self.arch == "kda":
            bound = "softplus" if self.lower_bound is None else f"bounded, lower_bound {self.lower_bound:g}"
            gate = f", per-channel gates ({bound})"
        return (f"{self.num_layers} {self.arch.upper()} layers, hidden {self.hidden}, {self.heads()}"
                f"{gate}, conv width {self.conv_width}, vocab {self.vocab}, {self.state_dtype} states")


def model_config(arch: str = "gdn", num_layers: int = 4, lower_bound: Optional[float] = None,
                 state_dtype: str = "fp32") -> ModelConfig:
    """The demo model of ``arch`` (:data:`ARCH_SIZES`) with ``num_layers`` layers."""
    return ModelConfig(arch=arch, lower_bound=lower_bound, num_layers=num_layers, state_dtype=state_dtype,
                       **ARCH_SIZES.get(arch, {}))


@dataclass
class LayerWeights:
    """One layer's weights (shapes in :class:`ModelConfig` terms)."""

    norm: torch.Tensor       # [hidden]
    w_in: torch.Tensor       # [hidden, proj_dim]
    conv_w: torch.Tensor     # [conv_dim, conv_width]; conv_w[:, -1] multiplies the current token
    conv_b: torch.Tensor     # [conv_dim]
    A_log: torch.Tensor      # [HV] fp32
    dt_bias: torch.Tensor    # gate_shape ([HV] or [HV, K]) fp32
    o_norm: torch.Tensor     # [V], gated RMSNorm weight (shared by the heads)
    w_out: torch.Tensor      # [HV * V, hidden]
    mlp_norm: torch.Tensor   # [hidden]
    w_up: torch.Tensor       # [hidden, mlp_hidden]
    w_down: torch.Tensor     # [mlp_hidden, hidden]


@dataclass
class LayerInputs:
    """The fused in-projection of a batch of tokens and its views (no copies).

    ``proj``: ``[T, proj_dim]``; ``qkv``: ``[T, conv_dim]`` (row stride ``proj_dim``);
    ``a``: ``[T, *gate_shape]``; ``b``: ``[T, HV]``; ``z``: ``[T, HV, V]``. All views have a contiguous last dim, as the
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


class TinyModel:
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
                dt_bias=randn(*c.gate_shape, std=0.5),
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
        b0 = a0 + c.HV * c.gate_channels
        z0 = b0 + c.HV
        return LayerInputs(proj=proj, qkv=proj[:, :a0], a=proj[:, a0:b0].unflatten(-1, c.gate_shape),
                           b=proj[:, b0:z0], z=proj[:, z0:].unflatten(-1, (c.HV, c.V)))

    def split_qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Strided views ``q, k: [T, H, K]`` and ``v: [T, HV, V]`` of the conv output ``[T, conv_dim]``
        (read in place by the recurrent ops: no copy)."""
        c = self.cfg
        hk = c.H * c.K
        return (y[:, :hk].unflatten(-1, (c.H, c.K)), y[:, hk:2 * hk].unflatten(-1, (c.H, c.K)),
                y[:, 2 * hk:].unflatten(-1, (c.HV, c.V)))

    def recurrence(self, mode: str) -> Callable[..., torch.Tensor]:
        """The library op of this model's layers for ``mode`` (``"verify"`` or ``"decode"``)."""
        return RECURRENCES[self.cfg.arch][mode]

    def gates(self, i: int, x: LayerInputs) -> dict:
        """Layer ``i``'s raw gate arguments of the recurrent op, for the tokens of ``x``."""
        w = self.layers[i]
        gates = dict(a=x.a, b=x.b, A_log=w.A_log, dt_bias=w.dt_bias)
        if self.cfg.arch == "kda":
            gates["lower_bound"] = self.cfg.lower_bound
        return gates

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


#: alias of :class:`TinyModel`, the name its callers import
TinyGDN = TinyModel
