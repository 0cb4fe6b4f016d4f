"""A partition's quantized layers as ONNX Runtime contrib ops over packed weights, ready for the ONNX exporter.

Before export, each quantized layer ``quantized.py`` finds is replaced, in a copy of the program,
by one call to an ``aotstack_ort`` op whose weights are new constants packed for its kernel
(``packing.py``); torchao's nodes and its unpacked weights leave the program. The exporter then
translates each ``aotstack_ort`` op into its ``com.microsoft`` op through ``custom_translation_table``.
The packed weights become initializers named by their new FQN, stored as aotstack named data like
any other weight, so they stay packed in the file and in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputSpec, TensorArgument
from torch.fx import Graph, GraphModule, Node

from ...compile.int8_tensor import int8_linears
from ...compile.program_parts import program_weights, rebuilt
from ...errors import LoweringError
from .packing import PackedWeights, block_packed, channel_transposed
from .quantized import QuantizedLayer, quantized_graph

# ---------------------------------------------------------------------------------------------
# The ops a quantized layer becomes in the program the exporter sees. They exist only to be
# translated: their kernels are ONNX Runtime's.


@torch.library.custom_op("aotstack_ort::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
    bias: torch.Tensor | None, k: int, n: int, bits: int, block_size: int, accuracy_level: int,
) -> torch.Tensor:
    raise RuntimeError("aotstack_ort::matmul_nbits only marks a layer for ONNX Runtime's MatMulNBits")


@matmul_nbits.register_fake
def _(x, packed, scales, zero_points, bias, k, n, bits, block_size, accuracy_level):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("aotstack_ort::dynamic_quantize_matmul", mutates_args=())
def dynamic_quantize_matmul(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    raise RuntimeError("aotstack_ort::dynamic_quantize_matmul only marks a layer for DynamicQuantizeMatMul")


@dynamic_quantize_matmul.register_fake
def _(x, weight, scales, zero_points, bias):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], weight.shape[1]))


@torch.library.custom_op("aotstack_ort::per_token_matmul_integer", mutates_args=())
def per_token_matmul_integer(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
    column_sums: torch.Tensor, bias: torch.Tensor | None, eps: float, symmetric: bool = False,
) -> torch.Tensor:
    raise RuntimeError("aotstack_ort::per_token_matmul_integer only marks a layer for ONNX Runtime's MatMulInteger")


@per_token_matmul_integer.register_fake
def _(x, weight, scales, zero_points, column_sums, bias, eps, symmetric=False):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], weight.shape[1]))


@torch.library.custom_op("aotstack_ort::gather_block_quantized", mutates_args=())
def gather_block_quantized(
    data: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
    columns: int, bits: int, block_size: int,
) -> torch.Tensor:
    raise RuntimeError("aotstack_ort::gather_block_quantized only marks a layer for GatherBlockQuantized")


@gather_block_quantized.register_fake
def _(data, indices, scales, zero_points, columns, bits, block_size):  # noqa: ANN001, ANN202
    return scales.new_empty((*indices.shape, columns))


# ---------------------------------------------------------------------------------------------
# Their ONNX translations. The exporter builds a node from an ONNX schema; contrib ops have none
# in the onnx package, so each gets one here with the inputs and attributes aotstack passes.


def contrib_op(
    name: str, inputs: list[tuple[str, str, bool]], types: dict[str, list[str]], attributes: list[str]
) -> Any:
    """An onnxscript op for ``com.microsoft``'s ``name``: inputs as (name, type variable, optional), int attributes."""
    import onnxscript
    from onnx.defs import OpSchema

    parameter = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    single = OpSchema.FormalParameterOption.Single
    schema = OpSchema(
        name, MICROSOFT_DOMAIN, 1,
        inputs=[parameter(input_name, kind, param_option=optional if is_optional else single)
                for input_name, kind, is_optional in inputs],
        outputs=[parameter("Y", inputs[0][1] if name != "GatherBlockQuantized" else "T2")],
        type_constraints=[(variable, allowed, "") for variable, allowed in types.items()],
        attributes=[OpSchema.Attribute(attribute, OpSchema.AttrType.INT, "") for attribute in attributes],
    )
    return onnxscript.values.Op(onnxscript.values.Opset(MICROSOFT_DOMAIN, 1), name, schema)


MICROSOFT_DOMAIN = "com.microsoft"


def translations() -> dict[Any, Callable[..., Any]]:
    """The exporter's ``custom_translation_table`` for the ``aotstack_ort`` ops."""
    nbits = contrib_op(
        "MatMulNBits",
        [("A", "T1", False), ("B", "T2", False), ("scales", "T1", False), ("zero_points", "T3", True),
         ("g_idx", "T4", True), ("bias", "T1", True)],
        {"T1": ["tensor(float)"], "T2": ["tensor(uint8)"], "T3": ["tensor(uint8)"], "T4": ["tensor(int32)"]},
        ["K", "N", "bits", "block_size", "accuracy_level"],
    )
    dynamic = contrib_op(
        "DynamicQuantizeMatMul",
        [("A", "T1", False), ("B", "T2", False), ("b_scale", "T1", False), ("b_zero_point", "T2", True),
         ("bias", "T1", True)],
        {"T1": ["tensor(float)"], "T2": ["tensor(uint8)"]},
        [],
    )
    gather = contrib_op(
        "GatherBlockQuantized",
        [("data", "T1", False), ("indices", "Tind", False), ("scales", "T2", False), ("zero_points", "T1", True)],
        {"T1": ["tensor(uint8)"], "T2": ["tensor(float)"], "Tind": ["tensor(int32)", "tensor(int64)"]},
        ["bits", "block_size", "gather_axis", "quantize_axis"],
    )

    def matmul_nbits_onnx(x, packed, scales, zero_points, bias, k, n, bits, block_size, accuracy_level):  # noqa: ANN001, ANN202
        return nbits(x, packed, scales, zero_points, None, bias, K=k, N=n, bits=bits, block_size=block_size,
                     accuracy_level=accuracy_level)

    def dynamic_quantize_matmul_onnx(x, weight, scales, zero_points, bias):  # noqa: ANN001, ANN202
        return dynamic(x, weight, scales, zero_points, bias)

    def gather_block_quantized_onnx(data, indices, scales, zero_points, columns, bits, block_size):  # noqa: ANN001, ANN202
        return gather(data, indices, scales, zero_points, bits=bits, block_size=block_size, gather_axis=0,
                      quantize_axis=1)

    return {
        torch.ops.aotstack_ort.per_token_matmul_integer.default: per_token_matmul_integer_onnx,
        torch.ops.aotstack_ort.matmul_nbits.default: matmul_nbits_onnx,
        torch.ops.aotstack_ort.dynamic_quantize_matmul.default: dynamic_quantize_matmul_onnx,
        torch.ops.aotstack_ort.gather_block_quantized.default: gather_block_quantized_onnx,
    }


def per_token_matmul_integer_onnx(x, weight, scales, zero_points, column_sums, bias, eps, symmetric=False):  # noqa: ANN001, ANN201
    """torchao's per-token int8 round trip in ONNX ops, then an integer matmul.

    The same arithmetic as torchao's ``choose_qparams_affine`` and ``quantize_affine``:
    asymmetric, scale ``(max(x, 0) - min(x, 0)) / 255`` at least ``eps``, zero point
    ``-round(min / scale)``; symmetric, scale ``max(|min(x, 0)|, max(x, 0)) / 127.5`` at least
    ``eps``, no zero point; then ``round(x * (1 / scale))``. On uint8 where torchao has int8, the
    same grid moved by 128: ``(q - zero point) @ w`` is the integer matmul of the raw ``q`` less
    the zero point times each column's sum (``column_sums``); its scales multiply the int32 result.
    """
    from onnxscript import opset18 as op

    last = op.Constant(value_ints=[-1])
    zero, top = op.Constant(value_float=0.0), op.Constant(value_float=255.0)
    high = op.Max(op.ReduceMax(x, last, keepdims=1), zero)
    low = op.Min(op.ReduceMin(x, last, keepdims=1), zero)
    if symmetric:
        scale = op.Max(op.Div(op.Max(op.Neg(low), high), op.Constant(value_float=127.5)),
                       op.Constant(value_float=eps))
        point = op.Constant(value_float=128.0)
    else:
        scale = op.Max(op.Div(op.Sub(high, low), top), op.Constant(value_float=eps))
        point = op.Clip(op.Neg(op.Round(op.Div(low, scale))), zero, top)
    quantized = op.Cast(op.Clip(op.Add(op.Round(op.Mul(x, op.Reciprocal(scale))), point), zero, top),
                        to=onnx_type("UINT8"))
    product = op.MatMulInteger(quantized, weight, None, zero_points)
    centred = op.Sub(product, op.Mul(op.Cast(point, to=onnx_type("INT32")), column_sums))
    result = op.Mul(op.Cast(centred, to=onnx_type("FLOAT")), op.Mul(scale, scales))
    return result if bias is None else op.Add(result, bias)


def onnx_type(name: str) -> int:
    import onnx

    return getattr(onnx.TensorProto, name)


# ---------------------------------------------------------------------------------------------
# The rewrite.


def with_quantized_kernels(
    exported_program: ExportedProgram, quantized_activations: bool, label: str
) -> tuple[ExportedProgram, dict[Any, Callable[..., Any]]]:
    """``exported_program`` with its quantized layers as ``aotstack_ort`` ops, and the translations they need.

    A program with no quantized layer (no torchao ops, no ``Int8Tensor`` linear) is returned as it
    is, with no translations. The program given is not changed.
    """
    if not any(is_torchao_node(node) for node in exported_program.graph.nodes) \
            and not int8_linears(exported_program.graph):
        return exported_program, {}
    module = GraphModule(exported_program.graph_module, copied_graph(exported_program.graph))
    graph = module.graph
    fqns = weight_fqns(exported_program)
    analysis = quantized_graph(graph, frozenset(fqns), quantized_activations)
    if analysis.refusals:
        node, reason = next(iter(analysis.refusals.items()))
        raise LoweringError(f"{label}: node {node.name!r} ({node.target}) cannot run in ONNX Runtime: {reason}")
    weights = program_weights(exported_program)
    constants: dict[str, torch.Tensor] = {}
    inserted: dict[str, Node] = {}
    replaced: dict[Node, Node] = {}
    fake_mode = torch._guards.detect_fake_mode([node.meta.get("val") for node in graph.nodes])
    before = first_user_input(graph, exported_program)
    for layer in analysis.layers:
        tensors = packed_layer(layer, weights, fqns)
        inputs = {}
        for fqn, tensor in tensors.items():
            if tensor is not None and fqn not in inserted:
                inserted[fqn] = constant_placeholder(graph, fqn, tensor, fake_mode, before)
                constants[fqn] = tensor
            inputs[fqn] = None if tensor is None else inserted[fqn]
        # A layer may read another's output (a linear over an embedding), replaced by now.
        source = kernel_source(graph, layer, replaced.get(layer.source, layer.source), fake_mode)
        op, arguments = kernel_call(layer, list(inputs.values()), source)
        arguments = torch.fx.map_arg(arguments, lambda node: replaced.get(node, node))
        with graph.inserting_before(layer.node):
            replacement = graph.call_function(op, arguments)
        replacement.meta = dict(layer.node.meta)
        layer.node.replace_all_uses_with(replacement)
        replaced[layer.node] = replacement
    removed = {fqns[name] for name in erase_replaced(graph, analysis.layers)}
    left = next((node for node in graph.nodes
                 if is_torchao_node(node) or node.target is torch.ops.aten._int_mm.default), None)
    if left is not None:
        raise LoweringError(f"{label}: node {left.name!r} ({left.target}) is still read after its layer's translation")
    module.recompile()
    renamed = {old.name: new.name for old, new in replaced.items()}
    signature = rebuilt_signature(exported_program, graph, inserted, renamed)
    state_dict = {name: value for name, value in exported_program.state_dict.items() if name not in removed}
    kept_constants = {name: value for name, value in exported_program.constants.items() if name not in removed}
    program = rebuilt(exported_program, module, signature, state_dict=state_dict,
                      constants={**kept_constants, **constants})
    return program, translations()


def packed_layer(layer: QuantizedLayer, weights: dict[str, torch.Tensor], fqns: dict[str, str]) -> dict[str, Any]:
    """The packed weight tensors ``layer``'s kernel reads, by the FQN each gets (None: an input left out)."""
    weight = layer.weight
    stored_fqn = fqns[weight.stored.name]
    stored = weights[stored_fqn]
    scales = weights[fqns[weight.scales.name]]
    if scales.numel() == 1:
        # One scale for the whole tensor (Int8Tensor's per-tensor granularity): the same for every channel.
        scales = scales.reshape(1).expand(stored.shape[0])
    zero_points = None if weight.zero_points is None else weights[fqns[weight.zero_points.name]]
    kernel = layer.kernel
    if kernel.op in ("DynamicQuantizeMatMul", "MatMulInteger"):
        packed = channel_transposed(stored, scales, zero_points, stored_fqn)
    else:
        packed = block_packed(stored, scales, zero_points, weight.bits, weight.group, kernel.block_size, stored_fqn)
        if kernel.op == "GatherBlockQuantized":
            packed = PackedWeights(packed.values.reshape(stored.shape[0], -1), packed.scales, packed.zero_points)
    base = f"{stored_fqn}.{kernel.op}"
    tensors = {f"{base}.values": packed.values, f"{base}.scales": packed.scales,
               f"{base}.zero_points": packed.zero_points}
    if kernel.op == "MatMulInteger":
        tensors[f"{base}.column_sums"] = packed.column_sums
    return tensors


def kernel_source(graph: Graph, layer: QuantizedLayer, source: Node, fake_mode: Any) -> Node:
    """What the kernel reads besides its weights: ``source``, rows flattened where the layer's result has them so."""
    if not layer.flattened:
        return source
    columns = layer.weight.stored.meta["val"].shape[-1]
    with graph.inserting_before(layer.node):
        flattened = graph.call_function(torch.ops.aten.reshape.default, (source, [-1, columns]))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        flattened.meta["val"] = source.meta["val"].reshape(-1, columns)
    return flattened


def kernel_call(layer: QuantizedLayer, weights: list[Node | None], source: Node) -> tuple[Any, tuple[Any, ...]]:
    """The ``aotstack_ort`` op and arguments that replace ``layer``, reading ``source``."""
    values, scales, zero_points, *column_sums = weights
    kernel = layer.kernel
    rows, columns = layer.weight.stored.meta["val"].shape
    if kernel.op == "GatherBlockQuantized":
        return (torch.ops.aotstack_ort.gather_block_quantized.default,
                (values, source, scales, zero_points, columns, kernel.bits, kernel.block_size))
    # An Int8Tensor linear adds its bias after the layer's nodes, outside them.
    linear = layer.node.target is torch.ops.aten.linear.default
    bias = layer.node.args[2] if linear and len(layer.node.args) > 2 else None
    if kernel.op == "DynamicQuantizeMatMul":
        return torch.ops.aotstack_ort.dynamic_quantize_matmul.default, (source, values, scales, zero_points, bias)
    if kernel.op == "MatMulInteger":
        return (torch.ops.aotstack_ort.per_token_matmul_integer.default,
                (source, values, scales, zero_points, column_sums[0], bias, layer.round_trip.eps, kernel.symmetric))
    return (torch.ops.aotstack_ort.matmul_nbits.default,
            (source, values, scales, zero_points, bias, columns, rows, kernel.bits, kernel.block_size,
             kernel.accuracy_level))


def copied_graph(graph: Graph) -> Graph:
    copy = Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def weight_fqns(exported_program: ExportedProgram) -> dict[str, str]:
    """Each weight placeholder's name → the FQN of the parameter, buffer or constant it reads."""
    signature = exported_program.graph_signature
    return {
        **signature.inputs_to_parameters, **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }


def first_user_input(graph: Graph, exported_program: ExportedProgram) -> Node:
    """Where new weight placeholders go: before the first user input (the signature lists weights first)."""
    user_inputs = set(exported_program.graph_signature.user_inputs)
    for node in graph.nodes:
        if node.op != "placeholder" or node.name in user_inputs:
            return node
    raise LoweringError("a graph without an output node")  # a graph always has one


def constant_placeholder(graph: Graph, fqn: str, tensor: torch.Tensor, fake_mode: Any, before: Node) -> Node:
    with graph.inserting_before(before):
        node = graph.placeholder("c_" + fqn.replace(".", "_"))
    node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode is not None else tensor
    return node


def erase_replaced(graph: Graph, layers: list[QuantizedLayer]) -> set[str]:
    """Erase the replaced layers, their torchao nodes and the weight placeholders only they read; those names."""
    erased_placeholders: set[str] = set()
    candidates = [node for layer in layers for node in layer.nodes]
    placeholders = {
        node for layer in layers
        for node in (layer.weight.stored, layer.weight.scales, layer.weight.zero_points) if node is not None
    }
    # Users before the nodes they read: the graph's order, reversed.
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in sorted(set(candidates), key=position.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    for node in placeholders:
        if not node.users:
            erased_placeholders.add(node.name)
            graph.erase_node(node)
    return erased_placeholders


def rebuilt_signature(
    exported_program: ExportedProgram, graph: Graph, inserted: dict[str, Node], renamed: dict[str, str]
) -> ExportGraphSignature:
    """The signature of ``graph``: the old input specs of the placeholders still there, the new constants',
    and the outputs, by their replacements' names where a replaced layer's output is one."""
    signature = exported_program.graph_signature
    old_placeholders = [node for node in exported_program.graph.nodes if node.op == "placeholder"]
    specs = {node.name: spec for node, spec in zip(old_placeholders, signature.input_specs, strict=True)}
    specs.update({
        node.name: InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), fqn)
        for fqn, node in inserted.items()
    })
    return ExportGraphSignature(
        input_specs=[specs[node.name] for node in graph.nodes if node.op == "placeholder"],
        output_specs=[
            OutputSpec(spec.kind, TensorArgument(renamed[spec.arg.name]), spec.target)
            if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed else spec
            for spec in signature.output_specs
        ],
    )


def is_torchao_node(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "torchao"
