"""Which torchao-quantized linears and embeddings ONNX Runtime runs on its packed-weight kernels, and which not.

torchao's configs (``aotstack.quantize``, ExecuTorch's ``8w``/``8da8w``/``4w``/``8da4w``) leave these
patterns in an exported program, once ``aotstack.export`` has unwrapped its weight subclasses:

- a weight: ``torchao.dequantize_affine(int8 weights, [1, group], scales, zero points, int8, qmin, qmax)``
  feeding the weight of ``aten.linear`` or ``aten.embedding``; ``[-8, 7]`` is int4, ``[-128, 127]`` int8;
- ``8da``: the linear's input is a per-token int8 round trip of the activations,
  ``choose_qparams_affine`` → ``quantize_affine`` → ``dequantize_affine``;

and torchao's ``Int8Tensor`` linears (``Int8WeightOnlyConfig``,
``Int8DynamicActivationInt8WeightConfig``) leave theirs in ATen ops (``mm`` over a cast of int8
weights, ``_int_mm``; see ``compile/int8_tensor.py``), taken or refused whole like the others.

Each such layer maps to one ONNX Runtime contrib op that reads packed weights (see ``Kernel``).
Any other cast of integer weights to float is refused: ONNX Runtime would compute that layer with
float weights, unpacked.
Both the partitioner (which nodes to claim, and why not) and the compile side (what to translate)
read this one analysis, so they cannot disagree.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from ...compile.int8_tensor import Int8Linear, int8_linears, integer_weights_cast

# ONNX Runtime's block sizes (MatMulNBits, GatherBlockQuantized) are powers of two of at least 16.
MIN_BLOCK = 16
# A larger block only coarsens the int8 activations of accuracy_level 4: 128 and 4096 ran alike.
MAX_BLOCK = 128
# Linears whose activations ONNX Runtime quantizes to int8 itself, in blocks along K.
INT8_ACTIVATIONS = 4
FLOAT_ACTIVATIONS = 0

_BITS = {(-8, 7): 4, (-128, 127): 8}
_ACTIVATION_MAPPINGS = ("ASYMMETRIC", "SYMMETRIC")


@dataclass(frozen=True)
class Kernel:
    """The ONNX Runtime op one quantized layer becomes.

    ``MatMulNBits``: 4- or 8-bit weights packed along K in blocks of ``block_size``; with
    ``accuracy_level`` 4 it quantizes the activations to int8 per block (torchao's ``8da``).
    ``DynamicQuantizeMatMul``: 8-bit weights per output channel (stored as uint8), activations quantized to uint8 over
    the whole tensor, which for one row is torchao's per-token asymmetric round trip exactly.
    ``MatMulInteger``: 8-bit weights per output channel (uint8), activations quantized per row by ONNX ops
    that repeat torchao's per-token arithmetic, then an integer matmul (several rows).
    ``GatherBlockQuantized``: an embedding table of 4- or 8-bit rows.
    """

    op: str
    bits: int
    block_size: int = 0
    accuracy_level: int = FLOAT_ACTIVATIONS
    # ``MatMulInteger``: torchao's symmetric per-token rounding (scale max|x| / 127.5, no zero point), not asymmetric.
    symmetric: bool = False


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``dequantize_affine`` of stored integer weights: ``(stored - zero_points) * scales`` per group.

    For an ``Int8Tensor`` linear, ``dequantize`` is what its matmul reads as the weight operand.
    """

    dequantize: Node
    stored: Node
    scales: Node
    zero_points: Node | None
    bits: int
    # torchao's group along the input dimension; the whole dimension for one scale per output channel.
    group: int

    @property
    def per_channel(self) -> bool:
        return self.group == self.stored.meta["val"].shape[-1]

    def describe(self) -> str:
        return f"{self.bits}-bit weights, " + ("per channel" if self.per_channel else f"group {self.group}")


@dataclass(frozen=True)
class ActivationRoundTrip:
    """torchao's per-token int8 quantize-dequantize of a linear's input (``8da``)."""

    source: Node
    mapping: str
    nodes: tuple[Node, ...]
    # torchao's smallest scale: its ``eps`` argument, or float32's smallest normal.
    eps: float = float(torch.finfo(torch.float32).smallest_normal)


@dataclass(frozen=True)
class QuantizedLayer:
    """One ``aten.linear`` or ``aten.embedding`` over a quantized weight, and the kernel it becomes."""

    node: Node
    weight: QuantizedWeight
    kernel: Kernel
    # What the kernel reads besides its weights: a linear's float activations (before any round
    # trip), an embedding's indices.
    source: Node
    round_trip: ActivationRoundTrip | None = None
    # Every node of an ``Int8Tensor`` linear (its ``mm`` or ``_int_mm``, casts, scale products, checks).
    members: tuple[Node, ...] = ()

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The layer's own node and the torchao nodes it replaces."""
        if self.members:
            return self.members
        return (self.node, self.weight.dequantize, *(self.round_trip.nodes if self.round_trip else ()))

    @property
    def op(self) -> torch._ops.OpOverload:
        """The op the layer is, whatever ops it is made of: what ``OrtPartitioner(ops=...)`` decides it by."""
        embedding = self.node.target is torch.ops.aten.embedding.default
        return torch.ops.aten.embedding.default if embedding else torch.ops.aten.linear.default

    @property
    def flattened(self) -> bool:
        """Whether the layer's result has the rows of its source flattened into one dimension (``_int_mm``'s)."""
        if self.op is torch.ops.aten.embedding.default:
            return False
        return self.node.meta["val"].dim() != self.source.meta["val"].dim()


@dataclass
class QuantizedGraph:
    """The quantized layers of one graph that ONNX Runtime takes, and why it refuses the rest."""

    layers: list[QuantizedLayer] = field(default_factory=list)
    # Every node of a refused layer, and every torchao node that belongs to no layer: why.
    refusals: dict[Node, str] = field(default_factory=dict)

    def layer_of(self) -> dict[Node, QuantizedLayer]:
        return {node: layer for layer in self.layers for node in layer.nodes}


def quantized_graph(graph: Graph, weight_names: frozenset[str] | None, quantized_activations: bool) -> QuantizedGraph:
    """The quantized layers of ``graph``; ``weight_names`` names its weight placeholders (None: any placeholder).

    A layer is taken whole or not at all: its weight's dequantization and its activations' round
    trip go with it, so a layer refused here goes, whole, to another engine. One whose dequantized
    weight or activations also feed a node that is not a taken layer is refused, as those nodes
    would need the float tensors this translation never makes.
    """
    candidates: dict[Node, QuantizedLayer | str] = {
        node: layer_or_refusal(node, weight_names, quantized_activations)
        for node in graph.nodes
        if layer_weight(node) is not None
    }
    parts = {node: layer_parts(node) for node in candidates}
    for match in int8_linears(graph):
        if weight_names is None or match.stored.name in weight_names:
            candidates[match.output] = int8_layer_or_refusal(match, weight_names, quantized_activations)
            parts[match.output] = match.members
    changed = True
    while changed:
        changed = False
        for node, candidate in candidates.items():
            if isinstance(candidate, QuantizedLayer):
                shared = shared_with_refused(candidate, candidates)
                if shared is not None:
                    candidates[node], changed = shared, True
    result = QuantizedGraph()
    for node, candidate in candidates.items():
        if isinstance(candidate, QuantizedLayer):
            result.layers.append(candidate)
        else:
            for part in parts[node]:
                result.refusals.setdefault(part, candidate)
    taken = result.layer_of()
    for node in graph.nodes:
        if node in taken or node in result.refusals:
            continue
        if is_torchao(node):
            result.refusals[node] = (
                f"{torchao_name(node)} is not part of a quantized linear or embedding ONNX Runtime reads packed "
                "(a dequantized weight feeding aten.linear or aten.embedding, or a per-token int8 round trip of "
                "a linear's input)"
            )
        elif node.target is operator.getitem and isinstance(node.args[0], Node) and node.args[0] in result.refusals:
            result.refusals[node] = result.refusals[node.args[0]]
        elif (weights := integer_weights_cast(node, lambda stored: is_weight(stored, weight_names))) is not None:
            result.refusals[node] = (
                f"it converts the integer weights {weights.name!r} to float outside any quantized layer ONNX "
                "Runtime recognizes, so ONNX Runtime would compute with them unpacked"
            )
    return result


def layer_or_refusal(
    node: Node, weight_names: frozenset[str] | None, quantized_activations: bool
) -> QuantizedLayer | str:
    """``node``'s layer as ONNX Runtime would run it, judged on its own; or why it cannot."""
    weight = quantized_weight(layer_weight(node), weight_names)
    if isinstance(weight, str):
        return with_layer(node, weight)
    if node.target is torch.ops.aten.embedding.default:
        kernel = embedding_kernel(weight)
        if isinstance(kernel, str):
            return with_layer(node, kernel, weight)
        return QuantizedLayer(node, weight, kernel, node.args[1])
    activations = node.args[0]
    round_trip = activation_round_trip(activations)
    if isinstance(round_trip, str):
        return with_layer(node, round_trip)
    refused = linear_input_refusal(node, weight)
    if refused is not None:
        return with_layer(node, refused)
    source = round_trip.source if round_trip else activations
    kernel = linear_kernel(weight, round_trip, rows(source), quantized_activations)
    if isinstance(kernel, str):
        return with_layer(node, kernel, weight, round_trip)
    return QuantizedLayer(node, weight, kernel, source, round_trip)


def int8_layer_or_refusal(
    match: Int8Linear, weight_names: frozenset[str] | None, quantized_activations: bool
) -> QuantizedLayer | str:
    """An ``Int8Tensor`` linear as ONNX Runtime would run it, judged on its own; or why it cannot."""
    if match.dequantize is not None:
        weight = quantized_weight(match.dequantize, weight_names)
        if isinstance(weight, QuantizedWeight):
            weight = QuantizedWeight(match.weight_operand, weight.stored, weight.scales, weight.zero_points,
                                     weight.bits, weight.group)
    else:
        weight = int8_channel_weight(match, weight_names)
    if isinstance(weight, str):
        return with_layer(match.matmul, weight)
    round_trip = None
    if match.mapping is not None:
        round_trip = int8_round_trip(match)
        if isinstance(round_trip, str):
            return with_layer(match.matmul, round_trip, weight)
    activations = match.activations.meta.get("val")
    if not isinstance(activations, torch.Tensor) or activations.dtype != torch.float32:
        return with_layer(match.matmul, "ONNX Runtime's quantized kernels here take float32 activations", weight,
                          round_trip)
    kernel = linear_kernel(weight, round_trip, rows(match.activations), quantized_activations)
    if isinstance(kernel, str):
        return with_layer(match.matmul, kernel, weight, round_trip)
    return QuantizedLayer(match.output, weight, kernel, match.activations, round_trip, match.members)


def int8_channel_weight(match: Int8Linear, weight_names: frozenset[str] | None) -> QuantizedWeight | str:
    """The int8 weights of an ``Int8Tensor`` linear with one scale per channel (or per tensor), or why not."""
    if not is_weight(match.stored, weight_names) or not is_weight(match.scales, weight_names):
        return "its weights or scales are computed in the graph, not stored"
    columns = match.stored.meta["val"].shape[-1]
    return QuantizedWeight(match.weight_operand, match.stored, match.scales, None, 8, columns)


def int8_round_trip(match: Int8Linear) -> ActivationRoundTrip | str:
    """The per-token int8 round of an ``Int8Tensor`` linear's activations, or why ONNX Runtime cannot repeat it."""
    choose = match.choose_qparams
    quantize = match.round_trip[3]
    source = match.activations.meta["val"]
    expected = [1] * (source.dim() - 1) + [source.shape[-1]]
    if list(choose.args[2]) != expected or list(quantize.args[1]) != expected:
        return "its activations are not quantized to int8 per token"
    if choose.args[3] != torch.int8 or tuple(choose.args[4:6]) != (-128, 127) \
            or tuple(quantize.args[4:7]) != (torch.int8, -128, 127):
        return "its activations are not quantized to int8 over [-128, 127]"
    if match.mapping not in _ACTIVATION_MAPPINGS:
        return f"its activations are quantized {match.mapping}, not {' or '.join(_ACTIVATION_MAPPINGS)}"
    eps = choose.args[6] if len(choose.args) > 6 and choose.args[6] is not None else None
    if eps is None:
        return ActivationRoundTrip(choose.args[0], match.mapping, match.round_trip)
    return ActivationRoundTrip(choose.args[0], match.mapping, match.round_trip, float(eps))


def with_layer(node: Node, reason: str, weight: QuantizedWeight | None = None,
               round_trip: ActivationRoundTrip | None = None) -> str:
    """``reason`` prefixed by the layer it refuses: ``linear 'linear_2' (8w, group 32): ...``."""
    kind = "embedding" if node.target is torch.ops.aten.embedding.default else "linear"
    scheme = ""
    if weight is not None:
        scheme = f" ({'8da' if round_trip else ''}{weight.bits}w, " + (
            "per channel)" if weight.per_channel else f"group {weight.group})")
    return f"{kind} {node.name!r}{scheme}: {reason}"


def embedding_kernel(weight: QuantizedWeight) -> Kernel | str:
    """``GatherBlockQuantized`` over the stored rows, or why its blocks cannot hold ``weight``'s groups.

    A small table (T5's relative position bias: 4 heads, one scale per row of 4) has no block it takes.
    """
    block = ort_block_size(weight.group)
    if block is None:
        return block_refusal(weight)
    return Kernel("GatherBlockQuantized", weight.bits, block)


def block_refusal(weight: QuantizedWeight) -> str:
    return (f"{weight.describe()}: ONNX Runtime's quantized kernels take blocks of a power of two of at least "
            f"{MIN_BLOCK}, and no such block divides the group of {weight.group}")


def linear_kernel(
    weight: QuantizedWeight, round_trip: ActivationRoundTrip | None, row_count: int | None, quantized_activations: bool
) -> Kernel | str:
    """The fastest ONNX Runtime kernel for a quantized linear, measured at 4096x4096, one thread (see the ORT issue).

    4-bit: ``MatMulNBits`` (0.46 ms with int8 activations, 1.14 ms with float ones; float32 MatMul 2.4 ms).
    8-bit ``8da`` per channel: ``DynamicQuantizeMatMul`` for one row (0.64 ms), whose activation
    quantization is then torchao's exactly, and ``MatMulInteger`` after torchao's own per-token
    rounding for several (as fast at one row, 2.6x faster than ``MatMulNBits`` at 16), and for
    symmetric activations (``Int8DynamicActivationInt8WeightConfig``'s) at any rows; other 8-bit
    layers: ``MatMulNBits`` with int8 activations (0.65-0.75 ms). 8-bit ``MatMulNBits`` with float
    activations took 75 ms, so an 8-bit weight-only linear that must keep float activations is refused.
    """
    block = ort_block_size(weight.group)
    if block is None:
        return block_refusal(weight)
    dynamic = round_trip is not None
    if weight.bits == 4:
        level = INT8_ACTIVATIONS if dynamic or quantized_activations else FLOAT_ACTIVATIONS
        return Kernel("MatMulNBits", 4, block, level)
    if dynamic and weight.per_channel and round_trip.mapping == "ASYMMETRIC":
        return Kernel("DynamicQuantizeMatMul" if row_count == 1 else "MatMulInteger", 8)
    if dynamic and weight.per_channel:
        # DynamicQuantizeMatMul rounds asymmetrically; MatMulInteger after torchao's symmetric rounding is exact.
        return Kernel("MatMulInteger", 8, symmetric=True)
    if dynamic or quantized_activations:
        return Kernel("MatMulNBits", 8, block, INT8_ACTIVATIONS)
    return ("8-bit weights with float activations: ONNX Runtime's only such kernel, MatMulNBits at "
            "accuracy_level 0, runs about 30x slower than a float32 MatMul; OrtPartitioner(quantized_activations=True) "
            "runs it 3.7x faster than float32 with its activations rounded to int8")


def ort_block_size(group: int) -> int | None:
    """The largest power of two dividing ``group``, at most ``MAX_BLOCK``; None below ``MIN_BLOCK``.

    Each ONNX Runtime block lies inside one torchao group, so a group's scale repeats over its blocks.
    """
    block = min(group & -group, MAX_BLOCK)
    return block if block >= MIN_BLOCK else None


def quantized_weight(dequantize: Node, weight_names: frozenset[str] | None) -> QuantizedWeight | str:
    """The stored weights ``dequantize`` reads, or why ONNX Runtime cannot read them packed."""
    stored, block_size, scales, zero_points, input_dtype, quant_min, quant_max = dequantize_arguments(dequantize)
    if not is_weight(stored, weight_names) or not is_weight(scales, weight_names):
        return "its weights or scales are computed in the graph, not stored"
    if zero_points is not None and not is_weight(zero_points, weight_names):
        return "its zero points are computed in the graph, not stored"
    values = stored.meta.get("val")
    bits = _BITS.get((quant_min, quant_max))
    if not isinstance(values, torch.Tensor) or values.dtype != torch.int8 or values.dim() != 2 \
            or input_dtype != torch.int8:
        return "ONNX Runtime's kernels read 2-D int8 weights"
    if bits is None:
        return f"its range [{quant_min}, {quant_max}] is neither int4 [-8, 7] nor int8 [-128, 127]"
    if dequantize.kwargs.get("output_dtype", torch.float32) != torch.float32:
        return f"it dequantizes to {dequantize.kwargs['output_dtype']}; ONNX Runtime's kernels here compute in float32"
    rows_, columns = values.shape
    if list(block_size) != [1, block_size[-1]] or columns % block_size[-1]:
        return f"its block {list(block_size)} is not a group along the input dimension"
    group = int(block_size[-1])
    parameters = rows_ * (columns // group)
    if scales.meta["val"].dtype != torch.float32 or scales.meta["val"].numel() != parameters:
        return f"its scales are not {parameters} float32 values, one per group"
    if zero_points is not None and (
        zero_points.meta["val"].is_floating_point() or zero_points.meta["val"].numel() != parameters
    ):
        return f"its zero points are not {parameters} integers, one per group"
    return QuantizedWeight(dequantize, stored, scales, zero_points, bits, group)


def activation_round_trip(activations: Node) -> ActivationRoundTrip | None | str:
    """torchao's per-token int8 round trip that made ``activations``; None when they are plain floats."""
    if not is_torchao(activations, "dequantize_affine"):
        return None
    quantized, block, scale, zero_point, dtype, quant_min, quant_max = dequantize_arguments(activations)
    if not is_torchao(quantized, "quantize_affine"):
        return f"its input is dequantized by {activations.name!r} from {quantized.name!r}, not a quantize_affine"
    source = quantized.args[0]
    choose = scale.args[0] if isinstance(scale, Node) and scale.target is operator.getitem else None
    if not isinstance(source, Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return f"its input's round trip through {quantized.name!r} starts from no tensor"
    expected = [1] * (source.meta["val"].dim() - 1) + [source.meta["val"].shape[-1]]
    if (
        choose is None or not is_torchao(choose, "choose_qparams_affine") or choose.args[0] is not source
        or not (isinstance(zero_point, Node) and zero_point.target is operator.getitem and zero_point.args[0] is choose)
        or list(quantized.args[1:7]) != [block, scale, zero_point, dtype, quant_min, quant_max]
    ):
        return (f"its input's round trip through {quantized.name!r} does not take its parameters from "
                "choose_qparams_affine")
    mapping = str(getattr(choose.args[1], "name", choose.args[1]))
    if list(block) != expected or dtype != torch.int8 or (quant_min, quant_max) != (-128, 127):
        return "its activations are not quantized to int8 per token"
    if mapping not in _ACTIVATION_MAPPINGS:
        return f"its activations are quantized {mapping}, not {' or '.join(_ACTIVATION_MAPPINGS)}"
    if set(quantized.users) != {activations} or any(user.target is not operator.getitem for user in choose.users):
        return f"its activations' int8 values from {quantized.name!r} are read elsewhere too"
    nodes = (choose, *choose.users, quantized, activations)
    eps = choose.args[6] if len(choose.args) > 6 and choose.args[6] is not None else None
    return ActivationRoundTrip(source, mapping, nodes) if eps is None else ActivationRoundTrip(source, mapping, nodes,
                                                                                                float(eps))


def linear_input_refusal(linear: Node, weight: QuantizedWeight) -> str | None:
    activations = linear.args[0].meta.get("val")
    columns = weight.stored.meta["val"].shape[-1]
    if not isinstance(activations, torch.Tensor) or activations.dtype != torch.float32:
        return "ONNX Runtime's quantized kernels here take float32 activations"
    if activations.shape[-1] != columns:
        return f"its activations' last dimension is not the weights' {columns}"
    bias = linear.args[2] if len(linear.args) > 2 else None
    if bias is not None and (not isinstance(bias, Node) or bias.meta["val"].dtype != torch.float32):
        return "its bias is not a float32 tensor"
    return None


def shared_with_refused(layer: QuantizedLayer, candidates: dict[Node, QuantizedLayer | str]) -> str | None:
    """Why ``layer`` must be refused after all: one of its values (a dequantized weight, rounded activations,
    an ``Int8Tensor`` linear's partial product) feeds a node that is neither in it nor in a taken layer
    sharing that value."""
    members = set(layer.nodes)
    weight_nodes = {layer.weight.dequantize}
    for member in layer.nodes:
        if member is layer.node:
            continue
        for user in member.users:
            if user in members or shares_with_taken(member, user, candidates):
                continue
            if member in weight_nodes:
                return shared_refusal(layer, "weights", user)
            if layer.round_trip is not None and member in layer.round_trip.nodes:
                return shared_refusal(layer, "activations", user)
            return shared_refusal(layer, "values", user)
    return None


def shares_with_taken(member: Node, user: Node, candidates: dict[Node, QuantizedLayer | str]) -> bool:
    """Whether ``user`` is a node of another layer, still taken, that has ``member`` too (two linears, one weight)."""
    return any(
        isinstance(other, QuantizedLayer) and user in other.nodes and member in other.nodes
        for other in candidates.values()
    )


def shared_refusal(layer: QuantizedLayer, what: str, user: Node) -> str:
    return with_layer(
        layer.node,
        f"its {'' if what == 'values' else 'dequantized '}{what} are also read by {user.name!r}, which ONNX Runtime "
        "does not take as a quantized layer",
        layer.weight, layer.round_trip,
    )


def layer_parts(node: Node) -> tuple[Node, ...]:
    """A layer's node and the torchao nodes that feed it, whether or not ONNX Runtime takes it."""
    parts = [node]
    weight = layer_weight(node)
    if weight is not None:
        parts.append(weight)
    if node.target is torch.ops.aten.linear.default:
        round_trip = activation_round_trip(node.args[0])
        if isinstance(round_trip, ActivationRoundTrip):
            parts.extend(round_trip.nodes)
        elif is_torchao(node.args[0]):
            parts.append(node.args[0])
    return tuple(parts)


def layer_weight(node: Node) -> Node | None:
    """The ``dequantize_affine`` node that feeds ``node``'s weight, if ``node`` is a linear or embedding."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.aten.linear.default and len(node.args) > 1:
        weight = node.args[1]
    elif node.target is torch.ops.aten.embedding.default:
        weight = node.args[0]
    else:
        return None
    return weight if is_torchao(weight, "dequantize_affine") else None


def dequantize_arguments(node: Node) -> list:
    """``dequantize_affine``'s seven positional arguments, defaults filled in (a range left out is its dtype's)."""
    arguments = list(node.args) + [None] * (7 - len(node.args))
    for index, name in ((5, "quant_min"), (6, "quant_max")):
        arguments[index] = node.kwargs.get(name, arguments[index])
    if arguments[4] == torch.int8:
        arguments[5] = -128 if arguments[5] is None else arguments[5]
        arguments[6] = 127 if arguments[6] is None else arguments[6]
    return arguments


def rows(source: Node) -> int | None:
    """How many rows of activations a linear multiplies, where the shape says so statically."""
    value = source.meta.get("val")
    if not isinstance(value, torch.Tensor) or not all(isinstance(size, int) for size in value.shape[:-1]):
        return None
    return math.prod(value.shape[:-1])


def is_weight(node: object, weight_names: frozenset[str] | None) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and (weight_names is None or node.name in weight_names)


def is_torchao(node: object, name: str | None = None) -> bool:
    """Whether ``node`` calls one of torchao's ops (``name``: that one, like ``"dequantize_affine"``)."""
    target = getattr(node, "target", None)
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "torchao":
        return False
    return name is None or target._opname == name


def torchao_name(node: Node) -> str:
    return f"torchao.{node.target._opname}"

