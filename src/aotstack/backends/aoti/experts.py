"""Mixture-of-experts matmuls that Inductor can compile, where the shapes allow it.

``transformers`` exports an experts layer as its ``grouped_mm_fallback`` custom op, whose Python
kernel loops over the experts: compiled as is, every call leaves the library for Python. Where
the rows are few and known (a decode step: one token times its top-k experts), each row's expert
is gathered and the rows multiplied as one batched matmul, which Inductor compiles with the
rest. Where the rows are many or dynamic (a prompt), the gather would copy an expert's weights
once per row, so the op stays as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

from ...format.custom_ops import registered_op
from ...format.op_names import op_name

GROUPED_MM = "transformers.grouped_mm_fallback.default"


def with_dense_experts(program: ExportedProgram) -> ExportedProgram:
    """``program`` with each grouped expert matmul over few, static rows as a batched matmul."""
    op = registered_op(GROUPED_MM)
    if op is None or not any(calls(node, GROUPED_MM) for node in program.graph.nodes):
        return program
    return program.run_decompositions({op: batched_expert_matmul})


def calls(node: torch.fx.Node, name: str) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and op_name(node.target) == name


def batched_expert_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> Any:
    """``rows[i] @ weight[e]`` for the expert ``e`` whose range in ``offsets`` holds row ``i``.

    ``rows`` is sorted by expert and ``offsets`` holds each expert's cumulative row count, as
    the op takes them. NotImplemented keeps the op, where the gather would not pay.
    """
    count = rows.shape[0]
    if not isinstance(count, int) or count > weight.shape[0]:
        return NotImplemented
    expert = torch.searchsorted(offsets, torch.arange(count, device=rows.device), right=True)
    # Rows past the last offset belong to no expert; the op leaves them zero.
    assigned = expert < weight.shape[0]
    products = torch.bmm(rows.unsqueeze(1), weight[expert.clamp(max=weight.shape[0] - 1)]).squeeze(1)
    return torch.where(assigned.unsqueeze(1), products, torch.zeros_like(products))
