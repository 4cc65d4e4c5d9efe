"""Programmatic dependent launch (NVIDIA Hopper and newer) between the two recurrence launches.

Every verify, decode and snapshot call is two kernels: ``gdn_prepare_kernel`` (a few microseconds)
and the recurrence kernel, which needs its output. Launched plainly, the recurrence kernel starts
only when the preparation has finished and its first act is to wait for its state tile. As a
programmatic dependent launch (Triton's ``launch_pdl`` option) it starts while the preparation
runs: each program issues its state tile's loads, then waits (``griddepcontrol.wait``) until the
preparation's writes are visible, then reads them. The launch gap and the preparation hide behind
the state loads, which matters most for small batches (a whole call is a few microseconds).

The instructions are PTX: only the ``cuda`` backend enables this (``LaunchConfig.grid_dependency``),
and never under Triton's interpreter. ``griddepcontrol.wait`` is also correct when the kernel was
not launched as a dependent (it returns at once), so the switch only decides speed.
"""
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without these (the switch then stays off)
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait"]
