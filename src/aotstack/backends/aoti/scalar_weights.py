"""Single-value weights written into the partition's code as ``full([], value)``.

Inductor holds a 0-d weight as a ``Constant``, a value rather than a tensor, and its view
lowerings (``unsqueeze``, ``expand``) cannot take one. A functional program reaches one through
a view where the model writes a Python number into a tensor (BEiT's relative position index:
``index[0, 0] = n`` exports as a lifted 0-d constant copied into a select, which Inductor's
no-op removal hands straight to an ``unsqueeze``), so such a partition failed to compile though
plain AOTInductor compiles the same model from ``torch.export`` as it comes. ``full`` is a
tensor to every lowering, and Inductor writes its value into the kernels just the same.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from ...compile.constants import renamed_signature, without_unused_constants
from ...compile.program_parts import constant_placeholders, program_weights, rebuilt

# The dtypes whose every value ``full`` makes exactly from the Python number ``item()`` gives.
WRITABLE_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


def with_scalar_weights_inlined(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each 0-d weight it never updates read as ``full([], value)``, and no longer an input.

    The program given is not changed; one without such weights is returned as it is.
    """
    updated = set(exported_program.graph_signature.buffers_to_mutate.values())
    weights = program_weights(exported_program)
    scalars = {node: weights[fqn] for node, fqn in constant_placeholders(exported_program).items()
               if fqn not in updated and is_scalar(weights[fqn])}
    if not scalars:
        return exported_program
    graph = Graph()
    # The copy may rename a placeholder: each is found through the copy's map, not by name.
    copies: dict[Node, Node] = {}
    graph.output(graph.graph_copy(exported_program.graph, copies))
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    for original, value in scalars.items():
        with graph.inserting_after(last_placeholder):
            copies[original].replace_all_uses_with(full_call(graph, copies[original], value))
    module = GraphModule(exported_program.graph_module, graph)
    program = rebuilt(exported_program, module, renamed_signature(exported_program.graph_signature, graph))
    return without_unused_constants(program, read_before={copies[original].name for original in scalars})


def is_scalar(value: torch.Tensor) -> bool:
    """A plain 0-d tensor whose value ``full`` writes exactly (a subclass, torchao's say, is left alone)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.dim() == 0 and value.dtype in WRITABLE_DTYPES


def full_call(graph: Graph, placeholder: Node, value: torch.Tensor) -> Node:
    """``aten.full([], value)`` with the placeholder's dtype and device, and its ``meta["val"]``."""
    number, kwargs = value.item(), {"dtype": value.dtype, "device": placeholder.meta["val"].device}
    node = graph.call_function(torch.ops.aten.full.default, ([], number), kwargs)
    with detect_fake_mode([placeholder.meta["val"]]):
        node.meta["val"] = torch.ops.aten.full.default([], number, **kwargs)
    return node
