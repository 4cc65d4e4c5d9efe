"""A whole speculative step (verify of every layer, sampling, the commit) in one CUDA graph.

The step of ``speculative_step.py`` is captured once and replayed with each step's values written
into the same buffers (new slots, new windows, new rows order; the accepted counts come from the
sampler inside the graph). After every replay the states, conv histories and outputs are checked
bit for bit against per-token decoding. Needs a CUDA GPU.

    python examples/cuda_graph_step.py [--arch kda] [--layers 3] [--steps 4]
"""
from __future__ import annotations

import sys

import torch
from speculative_step import Model, PerToken, buffers, fill, parser, step

import recoverssm as rs


def main() -> int:
    args = parser(__doc__.split("\n")[0], devices=("cuda",)).parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_graph_step.py needs a CUDA GPU")
    dev = torch.device("cuda")
    model = Model(args, dev)                # pools, records and the commit context: before capture
    ref = PerToken(model, args.backend)
    buf = buffers(model, dev)               # the graph reads these very tensors at every replay
    slot_of = torch.randperm(model.num_slots, generator=torch.Generator().manual_seed(args.seed))
    slot_of = slot_of[:args.requests].to(torch.int32)
    gen = torch.Generator().manual_seed(args.seed + 1)

    # One eager step with the same buffers first: it compiles the kernels and uploads the
    # commit's table of index buffers, which a capture may not do.
    fill(model, buf, slot_of, gen)
    out = step(model, buf, args.backend)
    print(f"eager step: {ref.check(buf, out)}")
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(model, buf, args.backend)      # recorded, not run; no checks of values here
    for i in range(1, args.steps + 1):
        fill(model, buf, slot_of, gen)                   # new values, same tensors
        graph.replay()
        print(f"replay {i}: {ref.check(buf, graph_out)}")
    print(f"OK: {args.steps} replays of one CUDA graph, {args.layers} {args.arch.upper()} layers, backend "
          f"{rs.get_backend(args.backend, dev).name}, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
