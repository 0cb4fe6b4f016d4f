"""``OrtBackend``: the compile side of ONNX Runtime, partitions exported to ONNX (the run side is ``run.py``)."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.export import ExportedProgram

from ...compile.program_parts import partition_boundary, program_weights, state_as_arguments
from ...engine.interface import Backend
from ...engine.session import session_threads
from ...errors import CompileSpecError, LoweringError
from ...format.processed import state_record
from ...format.specs import CompileSpec, PreprocessResult, SpecKey, compile_spec_value, partition_label
from ...format.tensor_data import weights_as_named_data
from .compile import OnnxPartition, export_partition
from .run import HOST_PROVIDERS, MODEL_NAME, PROCESSED_VERSION, providers
from .state import state_translations, updated_in_place


class OrtBackend(Backend):
    """ONNX Runtime as a stacked engine.

    Compile specs: ``providers``, a comma-separated list of execution providers in priority
    order (default ``CPUExecutionProvider``); ``quantized_activations``, ``on`` or ``off``
    (default; see ``OrtPartitioner``).
    """

    backend_id = "onnxruntime"
    cached_by_packages = ("onnx", "onnxscript")
    run_side_specs = (SpecKey.THREADS,)
    # 2: the small constants the exporter computes are folded (``compile.fold_small_constants``); 3: a zero bias
    # the exporter made is dropped from its convolution (``compile.drop_zero_biases``); 5: a repeat_interleave by a
    # count known when it runs is written out (``compile.with_counted_repeats_expanded``), and the weights the
    # session must copy are named (``compile.broadcast_operands``).
    compile_revision = 5
    # Exporting a part to ONNX: 5-6 s for a 4-layer BERT encoder.
    expected_compile_seconds = 5.0

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        return []  # it claims only ops it translates into its own

    def check_specs(self, compile_specs: list[CompileSpec]) -> None:
        providers(compile_specs)
        session_threads(compile_specs)

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        self.check_specs(compile_specs)  # a bad spec fails here, not in the process that loads the package
        check_boundary_dtypes(exported_program, label)
        # A buffer the partition owns is the model's trailing input and leading output.
        program, state = state_as_arguments(exported_program)
        onnx_partition = export_partition(
            program, label, quantized_activations(compile_specs), state_translations() if state else None
        )
        buffers = {fqn: program_weights(exported_program)[fqn] for fqn in state}
        named_data, weights = weights_as_named_data({**onnx_partition.weights, **buffers})
        named_data[MODEL_NAME] = onnx_partition.model
        # ONNX Runtime is handed numpy arrays: host memory, whatever its execution providers.
        boundary = partition_boundary(exported_program, label, "cpu")
        inputs, state_inputs = split_at(onnx_partition.input_names, len(boundary.inputs), label, "inputs")
        state_outputs, outputs = split_at(onnx_partition.output_names, len(state), label, "outputs")
        if len(state_inputs) != len(state):
            raise LoweringError(f"{label}: the ONNX model takes {len(onnx_partition.input_names)} inputs, the "
                                f"partition {len(boundary.inputs)} and {len(state)} buffer(s) it updates")
        state_pairs = list(zip(state_inputs, state_outputs, strict=True))
        processed = {
            "version": PROCESSED_VERSION,
            "weights": {fqn: meta for fqn, meta in weights.items() if fqn not in buffers},
            "inputs": inputs,
            "outputs": outputs,
            "session_owned": onnx_partition.session_owned,
            "state": state_record(buffers, state_inputs, state_outputs, updated_in_place(onnx_model(onnx_partition),
                                                                                          state_pairs)),
            # What the model takes; its run side checks every call against it.
            "boundary": boundary.to_json(),
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)


    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        # The run side binds the buffer's memory as both the model's input and its output.
        return set(providers(compile_specs)) <= HOST_PROVIDERS


def split_at(names: list[str], index: int, label: str, what: str) -> tuple[list[str], list[str]]:
    if index > len(names):
        raise LoweringError(f"{label}: the ONNX model has {len(names)} {what}, fewer than the {index} expected")
    return names[:index], names[index:]


def onnx_model(partition: OnnxPartition) -> Any:
    import onnx

    return onnx.load_from_string(partition.model)


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
