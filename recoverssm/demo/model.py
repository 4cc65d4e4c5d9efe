"""The demo's target model: a tiny stack of layers built from a fixed seed: Gated DeltaNet
(``arch="gdn"``, Qwen3-Next-like), Kimi Delta Attention (``arch="kda"``, Kimi-Linear-like:
``H = HV``, ``K = V``, a decay per K channel), or a hybrid of Mamba2 and attention layers
(``arch="mamba2"``, Nemotron-H-like, :func:`hybrid_pattern`).

One GDN or KDA layer (pre-norm, residual), for a token's hidden vector ``h`` (``[hidden]``)::

    proj        = rmsnorm(h) @ w_in                      fused in-projection -> q | k | v | a | b | z
    y           = silu(causal_conv(q | k | v))           conv over the q|k|v channels, width 4
    q, k, v     = strided views of y                     [H, K], [H, K], [HV, V]
    o           = GDN or KDA(q, k, v, a, b)              the recurrent layer (verify or decode)
    h           = h + (rmsnorm_per_head(o) * silu(z)).flatten() @ w_out
    h           = h + silu(rmsnorm(h) @ w_up) @ w_down   small MLP

One Mamba2 layer, Nemotron-H's mixer (``H`` = ngroups, ``HV`` = nheads, ``K`` = dstate, ``V`` =
headdim), with the same residual and MLP::

    proj        = rmsnorm(h) @ w_in                      fused in-projection -> z | x | B | C | dt
    y           = silu(causal_conv(x | B | C))           conv over the x|B|C channels, width 4
    x, B, C     = strided views of y                     [HV, V], [H, K], [H, K]
    o           = Mamba2(x, B, C, dt) + D * x            the recurrent layer, z not passed to it
    h           = h + rmsnorm_per_group(o * silu(z)).flatten() @ w_out

(Nemotron-H gates in the norm, after the SSM, and normalises each of the ``ngroups`` groups of
heads on its own.) The hybrid's attention layers are in :mod:`.attention`. Every layer ends with
the small MLP (Nemotron-H has separate MLP layers instead; the recurrent parts are the same).

At the top ``logits = rmsnorm(h) @ w_head``. The gate input ``a`` is ``[HV]`` per token for
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
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import recoverssm as rs

from .attention import AttentionWeights, KVCache, attend_windows

#: the recurrent layer kinds, as ``--arch`` names them
ARCHS = ("gdn", "kda", "mamba2")
#: the recurrent state pools' dtypes the demo runs (``--state-dtype``)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: the library's ops of each layer kind: the speculative path verifies, the per-token path decodes
RECURRENCES: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "gdn": {"verify": rs.gdn_verify, "decode": rs.gdn_decode},
    "kda": {"verify": rs.kda_verify, "decode": rs.kda_decode},
    "mamba2": {"verify": rs.mamba2_verify, "decode": rs.mamba2_decode},
}

#: head sizes of each kind's own model at production scale (the demo's memory accounting):
#: Qwen3-Next's GDN layers, Kimi-Linear's KDA layers and Nemotron-H's Mamba2 layers (n_groups 8,
#: mamba_num_heads 128, ssm_state_size 128, mamba_head_dim 64)
PRODUCTION_HEADS = {"gdn": dict(H=16, HV=32, K=128, V=128), "kda": dict(H=32, HV=32, K=128, V=128),
                    "mamba2": dict(H=8, HV=128, K=128, V=64)}

#: sizes each kind changes from :class:`ModelConfig`'s defaults (KDA: as many q/k heads as value
#: heads; Mamba2: 2 groups of 2 heads, headdim 8 unlike dstate 16, so no transposed layout passes)
ARCH_SIZES = {"gdn": {}, "kda": dict(H=4, HV=4), "mamba2": dict(H=2, HV=4, K=16, V=8)}

#: the layer kinds of :attr:`ModelConfig.pattern`, in Nemotron-H's notation
RECURRENT, ATTENTION = "M", "*"


def hybrid_pattern(num_mamba: int) -> str:
    """The Mamba2 hybrid's stack, bottom up: ``num_mamba`` Mamba2 layers (``M``), an attention layer
    (``*``) after every odd-numbered one that another follows: ``M``, ``M*M``, ``M*MM``,
    ``M*MM*M``. Far denser in attention than Nemotron-H (4 attention layers beside 24 Mamba2 layers
    in the 8B model), so that even the tiny demo has attention between its Mamba2 layers."""
    return "".join(RECURRENT + ATTENTION if j % 2 == 0 and j + 1 < num_mamba else RECURRENT
                   for j in range(num_mamba))


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model. ``H`` q/k heads of dim ``K``, ``HV`` value heads of dim ``V``
    (Mamba2: ``H`` groups of ``B``/``C`` of dstate ``K``, ``HV`` heads of headdim ``V``);
    ``num_layers``: the recurrent layers (the Mamba2 hybrid adds attention layers,
    :attr:`pattern`); ``arch``: the recurrent layers' kind; ``lower_bound``: KDA's bounded gate
    (None: the softplus gate); ``state_dtype``: the recurrent state pools' dtype, ``"fp32"`` or
    ``"bf16"``. Mamba2 only: ``attn_*``, the attention layers' query heads, KV heads and head dim;
    ``dt_min``, the clamp ``dt >= dt_min`` (Nemotron-H's ``time_step_min``)."""

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
    attn_heads: int = 4
    attn_kv_heads: int = 2
    attn_head_dim: int = 16
    dt_min: float = 0.001

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "kda" and (self.H != self.HV or self.K != self.V):
            raise ValueError(f"the KDA model has H = HV and K = V (as Kimi-Linear), got H={self.H} "
                             f"HV={self.HV} K={self.K} V={self.V}")
        if self.arch == "mamba2" and self.HV % self.H:
            raise ValueError(f"the Mamba2 model's nheads (HV = {self.HV}) must be a multiple of its ngroups "
                             f"(H = {self.H})")
        if self.arch == "mamba2" and self.attn_heads % self.attn_kv_heads:
            raise ValueError(f"attn_heads = {self.attn_heads} must be a multiple of attn_kv_heads = "
                             f"{self.attn_kv_heads}")
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
        """Shape of one token's gate input ``a`` (and of ``dt_bias``): ``[HV]`` for GDN (Mamba2: its
        ``dt``), ``[HV, K]`` for KDA."""
        return (self.HV, self.K) if self.arch == "kda" else (self.HV,)

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
        """Channels of the causal conv: q | k | v (Mamba2: x | B | C, as many)."""
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def proj_dim(self) -> int:
        """Width of the fused in-projection: q | k | v | a | b | z (Mamba2: z | x | B | C | dt, as
        wide: one dt per head where GDN has a and b)."""
        if self.arch == "mamba2":
            return self.HV * self.V + self.conv_dim + self.HV
        return self.conv_dim + self.HV * self.gate_channels + self.HV + self.HV * self.V

    @property
    def pattern(self) -> str:
        """The layer stack, bottom up: ``M`` a recurrent layer of ``arch``, ``*`` an attention
        layer (:func:`hybrid_pattern` for Mamba2; GDN and KDA models are recurrent throughout)."""
        return hybrid_pattern(self.num_layers) if self.arch == "mamba2" else RECURRENT * self.num_layers

    @property
    def recurrent_layers(self) -> list[int]:
        """Stack indices of the recurrent layers (the ones with states, records and conv states)."""
        return [i for i, kind in enumerate(self.pattern) if kind == RECURRENT]

    @property
    def attention_layers(self) -> list[int]:
        """Stack indices of the attention layers (the ones with a KV cache)."""
        return [i for i, kind in enumerate(self.pattern) if kind == ATTENTION]

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
        """The head sizes, e.g. ``H=2 HV=4 K=V=16`` (Mamba2: ``ngroups=2 nheads=4 dstate=16 headdim=8``)."""
        if self.arch == "mamba2":
            return f"ngroups={self.H} nheads={self.HV} dstate={self.K} headdim={self.V}"
        dims = f"K=V={self.K}" if self.K == self.V else f"K={self.K} V={self.V}"
        return f"H={self.H} HV={self.HV} {dims}"

    def describe(self) -> str:
        if self.arch == "mamba2":
            attention = (f"{_count(len(self.attention_layers), 'attention layer')} ({self.attn_heads} heads, "
                         f"{self.attn_kv_heads} KV heads of dim {self.attn_head_dim}, no RoPE)"
                         if self.attention_layers else "no attention layer")
            return (f"{_count(self.num_layers, 'Mamba2 layer')} + {attention}, pattern {self.pattern}, hidden "
                    f"{self.hidden}, {self.heads()}, dt >= {self.dt_min:g}, conv width {self.conv_width} "
                    f"over x|B|C, vocab {self.vocab}, {self.state_dtype} states")
        gate = ""
        if self.arch == "kda":
            bound = "softplus" if self.lower_bound is None else f"bounded, lower_bound {self.lower_bound:g}"
            gate = f", per-channel gates ({bound})"
        return (f"{self.num_layers} {self.arch.upper()} layers, hidden {self.hidden}, {self.heads()}"
                f"{gate}, conv width {self.conv_width}, vocab {self.vocab}, {self.state_dtype} states")


def _count(n: int, noun: str) -> str:
    """``1 Mamba2 layer``, ``4 Mamba2 layers``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def model_config(arch: str = "gdn", num_layers: int = 4, lower_bound: Optional[float] = None,
                 state_dtype: str = "fp32") -> ModelConfig:
    """The demo model of ``arch`` (:data:`ARCH_SIZES`) with ``num_layers`` recurrent layers."""
    return ModelConfig(arch=arch, lower_bound=lower_bound, num_layers=num_layers, state_dtype=state_dtype,
                       **ARCH_SIZES.get(arch, {}))


@dataclass
class LayerWeights:
    """One recurrent layer's weights (shapes in :class:`ModelConfig` terms)."""

    norm: torch.Tensor       # [hidden]
    w_in: torch.Tensor       # [hidden, proj_dim]
    conv_w: torch.Tensor     # [conv_dim, conv_width]; conv_w[:, -1] multiplies the current token
    conv_b: torch.Tensor     # [conv_dim]
    A_log: torch.Tensor      # [HV] fp32
    dt_bias: torch.Tensor    # gate_shape ([HV] or [HV, K]) fp32
    o_norm: torch.Tensor     # gated RMSNorm weight: [V] shared by the heads (Mamba2: [HV * V])
    w_out: torch.Tensor      # [HV * V, hidden]
    mlp_norm: torch.Tensor   # [hidden]
    w_up: torch.Tensor       # [hidden, mlp_hidden]
    w_down: torch.Tensor     # [mlp_hidden, hidden]
    D: Optional[torch.Tensor] = None   # Mamba2's skip y += D * x, [HV] fp32 (None: GDN, KDA)


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

    @property
    def conv_in(self) -> torch.Tensor:
        """The conv's input channels."""
        return self.qkv


@dataclass
class Mamba2Inputs:
    """A Mamba2 layer's fused in-projection of a batch of tokens and its views (no copies), in
    Nemotron-H's order ``z | x | B | C | dt``: ``proj`` ``[T, proj_dim]``; ``xbc`` ``[T, conv_dim]``,
    the conv's input; ``dt`` ``[T, HV]``, raw; ``z`` ``[T, HV, V]``, the norm's gate."""

    proj: torch.Tensor
    xbc: torch.Tensor
    dt: torch.Tensor
    z: torch.Tensor

    @property
    def conv_in(self) -> torch.Tensor:
        """The conv's input channels."""
        return self.xbc


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
    """The demo's target model (weights drawn on CPU from ``cfg.seed``, then moved to ``device``).
    ``layers[i]`` holds layer ``i`` of :attr:`ModelConfig.pattern`: :class:`LayerWeights` for a
    recurrent layer, :class:`~.attention.AttentionWeights` for an attention layer."""

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
        recurrent = self._mamba2_weights if c.arch == "mamba2" else self._delta_weights
        self.layers: list[LayerWeights | AttentionWeights] = [
            recurrent(randn, uniform) if kind == RECURRENT else self._attention_weights(randn)
            for kind in c.pattern]
        self.final_norm = 1.0 + randn(c.hidden, std=0.1)
        self.w_head = randn(c.hidden, c.vocab, std=2.0 / math.sqrt(c.hidden))

    # ---- weights (a GDN or KDA model draws in the order it always did: the same weights) ---------
    def _conv_weights(self, randn) -> torch.Tensor:
        conv_w = randn(self.cfg.conv_dim, self.cfg.conv_width, std=0.4)
        conv_w[:, -1] += 1.0  # mostly pass the current token through, as trained convs do
        return conv_w

    def _mlp_weights(self, randn) -> dict:
        """The small MLP that ends every layer (drawn last in each layer, so every kind draws its
        other weights as before)."""
        c = self.cfg
        return dict(mlp_norm=1.0 + randn(c.hidden, std=0.1),
                    w_up=randn(c.hidden, c.mlp_hidden, std=1 / math.sqrt(c.hidden)),
                    w_down=randn(c.mlp_hidden, c.hidden, std=0.15 / math.sqrt(c.mlp_hidden)))

    def _delta_weights(self, randn, uniform) -> LayerWeights:
        """A GDN or KDA layer."""
        c = self.cfg
        conv_w = self._conv_weights(randn)
        return LayerWeights(
            norm=1.0 + randn(c.hidden, std=0.1),
            w_in=randn(c.hidden, c.proj_dim, std=1 / math.sqrt(c.hidden)),
            conv_w=conv_w,
            conv_b=randn(c.conv_dim, std=0.1),
            A_log=torch.log(uniform(0.5, 8.0, c.HV)),
            dt_bias=randn(*c.gate_shape, std=0.5),
            o_norm=1.0 + randn(c.V, std=0.1),
            w_out=randn(c.HV * c.V, c.hidden, std=0.3 / math.sqrt(c.HV * c.V)),
            **self._mlp_weights(randn),
        )

    def _mamba2_weights(self, randn, uniform) -> LayerWeights:
        """A Mamba2 layer, initialised as Mamba2 is: ``A`` uniform in [1, 16], ``dt_bias`` the
        inverse softplus of a log-uniform ``dt`` in [0.001, 0.1] (so with the raw ``dt`` added, some
        tokens fall under ``dt_min`` and the clamp matters), ``D`` near 1."""
        c = self.cfg
        conv_w = self._conv_weights(randn)
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1), c.HV))
        return LayerWeights(
            norm=1.0 + randn(c.hidden, std=0.1),
            w_in=randn(c.hidden, c.proj_dim, std=1 / math.sqrt(c.hidden)),
            conv_w=conv_w,
            conv_b=randn(c.conv_dim, std=0.1),
            A_log=torch.log(uniform(1.0, 16.0, c.HV)),
            dt_bias=dt + torch.log(-torch.expm1(-dt)),
            D=1.0 + randn(c.HV, std=0.1),
            o_norm=1.0 + randn(c.HV * c.V, std=0.1),
            # Half GDN's scale: the norm comes after the gate here, so its output is about twice
            # GDN's; the layers then move the logits about as much (and the drafts are accepted
            # about as often) as in the GDN model.
            w_out=randn(c.HV * c.V, c.hidden, std=0.15 / math.sqrt(c.HV * c.V)),
            **self._mlp_weights(randn),
        )

    def _attention_weights(self, randn) -> AttentionWeights:
        c = self.cfg
        heads = c.attn_heads * c.attn_head_dim
        return AttentionWeights(
            norm=1.0 + randn(c.hidden, std=0.1),
            w_qkv=randn(c.hidden, heads + 2 * c.attn_kv_heads * c.attn_head_dim, std=1 / math.sqrt(c.hidden)),
            w_o=randn(heads, c.hidden, std=0.15 / math.sqrt(heads)),   # a modest correction, as w_out
            **self._mlp_weights(randn),
        )

    # ---- the non-recurrent pieces, one token at a time -------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: int64 ``[T]`` -> hidden ``[T, hidden]`` (a gather: exact, batch-invariant)."""
        return self.embedding[tokens]

    def is_attention(self, i: int) -> bool:
        """Whether layer ``i`` is an attention layer (else a recurrent one)."""
        return self.cfg.pattern[i] == ATTENTION

    def in_proj(self, i: int, h: torch.Tensor) -> LayerInputs | Mamba2Inputs:
        """Recurrent layer ``i``'s fused in-projection of ``h`` ``[T, hidden]`` (one matmul per token)."""
        c, w = self.cfg, self.layers[i]
        proj = rowwise(lambda x: rmsnorm(x, w.norm, c.eps) @ w.w_in, h)
        if c.arch == "mamba2":
            x0 = c.HV * c.V
            dt0 = x0 + c.conv_dim
            return Mamba2Inputs(proj=proj, xbc=proj[:, x0:dt0], dt=proj[:, dt0:],
                                z=proj[:, :x0].unflatten(-1, (c.HV, c.V)))
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

    def split_xbc(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mamba2: strided views ``x: [T, HV, V]`` and ``B, C: [T, H, K]`` of the conv output
        ``[T, conv_dim]``, channels ``x | B | C`` (read in place by the ops: no copy)."""
        c = self.cfg
        xd, gk = c.HV * c.V, c.H * c.K
        return (y[:, :xd].unflatten(-1, (c.HV, c.V)), y[:, xd:xd + gk].unflatten(-1, (c.H, c.K)),
                y[:, xd + gk:].unflatten(-1, (c.H, c.K)))

    def operands(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recurrent op's token operands from the conv output: ``q, k, v`` or Mamba2's
        ``x, B, C``, in the op's argument order."""
        return self.split_xbc(y) if self.cfg.arch == "mamba2" else self.split_qkv(y)

    def recurrence(self, mode: str) -> Callable[..., torch.Tensor]:
        """The library op of this model's layers for ``mode`` (``"verify"`` or ``"decode"``)."""
        return RECURRENCES[self.cfg.arch][mode]

    def gates(self, i: int, x: LayerInputs | Mamba2Inputs) -> dict:
        """Layer ``i``'s raw gate arguments of the recurrent op, for the tokens of ``x``."""
        c, w = self.cfg, self.layers[i]
        if c.arch == "mamba2":
            # z stays out of the op: Nemotron-H gates in its norm (finish_layer). It clamps dt only
            # in its chunked prefill scan; here every path clamps, as the two must compute one
            # function to be compared bit for bit.
            return dict(dt=x.dt, dt_bias=w.dt_bias, A_log=w.A_log, D=w.D, dt_limit=(c.dt_min, None))
        gates = dict(a=x.a, b=x.b, A_log=w.A_log, dt_bias=w.dt_bias)
        if c.arch == "kda":
            gates["lower_bound"] = c.lower_bound
        return gates

    def gated_norm(self, w: LayerWeights, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The recurrent layer's output ``o`` gated by ``z`` (both ``[1, HV, V]``), flattened to
        ``[1, HV * V]``: GDN and KDA normalise each head, then gate; Mamba2 (Nemotron-H's
        ``norm_before_gate=False``) gates, then normalises each of the ``H`` groups of heads."""
        c = self.cfg
        if c.arch == "mamba2":
            groups = (o * F.silu(z)).flatten(1).unflatten(-1, (c.H, -1))       # [1, H, HV * V / H]
            return rmsnorm(groups, w.o_norm.view(c.H, -1), c.eps).flatten(1)
        return (rmsnorm(o, w.o_norm, c.eps) * F.silu(z)).flatten(1)

    def mlp(self, w: LayerWeights | AttentionWeights, h: torch.Tensor) -> torch.Tensor:
        """The small MLP that ends every layer, with its residual (``h``: one token, ``[1, hidden]``)."""
        return h + F.silu(rmsnorm(h, w.mlp_norm, self.cfg.eps) @ w.w_up) @ w.w_down

    def finish_layer(self, i: int, h: torch.Tensor, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm, out-projection, residual and MLP. ``h``: ``[T, hidden]``, ``o``, ``z``:
        ``[T, HV, V]``. Returns the layer's output ``[T, hidden]``."""
        w = self.layers[i]
        return rowwise(lambda h1, o1, z1: self.mlp(w, h1 + self.gated_norm(w, o1, z1) @ w.w_out), h, o, z)

    def attention(self, i: int, h: torch.Tensor, cache: KVCache, requests: Sequence[int],
                  positions: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
        """Attention layer ``i`` over the windows of ``h`` ``[T, hidden]``: ``requests[r]`` owns rows
        ``[starts[r], starts[r + 1])`` at positions ``positions[r], ...`` (its computed tokens so
        far); their keys and values go into ``cache`` (:func:`~.attention.attend_windows`). Returns
        the layer's output ``[T, hidden]``."""
        c, w = self.cfg, self.layers[i]
        qkv = rowwise(lambda x: rmsnorm(x, w.norm, c.eps) @ w.w_qkv, h)
        qd, kvd = c.attn_heads * c.attn_head_dim, c.attn_kv_heads * c.attn_head_dim
        q, k, v = (part.unflatten(-1, (-1, c.attn_head_dim)) for part in qkv.split([qd, kvd, kvd], dim=1))
        o = attend_windows(q, k, v, cache, requests, positions, starts)
        return rowwise(lambda h1, o1: self.mlp(w, h1 + o1.flatten(1) @ w.w_o), h, o)

    def kv_cache(self, num_requests: int) -> KVCache:
        """An empty KV cache of one attention layer for ``num_requests`` requests."""
        c = self.cfg
        return KVCache(num_requests, c.attn_kv_heads, c.attn_head_dim, self.device)

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
