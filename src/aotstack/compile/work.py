"""How much arithmetic a node does, roughly: what auto shares a region's time by, and what a part must do to be worth
its boundary."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx import Node

from ..format.op_names import packet_name

# Ops whose work grows with their reduction dimension (the last of the first input, or a weight's).
MATMULS = ("aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten._int_mm")


def node_work(node: Node) -> float:
    """A rough count of ``node``'s arithmetic, from its output's size: a matmul of K columns weighs K times its output.

    Example::

        >>> node_work(linear_node)  # x [1, 512] @ w.T [512, 2048]
        1048576.0
    """
    value = node.meta.get("val")
    outputs = value if isinstance(value, (list, tuple)) else [value]
    size = float(sum(v.numel() for v in outputs if isinstance(v, torch.Tensor) and not has_symbols(v)))
    name = packet_name(node.target) if isinstance(node.target, torch._ops.OperatorBase) else ""
    if name in MATMULS and node.args and isinstance(node.args[0], Node):
        first = node.args[0].meta.get("val")
        if isinstance(first, torch.Tensor) and first.dim() and isinstance(first.shape[-1], int):
            return max(size, 1.0) * first.shape[-1]
    if is_convolution(node) and len(node.args) > 1 and isinstance(node.args[1], Node):
        weight = node.args[1].meta.get("val")
        if isinstance(weight, torch.Tensor) and not has_symbols(weight) and weight.shape[0]:
            return max(size, 1.0) * (weight.numel() // weight.shape[0])
    if "scaled_dot_product" in name and len(node.args) > 1 and isinstance(node.args[1], Node):
        key = node.args[1].meta.get("val")
        if isinstance(key, torch.Tensor) and key.dim() > 1 and isinstance(key.shape[-2], int):
            return max(size, 1.0) * key.shape[-2] * 2
    return max(size, 1.0)


def is_convolution(node: Node) -> bool:
    """Whether ``node`` is an ATen convolution (``conv2d``, ``convolution``, a transposed one), any overload."""
    return isinstance(node.target, torch._ops.OperatorBase) and packet_name(node.target).startswith("aten.conv")


def known_work(nodes: Iterable[Node]) -> float | None:
    """The work of ``nodes`` together; None where a size is symbolic, so that the count would mean nothing."""
    total = 0.0
    for node in nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) and has_symbols(v) for v in values):
            return None
        total += node_work(node)
    return total


def has_symbols(tensor: torch.Tensor) -> bool:
    return not all(isinstance(size, int) for size in tensor.shape)
