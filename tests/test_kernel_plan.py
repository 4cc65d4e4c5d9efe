"""The plan kernel (``plan_commit`` of the ``cuda`` backend) against ``cpu_ref`` on random plans,
in the interpreter and on a GPU (:mod:`kernel_settings`), exact.
"""
import pytest
import torch

import recoverssm as rs
from kernel_settings import SETTINGS


def backend_plan(name, device, accepted, src, qsl, req, kw, num_slots):
    """The kernel-facing plan op, below validation, so that any values can be fed to it."""
    be = rs.get_backend(name, device)
    out = tuple(torch.empty(src.shape[0], dtype=torch.int32, device=device) for _ in range(4))
    to = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
    be.plan_commit(to(accepted), to(src), to(qsl), to(req), to(kw.get("block_table")),
                   to(kw.get("num_computed_tokens")), kw.get("block_size", 1), -1, num_slots, out)
    return [t.tolist() for t in out]



@pytest.mark.parametrize("s", SETTINGS)
def test_plan_commit_random_matches_reference(s):
    """Random plans, including values validation would refuse (slots past the pool, null and
    negative blocks, windows past the block table): the in-kernel plan follows cpu_ref's rules."""
    device = s["device"]
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        B, R, width, bs = 6, 8, 5, 1 + trial % 4
        lens = torch.randint(0, 5, (B,), generator=g)
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        req = torch.randperm(R, generator=g)[:B].to(torch.int32)
        accepted = torch.randint(-1, 6, (R,), generator=g, dtype=torch.int32)
        bt = torch.randint(-1, 40, (R, width), generator=g, dtype=torch.int32)
        nct = torch.randint(0, bs * width + 2, (R,), generator=g, dtype=torch.int32)
        src = torch.randint(-1, 40, (B,), generator=g, dtype=torch.int32)
        for kw in (dict(block_table=bt, num_computed_tokens=nct, block_size=bs), {}):
            for r in (req, None):
                ref = backend_plan("cpu_ref", "cpu", accepted, src, qsl, r, kw, 32)
                got = backend_plan("cuda", device, accepted, src, qsl, r, kw, 32)
                assert got == ref, (trial, list(kw), r is None)
