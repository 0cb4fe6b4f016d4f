"""Edits to an FX graph that keep it readable by later steps: each new node carries its ``meta["val"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings
from torch.utils import _pytree as pytree

from .constants import renamed_signature
from .program_parts import rebuilt


def edited_copy(exported: ExportedProgram, edit: Callable[[Graph, dict[Node, Node]], None]) -> ExportedProgram:
    """A new program whose graph is a copy of ``exported``'s that ``edit(graph, copies)`` changed in place.

    ``copies`` maps each node of ``exported``'s graph to its copy; ``exported`` is not changed.
    """
    graph = Graph()
    copies: dict[Node, Node] = {}
    graph.output(graph.graph_copy(exported.graph, copies))
    edit(graph, copies)
    module = GraphModule(exported.graph_module, graph)
    return rebuilt(exported, module, renamed_signature(exported.graph_signature, graph))


def inserted_call(
    graph: Graph,
    target: torch._ops.OpOverload | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    like: Node | None = None,
) -> Node:
    """A new call to ``target`` at the graph's insertion point, with its ``meta["val"]``.

    The value is computed in the fake mode of the call's tensors, or of ``like``'s where it takes none.
    A size the value depends on the data for (an ``item``'s) is bound to this node, as export binds
    it: a later trace of the graph then knows where it comes from.
    """
    node = graph.call_function(target, args, kwargs)
    values, keywords = pytree.tree_map_only(Node, lambda arg: arg.meta["val"], (args, kwargs or {}))
    fake_mode = detect_fake_mode(pytree.tree_leaves((values, keywords, None if like is None else like.meta["val"])))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*values, **keywords)
        if fake_mode.shape_env is not None and (
            bindings := compute_unbacked_bindings(fake_mode.shape_env, node.meta["val"])
        ):
            node.meta["unbacked_bindings"] = bindings
    return node


def replace_node(graph: Graph, node: Node, result: Node) -> None:
    """Put ``result`` in ``node``'s place: its users read ``result``, which keeps ``node``'s meta but its value."""
    result.meta.update({key: value for key, value in node.meta.items() if key != "val"})
    node.replace_all_uses_with(result)
    graph.erase_node(node)
