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

Each slot must hold whole groups, so that it reads its own scales. A slot that would end inside
one of torchao's groups (a row of 1408 in groups of 32: 176 columns a slot) holds groups of a
finer width instead, at least 16 columns, its scales (and zero points) stored for each: a
512x1408 ``8da4w`` layer at one row, 0.09 ms, against 0.64 two a byte. Where no finer width
serves, int4 values go two a byte, the same layout in 8-bit words, which still halves the bytes.

Values are stored offset to unsigned; the offset joins the zero point (``(u - o) - z = u - (z +
o)``), which the few-rows reduction takes out of its loop, and zero points that are all zero
(symmetric quantization) are not read at all. Other zero points are stored as float32 ``z + o``,
as the product reads them: read as int8 and widened each call, asymmetric int4 weights took a
Llama's call from 0.45x float32's time to 0.65x.

torchao's int8 configs that skip ``dequantize_affine`` are packed too: ``Int8WeightOnlyConfig``
casts the transposed int8 weight to float for a matrix product, and
``Int8DynamicActivationInt8WeightConfig`` hands it to ``_int_mm``; each then reads the transpose
of the slots joined, which the few-rows reduction splits as it splits a dequantization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from ...compile.constants import renamed_signature
from ...compile.graph_edits import inserted_call
from ...compile.packed_integers import WORDS, fit_signed, packed_words, signed_range, slots_in
from ...compile.program_parts import constant_placeholders, program_weights, rebuilt
from ...compile.quantize import is_dequantize, zero_free

aten = torch.ops.aten
prims = torch.ops.prims

# The fewest columns a scale is stored for where slots split torchao's groups: a multiple of a
# vector's 8 float lanes (AVX2), so that each vector of a slot reads one scale rather than
# gathers several; and float32 scales of 16 int4 values add at most half their bytes again.
FINEST_GROUP = 16


@dataclass(frozen=True)
class PackableWeight:
    """A stored int8 ``[n, k]`` (a linear's weight, an embedding's table) as its one reader reads it, and its words.

    ``reader`` is torchao's ``dequantize_affine`` of the stored values, or their transpose, which
    a product reads (``packable_transpose``).
    """

    reader: Node
    stored: Node
    fqn: str
    # Columns a scale covers once packed: torchao's group, or a part of it (``regrouped``).
    group: int
    # Bits a value takes (4 or 8), and the word the values are packed in (``packed_integers.WORDS``).
    bits: int
    word: torch.dtype
    # The stored scale and zero point, each repeated ``repeats`` times along its row, where a slot
    # ends inside torchao's group: each slot then holds whole groups of the finer width.
    regrouped: tuple[Node, ...] = ()
    repeats: int = 1
    # The stored zero points are all zero (symmetric quantization): read as none, not loaded each call.
    zero_free: bool = False
    # The stored zero points are stored again as float32 ``z + offset``, what each call computed from them:
    # the few-rows reduction's one product then reads floats, where Inductor loads small integers slowly.
    offset_zero_points: bool = False

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
    offset_fqns: set[str] = set()
    for weight in found:
        if weight.fqn not in packed:
            packed[weight.fqn] = packed_words(weights[weight.fqn], weight.bits, weight.word)
            weight.stored.meta["val"] = fake_like(weight.stored, packed[weight.fqn])
        # A scale that two alike readers share (one table read twice) is repeated once.
        for operand in (operand for operand in weight.regrouped if copied_fqns[operand] not in packed):
            fqn = copied_fqns[operand]
            packed[fqn] = weights[fqn].repeat_interleave(weight.repeats, dim=1).contiguous()
            operand.meta["val"] = fake_like(operand, packed[fqn])
        zero_point = weight.reader.args[3] if weight.offset_zero_points else None
        if zero_point is not None and copied_fqns[zero_point] not in offset_fqns:
            fqn = copied_fqns[zero_point]
            offset_fqns.add(fqn)
            packed[fqn] = packed.get(fqn, weights[fqn]).to(torch.float32) + (1 << (weight.bits - 1))
            zero_point.meta["val"] = fake_like(zero_point, packed[fqn])
        if is_dequantize(weight.reader):
            unpack(graph, weight)
        else:
            unpack_transpose(graph, weight)
    module = GraphModule(exported_program.graph_module, graph)
    state_dict = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.state_dict.items()}
    constants = {fqn: stored_as(value, packed.get(fqn)) for fqn, value in exported_program.constants.items()}
    signature = renamed_signature(exported_program.graph_signature, graph)
    return rebuilt(exported_program, module, signature, state_dict=state_dict, constants=constants)


def packable_weights(graph: Graph, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> list[PackableWeight]:
    """Every read of a stored int8 weight that can be packed, where all of it can be, in one layout.

    A weight that any other node reads (another op, a dequantization that cannot be split), or
    that two readers would pack differently, stays as it is.
    """
    found = [weight for node in graph.nodes
             if (weight := packable_weight(node, fqns, weights) or packable_transpose(node, fqns, weights)) is not None]
    readers = {weight.reader for weight in found}
    layouts: dict[Node, set[tuple[int, torch.dtype, int]]] = {}
    for weight in found:
        layouts.setdefault(weight.stored, set()).add((weight.bits, weight.word, weight.group))
    return [weight for weight in found
            if all(user in readers for user in weight.stored.users) and len(layouts[weight.stored]) == 1]


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
    if not group or not all(per_group(operand, rows, columns // group) for operand in (scale, zero_point)):
        return None
    symmetric = zero_free(zero_point, fqns, weights)
    owned = tuple(operand for operand in (scale, None if symmetric else zero_point) if operand is not None)
    regroupable = all(owned_by_alike(operand, node, fqns, weights) for operand in owned)
    offset_zero_points = (not symmetric and takes_offset(zero_point)
                          and owned_by_alike(zero_point, node, fqns, weights))
    layout = layout_for(columns, group, bits, regroupable)
    if layout is None:
        return None
    if not all(reads_as_weight(user, node) for user in node.users) or not node.users:
        return None
    if not fit_signed(value, bits):
        return None
    word, finer = layout
    return PackableWeight(node, stored, fqns[stored], finer, bits, word,
                          owned if finer != group else (), group // finer, symmetric, offset_zero_points)


def owned_by_alike(operand: Node, node: Node, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``operand`` is a stored tensor that only dequantizations alike ``node`` read, so can be stored anew."""
    return (operand in fqns and isinstance(weights.get(fqns[operand]), torch.Tensor)
            and all(dequantizes_alike(user, node) for user in operand.users))


def packable_transpose(node: Node, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> PackableWeight | None:
    """``t(stored)`` of int8 values, read as ``mm``'s second operand cast to float or as ``_int_mm``'s.

    ``Int8WeightOnlyConfig`` computes ``mm(x, t(stored).to(float))``, ``Int8DynamicActivationInt8WeightConfig``
    ``_int_mm(x, t(stored))``; both scale the product after.
    """
    if node.op != "call_function" or node.target is not aten.t.default:
        return None
    stored = node.args[0]
    value = weights.get(fqns[stored]) if stored in fqns else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int8 or value.dim() != 2:
        return None
    layout = layout_for(value.shape[1], value.shape[1], 8, regroupable=False)
    readers = [user for user in node.users if not is_metadata_check(user)]
    if layout is None or not readers or not all(reads_transposed(user, node) for user in readers):
        return None
    return PackableWeight(node, stored, fqns[stored], value.shape[1], 8, layout[0])


def dequantizes_alike(user: Node, node: Node) -> bool:
    """Whether ``user`` dequantizes as ``node`` does (one weight read twice), so is packed alike."""
    return is_dequantize(user) and user.args[:7] == node.args[:7]


def reads_transposed(user: Node, transposed: Node) -> bool:
    """Whether ``user`` is ``_int_mm(x, transposed)``, or a cast of ``transposed`` to float that only ``mm`` reads."""
    if user.target is aten._int_mm.default:
        return user.args[1] is transposed and user.args[0] is not transposed
    if user.target is not aten._to_copy.default or set(user.kwargs) != {"dtype"}:
        return False
    dtype = user.kwargs["dtype"]
    return (isinstance(dtype, torch.dtype) and dtype.is_floating_point and bool(user.users)
            and all(reader.target is aten.mm.default and reader.args[1] is user for reader in user.users))


def is_metadata_check(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten._assert_tensor_metadata.default


def layout_for(columns: int, group: int, bits: int, regroupable: bool) -> tuple[torch.dtype, int] | None:
    """The widest word whose slots each hold whole groups of a row of ``columns``, and the groups' width.

    A slot that would end inside a group (a row of 1408 in groups of 32, 176 columns a slot)
    holds whole groups of a finer width where the scales can be stored so (``regroupable``) and
    a vector of float lanes still reads one scale (16 columns here, each scale stored twice).
    """
    for word in WORDS:
        slots = slots_in(word, bits)
        if slots < 2 or columns % slots:
            continue
        run = columns // slots
        if group == columns or run % group == 0:
            return word, group
        finer = math.gcd(run, group)
        if regroupable and finer % FINEST_GROUP == 0:
            return word, finer
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
    node = weight.reader
    _, _, scale, zero_point, _, quant_min, quant_max, *rest = node.args
    zero_point = None if weight.zero_free else zero_point
    columns = node.meta["val"].shape[-1]
    groups = columns // weight.group
    offset = 1 << (weight.bits - 1)
    unsigned = weight.offset_zero_points or takes_offset(zero_point)
    if unsigned:
        quant_min, quant_max = quant_min + offset, quant_max + offset
    with graph.inserting_before(node):
        if unsigned and not weight.offset_zero_points:
            zero_point = offset_zero_point(graph, zero_point, scale, offset)
        slots = []
        for index in range(weight.slots):
            # Dequantized from int32, as torchao's op computes anyway: no round trip through int8.
            slot = slot_values(graph, weight, index, signed=not unsigned)
            slot_scale, slot_zero_point = (slot_of(graph, operand, index, weight.slots, groups)
                                           for operand in (scale, zero_point))
            block = [1, min(weight.group, columns // weight.slots)]
            arguments = (slot, block, slot_scale, slot_zero_point, torch.int32, quant_min, quant_max, *rest)
            slots.append(inserted_call(graph, node.target, arguments, dict(node.kwargs)))
        joined = inserted_call(graph, aten.cat.default, (slots, 1))
    joined.meta.update({key: value for key, value in node.meta.items() if key != "val"})
    for user in [user for user in node.users if user.target is aten.embedding.default]:
        gather_then_join(graph, user, slots)
    node.replace_all_uses_with(joined)
    graph.erase_node(node)
    if not joined.users:
        graph.erase_node(joined)


def unpack_transpose(graph: Graph, weight: PackableWeight) -> None:
    """Give each reader of ``t(stored)`` the transpose of a join of the slots, cast as it reads them."""
    transposed = weight.reader
    for user in list(transposed.users):
        if is_metadata_check(user):
            graph.erase_node(user)
            continue
        cast = user.target is aten._to_copy.default
        dtype = user.kwargs["dtype"] if cast else torch.int8
        with graph.inserting_before(user):
            slots = [inserted_call(graph, aten._to_copy.default, (slot_values(graph, weight, index),), {"dtype": dtype})
                     for index in range(weight.slots)]
            joined = inserted_call(graph, aten.cat.default, (slots, 1))
            result = inserted_call(graph, aten.t.default, (joined,))
        if cast:
            result.meta.update({key: value for key, value in user.meta.items() if key != "val"})
            user.replace_all_uses_with(result)
            graph.erase_node(user)
        else:
            user.replace_input_with(transposed, result)
    graph.erase_node(transposed)


def slot_values(graph: Graph, weight: PackableWeight, index: int, signed: bool = True) -> Node:
    """Slot ``index`` of the stored words as int32: the values as they were before packing, else offset unsigned."""
    # Each slot reads the words itself: words all slots read would be written out whole.
    words = integer_words(graph, weight.stored, weight.word)
    shifted = words if index == 0 else inserted_call(
        graph, aten.bitwise_right_shift.Tensor_Scalar, (words, weight.bits * index))
    value = inserted_call(graph, aten.bitwise_and.Scalar, (shifted, (1 << weight.bits) - 1))
    return inserted_call(graph, aten.sub.Tensor, (value, 1 << (weight.bits - 1))) if signed else value


def is_int8_slot(node: Any) -> bool:
    """Whether ``node`` is what ``slot_values`` computes for a signed int8 slot: ``(words & 255) - 128``."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target is not aten.sub.Tensor:
        return False
    masked, offset = node.args[:2]
    return (offset == 128 and isinstance(masked, Node) and masked.target is aten.bitwise_and.Scalar
            and masked.args[1] == 255)


def takes_offset(zero_point: Any) -> bool:
    """Whether a dequantization's zero point can absorb the packing's offset exactly: absent, or integers.

    ``(u - o) - z == u - (z + o)`` for the slot's unsigned values ``u``, so the offset costs no
    operation per value; the few-rows reduction then takes ``z + o`` out of its loop with any
    zero point (``quantized.without_zero_point``): one operation of seven a value fewer.
    """
    if zero_point is None:
        return True
    value = zero_point.meta.get("val") if isinstance(zero_point, Node) else None
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and not value.dtype.is_complex


def offset_zero_point(graph: Graph, zero_point: Node | None, scale: Node, offset: int) -> Node:
    """``zero_point + offset`` in int32, where int8 could overflow; ``offset`` for each scale if there is none."""
    if zero_point is None:
        return inserted_call(graph, aten.full_like.default, (scale, offset), {"dtype": torch.int32})
    widened = inserted_call(graph, prims.convert_element_type.default, (zero_point, torch.int32))
    return inserted_call(graph, aten.add.Tensor, (widened, offset))


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
