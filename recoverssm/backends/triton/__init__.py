"""Triton kernels shared by the ``cuda`` and ``xpu`` backends, and their Python launchers.

Each kernel's readable twin is in ``recoverssm/backends/cpu_ref`` (same file names):

=================  ==========================  ==============================
op                 kernel (this package)       reference (cpu_ref)
=================  ==========================  ==============================
conv_verify        conv.py                     conv.py
gdn verify/decode  gdn.py                      gdn.py
 /snapshot
plan_commit        commit.py (plan_row)        core/plan.py (plan_rows)
commit, compaction commit.py                   commit.py, conv.py
=================  ==========================  ==============================
"""
