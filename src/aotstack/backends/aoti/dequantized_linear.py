"""A linear over integer weights, for a few rows: one fused reduction that reads the integers.

torchao's quantized layers (``IntxWeightOnlyConfig``, ``Int8DynamicActivationIntxWeightConfig``,
aotstack's ``8w``/``4w``/``8da8w``/``8da4w``) export as a ``linear`` whose weight operand is
computed from integer weights and their scales. AOTInductor compiles that as written: a kernel
writes the whole float weight out, then a float matrix product reads it back. At decode, one
row a call, the product is bound by memory, so that path moves five times the bytes of the
float model's own weights and runs 2-3x slower than float32.

As a multiply and a sum over the input dimension, Inductor fuses the dequantization into one
reduction that reads each integer once and writes no weight: at one row about as fast as the
float32 product (a 2048x2048 ``8da4w`` linear, 1 thread: 0.71 ms against 1.93 ms as written and
0.77 ms in float32). Each extra row reads the weights again, so a prefill's many rows keep the
matrix product.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from .passes import inserted_call

aten = torch.ops.aten

# Rows (the input's elements over its last dimension) up to which the reduction is the faster
# form: at 4 rows 2.26 ms against 2.52 as written, for the layer above.
MAX_ROWS = 4

# Integer dtypes that hold quantized weights; wider integers are indices, not weights.
WEIGHT_INTEGERS = frozenset({torch.int8, torch.uint8, torch.int16, torch.uint16})


class DequantizedLinearAsReductionPass:
    """Rewrite ``linear(x, w)`` as ``sum(x.unsqueeze(-2) * w, -1)`` where ``w`` is dequantized and ``x`` has few rows.

    ``x`` is computed once before the reduction (Inductor would otherwise recompute its own
    quantization, which a dynamically quantized layer has, for every weight it multiplies).
    """

    def __call__(self, graph_module: GraphModule) -> bool:
        graph = graph_module.graph
        linears = [node for node in graph.nodes if is_linear_over_few_rows(node) and is_dequantized(node.args[1])]
        for node in linears:
            input, weight, *rest = node.args
            bias = rest[0] if rest else node.kwargs.get("bias")
            with graph.inserting_before(node):
                stride = list(input.meta["val"].stride())
                computed = inserted_call(graph, force_stride_order(), (input, stride))
                rows = inserted_call(graph, aten.unsqueeze.default, (computed, -2))
                products = inserted_call(graph, aten.mul.Tensor, (rows, weight))
                result = inserted_call(graph, aten.sum.dim_IntList, (products, [-1]))
                if bias is not None:
                    result = inserted_call(graph, aten.add.Tensor, (result, bias))
            result.meta.update({key: value for key, value in node.meta.items() if key != "val"})
            node.replace_all_uses_with(result)
            graph.erase_node(node)
        if linears:
            graph_module.recompile()
        return bool(linears)


def force_stride_order() -> torch._ops.OpOverload:
    """Inductor's op that makes its input a buffer of its own (imported with Inductor, on the compile side)."""
    import torch._inductor.inductor_prims  # noqa: F401

    return torch.ops.prims.inductor_force_stride_order.default


def is_linear_over_few_rows(node: Node) -> bool:
    """Whether ``node`` is a ``linear`` of a static input of at most ``MAX_ROWS`` rows and a 2-D float weight."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return False
    input, weight = (arg.meta.get("val") if isinstance(arg, Node) else None for arg in node.args[:2])
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if weight.dim() != 2 or not weight.dtype.is_floating_point or input.dim() == 0:
        return False
    sizes = [*input.shape, *weight.shape]
    if not all(isinstance(size, int) for size in sizes):
        return False
    return math.prod(input.shape[:-1]) <= MAX_ROWS


def is_dequantized(weight: Node) -> bool:
    """Whether ``weight`` is computed (not a weight itself) from a tensor of quantized integers."""
    if weight.op != "call_function":
        return False
    seen: set[Node] = set()
    pending = [weight]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if node.op in ("placeholder", "get_attr"):
            if isinstance(value, torch.Tensor) and value.dtype in WEIGHT_INTEGERS:
                return True
            continue
        pending.extend(arg for arg in node.all_input_nodes)
    return False
