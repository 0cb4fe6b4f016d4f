"""``OpenVinoBackend``: the compile side of OpenVINO, partitions converted to OpenVINO IR (the run side is ``run.py``).

What a delegate stores, and why:

- The IR's XML, and its .bin holding only the constants the frontend made (shapes, scalars).
  The weights are not in the IR: they are parameters of it, and each is named data of its own,
  ``weight:<fqn>``, keyed by content in the package like every engine's weights. So a weight
  read by two partitions, two methods or two engines is stored once.
- A weight of 4-bit values (torchao holds each in an int8) that only a matmul's decompression
  reads is stored two values a byte and declared ``i4`` in the IR (``compile.int4_weights``):
  OpenVINO's kernel reads it so, and the file holds half the bytes.
- Not a compiled blob (``CompiledModel.export_model``): the CPU plugin writes every weight into
  it, again for each partition. Measured on BERT-base (12 layers, 110 M parameters, 2 cores):
  the blob is 435 MB and imports in 0.20 s; the IR is 350 kB of XML, and reading it, putting the
  weights in as constants over the mapped package and compiling takes 0.30 s. The blob cannot be
  made weightless here: the CPU plugin's weightless export points at a weights file, which a
  package does not have. So the IR, for a tenth of a second per BERT at load, and the file's
  weights once.

At load the run side reads both from the package's memory; nothing is written to disk, and
nothing is unpickled.
"""

from __future__ import annotations

import json

import torch
from torch.export import ExportedProgram

from ...compile.program_parts import partition_boundary, program_weights, state_as_arguments
from ...engine.interface import Backend
from ...engine.session import check_host_target
from ...errors import LoweringError
from ...format.processed import state_record
from ...format.specs import CompileSpec, PreprocessResult, SpecKey, partition_label
from ...format.tensor_data import dtype_from_name, weights_as_named_data
from .compile import convert_partition
from .frontend import decompositions, dtype_refusal
from .run import CONSTANTS_NAME, INPUT_ROLE, MODEL_NAME, OUTPUT_ROLE, PROCESSED_VERSION


class OpenVinoBackend(Backend):
    """OpenVINO as a stacked engine, on the CPU.

    Each partition is converted by OpenVINO's PyTorch frontend (what ``openvino.convert_model``
    does to an ExportedProgram) and compiled for the CPU plugin when the package is loaded.
    """

    backend_id = "openvino"
    cached_by_packages = ("openvino",)
    run_side_specs = (SpecKey.THREADS,)
    # 2: int4 values held in int8 weights are stored two a byte and read by OpenVINO as i4; 3: broadcasts to the
    # shape their input has are read as that input (compile.without_identity_broadcasts); 4: index_add decomposed.
    compile_revision = 4
    # The CPU plugin compiles the IR in ``compile_model``, at load; it has died of signals there.
    compiles_when_opened = True

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        return []  # it claims only ops it translates into its own

    def check_specs(self, compile_specs: list[CompileSpec]) -> None:
        check_host_target(compile_specs, "OpenVinoBackend")

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        self.check_specs(compile_specs)
        # OpenVINO is handed numpy views of host memory.
        boundary = partition_boundary(exported_program, label, "cpu")
        for index, item in enumerate(boundary.inputs):
            refused = dtype_refusal(dtype_from_name(item.dtype))
            if refused is not None:
                raise LoweringError(f"{label}: input {index} is {item.dtype}, and {refused}")
        # A buffer the partition owns is the IR's trailing input and leading output.
        program, state = state_as_arguments(exported_program)
        partition = convert_partition(program, label, len(state))
        if sum(role.startswith(INPUT_ROLE) for role in partition.parameters) > len(boundary.inputs) + len(state):
            raise LoweringError(f"{label}: the OpenVINO model takes more inputs than the partition's "
                                f"{len(boundary.inputs)} and its {len(state)} buffer(s)")
        buffers = {fqn: program_weights(exported_program)[fqn] for fqn in state}
        named_data, weights = weights_as_named_data({**partition.weights, **buffers})
        named_data[MODEL_NAME] = partition.xml
        named_data[CONSTANTS_NAME] = partition.constants
        first = len(boundary.inputs)
        processed = {
            "version": PROCESSED_VERSION,
            "weights": {fqn: meta for fqn, meta in weights.items() if fqn not in buffers},
            "parameters": partition.parameters,
            "outputs": partition.outputs,
            "state": state_record(
                buffers,
                [f"{INPUT_ROLE}{first + index}" for index in range(len(state))],
                [f"{OUTPUT_ROLE}{index}" for index in range(len(state))],
                partition.in_place,
            ),
            "precision": partition.precision,
            # What the model takes; its run side checks every call against it.
            "boundary": boundary.to_json(),
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        # The run side hands the buffer's memory to OpenVINO as both the IR's input and its output.
        return True

    def warm_up(self) -> None:
        # Forked compile workers inherit the import and the decomposition table.
        import openvino.frontend.pytorch.fx_decoder  # noqa: F401

        decompositions()
