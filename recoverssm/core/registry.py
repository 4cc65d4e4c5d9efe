"""The backend registry: a pluggy ``PluginManager`` named ``recoverssm``.

Built-in backends (``cpu_ref``, ``cuda``, ``xpu``) are registered as plugins; third-party ones
come from the entry-point group ``recoverssm.backends``. Selection order for an op:

1. the explicit ``backend=`` argument (a name or a :class:`Backend`);
2. the ``RECOVERSSM_BACKEND`` environment variable;
3. the tensors' device type (``recoverssm_default_backend`` hook, else the first available
   backend that serves it; ``cpu`` -> ``cpu_ref``).
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import Optional, Union

import pluggy
import torch

from . import environment, hookspecs
from .backend import Backend

ENV_BACKEND = "RECOVERSSM_BACKEND"
BUILTIN_PLUGINS = (
    "recoverssm.backends.cpu_ref.plugin",
    "recoverssm.backends.cuda.plugin",
    "recoverssm.backends.xpu.plugin",
)


class BackendError(ValueError):
    """A backend was asked for that does not exist, is not available, or cannot serve the tensors."""


class Registry:
    """Holds the plugin manager and the backends it yields, collected once and then cached."""

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._load_entry_points = load_entry_points
        self._backends: Optional[dict[str, Backend]] = None
        self._environment: tuple[str, ...] = ()
        self._resolved: dict[tuple, tuple[Backend, str]] = {}
        self._passed: dict[str, Backend] = {}     # backends passed as objects, by their key
        self._generation = 0                      # counts register / unregister
        self._lock = threading.Lock()

    # ---- plugin loading -----------------------------------------------------------------------
    def _load(self) -> dict[str, Backend]:
        for modname in BUILTIN_PLUGINS:
            module = importlib.import_module(modname)
            if not self.pm.is_registered(module):
                self.pm.register(module, name=modname)
        if self._load_entry_points:
            self.pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
        backends: dict[str, Backend] = {}
        owners: dict[str, str] = {}
        for impl in self.pm.hook.recoverssm_backends.get_hookimpls():
            plugin_name = impl.plugin_name
            for backend in impl.function() or ():
                if not isinstance(backend, Backend):
                    raise BackendError(
                        f"plugin {plugin_name!r} returned {backend!r} from recoverssm_backends(); "
                        "expected recoverssm.core.backend.Backend instances")
                if not backend.name:
                    raise BackendError(f"plugin {plugin_name!r} returned a backend without a name")
                if backend.name in backends:
                    raise BackendError(
                        f"two backends are named {backend.name!r}: one from {owners[backend.name]!r}, "
                        f"one from {plugin_name!r}; backend names must be unique")
                backends[backend.name] = backend
                owners[backend.name] = plugin_name
        return backends

    def backends(self) -> dict[str, Backend]:
        with self._lock:
            if self._backends is None:
                self._backends = self._load()
                names = {ENV_BACKEND}
                for backend in self._backends.values():
                    names.update(getattr(backend, "environment", ()))
                self._environment = tuple(sorted(names))
            return self._backends

    def register(self, plugin: object, name: Optional[str] = None) -> None:
        """Register one more plugin (a module or object with hookimpls) and re-collect backends."""
        with self._lock:
            self.pm.register(plugin, name=name)
            self._backends = None
            self._resolved.clear()
            self._generation += 1

    def unregister(self, name: str) -> None:
        with self._lock:
            self.pm.unregister(name=name)
            self._backends = None
            self._resolved.clear()
            self._generation += 1

    def invalidate(self) -> None:
        """Say that something a launch depends on changed besides the plugins (a launch table,
        ``backends/triton/tuning.py``): the generation in :meth:`state` moves, so no launch
        remembered before is repeated (``core/repeats.py``)."""
        with self._lock:
            self._resolved.clear()
            self._generation += 1

    def state(self) -> tuple:
        """What a resolution or a launch depends on besides its arguments: a generation (it
        moves when a plugin is registered or removed, and on :meth:`invalidate`) and the
        environment variables the backends list."""
        if self._backends is None:
            self.backends()
        return self._generation, environment.read_all(self._environment)

    # ---- queries --------------------------------------------------------------------------------
    def available_backends(self) -> list[str]:
        return [n for n, b in self.backends().items() if b.is_available()]

    def _describe_available(self) -> str:
        names = self.available_backends()
        return ", ".join(names) if names else "none"

    def key_for(self, backend: Backend) -> str:
        """The name an op receives for a backend passed as an object: its registered name when
        it is the registered backend of that name, else a key of its own (kept, with the object,
        for the life of the process)."""
        if self.backends().get(backend.name) is backend:
            return backend.name
        key = f"{backend.name}@{id(backend):x}"
        self._passed[key] = backend
        return key

    def _by_name(self, name: str, why: str) -> Backend:
        if name in self._passed:
            return self._passed[name]
        backends = self.backends()
        if name not in backends:
            raise BackendError(f"unknown backend {name!r} ({why}); available: {self._describe_available()}")
        backend = backends[name]
        if not backend.is_available():
            raise BackendError(
                f"backend {name!r} ({why}) is not available on this machine: {backend.unavailable_reason()}; "
                f"available: {self._describe_available()}")
        return backend

    def resolve(self, backend: Union[str, Backend, None] = None,
                device: Union[torch.device, str, None] = None) -> tuple[Backend, str]:
        """Return ``(backend, reason)``: the backend that serves ``device`` and why it was chosen.

        Successful answers are memoised per (argument, device type, environment), since every op
        asks; a change of ``RECOVERSSM_BACKEND`` or of a variable a backend lists in its
        ``environment`` is a new key.
        """
        dev_type = device.type if isinstance(device, torch.device) else (
            torch.device(device).type if device is not None else None)
        if self._backends is None:
            self.backends()
        key = (backend if not isinstance(backend, Backend) else id(backend), dev_type,
               environment.read_all(self._environment))
        hit = self._resolved.get(key)
        if hit is not None and (not isinstance(backend, Backend) or hit[0] is backend):
            return hit
        answer = self._resolve(backend, dev_type)
        self._resolved[key] = answer
        return answer

    def _resolve(self, backend: Union[str, Backend, None], dev_type: Optional[str]) -> tuple[Backend, str]:
        self.backends()   # plugins must be registered before their default-backend hooks are asked
        if isinstance(backend, Backend):
            chosen, why = backend, "passed as backend="
        elif backend is not None:
            chosen, why = self._by_name(str(backend), "backend= argument"), "backend= argument"
        elif os.environ.get(ENV_BACKEND):
            name = os.environ[ENV_BACKEND]
            chosen, why = self._by_name(name, f"{ENV_BACKEND}={name}"), f"{ENV_BACKEND}={name}"
        else:
            dtype_ = dev_type or "cpu"
            name = self.pm.hook.recoverssm_default_backend(device_type=dtype_)
            if name is not None:
                return self._by_name(name, f"default for device type {dtype_!r}"), \
                    f"default for device type {dtype_!r}"
            for cand in self.backends().values():
                if dtype_ in cand.device_types and cand.is_available():
                    return cand, f"first available backend for device type {dtype_!r}"
            raise BackendError(
                f"no available backend serves device type {dtype_!r}; available: {self._describe_available()}")
        if dev_type is not None and not chosen.serves(dev_type):
            raise BackendError(
                f"backend {chosen.name!r} ({why}) cannot serve tensors on device type {dev_type!r} "
                f"(it serves {', '.join(chosen.device_types)}); available: {self._describe_available()}")
        return chosen, why


_REGISTRY = Registry()


def registry() -> Registry:
    return _REGISTRY


def backend_for(op: str, capability: str, name: str, device: torch.device) -> Backend:
    """The backend that runs ``op`` on ``device``: ``name`` if not empty, else the registry's
    choice (``RECOVERSSM_BACKEND``, else by device type); it must declare ``capability``."""
    backend = _REGISTRY.resolve(name or None, device)[0]
    if capability not in backend.capabilities:
        raise BackendError(f"{op}: backend {backend.name!r} does not provide {capability!r} "
                           f"(it declares {', '.join(sorted(backend.capabilities)) or 'nothing'})")
    return backend


def available_backends() -> list[str]:
    """Names of the backends usable on this machine, e.g. ``["cpu_ref", "cuda"]``."""
    return _REGISTRY.available_backends()


def get_backend(name: Union[str, Backend, None] = None,
                device: Union[torch.device, str, None] = None) -> Backend:
    """The backend for ``name`` (explicit) > ``RECOVERSSM_BACKEND`` > the device type of ``device``."""
    return _REGISTRY.resolve(name, device)[0]
