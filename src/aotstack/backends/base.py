"""The backend interface: a compile side that lowering calls, a run side that loading calls.

A backend's run side (``BackendRuntime``: ``init`` then ``execute``) runs in the process that
loads a package; its compile side (``Backend``: ``preprocess``) runs once, ahead of time. A
built-in backend keeps the two in separate modules, so loading a package imports no compiler;
a user's backend may be one ``Backend`` subclass that does both. Defining a subclass with a
``backend_id`` registers it (``registry.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..format.specs import CompileSpec, PreprocessResult
from ..format.tensor_data import BytesLike
from . import registry

if TYPE_CHECKING:
    from torch.export import ExportedProgram


class BackendRuntime:
    """The run side of a backend: what ``aotstack.load`` calls for each of its delegates."""

    backend_id: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend_id = cls.__dict__.get("backend_id")
        if backend_id is None:
            return
        if not isinstance(backend_id, str) or not backend_id:
            raise TypeError(f"{cls.__qualname__}.backend_id must be a non-empty str")
        if issubclass(cls, Backend):
            registry.register_backend(backend_id, cls)
        # A compile side that inherits the base's run side leaves running to its runtime class.
        if cls.init is not BackendRuntime.init:
            registry.register_runtime(backend_id, cls)

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


class Backend(BackendRuntime):
    """Base of every backend's compile side; a subclass may be its own run side too.

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
