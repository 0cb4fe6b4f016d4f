"""Attention of a few query rows as a reduction and a product, on the CPU, before AOTInductor compiles it.

A decode step attends one token's queries (a few rows per key head once grouped, see
``compile/attention.py``) to the cache. AOTInductor compiles an attention as a call to ATen's
flash attention, whose setup (blocking, buffers, its parallel loop) costs more than the few dot
products a decode step needs. Here the scores are a multiply and a sum over the head width,
which Inductor compiles into a loop fused with the softmax and the mask; the query is computed
once before it (left to Inductor, a rotary embedding's cosines and sines were inlined into the
loop and computed again for every key). The weighted sum of the values stays ATen's product: a
call Inductor does not fuse across. As a reduction too, a decoder with its linears already
reductions (``few_rows.py``) had no such call left, Inductor fused all its layers into one
kernel, and every intermediate buffer of it was allocated at each call (427 against 113 for the
99.5 M Llama), which cost more than the attention gained.

1 thread, AMD EPYC with AVX-512, one attention compiled alone, its cache warm, ``[1, 4, 3, 64]``
queries over 40 keys: 14.8 µs against 19.4 as a flash attention (2 threads: 15.6 against 22.0);
over 256 keys 32.7 against 39.0. The 99.5 M Llama's ``8da4w`` decode (64 tokens after an 8-token
prompt, cache 256), same process, files alternating, two runs: XNNPACK+AOTInductor 390 to 424 and
393 to 410 tokens/s, AOTInductor alone 276 to 282 and 258 to 268; float32 through AOTInductor alone
103 to 107.

Scores, softmax and sums are computed in float32 where the inputs are narrower, as the flash
kernel accumulates, and the result is cast back. A query of more than ``MAX_QUERY_ROWS`` rows (a
prompt's) keeps the flash attention: its blocked products are the faster there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from ...compile.attention import plain_attention_arguments
from ...compile.graph_edits import inserted_call, replace_node
from .few_rows import force_stride_order

aten = torch.ops.aten

# Query rows per head up to which this form is the faster (one attention compiled alone, 40 keys: 8 rows
# 19.2 µs against 21.8 as a flash attention, 16 rows 26.2 against 26.6).
MAX_QUERY_ROWS = 8


@dataclass(frozen=True)
class FewQueriesAttention:
    """An attention node of at most ``MAX_QUERY_ROWS`` query rows that can run as a reduction and a product."""

    node: Node
    query: Node
    key: Node
    value: Node
    mask: Node | None
    scale: float


class FewQueriesAttentionPass:
    """Write each attention of a few query rows as a reduction Inductor fuses, then a product."""

    def __call__(self, graph_module: GraphModule) -> bool:
        graph = graph_module.graph
        changed = False
        # One at a time: a layer's query may be the attention before it, replaced just now.
        for node in list(graph.nodes):
            attention = few_queries_attention(node)
            if attention is None:
                continue
            with graph.inserting_before(node):
                result = attention_as_reduction_and_product(graph, attention)
            replace_node(graph, node, result)
            changed = True
        if changed:
            graph_module.recompile()
        return changed


def few_queries_attention(node: Node) -> FewQueriesAttention | None:
    """``node`` as an attention of a few query rows over keys of its own batch and heads, else None."""
    arguments = plain_attention_arguments(node)
    if arguments is None or arguments.get("enable_gqa"):
        return None
    query, key, value, mask = arguments["query"], arguments["key"], arguments["value"], arguments.get("attn_mask")
    if not (isinstance(query, Node) and isinstance(key, Node) and isinstance(value, Node)):
        return None
    if mask is not None and not isinstance(mask, Node):
        return None
    values = [operand.meta.get("val") for operand in (query, key, value)]
    if not all(isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 for tensor in values):
        return None
    query_value, key_value, value_value = values
    rows, width = query_value.shape[-2], query_value.shape[-1]
    if not (isinstance(rows, int) and rows <= MAX_QUERY_ROWS and isinstance(width, int) and width > 0):
        return None
    # Leading dimensions equal and known, not broadcast: the reductions then read each key once per query row.
    leading = [tuple(tensor.shape[:-2]) for tensor in values]
    if not (all(isinstance(size, int) for size in leading[0]) and leading[0] == leading[1] == leading[2]):
        return None
    if key_value.shape[-1] != width or query_value.dtype != key_value.dtype or key_value.dtype != value_value.dtype:
        return None
    if not query_value.dtype.is_floating_point:
        return None
    if mask is not None and not isinstance(mask.meta.get("val"), torch.Tensor):
        return None
    scale = arguments.get("scale")
    return FewQueriesAttention(node, query, key, value, mask, 1 / math.sqrt(width) if scale is None else scale)


def attention_as_reduction_and_product(graph: Graph, attention: FewQueriesAttention) -> Node:
    """``softmax(q·kᵀ * scale + mask)·v``, the scores as a multiply and a sum, cast back to the query's type."""
    dtype = attention.query.meta["val"].dtype

    def call(target: torch._ops.OpOverload, *args: object) -> Node:
        return inserted_call(graph, target, args)

    # Half-width floats computed in float32, as the flash kernel accumulates them.
    computed = torch.promote_types(dtype, torch.float32)

    def cast(tensor: Node, to: torch.dtype) -> Node:
        return tensor if computed == dtype else inserted_call(graph, aten._to_copy.default, (tensor,), {"dtype": to})

    query, key, value = (cast(node, computed) for node in (attention.query, attention.key, attention.value))
    # Computed once, into a buffer, rather than inlined into the loop over the keys.
    query = inserted_call(graph, force_stride_order(), (query, list(query.meta["val"].stride())))
    # [..., rows, 1, width] * [..., 1, keys, width], summed over the width: [..., rows, keys].
    products = call(aten.mul.Tensor, call(aten.unsqueeze.default, query, -2), call(aten.unsqueeze.default, key, -3))
    scores = call(aten.mul.Tensor, call(aten.sum.dim_IntList, products, [-1]), attention.scale)
    scores = masked_scores(graph, scores, attention.mask)
    weights = call(aten._softmax.default, scores, -1, False)
    # ATen's product, a call Inductor does not fuse across (see the module's docstring).
    result = cast(batched_product(graph, weights, value), dtype)
    # Laid out as the attention's result was (ATen's CPU attention writes it heads inside rows): the graph after it
    # may view it on that layout, as transformers' heads joined with a transpose and a view do.
    layout = list(attention.node.meta["val"].stride())
    if list(result.meta["val"].stride()) == layout:
        return result
    return inserted_call(graph, force_stride_order(), (result, layout))


def masked_scores(graph: Graph, scores: Node, mask: Node | None) -> Node:
    """``scores`` where a boolean ``mask`` lets a query see a key, else -inf; a float ``mask`` added."""
    if mask is None:
        return scores
    if mask.meta["val"].dtype == torch.bool:
        return inserted_call(graph, aten.where.ScalarOther, (mask, scores, -math.inf))
    return inserted_call(graph, aten.add.Tensor, (scores, mask))


def batched_product(graph: Graph, weights: Node, value: Node) -> Node:
    """``weights @ value`` over their leading dimensions, as one ``bmm``.

    Written out rather than as a ``matmul``: torch 2.11's ``matmul`` guards on the keys' count, a
    size known only when the graph runs where the keys are cut to the filled ones.
    """
    leading = list(weights.meta["val"].shape[:-2])
    if not leading:
        return inserted_call(graph, aten.mm.default, (weights, value))
    if len(leading) == 1:
        return inserted_call(graph, aten.bmm.default, (weights, value))
    last = len(leading) - 1
    flat = [inserted_call(graph, aten.flatten.using_ints, (operand, 0, last)) for operand in (weights, value)]
    product = inserted_call(graph, aten.bmm.default, tuple(flat))
    return inserted_call(graph, aten.unflatten.int, (product, 0, leading))
