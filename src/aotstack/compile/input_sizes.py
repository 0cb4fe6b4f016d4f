"""Sizes read off computed tensors, recomputed from the method's inputs before any partitioner looks.

A model reads the size of a tensor it computed (Swin's patch grid off its convolution's output, a window count off a
reshape). Such a size stays in the method, and each part that reads it recomputes it (``with_size_computations``).
So an engine's part that computes the tensor and also reads its size would run before the method's read and after it:
the partitioner must cut it there, and the method ends in several parts of one engine with boundaries between them.
Every size of a computed tensor is an expression in the sizes of the method's inputs (torch.export says which); read
from the inputs instead, it depends on no op, and a part whole enough for one engine stays one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from .graph_edits import inserted_call, replace_node
from .splice import drop_unused_size_computations
from .subprogram import derived_size_terms, is_derived_size


class OutsideArithmetic(Exception):
    """A size expression this pass does not rebuild; the size stays read off its tensor."""


# Integer functions torch's symbolic sizes use, by the class name of their sympy node, as the calls they are in a graph.
FOLDED: dict[str, Callable[[Any, Any], Any]] = {
    "Add": operator.add,
    "Mul": operator.mul,
    "Max": torch.sym_max,
    "Min": torch.sym_min,
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "FloorDiv": operator.floordiv,
    "CleanDiv": operator.floordiv,
    "PythonMod": operator.mod,
    "Mod": operator.mod,
}


def sizes_read_from_inputs(graph_module: GraphModule) -> int:
    """Read each size of a computed tensor from the method's inputs instead, in place; how many were replaced.

    A size whose expression holds a size no input has (an ``item``'s), or arithmetic outside ``FOLDED`` and
    ``BINARY``, stays as it was.
    """
    graph = graph_module.graph
    readers = [node for node in graph.nodes if reads_computed_tensor(node)]
    if not readers:
        return 0
    sources = input_size_sources(graph)
    # Arithmetic on sizes is worked out in the fake mode of the graph's tensors.
    anchor = next(arg for arg in readers[0].all_input_nodes if isinstance(arg.meta.get("val"), torch.Tensor))
    first_computation = next(node for node in graph.nodes if node.op != "placeholder")
    built: dict[Any, Node | int] = {}
    replaced = 0
    for node in readers:
        expr = node.meta["val"].node.expr
        if not expr.free_symbols <= sources.keys():
            continue
        # Each input size is read once, before anything the method computes; the arithmetic, where the size was read.
        with graph.inserting_before(first_computation):
            for symbol in expr.free_symbols - built.keys():
                built[symbol] = sources[symbol](graph)
        with graph.inserting_before(node):
            try:
                result = expression_node(graph, expr, built, anchor)
            except OutsideArithmetic:
                continue
        if not isinstance(result, Node) or not same_size(result.meta.get("val"), expr):
            continue
        replace_node(graph, node, result)
        replaced += 1
    drop_unused_size_computations(graph)
    graph.lint()
    graph_module.recompile()
    return replaced


def reads_computed_tensor(node: Node) -> bool:
    """Whether ``node`` is a symbolic size read off a tensor an op of the method computes."""
    value = node.meta.get("val")
    return (
        node.op == "call_function"
        and isinstance(value, torch.SymInt)
        and not value.node.expr.is_number
        and any(
            isinstance(arg.meta.get("val"), torch.Tensor) and arg.op != "placeholder" for arg in node.all_input_nodes
        )
    )


def input_size_sources(graph: Graph) -> dict[Any, Callable[[Graph], Node]]:
    """Each size symbol an input gives, with how to read it: its size (``sym_size``), solved where the input's size is
    a multiple of it (``a * s + b``, an image's side in steps of 32), or the input itself where it is a size."""
    sources: dict[Any, Callable[[Graph], Node]] = {}
    for placeholder in graph.find_nodes(op="placeholder"):
        value = placeholder.meta.get("val")
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            sources.setdefault(value.node.expr, lambda graph, placeholder=placeholder: placeholder)
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if expr.is_Symbol or is_derived_size(expr):
                symbol, scale, offset = derived_size_terms(expr)
                sources.setdefault(symbol, size_reader(placeholder, dim, scale, offset))
    return sources


def size_reader(placeholder: Node, dim: int, scale: int, offset: int) -> Callable[[Graph], Node]:
    """How to read ``s`` off ``placeholder``'s size ``dim``, which is ``scale * s + offset``."""

    def read(graph: Graph) -> Node:
        size = inserted_call(graph, torch.ops.aten.sym_size.int, (placeholder, dim), like=placeholder)
        if offset:
            size = inserted_call(graph, operator.sub, (size, offset), like=placeholder)
        if scale != 1:
            size = inserted_call(graph, operator.floordiv, (size, scale), like=placeholder)
        return size

    return read


def expression_node(graph: Graph, expr: Any, symbols: dict[Any, Node | int], anchor: Node) -> Node | int:
    """``expr`` computed in ``graph`` from the nodes of its ``symbols``; an int where it is a number.

    ``anchor``: a node holding a tensor of the graph's fake mode, in which the sizes' values are worked out.
    """
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return symbols[expr]
    name = type(expr).__name__
    operands = [expression_node(graph, arg, symbols, anchor) for arg in expr.args]
    if name in FOLDED and len(operands) >= 2:
        result = operands[0]
        for operand in operands[1:]:
            result = size_call(graph, FOLDED[name], result, operand, anchor)
        return result
    if name in BINARY and len(operands) == 2:
        return size_call(graph, BINARY[name], *operands, anchor)
    if name in ("Pow", "PowByNatural") and isinstance(operands[1], int) and 1 <= operands[1] <= 8:
        result = operands[0]
        for _ in range(operands[1] - 1):
            result = size_call(graph, operator.mul, result, operands[0], anchor)
        return result
    raise OutsideArithmetic(f"{name} in {expr}")


def size_call(
    graph: Graph, function: Callable[[Any, Any], Any], left: Node | int, right: Node | int, anchor: Node
) -> Node | int:
    if isinstance(left, int) and isinstance(right, int):
        return function(left, right)
    return inserted_call(graph, function, (left, right), like=anchor)


def same_size(value: Any, expr: Any) -> bool:
    """Whether ``value``, a rebuilt size, is ``expr`` as torch's symbolic sizes simplify it."""
    return isinstance(value, torch.SymInt) and value.node.expr == expr
