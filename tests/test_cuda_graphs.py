"""A whole speculative step (conv_verify and gdn_verify of every layer, then one commit of all
layers of two KV-cache groups, one of them in align mode) captured in one CUDA graph and replayed
with new values in the same index buffers: new slots, new accepted counts, padding rows. Every
replay must leave the states, conv states and outputs the eager path computes, bit for bit."""
from __future__ import annotations

import pytest
import torch

import recoverssm as rs

pytestmark = pytest.mark.gpu

I32 = torch.int32
H, HV, K, V, WIDTH, T_MAX, B, LAYERS, SLOTS, BLOCK = 4, 8, 128, 128, 4, 4, 6, 4, 40, 4
DIM = 2 * H * K + HV * V


class Model:
    """Per-layer weights and caches; layers 0, 2 form group 0, layers 1, 3 group 1 (align mode)."""

    def __init__(self, seed: int, dev: str):
        g = torch.Generator().manual_seed(seed)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(dict(
                state=(torch.randn(SLOTS, HV, V, K, generator=g) * 0.3).to(dev),
                conv=torch.randn(SLOTS, DIM, WIDTH - 1 + T_MAX, generator=g).to(dev),
                w=torch.randn(DIM, WIDTH, generator=g).to(dev) * 0.5, bias=torch.randn(DIM, generator=g).to(dev),
                A_log=torch.randn(HV, generator=g).to(dev) * 0.3, dt_bias=torch.randn(HV, generator=g).to(dev),
                records=rs.ReplayRecords.allocate(B, T_MAX, H, HV, K, V, device=dev)))
        caches = [rs.LayerCache(lay["state"], lay["records"], lay["conv"], conv_width=WIDTH) for lay in self.layers]
        self.ctx = rs.CommitContext([caches[0::2], caches[1::2]], max_batch=B)

    def clone(self, dev: str) -> "Model":
        other = Model.__new__(Model)
        other.layers = []
        for lay in self.layers:
            copy = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in lay.items()}
            copy["records"] = rs.ReplayRecords.allocate(B, T_MAX, H, HV, K, V, device=dev)
            other.layers.append(copy)
        caches = [rs.LayerCache(lay["state"], lay["records"], lay["conv"], conv_width=WIDTH) for lay in other.layers]
        other.ctx = rs.CommitContext([caches[0::2], caches[1::2]], max_batch=B)
        return other

    def step(self, buf: dict) -> torch.Tensor:
        outs = []
        for i, lay in enumerate(self.layers):
            slots = buf["slots"][i % 2]
            y = rs.conv_verify(buf["x"], lay["conv"], lay["w"], lay["bias"], state_indices=slots,
                               query_start_loc=buf["qsl"])
            T = y.shape[0]
            q, k, v = y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V)
            outs.append(rs.gdn_verify(q, k, v, state=lay["state"], state_indices=slots, query_start_loc=buf["qsl"],
                                      records=lay["records"], a=buf["a"], b=buf["b"], A_log=lay["A_log"],
                                      dt_bias=lay["dt_bias"]))
        self.ctx.commit(buf["accepted"], buf["slots"], buf["qsl"], block_table=[None, buf["block_table"]],
                        num_computed_tokens=[None, buf["computed"]], block_size=[None, BLOCK])
        return torch.stack(outs)


def fill(buf: dict, step: int, gen: torch.Generator) -> None:
    """New values in the same buffers: lengths, slots (distinct, some rows padding), accepted counts,
    align-mode block tables and computed-token counts."""
    lens = torch.randint(0, T_MAX + 1, (B,), generator=gen)
    padding = torch.rand(B, generator=gen) < 0.3
    perm = torch.randperm(SLOTS // 2, generator=gen)
    slots0 = torch.where(padding, -1, perm[:B])
    blocks = (torch.randperm(SLOTS // 2, generator=gen) + SLOTS // 2)[:3 * B].view(B, 3)
    computed = torch.randint(0, BLOCK * 2, (B,), generator=gen)
    accepted = torch.minimum(torch.randint(1, T_MAX + 1, (B,), generator=gen), lens)
    slots1 = torch.where(padding, -1, blocks[torch.arange(B), computed // BLOCK])
    buf["qsl"].copy_(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(I32))
    buf["slots"][0].copy_(slots0.to(I32))
    buf["slots"][1].copy_(slots1.to(I32))
    buf["block_table"].copy_(blocks.to(I32))
    buf["computed"].copy_(computed.to(I32))
    buf["accepted"].copy_(accepted.to(I32))
    buf["x"].copy_(torch.randn(buf["x"].shape, generator=gen))
    buf["a"].copy_(torch.randn(buf["a"].shape, generator=gen))
    buf["b"].copy_(torch.randn(buf["b"].shape, generator=gen))


def test_whole_step_in_one_cuda_graph_replays_the_eager_bits():
    dev = "cuda"
    graphed = Model(0, dev)
    eager = graphed.clone(dev)
    T = B * T_MAX
    buf = dict(x=torch.zeros(T, DIM, device=dev), a=torch.zeros(T, HV, device=dev), b=torch.zeros(T, HV, device=dev),
               qsl=torch.zeros(B + 1, dtype=I32, device=dev),
               slots=[torch.zeros(B, dtype=I32, device=dev), torch.zeros(B, dtype=I32, device=dev)],
               block_table=torch.zeros(B, 3, dtype=I32, device=dev), computed=torch.zeros(B, dtype=I32, device=dev),
               accepted=torch.zeros(B, dtype=I32, device=dev))
    gen = torch.Generator().manual_seed(1)
    fill(buf, 0, gen)
    # Before capture: one eager step with these very buffers (compiles, uploads the group tables).
    graphed.step(buf)
    eager.step(buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = graphed.step(buf)
    for step in range(1, 6):
        fill(buf, step, gen)
        graph.replay()
        want = eager.step(buf)
        torch.cuda.synchronize()
        covered = int(buf["qsl"][-1])          # tokens past the last row are not written
        assert torch.equal(graph_out[:, :covered], want[:, :covered]), f"step {step}: outputs"
        for i, (g_lay, e_lay) in enumerate(zip(graphed.layers, eager.layers)):
            assert torch.equal(g_lay["state"], e_lay["state"]), f"step {step}, layer {i}: state"
            assert torch.equal(g_lay["conv"], e_lay["conv"]), f"step {step}, layer {i}: conv state"
            assert torch.equal(g_lay["records"].correction, e_lay["records"].correction), f"step {step}, layer {i}"
