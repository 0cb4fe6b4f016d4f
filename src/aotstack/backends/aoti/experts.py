"""Mixture-of-experts matmuls that Inductor compiles with the rest of the library.

``transformers`` exports an experts layer as its ``grouped_mm_fallback`` custom op, whose Python
kernel loops over the experts: compiled as is, every call leaves the library for Python, and the
process that loads the file must import transformers to register the op. Rewritten in ATen ops
before compiling, it needs neither:

- where the rows are few and known (a decode step: one token times its top-k experts), each
  row's expert is gathered and the rows multiplied as one batched matmul;
- elsewhere (a prompt), each expert multiplies its own range of rows, whose bounds the library
  reads from the offsets at run time. Gathering there would read an expert's weights once per row.
  Past ``MOST_UNROLLED_EXPERTS`` those matmuls are not written out one by one, which made the compile
  grow with the experts, but a block of them a turn of a loop in the library.
  On a GPU each bound read would wait for the device, where the op's own loop waits once, so
  there the op stays as it is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch._higher_order_ops.while_loop import while_loop
from torch.export import ExportedProgram

from ...format.custom_ops import registered_op
from ...format.op_names import op_name

GROUPED_MM = "transformers.grouped_mm_fallback.default"
# torch 2.11's Inductor fails (ZeroDivisionError) on the ranged matmuls of transformers' Mixtral and Qwen3-MoE
# prompts; 2.13's compiles them. Before, a prompt keeps the op.
RANGES_COMPILE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
# Each matmul written out adds 0.3 s or more to the compile on a 2-core CPU; each turn of the loop copies the
# products once more (32 experts: 18.5 ms written out, 22.8 ms in turns of 8, for 1024 rows of 512 x 1024).
MOST_UNROLLED_EXPERTS = 32
EXPERTS_PER_TURN = 8


def with_compiled_experts(program: ExportedProgram, *, on_host: bool) -> ExportedProgram:
    """``program`` with each grouped expert matmul written in ATen ops (``expert_matmul``);
    ``on_host``: the library runs on the CPU, where a prompt's matmuls are rewritten too."""
    op = registered_op(GROUPED_MM)
    if op is None or not any(calls(node, GROUPED_MM) for node in program.graph.nodes):
        return program
    ranged = on_host and RANGES_COMPILE
    return program.run_decompositions({op: partial(expert_matmul, ranges_read_on_host=ranged)})


def calls(node: torch.fx.Node, name: str) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and op_name(node.target) == name


def expert_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, ranges_read_on_host: bool) -> Any:
    """``rows[i] @ weight[e]`` for the expert ``e`` whose range in ``offsets`` holds row ``i``.

    ``rows`` is sorted by expert and ``offsets`` holds each expert's cumulative row count, as
    the op takes them. Rows past the last offset belong to no expert; the op leaves them zero.
    NotImplemented keeps the op.
    """
    count = rows.shape[0]
    if isinstance(count, int) and count <= weight.shape[0]:
        return batched_expert_matmul(rows, weight, offsets)
    if ranges_read_on_host:
        return ranged_expert_matmuls(rows, weight, offsets)
    return NotImplemented


def batched_expert_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row times its own expert's weights, gathered: one batched matmul over few rows."""
    expert = torch.searchsorted(offsets, torch.arange(rows.shape[0], device=rows.device), right=True)
    assigned = expert < weight.shape[0]
    products = torch.bmm(rows.unsqueeze(1), weight[expert.clamp(max=weight.shape[0] - 1)]).squeeze(1)
    return torch.where(assigned.unsqueeze(1), products, torch.zeros_like(products))


def ranged_expert_matmuls(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One matmul per expert over its range of rows, the ranges read from ``offsets`` at run time.

    Past ``MOST_UNROLLED_EXPERTS`` the experts go in blocks, a loop in the library running one block's matmuls a
    turn, so the compile does not grow with the experts (a tiny MiniMax-M2's 256: over 10 minutes written out).
    """
    count, experts = rows.shape[0], weight.shape[0]
    bounds = torch.cat([offsets.new_zeros(1), offsets])
    if experts <= MOST_UNROLLED_EXPERTS:
        products, (_, end) = matmuls_over_ranges(rows, weight, bounds)
        return torch.cat([products, rows.new_zeros(count - end, weight.shape[2])])  # rows of no expert
    block = experts_per_turn(experts)

    def more(index: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
        return index < experts // block

    def next_block(index: torch.Tensor, products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = index.item()
        torch._check(first >= 0)
        torch._check(first < experts // block)
        # Indexed by the tensor, not narrowed at ``first``: dynamo, tracing the loop's body, cannot narrow there.
        edges = torch.index_select(bounds, 0, index * block + torch.arange(block + 1, device=bounds.device))
        block_products, (start, end) = matmuls_over_ranges(rows, weight.narrow(0, first * block, block), edges)
        return index + 1, products.slice_scatter(block_products, 0, start, end)

    first_turn = torch.zeros((), dtype=torch.int64, device=rows.device)
    return while_loop(more, next_block, (first_turn, rows.new_zeros(count, weight.shape[2])))[1]


def experts_per_turn(experts: int) -> int:
    """The most experts, at most ``EXPERTS_PER_TURN``, that divide ``experts`` into equal blocks."""
    return max(size for size in range(1, EXPERTS_PER_TURN + 1) if experts % size == 0)


def matmuls_over_ranges(
    rows: torch.Tensor, weight: torch.Tensor, edges: torch.Tensor
) -> tuple[torch.Tensor, tuple[Any, Any]]:
    """Rows ``edges[0]:edges[-1]``, each range ``edges[e]:edges[e + 1]`` times ``weight[e]``; and those two edges."""
    count = rows.shape[0]
    bounds = [edge.item() for edge in edges]
    products = []
    for expert, (start, end) in enumerate(zip(bounds, bounds[1:])):
        # The op's own loop would fail on offsets outside the rows or running backwards.
        torch._check(start >= 0)
        torch._check(end >= start)
        torch._check(end <= count)
        products.append(torch.mm(rows.narrow(0, start, end - start), weight[expert]))
    return torch.cat(products), (bounds[0], bounds[-1])
