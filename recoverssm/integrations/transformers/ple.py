"""Qwen4Exp's per-layer embeddings (PLE) under :func:`~recoverssm.integrations.transformers.speculative`.

A PLE layer (``Qwen4ExpTextPLELayer``) runs before the layer's Gated DeltaNet and keeps two more
per-request states in the same cache layer: the inputs of its dilated short conv (taps
``ngram_size`` tokens apart, ``(width - 1) * ngram_size`` columns; state 1) and the last
``ngram_size - 1`` token ids of its n-gram hash (state 2). Both must roll back with the accepted
prefix:

* :class:`PLEConvRun`: the short conv runs through ``conv_verify`` / ``conv_decode`` with
  ``dilation`` on a pool of its own (the model's own path for the prompt, as for the GDN); a
  rollback keeps the accepted prefix's last inputs (the commit's compaction rule: a copy);
* :class:`NGramHistory`: the module's n-gram embedding runs as it is (it stores the window's last
  ids in state 2); a rollback puts the accepted prefix's last ids there instead.
"""
from __future__ import annotations

from typing import Optional

import torch

import recoverssm as rs

I32 = torch.int32


class PLEConvRun:
    """The dilated short conv of one PLE layer: its pool ``[1, channels, history + window]``."""

    def __init__(self, module: torch.nn.Module, conv_state: torch.Tensor, backend: Optional[str]):
        self.module, self.backend = module, backend
        self.weight = module.conv1d.weight.detach().squeeze(1)
        self.width, self.dilation = self.weight.shape[1], module.conv1d.dilation[0]
        self.history = module.short_conv_state_len
        self.slots = torch.zeros(1, dtype=I32, device=conv_state.device)
        self.start = conv_state.detach()[:1, :, conv_state.shape[-1] - self.history:]
        self.pool: Optional[torch.Tensor] = None
        self.window = 0
        self.pending: Optional[int] = None

    def _ensure_window(self, T: int) -> None:
        if T <= self.window:
            return
        pool = torch.zeros(1, self.start.shape[1], self.history + T, dtype=self.start.dtype, device=self.start.device)
        pool[:, :, :self.history] = self.start if self.pool is None else self.pool[:, :, :self.history]
        self.pool, self.window = pool, T

    def run(self, hidden: torch.Tensor, candidates: bool = False) -> torch.Tensor:
        """``silu(conv(hidden))`` for ``hidden`` ``[1, T, channels]`` (the module's ``_short_conv``)."""
        self.commit_pending()
        T = hidden.shape[1]
        self._ensure_window(T)
        x = hidden[0].contiguous()
        if T == 1 and not candidates:
            y = rs.conv_decode(x, self.pool, self.weight, None, state_indices=self.slots, dilation=self.dilation,
                               backend=self.backend)
        else:
            qsl = torch.tensor([0, T], dtype=I32, device=hidden.device)
            y = rs.conv_verify(x, self.pool, self.weight, None, state_indices=self.slots, query_start_loc=qsl,
                               dilation=self.dilation, backend=self.backend)
            self.pending = T
        return y[None]

    def crop(self, n: int) -> None:
        if self.pending is not None:
            self._keep(self.pending + n)

    def commit_pending(self) -> None:
        if self.pending is not None:
            self._keep(self.pending)

    def _keep(self, accepted: int) -> None:
        """The commit's compaction: the ``history`` inputs that end at the last accepted token."""
        self.pool[:, :, :self.history] = self.pool[:, :, accepted:accepted + self.history].clone()
        self.pending = None

    def history_columns(self) -> torch.Tensor:
        self.commit_pending()
        return self.pool[:, :, :self.history] if self.pool is not None else self.start


class NGramHistory:
    """The ids a PLE layer's n-gram embedding saw before and in its last forward."""

    def __init__(self, context_len: int):
        self.context_len = context_len
        self.previous: Optional[torch.Tensor] = None
        self.ids: Optional[torch.Tensor] = None

    def saw(self, previous: torch.Tensor, ids: torch.Tensor) -> None:
        self.previous, self.ids = previous, ids

    def crop(self, layer, n: int) -> None:
        """Keep all but the last ``-n`` ids of the last forward in the cache layer's state 2."""
        if self.ids is None or n == 0:
            return
        kept = torch.cat([self.previous, self.ids[:, :self.ids.shape[1] + n]], dim=-1)
        layer.conv_states[2] = kept[:, -self.context_len:].contiguous()
        self.ids = None
