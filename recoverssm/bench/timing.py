"""Device timing: CUDA events around each call, medians, rotated inputs, the copy ceiling."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

L2_FLUSH_BYTES = 4 * 60 * 2**20   # four times the H200's L2: rotated input sets exceed it


def copies_for(nbytes: int, minimum: int = 1, maximum: int = 16) -> int:
    """How many input sets to rotate so the working set is not served from L2."""
    return max(minimum, min(maximum, -(-L2_FLUSH_BYTES // max(nbytes, 1))))


def median_us(calls: Sequence[Callable[[], object]], warmup: int = 5, iters: int = 40,
              graph: bool = True) -> float:
    """Median device time of one call in microseconds; call ``i`` runs ``calls[i % len(calls)]``.

    With ``graph`` (the default) the calls are captured back to back in one CUDA graph and each
    replay is timed and divided by the calls in it: that measures the kernels, not the Python
    that launches them (host time is measured separately, :func:`host_times`). A call that cannot be
    captured falls back to per-call event timing.
    """
    if graph:
        try:
            return _graph_median_us(calls, iters)
        except Exception:  # noqa: BLE001 - not capturable: time the plain calls instead
            torch.cuda.synchronize()
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()   # surfaces any asynchronous CUDA error from the calls
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def _graph_median_us(calls: Sequence[Callable[[], object]], iters: int) -> float:
    per_graph = len(calls) * max(1, -(-8 // len(calls)))        # >= 8 calls, every input set alike
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                 # warm-up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)) / per_graph


class CopyCeiling:
    """Device copy time of a given traffic (bytes read + bytes written), memoised: the ceiling
    every case is compared with."""

    def __init__(self, device):
        self.device = device
        self._cache: dict[int, float] = {}

    def us(self, traffic_bytes: int) -> float:
        half = max(traffic_bytes // 2 // 4 * 4, 4)
        if half not in self._cache:
            n = copies_for(2 * half)
            srcs = [torch.randn(half // 4, device=self.device) for _ in range(n)]
            dsts = [torch.empty_like(s) for s in srcs]
            # An elementwise kernel, not copy_(): inside a CUDA graph a device-to-device copy_
            # becomes a memcpy node served by the copy engines (measured ~2.8 TB/s on the H200),
            # while every case here is an SM kernel reading and writing memory.
            calls = [lambda s=s, d=d: torch.mul(s, 1.0, out=d) for s, d in zip(srcs, dsts)]
            self._cache[half] = median_us(calls, iters=60)
            del srcs, dsts
        return self._cache[half]

    def tbps(self, traffic_bytes: int) -> float:
        return traffic_bytes / self.us(traffic_bytes) / 1e6


def host_times(call: Callable[[], object], iters: int = 200, device: str = "cuda") -> dict:
    """Median host time of one call after 10 warm-up calls, two ways: ``wall_us`` (elapsed) and
    ``cpu_us`` (CPU time of the calling thread, ``time.thread_time``). On a machine shared with
    other work the wall time also counts the time the thread waited for a core; the CPU time is
    what the call itself costs. The device work queues behind and is not counted in either (on
    ``device="cuda"`` it is synchronized before and after the timed calls)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(10):
        call()
    sync()
    wall, cpu = [], []
    for _ in range(iters):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        call()
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        wall.append((t1 - t0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
    sync()
    return dict(wall_us=statistics.median(wall), cpu_us=statistics.median(cpu))


def kernel_launches(call: Callable[[], object]) -> tuple[int, list[str]]:
    """Kernels launched by one call, counted with torch.profiler (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and not e.name.startswith(("Memcpy", "Memset", "cudaMemcpy"))]
    return len(names), names
