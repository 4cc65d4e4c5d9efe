"""Every hook of the ``recoverssm`` plugin manager, documented in one place.

A backend package (built in, or third party through the entry-point group
``recoverssm.backends``) is a module or object that implements some of these hooks with
``@recoverssm.core.hookspecs.hookimpl``. Entry points name a module or object; the registry
registers it with the plugin manager.

Example of a third-party plugin module::

    from recoverssm.core.hookspecs import hookimpl
    from recoverssm.core.backend import Backend

    class MyBackend(Backend):
        name = "mine"
        device_types = ("cpu",)
        ...

    @hookimpl
    def recoverssm_backends():
        return [MyBackend()]

and in the plugin's ``pyproject.toml``::

    [project.entry-points."recoverssm.backends"]
    mine = "my_package.plugin"
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .backend import Backend

PROJECT_NAME = "recoverssm"
ENTRY_POINT_GROUP = "recoverssm.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def recoverssm_backends() -> "Iterable[Backend]":
    """Return the backends this plugin provides.

    Each item is a :class:`recoverssm.core.backend.Backend` instance that declares its ``name``
    (unique across all plugins: a second backend with the same name is an error), the
    ``device_types`` it serves (``torch.device.type`` strings), its ``pointer_encoding`` (how
    device addresses are stored in the int64 pointer tables the commit kernels read) and its
    ``capabilities``. The registry calls this hook once, when backends are first needed.
    """


@hookspec(firstresult=True)
def recoverssm_default_backend(device_type: str) -> "str | None":
    """Name the backend to use for tensors of ``device_type`` when nothing else chose one.

    Called only when neither the ``backend=`` argument nor ``RECOVERSSM_BACKEND`` picks a backend.
    The first non-``None`` answer wins (plugins registered later are asked first, so a third-party
    plugin can take over a device type); when every plugin answers ``None``, the registry picks the
    first available backend that lists ``device_type``.
    """
