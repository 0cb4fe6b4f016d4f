"""``XnnpackPartitioner``: claims what ExecuTorch's own ``XnnpackPartitioner`` would delegate (asked: ``claims.py``)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from ...compile.partitioner import MIN_ISLAND_WORK, PartitionResult, SupportedOpsPartitioner
from ...compile.program_parts import node_tensors
from ...errors import LoweringError
from ...format.placement import Reason
from ...format.specs import CompileSpec
from .backend import XnnpackBackend
from .claims import XnnpackAnswer, remembered_answer
from .packages import require_executorch

# The dtypes ExecuTorch's edge dialect has ops for (its ``edge.yaml``): a part touching another (a float8
# weight's transpose and cast) passes ExecuTorch's partitioner, then fails its dtype checks when lowered.
EXECUTORCH_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


# Ops XNNPACK lowers to its static reshape, which takes at most one dynamic dimension.
STATIC_RESHAPES = frozenset({
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
})


CONVOLUTIONS = frozenset({torch.ops.aten.conv1d.default, torch.ops.aten.convolution.default})


def reshaped_dynamic_dimensions(node: Node) -> int:
    """The most dynamic dimensions a static reshape XNNPACK would lower ``node`` with has; 0 for no reshape.

    A 1-D convolution is lowered as a 2-D one between an unsqueeze of its input and a squeeze of its output.
    """
    if node.target in STATIC_RESHAPES:
        return dynamic_dimensions(node.meta.get("val"))
    if node.target in CONVOLUTIONS and node.args and isinstance(node.args[0], Node):
        source = node.args[0].meta.get("val")
        if isinstance(source, torch.Tensor) and source.dim() == 3:
            return max(dynamic_dimensions(source), dynamic_dimensions(node.meta.get("val")))
    return 0


def dynamic_dimensions(value: object) -> int:
    """How many of the sizes of ``value`` are symbolic; 0 for anything not a tensor."""
    return sum(not isinstance(size, int) for size in value.shape) if isinstance(value, torch.Tensor) else 0


class XnnpackPartitioner(SupportedOpsPartitioner):
    """Claims, for ExecuTorch's XNNPACK delegate on the CPU, every node ExecuTorch's ``XnnpackPartitioner`` delegates.

    ExecuTorch is asked about the whole method each time (its partitioner decides per node, in
    context: a linear whose weight is not a constant, a dtype XNNPACK lacks), so its answer, not
    a copy of its op list, decides. torchao-quantized linears (``8da4w``, ``8w``, ...) are claimed
    with their quantize and dequantize ops and reach XNNPACK's quantized kernels.

    With ``portable_kernels`` (the default), the small ops XNNPACK leaves between ops it takes
    are claimed too where ExecuTorch's runtime has kernels for them: ExecuTorch runs them in the
    same program, so a decoder is one XNNPACK part per layer, not one per gap (an RMS norm's
    ``mean``). What reads a KV cache stays with the next engine, which updates it in place.
    ``portable_kernels=False`` claims XNNPACK's ops alone. A part lighter than ``min_island_work``
    beside ops left to others (the norms between int4 weight-only linears XNNPACK refuses) is
    left too (``SupportedOpsPartitioner``).

    Example::

        lowered = aotstack.lower(program, [XnnpackPartitioner(), AotiCpuPartitioner()])
    """

    backend_id = XnnpackBackend.backend_id

    def __init__(
        self,
        compile_specs: Iterable[CompileSpec] = (),
        *,
        min_block_size: int = 1,
        min_island_work: int = MIN_ISLAND_WORK,
        portable_kernels: bool = True,
    ) -> None:
        super().__init__(min_block_size=min_block_size, min_island_work=min_island_work, compile_specs=compile_specs)
        require_executorch("XnnpackPartitioner needs executorch", LoweringError)
        self.portable_kernels = portable_kernels
        self.answer: XnnpackAnswer | None = None

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        self.answer = remembered_answer(exported_program, portable=self.portable_kernels)
        return super().partition(exported_program)

    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        # Decided per node, from ExecuTorch's answer (``node_refusal``), never by the op alone.
        return True

    def node_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        refused = super().node_refusal(node, owner)
        if refused is not None or node.target is operator.getitem:
            return refused
        dtype = next((tensor.dtype for tensor in node_tensors(node) if tensor.dtype not in EXECUTORCH_DTYPES), None)
        if dtype is not None:
            return self.refusal("unsupported", f"it reads or makes a {dtype} tensor, which ExecuTorch has no ops for")
        dynamic = reshaped_dynamic_dimensions(node)
        if dynamic > 1:
            return self.refusal("unsupported", f"XNNPACK reshapes with at most one dynamic dimension, and this "
                                               f"one has {dynamic} (ExecuTorch's partitioner takes it, then cannot "
                                               "lower it)")
        if self.answer is None:
            return self.refusal("not_claimed", "ExecuTorch is asked when a whole program is partitioned")
        detail = self.answer.refusal(node)
        return None if detail is None else self.refusal("unsupported", detail)
