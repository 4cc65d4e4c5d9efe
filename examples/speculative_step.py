"""Speculative steps through the recurrent layers of a hybrid model, checked bit for bit.

A step is what an engine's model runner does after the draft proposed its tokens:

1. the host writes the step's metadata into persistent buffers: each batch row's slot,
   ``query_start_loc``, ``request_indices`` (batch row -> request), a padding row at the end;
2. forward: per layer ``conv_verify``, then ``gdn_verify`` (or ``kda_verify``) on strided views of
   the conv output; the states are read, not written; each layer's replay records are written;
3. sampling: ``num_accepted`` per request (accepted drafts + 1), on the device;
4. ONE ``CommitContext.commit`` for all layers.

Steps 2 to 4 never sync with the host, so they trace as one graph (``--compile``) and capture as one
CUDA graph (``examples/cuda_graph_step.py``). After each step the accepted tokens go through the
native per-token path (``conv_decode`` + ``gdn_decode`` / ``kda_decode``) on a copy of the pools:
the recurrent states, the conv histories and the last layer's outputs must be equal, bit for bit.

The model keeps only what matters here: layer ``l``'s in-projection is a lookup of the token in a
table plus the previous layer's output (exact, so the per-token path gets the same bits).

    python examples/speculative_step.py                        # cpu_ref on the CPU
    python examples/speculative_step.py --compile --arch kda   # the step under torch.compile
    python examples/speculative_step.py --device cuda --compile
    python examples/speculative_step.py --backend cuda         # the Triton kernels, in Triton's CPU interpreter
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

import recoverssm as rs

I32 = torch.int32
H, HV, K, V, WIDTH, VOCAB = 2, 4, 16, 16, 4, 64     # q/k heads, value heads, head dims, conv width
CONV_DIM = 2 * H * K + HV * V                         # the conv runs over q | k | v


@dataclass
class Layer:
    table: torch.Tensor      # [VOCAB, CONV_DIM + gate + HV]: q | k | v | a | b of each token
    conv_w: torch.Tensor     # [CONV_DIM, WIDTH]
    conv_b: torch.Tensor     # [CONV_DIM]
    A_log: torch.Tensor      # [HV] fp32
    dt_bias: torch.Tensor    # [HV] (GDN) or [HV, K] (KDA), fp32
    state: torch.Tensor      # state pool [num_slots, HV, V, K]
    conv: torch.Tensor       # conv pool [num_slots, CONV_DIM, WIDTH - 1 + window]
    records: rs.ReplayRecords


class Model:
    """Weights, pools, records and the commit context: everything allocated once, at startup."""

    def __init__(self, args, dev: torch.device):
        gen = torch.Generator().manual_seed(args.seed)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(dev)

        self.kda = args.arch == "kda"
        self.gate = HV * K if self.kda else HV          # gate inputs a per token: one per channel for KDA
        self.requests, self.window = args.requests, args.window
        self.num_slots = 2 * args.requests
        self.max_batch = args.requests + 1              # every request, plus one padding row
        self.layers = [Layer(
            table=randn(VOCAB, CONV_DIM + self.gate + HV),
            conv_w=randn(CONV_DIM, WIDTH, std=0.5), conv_b=randn(CONV_DIM, std=0.1),
            A_log=randn(HV, std=0.5), dt_bias=randn(HV, K) if self.kda else randn(HV),
            state=randn(self.num_slots, HV, V, K, std=0.1),              # as a prefill left them
            conv=randn(self.num_slots, CONV_DIM, WIDTH - 1 + args.window),
            records=rs.ReplayRecords.allocate(self.max_batch, args.window, H, HV, K, V, device=dev,
                                              vector_decay=self.kda),
        ) for _ in range(args.layers)]
        # One context for all layers (one KV-cache group: they share the slots), built once.
        caches = [rs.LayerCache(lay.state, lay.records, lay.conv, conv_width=WIDTH) for lay in self.layers]
        self.ctx = rs.CommitContext([caches], max_batch=self.max_batch, backend=args.backend)

    def inputs(self, lay: Layer, tokens: torch.Tensor, o: torch.Tensor | None):
        """The layer's conv input ``[T, CONV_DIM]`` and gates ``a``, ``b``: views of one buffer."""
        x = lay.table[tokens]
        if o is not None:
            x[:, 2 * H * K:CONV_DIM] += o.flatten(1)
        a = x[:, CONV_DIM:CONV_DIM + self.gate]
        return x[:, :CONV_DIM], a.unflatten(-1, (HV, K)) if self.kda else a, x[:, CONV_DIM + self.gate:]


def split(y: torch.Tensor):
    """q, k ``[T, H, K]`` and v ``[T, HV, V]``: strided views of the conv output, read in place."""
    return (y[:, :H * K].unflatten(-1, (H, K)), y[:, H * K:2 * H * K].unflatten(-1, (H, K)),
            y[:, 2 * H * K:].unflatten(-1, (HV, V)))


def buffers(model: Model, dev: torch.device) -> dict:
    """The step's persistent buffers: fixed addresses and shapes, new values every step."""
    B, T = model.max_batch, model.window
    return {"tokens": torch.zeros(B * T, dtype=torch.long, device=dev),
            "slots": torch.zeros(B, dtype=I32, device=dev),
            "qsl": torch.zeros(B + 1, dtype=I32, device=dev),
            "request_indices": torch.zeros(B, dtype=I32, device=dev),
            "num_accepted": torch.zeros(model.requests, dtype=I32, device=dev)}


def fill(model: Model, buf: dict, slot_of: torch.Tensor, gen: torch.Generator) -> None:
    """Host side of a step: the rows serve the requests in a random order, with windows of 1 to
    ``window`` tokens; a padding row (slot -1, no tokens) follows."""
    R, T = model.requests, model.window
    order = torch.randperm(R, generator=gen)
    lens = torch.cat([torch.randint(1, T + 1, (R,), generator=gen), torch.zeros(1, dtype=torch.long)])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    buf["qsl"].copy_(qsl)
    buf["slots"].copy_(torch.cat([slot_of[order], torch.tensor([-1], dtype=I32)]))
    buf["request_indices"].copy_(torch.cat([order, torch.zeros(1, dtype=torch.long)]))
    buf["tokens"][:int(qsl[-1])].copy_(torch.randint(VOCAB, (int(qsl[-1]),), generator=gen))


def forward(model: Model, buf: dict, backend) -> torch.Tensor:
    """Verify every row's window in every layer; the last layer's outputs ``[B * T, HV, V]``."""
    verify = rs.kda_verify if model.kda else rs.gdn_verify
    slots, qsl = buf["slots"], buf["qsl"]
    o = None
    for lay in model.layers:
        x, a, b = model.inputs(lay, buf["tokens"], o)
        y = rs.conv_verify(x, lay.conv, lay.conv_w, lay.conv_b, state_indices=slots, query_start_loc=qsl,
                           backend=backend)
        q, k, v = split(y)
        o = verify(q, k, v, state=lay.state, state_indices=slots, query_start_loc=qsl, records=lay.records,
                   a=a, b=b, A_log=lay.A_log, dt_bias=lay.dt_bias, backend=backend)
    return o


def sample(model: Model, buf: dict, out: torch.Tensor) -> None:
    """Stands in for the engine's rejection sampler, on the device: draft ``j + 1`` of a row is
    accepted when the output at position ``j`` has a positive first element and every earlier
    draft was accepted. Rows ``0 .. R-1`` serve the requests (padding rows follow). Writes
    ``num_accepted[request]`` = accepted drafts + 1, at most the row's window."""
    R, T = model.requests, model.window
    qsl = buf["qsl"]
    agree = out[:, 0, 0] > 0                                                      # [B * T]
    pos = (qsl[:R, None] + torch.arange(T - 1, device=qsl.device)).clamp(max=out.shape[0] - 1)
    run = agree[pos.long()].to(I32).cumprod(1).sum(1)                             # leading accepted drafts
    accepted = torch.minimum(1 + run, qsl[1:R + 1] - qsl[:R]).to(I32)
    buf["num_accepted"].index_copy_(0, buf["request_indices"][:R].long(), accepted)


def step(model: Model, buf: dict, backend) -> torch.Tensor:
    """Verify, sample, commit: one speculative step, without a host sync."""
    out = forward(model, buf, backend)
    sample(model, buf, out)
    model.ctx.commit(buf["num_accepted"], buf["slots"], buf["qsl"], request_indices=buf["request_indices"])
    return out


class PerToken:
    """The native per-token path on its own copy of the pools: what the commit must reproduce."""

    def __init__(self, model: Model, backend):
        self.model, self.backend = model, backend
        self.states = [lay.state.clone() for lay in model.layers]
        self.convs = [lay.conv.clone() for lay in model.layers]

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per row through every layer (``conv_decode``, then ``gdn_decode`` / ``kda_decode``)."""
        m = self.model
        decode = rs.kda_decode if m.kda else rs.gdn_decode
        qsl = torch.arange(len(slots) + 1, dtype=I32, device=slots.device)
        o = None
        for lay, state, conv in zip(m.layers, self.states, self.convs):
            x, a, b = m.inputs(lay, tokens, o)
            y = rs.conv_decode(x, conv, lay.conv_w, lay.conv_b, state_indices=slots, backend=self.backend)
            q, k, v = split(y)
            o = decode(q, k, v, state=state, state_indices=slots, query_start_loc=qsl, a=a, b=b, A_log=lay.A_log,
                       dt_bias=lay.dt_bias, backend=self.backend)
        return o

    def check(self, buf: dict, out: torch.Tensor) -> str:
        """Feed each request's accepted tokens one at a time and compare with the step's results;
        raise on any difference. Returns a one-line summary of the step."""
        m = self.model
        qsl, slots = buf["qsl"].tolist(), buf["slots"].tolist()
        rows, accepted = buf["request_indices"].tolist()[:m.requests], buf["num_accepted"].tolist()
        row_of = {q: r for r, q in enumerate(rows)}
        for t in range(max(accepted)):
            live = [row_of[q] for q in range(m.requests) if accepted[q] > t]
            pos = torch.tensor([qsl[r] + t for r in live], device=out.device)
            o = self.decode(buf["tokens"][pos], torch.tensor([slots[r] for r in live], dtype=I32, device=out.device))
            if not torch.equal(o, out[pos]):
                raise AssertionError(f"outputs at window position {t} differ from per-token decoding")
        for i, lay in enumerate(m.layers):
            if not torch.equal(lay.state, self.states[i]):
                raise AssertionError(f"layer {i}: committed states differ from per-token decoding")
            if not torch.equal(lay.conv[:, :, :WIDTH - 1], self.convs[i][:, :, :WIDTH - 1]):
                raise AssertionError(f"layer {i}: conv histories differ from per-token decoding")
        windows = [qsl[row_of[q] + 1] - qsl[row_of[q]] for q in range(m.requests)]
        return (f"rows serve requests {rows} + 1 padding row, windows {windows}, accepted {accepted}: "
                f"states, conv histories and outputs equal per-token decoding")


def parser(description: str, devices=("cpu", "cuda")) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default=devices[0], choices=devices)
    p.add_argument("--backend", default=None, help="cpu_ref, cuda, ... (default: the device's)")
    p.add_argument("--arch", default="gdn", choices=["gdn", "kda"])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--window", type=int, default=4, help="most tokens verified per request: 1 + drafts")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> int:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--compile", action="store_true", help="the step under torch.compile(fullgraph=True)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default: inductor)")
    args = p.parse_args()
    if args.device == "cpu" and args.backend not in (None, "cpu_ref"):
        os.environ.setdefault("TRITON_INTERPRET", "1")     # GPU kernels on CPU tensors: Triton's interpreter
    dev = torch.device(args.device)
    model = Model(args, dev)
    ref = PerToken(model, args.backend)
    buf = buffers(model, dev)
    slot_of = torch.randperm(model.num_slots, generator=torch.Generator().manual_seed(args.seed))[:args.requests]
    run = torch.compile(step, fullgraph=True, backend=args.compile_backend) if args.compile else step
    gen = torch.Generator().manual_seed(args.seed + 1)
    for i in range(1, args.steps + 1):
        fill(model, buf, slot_of.to(I32), gen)
        out = run(model, buf, args.backend)
        print(f"step {i}: {ref.check(buf, out)}")
    print(f"OK: {args.steps} steps, {args.layers} {args.arch.upper()} layers, backend "
          f"{rs.get_backend(args.backend, dev).name} on {dev}, {'compiled' if args.compile else 'eager'}, "
          f"bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
