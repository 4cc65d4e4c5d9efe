"""KDA (Kimi Delta Attention): verify against flash-linear-attention's naive recurrence and gates,
commit == native decode == snapshot bit for bit (every n, fp32 and bf16 states, padding rows,
align mode), and the records kinds kept apart. Runs on ``cpu_ref`` and, under the interpreter (or
on a GPU), on the shared Triton kernel."""
from __future__ import annotations


import pytest
import torch

import recoverssm as rs

from helpers import backends, device_of, qsl_of

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def kda_problem(lens, slots, *, H=2, HV=4, K=16, V=8, num_slots=8, seed=0, state_dtype=F32, gate_form="raw",
                lower_bound=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    p = dict(q=torch.randn(T, H, K, generator=g), k=torch.randn(T, H, K, generator=g),
             v=torch.randn(T, HV, V, generator=g),
             state=(torch.randn(num_slots, HV, V, K, generator=g) * 0.3).to(state_dtype),
             state_indices=torch.tensor(slots, dtype=I32), query_start_loc=qsl_of(lens))
    if gate_form == "raw":
        p["gates"] = dict(a=torch.randn(T, HV, K, generator=g), b=torch.randn(T, HV, generator=g),
                          A_log=(torch.randn(HV, generator=g) * 0.5 - 1.0),
                          dt_bias=torch.randn(HV, K, generator=g) * 0.5, lower_bound=lower_bound)
    else:
        p["gates"] = dict(g=-torch.rand(T, HV, K, generator=g) * 2, beta=torch.rand(T, HV, generator=g))
    dims = dict(H=H, HV=HV, K=K, V=V, B=len(lens), T=T, lens=list(lens))
    move = {n: t.to(device) for n, t in p.items() if isinstance(t, torch.Tensor)}
    move["gates"] = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in p["gates"].items()}
    return move, dims


def records_for(d, window=None, device="cpu", vector_decay=True):
    return rs.ReplayRecords.allocate(d["B"], window or max(max(d["lens"]), 1), d["H"], d["HV"], d["K"], d["V"],
                                     device=device, vector_decay=vector_decay)


def prefix(p, d, ns):
    """The inputs of the first ``ns[r]`` tokens of every row."""
    qsl = p["query_start_loc"].tolist()
    keep = [min(n, d["lens"][r]) for r, n in enumerate(ns)]
    idx = torch.tensor([qsl[r] + t for r in range(d["B"]) for t in range(keep[r])], dtype=torch.long,
                       device=p["q"].device)
    gates = {n: (t[idx] if n in ("a", "b", "g", "beta") else t) for n, t in p["gates"].items()}
    return p["q"][idx], p["k"][idx], p["v"][idx], gates, qsl_of(keep).to(p["q"].device)


# ------------------------------------------------------------------------------------------------
# against flash-linear-attention's naive KDA
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_verify_matches_fla_naive_kda(backend, lower_bound, use_qk_l2norm):
    naive = pytest.importorskip("fla.ops.kda.naive")
    gate = pytest.importorskip("fla.ops.kda.gate")
    dev = device_of(backend)
    lens = [3, 4, 2]
    p, d = kda_problem(lens, [1, 4, 6], H=2, HV=4, K=16, V=12, seed=3, lower_bound=lower_bound, device=dev)
    records = records_for(d, device=dev)
    out = rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                        query_start_loc=p["query_start_loc"], records=records, use_qk_l2norm=use_qk_l2norm,
                        backend=backend, **p["gates"])
    G = p["gates"]
    for r, (slot, start) in enumerate(zip(p["state_indices"].tolist(), p["query_start_loc"].tolist())):
        sl = slice(start, start + lens[r])
        q, k = p["q"][sl].double(), p["k"][sl].double()
        if use_qk_l2norm:
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        if lower_bound is None:
            g = gate.naive_kda_gate(G["a"][sl].double(), G["A_log"].double(), G["dt_bias"].reshape(-1).double(),
                                    output_dtype=torch.float64)
        else:
            g = gate.naive_kda_lowerbound_gate(G["a"][sl].double(), G["A_log"].double(),
                                               G["dt_bias"].reshape(-1).double(), lower_bound,
                                               output_dtype=torch.float64)
        beta = torch.sigmoid(G["b"][sl].double())
        state0 = p["state"][slot].double().transpose(-1, -2)[None]          # FLA keeps [K, V]
        ref, final = naive.naive_recurrent_kda(q[None], k[None], p["v"][sl].double()[None], g[None], beta[None],
                                               initial_state=state0, output_final_state=True)
        got = out[sl].double()
        err = (got - ref[0]).norm() / ref[0].norm()
        assert err < 1e-5, f"row {r}: relative error {err:.2e}"
        # the records replay to FLA's final state
        S = p["state"][slot].double()
        for t in range(lens[r]):
            S = S * records.decay[r, :, t].double()[:, None, :]
            S = S + records.correction[r, :, t].double()[:, :, None] * records.key[
                r, torch.arange(d["HV"]) // (d["HV"] // d["H"]), t].double()[:, None, :]
        err = (S - final[0].transpose(-1, -2)).norm() / final.norm()
        assert err < 1e-5, f"row {r}: records replay to a state off by {err:.2e}"


# ------------------------------------------------------------------------------------------------
# commit == decode == snapshot, bit for bit
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("gate_form", ["raw", "pre"])
def test_commit_equals_decode_every_n(backend, state_dtype, gate_form):
    dev = device_of(backend)
    lens, slots = [4, 3, 0, 4, 2], [0, 2, 4, -1, 6]
    p, d = kda_problem(lens, slots, seed=7, state_dtype=state_dtype, gate_form=gate_form, num_slots=9, device=dev)
    records = records_for(d, window=4, device=dev)
    rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                  query_start_loc=p["query_start_loc"], records=records, backend=backend, **p["gates"])
    for n in range(0, 5):
        ns = [min(n, L) for L in lens]
        committed = p["state"].clone()
        ctx = rs.CommitContext([[rs.LayerCache(committed, records)]], max_batch=d["B"], backend=backend)
        ctx.commit(torch.tensor(ns, dtype=I32, device=dev), p["state_indices"], p["query_start_loc"])
        native = p["state"].clone()
        q, k, v, gates, qsl = prefix(p, d, ns)
        rs.kda_decode(q, k, v, state=native, state_indices=p["state_indices"], query_start_loc=qsl,
                      backend=backend, **gates)
        assert torch.equal(committed, native), f"n={n}: commit != decode"


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_snapshot_equals_decode_at_every_position(backend, state_dtype):
    dev = device_of(backend)
    lens, slots = [3, 2], [0, 1]
    p, d = kda_problem(lens, slots, seed=11, state_dtype=state_dtype, num_slots=10, device=dev)
    snaps = torch.tensor([[2, 3, 4], [5, 6, -1]], dtype=I32, device=dev)
    pool = p["state"].clone()
    rs.kda_spec_decode_snapshot(p["q"], p["k"], p["v"], state=pool, state_indices=p["state_indices"],
                                query_start_loc=p["query_start_loc"], snapshot_slots=snaps, backend=backend,
                                **p["gates"])
    for t in range(3):
        native = p["state"].clone()
        q, k, v, gates, qsl = prefix(p, d, [t + 1, t + 1])
        rs.kda_decode(q, k, v, state=native, state_indices=p["state_indices"], query_start_loc=qsl,
                      backend=backend, **gates)
        for r in range(2):
            dst = int(snaps[r, t])
            if dst >= 0 and t < lens[r]:
                assert torch.equal(pool[dst], native[int(p["state_indices"][r])]), f"row {r} position {t}"
    untouched = [s for s in range(10) if s not in (2, 3, 4, 5, 6)]
    assert torch.equal(pool[untouched], p["state"][untouched])


@pytest.mark.parametrize("backend", backends())
def test_align_mode_boundary_and_final_states(backend):
    """Align mode (prefix caching): the boundary block gets the state after the tokens that fill it,
    the final block the state after all accepted tokens, both equal to native decode."""
    dev = device_of(backend)
    lens, slots = [4, 4], [0, 1]
    p, d = kda_problem(lens, slots, seed=5, num_slots=12, device=dev)
    records = records_for(d, window=4, device=dev)
    rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                  query_start_loc=p["query_start_loc"], records=records, backend=backend, **p["gates"])
    block_table = torch.tensor([[0, 3, 4], [1, 5, 6]], dtype=I32, device=dev)
    computed = torch.tensor([2, 3], dtype=I32, device=dev)            # block size 4
    accepted = torch.tensor([3, 4], dtype=I32, device=dev)
    pool = p["state"].clone()
    ctx = rs.CommitContext([[rs.LayerCache(pool, records)]], max_batch=2, backend=backend)
    ctx.commit(accepted, p["state_indices"], p["query_start_loc"], block_table=block_table,
               num_computed_tokens=computed, block_size=4)
    plan = rs.plan_commit(accepted, p["state_indices"], p["query_start_loc"], block_table=block_table,
                          num_computed_tokens=computed, block_size=4, backend=backend)
    for r in range(2):
        for slot, n in ((int(plan.boundary_slot[r]), int(plan.boundary_len[r])),
                        (int(plan.final_slot[r]), int(plan.commit_len[r]))):
            native = p["state"].clone()
            ns = [0, 0]
            ns[r] = n
            q, k, v, gates, qsl = prefix(p, d, ns)
            rs.kda_decode(q, k, v, state=native, state_indices=p["state_indices"], query_start_loc=qsl,
                          backend=backend, **gates)
            assert torch.equal(pool[slot], native[slots[r]]), f"row {r}, slot {slot} after {n} tokens"


@pytest.mark.parametrize("backend", backends())
def test_gdn_and_kda_layers_in_one_context(backend):
    """A context holding both kinds commits each layer as its own native decode does."""
    dev = device_of(backend)
    lens, slots = [3, 2], [1, 3]
    kp, d = kda_problem(lens, slots, seed=2, device=dev)
    krec = records_for(d, device=dev)
    rs.kda_verify(kp["q"], kp["k"], kp["v"], state=kp["state"], state_indices=kp["state_indices"],
                  query_start_loc=kp["query_start_loc"], records=krec, backend=backend, **kp["gates"])
    g = torch.Generator().manual_seed(9)
    T = sum(lens)
    ggates = dict(a=torch.randn(T, d["HV"], generator=g), b=torch.randn(T, d["HV"], generator=g),
                  A_log=torch.randn(d["HV"], generator=g), dt_bias=torch.randn(d["HV"], generator=g))
    ggates = {n: t.to(dev) for n, t in ggates.items()}
    gstate = kp["state"].clone() * 0.5
    grec = records_for(d, device=dev, vector_decay=False)
    rs.gdn_verify(kp["q"], kp["k"], kp["v"], state=gstate, state_indices=kp["state_indices"],
                  query_start_loc=kp["query_start_loc"], records=grec, backend=backend, **ggates)
    kpool, gpool = kp["state"].clone(), gstate.clone()
    ctx = rs.CommitContext([[rs.LayerCache(kpool, krec), rs.LayerCache(gpool, grec)]], max_batch=2, backend=backend)
    ctx.commit(torch.tensor([2, 2], dtype=I32, device=dev), kp["state_indices"], kp["query_start_loc"])
    q, k, v, gates, qsl = prefix(kp, d, [2, 2])
    knative = kp["state"].clone()
    rs.kda_decode(q, k, v, state=knative, state_indices=kp["state_indices"], query_start_loc=qsl,
                  backend=backend, **gates)
    idx = torch.tensor([0, 1, 3, 4], device=dev)
    gnative = gstate.clone()
    rs.gdn_decode(q, k, v, state=gnative, state_indices=kp["state_indices"], query_start_loc=qsl, backend=backend,
                  a=ggates["a"][idx], b=ggates["b"][idx], A_log=ggates["A_log"], dt_bias=ggates["dt_bias"])
    assert torch.equal(kpool, knative)
    assert torch.equal(gpool, gnative)


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------
def test_records_of_the_other_kind_are_refused():
    p, d = kda_problem([2], [0])
    before = p["state"].clone()
    with pytest.raises(ValueError, match=r"^kda_verify: records hold a scalar decay \(GDN, Mamba2\)"):
        rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                      query_start_loc=p["query_start_loc"], records=records_for(d, vector_decay=False), **p["gates"])
    gdn_gates = dict(a=torch.randn(2, d["HV"]), b=torch.randn(2, d["HV"]), A_log=torch.zeros(d["HV"]),
                     dt_bias=torch.zeros(d["HV"]))
    kda_records = records_for(d)
    decay = kda_records.decay.clone()
    with pytest.raises(ValueError, match=r"^gdn_verify: records hold a vector decay \(KDA\)"):
        rs.gdn_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                      query_start_loc=p["query_start_loc"], records=kda_records, **gdn_gates)
    assert torch.equal(kda_records.decay, decay) and torch.equal(p["state"], before)


@pytest.mark.parametrize("name, bad", [
    ("a", lambda d: torch.randn(d["T"], d["HV"])),                 # GDN-shaped gate input
    ("dt_bias", lambda d: torch.randn(d["HV"])),
    ("g", None),
])
def test_kda_gate_shapes_are_checked(name, bad):
    p, d = kda_problem([2, 1], [0, 1])
    gates = dict(p["gates"])
    if name == "g":
        gates = dict(g=torch.zeros(d["T"], d["HV"]), beta=torch.zeros(d["T"], d["HV"]))
    else:
        gates[name] = bad(d)
    with pytest.raises(ValueError, match=rf"^kda_verify: {name} has shape"):
        rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                      query_start_loc=p["query_start_loc"], records=records_for(d), **gates)


def test_lower_bound_needs_raw_gates():
    p, d = kda_problem([2], [0], gate_form="pre")
    with pytest.raises(ValueError, match=r"^kda_verify: lower_bound"):
        rs.kda_verify(p["q"], p["k"], p["v"], state=p["state"], state_indices=p["state_indices"],
                      query_start_loc=p["query_start_loc"], records=records_for(d), lower_bound=-5.0, **p["gates"])
