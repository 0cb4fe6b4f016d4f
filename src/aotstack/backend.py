"""The backend interface and the registry that finds a backend by its id.

A backend has a compile side (``preprocess``) that runs once, ahead of time, and a run side
(``init`` then ``execute``) that runs in the process that loads the package. Defining a
subclass with a ``backend_id`` registers it, so ``aotstack.load`` can find its run side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram

from .errors import BackendNotFoundError
from .specs import CompileSpec, PreprocessResult
from .tensor_data import BytesLike

_REGISTRY: dict[str, type[Backend]] = {}


class Backend:
    """Base of every backend.

    Example::

        class Doubler(aotstack.Backend):
            backend_id = "doubler"

            def preprocess(self, exported_program, compile_specs):
                return aotstack.PreprocessResult(b"")

            def init(self, processed_bytes, named_data, compile_specs):
                return None

            def execute(self, handle, inputs):
                return [inputs[0] * 2]
    """

    backend_id: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend_id = cls.__dict__.get("backend_id")
        if backend_id is None:
            return
        if not isinstance(backend_id, str) or not backend_id:
            raise TypeError(f"{cls.__qualname__}.backend_id must be a non-empty str")
        _register(backend_id, cls)

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        """Compile one partition ahead of time."""
        raise NotImplementedError

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        """Whether a partition may own ``buffer``, which it updates, changing it in place at run time.

        Such a buffer is stored as the partition's named data ``weight:<fqn>``
        (``tensor_data.weights_as_named_data``); at load, ``init`` gets a writable view of the
        buffer's one shared state in its place, which it must update without copying.
        """
        return False

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> Any:
        """Turn what ``preprocess`` produced into a handle that ``execute`` can run.

        ``named_data`` holds read-only views into the loaded file, verified against their hashes;
        ``bytes(view)`` copies one where an engine needs ``bytes``.
        """
        raise NotImplementedError

    def execute(self, handle: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run one delegate call."""
        raise NotImplementedError


def _register(backend_id: str, cls: type[Backend]) -> None:
    existing = _REGISTRY.get(backend_id)
    # Re-running the same definition (a reloaded module, a notebook cell) replaces it; a second,
    # different class claiming the id is a mistake worth stopping.
    if existing is not None and (existing.__module__, existing.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise TypeError(
            f"backend id {backend_id!r} is already registered by "
            f"{existing.__module__}.{existing.__qualname__}"
        )
    _REGISTRY[backend_id] = cls


def backend_class(backend_id: str) -> type[Backend]:
    """The backend class registered under ``backend_id``."""
    try:
        return _REGISTRY[backend_id]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise BackendNotFoundError(
            f"no backend registered as {backend_id!r} (registered: {known}); "
            "import the module that defines it before lowering or loading"
        ) from None


def registered_backend_ids() -> list[str]:
    return sorted(_REGISTRY)
