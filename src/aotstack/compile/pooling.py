"""Pooling windows wider than their padded input, narrowed to it.

With ``ceil_mode`` torch lets a pooling window overhang its padded input (EfficientNet pools its
7x7 map with a window as wide as its channel count, 1280 in B0), and the one window it then
computes along that axis covers the padded input whole. Narrowed to the padded input, the window
gives the same values, divisor and indices, and spares each engine a window it handles badly:
Inductor reduces over every position of it, the overhang included (EfficientNet-B0 under plain
AOTInductor took 2.9 s a call, eager 0.33 s), and OpenVINO's pooling refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node
from torch.fx.operator_schemas import normalize_function

from .graph_edits import edited_copy

# Pooling ops by the number of spatial dimensions their window spans.
POOLING_DIMENSIONS = {
    **{f"aten::avg_pool{n}d": n for n in (1, 2, 3)},
    **{f"aten::max_pool{n}d": n for n in (1, 2, 3)},
    **{f"aten::max_pool{n}d_with_indices": n for n in (2, 3)},
}


@dataclass(frozen=True)
class PoolingWindow:
    """A pooling node's arguments, one value per spatial axis, with its input's spatial sizes."""

    arguments: dict[str, Any]
    kernel: list[int]
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    sizes: list[int | torch.SymInt]

    def spans(self) -> list[int]:
        """How many input positions the window spans along each axis, dilation included."""
        return [(width - 1) * spacing + 1 for width, spacing in zip(self.kernel, self.dilation, strict=True)]

    def padded_sizes(self) -> list[int | torch.SymInt]:
        return [size + 2 * pad for size, pad in zip(self.sizes, self.padding, strict=True)]

    def fitted_kernel(self) -> list[int] | None:
        """The kernel narrowed to the padded input along each axis it overhangs; None where it overhangs none.

        An axis with a symbolic size or a dilated window is left as it is.
        """
        kernel = [
            padded if isinstance(padded, int) and spacing == 1 and width > padded else width
            for width, spacing, padded in zip(self.kernel, self.dilation, self.padded_sizes(), strict=True)
        ]
        return kernel if kernel != self.kernel else None


def pooling_window(node: Node) -> PoolingWindow | None:
    """The window of ``node`` if it is a pooling op whose input's shape is known, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    dimensions = POOLING_DIMENSIONS.get(node.target._schema.name)
    source = node.args[0] if node.args else None
    if dimensions is None or not isinstance(source, Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return None
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    arguments = dict(normalized.kwargs)
    kernel = per_dimension(arguments["kernel_size"], dimensions)
    # An empty stride means the kernel's.
    stride = per_dimension(arguments.get("stride") or kernel, dimensions)
    return PoolingWindow(
        arguments=arguments,
        kernel=kernel,
        stride=stride,
        padding=per_dimension(arguments.get("padding", 0), dimensions),
        dilation=per_dimension(arguments.get("dilation", 1), dimensions),
        sizes=list(source.meta["val"].shape[-dimensions:]),
    )


def per_dimension(value: Any, dimensions: int) -> list[int]:
    """A pooling argument given once or per dimension, as one int per dimension."""
    values = [value] if isinstance(value, int) else list(value)
    return values * dimensions if len(values) == 1 else values


def with_pooling_windows_fitted(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with each pooling window that overhangs its padded input narrowed to it.

    The program given is not changed; one without such a window is returned as it is.
    """
    windows = {node: window for node in exported.graph.nodes if (window := pooling_window(node))}
    fitted = {node: (window, kernel) for node, window in windows.items() if (kernel := window.fitted_kernel())}
    if not fitted:
        return exported

    def edit(graph: Graph, copies: dict[Node, Node]) -> None:
        for original, (window, kernel) in fitted.items():
            copy = copies[original]
            copy.args, copy.kwargs = narrowed_call(copy, window, kernel), {}

    return edited_copy(exported, edit)


def narrowed_call(node: Node, window: PoolingWindow, kernel: list[int]) -> tuple[Any, ...]:
    """``node``'s arguments, all positional, with ``kernel`` and, along each narrowed axis, a stride to match.

    An axis whose window overhangs its input has one output along it, so its stride is free; the
    others keep theirs, which an empty stride would have tied to the new kernel.
    """
    stride = [new if new != old else step for new, old, step in zip(kernel, window.kernel, window.stride, strict=True)]
    # ``arguments`` runs in the schema's order, its first entry the input tensor.
    arguments = {**window.arguments, "kernel_size": kernel, "stride": stride}
    return (node.args[0], *list(arguments.values())[1:])
