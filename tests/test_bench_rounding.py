"""The rounding suite of ``recoverssm bench`` (``recoverssm/bench/rounding.py``) without a GPU:
tiny shapes through the Triton kernels under the interpreter (or on a GPU), the timer replaced;
the rows carry both modes' times and their ratios, and the two modes really ran differently."""
from __future__ import annotations

import pytest
import torch

from recoverssm.bench import rounding
from recoverssm.console import ProgressBar

from helpers import backends, device_of


pytestmark = pytest.mark.skipif("cuda" not in backends(), reason="needs the Triton kernels (GPU or interpreter)")


def test_rows_hold_both_modes(monkeypatch):
    """Each row times the default mode, then the other; every op of a mode runs in that mode."""
    modes = []
    monkeypatch.setattr(rounding, "grid", lambda quick: [(2, 3)])
    monkeypatch.setattr(rounding, "copies_for", lambda state_bytes: 1)
    window, snapshot, deferred = rounding.window, rounding.rs.gdn_spec_decode_snapshot, rounding.DeferredLayer

    def recorded_window(*args, round_each_token, **kw):
        modes.append(("window", round_each_token))
        return window(*args, round_each_token=round_each_token, **kw)

    def recorded_snapshot(*args, round_each_token, **kw):
        modes.append(("snapshot", round_each_token))
        return snapshot(*args, round_each_token=round_each_token, **kw)

    class RecordedDeferred(deferred):
        def __init__(self, w, *args, **kw):
            super().__init__(w, *args, **kw)
            modes.append(("deferred", self.records.round_each_token))

    def fake_timer(calls, *a, **k):
        for call in calls:
            call()
        return 2.0 if modes[-1][1] else 1.0          # the mode of the case being timed

    monkeypatch.setattr(rounding, "window", recorded_window)
    monkeypatch.setattr(rounding.rs, "gdn_spec_decode_snapshot", recorded_snapshot)
    monkeypatch.setattr(rounding, "DeferredLayer", RecordedDeferred)
    monkeypatch.setattr(rounding, "median_us", fake_timer)
    with ProgressBar(1, "t", enabled=False) as progress:
        rows = rounding.bench_rounding(False, progress, device=device_of("cuda"), dims=(1, 2, 16, 16))
    (row,) = rows
    assert row["kind"] == "rounding" and row["N"] == 2 and row["T"] == 3 and row["HV"] == 2
    for op in ("verify", "commit", "snapshot", "deferred_step"):
        assert row[f"{op}_us"] == 2.0 and row[f"{op}_off_us"] == 1.0 and row[f"{op}_cost"] == 2.0
    on = [m for what, m in modes[:len(modes) // 2]]
    off = [m for what, m in modes[len(modes) // 2:]]
    assert {what for what, _ in modes} == {"window", "snapshot", "deferred"}
    assert on and all(on) and off and not any(off)


def test_the_two_modes_give_different_states():
    """The suite times what it says: with the same inputs, the modes' verify + commit differ."""
    dev = device_of("cuda")
    states = []
    for mode in (True, False):
        w = rounding.window(2, 4, 1, 2, 16, 16, state_dtype=torch.bfloat16, device=dev, round_each_token=mode)
        ctx = rounding.rs.CommitContext([[rounding.rs.LayerCache(w.state, w.records)]], max_batch=2)
        w.verify()
        ctx.commit(torch.tensor([4, 3], dtype=torch.int32, device=dev), w.state_indices, w.query_start_loc)
        states.append(w.state.clone())
    assert not torch.equal(*states)
