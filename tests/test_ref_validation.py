"""Bad inputs: one case per validation rule. Each asserts the exception type, that the message
starts with the op and names the argument (``"<op>: <name> ..."``), and that no tensor changed."""

import pytest
import torch

import recoverssm as rs
from helpers import (BF16, assert_unchanged, clone_all, i32, make_problem)

META = torch.device("meta")
NUM_SLOTS = 6


def on_meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


def records_like(mb, T, H=2, HV=4, K=16, V=16, **kw):
    return rs.ReplayRecords.allocate(mb, T, H, HV, K, V, **kw)


# ------------------------------------------------------------------------------------------------
# valid base calls; every case mutates one thing
# ------------------------------------------------------------------------------------------------
def gdn_base(gate_form="raw"):
    p = make_problem([3, 0, 2], [0, 2, 1], num_slots=NUM_SLOTS, gate_form=gate_form)
    kw = dict(q=p.q, k=p.k, v=p.v, state=p.state, state_indices=p.state_indices,
              query_start_loc=p.qsl, records=p.records(max_window=4), out=torch.full_like(p.v, 9.0))
    kw.update(p.gates)
    return kw


def gdn_pre_base():
    return gdn_base("pre")


def decode_base():
    kw = gdn_base()
    del kw["records"]
    return kw


def snapshot_base():
    kw = decode_base()
    kw["snapshot_slots"] = torch.tensor([[3, 4, 5, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    kw["state_indices"] = i32([0, 2, 1])
    return kw


def _split(kw, pos):
    kw = dict(kw)
    return [kw.pop(n) for n in pos], kw


def call_verify(kw):
    args, rest = _split(kw, ("q", "k", "v"))
    return rs.gdn_verify(*args, **rest)


def call_decode(kw):
    args, rest = _split(kw, ("q", "k", "v"))
    return rs.gdn_decode(*args, **rest)


def call_snapshot(kw):
    args, rest = _split(kw, ("q", "k", "v"))
    return rs.gdn_spec_decode_snapshot(*args, **rest)


def conv_base():
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(5, 8, generator=g), conv_state=torch.randn(NUM_SLOTS, 8, 3 + 4, generator=g),
                weight=torch.randn(8, 4, generator=g), bias=torch.randn(8, generator=g),
                state_indices=i32([0, 2, 1]), query_start_loc=i32([0, 3, 3, 5]),
                out=torch.full((5, 8), 9.0))


def call_conv(kw):
    args, rest = _split(kw, ("x", "conv_state", "weight", "bias"))
    return rs.conv_verify(*args, **rest)


def plan_base():
    return dict(num_accepted=i32([2, 0, 2]), state_indices=i32([0, 2, 1]), query_start_loc=i32([0, 3, 3, 5]))


def plan_align_base():
    kw = plan_base()
    # rows' sources 0, 2, 1; blocks of 4; row 0: tokens 3,4 -> final 3, boundary 0 (its source);
    # row 1: no tokens; row 2: tokens 3,4 -> final 4, boundary 1 (its source)
    kw.update(block_table=torch.tensor([[0, 3], [2, 5], [1, 4]], dtype=torch.int32),
              num_computed_tokens=i32([3, 1, 3]), block_size=4)
    return kw


def call_plan(kw):
    args, rest = _split(kw, ("num_accepted", "state_indices", "query_start_loc"))
    return rs.plan_commit(*args, **rest)


def commit_base(align=False, conv=True):
    """A CommitContext over one layer; the kwargs of one commit."""
    p = make_problem([3, 0, 2], [0, 2, 1], num_slots=NUM_SLOTS)
    records = p.records(max_window=4)
    rs.gdn_verify(p.q, p.k, p.v, records=records, **p.call_kwargs())
    conv_state = torch.randn(NUM_SLOTS, 8, 3 + 4) if conv else None
    kw = dict(layer=rs.LayerCache(p.state, records, conv_state=conv_state, conv_width=4 if conv else None),
              max_batch=3, num_accepted=i32([2, 0, 2]), state_indices=p.state_indices, query_start_loc=p.qsl)
    if align:
        kw.update(block_table=torch.tensor([[0, 3], [2, 5], [1, 4]], dtype=torch.int32),
                  num_computed_tokens=i32([3, 1, 3]), block_size=4)     # as in plan_align_base
    return kw


def commit_align_base():
    return commit_base(align=True)


def call_commit(kw):
    kw = dict(kw)
    layer, mb = kw.pop("layer"), kw.pop("max_batch")
    layers = kw.pop("layers", [[layer]])
    ctx = rs.CommitContext(layers, max_batch=mb)
    args, rest = _split(kw, ("num_accepted", "state_indices", "query_start_loc"))
    return ctx.commit(*args, **rest)


def two_group_base():
    """Two groups; group 1's pool has 4 slots, group 0's 6."""
    kw = commit_base(conv=False)
    p1 = make_problem([3, 0, 2], [3, 0, 1], num_slots=4, seed=3)
    rec1 = p1.records(max_window=4)
    rs.gdn_verify(p1.q, p1.k, p1.v, records=rec1, **p1.call_kwargs())
    kw["layer1"] = rs.LayerCache(p1.state, rec1)
    kw["layers"] = [[kw["layer"]], [kw["layer1"]]]
    kw["state_indices"] = [kw["state_indices"], p1.state_indices]
    return kw


def call_two_groups(kw):
    kw = dict(kw)
    kw.pop("layer1")
    return call_commit(kw)


def context_base():
    p = make_problem([3, 0, 2], [0, 2, 1], num_slots=NUM_SLOTS)
    p2 = make_problem([3, 0, 2], [0, 2, 1], num_slots=NUM_SLOTS, seed=2)
    return dict(groups=[[rs.LayerCache(p.state, p.records(max_window=4), conv_state=torch.zeros(NUM_SLOTS, 8, 7),
                                      conv_width=4)],
                        [rs.LayerCache(p2.state, p2.records(max_window=4))]], max_batch=3)


def call_context(kw):
    return rs.CommitContext(kw["groups"], max_batch=kw["max_batch"])


BASES = {
    "gdn_verify": (gdn_base, call_verify),
    "gdn_verify(pre)": (gdn_pre_base, call_verify),
    "gdn_decode": (decode_base, call_decode),
    "gdn_spec_decode_snapshot": (snapshot_base, call_snapshot),
    "conv_verify": (conv_base, call_conv),
    "plan_commit": (plan_base, call_plan),
    "plan_commit(align)": (plan_align_base, call_plan),
    "CommitContext.commit": (commit_base, call_commit),
    "CommitContext.commit(align)": (commit_align_base, call_commit),
    "CommitContext.commit(groups)": (two_group_base, call_two_groups),
    "CommitContext": (context_base, call_context),
}


# ------------------------------------------------------------------------------------------------
# mutations
# ------------------------------------------------------------------------------------------------
def setk(key, fn):
    def mutate(kw):
        kw[key] = fn(kw)
    return mutate


def drop(key):
    def mutate(kw):
        kw[key] = None
    return mutate


def strided_last(t):
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    v = big[..., ::2]
    v.copy_(t)
    return v


def recs(fn):
    """Replace the records with one built by ``fn(records)``."""
    return setk("records", lambda kw: fn(kw["records"]))


def layer_mut(fn):
    return setk("layer", lambda kw: fn(kw["layer"]))


def group0_mut(fn):
    def mutate(kw):
        kw["groups"][0][0] = fn(kw["groups"][0][0])
    return mutate


TE, VE = TypeError, ValueError

GDN_CASES = [
    # (id, mutation, exception, argument named)
    ("q float64", setk("q", lambda kw: kw["q"].double()), TE, "q"),
    ("q int", setk("q", lambda kw: kw["q"].int()), TE, "q"),
    ("q not a tensor", setk("q", lambda kw: kw["q"].tolist()), TE, "q"),
    ("q 2 dims", setk("q", lambda kw: kw["q"].reshape(kw["q"].shape[0], -1)), VE, "q"),
    ("q last dim strided", setk("q", lambda kw: strided_last(kw["q"])), VE, "q"),
    ("k dtype differs from q", setk("k", lambda kw: kw["k"].to(BF16)), TE, "k"),
    ("k wrong K", setk("k", lambda kw: kw["k"][..., :8].contiguous()), VE, "k"),
    ("k wrong H", setk("k", lambda kw: kw["k"][:, :1].contiguous()), VE, "k"),
    ("k last dim strided", setk("k", lambda kw: strided_last(kw["k"])), VE, "k"),
    ("v dtype differs", setk("v", lambda kw: kw["v"].to(BF16)), TE, "v"),
    ("v wrong token count", setk("v", lambda kw: kw["v"][:-1].contiguous()), VE, "v"),
    ("v heads not multiple of H", setk("v", lambda kw: kw["v"][:, :3].contiguous()), VE, "v"),
    ("v last dim strided", setk("v", lambda kw: strided_last(kw["v"])), VE, "v"),
    ("k on another device", setk("k", lambda kw: on_meta(kw["k"])), VE, "k"),
    ("state float16", setk("state", lambda kw: kw["state"].half()), TE, "state"),
    ("state wrong V", setk("state", lambda kw: kw["state"][:, :, :8].contiguous()), VE, "state"),
    ("state wrong HV", setk("state", lambda kw: kw["state"][:, :2].contiguous()), VE, "state"),
    ("state 3 dims", setk("state", lambda kw: kw["state"][0].contiguous()), VE, "state"),
    ("state last dim strided", setk("state", lambda kw: strided_last(kw["state"])), VE, "state"),
    ("state on another device", setk("state", lambda kw: on_meta(kw["state"])), VE, "state"),
    ("state_indices int64", setk("state_indices", lambda kw: kw["state_indices"].long()), TE, "state_indices"),
    ("state_indices 2 dims", setk("state_indices", lambda kw: kw["state_indices"][None]), VE, "state_indices"),
    ("state_indices strided", setk("state_indices", lambda kw: strided_last(kw["state_indices"])), VE, "state_indices"),
    ("slot out of range", setk("state_indices", lambda kw: i32([0, 2, NUM_SLOTS])), VE, "state_indices"),
    ("slot out of range with check=False (CPU always checks)",
     lambda kw: kw.update(check=False, state_indices=i32([0, 2, NUM_SLOTS])), VE, "state_indices"),
    ("query_start_loc wrong length", setk("query_start_loc", lambda kw: i32([0, 3, 5])), VE, "query_start_loc"),
    ("query_start_loc int64", setk("query_start_loc", lambda kw: kw["query_start_loc"].long()), TE, "query_start_loc"),
    ("query_start_loc decreasing", setk("query_start_loc", lambda kw: i32([0, 3, 2, 5])), VE, "query_start_loc"),
    ("query_start_loc negative start", setk("query_start_loc", lambda kw: i32([-1, 3, 3, 5])), VE, "query_start_loc"),
    ("query_start_loc past the tokens", setk("query_start_loc", lambda kw: i32([0, 3, 3, 6])), VE, "query_start_loc"),
    ("a missing", drop("a"), VE, "a"),
    ("b missing", drop("b"), VE, "b"),
    ("A_log missing", drop("A_log"), VE, "A_log"),
    ("dt_bias missing", drop("dt_bias"), VE, "dt_bias"),
    ("both gate forms", setk("g", lambda kw: torch.zeros_like(kw["a"])), VE, "g"),
    ("A_log bf16", setk("A_log", lambda kw: kw["A_log"].to(BF16)), TE, "A_log"),
    ("A_log wrong shape", setk("A_log", lambda kw: kw["A_log"][:2].contiguous()), VE, "A_log"),
    ("dt_bias wrong shape", setk("dt_bias", lambda kw: kw["dt_bias"][None]), VE, "dt_bias"),
    ("dt_bias strided", setk("dt_bias", lambda kw: strided_last(kw["dt_bias"])), VE, "dt_bias"),
    ("a wrong shape", setk("a", lambda kw: kw["a"][:, :2].contiguous()), VE, "a"),
    ("a int", setk("a", lambda kw: kw["a"].int()), TE, "a"),
    ("a last dim strided", setk("a", lambda kw: strided_last(kw["a"])), VE, "a"),
    ("b wrong token count", setk("b", lambda kw: kw["b"][:-1].contiguous()), VE, "b"),
    ("a on another device", setk("a", lambda kw: on_meta(kw["a"])), VE, "a"),
    ("scale a string", setk("scale", lambda kw: "0.25"), TE, "scale"),
    ("scale a bool", setk("scale", lambda kw: True), TE, "scale"),
    ("null_slot a float", setk("null_slot", lambda kw: -1.0), TE, "null_slot"),
    ("out wrong shape", setk("out", lambda kw: kw["out"][:, :, :8].contiguous()), VE, "out"),
    ("out int", setk("out", lambda kw: kw["out"].int()), TE, "out"),
    ("out last dim strided", setk("out", lambda kw: strided_last(kw["out"])), VE, "out"),
    ("out is v", setk("out", lambda kw: kw["v"]), VE, "out"),
    ("out overlaps the state", setk("out", lambda kw: kw["state"].view(-1)[:kw["v"].numel()].view(kw["v"].shape)),
     VE, "out"),
    ("out on another device", setk("out", lambda kw: on_meta(kw["out"])), VE, "out"),
]

PRE_CASES = [
    ("beta missing", drop("beta"), VE, "beta"),
    ("g missing", drop("g"), VE, "g"),
    ("both gate forms", setk("a", lambda kw: torch.zeros_like(kw["g"])), VE, "g"),
    ("g wrong shape", setk("g", lambda kw: kw["g"][:, :3].contiguous()), VE, "g"),
    ("beta int", setk("beta", lambda kw: kw["beta"].int()), TE, "beta"),
    ("g last dim strided", setk("g", lambda kw: strided_last(kw["g"])), VE, "g"),
]

VERIFY_CASES = [
    ("records not ReplayRecords", recs(lambda r: (r.correction, r.key, r.decay)), TE, "records"),
    ("records too few rows", recs(lambda r: records_like(2, 4)), VE, "records"),
    ("row longer than the records window", recs(lambda r: records_like(3, 2)), VE, "query_start_loc"),
    ("records vector decay", recs(lambda r: records_like(3, 4, vector_decay=True)), VE, "records"),
    # the per-step q against the records' H; the state against the records' sizes (both named)
    ("records wrong H", recs(lambda r: records_like(3, 4, H=1)), VE, "q"),
    ("records wrong V", recs(lambda r: records_like(3, 4, V=8)), VE, "state"),
    ("records bf16", recs(lambda r: rs.ReplayRecords(r.correction.to(BF16), r.key, r.decay)), TE, "records.correction"),
    ("records strided", recs(lambda r: rs.ReplayRecords(r.correction, r.key, strided_last(r.decay))),
     VE, "records.decay"),
    ("records on another device", recs(lambda r: rs.ReplayRecords(on_meta(r.correction), r.key, r.decay)),
     VE, "records.correction"),
    # hand-built records with a field of the wrong rank or not a tensor
    ("records correction 2 dims", recs(lambda r: rs.ReplayRecords(r.correction[0, 0], r.key, r.decay)),
     VE, "records.correction"),
    ("records key 3 dims", recs(lambda r: rs.ReplayRecords(r.correction, r.key[0], r.decay)), VE, "records.key"),
    ("records decay not a tensor", recs(lambda r: rs.ReplayRecords(r.correction, r.key, None)), TE, "records.decay"),
    ("records key not a tensor", recs(lambda r: rs.ReplayRecords(r.correction, None, r.decay)), TE, "records.key"),
]

DECODE_CASES = [
    ("duplicate destination slots", setk("state_indices", lambda kw: i32([1, 2, 1])), VE, "state_indices"),
    ("slot out of range", setk("state_indices", lambda kw: i32([0, 2, 7])), VE, "state_indices"),
    ("query_start_loc decreasing", setk("query_start_loc", lambda kw: i32([0, 3, 2, 5])), VE, "query_start_loc"),
    ("q float64", setk("q", lambda kw: kw["q"].double()), TE, "q"),
    ("b missing", drop("b"), VE, "b"),
]

SNAPSHOT_CASES = [
    ("snapshot_slots int64", setk("snapshot_slots", lambda kw: kw["snapshot_slots"].long()), TE, "snapshot_slots"),
    ("snapshot_slots wrong rows", setk("snapshot_slots", lambda kw: kw["snapshot_slots"][:2].contiguous()),
     VE, "snapshot_slots"),
    ("snapshot_slots not contiguous", setk("snapshot_slots", lambda kw: kw["snapshot_slots"].t().contiguous().t()),
     VE, "snapshot_slots"),
    ("snapshot slot out of range", setk("snapshot_slots", lambda kw: torch.tensor(
        [[3, 4, NUM_SLOTS, -1], [-1] * 4, [-1] * 4], dtype=torch.int32)), VE, "snapshot_slots"),
    ("snapshot slots duplicated", setk("snapshot_slots", lambda kw: torch.tensor(
        [[3, 4, 5, -1], [-1] * 4, [4, -1, -1, -1]], dtype=torch.int32)), VE, "snapshot_slots"),
    ("snapshot slot is another row's source", setk("snapshot_slots", lambda kw: torch.tensor(
        [[3, 1, 5, -1], [-1] * 4, [-1] * 4], dtype=torch.int32)), VE, "snapshot_slots"),
    # rows 0 and 2 read one slot; row 2 snapshots into it (its own source) while row 0 reads it
    ("snapshot slot is a shared source", lambda kw: kw.update(
        state_indices=i32([1, 2, 1]), snapshot_slots=torch.tensor([[3, 4, 5, -1], [-1] * 4, [1, -1, -1, -1]],
                                                                  dtype=torch.int32)), VE, "snapshot_slots"),
    ("row longer than the snapshot window", setk("snapshot_slots", lambda kw: torch.tensor(
        [[3, 4], [-1, -1], [-1, -1]], dtype=torch.int32)), VE, "query_start_loc"),
    ("source slot out of range", setk("state_indices", lambda kw: i32([0, 2, -1 + NUM_SLOTS + 1])),
     VE, "state_indices"),
]

CONV_CASES = [
    ("x int", setk("x", lambda kw: kw["x"].int()), TE, "x"),
    ("x not a tensor", setk("x", lambda kw: None), TE, "x"),
    ("x 3 dims", setk("x", lambda kw: kw["x"][None]), VE, "x"),
    ("x last dim strided", setk("x", lambda kw: strided_last(kw["x"])), VE, "x"),
    ("weight channels", setk("weight", lambda kw: kw["weight"][:4].contiguous()), VE, "weight"),
    ("weight int", setk("weight", lambda kw: kw["weight"].int()), TE, "weight"),
    ("weight on another device", setk("weight", lambda kw: on_meta(kw["weight"])), VE, "weight"),
    # conv_dim comes from the conv state; the weight that disagrees is named, with where it came from
    ("conv_state channels", setk("conv_state", lambda kw: kw["conv_state"][:, :4].contiguous()), VE, "weight"),
    ("conv_state no window room", setk("conv_state", lambda kw: kw["conv_state"][:, :, :3].contiguous()),
     VE, "conv_state"),
    ("conv_state 2 dims", setk("conv_state", lambda kw: kw["conv_state"][0]), VE, "conv_state"),
    ("bias wrong shape", setk("bias", lambda kw: kw["bias"][:4].contiguous()), VE, "bias"),
    ("bias int", setk("bias", lambda kw: kw["bias"].int()), TE, "bias"),
    ("activation unknown", setk("activation", lambda kw: "relu"), VE, "activation"),
    ("state_indices int64", setk("state_indices", lambda kw: kw["state_indices"].long()), TE, "state_indices"),
    ("slot out of range", setk("state_indices", lambda kw: i32([0, NUM_SLOTS, 1])), VE, "state_indices"),
    ("query_start_loc wrong length", setk("query_start_loc", lambda kw: i32([0, 5])), VE, "query_start_loc"),
    ("query_start_loc decreasing", setk("query_start_loc", lambda kw: i32([0, 3, 1, 5])), VE, "query_start_loc"),
    ("row longer than the window", setk("query_start_loc", lambda kw: i32([0, 5, 5, 5])), VE, "query_start_loc"),
    ("out wrong shape", setk("out", lambda kw: kw["out"][:, :4].contiguous()), VE, "out"),
    ("out is x", setk("out", lambda kw: kw["x"]), VE, "out"),
    ("out overlaps conv_state", setk("out", lambda kw: kw["conv_state"].view(-1)[:40].view(5, 8)), VE, "out"),
    ("null_slot a string", setk("null_slot", lambda kw: "-1"), TE, "null_slot"),
]

PLAN_CASES = [
    ("num_accepted int64", setk("num_accepted", lambda kw: kw["num_accepted"].long()), TE, "num_accepted"),
    ("num_accepted 2 dims", setk("num_accepted", lambda kw: kw["num_accepted"][None]), VE, "num_accepted"),
    ("fewer requests than rows", setk("num_accepted", lambda kw: i32([2, 1])), VE, "num_accepted"),
    ("state_indices int64", setk("state_indices", lambda kw: kw["state_indices"].long()), TE, "state_indices"),
    ("query_start_loc wrong length", setk("query_start_loc", lambda kw: i32([0, 3, 5])), VE, "query_start_loc"),
    ("query_start_loc decreasing", setk("query_start_loc", lambda kw: i32([0, 3, 2, 5])), VE, "query_start_loc"),
    ("request_indices wrong length", setk("request_indices", lambda kw: i32([0, 1])), VE, "request_indices"),
    ("request_indices out of range", setk("request_indices", lambda kw: i32([0, 3, 1])), VE, "request_indices"),
    # (a negative request index is padding with the default null_slot = -1: see test_padding_request_row)
    ("request_indices past the requests", setk("request_indices", lambda kw: i32([0, 5, 1])), VE,
     "request_indices"),
    ("request_indices int64", setk("request_indices", lambda kw: torch.tensor([0, 1, 2])), TE, "request_indices"),
    ("duplicate destination slots", setk("state_indices", lambda kw: i32([1, 2, 1])), VE, "state_indices"),
    ("null_slot a float", setk("null_slot", lambda kw: -1.5), TE, "null_slot"),
    ("num_slots negative", setk("num_slots", lambda kw: -1), VE, "num_slots"),
    ("slot past num_slots", setk("num_slots", lambda kw: 2), VE, "state_indices"),
    ("block_table without num_computed_tokens", setk("block_table", lambda kw: torch.zeros(3, 2, dtype=torch.int32)),
     VE, "num_computed_tokens"),
    ("num_computed_tokens without block_table", setk("num_computed_tokens", lambda kw: i32([0, 0, 0])),
     VE, "block_table"),
]

ALIGN_CASES = [
    ("align mode without block_size", drop("block_size"), VE, "block_size"),
    ("block_size zero", setk("block_size", lambda kw: 0), VE, "block_size"),
    ("block_size a float", setk("block_size", lambda kw: 4.0), TE, "block_size"),
    ("negative num_computed_tokens", setk("num_computed_tokens", lambda kw: i32([2, 1, -3])),
     VE, "num_computed_tokens"),
    ("num_computed_tokens wrong length", setk("num_computed_tokens", lambda kw: i32([2, 1])),
     VE, "num_computed_tokens"),
    ("block_table int64", setk("block_table", lambda kw: kw["block_table"].long()), TE, "block_table"),
    ("block_table 1 dim", setk("block_table", lambda kw: kw["block_table"][:, 0].contiguous()), VE, "block_table"),
    ("block_table wrong rows", setk("block_table", lambda kw: kw["block_table"][:2].contiguous()), VE, "block_table"),
    ("block_table no columns", setk("block_table", lambda kw: torch.zeros(3, 0, dtype=torch.int32)), VE, "block_table"),
    ("duplicate final slots", setk("block_table", lambda kw: torch.tensor([[0, 4], [2, 5], [1, 4]], dtype=torch.int32)),
     VE, "block_table"),
    ("final slot is another row's source", setk("block_table", lambda kw: torch.tensor(
        [[0, 1], [2, 5], [1, 4]], dtype=torch.int32)), VE, "block_table"),
    ("boundary slot is another row's source", setk("block_table", lambda kw: torch.tensor(
        [[5, 3], [2, 5], [0, 4]], dtype=torch.int32)), VE, "block_table"),
    # rows 0 and 2 read the same (shared prefix) block 1; row 2's window stays in it, so row 2
    # overwrites block 1 in place while row 0 still reads it
    ("final slot is a shared source", lambda kw: kw.update(
        state_indices=i32([1, 2, 1]), num_computed_tokens=i32([4, 1, 1]),
        block_table=torch.tensor([[1, 3], [2, 5], [1, 4]], dtype=torch.int32)), VE, "block_table"),
]

COMMIT_CASES = [
    ("num_accepted int64", setk("num_accepted", lambda kw: kw["num_accepted"].long()), TE, "num_accepted"),
    ("duplicate destination slots", setk("state_indices", lambda kw: i32([1, 2, 1])), VE, "state_indices"),
    ("slot out of range", setk("state_indices", lambda kw: i32([0, 2, NUM_SLOTS])), VE, "state_indices"),
    ("more rows than max_batch", setk("max_batch", lambda kw: 2), VE, "state_indices"),
    ("row longer than the records window", setk("query_start_loc", lambda kw: i32([0, 5, 5, 5])),
     VE, "query_start_loc"),
    ("query_start_loc decreasing", setk("query_start_loc", lambda kw: i32([0, 3, 2, 5])), VE, "query_start_loc"),
    ("bad request_indices", setk("request_indices", lambda kw: i32([0, 1, 3])), VE, "request_indices"),
    ("request_indices wrong length", setk("request_indices", lambda kw: i32([0, 1])), VE, "request_indices"),
    ("fewer requests than rows", setk("num_accepted", lambda kw: i32([2])), VE, "num_accepted"),
    ("per-group list of the wrong length", setk("state_indices", lambda kw: [kw["state_indices"]] * 2),
     VE, "state_indices"),
    ("block_table without num_computed_tokens", setk("block_table", lambda kw: torch.zeros(3, 2, dtype=torch.int32)),
     VE, "num_computed_tokens"),
]

COMMIT_ALIGN_CASES = [
    ("align mode without block_size", drop("block_size"), VE, "block_size"),
    ("negative num_computed_tokens", setk("num_computed_tokens", lambda kw: i32([-2, 1, 3])),
     VE, "num_computed_tokens"),
    # row 0 writes 5 (boundary) and 3 (final); row 2 writes 0 (boundary, row 0's source) and 4
    ("boundary slot is another row's source", setk("block_table", lambda kw: torch.tensor(
        [[5, 3], [2, 5], [0, 4]], dtype=torch.int32)), VE, "block_table"),
    ("final slot outside the pool", setk("block_table", lambda kw: torch.tensor(
        [[0, NUM_SLOTS], [2, 5], [1, 4]], dtype=torch.int32)), VE, "block_table"),
    ("duplicate final slots", setk("block_table", lambda kw: torch.tensor([[0, 4], [2, 5], [1, 4]], dtype=torch.int32)),
     VE, "block_table"),
    ("final slot is another row's source", setk("block_table", lambda kw: torch.tensor(
        [[0, 1], [2, 5], [1, 4]], dtype=torch.int32)), VE, "block_table"),
    ("final slot is a shared source", lambda kw: kw.update(
        state_indices=i32([1, 2, 1]), num_computed_tokens=i32([4, 1, 1]),
        block_table=torch.tensor([[1, 3], [2, 5], [1, 4]], dtype=torch.int32)), VE, "block_table"),
    ("block_table wrong rows", setk("block_table", lambda kw: kw["block_table"][:2].contiguous()), VE, "block_table"),
]

GROUP_CASES = [
    # group 0 is fine, group 1 is not: nothing of group 0 may be written either
    ("group 1 slot out of range", setk("state_indices", lambda kw: [kw["state_indices"][0], i32([3, 0, 4])]),
     VE, "state_indices[1]"),
    ("group 1 duplicate slots", setk("state_indices", lambda kw: [kw["state_indices"][0], i32([1, 0, 1])]),
     VE, "state_indices[1]"),
    # the rows are defined by the shared query_start_loc, so a short group is caught there
    ("group 1 different row count", setk("state_indices", lambda kw: [kw["state_indices"][0], i32([3, 0])]),
     VE, "query_start_loc"),
    ("group 1 align without block_size", setk("block_table", lambda kw: [None, torch.tensor(
        [[3, 2], [0, 1], [1, 2]], dtype=torch.int32)]), VE, "num_computed_tokens[1]"),
    ("block_size list of the wrong length", setk("block_size", lambda kw: [4]), VE, "block_size"),
]

CONTEXT_CASES = [
    ("groups empty", setk("groups", lambda kw: []), VE, "groups"),
    ("group empty", setk("groups", lambda kw: [kw["groups"][0], []]), VE, "groups[1]"),
    ("groups not lists", setk("groups", lambda kw: kw["groups"][0][0]), VE, "groups"),
    ("layer not a LayerCache", setk("groups", lambda kw: [[kw["groups"][0][0].state]]), TE, "groups[0][0]"),
    ("max_batch zero", setk("max_batch", lambda kw: 0), VE, "max_batch"),
    ("max_batch a float", setk("max_batch", lambda kw: 3.0), TE, "max_batch"),
    ("records not ReplayRecords", group0_mut(lambda cache: rs.LayerCache(cache.state, (1, 2, 3))),
     TE, "groups[0][0].records"),
    ("records key 3 dims", group0_mut(lambda cache: rs.LayerCache(cache.state, rs.ReplayRecords(
        cache.records.correction, cache.records.key[0], cache.records.decay))), VE, "groups[0][0].records.key"),
    ("records correction 2 dims", group0_mut(lambda cache: rs.LayerCache(cache.state, rs.ReplayRecords(
        cache.records.correction[0, 0], cache.records.key, cache.records.decay))),
     VE, "groups[0][0].records.correction"),
    ("records key not a tensor", group0_mut(lambda cache: rs.LayerCache(cache.state, rs.ReplayRecords(
        cache.records.correction, None, cache.records.decay))), TE, "groups[0][0].records.key"),
    ("records too few rows", group0_mut(lambda cache: rs.LayerCache(cache.state, records_like(2, 4))),
     VE, "groups[0][0].records"),
    ("state float16", group0_mut(lambda cache: rs.LayerCache(cache.state.half(), cache.records)),
     TE, "groups[0][0].state"),
    ("state K differs from records", group0_mut(lambda cache: rs.LayerCache(cache.state, records_like(3, 4, K=32))),
     VE, "groups[0][0].state"),
    ("state last dim strided", group0_mut(lambda cache: rs.LayerCache(strided_last(cache.state), cache.records)),
     VE, "groups[0][0].state"),
    ("records key not contiguous", group0_mut(lambda cache: rs.LayerCache(cache.state, rs.ReplayRecords(
        cache.records.correction, cache.records.key.transpose(0, 1).contiguous().transpose(0, 1),
        cache.records.decay))),
     VE, "groups[0][0].records.key"),
    ("conv_state slot count", group0_mut(lambda cache: rs.LayerCache(
        cache.state, cache.records, conv_state=torch.zeros(3, 8, 7), conv_width=4)),
     VE, "groups[0][0].conv_state"),
    ("conv_state narrower than the window", group0_mut(lambda cache: rs.LayerCache(
        cache.state, cache.records, conv_state=torch.zeros(NUM_SLOTS, 8, 3), conv_width=4)),
     VE, "groups[0][0].conv_state"),
    ("conv_state int", group0_mut(lambda cache: rs.LayerCache(
        cache.state, cache.records, conv_state=torch.zeros(NUM_SLOTS, 8, 7, dtype=torch.int32), conv_width=4)),
     TE, "groups[0][0].conv_state"),
    ("layers on two devices", setk("groups", lambda kw: [kw["groups"][0], [rs.LayerCache(
        on_meta(kw["groups"][1][0].state), kw["groups"][1][0].records)]]), VE, "groups[1][0].state"),
    ("records on another device", setk("groups", lambda kw: [kw["groups"][0], [rs.LayerCache(
        kw["groups"][1][0].state, records_like(3, 4, device=META))]]), VE, "groups[1][0].records.correction"),
]


def _cases():
    out = []
    for base, cases in (("gdn_verify", GDN_CASES + VERIFY_CASES), ("gdn_verify(pre)", PRE_CASES),
                        ("gdn_decode", DECODE_CASES + GDN_CASES[:4]),
                        ("gdn_spec_decode_snapshot", SNAPSHOT_CASES + GDN_CASES[:2]),
                        ("conv_verify", CONV_CASES), ("plan_commit", PLAN_CASES),
                        ("plan_commit(align)", ALIGN_CASES), ("CommitContext.commit", COMMIT_CASES),
                        ("CommitContext.commit(align)", COMMIT_ALIGN_CASES),
                        ("CommitContext.commit(groups)", GROUP_CASES), ("CommitContext", CONTEXT_CASES)):
        for cid, mutate, exc, name in cases:
            out.append(pytest.param(base, mutate, exc, name, id=f"{base}: {cid}"))
    return out


@pytest.mark.parametrize("base", list(BASES))
def test_base_calls_are_valid(base):
    """Every unmodified base call succeeds (so each case below fails because of its one mutation)."""
    build, call = BASES[base]
    call(build())


@pytest.mark.parametrize("base,mutate,exc,name", _cases())
def test_rejects(base, mutate, exc, name):
    build, call = BASES[base]
    kw = build()
    mutate(kw)
    before = clone_all(kw)
    with pytest.raises(exc) as ei:
        call(kw)
    msg = str(ei.value)
    op = base.split("(")[0]
    assert msg.startswith(f"{op}: {name} "), f"message does not start with '{op}: {name} ': {msg!r}"
    assert type(ei.value) is exc, f"raised {type(ei.value).__name__}, expected {exc.__name__}"
    assert_unchanged(before, kw)


def test_padding_row_may_share_a_slot_in_decode():
    """Not an error: a zero-length row and a padding row may name a slot another row writes."""
    kw = decode_base()
    kw["state_indices"] = i32([1, 1, -5])      # row 1 has no tokens; row 2 is padding (<= -1)
    call_decode(kw)


def test_gpu_value_checks_are_opt_in(monkeypatch):
    from recoverssm.core.validation import ENV_CHECK, wants_value_checks
    monkeypatch.delenv(ENV_CHECK, raising=False)
    assert wants_value_checks(None, torch.device("cpu"))
    assert wants_value_checks(False, torch.device("cpu"))      # CPU: always
    assert not wants_value_checks(None, torch.device("cuda"))
    assert wants_value_checks(True, torch.device("cuda"))
    monkeypatch.setenv(ENV_CHECK, "1")
    assert wants_value_checks(None, torch.device("cuda"))
    assert not wants_value_checks(False, torch.device("cuda"))


@pytest.mark.parametrize("args,name", [((0, 4, 2, 4, 16, 16), "max_batch"), ((2, 4, 0, 4, 16, 16), "H"),
                                       ((2, 4, 3, 4, 16, 16), "HV"), ((2, 4.0, 2, 4, 16, 16), "max_window")])
def test_records_allocate_rejects(args, name):
    with pytest.raises(ValueError, match=rf"ReplayRecords.allocate: {name}"):
        rs.ReplayRecords.allocate(*args)


def test_shared_source_without_overwrite_is_allowed():
    """Two rows may read one slot (a shared prefix block) as long as no row writes it."""
    kw = plan_align_base()
    kw.update(state_indices=i32([1, 2, 1]), num_computed_tokens=i32([4, 1, 4]),
              block_table=torch.tensor([[1, 3], [2, 5], [1, 4]], dtype=torch.int32))
    plan = call_plan(kw)
    assert plan.as_dict()["final_slot"] == [3, -1, 4]
    kw = snapshot_base()
    kw["state_indices"] = i32([1, 2, 1])
    kw["snapshot_slots"] = torch.tensor([[3, 4, 5, -1], [-1] * 4, [0, -1, -1, -1]], dtype=torch.int32)
    call_snapshot(kw)


def test_padding_request_row():
    """A request index <= null_slot makes the row padding (the index rule): accepted by the checks,
    nothing planned, and its request's num_accepted and num_computed_tokens are not read."""
    kw = plan_align_base()
    kw.update(request_indices=i32([0, -1, 2]), num_accepted=i32([2, -7, 2]),
              num_computed_tokens=i32([3, -5, 3]))
    plan = rs.plan_commit(**kw)
    assert plan.as_dict()["commit_len"] == [2, 0, 2]
    assert plan.as_dict()["final_slot"][1] == -1
