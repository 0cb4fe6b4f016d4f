"""One-token attention over repeated key/value heads, run on the key/value heads themselves.

A grouped-query attention layer (Llama, Qwen, Mistral, Gemma…) has fewer key/value heads than
query heads. Exported, transformers' attention repeats each key/value head once per query head of
its group (``repeat_kv``: unsqueeze, expand, and a copy), so every decode step copies the whole
cache, ``group`` times over, before attending to it: on a 99.5 M Llama at cache 256, most of the
time its attention takes. transformers' eager decode does not (``pack_gqa``): for one query
token, the queries of a group become rows of one query against its key/value head. The same
here, in the graph every engine is given: the attention reads ``key`` and ``value`` as they are,
its query ``[B, H, 1, D]`` viewed as ``[B, H_kv, group, D]``, and its result copied back to
``[B, H, 1, D]`` (a small copy: one row per head). The values are the same dot products and the
same softmax per row.

Left alone: a query longer than one token (prompts are compute-bound; the copy is a small part),
a causal flag (its mask is aligned to rows, which grouping would move), dropout, and a mask that
differs per query head of a group in a way that cannot be regrouped. An attention that asks for
the repeat itself (``enable_gqa``) is grouped the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node
from torch.fx.operator_schemas import normalize_function

from .graph_edits import edited_copy, inserted_call

aten = torch.ops.aten


@dataclass(frozen=True)
class GroupedAttention:
    """An attention node whose key and value are repeats of ``key`` and ``value``, ``group`` times per head."""

    node: Node
    query: Node
    key: Node
    value: Node
    mask: Node | None
    group: int
    scale: float | None


def repeated_heads(node: object) -> tuple[Node, int] | None:
    """``(source, group)`` where ``node`` is ``source`` ``[B, H_kv, S, D]`` with each head repeated ``group`` times.

    The form export leaves of ``x[:, :, None].expand(B, H_kv, group, S, D).reshape(B, H_kv * group, S, D)``.
    """
    if not (isinstance(node, Node) and node.target in (aten._unsafe_view.default, aten.view.default)):
        return None
    copied = node.args[0]
    if not (isinstance(copied, Node) and copied.target == aten.clone.default):
        return None
    expanded = copied.args[0]
    if not (isinstance(expanded, Node) and expanded.target == aten.expand.default):
        return None
    unsqueezed = expanded.args[0]
    if not (isinstance(unsqueezed, Node) and unsqueezed.target == aten.unsqueeze.default
            and unsqueezed.args[1] in (2, -3) and isinstance(unsqueezed.args[0], Node)):
        return None
    source = unsqueezed.args[0]
    shape, repeated = tensor_shape(source), tensor_shape(node)
    group = tensor_shape(expanded)
    if shape is None or repeated is None or group is None or len(shape) != 4 or len(group) != 5:
        return None
    batch, heads, length, width = shape
    if not isinstance(group[2], int) or group[2] < 2 or list(repeated) != [batch, heads * group[2], length, width]:
        return None
    return source, group[2]


def shared_heads(node: object, heads: int) -> tuple[Node, int] | None:
    """``(node, group)`` where ``node`` ``[B, H_kv, S, D]`` serves ``heads`` query heads, ``group`` each
    (``enable_gqa``, which the ONNX exporter, for one, writes as a repeat of the key/value heads)."""
    shape = tensor_shape(node) if isinstance(node, Node) else None
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or shape[1] >= heads or heads % shape[1]:
        return None
    return node, heads // shape[1]


def tensor_shape(node: Node) -> list[int | torch.SymInt] | None:
    value = node.meta.get("val")
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def plain_attention_arguments(node: Node) -> dict[str, Any] | None:
    """An attention ``node``'s arguments by name, where it has neither dropout nor a causal flag; else None."""
    if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
        return None
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    arguments = normalized.kwargs
    if arguments.get("dropout_p", 0.0) != 0.0 or arguments.get("is_causal"):
        return None
    return arguments


def grouped_attention(node: Node) -> GroupedAttention | None:
    """``node`` as a one-token attention over repeated key/value heads that can run grouped, else None."""
    arguments = plain_attention_arguments(node)
    if arguments is None:
        return None
    query = arguments["query"]
    shape = tensor_shape(query) if isinstance(query, Node) else None
    if shape is None or len(shape) != 4 or shape[2] != 1 or not all(isinstance(size, int) for size in shape):
        return None
    if arguments.get("enable_gqa"):
        key, value = shared_heads(arguments["key"], shape[1]), shared_heads(arguments["value"], shape[1])
    else:
        key, value = repeated_heads(arguments["key"]), repeated_heads(arguments["value"])
    if key is None or value is None or key[1] != value[1]:
        return None
    mask = arguments.get("attn_mask")
    if mask is not None and not (isinstance(mask, Node) and regroupable_mask(mask, shape[1])):
        return None
    return GroupedAttention(node, query, key[0], value[0], mask, key[1], arguments.get("scale"))


def regroupable_mask(mask: Node, heads: int) -> bool:
    """Whether ``mask`` (broadcast to ``[B, H, 1, S]``) is the same for every query head, or has one row per head."""
    shape = tensor_shape(mask)
    if shape is None or (len(shape) >= 2 and shape[-2] != 1):
        return False
    return len(shape) < 3 or shape[-3] in (1, heads)


def with_grouped_attention(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with each one-token attention over repeated key/value heads run on the heads themselves.

    The program given is not changed; one without such an attention is returned as it is.
    """
    found = [attention for node in exported.graph.nodes if (attention := grouped_attention(node))]
    if not found:
        return exported

    def edit(graph: Graph, copies: dict[Node, Node]) -> None:
        for attention in found:
            regroup(graph, attention, copies)
        graph.eliminate_dead_code()  # the repeats of the key/value heads

    return edited_copy(exported, edit)


def regroup(graph: Graph, attention: GroupedAttention, copies: dict[Node, Node]) -> None:
    """Replace ``attention``'s copy in ``graph`` by one on the key/value heads, its query heads as rows."""
    node = copies[attention.node]
    batch, heads, _, width = tensor_shape(attention.query) or []
    grouped_shape = [batch, heads // attention.group, attention.group, width]
    before = set(graph.nodes)
    with graph.inserting_before(node):
        query = reshaped(graph, copies[attention.query], grouped_shape)
        mask = None if attention.mask is None else copies[attention.mask]
        mask_shape = None if mask is None else tensor_shape(mask)
        if mask is not None and mask_shape is not None and len(mask_shape) >= 3 and mask_shape[-3] == heads:
            mask = reshaped(graph, mask, [*mask_shape[:-3], heads // attention.group, attention.group, -1])
        grouped = inserted_call(
            graph, aten.scaled_dot_product_attention.default,
            (query, copies[attention.key], copies[attention.value], mask),
            {} if attention.scale is None else {"scale": attention.scale},
        )
        # Copied, never viewed: decomposed, the attention is a kernel whose result is laid out query by query
        # ([B, rows, H_kv, D], transposed back), and its heads and rows then do not merge in place.
        result = copied_as(graph, grouped, [batch, heads, 1, width])
    # Each new node is the attention's doing: its module stack and source line, for reports and engines that read them.
    for added in set(graph.nodes) - before:
        added.meta.update({key: value for key, value in node.meta.items() if key != "val"})
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def reshaped(graph: Graph, node: Node, shape: list[int | torch.SymInt]) -> Node:
    """``node`` viewed as ``shape``, or copied first where its strides do not allow a view (as ``reshape`` does)."""
    if viewable(node, shape):
        return inserted_call(graph, aten.view.default, (node, shape))
    return copied_as(graph, node, shape)


def copied_as(graph: Graph, node: Node, shape: list[int | torch.SymInt]) -> Node:
    """``node`` copied into memory of its own, laid out as ``shape`` (what ``reshape`` decomposes to)."""
    copied = inserted_call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    return inserted_call(graph, aten._unsafe_view.default, (copied, shape))


def viewable(node: Node, shape: list[int | torch.SymInt]) -> bool:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return False
    try:
        value.view(shape)
    except RuntimeError:
        return False
    return True
