"""The reference path: plain non-speculative decoding, one token per request per call.

Nothing here touches records, plans or commits. Each request owns slot ``q`` of small private
pools; every call feeds one token per active request through the model with ``rs.gdn_decode``,
``rs.kda_decode`` or ``rs.mamba2_decode`` (the native per-token recurrence, state updated in place)
and a per-token causal conv, whose pools hold the history only (``[requests, conv_dim, width - 1]``);
an attention layer appends the token's key and value to its own KV cache and attends over it:

* ``conv="kernel"``: the backend's ``rs.conv_decode``, as an engine's decode step runs it (output
  and history shift in one op). Its history is bit-exact to ``conv_verify`` + commit, and its
  output is ``conv_verify``'s because the fp32 conv state holds the fp32 inputs exactly.
* ``conv="torch"``: the conv written out in plain PyTorch from the formula of docs/API.md
  (``y = silu(bias + sum_j w[:, j] * seq[j])``, fp32, taps in order ``j = 0 .. width-1``,
  then the window shifts by one). These are the same elementwise fp32 operations, in the same
  order, as the ``cpu_ref`` kernel, so on ``cpu_ref`` the outputs agree bit for bit without
  sharing any code with it; a GPU kernel may contract ``a*b+c`` into an FMA and round otherwise.

It also keeps a copy of every recurrent layer's state and conv history whenever a request's token
count reaches a multiple of a group's block size: what a prefix-cache block must hold.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

import recoverssm as rs
from recoverssm.backends.cpu_ref.numerics import on_vector_path

from .model import TinyModel


class ReferenceEngine:
    """Per-token decode of ``num_requests`` requests; request ``q`` lives in slot ``q``."""

    def __init__(self, model: TinyModel, num_requests: int, backend, conv: str,
                 block_sizes: Sequence[int], layers_of: Sequence[Sequence[int]]):
        if conv not in ("torch", "kernel"):
            raise ValueError(f"conv must be 'torch' or 'kernel', got {conv!r}")
        c = model.cfg
        self.model = model
        self.backend = backend
        self.conv = conv
        self.block_sizes = list(block_sizes)
        self.layers_of = [list(ls) for ls in layers_of]
        dev = model.device
        # by stack index, as the speculative path's
        self.state = {i: torch.zeros(num_requests, c.HV, c.V, c.K, device=dev, dtype=c.state_torch_dtype)
                      for i in c.recurrent_layers}
        self.conv_state = {i: torch.zeros(num_requests, c.conv_dim, c.conv_history, device=dev)
                           for i in c.recurrent_layers}
        self.kv = {i: model.kv_cache(num_requests) for i in c.attention_layers}
        self.num_computed = [0] * num_requests
        #: (group, request, tokens) -> [(state, conv history) per layer of the group]
        self.block_states: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def feed(self, requests: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Feed token ``tokens[j]`` to request ``requests[j]`` (distinct requests, one token each);
        return ``logits [len(requests), vocab]``."""
        m, dev = self.model, self.model.device
        B = len(requests)
        slots = torch.tensor(list(requests), dtype=torch.int32, device=dev)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
        h = m.embed(torch.tensor(list(tokens), dtype=torch.long, device=dev))
        decode = m.recurrence("decode")
        for i in range(len(m.layers)):
            if m.is_attention(i):
                h = m.attention(i, h, self.kv[i], requests, [self.num_computed[r] for r in requests], range(B + 1))
                continue
            x = m.in_proj(i, h)
            y = self._conv(i, x.conv_in, requests, slots)
            o = decode(*m.operands(y), state=self.state[i], state_indices=slots, query_start_loc=qsl,
                       **m.gates(i, x), backend=self.backend)
            h = m.finish_layer(i, h, o, x.z)
        for r in requests:
            self.num_computed[r] += 1
            self._keep_block_state(r)
        return m.logits(h)

    def _conv(self, i: int, x: torch.Tensor, requests, slots) -> torch.Tensor:
        """Per-token causal conv of layer ``i``: ``x [B, conv_dim]`` -> ``y [B, conv_dim]``."""
        w = self.model.layers[i]
        cs = self.conv_state[i]
        hist = self.model.cfg.conv_history
        if self.conv == "kernel":
            return rs.conv_decode(x, cs, w.conv_w, w.conv_b, state_indices=slots, activation="silu",
                                  backend=self.backend)
        weight = w.conv_w.float()
        ys = []
        for j, r in enumerate(requests):
            seq = torch.cat([cs[r, :, :hist].float(), x[j].float()[:, None]], dim=1)   # [conv_dim, width]
            acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
            acc += w.conv_b.float()
            for tap in range(weight.shape[1]):
                acc = acc + weight[:, tap] * seq[:, tap]
            ys.append(on_vector_path(F.silu, acc).to(x.dtype))   # cpu_ref's rounding rule
            cs[r, :, :hist] = seq[:, 1:].to(cs.dtype)
        return torch.stack(ys)

    def _keep_block_state(self, r: int) -> None:
        n = self.num_computed[r]
        hist = self.model.cfg.conv_history
        for g, bs in enumerate(self.block_sizes):
            if n % bs == 0:
                self.block_states[(g, r, n)] = [
                    (self.state[i][r].clone(), self.conv_state[i][r, :, :hist].clone())
                    for i in self.layers_of[g]]

    def current(self, g: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Request ``r``'s (state, conv history) for each layer of group ``g``, now."""
        hist = self.model.cfg.conv_history
        return [(self.state[i][r], self.conv_state[i][r, :, :hist]) for i in self.layers_of[g]]

    def kv_prefix(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer ``layer``'s keys and values of request ``r``'s computed tokens."""
        return self.kv[layer].prefix(r, self.num_computed[r])
