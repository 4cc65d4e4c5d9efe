"""What the Triton kernel tests (``test_kernel_*.py``) share: the two settings they run in, and
the calls they make through the ``cuda`` backend or ``cpu_ref``.

* ``interp``: Triton's CPU interpreter on CPU tensors, small shapes (runs in CI, no GPU);
* ``gpu``: compiled kernels on a CUDA GPU at real shapes (H=16, HV=48, K=V=128).
"""
import pytest

import recoverssm as rs
import torch

from helpers import legal_accepted, run_verify

SETTINGS = [
    pytest.param(dict(device="cpu", H=2, HV=4, K=16, V=16, lens=[[3, 1, 4, 0, 2], [1, 2]], Ts=[1, 2, 4]),
                 marks=pytest.mark.interpreter, id="interp"),
    pytest.param(dict(device="cuda", H=16, HV=48, K=128, V=128,
                      lens=[[4, 1, 3, 0, 2, 4, 4, 1], [2] * 8], Ts=[2, 4, 8]),
                 marks=pytest.mark.gpu, id="gpu"),
]
FP32_TOL = 2e-5


def dims(s):
    """The keyword arguments of :func:`helpers.make_batch_problem` for setting ``s``."""
    return dict(H=s["H"], HV=s["HV"], K=s["K"], V=s["V"], device=s["device"])


def verify(p, backend, records=None, **over):
    """``gdn_verify`` of problem ``p`` on ``backend``; returns ``(out, records)``."""
    return run_verify(p, records, backend=backend, **over)


def accepted_tensor(ns, p):
    """Accepted counts ``ns`` (one per row), clamped to each row's window, on ``p``'s device."""
    return torch.tensor(legal_accepted(ns, p.lens), dtype=torch.int32, device=p.q.device)


def commit(p, state, records, num_accepted, backend, **kw):
    """One single-layer commit of ``records`` into ``state`` with ``p``'s rows."""
    ctx = rs.CommitContext([[rs.LayerCache(state, records)]], max_batch=records.max_batch, backend=backend)
    ctx.commit(num_accepted, p.state_indices, p.qsl, **kw)


def recurrence_table(**fields):
    """The cuda backend's launch table with these recurrence fields (``config.RecurrenceSpec``)
    for both state dtypes."""
    from dataclasses import replace

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import RecurrenceSpec

    return replace(LAUNCH_TABLE, recurrence={dtype: replace(RecurrenceSpec(), **fields)
                                             for dtype in LAUNCH_TABLE.recurrence})


def commit_table(**fields):
    """The cuda backend's launch table with these commit fields (``config.CommitSpec``) for both
    state dtypes."""
    from dataclasses import replace

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    from recoverssm.backends.triton.config import CommitSpec

    return replace(LAUNCH_TABLE, commit={dtype: replace(CommitSpec(), **fields) for dtype in LAUNCH_TABLE.commit})


def to_cpu(p_state, records):
    """CPU copies of a state pool and its records (for cpu_ref)."""
    return p_state.cpu(), rs.ReplayRecords(records.correction.cpu(), records.key.cpu(), records.decay.cpu())
