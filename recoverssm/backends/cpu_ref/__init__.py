"""The ``cpu_ref`` backend: the readable, exact PyTorch reference of every op (the kernels' twin)."""
