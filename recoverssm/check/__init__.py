"""``recoverssm check``: run one backend against the ``cpu_ref`` reference on random problems.

Inputs are drawn on CPU (fixed seed), copied to the target device, and the results copied back.
Two kinds of items:

* **against cpu_ref** (``vs cpu_ref``): fp32 outputs, records and states must agree within a
  relative tolerance, ``max |got - ref| / max |ref| <= tol`` (1e-5 for fp32; 1e-2 where a value is
  stored in bf16, one bf16 ulp being 2**-8, or computed from a bf16 pool's state, which is rounded
  after every token), since another device may round ``exp`` or order a sum differently. Conv
  states (pure copies) and commit plans must be equal.
* **bit-exact** (``== own ...``): the backend against itself. Its commit must leave exactly the
  states its own per-token ``gdn_decode`` / ``kda_decode`` / ``mamba2_decode`` leaves after the
  same tokens (the library's promise), verify must not write the state, ``conv_decode`` must
  leave the history its own ``conv_verify`` + commit leaves, and a context that defers its
  commits must give an eager one's outputs and, after a flush, its states.

With ``--backend cpu_ref`` on CPU the reference is checked against itself (a smoke test of the
API paths and of the bit-exact promises, which do not compare against cpu_ref).

* :mod:`.report`: the items, the tolerances and the table;
* :mod:`.problems`: the cases and their random inputs;
* :mod:`.recurrence` (GDN, KDA, Mamba2), :mod:`.conv`, :mod:`.align`, :mod:`.plans`,
  :mod:`.deferred` (deferred commits over a random step sequence, :mod:`.sequence`): one checker
  per kind of case;
* :mod:`.suite`: the cases run and the run; :mod:`.cli`: the command line.
"""
from .cli import add_arguments, default_device, main
from .problems import AlignCase, ConvCase, ConvDecodeCase, DeferredCase, Mamba2Options, PlanCase, RecurrenceCase
from .report import REF, TOL, Item, Report, format_report
from .suite import cases, run_check

__all__ = ["AlignCase", "ConvCase", "ConvDecodeCase", "DeferredCase", "Item", "Mamba2Options", "PlanCase", "REF",
           "RecurrenceCase", "Report", "TOL", "add_arguments", "cases", "default_device", "format_report", "main",
           "run_check"]
