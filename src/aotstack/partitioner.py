"""The partitioner interface and the tagging helpers every partitioner shares.

A partitioner marks the nodes its backend will run with ``node.meta["delegation_tag"]``
and says, per tag, which backend and options take it. It never changes the ops themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, Node

from .delegate_op import is_delegate_call, is_delegate_output
from .specs import PartitionResult

DELEGATION_TAG = "delegation_tag"

_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class Partitioner(ABC):
    """Base of every partitioner: claims parts of one method's graph for a backend."""

    @abstractmethod
    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag the nodes this partitioner's backend takes; return the tags and their backends."""


def get_non_lowered_nodes(graph: Graph) -> list[Node]:
    """The call_function nodes no earlier partitioner has lowered.

    A delegate call and the getitems that take its outputs are never offered again, so no
    delegate is ever nested inside another.
    """
    return [
        node
        for node in graph.nodes
        if node.op == "call_function" and not is_delegate_call(node) and not is_delegate_output(node)
    ]


def constant_placeholders(exported_program: ExportedProgram) -> dict[Node, str]:
    """Placeholders holding parameters, buffers and lifted constants, with their FQNs."""
    targets = {
        spec.arg.name: spec.target
        for spec in exported_program.graph_signature.input_specs
        if spec.kind in _CONSTANT_KINDS and spec.target is not None
    }
    return {
        node: targets[node.name]
        for node in exported_program.graph.nodes
        if node.op == "placeholder" and node.name in targets
    }


def program_weights(exported_program: ExportedProgram) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and lifted constant tensor of the program, by FQN."""
    weights = dict(exported_program.state_dict)
    weights.update(
        (name, value) for name, value in exported_program.constants.items() if isinstance(value, torch.Tensor)
    )
    return weights


def mutated_buffer_names(exported_program: ExportedProgram) -> set[str]:
    """Names of the placeholders whose buffers the method mutates."""
    mutated_targets = set(exported_program.graph_signature.buffers_to_mutate.values())
    return {
        spec.arg.name
        for spec in exported_program.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER and spec.target in mutated_targets
    }


def tag_constant_data(exported_program: ExportedProgram) -> None:
    """Give each parameter, buffer and constant the tag of the partition that uses it.

    A constant whose users all carry one tag goes with that partition. One used by several
    partitions, or by untagged nodes, stays untagged (lowering copies it into every partition
    that reads it; the package stores it once). One nobody uses takes the first tag, so no
    constant is left dangling when everything else is claimed.
    """
    tags_in_graph = [
        node.meta[DELEGATION_TAG] for node in exported_program.graph.nodes if DELEGATION_TAG in node.meta
    ]
    mutated = mutated_buffer_names(exported_program)
    for node in constant_placeholders(exported_program):
        if node.name in mutated:
            continue
        user_tags = {user.meta.get(DELEGATION_TAG) for user in node.users}
        if not node.users:
            if tags_in_graph:
                node.meta[DELEGATION_TAG] = tags_in_graph[0]
        elif len(user_tags) == 1 and None not in user_tags:
            node.meta[DELEGATION_TAG] = user_tags.pop()


def tag_mutated_buffer(exported_program: ExportedProgram) -> None:
    """Tag a mutated buffer with the partition that computes its new value.

    The mutation itself stays in the method, so the buffer's state lives in one place.
    """
    signature = exported_program.graph_signature
    producers = {node.name: node for node in exported_program.graph.nodes}
    buffer_placeholders = {
        spec.target: spec.arg.name
        for spec in signature.input_specs
        if spec.kind == InputKind.BUFFER
    }
    for output_name, buffer_fqn in signature.buffers_to_mutate.items():
        producer = producers.get(output_name)
        placeholder = producers.get(buffer_placeholders.get(buffer_fqn, ""))
        if producer is not None and placeholder is not None and DELEGATION_TAG in producer.meta:
            placeholder.meta[DELEGATION_TAG] = producer.meta[DELEGATION_TAG]
