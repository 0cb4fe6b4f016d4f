"""Graph passes run on a partition before AOTInductor compiles it.

A pass takes the partition's ``GraphModule``, rewrites it in place and says whether it
changed anything. New nodes get a ``meta["val"]`` computed on the graph's fake tensors, so
later steps can read shapes as they do on exported nodes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

GraphPass = Callable[[GraphModule], bool]

aten = torch.ops.aten


class ReplaceViewCopyWithViewPass:
    """Turn ``slice_copy``, ``select_copy`` and ``split_copy`` into the views they copy.

    AOTInductor then reads the source in place instead of materializing a copy. A copy stays
    where a user of its result writes to it in place, takes a view of it, or returns it from
    the partition: there the result must not alias its source.
    """

    views_of_copies: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
        aten.slice_copy.Tensor: aten.slice.Tensor,
        aten.select_copy.int: aten.select.int,
        aten.split_copy.Tensor: aten.split.Tensor,
        aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    }

    def __call__(self, graph_module: GraphModule) -> bool:
        changed = False
        for node in graph_module.graph.nodes:
            view = self.views_of_copies.get(node.target) if node.op == "call_function" else None
            if view is not None and not any(needs_own_memory(node, user) for user in result_users(node)):
                node.target = view
                changed = True
        if changed:
            graph_module.recompile()
        return changed


def result_users(node: Node) -> list[Node]:
    """The nodes that read ``node``'s tensors; for a split, the users of each piece."""
    users = []
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            users.extend(user.users)
        else:
            users.append(user)
    return users


def needs_own_memory(source: Node, user: Node) -> bool:
    """Whether ``user`` would see a difference if a tensor it reads became a view."""
    if user.op == "output":
        return True
    if user.op != "call_function":
        return user.op == "call_method"
    target = user.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    operands = [arg for arg in argument_slots(user) if reads(arg[1], source)]
    if target.is_view and operands:
        return True
    return any(writes(argument) for argument, _ in operands)


def argument_slots(node: Node) -> list[tuple[torch._C.Argument, Any]]:
    """Each schema argument of ``node`` with the value passed to it."""
    schema = node.target._schema
    slots = list(zip(schema.arguments, node.args))
    by_name = {argument.name: argument for argument in schema.arguments}
    slots += [(by_name[name], value) for name, value in node.kwargs.items() if name in by_name]
    return slots


def reads(value: Any, source: Node) -> bool:
    return any(leaf is source or is_piece_of(leaf, source) for leaf in pytree.tree_leaves(value))


def is_piece_of(value: Any, source: Node) -> bool:
    """Whether ``value`` is one of the tensors a split ``source`` returns."""
    return isinstance(value, Node) and value.target is operator.getitem and value.args[0] is source


def writes(argument: torch._C.Argument) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write

