"""Backend registry: selection order, errors, entry-point plugins ."""
import importlib
import itertools
import os
import sys
import textwrap

import pytest
import torch

import recoverssm as rs
from recoverssm.backends.cpu_ref.plugin import CpuRefBackend
from recoverssm.core import registry as registry_mod
from recoverssm.core.hookspecs import hookimpl
from recoverssm.core.registry import ENV_BACKEND, Registry
from helpers import make_problem, run_verify

_counter = itertools.count()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    rs.available_backends()          # load the global registry before any test puts plugins on sys.path


class SpyBackend(CpuRefBackend):
    """cpu_ref under another name, counting its calls."""

    def __init__(self, name="spy", device_types=("cpu",), available=True):
        self.name = name
        self.device_types = device_types
        self._available = available
        self.calls = []

    def is_available(self):
        return self._available

    def unavailable_reason(self):
        return "" if self._available else "spy says no"

    def recurrence(self, call, **kwargs):
        self.calls.append(call.mode)
        return super().recurrence(call, **kwargs)


class SpyPlugin:
    def __init__(self, *backends):
        self.backends = list(backends)

    @hookimpl
    def recoverssm_backends(self):
        return self.backends


def test_builtin_cpu_ref_is_available_and_default():
    assert "cpu_ref" in rs.available_backends()
    assert rs.get_backend().name == "cpu_ref"
    assert rs.get_backend(device="cpu").name == "cpu_ref"
    assert rs.get_backend("cpu_ref", torch.device("cpu")).name == "cpu_ref"
    be = rs.get_backend()
    assert isinstance(be, rs.Backend) and "cpu" in be.device_types
    assert be.capabilities <= rs.Backend.CAPABILITIES


def test_env_var_selects_backend(monkeypatch):
    reg = Registry(load_entry_points=False)
    spy = SpyBackend("spy_env")
    reg.register(SpyPlugin(spy), name="spy_env_plugin")
    monkeypatch.setenv(ENV_BACKEND, "spy_env")
    assert reg.resolve(None, "cpu")[0] is spy
    # explicit argument beats the env var
    assert reg.resolve("cpu_ref", "cpu")[0].name == "cpu_ref"
    monkeypatch.setenv(ENV_BACKEND, "cpu_ref")
    assert reg.resolve(None, "cpu")[0].name == "cpu_ref"


def test_env_var_through_public_ops(monkeypatch):
    """The public ops honour RECOVERSSM_BACKEND; an unknown name there is an error that lists the
    available backends, and an explicit backend= still wins."""
    p = make_problem([2, 3], [0, 1])
    monkeypatch.setenv(ENV_BACKEND, "cpu_ref")
    out, _ = run_verify(p)
    monkeypatch.setenv(ENV_BACKEND, "no_such_backend")
    records = p.records()
    before = records.correction.clone()
    with pytest.raises(rs.BackendError) as ei:
        rs.gdn_verify(p.q, p.k, p.v, records=records, **p.call_kwargs())
    msg = str(ei.value)
    assert "no_such_backend" in msg and "cpu_ref" in msg and ENV_BACKEND in msg
    assert torch.equal(records.correction, before)
    with pytest.raises(rs.BackendError):
        rs.get_backend()
    out2 = rs.gdn_verify(p.q, p.k, p.v, records=records, backend="cpu_ref", **p.call_kwargs())
    assert torch.equal(out, out2)


def test_explicit_backend_object_is_used():
    p = make_problem([2, 3], [0, 1])
    spy = SpyBackend("spy_obj")
    out = rs.gdn_verify(p.q, p.k, p.v, records=p.records(), backend=spy, **p.call_kwargs())
    assert spy.calls == ["verify"]
    ref, _ = run_verify(p)
    assert torch.equal(out, ref)
    rs.gdn_decode(p.q, p.k, p.v, backend=spy, **p.call_kwargs(state=p.state.clone()))
    assert spy.calls == ["verify", "decode"]


def test_explicit_backend_name_through_registry(monkeypatch):
    reg = Registry(load_entry_points=False)
    spy = SpyBackend("spy_name")
    reg.register(SpyPlugin(spy), name="spy_name_plugin")
    assert "spy_name" in reg.available_backends()
    monkeypatch.setattr(registry_mod, "_REGISTRY", reg)
    p = make_problem([2, 3], [0, 1])
    rs.gdn_verify(p.q, p.k, p.v, records=p.records(), backend="spy_name", **p.call_kwargs())
    assert spy.calls == ["verify"]
    assert rs.get_backend("spy_name") is spy
    # unregistering removes it again
    reg.unregister("spy_name_plugin")
    assert "spy_name" not in reg.available_backends()


def test_unknown_name_lists_available():
    with pytest.raises(rs.BackendError) as ei:
        rs.get_backend("definitely_not_a_backend")
    msg = str(ei.value)
    assert "definitely_not_a_backend" in msg and "available" in msg
    for name in rs.available_backends():
        assert name in msg
    assert isinstance(ei.value, ValueError)


def test_unavailable_backend_is_an_error():
    reg = Registry(load_entry_points=False)
    reg.register(SpyPlugin(SpyBackend("sleepy", available=False)), name="sleepy_plugin")
    assert "sleepy" not in reg.available_backends()
    with pytest.raises(rs.BackendError) as ei:
        reg.resolve("sleepy", "cpu")
    msg = str(ei.value)
    assert "sleepy" in msg and "spy says no" in msg and "cpu_ref" in msg


def test_backend_that_cannot_serve_the_device():
    gpu_only = SpyBackend("gpu_only", device_types=("cuda",))
    reg = Registry(load_entry_points=False)
    reg.register(SpyPlugin(gpu_only), name="gpu_only_plugin")
    with pytest.raises(rs.BackendError) as ei:
        reg.resolve("gpu_only", "cpu")
    assert "gpu_only" in str(ei.value) and "cpu" in str(ei.value)
    with pytest.raises(rs.BackendError):
        reg.resolve(gpu_only, "cpu")
    # through a public op: nothing is written
    p = make_problem([2, 3], [0, 1])
    records = p.records()
    records.correction.fill_(3.0)
    out = torch.full_like(p.v, 5.0)
    with pytest.raises(rs.BackendError, match="gpu_only"):
        rs.gdn_verify(p.q, p.k, p.v, records=records, out=out, backend=gpu_only, **p.call_kwargs())
    assert (records.correction == 3.0).all() and (out == 5.0).all()
    assert gpu_only.calls == []


def test_duplicate_names_raise_naming_both():
    reg = Registry(load_entry_points=False)
    reg.register(SpyPlugin(SpyBackend("cpu_ref")), name="impostor_plugin")
    with pytest.raises(rs.BackendError) as ei:
        reg.backends()
    msg = str(ei.value)
    assert "cpu_ref" in msg and "impostor_plugin" in msg and "recoverssm.backends.cpu_ref.plugin" in msg


def test_plugin_returning_a_non_backend_is_an_error():
    reg = Registry(load_entry_points=False)
    reg.register(SpyPlugin(object()), name="junk_plugin")
    with pytest.raises(rs.BackendError, match="junk_plugin"):
        reg.backends()


def _make_dist(tmp_path, backend_name, *, ep_name=None):
    """A tiny installed distribution: a plugin module plus a *.dist-info with an entry point."""
    i = next(_counter)
    mod = f"rs_test_plugin_{os.getpid()}_{i}"
    ep_name = ep_name or f"ep_{mod}"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(f"""
        from recoverssm.backends.cpu_ref.plugin import CpuRefBackend
        from recoverssm.core.hookspecs import hookimpl

        class PluginBackend(CpuRefBackend):
            name = {backend_name!r}

        @hookimpl
        def recoverssm_backends():
            return [PluginBackend()]
    """))
    dist = tmp_path / f"{mod}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[recoverssm.backends]\n{ep_name} = {mod}\n")
    return mod, ep_name


def test_entry_point_plugin_is_found(tmp_path, monkeypatch):
    mod, ep_name = _make_dist(tmp_path, "from_entry_point")
    assert "from_entry_point" not in Registry().available_backends()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        reg = Registry()
        assert "from_entry_point" in reg.available_backends()
        assert "cpu_ref" in reg.available_backends()
        be = reg.resolve("from_entry_point", "cpu")[0]
        assert type(be).__module__ == mod
        # without entry points it is not there
        assert "from_entry_point" not in Registry(load_entry_points=False).available_backends()
        # and it computes: use it for an op through the public API
        monkeypatch.setattr(registry_mod, "_REGISTRY", reg)
        monkeypatch.setenv(ENV_BACKEND, "from_entry_point")
        p = make_problem([2, 1], [0, 1])
        out, _ = run_verify(p)
        monkeypatch.delenv(ENV_BACKEND)
        ref, _ = run_verify(p, backend="cpu_ref")
        assert torch.equal(out, ref)
    finally:
        sys.modules.pop(mod, None)


def test_entry_point_duplicate_name_raises(tmp_path, monkeypatch):
    mod, ep_name = _make_dist(tmp_path, "cpu_ref")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(rs.BackendError) as ei:
            Registry().available_backends()
        msg = str(ei.value)
        assert "cpu_ref" in msg and ep_name in msg and "recoverssm.backends.cpu_ref.plugin" in msg
    finally:
        sys.modules.pop(mod, None)


def test_pointer_encodings():
    from recoverssm.core.pointers import PointerEncoding
    addr = 0xFFFF85ABD4E00000
    t = PointerEncoding.UINT64_IN_INT64.encode([addr, 16])
    assert t.dtype == torch.int64 and PointerEncoding.UINT64_IN_INT64.decode(t) == [addr, 16]
    assert t[0].item() < 0
    with pytest.raises(ValueError, match="uint64-in-int64"):
        PointerEncoding.INT64.encode([addr])
    assert PointerEncoding.INT64.decode(PointerEncoding.INT64.encode([1 << 40])) == [1 << 40]
    with pytest.raises(ValueError):
        PointerEncoding.INT64.encode([-1])
