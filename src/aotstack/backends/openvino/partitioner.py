"""``OpenVinoPartitioner``: claims what OpenVINO's PyTorch frontend converts and its CPU plugin runs as torch does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Node

from ...compile.partitioner import CONTROL_FLOW_OPS, MIN_ISLAND_WORK, SupportedOpsPartitioner
from ...errors import LoweringError
from ...format.op_names import OpName, matches_any, normalized_op_name
from ...format.placement import Reason
from ...format.specs import CompileSpec
from .backend import OpenVinoBackend
from .frontend import (
    argument_signature,
    decomposes,
    decomposition_refusal,
    frontend_refusal,
    int64_literal_refusal,
    integer_floor_division_refusal,
    node_dtype_refusal,
    pooling_window_refusal,
    repeats_refusal,
)
from .packages import require_openvino


class OpenVinoPartitioner(SupportedOpsPartitioner):
    """Claims, for OpenVINO on the CPU, every op its PyTorch frontend converts (asked of it: see ``frontend.py``).

    It declines a node that reads or makes a tensor the CPU plugin would not compute as torch
    does (float64, complex, float8), and one whose ops OpenVINO's decomposition turns into ops it
    cannot convert. ``ops`` narrows the claim to a set, named like ``"aten.linear"`` or given as
    op objects. A part lighter than ``min_island_work`` beside ops left to others is left too
    (``SupportedOpsPartitioner``).

    Example::

        lowered = aotstack.lower(program, [OpenVinoPartitioner(), AotiCpuPartitioner()])
    """

    backend_id = OpenVinoBackend.backend_id

    def __init__(
        self,
        ops: Iterable[OpName] | None = None,
        compile_specs: Iterable[CompileSpec] = (),
        *,
        min_block_size: int = 1,
        min_island_work: int = MIN_ISLAND_WORK,
    ) -> None:
        super().__init__(min_block_size=min_block_size, min_island_work=min_island_work, compile_specs=compile_specs)
        require_openvino("OpenVinoPartitioner needs openvino", LoweringError)
        self.ops = None if ops is None else frozenset(normalized_op_name(op, "ops") for op in ops)
        self.control_flow = frozenset(
            name for name in CONTROL_FLOW_OPS
            if hasattr(torch.ops.higher_order, name) and frontend_refusal(getattr(torch.ops.higher_order, name)) is None
        )

    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        return self.op_refusal(op) is None

    def op_refusal(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> Reason | None:
        if self.ops is not None and not matches_any(op, self.ops):
            return self.refusal("excluded", "the user's ops= list does not name it")
        refused = frontend_refusal(op)
        return None if refused is None else self.refusal("unsupported", refused)

    def node_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        refused = super().node_refusal(node, owner)
        if refused is not None or node.op != "call_function":
            return refused
        detail = (node_dtype_refusal(node) or int64_literal_refusal(node) or pooling_window_refusal(node)
                  or repeats_refusal(node) or integer_floor_division_refusal(node))
        if detail is None and decomposes(node.target):
            detail = decomposition_refusal(node.target, argument_signature(node))
        return None if detail is None else self.refusal("unsupported", detail)
