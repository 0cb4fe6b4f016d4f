"""torchao's ``Int8Tensor`` linears rewritten into the weight pattern OpenVINO's CPU plugin keeps compressed.

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
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from ...compile.int8_tensor import Int8Linear, int8_linears, through_reshapes

aten = torch.ops.aten


def with_compressed_int8_linears(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each per-channel ``Int8Tensor`` linear as a linear over dequantized int8 weights.

    The program given is not changed; one without such layers is returned as it is.
    """
    if not any(layer.dequantize is None for layer in int8_linears(exported_program.graph)):
        return exported_program
    graph = Graph()
    graph.output(graph.graph_copy(exported_program.graph, {}))
    for layer in int8_linears(graph):
        if layer.dequantize is None:
            rewrite(graph, layer)
    module = GraphModule(exported_program.graph_module, graph)
    return exported_program._update(module, exported_program.graph_signature)


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
            activations, _ = through_reshapes(layer.activations)
            linear = call(graph, aten.linear.default, activations, weight)
            target, args = aten.reshape.default, (linear, [-1, layer.stored.meta["val"].shape[0]])
        else:
            target, args = aten.linear.default, (dequantized_activations(graph, layer), weight)
    output.target, output.args, output.kwargs = target, args, {}
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in sorted(layer.members, key=position.__getitem__, reverse=True):
        if node is not output and not node.users:
            graph.erase_node(node)


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
    node = graph.call_function(target, args, kwargs)
    values, keywords = pytree.tree_map_only(Node, lambda arg: arg.meta["val"], (args, kwargs))
    with detect_fake_mode(pytree.tree_leaves(values)):
        node.meta["val"] = target(*values, **keywords)
    return node
