"""``OrtBackend``: partitions exported to ONNX and run in an ONNX Runtime session."""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from torch.export import ExportedProgram

from ...backend import Backend
from ...errors import LoweringError
from ...specs import CompileSpec, PreprocessResult, compile_spec_value, partition_label
from ...tensor_data import BytesLike, weights_as_named_data, weights_from_named_data
from .compile import export_partition
from .run import DEFAULT_PROVIDERS, OrtHandle, open_session, run

MODEL_NAME = "model.onnx"


class OrtBackend(Backend):
    """ONNX Runtime as a stacked engine.

    Compile specs: ``providers``, a comma-separated list of execution providers in priority
    order (default ``CPUExecutionProvider``).
    """

    backend_id = "onnxruntime"

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        providers(compile_specs)  # a bad spec fails here, not in the process that loads the package
        check_boundary_dtypes(exported_program, label)
        onnx_partition = export_partition(exported_program, label)
        named_data, weights = weights_as_named_data(onnx_partition.weights)
        named_data[MODEL_NAME] = onnx_partition.model
        processed = {
            "weights": weights,
            "inputs": onnx_partition.input_names,
            "outputs": onnx_partition.output_names,
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> OrtHandle:
        processed = json.loads(processed_bytes)
        weights = weights_from_named_data(named_data, processed["weights"])
        return open_session(
            bytes(named_data[MODEL_NAME]),
            weights,
            providers(compile_specs),
            processed["inputs"],
            processed["outputs"],
            partition_label(self.backend_id, compile_specs),
        )

    def execute(self, handle: OrtHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


def providers(compile_specs: list[CompileSpec]) -> list[str]:
    """The execution providers named by the ``providers`` compile spec."""
    value = compile_spec_value(compile_specs, "providers")
    if value is None:
        return list(DEFAULT_PROVIDERS)
    names = [name.strip() for name in value.decode().split(",") if name.strip()]
    if not names or not all(name.endswith("ExecutionProvider") for name in names):
        raise LoweringError(
            f"compile spec 'providers' must list ONNX Runtime execution providers, such as "
            f"'CUDAExecutionProvider,CPUExecutionProvider'; got {value!r}"
        )
    return names


# numpy carries the tensors across without a copy, so the boundary takes the dtypes it has.
_BOUNDARY_DTYPES = frozenset({
    torch.float16, torch.float32, torch.float64, torch.bool,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
})


def check_boundary_dtypes(exported_program: ExportedProgram, label: str) -> None:
    signature = exported_program.graph_signature
    boundary = set(signature.user_inputs) | set(signature.user_outputs)
    for node in exported_program.graph.nodes:
        value = node.meta.get("val")
        if node.name in boundary and isinstance(value, torch.Tensor) and value.dtype not in _BOUNDARY_DTYPES:
            raise LoweringError(f"{label}: tensor {node.name!r} has dtype {value.dtype}, which OrtBackend cannot pass")
