"""Argument checks added for memory safety: overlapping or self-overlapping outputs, layers that
share memory, degenerate sizes, the conv width, errors that name the argument that disagrees
with the persistent buffers, and scalar arguments of the wrong type or range. Every case asserts
the message (op and argument) and that nothing was written."""
from __future__ import annotations

import pytest
import torch

import recoverssm as rs

I32 = torch.int32
H, HV, K, V = 2, 4, 16, 8


def snapshot_all(kw: dict) -> dict:
    out = {}
    for name, value in kw.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.clone()
        elif isinstance(value, rs.ReplayRecords):
            out[name] = [value.correction.clone(), value.key.clone(), value.decay.clone()]
    return out


def assert_nothing_written(kw: dict, before: dict) -> None:
    for name, saved in before.items():
        value = kw[name]
        now = [value.correction, value.key, value.decay] if isinstance(value, rs.ReplayRecords) else value
        if isinstance(saved, list):
            assert all(torch.equal(a, b) for a, b in zip(saved, now)), f"{name} was written"
        else:
            assert torch.equal(saved, now) or torch.equal(saved.isnan(), now.isnan()), f"{name} was written"


def verify_kwargs(T=5, K_state=K, K_q=K):
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(T, H, K_q, generator=g), k=torch.randn(T, H, K_q, generator=g),
                v=torch.randn(T, HV, V, generator=g), state=torch.randn(6, HV, V, K_state, generator=g),
                state_indices=torch.tensor([0, 2, 1], dtype=I32), query_start_loc=torch.tensor([0, 3, 3, 5], dtype=I32),
                records=rs.ReplayRecords(torch.zeros(3, HV, 4, V), torch.zeros(3, H, 4, K_state),
                                         torch.zeros(3, HV, 4)),
                g=-torch.rand(T, HV, generator=g), beta=torch.rand(T, HV, generator=g),
                out=torch.full((T, HV, V), 7.0))


def call(fn, kw):
    kw = dict(kw)
    return fn(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


# ------------------------------------------------------------------------------------------------
# overlap
# ------------------------------------------------------------------------------------------------
def _alias_out_with(name):
    def mutate(kw):
        if name == "records":
            kw["out"] = kw["records"].correction[:, :, :, :V].reshape(-1)[:5 * HV * V].view(5, HV, V)
        else:
            flat = torch.zeros(5 * HV * V)
            kw[name] = flat[:5 * HV].view(5, HV)
            kw["out"] = flat.view(5, HV, V)
    return mutate


@pytest.mark.parametrize("mutate, name, other", [
    (_alias_out_with("g"), "out", "g"),
    (_alias_out_with("beta"), "out", "beta"),
    (_alias_out_with("records"), "out", "records.correction"),
    (lambda kw: kw.update(out=torch.zeros(1, 1, V).expand(5, HV, V)), "out", "itself"),
    (lambda kw: kw.update(records=rs.ReplayRecords(kw["records"].correction, kw["records"].key,
                                                   kw["records"].correction.view(-1)[:3 * HV * 4].view(3, HV, 4))),
     "records.correction", "records.decay"),
    (lambda kw: kw.update(g=kw["records"].decay.view(-1)[:5 * HV].view(5, HV)), "records.decay", "g"),
])
def test_verify_refuses_overlapping_writes(mutate, name, other):
    kw = verify_kwargs()
    mutate(kw)
    before = snapshot_all(kw)
    with pytest.raises(ValueError, match=rf"^gdn_verify: {name} overlaps {other}"):
        call(rs.gdn_verify, kw)
    assert_nothing_written(kw, before)


def test_decode_refuses_an_output_inside_the_state():
    kw = verify_kwargs()
    del kw["records"]
    kw["out"] = kw["state"].view(-1)[:5 * HV * V].view(5, HV, V)    # the output inside the state pool
    before = snapshot_all(kw)
    with pytest.raises(ValueError, match=r"^gdn_decode: (out|state) overlaps (state|out)"):
        call(rs.gdn_decode, kw)
    assert_nothing_written(kw, before)


def test_conv_refuses_a_weight_inside_out():
    out = torch.zeros(4, 8)
    weight = out.view(-1)[:32].view(8, 4)             # the weight is a view of the output
    before = out.clone()
    with pytest.raises(ValueError, match=r"^conv_verify: out overlaps weight"):
        rs.conv_verify(torch.randn(4, 8), torch.zeros(6, 8, 3 + 4), weight, None,
                       state_indices=torch.tensor([0], dtype=I32), query_start_loc=torch.tensor([0, 4], dtype=I32),
                       out=out)
    assert torch.equal(out, before)


def commit_layer(seed=0, conv=True, num_slots=6):
    g = torch.Generator().manual_seed(seed)
    return rs.LayerCache(torch.randn(num_slots, HV, V, K, generator=g), rs.ReplayRecords.allocate(3, 4, H, HV, K, V),
                         torch.randn(num_slots, 8, 3 + 4, generator=g) if conv else None,
                         conv_width=4 if conv else None)


@pytest.mark.parametrize("make, name, other", [
    (lambda a, b: [a, a], r"groups\[0\]\[0\]\.state", r"groups\[0\]\[1\]\.state"),
    (lambda a, b: [a, rs.LayerCache(a.state, b.records)], r"groups\[0\]\[0\]\.state", r"groups\[0\]\[1\]\.state"),
    (lambda a, b: [a, rs.LayerCache(b.state, a.records)], r"groups\[0\]\[0\]\.records\.correction",
     r"groups\[0\]\[1\]\.records\.correction"),
    (lambda a, b: [a, rs.LayerCache(b.state, b.records, a.conv_state, conv_width=4)], r"groups\[0\]\[0\]\.conv_state",
     r"groups\[0\]\[1\]\.conv_state"),
])
def test_context_refuses_layers_that_share_memory(make, name, other):
    a, b = commit_layer(0), commit_layer(1)
    with pytest.raises(ValueError, match=rf"^CommitContext: {name} overlaps {other}"):
        rs.CommitContext([make(a, b)], max_batch=3)


def test_commit_refuses_an_index_tensor_inside_a_state():
    layer = commit_layer(conv=False)
    ctx = rs.CommitContext([[layer]], max_batch=3)
    slots = layer.state.view(-1)[:3].view(torch.int32)
    slots.copy_(torch.tensor([0, 1, 2], dtype=I32))
    before = layer.state.clone()
    with pytest.raises(ValueError, match=r"^CommitContext.commit: groups\[0\]\[0\]\.state overlaps state_indices"):
        ctx.commit(torch.tensor([1, 1, 1], dtype=I32), slots, torch.tensor([0, 1, 2, 3], dtype=I32))
    assert torch.equal(layer.state, before)


# ------------------------------------------------------------------------------------------------
# degenerate sizes and the conv width
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K_size", [0])
def test_empty_head_size_is_refused(K_size):
    kw = verify_kwargs(K_state=K_size, K_q=K_size)
    with pytest.raises(ValueError, match=r"^gdn_verify: state has K = 0"):
        call(rs.gdn_verify, kw)


def test_zero_heads_are_refused():
    kw = verify_kwargs()
    kw.update(q=torch.zeros(5, 0, K), k=torch.zeros(5, 0, K))
    del kw["records"]
    with pytest.raises(ValueError, match=r"^gdn_decode: q has H \(q/k heads\) = 0"):
        call(rs.gdn_decode, kw)


def test_conv_weight_without_taps_is_refused():
    with pytest.raises(ValueError, match=r"^conv_verify: weight has width \(taps\) = 0"):
        rs.conv_verify(torch.randn(2, 8), torch.zeros(4, 8, 4), torch.zeros(8, 0), None,
                       state_indices=torch.tensor([0], dtype=I32), query_start_loc=torch.tensor([0, 2], dtype=I32))


def test_conv_width_is_required_with_a_conv_state():
    layer = commit_layer()
    layer.conv_width = None
    with pytest.raises(ValueError,
                       match=r"^CommitContext: groups\[0\]\[0\]\.conv_width must be the conv kernel's width"):
        rs.CommitContext([[layer]], max_batch=3)


def test_conv_state_too_narrow_for_width_and_window_is_refused():
    layer = commit_layer()
    layer.conv_width = 5               # 4 history columns + a window of 4 > the 7 columns
    with pytest.raises(ValueError, match=r"^CommitContext: groups\[0\]\[0\]\.conv_state has 7 columns"):
        rs.CommitContext([[layer]], max_batch=3)


# ------------------------------------------------------------------------------------------------
# which argument an error names
# ------------------------------------------------------------------------------------------------
def test_head_size_mismatch_names_q_and_the_state():
    kw = verify_kwargs(K_q=8)
    with pytest.raises(ValueError,
                       match=r"^gdn_verify: q has shape \[5, 2, 8\]; expected \[5, 2, 16\] \(K = 16 from state"):
        call(rs.gdn_verify, kw)


def test_activation_of_the_wrong_type_is_named():
    with pytest.raises(ValueError, match=r"^conv_verify: activation must be 'silu' or None, got \['silu'\]"):
        rs.conv_verify(torch.randn(2, 8), torch.zeros(4, 8, 5), torch.zeros(8, 4), None, activation=["silu"],
                       state_indices=torch.tensor([0], dtype=I32), query_start_loc=torch.tensor([0, 2], dtype=I32))


@pytest.mark.parametrize("null_slot", [2**31, -2**31 - 1])
def test_null_slot_outside_int32_is_refused(null_slot):
    kw = verify_kwargs()
    kw["null_slot"] = null_slot
    before = snapshot_all(kw)
    with pytest.raises(ValueError, match=r"^gdn_verify: null_slot must be"):
        call(rs.gdn_verify, kw)
    assert_nothing_written(kw, before)


def test_block_size_outside_int32_is_refused():
    with pytest.raises(ValueError, match=r"^plan_commit: block_size must be in \[1, 2147483647\]"):
        rs.plan_commit(torch.tensor([1], dtype=I32), torch.tensor([0], dtype=I32), torch.tensor([0, 1], dtype=I32),
                       block_table=torch.zeros(1, 1, dtype=I32), num_computed_tokens=torch.zeros(1, dtype=I32),
                       block_size=2**31)


def test_num_accepted_outside_the_window_is_refused():
    layer = commit_layer(conv=False)
    ctx = rs.CommitContext([[layer]], max_batch=3)
    before = layer.state.clone()
    with pytest.raises(ValueError, match=r"^CommitContext.commit: num_accepted entry 1 = 3 is outside \[0, 2\]"):
        ctx.commit(torch.tensor([1, 3, 0], dtype=I32), torch.tensor([0, 1, -1], dtype=I32),
                   torch.tensor([0, 1, 3, 3], dtype=I32))
    assert torch.equal(layer.state, before)


def test_final_block_past_the_table_is_refused():
    with pytest.raises(ValueError, match=r"^plan_commit: block_table has 2 columns; batch row 0"):
        rs.plan_commit(torch.tensor([3], dtype=I32), torch.tensor([0], dtype=I32), torch.tensor([0, 3], dtype=I32),
                       block_table=torch.tensor([[0, 1]], dtype=I32), num_computed_tokens=torch.tensor([7], dtype=I32),
                       block_size=4)
