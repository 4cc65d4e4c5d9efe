"""Mamba2: verify against a float64 reference and transformers' own Mamba2 functions, verify +
commit of every accepted count == one-token decode steps == the snapshot of that position, bit for
bit (fp32 and bf16 states, padding rows, grouped B/C), and the argument checks. Runs on
``cpu_ref`` and, under the interpreter (or on a GPU), on the shared Triton kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recoverssm as rs

from helpers import backends, device_of, qsl_of

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def mamba2_problem(lens, slots, *, G=2, HV=4, K=16, V=8, num_slots=10, seed=0, state_dtype=F32, act_dtype=F32,
                   D="head", z=False, dt_limit=None, A_given=False, device="cpu"):
    """Inputs of one Mamba2 call: ``G`` groups of ``B``/``C`` (``K`` = dstate), ``HV`` heads of
    ``V`` = headdim channels; gates drawn so that decays spread over (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rand(*shape, dtype=act_dtype):
        return torch.randn(*shape, generator=g).to(dtype).to(device)
    A_log = (torch.randn(HV, generator=g) * 0.5).to(device)
    p = dict(x=rand(T, HV, V), B=rand(T, G, K), C=rand(T, G, K), dt=rand(T, HV),
             state=(torch.randn(num_slots, HV, V, K, generator=g) * 0.5).to(state_dtype).to(device),
             state_indices=torch.tensor(slots, dtype=I32, device=device),
             query_start_loc=qsl_of(lens).to(device))
    kw = dict(dt_bias=(torch.randn(HV, generator=g) * 0.5 - 1.0).to(device), dt_limit=dt_limit,
              D={"head": rand(HV, dtype=F32), "channel": rand(HV, V, dtype=F32), None: None}[D],
              z=rand(T, HV, V) if z else None)
    kw.update(A=-torch.exp(A_log)) if A_given else kw.update(A_log=A_log)
    return p, kw


def reference(p, kw, lens):
    """Section "Mamba2" of docs/API.md in float64, one row and token at a time: outputs and final
    states by row."""
    HV, G = p["x"].shape[1], p["B"].shape[1]
    A = kw["A"].double() if "A" in kw else -torch.exp(kw["A_log"].double())
    lo, hi = kw["dt_limit"] or (None, None)
    group = torch.arange(HV) // (HV // G)
    outs, finals = [], []
    start = 0
    for r, n in enumerate(lens):
        S = p["state"][p["state_indices"][r]].double().cpu()
        for t in range(start, start + n):
            dt = F.softplus(p["dt"][t].double().cpu() + kw["dt_bias"].double().cpu())
            if kw["dt_limit"] is not None:
                dt = dt.clamp(min=lo, max=hi)
            x, B, C = (p[n_][t].double().cpu() for n_ in ("x", "B", "C"))
            S = S * torch.exp(dt * A.cpu())[:, None, None] + (dt[:, None] * x)[:, :, None] * B[group][:, None, :]
            y = (S * C[group][:, None, :]).sum(-1)
            if kw["D"] is not None:
                D = kw["D"].double().cpu()
                y = y + (D[:, None] if D.dim() == 1 else D) * x
            if kw["z"] is not None:
                y = y * F.silu(kw["z"][t].double().cpu())
            outs.append(y)
        finals.append(S)
        start += n
    return torch.stack(outs), finals


def records_for(p, lens, window=None):
    T, G, K = p["B"].shape
    _, HV, V = p["x"].shape
    return rs.ReplayRecords.allocate(len(lens), window or max(lens), G, HV, K, V, device=p["x"].device)


def call(fn, p, **extra):
    return fn(p["x"], p["B"], p["C"], p["dt"], state=p["state"], state_indices=p["state_indices"],
              query_start_loc=p["query_start_loc"], **extra)


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("D, z, dt_limit, A_given", [
    ("head", False, None, False),
    ("channel", True, (0.05, 0.5), False),
    (None, True, (0.001, None), True),
    ("head", False, (None, 0.3), True),
])
def test_verify_and_decode_match_float64(backend, D, z, dt_limit, A_given):
    dev = device_of(backend)
    lens = [3, 1, 4]
    p, kw = mamba2_problem(lens, [1, 4, 6], G=2, HV=4, K=16, V=12, seed=3, D=D, z=z, dt_limit=dt_limit,
                           A_given=A_given, device=dev)
    ref_out, ref_states = reference(p, kw, lens)
    out = call(rs.mamba2_verify, p, records=records_for(p, lens), backend=backend, **kw)
    scale = ref_out.abs().max()
    assert (out.double().cpu() - ref_out).abs().max() <= 1e-5 * scale
    call(rs.mamba2_decode, p, backend=backend, **kw)
    for r, S in enumerate(ref_states):
        got = p["state"][p["state_indices"][r]].double().cpu()
        assert (got - S).abs().max() <= 1e-5 * S.abs().max()


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("seed, dims", [(0, dict(G=1, HV=4, K=16, V=8)), (1, dict(G=1, HV=4, K=16, V=8)),
                                        (2, dict(G=2, HV=4, K=128, V=64))], ids=["small0", "small1", "headdim64"])
def test_commit_of_every_count_equals_one_token_decode_steps(backend, state_dtype, seed, dims):
    """verify + commit of n == n one-token decode calls == the snapshot of position n - 1, bit for
    bit, for random windows and accepted counts, a padding row, heads sharing a group; small heads,
    and the headdim (64) and dstate (128) of Nemotron-H's layers, which have launch specs of their
    own on some backends."""
    dev = device_of(backend)
    gen = torch.Generator().manual_seed(100 + seed)
    lens = [int(n) for n in torch.randint(1, 6, (4,), generator=gen)]
    slots = [2, -1, 7, 5]
    p, kw = mamba2_problem(lens, slots, **dims, seed=seed, state_dtype=state_dtype,
                           act_dtype=BF16, z=True, dt_limit=(0.001, None), device=dev)
    accepted = [int(torch.randint(0, n + 1, (), generator=gen)) for n in lens]
    before = p["state"].clone()
    records = records_for(p, lens)
    out = call(rs.mamba2_verify, p, records=records, backend=backend, **kw)
    assert torch.equal(p["state"], before)                       # verify reads the state only
    ctx = rs.CommitContext([[rs.LayerCache(p["state"], records)]], max_batch=len(lens), backend=backend)
    ctx.commit(torch.tensor(accepted, dtype=I32, device=dev), p["state_indices"], p["query_start_loc"])

    stepped = before.clone()
    starts = p["query_start_loc"].tolist()
    one = torch.tensor([0, 1], dtype=I32, device=dev)
    for r, (slot, n) in enumerate(zip(slots, accepted)):
        for t in range(starts[r], starts[r] + (n if slot >= 0 else 0)):
            y = rs.mamba2_decode(p["x"][t:t + 1], p["B"][t:t + 1], p["C"][t:t + 1], p["dt"][t:t + 1], state=stepped,
                                 state_indices=p["state_indices"][r:r + 1], query_start_loc=one,
                                 backend=backend, **{**kw, "z": kw["z"][t:t + 1]})
            assert torch.equal(y[0], out[t])                     # verify's output, bit for bit
    assert torch.equal(p["state"], stepped)
    assert not out[starts[1]:starts[2]].any()                    # the padding row's outputs: zeros

    snap = before.clone()
    table = torch.full((len(lens), max(lens)), -1, dtype=I32)     # position n - 1 of each row, to a free slot
    spots = iter(s for s in range(snap.shape[0]) if s not in slots)
    for r in range(len(lens)):
        if slots[r] >= 0 and accepted[r] > 0:
            table[r, accepted[r] - 1] = next(spots)
    call(rs.mamba2_spec_decode_snapshot, {**p, "state": snap}, snapshot_slots=table.to(dev), backend=backend, **kw)
    for r in range(len(lens)):
        if slots[r] >= 0 and accepted[r] > 0:
            assert torch.equal(snap[int(table[r, accepted[r] - 1])], stepped[slots[r]])


# ------------------------------------------------------------------------------------------------
# against transformers' Mamba2 functions (the torch paths of its Mamba2Mixer)
# ------------------------------------------------------------------------------------------------
def test_decode_matches_transformers_selective_state_update():
    """transformers' one-token update (the decode path of every Mamba2 mixer) over a few tokens,
    fp32: states and outputs within fp32 rounding (it rounds ``dt * B`` first, then ``* x``)."""
    m = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    lens = [5, 5]
    p, kw = mamba2_problem(lens, [0, 3], G=2, HV=4, K=16, V=8, seed=7)
    hf_state = p["state"][p["state_indices"].long()].clone()
    P, N = 8, 16
    A = -torch.exp(kw["A_log"])
    hf_out = []
    for t in range(5):
        toks = [t, 5 + t]
        x = p["x"][toks]
        hf_out.append(m.mamba2_selective_state_update(
            hf_state, x, p["dt"][toks][:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
            p["B"][toks], p["C"][toks], D=kw["D"][:, None].expand(-1, P),
            dt_bias=kw["dt_bias"][:, None].expand(-1, P), dt_softplus=True))
    out = call(rs.mamba2_decode, p, backend="cpu_ref", **kw)
    for r in range(2):
        assert torch.allclose(p["state"][p["state_indices"][r]], hf_state[r], rtol=1e-5, atol=1e-5)
        got = out[5 * r:5 * r + 5]
        want = torch.stack([o[r] for o in hf_out])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())


def test_verify_matches_transformers_chunk_scan():
    """transformers' chunked prefill scan (with ``dt_limit``, as NemotronH's mixer clamps): the
    outputs of a window and the final state, fp32."""
    m = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    lens = [6]
    p, kw = mamba2_problem(lens, [2], G=2, HV=4, K=16, V=8, seed=9, dt_limit=(0.05, float("inf")))
    initial = p["state"][2:3].clone()
    y, final = m.mamba2_chunk_scan(p["x"][None], p["dt"][None], -torch.exp(kw["A_log"]), p["B"][None],
                                   p["C"][None], chunk_size=4, D=kw["D"], dt_bias=kw["dt_bias"],
                                   initial_states=initial, dt_softplus=True, dt_limit=(0.05, float("inf")),
                                   return_final_states=True)
    out = call(rs.mamba2_decode, p, backend="cpu_ref", **kw)
    assert torch.allclose(out, y[0], rtol=1e-4, atol=1e-5 * y.abs().max())
    assert torch.allclose(p["state"][2], final[0], rtol=1e-4, atol=1e-5 * final.abs().max())


# ------------------------------------------------------------------------------------------------
# argument checks (named, before anything is written)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda p, kw: kw.update(dt_bias=None), "dt_bias is missing"),
    (lambda p, kw: kw.update(A=-torch.exp(kw["A_log"])), "A_log and A: pass exactly one"),
    (lambda p, kw: kw.update(A_log=None), "A_log and A: pass exactly one"),
    (lambda p, kw: kw.update(D=torch.ones(3)), r"D must be \[nheads\] = \[4\] or \[nheads, headdim\]"),
    (lambda p, kw: kw.update(z=torch.ones(2, 4, 8)), "z has shape"),
    (lambda p, kw: kw.update(dt_limit=(0.5, 0.1)), r"dt_min \(0.5\) is greater than dt_max"),
    (lambda p, kw: kw.update(dt_limit=0.5), "dt_limit must be a"),
    (lambda p, kw: p.update(B=p["B"][:, :1].contiguous()), "B has shape"),
    (lambda p, kw: p.update(B=torch.randn(8, 3, 16), C=torch.randn(8, 3, 16)), "C has shape"),
    (lambda p, kw: p.update(dt=p["dt"][:, :2].contiguous()), "dt has shape"),
    (lambda p, kw: p.update(x=p["x"][:, :, :4].contiguous()), "x has shape"),
])
def test_bad_arguments_are_named_and_nothing_is_written(change, message):
    p, kw = mamba2_problem([3, 5], [1, 2], G=2, HV=4, K=16, V=8, z=True)
    change(p, kw)
    records = rs.ReplayRecords.allocate(2, 5, 2, 4, 16, 8)
    before = (p["state"].clone(), records.correction.clone())
    with pytest.raises((ValueError, TypeError), match=message):
        call(rs.mamba2_verify, p, records=records, backend="cpu_ref", **kw)
    assert torch.equal(p["state"], before[0]) and torch.equal(records.correction, before[1])


def test_groups_must_divide_heads():
    p, kw = mamba2_problem([3, 5], [1, 2], G=2, HV=4, K=16, V=8)
    p.update(B=torch.randn(8, 3, 16), C=torch.randn(8, 3, 16))
    with pytest.raises(ValueError, match="C has 3 groups; the state's 4 heads are not a multiple of it"):
        call(rs.mamba2_decode, p, backend="cpu_ref", **kw)


def test_custom_op_schema_names_the_mamba2_inputs():
    schema = str(torch.ops.recoverssm.mamba2_verify.default._schema)
    assert schema.startswith("recoverssm::mamba2_verify(Tensor C, Tensor B, Tensor x, Tensor state")
    for name in ("Tensor? dt", "Tensor? dt_bias", "Tensor? A_log", "Tensor? A", "Tensor? D", "Tensor? z",
                 "float? dt_min", "float? dt_max"):
        assert name in schema
    assert "scale" not in schema and "use_qk_l2norm" not in schema


def test_verify_matches_transformers_mamba2_mixer():
    """transformers' ``Mamba2Mixer`` (fp32, random weights, a ``time_step_limit``) over a prompt:
    the SSM output it hands its gated norm equals ``mamba2_verify`` on the inputs it computed
    (``x``, ``B``, ``C`` views of its conv output, its raw ``dt``, its ``A_log``, ``dt_bias``,
    ``D``), from a zero state, within fp32 rounding."""
    pytest.importorskip("transformers")
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    H, P, N, G, T = 8, 16, 16, 2, 7
    cfg = Mamba2Config(hidden_size=64, num_heads=H, head_dim=P, state_size=N, n_groups=G, num_hidden_layers=1,
                       vocab_size=100, chunk_size=4, time_step_limit=(0.01, 0.5))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(H) * 0.5)
        mixer.dt_bias.copy_(torch.randn(H) * 0.5 - 1.0)
        mixer.D.copy_(torch.randn(H))
    seen = {}
    mixer.norm.register_forward_pre_hook(lambda m, args: seen.update(y=args[0].detach()))
    hs = torch.randn(1, T, 64)
    with torch.no_grad():
        mixer(hs)
        z_xbc_dt = mixer.in_proj(hs)[0]
        _, xbc, dt = z_xbc_dt.split([H * P, mixer.conv_dim, H], dim=-1)
        w = mixer.conv1d.weight[:, 0]                                             # [conv_dim, width]
        padded = F.pad(xbc.T, (w.shape[1] - 1, 0))
        y_conv = F.silu(F.conv1d(padded[None], w[:, None], mixer.conv1d.bias, groups=mixer.conv_dim)[0].T).contiguous()
        x, B, C = y_conv.split([H * P, G * N, G * N], dim=-1)
        state = torch.zeros(1, H, P, N)
        out = rs.mamba2_verify(x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N)), dt,
                               state=state, state_indices=torch.tensor([0], dtype=I32),
                               query_start_loc=torch.tensor([0, T], dtype=I32),
                               records=rs.ReplayRecords.allocate(1, T, G, H, N, P), dt_bias=mixer.dt_bias,
                               A_log=mixer.A_log, D=mixer.D, dt_limit=cfg.time_step_limit, backend="cpu_ref")
    want = seen["y"][0].view(T, H, P)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5 * want.abs().max())
