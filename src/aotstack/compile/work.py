"""How much arithmetic a node does, roughly: what auto shares a region's time by, and what a part must do to be worth
its boundary."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import bound_sympy

from ..format.op_names import packet_name

# The largest value a symbolic size may take; None where it is unbounded (``largest_sizes``).
Largest = Callable[[torch.SymInt], "int | None"]
# Ops whose work grows with their reduction dimension (the last of the first input, or a weight's).
MATMULS = ("aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten._int_mm")


def node_work(node: Node, largest: Largest | None = None) -> float:
    """A rough count of ``node``'s arithmetic, from its output's size: a matmul of K columns weighs K times its output.

    A symbolic size counts as ``largest`` says (``largest_sizes``); without it, or where it gives None, a tensor of
    symbolic size counts as nothing.

    Example::

        >>> node_work(linear_node)  # x [1, 512] @ w.T [512, 2048]
        1048576.0
    """
    value = node.meta.get("val")
    outputs = value if isinstance(value, (list, tuple)) else [value]
    size = float(sum(elements(v, largest) or 0 for v in outputs if isinstance(v, torch.Tensor)))
    name = packet_name(node.target) if isinstance(node.target, torch._ops.OperatorBase) else ""
    if name in MATMULS and node.args and isinstance(node.args[0], Node):
        first = node.args[0].meta.get("val")
        columns = extent(first.shape[-1], largest) if isinstance(first, torch.Tensor) and first.dim() else None
        if columns is not None:
            return max(size, 1.0) * columns
    if is_convolution(node) and len(node.args) > 1 and isinstance(node.args[1], Node):
        weight = node.args[1].meta.get("val")
        weights = elements(weight, largest) if isinstance(weight, torch.Tensor) and weight.dim() else None
        if weights:
            return max(size, 1.0) * (weights // extent(weight.shape[0], largest))
    if "scaled_dot_product" in name and len(node.args) > 1 and isinstance(node.args[1], Node):
        key = node.args[1].meta.get("val")
        keys = extent(key.shape[-2], largest) if isinstance(key, torch.Tensor) and key.dim() > 1 else None
        if keys is not None:
            return max(size, 1.0) * keys * 2
    return max(size, 1.0)


def is_convolution(node: Node) -> bool:
    """Whether ``node`` is an ATen convolution (``conv2d``, ``convolution``, a transposed one), any overload."""
    return isinstance(node.target, torch._ops.OperatorBase) and packet_name(node.target).startswith("aten.conv")


def known_work(nodes: Iterable[Node], largest: Largest | None = None) -> float | None:
    """The work of ``nodes`` together; None where a size is symbolic (and ``largest`` gives it no bound), so that the
    count would mean nothing."""
    total = 0.0
    for node in nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) and elements(v, largest) is None for v in values):
            return None
        total += node_work(node, largest)
    return total


def largest_sizes(exported_program: ExportedProgram) -> Largest:
    """The largest value each symbolic size of ``exported_program`` may take, from its range constraints; None for
    one they leave unbounded.

    A prefill exported for prompts of up to 256 tokens: ``s * 256`` is at most 65536.
    """
    ranges = exported_program.range_constraints

    def largest(size: torch.SymInt) -> int | None:
        upper = bound_sympy(size.node.expr, ranges).upper
        return None if upper in (int_oo, sympy.oo) or not upper.is_number else int(upper)

    return largest


def extent(size: int | torch.SymInt, largest: Largest | None) -> int | None:
    """``size`` where it is an int; else the largest it may be, where ``largest`` bounds it; else None."""
    if isinstance(size, int):
        return size
    return largest(size) if largest is not None else None


def elements(tensor: torch.Tensor, largest: Largest | None = None) -> int | None:
    """How many elements ``tensor`` has at most (``extent`` of each size); None where a size has no bound."""
    count = 1
    for size in tensor.shape:
        bound = extent(size, largest)
        if bound is None:
            return None
        count *= bound
    return count
