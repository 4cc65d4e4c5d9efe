"""Tensor parallelism (``recoverssm demo --tp N``, :mod:`recoverssm.demo.tp`) on CPU with gloo.

* Op level, 2 processes: each rank runs ``rs.conv_verify``, ``rs.gdn_verify`` and
  ``CommitContext.commit`` (align mode, two KV-cache groups, fp32 and bf16 states, two steps) on its
  head shard; its conv outputs, GDN outputs, records and committed states / conv states must equal,
  bit for bit, the matching head (channel) slices of the single-process run computed here.
* Model level: the sharded model (column-parallel in-projection, row-parallel out-projection and
  all_reduce) computes the same function as the single-process model (to rounding).
* Demo level: the whole TP demo on 2 ranks (speculative vs each rank's own per-token path, greedy
  tokens all-gathered and compared across ranks), a corrupted commit on one rank is caught, and the
  real command line through ``torch.distributed.run``.

Only 127.0.0.1: the process groups rendezvous through a FileStore (spawned workers) or on
127.0.0.1 with a free port (torchrun), and gloo is pinned to the loopback interface.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import recoverssm as rs
from recoverssm import cli
from recoverssm.demo import DemoConfig, DemoMismatch, ModelConfig, TinyGDN, run_demo
from recoverssm.demo.reference import ReferenceEngine
from recoverssm.demo.spec import SpecEngine
from recoverssm.demo.tp import HeadShard, ShardedTinyGDN, TPSetupError, run_tp_demo, shard_config
from recoverssm.cli_support import torch_threads

WORLD = 2
I32 = torch.int32
TINY = ModelConfig(vocab=64, hidden=32, num_layers=2, H=2, HV=4, K=8, V=8, mlp_hidden=32)

# Op-level problems. "small": per-token vectors that stay on one side of PyTorch's vector/scalar
# loop split whatever the ISA (HV = 4 -> 2 scalar; conv channels 64 -> 32, multiples of 32), so
# cpu_ref is shard-invariant. "wide": HV = 32 -> 16 and 320 -> 160 conv channels, where cpu_ref's
# per-token gates and SiLU may land in the vectorised body on one side and the scalar tail on the
# other (cpu_ref/numerics.py says why).
OP_CASES = {
    "small_fp32": dict(H=2, HV=4, K=8, V=8, state_dtype=torch.float32),
    "small_bf16": dict(H=2, HV=4, K=8, V=8, state_dtype=torch.bfloat16),
    "wide_fp32": dict(H=4, HV=32, K=8, V=8, state_dtype=torch.float32),
}


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _loopback_env() -> None:
    """Pin gloo to the loopback interface (127.0.0.1) where there is one."""
    names = {n for _, n in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    for lo in ("lo", "lo0"):
        if lo in names:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            return


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# the op-level problem (built in the test process, sharded in the workers)
# ------------------------------------------------------------------------------------------------
def make_problem(H, HV, K, V, state_dtype, seed=0) -> dict:
    """Two steps of a 4-request batch over 2 layers (2 KV-cache groups, block sizes 2 and 3),
    align mode: request 0 crosses a block boundary, request 1 has an empty window, request 3 is a
    padding row. Everything a rank needs to shard is here, on CPU."""
    g = torch.Generator().manual_seed(seed)
    width, T, R, L = 4, 4, 4, 2
    conv_dim = 2 * H * K + HV * V
    block_sizes = [2, 3]
    bt_width = 6
    tables, num_slots = [], []
    for gi, bs in enumerate(block_sizes):
        n = R * bt_width
        perm = torch.randperm(n, generator=g).to(I32)
        tables.append(perm.view(R, bt_width).contiguous())
        num_slots.append(n)
    layers = []
    for i in range(L):
        gi = i % 2
        layers.append(dict(
            group=gi,
            conv_w=torch.randn(conv_dim, width, generator=g) * 0.5,
            conv_b=torch.randn(conv_dim, generator=g) * 0.1,
            A_log=torch.log(0.5 + 7.5 * torch.rand(HV, generator=g)),
            dt_bias=torch.randn(HV, generator=g) * 0.5,
            state=(torch.randn(num_slots[gi], HV, V, K, generator=g) * 0.3).to(state_dtype),
            conv_state=torch.randn(num_slots[gi], conv_dim, width - 1 + T, generator=g),
        ))
    steps = []
    lengths = [[4, 0, 3, 2], [3, 2, 4, 1]]
    accepted = [[4, 0, 2, 1], [1, 2, 4, 1]]
    for s in range(2):
        Tt = sum(lengths[s])
        steps.append(dict(
            lengths=lengths[s], num_accepted=accepted[s],
            x=[torch.randn(Tt, conv_dim, generator=g) for _ in range(L)],
            a=[torch.randn(Tt, HV, generator=g) * 2 for _ in range(L)],
            b=[torch.randn(Tt, HV, generator=g) * 2 for _ in range(L)],
        ))
    return dict(H=H, HV=HV, K=K, V=V, T=T, R=R, block_sizes=block_sizes, tables=tables,
                num_slots=num_slots, layers=layers, steps=steps, num_computed=[3, 1, 0, 2])


def _source(table_row: list[int], nc: int, bs: int) -> int:
    return table_row[0] if nc == 0 else table_row[(nc - 1) // bs]


def run_ops(p: dict, shard: HeadShard | None = None) -> dict:
    """Verify + commit both steps with cpu_ref, on all heads (``shard=None``) or on one rank's
    shard. Returns every output, record and post-commit pool, per step and layer."""
    H, HV, K, V, T, R = p["H"], p["HV"], p["K"], p["V"], p["T"], p["R"]
    ch = hv = None
    if shard is not None:
        ch, hv = shard.conv_channels(), shard.v_heads
        H, HV = shard.local_H, shard.local_HV

    def chan(t, dim=1):
        return t if ch is None else t.index_select(dim, ch).contiguous()

    def vh(t, dim=1):
        return t if hv is None else t.narrow(dim, hv.start, hv.stop - hv.start).contiguous()

    layers = []
    for lw in p["layers"]:
        layers.append(dict(group=lw["group"], conv_w=chan(lw["conv_w"], 0), conv_b=chan(lw["conv_b"], 0),
                           A_log=vh(lw["A_log"], 0), dt_bias=vh(lw["dt_bias"], 0),
                           state=vh(lw["state"]).clone(), conv_state=chan(lw["conv_state"]).clone(),
                           records=rs.ReplayRecords.allocate(R, T, H, HV, K, V)))
    G = len(p["block_sizes"])
    ctx = rs.CommitContext([[rs.LayerCache(layer["state"], layer["records"], conv_state=layer["conv_state"],
                                           conv_width=layer["conv_w"].shape[1])
                             for layer in layers if layer["group"] == gi] for gi in range(G)],
                           max_batch=R, backend="cpu_ref")
    tables = [t.tolist() for t in p["tables"]]
    nc = list(p["num_computed"])
    out = {}
    for si, st in enumerate(p["steps"]):
        lengths = st["lengths"]
        qsl = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(R)], dtype=I32)
        sources = []
        for gi, bs in enumerate(p["block_sizes"]):
            src = [_source(tables[gi][q], nc[q], bs) for q in range(R)]
            src[3] = -1                                    # request 3: a padding row
            sources.append(torch.tensor(src, dtype=I32))
        for li, layer in enumerate(layers):
            si_ = sources[layer["group"]]
            y = rs.conv_verify(chan(st["x"][li]), layer["conv_state"], layer["conv_w"], layer["conv_b"],
                               state_indices=si_, query_start_loc=qsl, backend="cpu_ref")
            hk = H * K
            q_, k_ = y[:, :hk].unflatten(-1, (H, K)), y[:, hk:2 * hk].unflatten(-1, (H, K))
            v_ = y[:, 2 * hk:].unflatten(-1, (HV, V))
            o = rs.gdn_verify(q_, k_, v_, state=layer["state"], state_indices=si_, query_start_loc=qsl,
                              records=layer["records"], a=vh(st["a"][li]), b=vh(st["b"][li]),
                              A_log=layer["A_log"], dt_bias=layer["dt_bias"], backend="cpu_ref")
            rec = layer["records"]
            out[f"s{si}.l{li}.conv_out"] = y.clone()
            out[f"s{si}.l{li}.gdn_out"] = o.clone()
            out[f"s{si}.l{li}.correction"] = rec.correction.clone()
            out[f"s{si}.l{li}.key"] = rec.key.clone()
            out[f"s{si}.l{li}.decay"] = rec.decay.clone()
        na = torch.tensor(st["num_accepted"], dtype=I32)
        ctx.commit(na, sources, qsl, block_table=p["tables"],
                   num_computed_tokens=torch.tensor(nc, dtype=I32), block_size=p["block_sizes"])
        for li, layer in enumerate(layers):
            out[f"s{si}.l{li}.state"] = layer["state"].clone()
            out[f"s{si}.l{li}.conv_state"] = layer["conv_state"].clone()
        for q in range(R):
            if sources[0][q] > -1:
                nc[q] += min(st["num_accepted"][q], lengths[q])
    return out


def head_slice(name: str, full: torch.Tensor, shard: HeadShard) -> torch.Tensor:
    """The part of a single-process result that rank ``shard.rank`` holds."""
    kind = name.rsplit(".", 1)[1]
    if kind in ("conv_out", "conv_state"):
        return full.index_select(1, shard.conv_channels())
    if kind == "key":
        return full[:, shard.heads]
    return full[:, shard.v_heads]       # gdn_out, correction, decay, state


# ------------------------------------------------------------------------------------------------
# the 2-process run (one spawn for everything, results through files)
# ------------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    _loopback_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    res: dict = {"timings": {}}
    t0 = time.perf_counter()
    # 1. ops on this rank's shard; reassemble the last states across ranks with all_gather
    problems = torch.load(os.path.join(out_dir, "problems.pt"), weights_only=False)
    res["ops"] = {}
    for name, p in problems.items():
        shard = HeadShard(rank, world, p["H"], p["HV"], p["K"], p["V"])
        mine = run_ops(p, shard)
        last = mine["s1.l0.state"].float()
        parts = [torch.empty_like(last) for _ in range(world)]
        dist.all_gather(parts, last)
        mine["gathered.s1.l0.state"] = torch.cat(parts, dim=1)
        res["ops"][name] = mine
    res["timings"]["ops"] = time.perf_counter() - t0

    # 2. the sharded model computes the single-process model's function (to rounding)
    t0 = time.perf_counter()
    full = TinyGDN(TINY)
    sharded = ShardedTinyGDN(full, rank, world)
    engines = [ReferenceEngine(m, 2, "cpu_ref", "torch", [4], [[0, 1]]) for m in (full, sharded)]
    diffs, same_tokens = [], True
    tokens = [[5, 9, 1, 33, 7, 2], [60, 3, 3, 12, 40, 8]]
    for t in range(len(tokens[0])):
        lf, ls = (e.feed([0, 1], [tokens[0][t], tokens[1][t]]) for e in engines)
        diffs.append((lf - ls).abs().max().item())
        same_tokens &= torch.equal(lf.argmax(-1), ls.argmax(-1))
    res["model"] = dict(max_abs_diff=max(diffs), same_tokens=same_tokens,
                        state_shape=tuple(engines[1].state[0].shape), all_reduces=sharded.all_reduces)
    res["timings"]["model"] = time.perf_counter() - t0

    # 3. the TP demo
    t0 = time.perf_counter()
    cfg = DemoConfig(requests=3, draft_tokens=3, steps=4, seed=1, prompt_len=(3, 7), model=TINY)
    tpr = run_tp_demo(cfg)
    r = tpr.result
    res["demo"] = dict(tokens=r.tokens, ref_tokens=r.ref_tokens, ok=r.ok, steps=len(r.steps),
                       compared_slots=r.compared_slots, compared_logits=r.compared_logits,
                       prefix_blocks=r.prefix_blocks_checked,
                       boundary_writes=sum(s.boundary_writes for s in r.steps),
                       token_rows=tpr.token_rows_checked, ranks=tpr.ranks, world=tpr.world,
                       records_bytes=r.memory["recoverssm_records"],
                       state_bytes_per_slot=r.memory["state_bytes_per_slot"])
    res["timings"]["demo"] = time.perf_counter() - t0

    # 4. last (it breaks the group): a one-ulp corruption of rank 1's commit is caught on rank 1
    t0 = time.perf_counter()
    if rank == 1:
        original = SpecEngine.commit

        def corrupting_commit(self, num_accepted, qsl):
            plans = original(self, num_accepted, qsl)
            s = self.state[self.layers_of[1][0]][plans[1].final_slot[0]]
            s[0, 0, 0] = torch.nextafter(s[0, 0, 0], torch.tensor(float("inf")))
            return plans

        SpecEngine.commit = corrupting_commit
    try:
        run_tp_demo(dataclasses.replace(cfg, steps=2))
        res["corrupt"] = dict(raised=None, message="")
    except Exception as e:    # rank 1: DemoMismatch; rank 0: gloo sees rank 1 go away
        res["corrupt"] = dict(raised=type(e).__name__, message=str(e)[:400],
                              mismatch=isinstance(e, DemoMismatch))
    res["timings"]["corrupt"] = time.perf_counter() - t0
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    # Leave at once (the group is broken now): rank 1's exit makes rank 0's pending collective
    # fail instead of waiting for its timeout, and no rank tears down a broken group.
    os._exit(0)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Single-process results, then one 2-process gloo run of every worker phase."""
    out_dir = str(tmp_path_factory.mktemp("tp"))
    problems = {name: make_problem(**kw) for name, kw in OP_CASES.items()}
    full = {name: run_ops(p) for name, p in problems.items()}
    torch.save(problems, os.path.join(out_dir, "problems.pt"))
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(WORLD, os.path.join(out_dir, "store"), out_dir), nprocs=WORLD, join=True)
    wall = time.perf_counter() - t0
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    print(f"2-process gloo run: {wall:.1f} s; per rank: " + "; ".join(
        ", ".join(f"{k} {v:.1f} s" for k, v in r["timings"].items()) for r in ranks))
    return dict(problems=problems, full=full, ranks=ranks, wall=wall)


def _op_mismatches(tp_run, case: str) -> list[str]:
    p, full = tp_run["problems"][case], tp_run["full"][case]
    bad = []
    for rank, res in enumerate(tp_run["ranks"]):
        shard = HeadShard(rank, WORLD, p["H"], p["HV"], p["K"], p["V"])
        mine = res["ops"][case]
        for name, want in full.items():
            got = mine[name]
            exp = head_slice(name, want, shard)
            if got.shape != exp.shape:
                bad.append(f"rank {rank} {name}: shape {tuple(got.shape)} != {tuple(exp.shape)}")
            elif not torch.equal(got, exp):
                n = int((got != exp).sum())
                bad.append(f"rank {rank} {name}: {n} of {got.numel()} elements differ")
    return bad


@pytest.mark.parametrize("case", ["small_fp32", "small_bf16"])
def test_tp_ops_bit_identical_to_single_process_head_slices(tp_run, case):
    bad = _op_mismatches(tp_run, case)
    assert not bad, "\n".join(bad)
    # the reassembled state (all_gather over the ranks) is the single-process state
    full_state = tp_run["full"][case]["s1.l0.state"].float()
    assert torch.equal(tp_run["ranks"][0]["ops"][case]["gathered.s1.l0.state"], full_state)
    # and the problem really committed something (states moved away from the initial pools)
    p = tp_run["problems"][case]
    assert not torch.equal(tp_run["full"][case]["s1.l0.state"], p["layers"][0]["state"])


def test_tp_ops_wide_heads(tp_run):
    """HV = 32 -> 16 per rank, conv 320 -> 160: bit-identical because cpu_ref evaluates per-token
    gates and SiLU on the vectorised path whatever the vector's length (cpu_ref/numerics.py)."""
    bad = _op_mismatches(tp_run, "wide_fp32")
    assert not bad, "\n".join(bad)


def test_tp_sharded_model_is_the_same_model(tp_run):
    for rank, res in enumerate(tp_run["ranks"]):
        m = res["model"]
        assert m["same_tokens"], m
        assert m["max_abs_diff"] < 1e-4, m
        assert m["state_shape"] == (2, TINY.HV // WORLD, TINY.V, TINY.K)
        assert m["all_reduces"] == 6 * 2 * TINY.num_layers   # one per token per layer


def test_tp_demo_two_ranks(tp_run):
    d0, d1 = (r["demo"] for r in tp_run["ranks"])
    for d in (d0, d1):
        assert d["ok"] and d["world"] == WORLD and d["steps"] == 4
        assert d["tokens"] == d["ref_tokens"]
        assert d["compared_slots"] > 0 and d["compared_logits"] > 0 and d["prefix_blocks"] > 0
        assert d["token_rows"] > 0
        # per-rank records: [R, HV/N, T, V] + [R, H/N, T, K] + [R, HV/N, T] fp32 per layer
        R, T, N, c = 3, 4, WORLD, TINY
        per_layer = 4 * R * T * (c.HV // N * c.V + c.H // N * c.K + c.HV // N)
        assert d["records_bytes"] == c.num_layers * per_layer
        assert d["state_bytes_per_slot"] == 4 * (c.HV // N) * c.V * c.K
    assert d0["tokens"] == d1["tokens"]
    assert [r["tokens"] for r in d0["ranks"]] == [d0["tokens"]] * WORLD


def test_tp_detects_a_one_ulp_difference_on_one_rank(tp_run):
    c0, c1 = (r["corrupt"] for r in tp_run["ranks"])
    assert c1["mismatch"] and "recurrent state" in c1["message"], c1
    assert c0["raised"] is not None, c0        # rank 0 stopped (its collective failed), no hang


# ------------------------------------------------------------------------------------------------
# the real command line, and in-process pieces
# ------------------------------------------------------------------------------------------------
def test_tp_cli_under_torchrun():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if "lo" in {n for _, n in socket.if_nameindex()}:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "recoverssm", "demo", "--tp", "2", "--device", "cpu", "--steps", "3", "--layers", "2",
           "--requests", "3", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)          # rank 0 only prints
    assert summary["ok"] and summary["tokens_match"]
    tp = summary["tp"]
    assert tp["world"] == 2 and tp["dist_backend"] == "gloo" and tp["tokens_equal_across_ranks"]
    assert len(tp["ranks"]) == 2 and tp["token_rows_checked_across_ranks"] > 0
    assert all(r["compared_slots"] > 0 for r in tp["ranks"])
    print(f"torchrun demo --tp 2: {wall:.1f} s")


def test_head_shard_columns_partition_the_model():
    c = ModelConfig()
    shards = [HeadShard(r, 2, c.H, c.HV, c.K, c.V) for r in range(2)]
    conv = torch.cat([s.conv_channels() for s in shards])
    cols = torch.cat([s.proj_columns() for s in shards])
    assert sorted(conv.tolist()) == list(range(c.conv_dim))
    assert sorted(cols.tolist()) == list(range(c.proj_dim))
    local = shard_config(c, 2)
    assert shards[0].proj_columns().numel() == local.proj_dim
    assert shards[0].conv_channels().numel() == local.conv_dim
    with pytest.raises(TPSetupError, match="H \\(q/k heads\\) = 2 does not split over 4"):
        shard_config(c, 4)


def test_tp_one_rank_equals_the_single_process_demo():
    """``--tp 1`` (a world of one, no torchrun): the sharded path with a no-op all_reduce gives the
    single-process demo's tokens, bit for bit."""
    from recoverssm.demo.tp import init_distributed
    cfg = DemoConfig(requests=2, draft_tokens=2, steps=3, seed=2, prompt_len=(3, 5), model=TINY)
    single = run_demo(cfg)
    env = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    _loopback_env()
    try:
        init_distributed(1, "cpu")
        try:
            tpr = run_tp_demo(cfg)
        finally:
            dist.destroy_process_group()
    finally:
        os.environ.update(env)
    assert tpr.result.tokens == single.tokens
    assert tpr.result.compared_slots == single.compared_slots


def test_tp_cli_errors(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["demo", "--tp", "2", "--steps", "1"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert cli.main(["demo", "--tp", "4", "--steps", "1"]) == 2       # H = 2 does not split over 4
    assert "does not split over 4 ranks" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["demo", "--tp", "2", "--steps", "1"]) == 2
    assert "torchrun started 3 processes" in capsys.readouterr().err
