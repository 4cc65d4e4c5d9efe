"""The model suite of ``recoverssm bench`` (``recoverssm/bench/model.py``) without a GPU: the
geometries and byte counts, one tiny case of each recurrence run through both methods' steps with
the accepted states compared bit for bit (``cpu_ref``, and the Triton kernels under the
interpreter or on a GPU), the per-case rows with the timers replaced, the targets, the output."""
from __future__ import annotations

import json

import pytest
import torch

from recoverssm import bench
from recoverssm.bench import model as M
from recoverssm.console import ProgressBar

from helpers import backends, device_of

F32, BF16 = torch.float32, torch.bfloat16
TINY_GDN = M.Geometry("tiny-gdn", "gdn", layers=2, H=2, HV=4, K=16, V=16)
TINY_KDA = M.Geometry("tiny-kda", "kda", layers=2, H=2, HV=2, K=16, V=16)
TINY_MAMBA2 = M.Geometry("tiny-mamba2", "mamba2", layers=2, H=2, HV=4, K=16, V=8)


# ------------------------------------------------------------------------------------------------
# geometries, grid, bytes
# ------------------------------------------------------------------------------------------------
def test_geometries_and_their_shards():
    assert M.QWEN3_NEXT.conv_dim == 8192
    assert M.LARGE_HEAD.conv_dim == 2 * 16 * 128 + 64 * 128
    assert M.KIMI_LINEAR.conv_dim == 3 * 32 * 128
    for g in M.GEOMETRIES:
        for tp in M.TPS:
            s = g.shard(tp)
            assert (s.H, s.HV, s.conv_dim, s.layers) == (g.H // tp, g.HV // tp, g.conv_dim // tp, g.layers)
    with pytest.raises(ValueError, match="do not split"):
        TINY_GDN.shard(4)


def test_grid():
    full = M.grid()
    assert len(full) == len(M.GEOMETRIES) * 3 * 2 * 3 * 6
    assert {(c.N, c.T) for c in full} == {(N, T) for N in M.NS for T in M.TS}
    quick = M.grid(quick=True)
    assert 0 < len(quick) <= 10 and {c.state_dtype for c in quick} == {F32, BF16}


def test_bytes_per_request_and_pools():
    g = M.QWEN3_NEXT
    assert M.state_slot_bytes(g, F32) == 2 * 2**20 and M.state_slot_bytes(g, BF16) == 2**20
    assert M.conv_slot_bytes(g, 4) == 8192 * 7 * 2
    assert M.record_token_bytes(g) == (32 * 128 + 16 * 128 + 32) * 4
    assert M.record_token_bytes(M.KIMI_LINEAR) == (32 * 128 + 32 * 128 + 32 * 128) * 4
    slot = M.state_slot_bytes(g, F32) + M.conv_slot_bytes(g, 4)
    assert M.bytes_per_request(g, F32, 4, "snapshot") == 36 * 4 * slot
    assert M.bytes_per_request(g, F32, 4, "recoverssm") == 36 * (slot + 4 * M.record_token_bytes(g))
    assert M.bytes_per_request(g, F32, 4, "deferred") == 36 * (slot + 2 * 4 * M.record_token_bytes(g))
    # The case the issue names: 36 layers x 256 requests x 8 fp32 snapshot slots does not fit 100 GiB.
    big = M.Case(g, 1, F32, 256, 8)
    assert M.pool_bytes(big, "snapshot") > M.POOL_BUDGET_BYTES > M.pool_bytes(big, "recoverssm")


def test_traffic():
    case = M.Case(M.QWEN3_NEXT, 2, BF16, 8, 4)
    g, state = case.shard, M.state_slot_bytes(case.shard, BF16)
    accepted = 20
    conv = M.conv_traffic(g, 8, 4, "snapshot")
    assert M.traffic_bytes(case, "snapshot", accepted) == g.layers * (5 * 8 * state + conv)
    ours = 3 * 8 * state + (8 * 4 + accepted) * M.record_token_bytes(g) + M.conv_traffic(g, 8, 4, "recoverssm")
    assert M.traffic_bytes(case, "recoverssm", accepted) == g.layers * ours
    assert M.conv_traffic(g, 8, 4, "recoverssm") - conv == 2 * 8 * 3 * g.conv_dim * 2   # the compaction
    deferred = 2 * 8 * state + (8 * 4 + accepted) * M.record_token_bytes(g) + M.conv_traffic(g, 8, 4, "deferred")
    assert M.traffic_bytes(case, "deferred", accepted) == g.layers * deferred      # one state move fewer


def test_memory_rows():
    rows = M.memory_rows(M.grid())
    assert len(rows) == len(M.GEOMETRIES) * 3 * 2 * 3
    r = next(r for r in rows if (r["geometry"], r["tp"], r["state"], r["T"]) == (M.QWEN3_NEXT.name, 1, "fp32", 4))
    assert r["recoverssm_max_requests"] == M.CONCURRENCY_BUDGET_BYTES // r["recoverssm_bytes_per_request"]
    assert r["snapshot_max_requests"] == M.CONCURRENCY_BUDGET_BYTES // r["snapshot_bytes_per_request"]
    assert r["concurrency_gain"] == round(r["recoverssm_max_requests"] / r["snapshot_max_requests"], 3)


# ------------------------------------------------------------------------------------------------
# both methods, one eager step: the accepted states agree bit for bit
# ------------------------------------------------------------------------------------------------
def _agree(geometry, dtype, backend, N=3, T=3):
    device = device_of(backend)
    case = M.Case(geometry, 1, dtype, N, T)
    out = M.run_case_eagerly(case, device, backend)
    ours, snap = out["recoverssm"], out["snapshot"]
    assert M.states_agree(ours, snap) and M.states_agree(ours, out["deferred"])
    # Not vacuous: the step moved every checked state away from where it started.
    start = M.make_pools(case, "recoverssm", device)
    for layer, state in zip(ours.layers, ours.state):
        assert not torch.equal(state, start.state[layer])
    assert set(M.make_activations(case, device).num_accepted.tolist()) != {T}
    return out


@pytest.mark.parametrize("geometry", [TINY_GDN, TINY_KDA, TINY_MAMBA2], ids=["gdn", "kda", "mamba2"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_methods_agree_cpu_ref(geometry, dtype):
    _agree(geometry, dtype, "cpu_ref")


@pytest.mark.parametrize("geometry,dtype", [(TINY_GDN, F32), (TINY_KDA, BF16), (TINY_MAMBA2, BF16)],
                         ids=["gdn-fp32", "kda-bf16", "mamba2-bf16"])
def test_methods_agree_triton(geometry, dtype):
    if "cuda" not in backends():
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU")
    _agree(geometry, dtype, "cuda")


def test_states_agree_sees_one_bit():
    out = M.run_case_eagerly(M.Case(TINY_GDN, 1, F32, 2, 2), "cpu", "cpu_ref")
    ours, snap = out["recoverssm"], out["snapshot"]
    snap.conv[-1].view(-1)[0] += 1
    assert not M.states_agree(ours, snap)


# ------------------------------------------------------------------------------------------------
# the rows, the targets and the output, with the timers replaced
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_timers(monkeypatch):
    """Graph time = the step's calls (so the snapshot step, one call shorter, is faster), eager
    time = ten times that; the steps themselves run in measure_method as on a GPU."""
    monkeypatch.setattr(M, "graph_us", lambda steps, iters: float(len(steps[0].calls)))
    monkeypatch.setattr(M, "eager_us", lambda steps, iters=3: 10.0 * len(steps[0].calls))


def _run(cases, budget=2**30, limit=60.0):
    progress = ProgressBar(len(cases), enabled=False)
    return M.run_cases(cases, bytes_per_us=1e6, fit_budget=budget, progress=progress, time_limit_s=limit,
                       device="cpu", backend="cpu_ref")


def test_rows(fake_timers, capsys):
    case = M.Case(TINY_GDN, 1, F32, 2, 4)
    (row,) = _run([case])
    assert row["check"] == "bit-exact"
    assert row["recoverssm"]["status"] == row["snapshot"]["status"] == "ok"
    assert row["speedup"] == round(2 * 2 / (2 * 2 + 1), 3) and row["eager_speedup"] == row["speedup"]
    accepted = int(M.make_activations(case, "cpu").num_accepted.sum())
    for method in M.METHODS:
        assert row[method]["traffic_bytes"] == M.traffic_bytes(case, method, accepted)
        assert row[method]["floor_us"] == round(row[method]["traffic_bytes"] / 1e6, 2)
    assert 1 <= row["copies"] <= 16
    assert "model: tiny-gdn TP=1 fp32 done" in capsys.readouterr().out


def test_rows_that_do_not_fit_or_do_not_run(fake_timers):
    case = M.Case(TINY_GDN, 1, F32, 2, 4)
    ours = M.pool_bytes(case, "recoverssm")
    budget = M.activation_bytes(case) + ours * M.copies_for(ours)
    (row,) = _run([case], budget=budget)
    assert row["recoverssm"]["status"] == "ok"
    assert row["snapshot"]["status"].startswith("does not fit")
    assert row["check"] == "n/a" and "speedup" not in row
    (late,) = _run([case], limit=-1.0)
    assert late["recoverssm"]["status"].startswith("not run") and late["check"] == "n/a"


def test_targets():
    def row(N, T, state, speedup):
        return dict(geometry="g", tp=1, state=state, N=N, T=T, speedup=speedup, check="bit-exact")
    cases = [row(1, 2, "fp32", 0.99), row(64, 4, "fp32", 1.5), row(256, 8, "bf16", 1.7), row(8, 4, "fp32", 1.3),
             dict(geometry="g", tp=1, state="bf16", N=8, T=4, check="n/a")]
    memory = [dict(geometry="g", tp=1, state="fp32", T=4, concurrency_gain=3.5)]
    t = {x["target"]: x for x in M.evaluate_targets(cases, memory)}
    assert t["speedup >= 0.97x at every N and T"]["met"] is True
    assert t["speedup >= 0.97x at every N and T"]["measured"] == 0.99
    assert t["speedup >= 1.4x at T = 4, N >= 64"]["met"] is True
    assert t["speedup >= 1.8x at T = 8, N >= 64"]["met"] is False
    assert t["speedup >= 1.8x at T = 8, N >= 64"]["worst"] == "g TP=1 bf16 N=256 T=8"
    assert t["speedup >= 1.2x at T = 4, N = 8, fp32 state"]["met"] is True
    assert t["speedup >= 1.2x at T = 4, N = 8, bf16 state"]["met"] is None
    assert t["concurrent requests >= 3x at T = 4"]["met"] is True
    assert t["commit of n == deferred + flush == snapshot of position n - 1, bit for bit"]["met"] is True


def test_summary_renders_and_serializes(fake_timers, tmp_path):
    cases = [M.Case(TINY_GDN, 1, F32, 2, 2), M.Case(TINY_KDA, 1, BF16, 2, 4)]
    summary = M.summarize(_run(cases), cases, 2**30, 1e6, 60.0, 1.0)
    json.dumps(summary)
    text = "\n".join(M.render(summary))
    for needle in ("tiny-gdn", "tiny-kda", "bit-exact", "model memory", "model targets", "NOT MET"):
        assert needle in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench_model.png"
    M.plot(summary, str(path), "test")
    assert path.stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cli_without_gpu(capsys, tmp_path):
    assert bench.main(["--only", "model", "--quick", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
