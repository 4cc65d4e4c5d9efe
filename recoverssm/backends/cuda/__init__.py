"""The ``cuda`` backend: the shared Triton kernels (``recoverssm/backends/triton``) on NVIDIA GPUs."""
