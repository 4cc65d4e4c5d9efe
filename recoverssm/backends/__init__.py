"""Built-in backends: ``cpu_ref`` (readable PyTorch reference), ``cuda`` and ``xpu`` (shared Triton
kernels in ``triton/``)."""
