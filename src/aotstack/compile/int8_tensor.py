"""torchao's ``Int8Tensor`` linears as an exported graph holds them, found for every engine alike.

``Int8WeightOnlyConfig`` and ``Int8DynamicActivationInt8WeightConfig`` leave no
``dequantize_affine`` feeding an ``aten.linear`` (the pattern ``aotstack.quantize``'s configs
leave); their weight subclass computes the layer in ATen ops, which export keeps:

- weight-only, one scale per output channel (or per tensor):
  ``mul(mm(x, _to_copy(t(int8 weights), float32)), view(scales, [N]))``;
- weight-only in groups: ``mm(x, t(dequantize_affine(int8 weights, [1, group], ...)))``;
- dynamic: ``x``'s per-token int8 round (``choose_qparams_affine`` → ``quantize_affine``), then
  ``mul(mul(_to_copy(_int_mm(q, t(int8 weights)), float32), view(x scale, [-1, 1])), view(scales, [N]))``,
  with, for asymmetric activations, ``zero point × x scale × each channel's weight sum`` subtracted
  before the last ``mul``.

An engine that claimed these ops one by one would compute the layer with unpacked weights
(a float copy of them, or an integer matmul between its own ops); each engine asks this module
for the layer's nodes, so it takes a layer whole, on a packed kernel, or leaves it whole. Any
other cast of integer weights to float (``integer_weights_cast``) is a quantized layer no engine
recognizes: an engine that claimed it would hold those weights as floats.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from .graph_edits import edited_copy, inserted_call, replace_node

aten = torch.ops.aten
# Ops that only reshape: looked through between a layer's nodes.
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
# Checks of a tensor's dtype and layout that export leaves beside a subclass's ops; a layer keeps those of its nodes.
METADATA_CHECKS = frozenset({aten._assert_tensor_metadata.default})
TRANSPOSES = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})
# What quantized weights are stored in (torchao keeps int4 values in int8); an integer buffer of another
# dtype (positions, a mask) cast to float is not a dequantization.
QUANTIZED_DTYPES = frozenset({torch.int8, torch.uint8, torch.int4, torch.uint4})
# Ops that move or copy a tensor's values without computing: looked through back to a weight.
LAYOUT_OPS = RESHAPES | TRANSPOSES | {aten.expand.default, aten.clone.default}


@dataclass(frozen=True)
class Int8Linear:
    """One ``Int8Tensor`` linear: its nodes, its weights, and how its activations are rounded."""

    # The layer's float result, ``[rows, N]``; the node an engine's kernel replaces.
    output: Node
    # ``aten.mm`` or ``aten._int_mm``.
    matmul: Node
    # What the matmul reads as its weight operand: ``_to_copy(t(w))``, ``t(dequantize_affine(w))`` or ``t(w)``.
    weight_operand: Node
    stored: Node
    scales: Node
    zero_points: Node | None
    # The group along the input dimension; the whole input dimension for one scale per channel or per tensor.
    group: int
    # The float activations: the ``mm``'s own input (weight-only), or the tensor the round starts from (dynamic).
    activations: Node
    # Every node of the layer, ``output`` first.
    members: tuple[Node, ...]
    # The nodes of the activations' int8 round (dynamic layers): ``choose_qparams_affine`` first.
    round_trip: tuple[Node, ...] = ()
    # ``"SYMMETRIC"`` or ``"ASYMMETRIC"`` for a dynamic layer, None for a weight-only one.
    mapping: str | None = None
    # The ``dequantize_affine`` of a grouped weight-only layer.
    dequantize: Node | None = None

    @property
    def per_tensor(self) -> bool:
        return self.scales.meta["val"].numel() == 1

    @property
    def label(self) -> str:
        """``"linear 8da8w, per channel"``: the name ``compile.quantize`` gives quantized layers."""
        columns = self.stored.meta["val"].shape[-1]
        grouping = ("per tensor" if self.per_tensor else "per channel") if self.group == columns \
            else f"group {self.group}"
        return f"linear {'8da' if self.mapping else ''}{self.bits}w, {grouping}"

    @property
    def bits(self) -> int:
        """8, or what a grouped layer's ``dequantize_affine`` range says (``[-8, 7]``: 4)."""
        if self.dequantize is None:
            return 8
        arguments = list(self.dequantize.args) + [None] * 7
        low = self.dequantize.kwargs.get("quant_min", arguments[5])
        high = self.dequantize.kwargs.get("quant_max", arguments[6])
        return 8 if low is None or high is None else int(high - low + 1).bit_length() - 1

    @property
    def choose_qparams(self) -> Node | None:
        return self.round_trip[0] if self.round_trip else None


def int8_linears(graph: Graph) -> list[Int8Linear]:
    """Every ``Int8Tensor`` linear of ``graph``, in graph order."""
    return [layer for node in graph.nodes if (layer := int8_linear(node)) is not None]


def int8_linear(output: Node) -> Int8Linear | None:
    """The ``Int8Tensor`` linear whose result ``output`` is, or None."""
    if not is_call(output):
        return None
    if output.target is aten.mm.default:
        return grouped_weight_only(output)
    if output.target is aten.mul.Tensor:
        return per_channel_linear(output)
    return None


def grouped_weight_only(mm: Node) -> Int8Linear | None:
    """``mm(x, t(dequantize_affine(int8 weights, [1, group], ...)))``."""
    activations, operand = mm.args
    if not is_call(operand) or operand.target not in TRANSPOSES or not is_transpose_2d(operand):
        return None
    dequantize = operand.args[0]
    # Int8Tensor dequantizes a grouped weight for its own matmul only.
    if not is_torchao(dequantize, "dequantize_affine") or set(plain_users(dequantize)) != {operand} \
            or set(plain_users(operand)) != {mm}:
        return None
    stored, block, scales, zero_points = (list(dequantize.args) + [None] * 4)[:4]
    if not (is_integer_weight(stored) and isinstance(scales, Node) and len(block) == 2 and block[0] == 1):
        return None
    members = (mm, operand, dequantize)
    return Int8Linear(mm, mm, operand, stored, scales, zero_points if isinstance(zero_points, Node) else None,
                      int(block[1]), activations, with_checks(members, (stored, scales, zero_points)),
                      dequantize=dequantize)


def per_channel_linear(output: Node) -> Int8Linear | None:
    """``mul(<the matmul's float result>, view(scales, [N]))``: weight-only or dynamic, one scale per channel."""
    for product, scale_view in (output.args, reversed(output.args)):
        scales, reshapes = through_reshapes(scale_view)
        if not is_float_weight(scales) or not is_call(product):
            continue
        if product.target is aten.mm.default:
            layer = weight_only(output, product, scales, reshapes)
        else:
            layer = dynamic(output, product, scales, reshapes)
        if layer is not None:
            return layer
    return None


def weight_only(output: Node, mm: Node, scales: Node, reshapes: tuple[Node, ...]) -> Int8Linear | None:
    """``mul(mm(x, _to_copy(t(int8 weights), float32)), view(scales, [N]))``."""
    activations, cast = mm.args
    if not is_float_cast(cast) or not is_call(cast.args[0]) or cast.args[0].target not in TRANSPOSES:
        return None
    transpose = cast.args[0]
    stored = transpose.args[0]
    if not is_transpose_2d(transpose) or not is_integer_weight(stored) or not fits_channels(scales, stored):
        return None
    members = (output, mm, cast, transpose, *reshapes)
    return Int8Linear(output, mm, cast, stored, scales, None, stored.meta["val"].shape[-1], activations,
                      with_checks(members, (stored, scales)))


def dynamic(output: Node, product: Node, scales: Node, reshapes: tuple[Node, ...]) -> Int8Linear | None:
    """``Int8DynamicActivationInt8WeightConfig``'s layer, from its last ``mul`` back to the activations' round."""
    correction: tuple[Node, ...] = ()
    scaled = product
    if product.target is aten.sub.Tensor:
        scaled, subtracted = product.args
        correction = asymmetric_correction(subtracted)
        if not correction:
            return None
    if not is_call(scaled) or scaled.target is not aten.mul.Tensor:
        return None
    for cast, x_scale_view in (scaled.args, reversed(scaled.args)):
        if not is_float_cast(cast) or not is_call(cast.args[0]) or cast.args[0].target is not aten._int_mm.default:
            continue
        int_mm = cast.args[0]
        quantized, transpose = int_mm.args
        stored = transpose.args[0] if is_call(transpose) and transpose.target in TRANSPOSES else None
        if stored is None or not is_transpose_2d(transpose) or not is_integer_weight(stored):
            return None
        if not fits_channels(scales, stored) or (correction and not sums_rows_of(correction[-1], stored)):
            return None
        quantize, quantized_reshapes = through_reshapes(quantized)
        x_scale, x_scale_reshapes = through_reshapes(x_scale_view)
        round_trip = activation_round(quantize, x_scale)
        if round_trip is None or (correction and correction_zero_point(correction) is not round_trip[2]):
            return None
        choose = round_trip[0]
        if correction and correction_x_scale(correction) is not x_scale:
            return None
        round_nodes = (*round_trip, *quantized_reshapes, *x_scale_reshapes)
        members = (output, scaled, cast, int_mm, transpose, *reshapes, *correction, *round_nodes,
                   *((product,) if correction else ()))
        mapping = str(getattr(choose.args[1], "name", choose.args[1]))
        return Int8Linear(output, int_mm, transpose, stored, scales, None, stored.meta["val"].shape[-1],
                          choose.args[0], with_checks(members, (stored, scales)), round_nodes, mapping)
    return None


def integer_weights_cast(node: Node, is_weight: Callable[[Node], bool]) -> Node | None:
    """The quantized weights (a matrix of 8 bits or fewer) ``node`` casts to a floating dtype, looking through
    layout ops; None for any other node.

    ``is_weight`` says which placeholders are weights (an engine knows its program's).
    """
    value = node.meta.get("val")
    if not is_call(node) or node.target not in CASTS or not isinstance(value, torch.Tensor) \
            or not value.is_floating_point():
        return None
    source = node.args[0]
    while is_call(source) and source.target in LAYOUT_OPS:
        source = source.args[0]
    stored = source.meta.get("val") if isinstance(source, Node) and source.op == "placeholder" else None
    if not isinstance(stored, torch.Tensor) or stored.dtype not in QUANTIZED_DTYPES or stored.dim() < 2 \
            or not is_weight(source):
        return None
    return source


def activation_round(quantize: Node, x_scale: Node) -> tuple[Node, ...] | None:
    """``(choose_qparams_affine, its scale getitem, its zero point getitem, quantize_affine)``, or None.

    The round must take its parameters from ``choose_qparams_affine`` on the same tensor it
    quantizes, and the layer must rescale by that scale.
    """
    if not is_torchao(quantize, "quantize_affine"):
        return None
    source, _, scale, zero_point = quantize.args[:4]
    if scale is not x_scale or not is_getitem(scale, 0) or not is_getitem(zero_point, 1):
        return None
    choose = scale.args[0]
    if zero_point.args[0] is not choose or not is_torchao(choose, "choose_qparams_affine") \
            or choose.args[0] is not source:
        return None
    return choose, scale, zero_point, quantize


def asymmetric_correction(subtracted: Node) -> tuple[Node, ...]:
    """The nodes of ``zero point × x scale × weight sums``, the ``sum`` last; () where it is not that."""
    if not is_call(subtracted) or subtracted.target is not aten.mul.Tensor:
        return ()
    for pair, sums in (subtracted.args, reversed(subtracted.args)):
        if not is_float_cast(sums) or not is_call(sums.args[0]) or sums.args[0].target is not aten.sum.dim_IntList:
            continue
        if not is_call(pair) or pair.target is not aten.mul.Tensor:
            continue
        parts: list[Node] = []
        for operand in pair.args:
            if is_float_cast(operand):
                parts.append(operand)
                operand = operand.args[0]
            _, reshapes = through_reshapes(operand)
            parts.extend(reshapes)
        return (subtracted, pair, *parts, sums, sums.args[0])
    return ()


def correction_zero_point(correction: tuple[Node, ...]) -> Node | None:
    """The activations' zero point the correction reads (a getitem of ``choose_qparams_affine``)."""
    pair = correction[1]
    for operand in pair.args:
        if is_float_cast(operand):
            source, _ = through_reshapes(operand.args[0])
            return source
    return None


def correction_x_scale(correction: tuple[Node, ...]) -> Node | None:
    pair = correction[1]
    for operand in pair.args:
        if not is_float_cast(operand):
            source, _ = through_reshapes(operand)
            return source
    return None


def sums_rows_of(total: Node, stored: Node) -> bool:
    """Whether ``total`` is ``sum(stored, [-1])``: each output channel's sum of weights."""
    return total.args[0] is stored and [int(dim) % 2 for dim in total.args[1]] == [1]


def plain_users(node: Node) -> list[Node]:
    """The nodes that read ``node``, metadata checks left out."""
    return [user for user in node.users if not (is_call(user) and user.target in METADATA_CHECKS)]


def with_checks(members: tuple[Node, ...], weights: tuple[Node | None, ...]) -> tuple[Node, ...]:
    """``members`` with the metadata checks that read one of them or one of the layer's weights."""
    read = {*members, *(weight for weight in weights if weight is not None)}
    checks = [
        user for node in read for user in node.users
        if is_call(user) and user.target in METADATA_CHECKS and user not in members
    ]
    return tuple(dict.fromkeys((*members, *checks)))


def through_reshapes(node: object) -> tuple[object, tuple[Node, ...]]:
    """The tensor ``node`` reshapes, looking through views; and the reshapes on the way."""
    reshapes = []
    while is_call(node) and node.target in RESHAPES:
        reshapes.append(node)
        node = node.args[0]
    return node, tuple(reshapes)


def is_call(node: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function"


def is_getitem(node: object, index: int) -> bool:
    return is_call(node) and node.target is operator.getitem and node.args[1] == index


def is_torchao(node: object, name: str) -> bool:
    target = getattr(node, "target", None)
    return is_call(node) and isinstance(target, torch._ops.OpOverload) and target.namespace == "torchao" \
        and target._opname == name


def is_float_cast(node: object) -> bool:
    """``_to_copy(x, dtype=float32)`` and nothing else (same device, layout, memory format)."""
    return is_cast_to(node, torch.float32)


def is_cast_to(node: object, dtype: torch.dtype) -> bool:
    """``_to_copy(x, dtype=dtype)`` and nothing else."""
    return is_call(node) and node.target is aten._to_copy.default and node.kwargs == {"dtype": dtype}


def is_transpose_2d(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    return sorted(int(dim) % 2 for dim in node.args[1:3]) == [0, 1]


def is_integer_weight(node: object) -> bool:
    """A placeholder holding a 2-D int8 tensor (a weight, unless an engine says otherwise)."""
    value = node.meta.get("val") if isinstance(node, Node) and node.op == "placeholder" else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.int8 and value.dim() == 2


def is_float_weight(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, Node) and node.op == "placeholder" else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


def fits_channels(scales: Node, stored: Node) -> bool:
    """Whether ``scales`` holds one value per output channel of ``stored``, or one for the whole tensor."""
    return scales.meta["val"].numel() in (1, stored.meta["val"].shape[0])


# torchao's unsigned activations, undone -----------------------------------------------------------


@dataclass(frozen=True)
class UnsignedProduct:
    """``sub(_int_mm(u8(i32(q) + 128), w), mul(sum(w, [0], True, int32), 128))``, which equals ``_int_mm(q, w)``."""

    signed: Node
    weights: Node
    # The nodes of the shift and of taking it out again, which the signed product leaves unread.
    shift: tuple[Node, ...]


def with_signed_int8_products(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with each ``Int8Tensor`` product over unsigned activations made the signed product it equals.

    On a CPU with VNNI and without AMX, torchao (0.18, torch 2.12 and newer) computes a dynamic
    int8 layer in the form VNNI's instructions take: ``q`` shifted to unsigned, multiplied, and the
    shift taken out again. So a program depends on the CPU that exported it, and every engine
    reading the layer (``int8_linear``) would meet a second form. Here each such form becomes the
    one other CPUs export, which is exact: integer sums either way. ``exported`` is returned as it
    is where it has none.
    """
    if not any(unsigned_product(node) is not None for node in exported.graph.nodes):
        return exported

    def edit(graph: Graph, copies: dict[Node, Node]) -> None:
        shifts: list[Node] = []
        for node in list(graph.nodes):
            found = unsigned_product(node)
            if found is None:
                continue
            with graph.inserting_before(node):
                product = inserted_call(graph, aten._int_mm.default, (found.signed, found.weights))
            replace_node(graph, node, product)
            shifts.extend(found.shift)
        # A metadata check of a node the signed product leaves unread would keep it computed.
        for node in shifts:
            for check in [user for user in node.users if is_call(user) and user.target in METADATA_CHECKS]:
                graph.erase_node(check)
        graph.eliminate_dead_code()

    return edited_copy(exported, edit)


def unsigned_product(node: Node) -> UnsignedProduct | None:
    """``node`` read as an ``UnsignedProduct``, or None."""
    if not is_call(node) or node.target is not aten.sub.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    int_mm, compensation = node.args
    if not is_call(int_mm) or int_mm.target is not aten._int_mm.default:
        return None
    unsigned, weights = int_mm.args
    shift = shifted_from(unsigned)
    if shift is None or not is_call(compensation) or compensation.target is not aten.mul.Tensor:
        return None
    total, factor = compensation.args
    if factor != 128 or not is_call(total) or total.target is not aten.sum.dim_IntList:
        return None
    if total.args[0] is not weights or [int(dim) for dim in total.args[1]] not in ([0], [-2]):
        return None
    return UnsignedProduct(shift[-1], weights, (*shift[:-1], int_mm, compensation, total))


def shifted_from(unsigned: object) -> tuple[Node, ...] | None:
    """Where ``unsigned`` is ``_to_copy(add(_to_copy(q, dtype=int32), 128), dtype=uint8)`` of an int8 ``q``: those
    nodes, ``q`` last."""
    if not (is_cast_to(unsigned, torch.uint8) and is_call(unsigned.args[0])):
        return None
    shifted = unsigned.args[0]
    if shifted.target is not aten.add.Tensor or shifted.args[1] != 128:
        return None
    if not is_cast_to(shifted.args[0], torch.int32):
        return None
    widened = shifted.args[0]
    signed = widened.args[0]
    value = signed.meta.get("val") if isinstance(signed, Node) else None
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.int8):
        return None
    return unsigned, shifted, widened, signed
