"""Concatenations rid of the empty one-dimensional operands torch skips.

``torch.cat`` skips an operand of shape ``[0]`` whatever the others' rank (a rule kept from its
early days): transformers' ``DynamicCache`` starts each layer's keys and values as
``torch.tensor([])`` and concatenates the first step's onto it, so a model exported with its cache
on (a decoder's base model, exported for its hidden states) carries ``cat([empty, keys], -2)``.
OpenVINO's ``Concat`` checks every operand's rank and refuses the partition; other engines copy
or check an operand that adds nothing. Dropped, each concatenation gives the same value.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from .graph_edits import edited_copy


def with_empty_concat_operands_dropped(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with each ``cat``'s skipped empty operands dropped; returned as it is where it has none."""
    kept = {node: operands for node in exported.graph.nodes if (operands := operands_kept(node)) is not None}
    if not kept:
        return exported

    def edit(graph: Graph, copies: dict[Node, Node]) -> None:
        for original, operands in kept.items():
            copy = copies[original]
            copy.args = ([copies[operand] for operand in operands], *copy.args[1:])

    return edited_copy(exported, edit)


def operands_kept(node: Node) -> list[Node] | None:
    """The operands of a ``cat`` but those torch skips; None where there is none to drop, or nothing else.

    An empty operand of another dtype than the result stays: it may have taken part in the result's dtype.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return None
    operands = node.args[0]
    result = node.meta.get("val")
    if not isinstance(result, torch.Tensor) or not all(isinstance(operand, Node) for operand in operands):
        return None
    kept = [operand for operand in operands if not skipped_by_cat(operand.meta.get("val"), result)]
    return kept if 0 < len(kept) < len(operands) else None


def skipped_by_cat(value: object, result: torch.Tensor) -> bool:
    """Whether ``torch.cat`` skips ``value`` in making ``result``: a tensor of shape ``[0]`` beside higher ranks."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and result.dim() > 1
        and isinstance(value.shape[0], int)
        and value.shape[0] == 0
        and value.dtype == result.dtype
    )
