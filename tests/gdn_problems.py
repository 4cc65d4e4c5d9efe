"""Random GDN problems shared by the kernel tests: ragged, padded batches with strided inputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import recoverssm as rs


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: dict
    state: torch.Tensor
    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    lengths: list
    H: int
    HV: int
    K: int
    V: int
    T: int
    extra: dict = field(default_factory=dict)

    @property
    def B(self) -> int:
        return len(self.lengths)

    def kwargs(self, **over) -> dict:
        kw = dict(state=self.state, state_indices=self.state_indices,
                  query_start_loc=self.query_start_loc, **self.gates)
        kw.update(over)
        return kw

    def records(self) -> rs.ReplayRecords:
        return rs.ReplayRecords.allocate(max(self.B, 1), self.T, self.H, self.HV, self.K, self.V,
                                         device=self.q.device)

    def first_tokens(self, n: int):
        """The inputs restricted to each row's first ``min(n, len)`` tokens (for the native path)."""
        idx, qsl = [], [0]
        starts = self.query_start_loc.tolist()
        for r, length in enumerate(self.lengths):
            m = min(n, length)
            idx += range(starts[r], starts[r] + m)
            qsl.append(qsl[-1] + m)
        idx = torch.tensor(idx, dtype=torch.long, device=self.q.device)
        gates = {name: (t[idx] if t.dim() == 2 else t) for name, t in self.gates.items()}
        return (self.q[idx], self.k[idx], self.v[idx], gates,
                torch.tensor(qsl, dtype=torch.int32, device=self.q.device))


def make_problem(lengths, *, H=2, HV=4, K=16, V=16, T=None, padding=(), state_dtype=torch.float32,
                 act_dtype=torch.float32, precomputed_gates=False, device="cpu", seed=0,
                 num_slots: Optional[int] = None, extreme=False,
                 sources_below: Optional[int] = None) -> Problem:
    """``lengths``: tokens per row; rows listed in ``padding`` get ``state_indices = -1``.

    q, k, v are strided views into one fused projection output ``[T_total, 2*H*K + HV*V + pad]``,
    as an engine's in-projection would give them. Source slots are distinct and shuffled, drawn
    from ``[1, sources_below)`` (default: the whole pool but slot 0).
    """
    g = torch.Generator().manual_seed(seed)
    T = T or max(max(lengths), 1)
    total = sum(lengths)
    width = 2 * H * K + HV * V + 8
    fused = torch.randn(total, width, generator=g).to(act_dtype)
    q = fused[:, :H * K].view(total, H, K)
    k = fused[:, H * K:2 * H * K].view(total, H, K)
    v = fused[:, 2 * H * K:2 * H * K + HV * V].view(total, HV, V)
    if extreme:   # gates at the edges: decay ~1 and ~0, beta ~0 and ~1, a past the softplus switch
        a = torch.tensor([-30.0, 25.0, 0.0, 60.0], dtype=torch.float32).repeat(total, (HV + 3) // 4)[:, :HV]
        b = torch.tensor([-20.0, 20.0, 0.5, -0.5], dtype=torch.float32).repeat(total, (HV + 3) // 4)[:, :HV]
        A_log = torch.linspace(-4, 3, HV)
    else:
        a = torch.randn(total, HV, generator=g) * 2
        b = torch.randn(total, HV, generator=g) * 2
        A_log = torch.randn(HV, generator=g)
    dt_bias = torch.randn(HV, generator=g)
    if precomputed_gates:
        x = a + dt_bias
        sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
        gates = dict(g=(-torch.exp(A_log) * sp).contiguous(), beta=torch.sigmoid(b))
    else:
        gates = dict(a=a.to(act_dtype), b=b.to(act_dtype), A_log=A_log, dt_bias=dt_bias)
    num_slots = num_slots or 2 * len(lengths) + 3
    state = (torch.randn(num_slots, HV, V, K, generator=g) * 0.5).to(state_dtype)
    perm = torch.randperm((sources_below or num_slots) - 1, generator=g)[:len(lengths)] + 1
    slots = [(-1 if r in padding else int(perm[r])) for r in range(len(lengths))]
    qsl = [0]
    for length in lengths:
        qsl.append(qsl[-1] + length)
    to = dict(device=device)
    return Problem(q.to(**to), k.to(**to), v.to(**to), {n: t.to(**to) for n, t in gates.items()},
                   state.to(**to), torch.tensor(slots, dtype=torch.int32, **to),
                   torch.tensor(qsl, dtype=torch.int32, **to), list(lengths), H, HV, K, V, T)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
