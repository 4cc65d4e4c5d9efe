"""The ``xpu`` backend: the shared Triton kernels (``recoverssm/backends/triton``) on Intel GPUs."""
