"""The Mamba2 suite of ``recoverssm bench`` (``recoverssm/bench/mamba2.py``) without a GPU: tiny
shapes through the Triton kernels under the interpreter (or on a GPU), the timer replaced; the
peer's calls are checked against our decode with a stand-in written from the peer's documented
math, so the wiring (views, stride-0 broadcasts, one call per token) is what the suite times."""
from __future__ import annotations

import sys

import pytest
import torch

from recoverssm.bench import mamba2
from recoverssm.console import ProgressBar

from helpers import backends, device_of

pytestmark = pytest.mark.skipif("cuda" not in backends(), reason="needs the Triton kernels (GPU or interpreter)")

TINY = mamba2.Mamba2Geometry("tiny", nheads=4, headdim=8, dstate=16, ngroups=2)


def one_token_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None):
    """mamba-ssm's ``selective_state_update`` as its reference states it, in float64: ``x``,
    ``dt`` ``[b, H, P]``, ``A`` ``[H, P, N]``, ``B``, ``C`` ``[b, G, N]``, ``D``, ``dt_bias``
    ``[H, P]``; the state updated in place at ``state_batch_indices``."""
    H, G = x.shape[1], B.shape[1]
    dt = dt.double() + dt_bias.double()
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    group = torch.arange(H) // (H // G)
    Bh, Ch = B.double()[:, group], C.double()[:, group]                      # [b, H, N]
    idx = state_batch_indices.long()
    S = state[idx].double() * torch.exp(dt[..., None] * A.double()) + (dt * x.double())[..., None] * Bh[:, :, None]
    state[idx] = S.to(state.dtype)
    return (S * Ch[:, :, None]).sum(-1) + x.double() * D.double()


def test_peer_calls_decode_the_window_token_by_token():
    dev = device_of("cuda")
    w = mamba2.mamba2_window(TINY, 3, 4, torch.float32, device=dev)
    ours = w.state.clone()
    w.decode()
    ours, w.state[:] = w.state.clone(), ours
    for call in mamba2.peer_calls(w, one_token_update):
        call()
    rows = w.state_indices.long()
    assert torch.allclose(w.state[rows], ours[rows], rtol=1e-5, atol=1e-6)


def test_rows(monkeypatch):
    """One case: verify, commit and step rows with their times; the peer row is the error when
    the peer cannot be imported, the peer's time when it can."""
    monkeypatch.setattr(mamba2, "grid", lambda quick: [(TINY, torch.float32, 2, 3)])
    monkeypatch.setattr(mamba2, "copies_for", lambda state_bytes: 1)

    def fake_timer(calls, *a, **k):
        for call in calls:
            call()
        return 2.0

    class Ceiling:
        def us(self, traffic):
            return 1.0
    monkeypatch.setattr(mamba2, "median_us", fake_timer)
    monkeypatch.setattr("recoverssm.bench.rows.median_us", fake_timer)
    for peer in (None, one_token_update):
        if peer is None:
            monkeypatch.setattr(mamba2, "load_peer", lambda: (_ for _ in ()).throw(ImportError("no mamba_ssm")))
        else:
            monkeypatch.setattr(mamba2, "load_peer", lambda: one_token_update)
        with ProgressBar(1, "t", enabled=False) as progress:
            rows = mamba2.bench_mamba2(Ceiling(), False, progress, device=device_of("cuda"))
        kinds = {r["kind"]: r for r in rows}
        assert set(kinds) == {"mamba2_verify", "mamba2_commit", "mamba2_step", "mamba_ssm"}
        assert kinds["mamba2_step"]["speedup_vs_snapshot"] == 1.0 and kinds["mamba2_step"]["N"] == 2
        if peer is None:
            assert "no mamba_ssm" in kinds["mamba_ssm"]["error"]
        else:
            assert kinds["mamba_ssm"]["verify_speedup"] == 1.0 and kinds["mamba_ssm"]["decode_speedup"] == 1.0


def test_load_peer_reads_a_source_tree(tmp_path, monkeypatch):
    """Without an installed mamba_ssm, the folder ``RECOVERSSM_MAMBA_SSM`` names is imported
    without its package ``__init__``."""
    ops = tmp_path / "mamba_ssm" / "ops" / "triton"
    ops.mkdir(parents=True)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("raise ImportError('the compiled extension')\n")
    (tmp_path / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("")
    (ops / "selective_state_update.py").write_text("def selective_state_update():\n    return 'peer'\n")
    monkeypatch.setenv("RECOVERSSM_MAMBA_SSM", str(tmp_path))
    # the modules the import adds go with the test
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if not k.startswith("mamba_ssm")})
    try:
        import mamba_ssm  # noqa: F401
        pytest.skip("mamba_ssm is installed")
    except ImportError:
        pass
    assert mamba2.load_peer()() == "peer"
