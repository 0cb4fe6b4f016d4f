"""``AotiBackend``: the one base every AOTInductor backend builds on.

The compile steps and the run side live here, once. A concrete backend only answers the
hooks: its device, the fallback kernels its runtime has, its decompositions, its Inductor
options and its graph passes. Concrete backends are final.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram

from ...backend import Backend
from ...errors import LoweringError
from ...specs import CompileSpec, PreprocessResult, partition_label
from ...tensor_data import weights_as_named_data, weights_from_named_data
from .compile import GraphPass, compile_partition
from .run import AotiHandle, bind_constants, open_runner, run

LIBRARY_NAME = "model.so"


class AotiBackend(Backend):
    """Shared base of the AOTInductor backends (CPU here; CUDA and Metal build on it too)."""

    device_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        for base in cls.__mro__[1:]:
            if base is not AotiBackend and issubclass(base, AotiBackend) and "backend_id" in base.__dict__:
                raise TypeError(
                    f"{base.__qualname__} is final; subclass AotiBackend to add an AOTInductor backend"
                )
        super().__init_subclass__(**kwargs)

    # Hooks -----------------------------------------------------------------------------------

    def supported_fallback_kernels(self) -> frozenset[str] | None:
        """ATen ops the target's runtime can run as fallback kernels; None means all of them."""
        return None

    def decomposition_table(self) -> dict[Any, Callable[..., Any]]:
        """Decompositions applied before compiling (none by default)."""
        return {}

    def inductor_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        """AOTInductor options for this target."""
        return {}

    def custom_passes(self) -> list[GraphPass]:
        """Graph passes run on each partition before compiling."""
        return []

    # Compile side ----------------------------------------------------------------------------

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        compiled = compile_partition(
            exported_program,
            label=label,
            decompositions=self.decomposition_table(),
            passes=self.custom_passes(),
            inductor_options=self.inductor_options(compile_specs),
        )
        named_data, weights = weights_as_named_data(compiled.constants)
        named_data[LIBRARY_NAME] = compiled.library
        processed = {
            "weights": weights,
            "input_strides": [static_stride(node) for node in user_input_nodes(exported_program)],
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)

    # Run side --------------------------------------------------------------------------------

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, bytes], compile_specs: list[CompileSpec]
    ) -> AotiHandle:
        label = partition_label(self.backend_id, compile_specs)
        processed = json.loads(processed_bytes)
        weights = weights_from_named_data(named_data, processed["weights"])
        runner = open_runner(named_data[LIBRARY_NAME], self.device_name, label)
        bound = bind_constants(runner, weights, label)
        strides = [None if s is None else tuple(s) for s in processed["input_strides"]]
        return AotiHandle(runner=runner, input_strides=strides, constants=bound)

    def execute(self, handle: AotiHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


def user_input_nodes(exported_program: ExportedProgram) -> list[torch.fx.Node]:
    user_inputs = set(exported_program.graph_signature.user_inputs)
    return [n for n in exported_program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]


def static_stride(node: torch.fx.Node) -> list[int] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise LoweringError(f"partition input {node.name!r} is not a tensor")
    stride = value.stride()
    if all(isinstance(s, int) for s in stride):
        return list(stride)
    return None
