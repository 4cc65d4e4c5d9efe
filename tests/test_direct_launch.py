"""``backends/triton/direct_launch.py`` with a stand-in kernel and stand-in CUDA tensors: which
path launches, how many times, and with which arguments (the GPU tests run the real thing)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from recoverssm.backends.triton import direct_launch
from recoverssm.backends.triton.direct_launch import DirectLauncher


class FakeTensor:
    """What the launcher reads of a CUDA tensor."""

    def __init__(self, address: int, dtype=torch.float32):
        self.device = SimpleNamespace(type="cuda", index=0)
        self.dtype = dtype
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def param(name, constexpr=False):
    return SimpleNamespace(name=name, is_constexpr=constexpr, do_not_specialize=False,
                           do_not_specialize_on_alignment=False)


class FakeKernel:
    """A ``@triton.jit`` stand-in: ``kernel[grid](...)`` is Triton's launch path; the compiled
    object it returns has ``run``, the launcher the direct path calls."""

    __name__ = "fake_kernel"
    params = [param("x_ptr"), param("out_ptr"), param("n"), param("BLOCK", constexpr=True)]

    def __init__(self):
        self.triton_launches = []
        self.direct_launches = []
        self.refuse = False
        kernel = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            def run(self, *args):
                if kernel.refuse:
                    raise TypeError("refused")
                kernel.direct_launches.append(args)

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_launches.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(direct_launch, "_current_stream", lambda index: 7)
    return FakeKernel()


def test_the_first_call_compiles_then_calls_launch_directly_and_bind(kernel):
    launcher = DirectLauncher(kernel)
    x, out = FakeTensor(1024), FakeTensor(2048)
    args, constexprs = (x, out, 5), dict(BLOCK=128)
    assert launcher((4,), args, constexprs, {}, bind=True) is None          # compiled through Triton
    assert (len(kernel.triton_launches), len(kernel.direct_launches)) == (1, 0)
    bound = launcher((4,), args, constexprs, {}, bind=True)                 # direct, and bound
    assert (len(kernel.triton_launches), len(kernel.direct_launches)) == (1, 1)
    assert kernel.direct_launches[0] == (4, 1, 1, 7, "function", "metadata", None, None, None, x, out, 5, 128)
    assert bound() is True                                                  # addresses as integers
    assert kernel.direct_launches[1] == (4, 1, 1, 7, "function", "metadata", None, None, None, 1024, 2048, 5, 128)
    assert len(kernel.triton_launches) == 1


def test_a_refused_direct_call_launches_once_through_triton(kernel):
    launcher = DirectLauncher(kernel)
    args, constexprs = (FakeTensor(1024), FakeTensor(2048), 5), dict(BLOCK=128)
    launcher((4,), args, constexprs, {})
    kernel.refuse = True
    assert launcher((4,), args, constexprs, {}, bind=True) is None
    assert (len(kernel.triton_launches), len(kernel.direct_launches)) == (2, 0)
    assert not launcher.enabled


def test_a_bound_launch_that_is_refused_launches_nothing_and_says_so(kernel):
    launcher = DirectLauncher(kernel)
    args, constexprs = (FakeTensor(1024), FakeTensor(2048), 5), dict(BLOCK=128)
    launcher((4,), args, constexprs, {})
    bound = launcher((4,), args, constexprs, {}, bind=True)
    kernel.refuse = True
    assert bound() is False          # it holds no tensor: the caller takes the op path instead
    assert (len(kernel.triton_launches), len(kernel.direct_launches)) == (1, 1)


def test_a_changed_alignment_is_another_binary(kernel):
    launcher = DirectLauncher(kernel)
    constexprs = dict(BLOCK=128)
    launcher((4,), (FakeTensor(1024), FakeTensor(2048), 5), constexprs, {})
    launcher((4,), (FakeTensor(1028), FakeTensor(2048), 5), constexprs, {})    # not 16-byte aligned
    assert (len(kernel.triton_launches), len(kernel.direct_launches)) == (2, 0)


def test_a_repeated_launch_takes_a_device_guard_only_where_several_devices_are_seen():
    from recoverssm.backends.triton.backend import TritonBackend

    guarded = []

    class Backend(TritonBackend):
        name = "guard-test"
        device_types = ("cuda",)
        devices = 2

        def device_guard(self, device):
            guarded.append(device)
            return contextlib.nullcontext()

        def one_device(self):
            return self.devices == 1

    backend, device = Backend(), torch.device("cuda", 1)
    assert backend.launch_on(device, None) is None           # nothing bound
    launches = []

    def bound():
        launches.append(len(guarded))
        return True

    assert backend.launch_on(device, bound)() and guarded == [device] and launches == [1]
    backend.devices = 1
    repeat = backend.launch_on(device, bound)
    assert repeat.run is bound and repeat() and guarded == [device] and launches == [1, 1]
