"""``XnnpackBackend``: the compile side of ExecuTorch's XNNPACK delegate (the run side is ``run.py``).

What a delegate stores: the ``.pte`` ExecuTorch wrote (the XNNPACK graph and ExecuTorch's plan,
a few kB), the frame of its external data file, and each constant XNNPACK reads as named data
of its own (``compile.py``). The constants are XNNPACK's serialized form (4-bit weights packed
two to a byte, ...), keyed in the package by content, so one read by several partitions or
methods is stored once.
"""

from __future__ import annotations

import json

from torch.export import ExportedProgram

from ...compile.cache import structure_key
from ...compile.program_parts import partition_boundary, program_structure
from ...engine.interface import Backend
from ...engine.session import check_host_target
from ...format.specs import CompileSpec, PreprocessResult, SpecKey, partition_label
from .compile import lower_partition, warmed_lowering
from .run import FRAME_NAME, PROCESSED_VERSION, PROGRAM_NAME
from .shared import from_template, keep_template, role_tensors


class XnnpackBackend(Backend):
    """ExecuTorch's XNNPACK delegate as a stacked engine, on the CPU."""

    backend_id = "xnnpack"
    cached_by_packages = ("executorch", "torchao")
    # 2: no template of a lowering whose program holds weights itself; earlier ones may carry another's weights.
    compile_revision = 2
    run_side_specs = (SpecKey.THREADS,)
    # A model's repeated layers lower once (``shared.py``), where XNNPACK stores their weights as they are.
    shares_code_across_weights = True

    def check_specs(self, compile_specs: list[CompileSpec]) -> None:
        check_host_target(compile_specs, "XnnpackBackend")

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        self.check_specs(compile_specs)
        # ExecuTorch reads host memory.
        boundary = partition_boundary(exported_program, label, "cpu")
        partition = lower_partition(exported_program, label)
        named_data = {PROGRAM_NAME: partition.program, **partition.data}
        if partition.frame:
            named_data[FRAME_NAME] = partition.frame
        processed = {
            "version": PROCESSED_VERSION,
            "segments": [segment.to_json() for segment in partition.segments],
            "data_size": partition.data_size,
            "outputs": partition.outputs,
            # The segments XNNPACK reads only to pack them: its run side lets their memory go after the first call.
            "packed": partition.packed,
            # What ExecuTorch runs outside XNNPACK, on its portable kernels (for the curious; never read).
            "portable_ops": partition.portable,
            # What the program takes; its run side checks every call against it.
            "boundary": boundary.to_json(),
        }
        structure = program_structure(exported_program)
        key = structure_key(self, structure, compile_specs)
        # A template gives another partition its own weights through the data file alone: constants written into
        # the program would be this partition's values in every partition made from it.
        if key is not None and not partition.constants_in_program:
            keep_template(key, role_tensors(exported_program, structure), processed, named_data, PROGRAM_NAME,
                          FRAME_NAME)
        return PreprocessResult(json.dumps(processed).encode(), named_data)

    def cached_preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult | None:
        self.check_specs(compile_specs)
        structure = program_structure(exported_program)
        key = structure_key(self, structure, compile_specs)
        made = None if key is None else from_template(
            key, role_tensors(exported_program, structure), PROGRAM_NAME, FRAME_NAME
        )
        if made is None:
            return None
        processed, named_data = made
        label = partition_label(self.backend_id, compile_specs)
        processed["boundary"] = partition_boundary(exported_program, label, "cpu").to_json()
        return PreprocessResult(json.dumps(processed).encode(), named_data, from_cache=True)

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        # XNNPACK takes torchao's quantize ops into its own kernels (``lower_partition`` refuses a
        # part with any op left outside the delegate), so a loading process needs none registered.
        return []

    def warm_up(self) -> None:
        # Forked compile workers inherit ExecuTorch's compiler and what its first lowering sets up
        # (its edge ops' tables, XNNPACK's serializer): a part compiles in about 2 s after it, 7 s without.
        warmed_lowering()
