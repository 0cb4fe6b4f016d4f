"""Lifted constant tensors handed to AOTInductor as buffers, so that its library asks for each by its FQN.

``torch.export`` lifts a tensor a module holds as a plain attribute (neither parameter nor buffer:
wav2vec2-conformer's cached rotary table, a mask built in ``__init__``) as a constant. Inductor
takes such a constant as fixed and folds what the code computes from it alone (a slice, a select)
into a new constant, ``_tensor_constant<N>``, at compile time. With the weights kept out of the
library, that folded tensor lives only in AOTInductor's own package, so the run side, which binds
each weight by the name the library asks for, could not find it among the delegate's weights, and
the load failed. As a non-persistent buffer the constant is the same tensor, read the same way at
run time, and asked for by its FQN, as parameters and buffers are.
"""

from __future__ import annotations

import dataclasses

from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind

from ...compile.program_parts import rebuilt


def with_constants_as_buffers(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each lifted constant tensor an input buffer that is not persistent.

    The program given is not changed; one without lifted constants is returned as it is.
    """
    signature = exported_program.graph_signature
    if not any(spec.kind is InputKind.CONSTANT_TENSOR for spec in signature.input_specs):
        return exported_program
    inputs = [
        dataclasses.replace(spec, kind=InputKind.BUFFER, persistent=False)
        if spec.kind is InputKind.CONSTANT_TENSOR else spec
        for spec in signature.input_specs
    ]
    return rebuilt(exported_program, exported_program.graph_module,
                   ExportGraphSignature(input_specs=inputs, output_specs=signature.output_specs))
