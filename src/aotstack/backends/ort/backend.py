"""``OrtBackend``: the compile side of ONNX Runtime, partitions exported to ONNX (the run side is ``run.py``)."""

from __future__ import annotations

import json

import torch
from torch.export import ExportedProgram

from ...compile.program_parts import partition_boundary
from ...engine.interface import Backend
from ...errors import CompileSpecError, LoweringError
from ...format.specs import CompileSpec, PreprocessResult, compile_spec_value, partition_label
from ...format.tensor_data import weights_as_named_data
from .compile import export_partition
from .run import MODEL_NAME, PROCESSED_VERSION, providers


class OrtBackend(Backend):
    """ONNX Runtime as a stacked engine.

    Compile specs: ``providers``, a comma-separated list of execution providers in priority
    order (default ``CPUExecutionProvider``); ``quantized_activations``, ``on`` or ``off``
    (default; see ``OrtPartitioner``).
    """

    backend_id = "onnxruntime"
    cached_by_packages = ("onnx", "onnxscript")

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        return []  # it claims only ops it translates into its own

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        providers(compile_specs)  # a bad spec fails here, not in the process that loads the package
        check_boundary_dtypes(exported_program, label)
        onnx_partition = export_partition(exported_program, label, quantized_activations(compile_specs))
        named_data, weights = weights_as_named_data(onnx_partition.weights)
        named_data[MODEL_NAME] = onnx_partition.model
        # ONNX Runtime is handed numpy arrays: host memory, whatever its execution providers.
        boundary = partition_boundary(exported_program, label, "cpu")
        if len(boundary.inputs) != len(onnx_partition.input_names):
            raise LoweringError(
                f"{label}: the ONNX model takes {len(onnx_partition.input_names)} inputs, the partition "
                f"{len(boundary.inputs)}"
            )
        processed = {
            "version": PROCESSED_VERSION,
            "weights": weights,
            "inputs": onnx_partition.input_names,
            "outputs": onnx_partition.output_names,
            # What the model takes; its run side checks every call against it.
            "boundary": boundary.to_json(),
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)


# The compile spec that says whether quantized linears may quantize float activations to int8.
QUANTIZED_ACTIVATIONS = "quantized_activations"


def quantized_activations(compile_specs: list[CompileSpec]) -> bool:
    """The ``quantized_activations`` spec: ``off`` unless it says ``on``."""
    value = compile_spec_value(compile_specs, QUANTIZED_ACTIVATIONS)
    if value == b"on":
        return True
    if value is None or value == b"off":
        return False
    raise CompileSpecError(f"compile spec {QUANTIZED_ACTIVATIONS!r} must be b'on' or b'off', got {value!r}")


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
