"""The ops as torch.library custom ops: schemas that state exactly what each op writes,
``torch.library.opcheck`` for every op (cpu_ref, and the Triton backend under the interpreter or
on a GPU), and a multi-layer speculative step that compiles with ``fullgraph=True`` and gives the
eager bits, records included (a GDN and a Mamba2 layer)."""
from __future__ import annotations


import pytest
import torch

import recoverssm as rs

from helpers import backends, device_of

I32 = torch.int32
H, HV, K, V, WIDTH = 2, 4, 16, 8, 4
DIM = 2 * H * K + HV * V


WRITES = {
    "conv_verify": {"conv_state", "out", "pending_plan"}, "conv_decode": {"conv_state", "out"},
    "gdn_verify": {"correction", "key", "decay", "out"}, "kda_verify": {"correction", "key", "decay", "out"},
    "gdn_verify_pending": {"state", "correction", "key", "decay", "out", "pending_plan"},
    "kda_verify_pending": {"state", "correction", "key", "decay", "out", "pending_plan"},
    "gdn_decode": {"state", "out"}, "kda_decode": {"state", "out"},
    "gdn_spec_decode_snapshot": {"state", "out"}, "kda_spec_decode_snapshot": {"state", "out"},
    "plan_commit": set(), "commit": {"states", "conv_states"}, "defer": {"plan", "parity"},
    "flush": {"states", "conv_states", "plan"},
    "mamba2_verify": {"correction", "key", "decay", "out"},
    "mamba2_verify_pending": {"state", "correction", "key", "decay", "out", "pending_plan"},
    "mamba2_decode": {"state", "out"}, "mamba2_spec_decode_snapshot": {"state", "out"},
}


def test_every_op_is_listed():
    from recoverssm.core.ops import OPS
    assert set(WRITES) == set(OPS)


@pytest.mark.parametrize("name", sorted(WRITES))
def test_schema_states_what_the_op_writes(name):
    schema = getattr(torch.ops.recoverssm, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name]


def step_inputs(dev, seed=0, lens=(3, 0, 2), slots=(1, 3, -1)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)
    t = dict(x=torch.randn(T, DIM, generator=g), a=torch.randn(T, HV, generator=g), b=torch.randn(T, HV, generator=g),
             ka=torch.randn(T, HV, K, generator=g), state_indices=torch.tensor(slots, dtype=I32), qsl=qsl,
             num_accepted=torch.tensor([2, 0, 1], dtype=I32))
    return {n: v.to(dev) for n, v in t.items()}


def layer(dev, seed, kind="gdn", buffers=1):
    g = torch.Generator().manual_seed(100 + seed)
    t = dict(state=torch.randn(8, HV, V, K, generator=g) * 0.3, conv=torch.randn(8, DIM, WIDTH - 1 + 4, generator=g),
             w=torch.randn(DIM, WIDTH, generator=g), bias=torch.randn(DIM, generator=g),
             A_log=torch.randn(HV, generator=g) * 0.3,
             dt_bias=torch.randn(HV, K, generator=g) if kind == "kda" else torch.randn(HV, generator=g))
    t = {n: v.to(dev) for n, v in t.items()}
    t["records"] = rs.ReplayRecords.allocate(3, 4, H, HV, K, V, device=dev, vector_decay=kind == "kda",
                                             buffers=buffers)
    t["kind"] = kind
    return t


def split(y):
    T = y.shape[0]
    return (y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V))


@pytest.mark.parametrize("backend", backends())
def test_opcheck_every_op(backend):
    dev = device_of(backend)
    s = step_inputs(dev)
    gl, kl = layer(dev, 0), layer(dev, 1, "kda")
    q, k, v = (t.contiguous() for t in split(s["x"]))
    out = torch.empty_like(v)
    rec, krec = gl["records"], kl["records"]
    snaps = torch.tensor([[4, 5, -1], [-1, -1, -1], [-1, -1, -1]], dtype=I32, device=dev)
    ops = torch.ops.recoverssm
    # a context that defers: its pending step, double-buffered records, the rows that continue
    dl = layer(dev, 2, buffers=2)
    dctx = rs.CommitContext([[rs.LayerCache(dl["state"], dl["records"], dl["conv"], conv_width=WIDTH)]],
                            max_batch=3, backend=backend, deferred=True)
    pending, drec = dctx.pending, dl["records"]
    kdl = layer(dev, 3, "kda", buffers=2)
    kctx = rs.CommitContext([[rs.LayerCache(kdl["state"], kdl["records"], kdl["conv"], conv_width=WIDTH)]],
                            max_batch=3, backend=backend, deferred=True)
    kpending, kdrec = kctx.pending, kdl["records"]
    rows = torch.tensor([0, -1, 1], dtype=I32, device=dev)
    z = torch.randn_like(v)
    calls = [
        (ops.conv_verify, (s["x"], gl["conv"], gl["w"], gl["bias"], s["state_indices"], s["qsl"], True, 1, -1,
                           torch.empty_like(s["x"]), None, None, backend, None)),
        (ops.gdn_verify_pending, (q, k, v, dl["state"], s["state_indices"], s["qsl"], drec.correction, drec.key,
                                  drec.decay, s["a"], s["b"], dl["A_log"], dl["dt_bias"], None, None, None, True, -1,
                                  True, out, pending.plan, rows, pending.parity, backend, None)),
        (ops.defer, (pending.plan, pending.parity, s["num_accepted"], s["qsl"], [s["state_indices"]], [None], [None],
                     [None], [0], -1, 3, dctx.id, backend, None)),
        (ops.flush, ([dl["state"]], [dl["conv"]], [drec.correction], [drec.key], [drec.decay], [0], [WIDTH], [1],
                     [True], pending.plan, pending.parity, torch.tensor([0, 1], dtype=I32, device=dev), -1, 3, dctx.id,
                     backend, None)),
        (ops.conv_decode, (s["x"][:3], gl["conv"], gl["w"], gl["bias"], s["state_indices"], True, 1, -1,
                           torch.empty(3, DIM, device=dev), backend, None)),
        (ops.gdn_verify, (q, k, v, gl["state"], s["state_indices"], s["qsl"], rec.correction, rec.key, rec.decay,
                          s["a"], s["b"], gl["A_log"], gl["dt_bias"], None, None, None, True, -1, True, out, backend,
                          None)),
        (ops.gdn_decode, (q, k, v, gl["state"], s["state_indices"], s["qsl"], s["a"], s["b"], gl["A_log"],
                          gl["dt_bias"], None, None, None, True, -1, True, out, backend, None)),
        (ops.gdn_spec_decode_snapshot, (q, k, v, gl["state"], s["state_indices"], s["qsl"], snaps, s["a"], s["b"],
                                        gl["A_log"], gl["dt_bias"], None, None, None, True, -1, False, out, backend,
                                        None)),
        (ops.kda_verify, (q, k, v, kl["state"], s["state_indices"], s["qsl"], krec.correction, krec.key, krec.decay,
                          s["ka"], s["b"], kl["A_log"], kl["dt_bias"], None, None, -5.0, None, True, -1, True, out,
                          backend, None)),
        (ops.kda_verify_pending, (q, k, v, kdl["state"], s["state_indices"], s["qsl"], kdrec.correction,
                                  kdrec.key, kdrec.decay, s["ka"], s["b"], kdl["A_log"], kdl["dt_bias"], None, None,
                                  -5.0, None, True, -1, True, out, kpending.plan, rows, kpending.parity, backend,
                                  None)),
        (ops.kda_decode, (q, k, v, kl["state"], s["state_indices"], s["qsl"], s["ka"], s["b"], kl["A_log"],
                          kl["dt_bias"], None, None, None, None, True, -1, True, out, backend, None)),
        (ops.kda_spec_decode_snapshot, (q, k, v, kl["state"], s["state_indices"], s["qsl"], snaps, s["ka"], s["b"],
                                        kl["A_log"], kl["dt_bias"], None, None, None, None, True, -1, True, out,
                                        backend, None)),
        (ops.plan_commit, (s["num_accepted"], s["state_indices"], s["qsl"], None, None, None, None, -1, None,
                           backend, None)),
        # Mamba2: q, k, v in the roles of C, B, x; dt, dt_bias, A_log, A, D, z, dt_min, dt_max
        (ops.mamba2_verify, (q, k, v, gl["state"], s["state_indices"], s["qsl"], rec.correction, rec.key, rec.decay,
                             s["a"], gl["dt_bias"], gl["A_log"], None, gl["A_log"], z, 0.001, None, -1, True, out,
                             backend, None)),
        (ops.mamba2_verify_pending, (q, k, v, dl["state"], s["state_indices"], s["qsl"], drec.correction, drec.key,
                                     drec.decay, s["a"], dl["dt_bias"], dl["A_log"], None, None, None, None, None, -1,
                                     True, out, pending.plan, rows, pending.parity, backend, None)),
        (ops.mamba2_decode, (q, k, v, gl["state"], s["state_indices"], s["qsl"], s["a"], gl["dt_bias"], None,
                             -torch.exp(gl["A_log"]), gl["A_log"], None, None, 0.5, -1, True, out, backend, None)),
        (ops.mamba2_spec_decode_snapshot, (q, k, v, gl["state"], s["state_indices"], s["qsl"], snaps, s["a"],
                                           gl["dt_bias"], gl["A_log"], None, None, z, None, None, -1, False, out,
                                           backend, None)),
        (ops.commit, ([gl["state"], kl["state"]], [gl["conv"]], [rec.correction, krec.correction],
                      [rec.key, krec.key], [rec.decay, krec.decay], [0, 0], [WIDTH, 0], [1, 1], [True, False],
                      s["num_accepted"], s["qsl"], [s["state_indices"]], [None], [None], [None], [0], -1, 3, 0,
                      backend, None)),
    ]
    assert {op.default.name().split("::")[1] for op, _ in calls} == set(WRITES)
    for op, args in calls:
        torch.library.opcheck(op.default, args)


def run_step(layers, ctx, s, backend):
    """conv_verify and verify of every layer, then one commit: an engine's speculative step."""
    outs = []
    for lay in layers:
        y = rs.conv_verify(s["x"], lay["conv"], lay["w"], lay["bias"], state_indices=s["state_indices"],
                           query_start_loc=s["qsl"], backend=backend)
        q, k, v = split(y)
        common = dict(state=lay["state"], state_indices=s["state_indices"], query_start_loc=s["qsl"],
                      records=lay["records"], A_log=lay["A_log"], dt_bias=lay["dt_bias"], backend=backend)
        if lay["kind"] == "mamba2":      # the conv's channels in the roles of x, B, C
            outs.append(rs.mamba2_verify(v, k, q, s["a"], D=lay["A_log"], dt_limit=(0.001, None), **common))
        else:
            outs.append(rs.gdn_verify(q, k, v, a=s["a"], b=s["b"], **common))
    ctx.commit(s["num_accepted"], s["state_indices"], s["qsl"])
    return torch.stack(outs)


@pytest.mark.parametrize("backend", backends())
def test_compiled_step_has_no_graph_break_and_eager_bits(backend):
    dev = device_of(backend)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        layers = [layer(dev, 0), layer(dev, 1, "mamba2")]
        s = step_inputs(dev)
        ctx = rs.CommitContext([[rs.LayerCache(lay["state"], lay["records"], lay["conv"], conv_width=WIDTH)
                                 for lay in layers]], max_batch=3, backend=backend)
        fn = torch.compile(run_step, fullgraph=True, backend="inductor" if backend == "cpu_ref" else "aot_eager") \
            if compiled else run_step
        out = fn(layers, ctx, s, backend)
        rec = [lay["records"] for lay in layers]
        results.append([out, *(lay["state"] for lay in layers), *(lay["conv"] for lay in layers),
                        *(t for r in rec for t in (r.correction, r.key, r.decay))])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
