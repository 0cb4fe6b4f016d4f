"""Mixture-of-experts matmuls that Inductor compiles with the rest of the library.

``transformers`` exports an experts layer as its ``grouped_mm_fallback`` custom op, whose Python
kernel loops over the experts: compiled as is, every call leaves the library for Python, and the
process that loads the file must import transformers to register the op. Rewritten in ATen ops
before compiling, it needs neither:

- where the rows are few and known (a decode step: one token times its top-k experts), each
  row's expert is gathered and the rows multiplied as one batched matmul;
- elsewhere (a prompt), each expert multiplies its own range of rows, whose bounds the library
  reads from the offsets at run time. Gathering there would copy an expert's weights once per row.
  On a GPU each bound read would wait for the device, where the op's own loop waits once, so
  there the op stays as it is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.export import ExportedProgram

from ...format.custom_ops import registered_op
from ...format.op_names import op_name

GROUPED_MM = "transformers.grouped_mm_fallback.default"
# torch 2.11's Inductor fails (ZeroDivisionError) on the ranged matmuls of transformers' Mixtral and Qwen3-MoE
# prompts; 2.13's compiles them. Before, a prompt keeps the op.
RANGES_COMPILE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


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
    """One matmul per expert over its range of rows, the ranges read from ``offsets`` at run time."""
    count = rows.shape[0]
    products = []
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        # The op's own loop would fail on offsets outside the rows or running backwards.
        torch._check(end >= start)
        torch._check(end <= count)
        products.append(torch.mm(rows[start:end], weight[expert]))
        start = end
    products.append(rows.new_zeros(count - start, weight.shape[2]))
    return torch.cat(products)
