"""Which engines exist: the built-in ones by id, and the classes registered for each side.

The registry names modules by string, so it imports no engine: ``backend_class`` and
``runtime_class`` import a built-in engine's side the first time a package or a lowering asks.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ..errors import BackendNotFoundError
from .interface import REGISTERED_BACKENDS, REGISTERED_RUNTIMES, Backend, BackendRuntime


@dataclass(frozen=True)
class Engine:
    """A built-in engine's one registration: where its sides live, what it runs on, what it needs installed.

    ``run`` and ``compile`` are modules; importing one registers that side's class.
    ``partitioner`` is ``"module:Class"``, the partitioner ``lower(program, "auto")`` asks,
    built with no arguments; ``devices`` are the device types it targets (``"cpu"``,
    ``"cuda"``, ``"mps"``); ``packages`` are the modules it needs, and ``extra`` the pip extra
    that brings them. ``takes_every_op``: it compiles whatever ATen op another engine leaves on
    its device, so auto-lowering ends every plan with it. ``lost_in_fork``: native libraries
    (file name prefixes) that, once they ran here, leave a forked child that calls the engine
    waiting forever on threads fork did not copy; its plans are then timed in this process.
    """

    run: str
    compile: str
    partitioner: str
    devices: tuple[str, ...] = ("cpu",)
    packages: tuple[str, ...] = ()
    extra: str | None = None
    takes_every_op: bool = False
    lost_in_fork: tuple[str, ...] = ()

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
                       packages=("openvino",), extra="openvino",
                       # Its CPU plugin compiles a model on its executor's threads: a child's compile_model never
                       # returns (its compile side, which only converts, is unaffected).
                       lost_in_fork=("libopenvino_intel_cpu_plugin",)),
    "xnnpack": Engine("aotstack.backends.xnnpack.run", "aotstack.backends.xnnpack.backend",
                      "aotstack.backends.xnnpack.partitioner:XnnpackPartitioner",
                      packages=("executorch",), extra="xnnpack"),
}


def run_side_modules() -> set[str]:
    """The modules a loading process may import to run the built-in engines."""
    return {engine.run for engine in BUILT_IN.values()}


# Filled as backend classes are defined (``interface.BackendRuntime.__init_subclass__``).
_BACKENDS = REGISTERED_BACKENDS
_RUNTIMES = REGISTERED_RUNTIMES


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

