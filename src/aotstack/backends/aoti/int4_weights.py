"""int4 weights stored two a byte for AOTInductor on the CPU, and read so.

torchao keeps each int4 value of a weight in an int8 (``IntxWeightOnlyConfig(int4)``,
``Int8DynamicActivationIntxWeightConfig(int4)``, aotstack's ``4w`` and ``8da4w``, for linears and
embeddings). Compiled as is, the file and the process hold twice the bytes the weights need.

Here each such weight ``[n, k]`` is stored as ``[n, k // 2]`` bytes, each row's first half in the
low nibbles and its second half in the high ones (``packed_int4_halves``). Its dequantization
becomes two, one per half, joined along the row. The few-rows reduction (``quantized.py``) splits
a linear's product at the join, so its one loop reads each byte once, both nibbles of it; an
embedding gathers its rows from each half, then joins them. Interleaved nibbles, or the halves
joined inside the loop, cost 3-10x in Inductor's generated code (a 2048x2048 ``8da4w`` layer, 1
thread); split halves run level with the int8 form (1.01-1.04x its time; 1.11x for a 32000-row
output layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import Graph, GraphModule, Node

from ...compile.constants import renamed_output_specs
from ...compile.packed_integers import fit_signed, packed_int4_halves, signed_range
from ...compile.program_parts import constant_placeholders, program_weights
from ...compile.quantize import is_dequantize
from .passes import inserted_call

aten = torch.ops.aten
prims = torch.ops.prims

INT4 = signed_range(4)


@dataclass(frozen=True)
class Int4Weight:
    """A ``dequantize_affine`` of a stored int8 ``[n, k]`` of 4-bit values: a linear's weight, an embedding's table."""

    dequantize: Node
    stored: Node
    fqn: str
    group: int


def with_packed_int4_weights(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each int4 weight stored two a byte and unpacked where it is read.

    The program given is not changed; one without such weights is returned as it is.
    """
    weights = program_weights(exported_program)
    fqns = constant_placeholders(exported_program)
    graph = Graph()
    graph.output(graph.graph_copy(exported_program.graph, {}))
    copied_fqns = {node: fqns[original] for node, original in zip(graph.nodes, exported_program.graph.nodes)
                   if original in fqns}
    found = packable_weights(graph, copied_fqns, weights)
    if not found:
        return exported_program
    packed: dict[str, torch.Tensor] = {}
    for weight in found:
        if weight.fqn not in packed:
            packed[weight.fqn] = packed_int4_halves(weights[weight.fqn])
            weight.stored.meta["val"] = fake_like(weight.stored, packed[weight.fqn])
        unpack(graph, weight)
    module = GraphModule(exported_program.graph_module, graph)
    state_dict = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.state_dict.items()}
    constants = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.constants.items()}
    signature = ExportGraphSignature(input_specs=exported_program.graph_signature.input_specs,
                                     output_specs=renamed_output_specs(exported_program.graph_signature, graph))
    return exported_program._update(module, signature, state_dict=state_dict, constants=constants)


def packable_weights(graph: Graph, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> list[Int4Weight]:
    """Every dequantization of a stored int8 weight whose values fit 4 bits, where all of it can be packed.

    A weight that any other node reads (another op, a dequantization that cannot be split) stays
    as it is.
    """
    found = [weight for node in graph.nodes if (weight := packable_weight(node, fqns, weights)) is not None]
    packable = {weight.dequantize for weight in found}
    return [weight for weight in found if all(user in packable for user in weight.stored.users)]


def packable_weight(node: Node, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> Int4Weight | None:
    if not is_dequantize(node) or len(node.args) < 7:
        return None
    stored, block_size, scale, zero_point, input_dtype, quant_min, quant_max = node.args[:7]
    if stored not in fqns or input_dtype != torch.int8 or quant_min is None or quant_max is None:
        return None
    if quant_min < INT4.start or quant_max >= INT4.stop:
        return None
    value = weights.get(fqns[stored])
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int8 or value.dim() != 2:
        return None
    rows, columns = value.shape
    group = int(block_size[-1]) if len(block_size) == 2 and int(block_size[0]) == 1 else 0
    # Each half must hold whole groups, so it keeps its own columns of scales.
    if columns % 2 or not group or (group != columns and (columns // 2) % group):
        return None
    if not all(per_group(operand, rows, columns // group) for operand in (scale, zero_point)):
        return None
    if not all(reads_as_weight(user, node) for user in node.users) or not node.users:
        return None
    if not fit_signed(value, 4):
        return None
    return Int4Weight(node, stored, fqns[stored], group)


def per_group(operand: Any, rows: int, groups: int) -> bool:
    """Whether a scale or zero point is ``[rows, groups]``, one per group (or absent)."""
    if operand is None:
        return True
    value = operand.meta.get("val") if isinstance(operand, Node) else None
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (rows, groups)


def reads_as_weight(user: Node, weight: Node) -> bool:
    """Whether ``user`` reads ``weight`` only as a linear's weight or an embedding's table."""
    if user.op != "call_function" or user.target not in (aten.linear.default, aten.embedding.default):
        return False
    position = 1 if user.target is aten.linear.default else 0
    operands = [*user.args, *user.kwargs.values()]
    return len(user.args) > position and user.args[position] is weight and operands.count(weight) == 1


def unpack(graph: Graph, weight: Int4Weight) -> None:
    """Put a join of two dequantized halves, read from the packed bytes, in place of ``weight``'s dequantization."""
    node = weight.dequantize
    stored, _, scale, zero_point, *rest = node.args
    columns = node.meta["val"].shape[-1]
    groups = columns // weight.group
    with graph.inserting_before(node):
        halves = []
        for index, nibble_of in enumerate((aten.bitwise_and.Scalar, aten.bitwise_right_shift.Tensor_Scalar)):
            # Each half reads the bytes itself: a conversion both read is written out whole.
            values = inserted_call(graph, prims.convert_element_type.default, (stored, torch.int32))
            nibble = inserted_call(graph, nibble_of, (values, 0xF if index == 0 else 4))
            # Dequantized from int32, as torchao's op computes anyway: no round trip through int8.
            half = inserted_call(graph, aten.sub.Tensor, (nibble, 8))
            operands = [half_of(graph, operand, index, groups) for operand in (scale, zero_point)]
            block = [1, min(weight.group, columns // 2)]
            arguments = (half, block, *operands, torch.int32, *rest[1:])
            halves.append(inserted_call(graph, node.target, arguments, dict(node.kwargs)))
        joined = inserted_call(graph, aten.cat.default, (halves, 1))
    joined.meta.update({key: value for key, value in node.meta.items() if key != "val"})
    for user in [user for user in node.users if user.target is aten.embedding.default]:
        gather_then_join(graph, user, halves)
    node.replace_all_uses_with(joined)
    graph.erase_node(node)
    if not joined.users:
        graph.erase_node(joined)


def gather_then_join(graph: Graph, embedding: Node, halves: list[Node]) -> None:
    """Gather ``embedding``'s rows from each half of its table and join them: a few rows, not the table, joined."""
    _, indices, *rest = embedding.args
    with graph.inserting_before(embedding):
        gathered = [inserted_call(graph, aten.embedding.default, (half, indices, *rest)) for half in halves]
        joined = inserted_call(graph, aten.cat.default, (gathered, -1))
    joined.meta.update({key: value for key, value in embedding.meta.items() if key != "val"})
    embedding.replace_all_uses_with(joined)
    graph.erase_node(embedding)


def half_of(graph: Graph, operand: Any, index: int, groups: int) -> Any:
    """A per-group operand's columns for one half of the weight; a per-row one (a single group) serves both."""
    if not isinstance(operand, Node) or groups == 1:
        return operand
    return inserted_call(graph, aten.slice.Tensor, (operand, 1, index * groups // 2, (index + 1) * groups // 2))


def fake_like(node: Node, tensor: torch.Tensor) -> Any:
    fake_mode = torch._guards.detect_fake_mode([node.meta.get("val")])
    return tensor if fake_mode is None else fake_mode.from_tensor(tensor, static_shapes=True)


def stored_as(value: Any, packed: torch.Tensor | None) -> Any:
    """``packed`` in ``value``'s place, a parameter where ``value`` was one; ``value`` where nothing was packed."""
    if packed is None:
        return value
    return torch.nn.Parameter(packed, requires_grad=False) if isinstance(value, torch.nn.Parameter) else packed
