"""Matrix products of a few rows as reductions, on the CPU, before AOTInductor compiles them.

A decode step multiplies one row by each weight, so its linears are bound by memory: each
reads its whole weight once. AOTInductor compiles a linear as a call to ATen's matrix product,
which reads memory slowly at one row, and torchao's quantized layers worse. As a multiply and a
sum over the input dimension (``sum(x.unsqueeze(-2) * w, -1)``), Inductor compiles one
vectorized reduction that streams the weight. Each extra row reads the weight again, so a
prefill's many rows keep the matrix product.

- **Float weights** read along their rows (a ``Linear``'s ``[out, in]``), at most
  ``FLOAT_MAX_ROWS`` rows. 1 thread, AMD EPYC with AVX-512, weights cycled through 400 MB so each
  comes from memory, a 768x2048 layer: float32 at one row 0.22 ms against 0.38 as a product, two
  rows 0.45 against 0.68, four 0.52 against 0.64; bfloat16 at one row 0.12 against 0.24, two rows
  0.19 against 0.23, four 0.32 against 0.23 (slower). A weight stored the other way (GPT-2's
  ``Conv1D``, ``[in, out]``) keeps the product: its reduction strides through memory (0.43 ms
  against 0.30).
- **Dequantized weights**, at most ``MAX_ROWS`` rows. torchao's quantized layers
  (``IntxWeightOnlyConfig``, ``Int8DynamicActivationIntxWeightConfig``, aotstack's
  ``8w``/``4w``/``8da8w``/``8da4w``) export as a ``linear`` whose weight operand is computed from
  integer weights and their scales. Compiled as written, a kernel writes the whole float weight
  out, then a float matrix product reads it back: more than twice the bytes of the float model,
  1.4-4x slower than float32 (measured on Llama decoders). The reduction fuses the dequantization
  and reads each integer once (a 2048x2048 ``8da4w`` linear, 1 thread: 0.71 ms against 1.93 ms
  as written).

An ``_int_mm`` (``Int8DynamicActivationInt8WeightConfig``'s layers) of one row: its activation
laid out row-major. ATen's CPU kernel computes wrong numbers for a one-row operand whose row
stride is not its row length, and Inductor gives a one-row view the row stride 0; plain
AOTInductor's decode step of such a model is wrong by orders of magnitude (torch 2.13).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from ...compile.graph_edits import inserted_call, replace_node
from ...compile.quantize import is_dequantize
from .packed_weights import is_int8_slot

aten = torch.ops.aten
prims = torch.ops.prims

# Rows (the input's elements over its last dimension) up to which the reduction is the faster
# form over dequantized weights: at 4 rows 2.26 ms against 2.52 as written, for the 8da4w layer above.
MAX_ROWS = 4
# And over float weights: bfloat16's reduction is the slower at 4 rows (see above).
FLOAT_MAX_ROWS = 2

# Integer dtypes that hold quantized weights; wider integers are indices, not weights.
WEIGHT_INTEGERS = frozenset({torch.int8, torch.uint8, torch.int16, torch.uint16})


@dataclass(frozen=True)
class Product:
    """A matrix product's operands read as a linear's: ``input @ weight.T + bias``."""

    input: Node
    weight: Node
    # The weight node holds ``weight.T`` (``mm``'s second operand) rather than ``weight``.
    transposed: bool
    bias: Node | None
    # ``_int_mm``: int8 operands, an int32 product.
    integer: bool = False


class FewRowsProductAsReductionPass:
    """Rewrite a product of few rows as ``sum(x.unsqueeze(-2) * w, -1)``, over float or dequantized weights.

    It reads ``linear(x, w, b)``, and ``mm(x, w.T)`` and ``addmm(b, x, w.T)`` as a decomposed
    program or ``Int8WeightOnlyConfig`` (a cast of the int8 weights) has them. ``x`` is computed
    once before the reduction (Inductor would otherwise recompute its own quantization, which a
    dynamically quantized layer has, for every weight it multiplies).
    """

    def __call__(self, graph_module: GraphModule) -> bool:
        graph = graph_module.graph
        found = [node for node in graph.nodes if reduced_product(node) is not None]
        for node in found:
            # Read now, not when found: a product over another's result reads the rewrite that replaced it.
            product = reduced_product(node)
            if product is None:
                continue
            with graph.inserting_before(node):
                stride = list(product.input.meta["val"].stride())
                source = product.input
                if product.integer:
                    # Summed in float32: exact to 2**24, which 1024 products of int8s cannot pass.
                    source = inserted_call(graph, prims.convert_element_type.default, (source, torch.float32))
                computed = inserted_call(graph, force_stride_order(), (source, stride))
                weight = transposed(graph, product.weight) if product.transposed else product.weight
                pieces = column_pieces(weight)
                sums, taken = [], []
                for piece, columns in pieces:
                    part = computed
                    if columns is not None:
                        part = inserted_call(graph, aten.slice.Tensor, (computed, -1, *columns))
                    piece, zero_points = without_zero_point(graph, piece, part)
                    taken.extend([zero_points] if zero_points is not None else [])
                    if product.integer:
                        piece = widened(piece)
                    sums.append(inner_products(graph, part, piece))
                result = sums[0]
                for partial in sums[1:]:
                    result = inserted_call(graph, aten.add.Tensor, (result, partial))
                for zero_points in whole_zero_points(taken, computed, len(pieces)):
                    result = inserted_call(graph, aten.sub.Tensor, (result, zero_point_product(graph, zero_points)))
                if product.bias is not None:
                    result = inserted_call(graph, aten.add.Tensor, (result, product.bias))
                if product.integer:
                    result = inserted_call(graph, prims.convert_element_type.default, (result, torch.int32))
            replace_node(graph, node, result)
            # A join left unread is still compiled, a whole float weight written each call.
            erase_unread(graph, product.weight)
        if found:
            graph_module.recompile()
        return bool(found)


class IntMmRowMajorPass:
    """Make ``_int_mm``'s first operand a row-major buffer of its own, whatever view it was."""

    def __call__(self, graph_module: GraphModule) -> bool:
        graph = graph_module.graph
        products = [
            node for node in graph.nodes
            if node.op == "call_function" and node.target is aten._int_mm.default
            and isinstance(node.args[0], Node) and isinstance(node.args[0].meta.get("val"), torch.Tensor)
        ]
        for node in products:
            operand = node.args[0]
            columns = operand.meta["val"].shape[-1]
            with graph.inserting_before(node):
                row_major = inserted_call(graph, force_stride_order(), (operand, [columns, 1]))
            node.replace_input_with(operand, row_major)
        if products:
            graph_module.recompile()
        return bool(products)


def column_pieces(weight: Node) -> list[tuple[Node, tuple[int, int] | None]]:
    """The pieces a weight is joined from along its input dimension, each with its columns; else the weight, whole.

    A product over such a weight is a sum of one product per piece, each reading its piece in
    place (packed weights are so joined, ``packed_weights.py``), where one product over the
    join would read every piece, masked, at every column.
    """
    if weight.op != "call_function" or weight.target is not aten.cat.default:
        return [(weight, None)]
    pieces, dim = weight.args[0], (weight.args[1] if len(weight.args) > 1 else 0)
    values = [piece.meta.get("val") if isinstance(piece, Node) else None for piece in pieces]
    if dim not in (1, -1) or not all(isinstance(value, torch.Tensor) and value.dim() == 2 for value in values):
        return [(weight, None)]
    ends = list(itertools.accumulate(int(value.shape[1]) for value in values))
    return [(piece, (end - int(value.shape[1]), end)) for piece, value, end in zip(pieces, values, ends)]


def inner_products(graph: Graph, rows: Node, weight: Node) -> Node:
    """``rows @ weight.T`` as a multiply and a sum over the last dimension, which Inductor fuses into one loop."""
    products = inserted_call(graph, aten.mul.Tensor, (inserted_call(graph, aten.unsqueeze.default, (rows, -2)), weight))
    return inserted_call(graph, aten.sum.dim_IntList, (products, [-1]))


@dataclass(frozen=True)
class ZeroPoints:
    """Zero points taken out of a product's loop, and the columns (``part``) they multiply, ``group`` per scale."""

    part: Node
    scale: Node
    zero_point: Node
    group: int


def without_zero_point(graph: Graph, piece: Node, part: Node) -> tuple[Node, ZeroPoints | None]:
    """``piece`` dequantized without its zero points, and the zero points taken; else ``piece``.

    ``sum_k x_k (q_k - z_g) s_g = sum_k x_k q_k s_g - sum_g (sum_{k in g} x_k) z_g s_g``: the loop over
    the weights no longer reads a zero point per group nor subtracts one per value (a 768x2048
    ``8da4w`` layer at one row, 1 thread: 0.29 ms against 0.37), and the zero points meet the
    activations' group sums in a product as small as the scales (``zero_point_product``).
    """
    if not is_dequantize(piece) or len(piece.args) < 5:
        return piece, None
    if (piece.args[7] if len(piece.args) > 7 else piece.kwargs.get("output_dtype", torch.float32)) != torch.float32:
        return piece, None
    stored, block, scale, zero_point = piece.args[:4]
    values = [value.meta.get("val") if isinstance(value, Node) else None for value in (piece, scale, zero_point)]
    if not all(isinstance(value, torch.Tensor) for value in values) or values[0].dim() != 2:
        return piece, None
    (rows, columns), groups = values[0].shape, values[1].shape[-1]
    if tuple(values[1].shape) != (rows, groups) or tuple(values[2].shape) != (rows, groups) or columns % groups:
        return piece, None
    if list(block) != [1, columns // groups]:
        return piece, None
    without = inserted_call(graph, piece.target, (stored, block, scale, None, *piece.args[4:]), dict(piece.kwargs))
    return without, ZeroPoints(part, scale, zero_point, columns // groups)


def whole_zero_points(taken: list[ZeroPoints], whole: Node, pieces: int) -> list[ZeroPoints]:
    """The zero points of every piece of a product over ``whole`` as one, where they are one tensor's; else ``taken``.

    A packed weight's slots (``packed_weights.py``) each read their columns of one scale and zero
    point, or all of a per-row one: then one small product corrects the sum, where one per slot
    cost more than the slots' loop (eight kernels, each a horizontal sum a row).
    """
    if len(taken) < 2 or len(taken) != pieces or len({zero_points.group for zero_points in taken}) != 1:
        return taken
    columns = int(whole.meta["val"].shape[-1])
    scales, zero_points = [item.scale for item in taken], [item.zero_point for item in taken]
    scale, zero_point = tiled(scales), tiled(zero_points)
    if scale is not None and zero_point is not None:
        return [ZeroPoints(whole, scale, zero_point, taken[0].group)]
    per_row = taken[0].scale.meta["val"].shape[-1] == 1
    if per_row and all(node is scales[0] for node in scales) and all(node is zero_points[0] for node in zero_points):
        return [ZeroPoints(whole, scales[0], zero_points[0], columns)]
    return taken


def tiled(nodes: list[Node]) -> Node | None:
    """The tensor that ``nodes``, slices of it along its last dimension, cover in order, end to end; else None."""
    source = nodes[0].args[0] if nodes[0].op == "call_function" else None
    value = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    end = 0
    for node in nodes:
        if node.op != "call_function" or node.target is not aten.slice.Tensor or node.args[0] is not source:
            return None
        dim, start, stop, *step = node.args[1:]
        if dim not in (1, -1) or start != end or step not in ([], [1]):
            return None
        end = stop
    return source if end == value.shape[-1] else None


def zero_point_product(graph: Graph, zero_points: ZeroPoints) -> Node:
    """``sum_g (sum_{k in g} x_k) z_g s_g`` for ``zero_points.part`` (``x``): what the zero points take from the sum."""
    part, group = zero_points.part, zero_points.group
    leading, columns = list(part.meta["val"].shape[:-1]), int(part.meta["val"].shape[-1])
    grouped = inserted_call(graph, aten.view.default, (part, [*leading, columns // group, group]))
    group_sums = inserted_call(graph, aten.sum.dim_IntList, (grouped, [-1]))
    zeros = inserted_call(graph, prims.convert_element_type.default, (zero_points.zero_point, torch.float32))
    return inner_products(graph, group_sums, inserted_call(graph, aten.mul.Tensor, (zeros, zero_points.scale)))


def widened(piece: Node) -> Node:
    """The int32 values ``piece`` casts to int8, where they are a packed slot's, so fit it; else ``piece``.

    Inductor's code converts an int32 vector to int8 and that to float slowly (``packed_weights.py``
    hands ``_int_mm`` its slots so cast): a 768x2048 layer at one row, 1 thread, 2.3 ms; 0.17 ms read
    as int32.
    """
    if piece.op != "call_function" or piece.target is not aten._to_copy.default:
        return piece
    source = piece.args[0]
    return source if piece.kwargs.get("dtype") is torch.int8 and is_int8_slot(source) else piece


def transposed(graph: Graph, weight: Node) -> Node:
    """``weight.T``: what ``weight`` transposes, where it is a transpose, so a join beneath stays in sight."""
    if weight.op == "call_function" and weight.target is aten.t.default:
        return weight.args[0]
    return inserted_call(graph, aten.t.default, (weight,))


def erase_unread(graph: Graph, node: Node) -> None:
    """Erase ``node`` if nothing reads it, then each of its inputs that nothing reads after that."""
    pending = [node]
    while pending:
        node = pending.pop()
        if node.op != "call_function" or node.users or node.graph is not graph or node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        pending.extend(inputs)


def force_stride_order() -> torch._ops.OpOverload:
    """Inductor's op that makes its input a buffer of its own (imported with Inductor, on the compile side)."""
    import torch._inductor.inductor_prims  # noqa: F401

    return torch.ops.prims.inductor_force_stride_order.default


def reduced_product(node: Node) -> Product | None:
    """``node`` read as a product that is faster as a reduction: few static rows, over float or dequantized weights."""
    product = product_of(node)
    if product is None or not few_rows(product):
        return None
    if is_dequantized(product.weight):
        return product
    if product.integer or rows(product) > FLOAT_MAX_ROWS or not read_along_rows(product):
        return None
    return product


def product_of(node: Node) -> Product | None:
    """``node`` read as ``input @ weight.T + bias``: a ``linear``, ``mm``, ``addmm`` or ``_int_mm``; else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        input, weight, *rest = node.args
        return Product(input, weight, False, rest[0] if rest else node.kwargs.get("bias"))
    if node.target is aten.mm.default:
        return Product(node.args[0], node.args[1], True, None)
    if node.target is aten.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        return Product(node.args[1], node.args[2], True, node.args[0])
    if node.target is aten._int_mm.default:
        return Product(node.args[0], node.args[1], True, None, integer=True)
    return None


def few_rows(product: Product) -> bool:
    """Whether the input is static, of at most ``MAX_ROWS`` rows, and the weight 2-D: float, or int8 for ``_int_mm``."""
    input, weight = (value.meta.get("val") if isinstance(value, Node) else None
                     for value in (product.input, product.weight))
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if weight.dim() != 2 or input.dim() == 0 or not (weight.dtype.is_floating_point or product.integer):
        return False
    if not all(isinstance(size, int) for size in [*input.shape, *weight.shape]):
        return False
    return rows(product) <= MAX_ROWS


def rows(product: Product) -> int:
    """The product's rows: its input's elements over the last dimension."""
    return math.prod(product.input.meta["val"].shape[:-1])


def read_along_rows(product: Product) -> bool:
    """Whether the weight's values along the input dimension lie next to each other in memory.

    The reduction walks that dimension; a weight stored across it makes every step a stride.
    """
    weight = product.weight.meta["val"]
    axis = 0 if product.transposed else 1
    return weight.shape[axis] == 1 or weight.stride()[axis] == 1


def is_dequantized(weight: Any) -> bool:
    """Whether ``weight`` is computed (not a weight itself) from a tensor of quantized integers.

    Such a tensor is stored as integers, or as words whose bits are read as integers
    (``packed_weights.py``).
    """
    if not isinstance(weight, Node) or weight.op != "call_function":
        return False
    seen: set[Node] = set()
    pending = [weight]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if is_stored_words(node):
            return True
        if node.op in ("placeholder", "get_attr"):
            if isinstance(value, torch.Tensor) and value.dtype in WEIGHT_INTEGERS:
                return True
            continue
        pending.extend(arg for arg in node.all_input_nodes)
    return False


def is_stored_words(node: Node) -> bool:
    """Whether ``node`` reads a stored tensor's bits as integers."""
    if node.op != "call_function" or node.target is not aten.view.dtype:
        return False
    stored, value = node.args[0], node.meta.get("val")
    return (isinstance(stored, Node) and stored.op in ("placeholder", "get_attr")
            and isinstance(value, torch.Tensor) and not value.dtype.is_floating_point)
