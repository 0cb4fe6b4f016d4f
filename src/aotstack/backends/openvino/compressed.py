"""torchao's quantized layers rewritten into the weight patterns OpenVINO's CPU plugin keeps compressed.

OpenVINO runs a matmul on int8 weights, converted inside its kernel, where its weight is
``Convert(int8 constant) → [Subtract(zero point)] → Multiply(scale)``: the form torchao's
``dequantize_affine`` decomposes into. An ``Int8Tensor`` linear with one scale per channel
(``Int8WeightOnlyConfig``, ``Int8DynamicActivationInt8WeightConfig``; see
``compile/int8_tensor.py``) multiplies by its scales after the matmul instead, so OpenVINO folds
the int8 weights into a float32 copy and multiplies floats (measured: ``FullyConnected`` on f32
weights, where a ``dequantize_affine`` layer runs on i8). Here each such layer becomes
``linear(activations, int8 weights × scales)``; a dynamic layer's activations are its int8 ones
dequantized, as torchao's ``Int8DynamicActivationIntxWeightConfig`` leaves them. The same sums,
up to float rounding.

A quantized embedding (``IntxWeightOnlyConfig`` on ``nn.Embedding``) dequantizes its whole table and
gathers rows of it; OpenVINO gathers int8 rows only where the table is ``Convert → Multiply`` with
no reshape between, which a grouped (or torchao's per-channel) dequantization has, so it folded the
table to float32. Here the rows are gathered first, int8, with their scales and zero points, and
only they are dequantized: the same values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from ...compile.constants import renamed_signature
from ...compile.graph_edits import inserted_call
from ...compile.int8_tensor import (
    RESHAPES,
    Int8Linear,
    int8_linears,
    is_call,
    is_torchao,
)
from ...compile.program_parts import rebuilt

aten = torch.ops.aten


def with_compressed_int8_linears(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each per-channel ``Int8Tensor`` linear as a linear over dequantized int8 weights.

    The program given is not changed; one without such layers is returned as it is.
    """
    if not any(layer.dequantize is None for layer in int8_linears(exported_program.graph)) \
            and not quantized_embeddings(exported_program.graph):
        return exported_program
    graph = Graph()
    graph.output(graph.graph_copy(exported_program.graph, {}))
    for layer in int8_linears(graph):
        if layer.dequantize is None:
            rewrite(graph, layer)
    for embedding in quantized_embeddings(graph):
        gather_then_dequantize(graph, embedding)
    module = GraphModule(exported_program.graph_module, graph)
    return rebuilt(exported_program, module, renamed_signature(exported_program.graph_signature, graph))


def quantized_embeddings(graph: Graph) -> list[Node]:
    """The ``aten.embedding`` nodes whose table is a ``dequantize_affine`` of int8 rows, in groups along them.

    Gathering first is the same arithmetic whatever the operands are, so they need not be weights.
    """
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        table = node.args[0]
        if not is_torchao(table, "dequantize_affine") or table.kwargs.get("output_dtype", torch.float32) \
                is not torch.float32:
            continue
        stored, block, scales, zero_points = (list(table.args) + [None] * 4)[:4]
        values = stored.meta.get("val") if isinstance(stored, Node) else None
        if isinstance(values, torch.Tensor) and values.dtype == torch.int8 and values.dim() == 2 \
                and isinstance(scales, Node) and (zero_points is None or isinstance(zero_points, Node)) \
                and len(block) == 2 and block[0] == 1 and values.shape[1] % block[1] == 0:
            found.append(node)
    return found


def gather_then_dequantize(graph: Graph, embedding: Node) -> None:
    """Turn ``embedding`` into a gather of int8 rows, their scales and zero points, dequantized; in place."""
    table = embedding.args[0]
    stored, block, scales, zero_points = (list(table.args) + [None] * 4)[:4]
    indices = embedding.args[1]
    rows, columns = stored.meta["val"].shape
    groups = columns // block[1]
    with graph.inserting_before(embedding):
        values = call(graph, aten.embedding.default, stored, indices)
        values = call(graph, aten._to_copy.default, values, dtype=torch.float32)
        values = call(graph, aten.unflatten.int, values, -1, [groups, block[1]])
        if zero_points is not None:
            points = call(graph, aten.embedding.default, call(graph, aten.reshape.default, zero_points,
                                                                [rows, groups]), indices)
            points = call(graph, aten._to_copy.default, call(graph, aten.unsqueeze.default, points, -1),
                          dtype=torch.float32)
            values = call(graph, aten.sub.Tensor, values, points)
        row_scales = call(graph, aten.embedding.default, call(graph, aten.reshape.default, scales, [rows, groups]),
                          indices)
        values = call(graph, aten.mul.Tensor, values, call(graph, aten.unsqueeze.default, row_scales, -1))
    embedding.target, embedding.args, embedding.kwargs = aten.flatten.using_ints, (values, -2, -1), {}
    if not table.users:
        graph.erase_node(table)


def rewrite(graph: Graph, layer: Int8Linear) -> None:
    """Turn ``layer``'s result node into the linear, in place (so its name, which outputs may use, stays), and
    erase the nodes it no longer needs."""
    output = layer.output
    with graph.inserting_before(output):
        weight = call(graph, aten._to_copy.default, layer.stored, dtype=torch.float32)
        weight = call(graph, aten.mul.Tensor, weight, call(graph, aten.reshape.default, layer.scales, [-1, 1]))
        if layer.mapping is None:
            # The rows as the model shaped them: OpenVINO folds the weights of a matmul over a flattening
            # reshape to float32 (measured), and keeps those of one over the unflattened tensor int8.
            activations = unflattened(layer.activations)
            linear = call(graph, aten.linear.default, activations, weight)
            target, args = aten.reshape.default, (linear, [-1, layer.stored.meta["val"].shape[0]])
        else:
            target, args = aten.linear.default, (dequantized_activations(graph, layer), weight)
    output.target, output.args, output.kwargs = target, args, {}
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in sorted(layer.members, key=position.__getitem__, reverse=True):
        if node is not output and not node.users:
            graph.erase_node(node)


def unflattened(activations: Node) -> Node:
    """The tensor ``activations`` flattens the rows of: back through reshapes that keep the last dimension."""
    columns = activations.meta["val"].shape[-1]
    while is_call(activations) and activations.target in RESHAPES:
        source = activations.args[0]
        if not isinstance(source, Node) or source.meta["val"].shape[-1] != columns:
            break
        activations = source
    return activations


def dequantized_activations(graph: Graph, layer: Int8Linear) -> Node:
    """A dynamic layer's int8 activations (rows flattened, as its ``_int_mm`` reads them) times their scales,
    less their zero points where asymmetric."""
    _, scale, zero_point, *_ = layer.round_trip
    values = call(graph, aten._to_copy.default, layer.matmul.args[0], dtype=torch.float32)
    if layer.mapping == "ASYMMETRIC":
        points = call(graph, aten._to_copy.default, call(graph, aten.reshape.default, zero_point, [-1, 1]),
                      dtype=torch.float32)
        values = call(graph, aten.sub.Tensor, values, points)
    return call(graph, aten.mul.Tensor, values, call(graph, aten.reshape.default, scale, [-1, 1]))


def call(graph: Graph, target: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Node:
    """A new call at the graph's insertion point, with its ``meta["val"]`` computed on the graph's fake tensors."""
    return inserted_call(graph, target, args, kwargs)
