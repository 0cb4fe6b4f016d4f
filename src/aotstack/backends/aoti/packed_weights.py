"""Integer weights packed into words for AOTInductor on the CPU, and read so.

torchao keeps each int4 or int8 value of a weight in an int8 (``IntxWeightOnlyConfig``,
``Int8DynamicActivationIntxWeightConfig``, aotstack's ``4w``/``8w``/``8da4w``/``8da8w``, for linears
and embeddings). Compiled as is, an int4 weight takes twice the bytes it needs, and Inductor's
generated code reads the int8s slowly: on AVX2 it loads each run of 8 small integers through a
buffer on the stack, a stalled load per step (a 768x2048 int8 linear at one row, 1 thread: 2.7 ms,
against 0.20 ms in float32).

Here each such weight ``[n, k]`` is stored as ``[n, k // slots]`` words of ``slots`` values each
(``packed_words``): 32-bit words of eight int4 or four int8 values, typed float32 so that the
generated code loads them as floats, a full vector at once, and reads the bits as integers. Slot
``i`` of a row's words holds its ``i``-th run of ``k // slots`` columns, so the dequantization
becomes one per slot, joined along the row; the few-rows reduction (``quantized.py``) splits a
linear's product at the join, and its one loop reads each word once, every slot of it. An
embedding gathers its rows from each slot, then joins them. The same layer as above: 0.26 ms in
int8 words, 0.29-0.37 ms in int4 words (1.45 ms two int4 a byte).

Each slot must hold whole groups. Where 32-bit words cannot (a row of 768 in groups of 128), int4
values go two a byte, the same layout in 8-bit words, which still halves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import Graph, GraphModule, Node

from ...compile.constants import renamed_output_specs
from ...compile.packed_integers import WORDS, fit_signed, packed_words, signed_range, slots_in
from ...compile.program_parts import constant_placeholders, program_weights
from ...compile.quantize import is_dequantize
from .passes import inserted_call

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass(frozen=True)
class PackableWeight:
    """A ``dequantize_affine`` of a stored int8 ``[n, k]``: a linear's weight, an embedding's table, and its words."""

    dequantize: Node
    stored: Node
    fqn: str
    group: int
    # Bits a value takes (4 or 8), and the word the values are packed in (``packed_integers.WORDS``).
    bits: int
    word: torch.dtype

    @property
    def slots(self) -> int:
        return slots_in(self.word, self.bits)


def with_packed_weights(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each int4 and int8 weight packed into words and unpacked where it is read.

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
            packed[weight.fqn] = packed_words(weights[weight.fqn], weight.bits, weight.word)
            weight.stored.meta["val"] = fake_like(weight.stored, packed[weight.fqn])
        unpack(graph, weight)
    module = GraphModule(exported_program.graph_module, graph)
    state_dict = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.state_dict.items()}
    constants = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.constants.items()}
    signature = ExportGraphSignature(input_specs=exported_program.graph_signature.input_specs,
                                     output_specs=renamed_output_specs(exported_program.graph_signature, graph))
    return exported_program._update(module, signature, state_dict=state_dict, constants=constants)


def packable_weights(graph: Graph, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> list[PackableWeight]:
    """Every dequantization of a stored int8 weight that can be packed, where all of it can be.

    A weight that any other node reads (another op, a dequantization that cannot be split) stays
    as it is.
    """
    found = [weight for node in graph.nodes if (weight := packable_weight(node, fqns, weights)) is not None]
    packable = {weight.dequantize for weight in found}
    return [weight for weight in found if all(user in packable for user in weight.stored.users)]


def packable_weight(node: Node, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> PackableWeight | None:
    if not is_dequantize(node) or len(node.args) < 7:
        return None
    stored, block_size, scale, zero_point, input_dtype, quant_min, quant_max = node.args[:7]
    if stored not in fqns or input_dtype != torch.int8 or quant_min is None or quant_max is None:
        return None
    bits = next((bits for bits in (4, 8) if quant_min in signed_range(bits) and quant_max in signed_range(bits)), None)
    value = weights.get(fqns[stored])
    if bits is None or not isinstance(value, torch.Tensor) or value.dtype != torch.int8 or value.dim() != 2:
        return None
    rows, columns = value.shape
    group = int(block_size[-1]) if len(block_size) == 2 and int(block_size[0]) == 1 else 0
    word = word_for(columns, group, bits)
    if word is None or not all(per_group(operand, rows, columns // group) for operand in (scale, zero_point)):
        return None
    if not all(reads_as_weight(user, node) for user in node.users) or not node.users:
        return None
    if not fit_signed(value, bits):
        return None
    return PackableWeight(node, stored, fqns[stored], group, bits, word)


def word_for(columns: int, group: int, bits: int) -> torch.dtype | None:
    """The widest word whose slots each hold whole groups of a row of ``columns``, so keep their own scales."""
    for word in WORDS:
        slots = slots_in(word, bits)
        if slots < 2 or columns % slots or not group:
            continue
        if group == columns or (columns // slots) % group == 0:
            return word
    return None


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


def unpack(graph: Graph, weight: PackableWeight) -> None:
    """Put a join of the dequantized slots, read from the packed words, in place of ``weight``'s dequantization."""
    node = weight.dequantize
    stored, _, scale, zero_point, *rest = node.args
    columns = node.meta["val"].shape[-1]
    groups = columns // weight.group
    mask, offset = (1 << weight.bits) - 1, 1 << (weight.bits - 1)
    with graph.inserting_before(node):
        slots = []
        for index in range(weight.slots):
            # Each slot reads the words itself: words all slots read would be written out whole.
            words = integer_words(graph, stored, weight.word)
            shifted = words if index == 0 else inserted_call(
                graph, aten.bitwise_right_shift.Tensor_Scalar, (words, weight.bits * index))
            value = inserted_call(graph, aten.bitwise_and.Scalar, (shifted, mask))
            # Dequantized from int32, as torchao's op computes anyway: no round trip through int8.
            slot = inserted_call(graph, aten.sub.Tensor, (value, offset))
            operands = [slot_of(graph, operand, index, weight.slots, groups) for operand in (scale, zero_point)]
            block = [1, min(weight.group, columns // weight.slots)]
            arguments = (slot, block, *operands, torch.int32, *rest[1:])
            slots.append(inserted_call(graph, node.target, arguments, dict(node.kwargs)))
        joined = inserted_call(graph, aten.cat.default, (slots, 1))
    joined.meta.update({key: value for key, value in node.meta.items() if key != "val"})
    for user in [user for user in node.users if user.target is aten.embedding.default]:
        gather_then_join(graph, user, slots)
    node.replace_all_uses_with(joined)
    graph.erase_node(node)
    if not joined.users:
        graph.erase_node(joined)


def integer_words(graph: Graph, stored: Node, word: torch.dtype) -> Node:
    """The stored words as int32: float32 words' bits as they are, bytes widened."""
    if word is torch.float32:
        return inserted_call(graph, aten.view.dtype, (stored, torch.int32))
    return inserted_call(graph, prims.convert_element_type.default, (stored, torch.int32))


def gather_then_join(graph: Graph, embedding: Node, slots: list[Node]) -> None:
    """Gather ``embedding``'s rows from each slot of its table and join them: a few rows, not the table, joined."""
    _, indices, *rest = embedding.args
    with graph.inserting_before(embedding):
        gathered = [inserted_call(graph, aten.embedding.default, (slot, indices, *rest)) for slot in slots]
        joined = inserted_call(graph, aten.cat.default, (gathered, -1))
    joined.meta.update({key: value for key, value in embedding.meta.items() if key != "val"})
    embedding.replace_all_uses_with(joined)
    graph.erase_node(embedding)


def slot_of(graph: Graph, operand: Any, index: int, slots: int, groups: int) -> Any:
    """A per-group operand's columns for one slot of the weight; a per-row one (a single group) serves every slot."""
    if not isinstance(operand, Node) or groups == 1:
        return operand
    return inserted_call(graph, aten.slice.Tensor, (operand, 1, index * groups // slots, (index + 1) * groups // slots))


def fake_like(node: Node, tensor: torch.Tensor) -> Any:
    fake_mode = torch._guards.detect_fake_mode([node.meta.get("val")])
    return tensor if fake_mode is None else fake_mode.from_tensor(tensor, static_shapes=True)


def stored_as(value: Any, packed: torch.Tensor | None) -> Any:
    """``packed`` in ``value``'s place, a parameter where ``value`` was one; ``value`` where nothing was packed."""
    if packed is None:
        return value
    return torch.nn.Parameter(packed, requires_grad=False) if isinstance(value, torch.nn.Parameter) else packed
