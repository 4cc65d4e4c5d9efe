"""How each supported transformers linear-attention module maps onto RecoverSSM's ops.

A module's forward is, for every supported model: project the hidden states to the conv input
``x`` (q | k | v, ``[T, conv_dim]``), the gates and an output gate; a depthwise causal conv with
SiLU; the gated delta rule (GDN: a decay per head; KDA: per channel); a gated RMS norm and the
output projection. An :class:`Adapter` holds the model-specific parts (projections, gates,
finishing); :mod:`.layer` runs the conv and the recurrence with RecoverSSM's ops in between.

The gates are computed exactly as transformers computes them (``g``, the log-decay, in fp32;
``beta`` the sigmoid in the model's dtype) and handed to the ops precomputed, so the only
difference from the model's own path is the recurrence's arithmetic (fp32 either way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Projected:
    """One window's inputs for one layer: ``x`` ``[T, conv_dim]`` (the conv input, q | k | v),
    ``g`` (log-decay, fp32: GDN ``[T, HV]``, KDA ``[T, HV, K]``), ``beta`` ``[T, HV]`` fp32 and
    the output gate (the module's own shape)."""

    x: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gate: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    """A linear-attention module class: its family (``"gdn"`` or ``"kda"``), its sizes
    ``(H, HV, K, V)``, its projections (``project(module, h [1, T, hidden])``) and its output
    (``finish(module, o [T, HV, V], gate) -> [1, T, hidden]``)."""

    model: str
    family: str
    sizes: Callable[[torch.nn.Module], tuple[int, int, int, int]]
    project: Callable[[torch.nn.Module, torch.Tensor], Projected]
    finish: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _gdn_sizes(m) -> tuple[int, int, int, int]:
    return m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim


def _gdn_gates(m, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's and Qwen3.5's gates, as their forward computes them."""
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    return g, b.sigmoid().float()


def _qwen3_next_project(m, h: torch.Tensor) -> Projected:
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    T = h.shape[1]
    x = torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=-1)
    g, beta = _gdn_gates(m, a[0], b[0])
    return Projected(x, g, beta, z[0])


def _qwen3_5_project(m, h: torch.Tensor) -> Projected:
    g, beta = _gdn_gates(m, m.in_proj_a(h)[0], m.in_proj_b(h)[0])
    return Projected(m.in_proj_qkv(h)[0], g, beta, m.in_proj_z(h)[0])


def _gdn_finish(m, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    T, V = o.shape[0], o.shape[-1]
    return m.out_proj(m.norm(o.reshape(-1, V), gate.reshape(-1, V)).reshape(1, T, -1))


def _olmo_project(m, h: torch.Tensor) -> Projected:
    x = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)[0]
    beta = m.b_proj(h)[0].sigmoid()
    if m.allow_neg_eigval:
        beta = beta * 2.0
    g = -m.A_log.float().exp() * F.softplus(m.a_proj(h)[0].float() + m.dt_bias)
    return Projected(x, g, beta.float(), m.g_proj(h)[0])


def _olmo_finish(m, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    T, V = o.shape[0], o.shape[-1]
    return m.o_proj(m.o_norm(o.reshape(-1, V), gate.reshape(-1, V)).reshape(1, T, -1))


def _kimi_sizes(m) -> tuple[int, int, int, int]:
    return m.num_heads, m.num_heads, m.head_dim, m.head_dim


def _kimi_project(m, h: torch.Tensor) -> Projected:
    x = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)[0]
    g = m.forget_gate(h)[0]                                     # [T, H, K] fp32
    beta = torch.sigmoid(m.b_proj(h))[0].float()
    return Projected(x, g, beta, m.g_b_proj(m.g_a_proj(h))[0])


def _kimi_finish(m, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    T = o.shape[0]
    return m.o_proj(m.o_norm(o, gate.view(T, m.num_heads, m.head_dim)).reshape(1, T, -1))


#: Supported linear-attention modules, by class name (transformers 5.24).
ADAPTERS = {
    "Qwen3NextGatedDeltaNet": Adapter("Qwen3-Next", "gdn", _gdn_sizes, _qwen3_next_project, _gdn_finish),
    "Qwen3_5GatedDeltaNet": Adapter("Qwen3.5", "gdn", _gdn_sizes, _qwen3_5_project, _gdn_finish),
    "Qwen4ExpTextGatedDeltaNet": Adapter("Qwen4Exp", "gdn", _gdn_sizes, _qwen3_5_project, _gdn_finish),
    "OlmoHybridGatedDeltaNet": Adapter("OLMo-hybrid", "gdn", _gdn_sizes, _olmo_project, _olmo_finish),
    "KimiLinearDeltaAttention": Adapter("Kimi-Linear", "kda", _kimi_sizes, _kimi_project, _kimi_finish),
}

#: Recurrent modules of models transformers marks stateful that RecoverSSM does not serve yet.
NOT_YET = {
    "Mamba2Mixer": "Mamba2",
    "NemotronHMamba2Mixer": "Nemotron-H (Mamba2)",
    "GraniteMoeHybridMambaLayer": "Granite 4.0-H (Mamba2)",
    "FalconH1Mixer": "Falcon-H1 (Mamba2)",
}


def supported_models() -> list[str]:
    """The model families :func:`~recoverssm.integrations.transformers.speculative` serves."""
    return sorted({a.model for a in ADAPTERS.values()})
