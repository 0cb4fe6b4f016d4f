"""The backend interface, and the registry that finds a backend's sides by its id.

A backend's run side (``BackendRuntime``: ``init`` then ``execute``) runs in the process that
loads a package; its compile side (``Backend``: ``preprocess``) runs once, ahead of time. A
built-in backend keeps the two in separate modules, and loading imports the module of a run side
only when a package names its backend, so a process that only loads imports no compiler. A
user's backend may be one ``Backend`` subclass that does both. Defining a subclass with a
``backend_id`` registers it; import its module before lowering or loading.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import BackendNotFoundError
from ..format.custom_ops import is_custom_op_name
from ..format.specs import CompileSpec, PreprocessResult
from ..format.tensor_data import BytesLike

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
            register_backend(backend_id, cls)
        # A compile side that inherits the base's run side leaves running to its runtime class.
        if cls.init is not BackendRuntime.init:
            register_runtime(backend_id, cls)

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

    # The packages whose versions, with a partition's program and compile specs, key a cache of
    # ``preprocess``'s results that lowering keeps for this backend (``compile/cache.py``), so an
    # unchanged partition is not compiled twice; None: no such cache (or the backend keeps its own).
    cached_by_packages: ClassVar[tuple[str, ...] | None] = None

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        """Compile one partition ahead of time."""
        raise NotImplementedError

    def cached_preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult | None:
        """What ``preprocess`` would return, if the backend kept it from an earlier compile; never compiles.

        ``lower`` asks before it starts compile workers, so a partition compiled before costs
        no process; None (the default) means "compile it".
        """
        return None

    def warm_up(self) -> None:
        """Do, once, the work every compile in a fresh process repeats (imports, probes of this machine).

        ``lower`` calls it in its own process before it forks compile workers, which inherit the
        result instead of each paying for it. The default does nothing.
        """

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        """The custom ops (``ns.op.overload``) of ``claimed`` that the compiled partition calls back through torch.

        A process loading the package must register these first. The default assumes every
        claimed custom op is called; an engine that translates ops into its own returns none, and
        one whose compiled code lists its calls returns exactly those.
        """
        return [name for name in claimed if is_custom_op_name(name)]

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        """Whether a partition may own ``buffer``, which it updates, changing it in place at run time.

        Such a buffer is stored as the partition's named data ``weight:<fqn>``
        (``tensor_data.weights_as_named_data``); at load, ``init`` gets a writable view of the
        buffer's one shared state in its place, which it must update without copying.
        """
        return False


@dataclass(frozen=True)
class Engine:
    """A built-in engine's one registration: where its sides live, what it runs on, what it needs installed.

    ``run`` and ``compile`` are modules; importing one registers that side's class.
    ``partitioner`` is ``"module:Class"``, the partitioner ``lower(program, "auto")`` asks,
    built with no arguments; ``devices`` are the device types it targets (``"cpu"``,
    ``"cuda"``, ``"mps"``); ``packages`` are the modules it needs, and ``extra`` the pip extra
    that brings them. ``takes_every_op``: it compiles whatever ATen op another engine leaves on
    its device, so auto-lowering ends every plan with it.
    """

    run: str
    compile: str
    partitioner: str
    devices: tuple[str, ...] = ("cpu",)
    packages: tuple[str, ...] = ()
    extra: str | None = None
    takes_every_op: bool = False

    def installed(self) -> bool:
        """Whether every package this engine needs can be imported here."""
        return all(importlib.util.find_spec(name) is not None for name in self.packages)

    def partitioner_class(self) -> type:
        module, _, name = self.partitioner.partition(":")
        return getattr(importlib.import_module(module), name)


# Built-in backend id -> its engine. A new engine is one folder under backends/ and one line here.
BUILT_IN: dict[str, Engine] = {
    "aoti_cpu": Engine("aotstack.backends.aoti.run", "aotstack.backends.aoti.cpu",
                       "aotstack.backends.aoti.cpu:AotiCpuPartitioner", takes_every_op=True),
    "aoti_cuda": Engine("aotstack.backends.aoti.run", "aotstack.backends.aoti.cuda",
                        "aotstack.backends.aoti.cuda:CudaPartitioner", devices=("cuda",), takes_every_op=True),
    "aoti_metal": Engine("aotstack.backends.aoti.run", "aotstack.backends.aoti.metal",
                         "aotstack.backends.aoti.metal:MetalPartitioner", devices=("mps",), takes_every_op=True),
    "onnxruntime": Engine("aotstack.backends.ort.run", "aotstack.backends.ort.backend",
                          "aotstack.backends.ort.partitioner:OrtPartitioner",
                          packages=("onnxruntime", "onnx", "onnxscript"), extra="onnx"),
    "openvino": Engine("aotstack.backends.openvino.run", "aotstack.backends.openvino.backend",
                       "aotstack.backends.openvino.partitioner:OpenVinoPartitioner",
                       packages=("openvino",), extra="openvino"),
    "xnnpack": Engine("aotstack.backends.xnnpack.run", "aotstack.backends.xnnpack.backend",
                      "aotstack.backends.xnnpack.partitioner:XnnpackPartitioner",
                      packages=("executorch",), extra="xnnpack"),
}


def run_side_modules() -> set[str]:
    """The modules a loading process may import to run the built-in engines."""
    return {engine.run for engine in BUILT_IN.values()}


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
    return _lookup(_BACKENDS, backend_id, "compile")


def runtime_class(backend_id: str) -> type[BackendRuntime]:
    """The run side registered under ``backend_id``."""
    return _lookup(_RUNTIMES, backend_id, "run")


def _lookup(table: dict[str, type], backend_id: str, side: str) -> type:
    if backend_id not in table and backend_id in BUILT_IN:
        importlib.import_module(getattr(BUILT_IN[backend_id], side))
    try:
        return table[backend_id]
    except KeyError:
        known = ", ".join(sorted(set(table) | set(BUILT_IN))) or "none"
        raise BackendNotFoundError(
            f"no backend registered as {backend_id!r} (known: {known}); "
            "import the module that defines it before lowering or loading"
        ) from None

