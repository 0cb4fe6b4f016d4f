"""Putting a delegate call in place of the nodes it replaces, and tidying the method around it."""

from __future__ import annotations

import heapq
import operator
from collections.abc import Collection

from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Graph, GraphModule, Node

from ..format.ops import call_delegate
from .partitioner import DELEGATION_TAG
from .program_parts import is_size_computation


def drop_buffer_mutations(exported: ExportedProgram, fqns: Collection[str]) -> None:
    """Take the updates of ``fqns`` out of the method: a delegate now makes them in place."""
    if not fqns:
        return
    output_node = exported.graph.output_node()
    specs = exported.graph_signature.output_specs
    kept = [
        index
        for index, spec in enumerate(specs)
        if not (spec.kind == OutputKind.BUFFER_MUTATION and spec.target in fqns)
    ]
    values = output_node.args[0]
    output_node.args = (tuple(values[index] for index in kept),)
    specs[:] = [specs[index] for index in kept]


def drop_unused_subgraphs(graph_module: GraphModule) -> None:
    """Remove the branches and bodies a delegate took with it."""
    for node in list(graph_module.graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.delete_all_unused_submodules()


def splice_delegate_call(
    graph: Graph, nodes: list[Node], delegate_id: str, inputs: list[Node], outputs: list[Node]
) -> dict[Node, Node]:
    """Replace ``nodes`` with one delegate call; each of ``outputs`` -> the ``getitem`` now standing for it."""
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(call_delegate, (delegate_id, inputs))
    call.meta["val"] = [n.meta["val"] for n in outputs]
    previous = call
    replaced = {}
    for index, node in enumerate(outputs):
        with graph.inserting_after(previous):
            item = graph.call_function(operator.getitem, (call, index))
        item.meta = {"val": node.meta["val"]}
        node.replace_all_uses_with(item)
        replaced[node] = previous = item
    for node in reversed(nodes):
        graph.erase_node(node)
    restore_topological_order(graph)
    return replaced


def restore_topological_order(graph: Graph) -> None:
    """Move nodes, in place and keeping their names, so each follows its inputs.

    The delegate call sits where its partition's last node was; an op outside the partition
    that read an earlier output must now move after it. The order is otherwise kept.
    """
    position = {node: index for index, node in enumerate(graph.nodes)}
    waiting = {node: len(node.all_input_nodes) for node in graph.nodes}
    ready = [(position[node], node) for node, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (position[user], user))
    first = next(iter(graph.nodes))
    if order[0] is not first:
        first.prepend(order[0])
    for previous, node in zip(order, order[1:]):
        if previous.next is not node:
            previous.append(node)


def drop_unused_size_computations(graph: Graph) -> None:
    """Remove the sizes only delegates read: each delegate now computes its own."""
    for node in reversed(list(graph.nodes)):
        if is_size_computation(node) and not node.users:
            graph.erase_node(node)


def clear_tags(graph: Graph) -> None:
    for node in graph.nodes:
        node.meta.pop(DELEGATION_TAG, None)
