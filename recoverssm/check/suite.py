"""The cases ``recoverssm check`` runs, and the run itself."""
from __future__ import annotations

import random
from typing import Callable, Optional, Union

import torch

from recoverssm.core.registry import registry

from .align import check_align
from .conv import check_conv, check_conv_decode
from .deferred import check_deferred
from .plans import check_plans
from .problems import AlignCase, ConvCase, ConvDecodeCase, DeferredCase, Mamba2Options, PlanCase, RecurrenceCase
from .recurrence import check_recurrence
from .report import Report

Case = Union[RecurrenceCase, ConvCase, ConvDecodeCase, AlignCase, PlanCase, DeferredCase]

#: the checker of each kind of case; each takes ``(report, case, backend, device, gen, rng)``
CHECKERS = {RecurrenceCase: check_recurrence, ConvCase: check_conv, ConvDecodeCase: check_conv_decode,
            AlignCase: check_align, PlanCase: check_plans, DeferredCase: check_deferred}


def cases(device: torch.device) -> list[Case]:
    """Small shapes everywhere (the Triton interpreter runs these on CPU); larger ones on a GPU."""
    bf16 = torch.bfloat16
    # a Mamba2 layer with every optional input: the gate z, D per channel, dt clamped at both ends
    m2_full = Mamba2Options(D="channel", z=True, dt_limit=(0.05, 0.5))
    suite = [
        RecurrenceCase(lengths=(4, 3, 0, 4), pad_rows=(3,)),
        RecurrenceCase(lengths=(3, 1, 2), H=1, HV=2, K=16, V=8, gates="pre", l2norm=False),
        RecurrenceCase(lengths=(4, 2), state_dtype=bf16),
        RecurrenceCase(lengths=(2, 1, 2, 2), H=2, HV=2, K=8, V=16, act_dtype=bf16),
        RecurrenceCase(kind="kda", lengths=(4, 3, 0, 4), pad_rows=(3,), H=2, HV=4, K=16, V=8),
        RecurrenceCase(kind="kda", lengths=(3, 1, 2), H=2, HV=2, K=16, V=16, state_dtype=bf16, lower_bound=-5.0),
        RecurrenceCase(kind="kda", lengths=(2, 3), H=1, HV=2, K=8, V=16, gates="pre", l2norm=False),
        RecurrenceCase(kind="mamba2", lengths=(4, 3, 0, 4), pad_rows=(3,), H=2, HV=4, K=16, V=8),
        RecurrenceCase(kind="mamba2", lengths=(3, 1, 2), H=1, HV=4, K=16, V=8, state_dtype=bf16, act_dtype=bf16,
                       mamba2=Mamba2Options(D=None, z=True, dt_limit=(0.001, None), A=True)),
        RecurrenceCase(kind="mamba2", lengths=(2, 3, 1), H=2, HV=2, K=8, V=16, mamba2=m2_full),
        ConvCase(lengths=(4, 0, 3, 2), pad_rows=(3,)),
        ConvCase(lengths=(1, 4), dim=40, width=2, silu=False, bias=False),
        ConvCase(lengths=(3, 3), dim=64, act_dtype=bf16),
        ConvDecodeCase(lengths=(3,) * 4, pad_rows=(2,)),
        ConvDecodeCase(lengths=(2,) * 3, dim=40, width=2, state_dtype=bf16, silu=False, bias=False),
        AlignCase(lengths=(4, 4, 3, 4)),
        AlignCase(lengths=(4, 2, 4), block_sizes=(2, 5), permute=True, pad_row=True),
        AlignCase(lengths=(3, 4), state_dtype=bf16, block_sizes=(3, 4)),
        AlignCase(kind="kda", lengths=(4, 2, 3), H=2, HV=2, K=16, V=16, block_sizes=(2, 3), lower_bound=-5.0),
        AlignCase(kind="mamba2", lengths=(4, 2, 3), H=1, HV=4, K=16, V=8, block_sizes=(3, 2), permute=True,
                  mamba2=m2_full),
        AlignCase(kind="mamba2", lengths=(3, 4, 2), H=2, HV=4, K=8, V=8, block_sizes=(2, 4), pad_row=True,
                  state_dtype=bf16, mamba2=Mamba2Options(dt_limit=(None, 0.3))),
        PlanCase(),
        DeferredCase(),
        DeferredCase(kinds=("kda", "gdn"), block_sizes=(2, 3), align=True, max_batch=5, state_dtype=bf16,
                     lower_bound=-5.0),
        DeferredCase(kinds=("mamba2", "gdn", "kda", "mamba2"), block_sizes=(2, 3), align=True, mamba2=m2_full),
        DeferredCase(kinds=("gdn", "mamba2"), max_batch=5, state_dtype=bf16, mamba2=Mamba2Options(z=True, A=True)),
    ]
    if device.type != "cpu":
        suite += [
            RecurrenceCase(lengths=(8,) * 12 + (5, 0, 3, 8), pad_rows=(14,), H=4, HV=8, K=128, V=128),
            RecurrenceCase(lengths=(4,) * 16, H=16, HV=32, K=128, V=128, state_dtype=bf16),
            RecurrenceCase(lengths=(6, 1, 6, 4), H=4, HV=8, K=64, V=128, act_dtype=bf16, gates="pre"),
            RecurrenceCase(kind="kda", lengths=(8,) * 12 + (5, 0, 3, 8), pad_rows=(14,), H=8, HV=8, K=128, V=128),
            RecurrenceCase(kind="kda", lengths=(4,) * 16, H=32, HV=32, K=128, V=128, state_dtype=bf16,
                           lower_bound=-5.0),
            RecurrenceCase(kind="kda", lengths=(6, 1, 6, 4), H=4, HV=8, K=64, V=128, act_dtype=bf16, gates="pre"),
            # Mamba2 at model sizes (dstate 128, headdim 64, grouped B/C)
            RecurrenceCase(kind="mamba2", lengths=(8,) * 12 + (5, 0, 3, 8), pad_rows=(14,), H=2, HV=16, K=128,
                           V=64),
            RecurrenceCase(kind="mamba2", lengths=(4,) * 16, H=1, HV=32, K=128, V=64, state_dtype=bf16,
                           act_dtype=bf16, mamba2=Mamba2Options(z=True, dt_limit=(0.001, None))),
            RecurrenceCase(kind="mamba2", lengths=(6, 1, 6, 4), H=8, HV=16, K=128, V=64, act_dtype=bf16,
                           mamba2=m2_full),
            ConvCase(lengths=(8,) * 8 + (3, 0), dim=4096 + 2048),
            ConvDecodeCase(lengths=(2,) * 64, pad_rows=(5,), dim=4096 + 2048),
            AlignCase(lengths=(4,) * 8, block_sizes=(8, 5), layers=4, H=4, HV=8, K=128, V=128),
            AlignCase(lengths=(6, 6, 2, 6), block_sizes=(4, 16), H=4, HV=8, K=64, V=128,
                      state_dtype=bf16, permute=True),
            AlignCase(kind="kda", lengths=(4,) * 8, block_sizes=(8, 5), layers=4, H=8, HV=8, K=128, V=128),
            AlignCase(kind="mamba2", lengths=(4,) * 8, block_sizes=(8, 5), layers=4, H=2, HV=16, K=128, V=64,
                      mamba2=m2_full),
            DeferredCase(kinds=("gdn", "kda", "gdn", "kda"), block_sizes=(4, 8), align=True, steps=10, max_batch=8,
                         T=4, H=2, HV=4, K=128, V=128, conv_width=4),
            DeferredCase(kinds=("mamba2", "gdn", "mamba2", "kda"), block_sizes=(4, 8), align=True, steps=10,
                         max_batch=8, T=4, H=2, HV=4, K=128, V=128, conv_width=4, mamba2=m2_full),
        ]
    return suite


def run_check(backend_name: Optional[str], device: torch.device, seed: int = 0,
              on_case: Optional[Callable[[str], None]] = None) -> tuple[Report, object, str]:
    """Run the suite; returns ``(report, backend, reason)``. ``on_case(label)`` after each case.

    One torch generator and one ``random.Random``, both from ``seed``, feed every case in turn, so
    a case's inputs depend on the cases before it: the suite is reproduced as a whole."""
    backend, reason = registry().resolve(backend_name, device)
    report = Report()
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for case in cases(device):
        CHECKERS[type(case)](report, case, backend, device, gen, rng)
        if on_case:
            on_case(case.label)
    return report, backend, reason
