"""``recoverssm demo --tp N``: the demo under tensor parallelism, one process per rank.

Started by ``torchrun --nproc-per-node N -m recoverssm demo --tp N`` (gloo on ``--device cpu``,
NCCL on ``--device cuda``, one GPU per rank). Every rank holds, of every layer,

* ``H/N`` q/k heads and ``HV/N`` value heads (rank ``r``: q/k heads ``[r*H/N, (r+1)*H/N)``, value
  heads ``[r*HV/N, (r+1)*HV/N)``; a value head's q/k head stays on the same rank), and the conv
  channels of those heads (its q, k and v channels, in the order q | k | v);
* the matching columns of the fused in-projection (column parallel: it computes its own slice of
  q, k, v, a, b, z, nothing else; for KDA, ``a`` holds ``K`` gate inputs per value head), the
  matching rows of the out-projection (row parallel: a partial sum of the hidden update, summed over
  the ranks by ``torch.distributed.all_reduce``);
* its own state pools, conv states, replay records and ONE :class:`~recoverssm.CommitContext`
  over its local layers: ``rs.conv_verify``, ``rs.gdn_verify`` (or ``rs.kda_verify``) and the
  commit run on the shard only.

Everything else (embedding, norms, MLP, LM head, sampling, the draft) is replicated.

GDN and KDA models only (:data:`TP_ARCHS`): the Mamba2 hybrid (``--arch mamba2``) is refused with a
:class:`TPSetupError`. Sharding it would need its own column map (``z | x | B | C | dt``, B and C by
group), a group-wise gated norm on each rank and head-parallel attention layers with their KV
caches: another sharded model, which this demo does not have.

**What is checked, on every rank.** The whole single-process demo loop (:func:`.run.run_demo`) runs
on each rank with the sharded model: the speculative path's committed states and conv histories
are compared with ``torch.equal`` to that rank's OWN per-token path (``rs.gdn_decode`` or
``rs.kda_decode`` on the same shard, the same all-reduces), every accepted position's logits too,
and the prefix-cache blocks at the end. The reference is the sharded model, not the
single-process one: an all-reduce of partial out-projections rounds differently from one matmul
over all heads, so a TP run and a single-process run legitimately differ in the last bits (and
may, rarely, pick other greedy tokens).

**Across ranks.** Every logits call all-gathers the greedy tokens (argmax) and compares them: the
replicated part of the model must give every rank the same tokens, or the ranks would take different
paths and their collectives would no longer match. The check runs before any rank acts on the
tokens, so a divergence stops every rank at once with the same message. Logits rows are compared bit
for bit too (reported, not required). At the end the generated tokens of all ranks are compared.

**Batch invariance with collectives.** The out-projection and its all-reduce run one token at a time
(inside the model's ``rowwise``), so a token's all-reduce has the same shape whichever path and
window it belongs to: a collective may pick its algorithm (and so its summation order) by message
size, and a per-token message keeps both paths on the same choice.

If one rank finds a mismatch of its own (a state that differs from its per-token path), it raises
and exits; the other ranks then fail in their next collective (gloo reports the closed connection)
or are stopped by torchrun, which ends all workers when one fails.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import DemoMismatch
from .model import LayerWeights, ModelConfig, TinyModel, rmsnorm, rowwise
from .run import DemoConfig, DemoResult, StepStats, run_demo

#: NVLink multicast (NVLS) stays off on shared hosts: set before NCCL is initialised.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: how long a collective waits for the other ranks before it fails (a peer that died, a hang)
DEFAULT_TIMEOUT_S = 300


#: the layer kinds the sharded model (:class:`ShardedTinyModel`) implements
TP_ARCHS = ("gdn", "kda")


class TPSetupError(ValueError):
    """The run cannot be sharded or started as asked (sizes, world size, device, layer kind)."""


# ------------------------------------------------------------------------------------------------
# which heads and channels a rank holds
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadShard:
    """Rank ``rank`` of ``world``: q/k heads ``[h0, h1)``, value heads ``[hv0, hv1)`` of a layer with
    ``H`` q/k heads of dim ``K``, ``HV`` value heads of dim ``V`` and ``gate_channels`` gate inputs
    per value head (:attr:`ModelConfig.gate_channels`)."""

    rank: int
    world: int
    H: int
    HV: int
    K: int
    V: int
    gate_channels: int = 1

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> "HeadShard":
        """Rank ``rank``'s shard of the layers of ``cfg`` (the full model's config)."""
        if cfg.arch not in TP_ARCHS:
            raise TPSetupError(f"tensor parallelism shards {' and '.join(a.upper() for a in TP_ARCHS)} models "
                               f"only, not --arch {cfg.arch} (the Mamba2 hybrid has no sharded model); "
                               f"run it without --tp")
        return cls(rank, world, cfg.H, cfg.HV, cfg.K, cfg.V, cfg.gate_channels)

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise TPSetupError(f"rank {self.rank} is not in [0, {self.world})")
        for name, n in (("H (q/k heads)", self.H), ("HV (value heads)", self.HV)):
            if n % self.world:
                raise TPSetupError(f"{name} = {n} does not split over {self.world} ranks: "
                                   f"tensor parallelism needs a multiple of the rank count")
        if self.HV % self.H:
            raise TPSetupError(f"HV = {self.HV} is not a multiple of H = {self.H}")

    @property
    def h0(self) -> int:
        return self.rank * self.H // self.world

    @property
    def h1(self) -> int:
        return (self.rank + 1) * self.H // self.world

    @property
    def hv0(self) -> int:
        return self.rank * self.HV // self.world

    @property
    def hv1(self) -> int:
        return (self.rank + 1) * self.HV // self.world

    @property
    def local_H(self) -> int:
        return self.h1 - self.h0

    @property
    def local_HV(self) -> int:
        return self.hv1 - self.hv0

    @property
    def conv_dim(self) -> int:
        """Channels of the full conv (q | k | v)."""
        return 2 * self.H * self.K + self.HV * self.V

    def conv_channels(self) -> torch.Tensor:
        """int64 indices of this rank's conv channels in the full ``q | k | v`` layout, in the local
        order ``q | k | v`` (so the local conv input is laid out like the full one)."""
        H, K, V = self.H, self.K, self.V
        q = torch.arange(self.h0 * K, self.h1 * K)
        k = H * K + q
        v = torch.arange(2 * H * K + self.hv0 * V, 2 * H * K + self.hv1 * V)
        return torch.cat([q, k, v])

    def proj_columns(self) -> torch.Tensor:
        """int64 indices of this rank's columns of the fused in-projection
        ``q | k | v | a | b | z``, in the same local order."""
        cd, HV, V, G = self.conv_dim, self.HV, self.V, self.gate_channels
        b0 = cd + HV * G
        z0 = b0 + HV
        a = torch.arange(cd + self.hv0 * G, cd + self.hv1 * G)
        b = torch.arange(b0 + self.hv0, b0 + self.hv1)
        z = torch.arange(z0 + self.hv0 * V, z0 + self.hv1 * V)
        return torch.cat([self.conv_channels(), a, b, z])

    @property
    def heads(self) -> slice:
        """This rank's q/k heads (``key`` records, ``q``, ``k``)."""
        return slice(self.h0, self.h1)

    @property
    def v_heads(self) -> slice:
        """This rank's value heads (state, ``correction``/``decay`` records, ``v``, ``a``, ``b``)."""
        return slice(self.hv0, self.hv1)

    def describe(self) -> str:
        return (f"q/k heads {self.h0}..{self.h1 - 1} of {self.H}, value heads {self.hv0}..{self.hv1 - 1} "
                f"of {self.HV}, conv channels {self.conv_channels().numel()} of {self.conv_dim}")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank model sizes: ``H/N`` q/k heads, ``HV/N`` value heads (conv and projection widths
    follow)."""
    HeadShard.of(cfg, 0, world)          # validates
    return dataclasses.replace(cfg, H=cfg.H // world, HV=cfg.HV // world)


# ------------------------------------------------------------------------------------------------
# the sharded model
# ------------------------------------------------------------------------------------------------
class ShardedTinyModel(TinyModel):
    """Rank ``rank``'s shard of a :class:`TinyModel` (built from the full model's weights).

    ``cfg`` holds the LOCAL sizes (``H/N``, ``HV/N``, conv and projection widths), so the engines
    of :mod:`.spec` and :mod:`.reference` allocate per-rank states, conv states and records and call
    the ops on the shard without knowing about parallelism. ``full_cfg`` is the model's config.
    ``finish_layer`` sums the out-projection over the ranks; ``logits`` checks that every rank
    gets the same greedy tokens.
    """

    def __init__(self, full: TinyModel, rank: int, world: int, *, device=None, group=None):
        # No TinyModel.__init__: the weights are slices of ``full``'s.
        c = full.cfg
        self.full_cfg = c
        self.shard = HeadShard.of(c, rank, world)
        self.cfg = shard_config(c, world)
        self.rank, self.world, self.group = rank, world, group
        self.device = torch.device(device) if device is not None else full.device
        dev = self.device

        def mine(t: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return t.index_select(dim, index.to(t.device)).contiguous().to(dev)

        conv_ch, cols = self.shard.conv_channels(), self.shard.proj_columns()
        hv = torch.arange(self.shard.hv0, self.shard.hv1)
        out_rows = torch.arange(self.shard.hv0 * c.V, self.shard.hv1 * c.V)
        self.embedding = full.embedding.to(dev)
        self.layers = []
        for w in full.layers:
            self.layers.append(LayerWeights(
                norm=w.norm.to(dev),
                w_in=mine(w.w_in, cols, dim=1),              # column parallel
                conv_w=mine(w.conv_w, conv_ch), conv_b=mine(w.conv_b, conv_ch),
                A_log=mine(w.A_log, hv), dt_bias=mine(w.dt_bias, hv),
                o_norm=w.o_norm.to(dev),                      # shared by all heads: replicated
                w_out=mine(w.w_out, out_rows),                # row parallel
                mlp_norm=w.mlp_norm.to(dev), w_up=w.w_up.to(dev), w_down=w.w_down.to(dev)))
        self.final_norm = full.final_norm.to(dev)
        self.w_head = full.w_head.to(dev)
        self.all_reduces = 0
        self.token_rows_checked = 0        # greedy tokens compared across ranks
        self.logits_rows_checked = 0
        self.logits_rows_differing = 0     # logits rows whose bits differ between ranks (info)

    def finish_layer(self, i: int, h: torch.Tensor, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """As :meth:`TinyModel.finish_layer`, with a row-parallel out-projection: the gated norm and
        ``@ w_out`` over this rank's heads, then ``all_reduce(SUM)`` of the ``[1, hidden]`` partial,
        one token at a time; residual and MLP replicated."""
        c, w = self.cfg, self.layers[i]

        def one(h1, o1, z1):
            gated = rmsnorm(o1, w.o_norm, c.eps) * F.silu(z1)          # this rank's heads, [1, HV/N, V]
            partial = gated.flatten(1) @ w.w_out                         # [1, hidden]
            if partial.numel():
                dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
                self.all_reduces += 1
            h1 = h1 + partial
            return h1 + F.silu(rmsnorm(h1, w.mlp_norm, c.eps) @ w.w_up) @ w.w_down

        return rowwise(one, h, o, z)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h)
        self._check_replicated(out)
        return out

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def _check_replicated(self, logits: torch.Tensor) -> None:
        """All ranks must get the same greedy tokens from their (replicated) logits."""
        if logits.shape[0] == 0:
            return
        tokens = logits.argmax(-1)
        all_tokens = self._gather(tokens)
        for r, t in enumerate(all_tokens):
            if not torch.equal(t, all_tokens[0]):
                raise DemoMismatch(
                    f"greedy tokens differ across ranks: rank 0 has {all_tokens[0].tolist()}, "
                    f"rank {r} has {t.tolist()} (the replicated part of the model diverged)")
        self.token_rows_checked += tokens.numel()
        all_logits = self._gather(logits)
        same = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        for lg in all_logits[1:]:
            same &= (lg == all_logits[0]).all(-1)
        self.logits_rows_checked += logits.shape[0]
        self.logits_rows_differing += int((~same).sum())


#: alias of :class:`ShardedTinyModel`, the name its callers import
ShardedTinyGDN = ShardedTinyModel


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
@dataclass
class TPDemoResult:
    """One rank's view of a TP demo run. ``ranks``: every rank's summary (all-gathered)."""

    rank: int
    world: int
    dist_backend: str
    shard: HeadShard
    result: DemoResult
    ranks: list[dict] = field(default_factory=list)
    token_rows_checked: int = 0
    logits_rows_checked: int = 0
    logits_rows_differing: int = 0

    def to_json(self) -> dict:
        out = self.result.to_json()
        out["tp"] = {"world": self.world, "dist_backend": self.dist_backend,
                     "token_rows_checked_across_ranks": self.token_rows_checked,
                     "logits_rows_checked_across_ranks": self.logits_rows_checked,
                     "logits_rows_differing_across_ranks": self.logits_rows_differing,
                     "tokens_equal_across_ranks": True, "ranks": self.ranks}
        return out


def _rank_summary(rank: int, shard: HeadShard, model: ShardedTinyModel, res: DemoResult) -> dict:
    return {"rank": rank, "shard": shard.describe(), "backend": res.backend,
            "compared_slots": res.compared_slots, "compared_logits": res.compared_logits,
            "prefix_blocks_checked": res.prefix_blocks_checked, "tokens": res.tokens,
            "ref_tokens": res.ref_tokens, "accepted": [s.accepted for s in res.steps],
            "all_reduces": model.all_reduces, "memory": res.memory}


def run_tp_demo(cfg: DemoConfig, *, group=None, on_step: Optional[Callable[[StepStats], None]] = None,
                on_prefill: Optional[Callable[[int], None]] = None) -> TPDemoResult:
    """Run the demo on this rank's shard (the process group must be initialised; ``cfg.device`` is
    this rank's device). Raises :class:`DemoMismatch` at the first difference, on the rank that
    sees it (cross-rank token differences: on every rank)."""
    if not dist.is_initialized():
        raise TPSetupError("run_tp_demo needs torch.distributed initialised (see init_distributed)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard = HeadShard.of(cfg.model, rank, world)
    made: list[ShardedTinyModel] = []

    def make_model(mcfg: ModelConfig, device: torch.device) -> ShardedTinyModel:
        m = ShardedTinyModel(TinyModel(mcfg, "cpu"), rank, world, device=device, group=group)
        made.append(m)
        return m

    res = run_demo(cfg, on_step=on_step, on_prefill=on_prefill, make_model=make_model)
    model = made[0]
    ranks: list[Optional[dict]] = [None] * world
    dist.all_gather_object(ranks, _rank_summary(rank, shard, model, res), group=group)
    for other in ranks[1:]:
        for key in ("tokens", "ref_tokens", "accepted"):
            if other[key] != ranks[0][key]:
                raise DemoMismatch(f"{key} differ across ranks: rank 0 {ranks[0][key]}, "
                                   f"rank {other['rank']} {other[key]}")
    return TPDemoResult(rank=rank, world=world, dist_backend=dist.get_backend(group), shard=shard,
                        result=res, ranks=ranks, token_rows_checked=model.token_rows_checked,
                        logits_rows_checked=model.logits_rows_checked,
                        logits_rows_differing=model.logits_rows_differing)


# ------------------------------------------------------------------------------------------------
# process group
# ------------------------------------------------------------------------------------------------
def dist_backend_for(device_type: str) -> str:
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    raise TPSetupError(f"tensor parallelism runs on --device cpu (gloo) or cuda (nccl), not {device_type!r}")


def init_distributed(tp: int, device_type: str, *, timeout_s: float = DEFAULT_TIMEOUT_S
                     ) -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun set up (``env://``). Returns ``(rank, world, local_rank,
    device)``. ``--tp 1`` without torchrun runs a world of one (an in-memory store).

    For NCCL, NVLink multicast is switched off first (:data:`NCCL_ENV`) and each rank takes
    ``cuda:LOCAL_RANK``."""
    if not dist.is_available():
        raise TPSetupError("this torch build has no torch.distributed")
    if tp < 1:
        raise TPSetupError(f"--tp must be >= 1, got {tp}")
    backend = dist_backend_for(device_type)
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not launched and tp != 1:
        raise TPSetupError(f"--tp {tp} needs {tp} processes: start it with "
                           f"torchrun --nproc-per-node {tp} -m recoverssm demo --tp {tp} ...")
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    rank = int(os.environ["RANK"]) if launched else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if launched else 0
    if world != tp:
        raise TPSetupError(f"--tp {tp} but torchrun started {world} processes (WORLD_SIZE); "
                           f"use --nproc-per-node {tp}")
    if backend == "nccl":
        os.environ.update(NCCL_ENV)
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            raise TPSetupError(f"rank {rank} needs cuda:{local_rank}, but this host has "
                               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs "
                               f"(--device cpu runs the ranks on gloo)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kw = dict(backend=backend, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        kw["device_id"] = device
    if launched:
        dist.init_process_group(init_method="env://", **kw)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kw)
    return rank, world, local_rank, device
