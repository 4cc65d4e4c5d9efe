"""One linear-attention layer under :func:`~recoverssm.integrations.transformers.speculative`.

The layer keeps its recurrent state and conv history in RecoverSSM's layout, one slot (generate
speculates with batch size 1): the state ``[1, HV, V, K]`` fp32 (transformers keeps it in fp32
too, ``[B, HV, K, V]``), the history ``[1, conv_dim, width - 1 + window]`` in the model's dtype,
the replay records of the last window, and a one-layer :class:`~recoverssm.CommitContext`.

* **Prefill** (the first forward of a generate call on this layer): the module's own forward runs
  the prompt (its torch path, or flash-linear-attention where transformers uses it) and its
  states are handed over. Assisted generation puts the first candidates in that same forward
  (``logits_to_keep = 1 + k``): the last ``k`` tokens are verified as below, not prefilled.
* **A window of candidates** (``T > 1`` tokens, or a prefill's tail): ``conv_verify`` and ``gdn_verify`` /
  ``kda_verify`` with records; neither the state nor the history is written.
* **One token**: ``conv_decode`` and ``gdn_decode`` / ``kda_decode`` (state and history written).
* **Rollback**: generate calls ``cache.crop(-r)`` after every forward; the layer commits the
  window's first ``T - r`` tokens (state and history). A forward that finds a window still
  uncommitted (plain ``generate`` inside the context does not crop) commits all of it first.
"""
from __future__ import annotations

from typing import Optional

import torch

import recoverssm as rs

from .adapters import Adapter

I32 = torch.int32


class LayerRun:
    """A layer's state, history, records and commit context (see the module docstring)."""

    def __init__(self, adapter: Adapter, module: torch.nn.Module, conv_state: torch.Tensor,
                 recurrent_state: torch.Tensor, backend: Optional[str]):
        self.adapter, self.module, self.backend = adapter, module, backend
        self.H, self.HV, self.K, self.V = adapter.sizes(module)
        self.width = module.conv1d.weight.shape[-1]
        device = recurrent_state.device
        self.weight = module.conv1d.weight.detach().squeeze(1)
        self.bias = None if module.conv1d.bias is None else module.conv1d.bias.detach()
        self.state = recurrent_state.detach()[:1].transpose(-1, -2).to(torch.float32).contiguous()
        self.slots = torch.zeros(1, dtype=I32, device=device)
        self.pending: Optional[int] = None   # tokens of the last verified window, not yet committed
        self.window = 0                  # columns of the conv pool past the history, records' window
        self.conv = conv_state.detach()[:1, :, conv_state.shape[-1] - (self.width - 1):]   # the history alone
        self._ensure_window(1)

    # ---- pools -------------------------------------------------------------------------------
    def _ensure_window(self, T: int) -> None:
        """Pools for windows of up to ``T`` tokens (grown when a longer window comes)."""
        if T <= self.window:
            return
        device, hist = self.state.device, self.width - 1
        conv = torch.zeros(1, self.conv.shape[1], hist + T, dtype=self.conv.dtype, device=device)
        conv[:, :, :hist] = self.conv[:, :, :hist]
        self.conv, self.window = conv, T
        self.records = rs.ReplayRecords.allocate(1, T, self.H, self.HV, self.K, self.V, device=device,
                                                 vector_decay=self.adapter.family == "kda")
        cache = rs.LayerCache(self.state, self.records, self.conv, conv_width=self.width)
        self.ctx = rs.CommitContext([[cache]], max_batch=1, backend=self.backend)

    # ---- steps -------------------------------------------------------------------------------
    def run(self, hidden: torch.Tensor, candidates: bool = False) -> torch.Tensor:
        """The layer's output for ``hidden`` ``[1, T, hidden]``: a verified window (``T > 1``,
        or ``candidates``: a prefill's tail, which may be rolled back whole) or a decoded token."""
        self.commit_pending()
        T = hidden.shape[1]
        decode = T == 1 and not candidates
        self._ensure_window(T)
        p = self.adapter.project(self.module, hidden)
        qsl = torch.tensor([0, T], dtype=I32, device=hidden.device)
        if decode:
            y = rs.conv_decode(p.x, self.conv, self.weight, self.bias, state_indices=self.slots, backend=self.backend)
        else:
            y = rs.conv_verify(p.x, self.conv, self.weight, self.bias, state_indices=self.slots, query_start_loc=qsl,
                               backend=self.backend)
        kd = self.H * self.K
        q = y[:, :kd].unflatten(-1, (self.H, self.K))
        k = y[:, kd:2 * kd].unflatten(-1, (self.H, self.K))
        v = y[:, 2 * kd:].unflatten(-1, (self.HV, self.V))
        kw = dict(state=self.state, state_indices=self.slots, query_start_loc=qsl, g=p.g, beta=p.beta,
                  backend=self.backend)
        kda = self.adapter.family == "kda"
        if decode:
            o = (rs.kda_decode if kda else rs.gdn_decode)(q, k, v, **kw)
        else:
            o = (rs.kda_verify if kda else rs.gdn_verify)(q, k, v, records=self.records, **kw)
            self.pending = T
        return self.adapter.finish(self.module, o, p.gate)

    def crop(self, n: int) -> None:
        """generate's rollback: keep all but the last ``-n`` tokens of the last forward."""
        if n > 0:
            raise RuntimeError(f"crop({n}): only the last window can be rolled back (n <= 0)")
        if self.pending is None:
            if n < 0:
                raise RuntimeError(f"crop({n}): the last forward was a prefill or one token, which cannot be "
                                   "rolled back")
            return
        if -n > self.pending:
            raise RuntimeError(f"crop({n}) reaches past the last window of {self.pending} tokens")
        if n == -self.pending:           # every candidate of a prefill's tail rejected: nothing to keep
            self.pending = None
        else:
            self._commit(self.pending + n)

    def commit_pending(self) -> None:
        if self.pending is not None:
            self._commit(self.pending)

    def _commit(self, accepted: int) -> None:
        T, device = self.pending, self.state.device
        self.ctx.commit(torch.tensor([accepted], dtype=I32, device=device), self.slots,
                        torch.tensor([0, T], dtype=I32, device=device))
        self.pending = None
