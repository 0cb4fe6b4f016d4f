"""What an exported program holds: its weights, its constant and mutated placeholders, sizes and subgraphs."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def subgraph_nodes(node: Node) -> list[Node]:
    """The get_attr nodes among ``node``'s operands: the branches and bodies of a control-flow op."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [leaf for leaf in leaves if isinstance(leaf, Node) and leaf.op == "get_attr"]


def subgraph_modules(node: Node, owner: GraphModule) -> list[GraphModule]:
    modules = [getattr(owner, attr.target) for attr in subgraph_nodes(node)]
    return [module for module in modules if isinstance(module, GraphModule)]


def is_size_computation(node: Node) -> bool:
    """Whether ``node`` computes a size or another scalar (``sym_size``, arithmetic on sizes), not a tensor."""
    return node.op == "call_function" and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    )


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
