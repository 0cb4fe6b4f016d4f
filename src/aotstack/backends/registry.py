"""Backends by id: the compile side that lowering calls and the run side that loading calls.

A package names each delegate's backend id. Loading finds its run side here, importing the
module of a built-in one on first use, so a process that only loads imports no compile side.
A user's backend registers itself when its class is defined; import its module before lowering
or loading.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import BackendNotFoundError

if TYPE_CHECKING:
    from .base import Backend, BackendRuntime

# Built-in backend id -> (module defining its run side, module defining its compile side).
BUILT_IN = {
    "aoti_cpu": ("aotstack.backends.aoti.run", "aotstack.backends.aoti.cpu"),
    "aoti_cuda": ("aotstack.backends.aoti.run", "aotstack.backends.aoti.cuda"),
    "aoti_metal": ("aotstack.backends.aoti.run", "aotstack.backends.aoti.metal"),
    "onnxruntime": ("aotstack.backends.ort.run", "aotstack.backends.ort.backend"),
}

_BACKENDS: dict[str, type[Backend]] = {}
_RUNTIMES: dict[str, type[BackendRuntime]] = {}


def register_backend(backend_id: str, cls: type[Backend]) -> None:
    _register(_BACKENDS, backend_id, cls)


def register_runtime(backend_id: str, cls: type[BackendRuntime]) -> None:
    _register(_RUNTIMES, backend_id, cls)


def _register(table: dict[str, type], backend_id: str, cls: type) -> None:
    existing = table.get(backend_id)
    # Re-running the same definition (a reloaded module, a notebook cell) replaces it; a second,
    # different class claiming the id is a mistake worth stopping.
    if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(
            f"backend id {backend_id!r} is already registered by {existing.__module__}.{existing.__qualname__}"
        )
    table[backend_id] = cls


def backend_class(backend_id: str) -> type[Backend]:
    """The compile side registered under ``backend_id``."""
    return _lookup(_BACKENDS, backend_id, 1)


def runtime_class(backend_id: str) -> type[BackendRuntime]:
    """The run side registered under ``backend_id``."""
    return _lookup(_RUNTIMES, backend_id, 0)


def _lookup(table: dict[str, type], backend_id: str, side: int) -> type:
    if backend_id not in table and backend_id in BUILT_IN:
        importlib.import_module(BUILT_IN[backend_id][side])
    try:
        return table[backend_id]
    except KeyError:
        known = ", ".join(sorted(set(table) | set(BUILT_IN))) or "none"
        raise BackendNotFoundError(
            f"no backend registered as {backend_id!r} (known: {known}); "
            "import the module that defines it before lowering or loading"
        ) from None

