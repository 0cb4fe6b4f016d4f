"""``AotiPartitioner``: claims what an AOTInductor backend can run, in maximal convex parts."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.infra.partitioner import Partition

from ...compile.partitioner import PartitionResult, SupportedOpsPartitioner, compute_node_count
from ...compile.program_parts import subgraph_modules
from ...errors import MissingFallbackKernelsError
from ...format.custom_ops import has_kernel, is_custom_op_name
from ...format.op_names import OpName, matches_any, normalized_op_name, op_name
from ...format.ops import is_delegate_call
from ...format.placement import Reason
from ...format.plan import runs_as_plain_op
from ...format.specs import CompileSpec
from .backend import AotiBackend
from .kernels import kernel_allowed


class AotiPartitioner(SupportedOpsPartitioner):
    """Base of the AOTInductor partitioners; a subclass names its backend.

    ``exclude_ops`` lists ops to leave to plain ATen (or to the next partitioner), as
    ``"aten.relu"`` (every overload), ``"aten.relu.default"`` or the op object itself.
    ``min_block_size`` leaves parts with fewer compute nodes than that unclaimed. Left at None,
    it is 1, except that a backend with ``lone_ops_to_aten`` leaves a part of one ATen op between
    other engines' delegates to plain ATen: compiled alone the op fuses with nothing, so a
    compile (seconds), a library in the file and a delegate boundary would buy the kernel ATen
    runs anyway. ``min_block_size=1`` claims such parts too.

    Where the target's runtime lacks some fallback kernels (the backend's list, or the
    ``fallback_kernels`` compile spec), an op that would need one is not claimed: it runs as
    plain ATen between delegates. With ``strict=True`` the partitioner raises
    ``MissingFallbackKernelsError`` naming every such kernel instead.
    """

    backend: ClassVar[type[AotiBackend]]
    # AOTInductor compiles the branches and bodies of these into the same library.
    control_flow = frozenset({"cond", "while_loop"})
    # Whether, by default, a lone op between other engines' delegates runs as plain ATen (see above).
    lone_ops_to_aten: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "backend" in cls.__dict__:
            cls.backend_id = cls.backend.backend_id

    def __init__(
        self,
        exclude_ops: Iterable[OpName] = (),
        compile_specs: Iterable[CompileSpec] = (),
        *,
        min_block_size: int | None = None,
        strict: bool = False,
    ) -> None:
        super().__init__(min_block_size=1 if min_block_size is None else min_block_size, compile_specs=compile_specs)
        self.leaves_lone_ops = min_block_size is None and self.lone_ops_to_aten
        self.exclude_ops = frozenset(normalized_op_name(op, "exclude_ops") for op in exclude_ops)
        self.strict = strict
        self.aoti_backend = self.backend()
        # A bad spec is refused here, before any partitioning or compiling.
        self.aoti_backend.validate_compile_specs(self.compile_specs)
        self.fallback_kernels = self.aoti_backend.fallback_kernels(self.compile_specs)

    def default_target_device(self) -> str:
        return str(self.aoti_backend.target_device([]))

    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        return self.op_refusal(op) is None

    def op_refusal(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> Reason | None:
        if isinstance(op, torch._ops.OpOverload) and is_custom_op_name(op_name(op)):
            return self.custom_op_refusal(op)
        if op.namespace not in ("aten", "prims", "higher_order"):
            return self.refusal("unsupported", f"AOTInductor compiles ATen and prims ops, not {op.namespace} ops")
        if matches_any(op, self.exclude_ops):
            return self.refusal("excluded", "the user's exclude_ops names it")
        return None

    def custom_op_refusal(self, op: torch._ops.OpOverload) -> Reason | None:
        """A custom op is claimed, as plain AOTInductor takes it, where it has a kernel for the target.

        The library calls it through AOTInductor's proxy executor, so the loading process must
        register it too (the package lists it; ``format/custom_ops.py``).
        """
        if matches_any(op, self.exclude_ops):
            return self.refusal("excluded", "the user's exclude_ops names it")
        device = self.aoti_backend.target_device(self.compile_specs).type.value
        if not has_kernel(op, device):
            return self.refusal("unsupported", f"custom op {op.name()} has no kernel for {device}")
        return None

    def node_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        refused = super().node_refusal(node, owner)
        if refused is not None:
            return refused
        if is_convolution_over_data_dependent_sizes(node):
            return self.refusal(
                "unsupported",
                "Inductor lays out a convolution of other than 2 spatial dimensions by each stride's value, and a size "
                "here is read from data (plain AOTInductor fails on it too); ATen's kernel or another engine runs it",
            )
        missing = self.missing_kernels(node)
        if missing:
            kernels = ", ".join(sorted(missing))
            return self.refusal("missing_kernels", f"it needs fallback kernel(s) the target's runtime lacks: {kernels}")
        return None

    def part_refusal(self, partition: Partition, exported_program: ExportedProgram) -> Reason | None:
        refused = super().part_refusal(partition, exported_program)
        if refused is None and self.leaves_lone_ops and is_lone_plain_op(partition, exported_program):
            return self.refusal(
                "min_block_size",
                "a lone op between other engines' delegates runs as plain ATen: compiled alone it fuses with "
                "nothing, and ATen runs its own kernel without a boundary (min_block_size=1 claims it)",
            )
        return refused

    def compiled_calls_aten_kernel(self, node: Node) -> bool:
        # Inductor's code for the op alone, generated but not compiled (``probe.py``), names the ATen kernels it calls.
        # An op it cannot compile alone is not known to call one: all its time counts as what compiling could save.
        return isinstance(node.target, torch._ops.OpOverload) and bool(
            self.aoti_backend.probed_fallback_kernels(node, self.compile_specs)
        )

    def missing_kernels(self, node: Node) -> frozenset[str]:
        """The fallback kernels ``node`` would need that the target's runtime lacks."""
        if self.fallback_kernels is None or not isinstance(node.target, torch._ops.OpOverload):
            return frozenset()
        needed = self.aoti_backend.needed_fallback_kernels(node, self.compile_specs)
        return frozenset(kernel for kernel in needed if not kernel_allowed(kernel, self.fallback_kernels))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        if self.strict:
            missing: dict[str, list[str]] = defaultdict(list)
            for node in self.candidate_nodes(exported_program.graph_module):
                for kernel in self.missing_kernels(node):
                    missing[kernel].append(node.name)
            if missing:
                raise MissingFallbackKernelsError(self.backend_id, dict(missing))
        return super().partition(exported_program)

    def candidate_nodes(self, graph_module: GraphModule) -> Iterator[Node]:
        """Every ATen node this backend would take but for its kernels, in control-flow bodies too."""
        for node in graph_module.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OperatorBase):
                continue
            if not self.supports_op(target):
                continue
            if isinstance(target, torch._ops.HigherOrderOperator):
                if target.__name__ in self.control_flow:
                    for body in subgraph_modules(node, graph_module):
                        yield from self.candidate_nodes(body)
            else:
                yield node


CONVOLUTIONS = frozenset({
    "aten.convolution", "aten._convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.conv_transpose1d",
    "aten.conv_transpose2d", "aten.conv_transpose3d",
})


def is_convolution_over_data_dependent_sizes(node: Node) -> bool:
    """Whether ``node`` is a convolution Inductor cannot compile: one of 1 or 3 spatial dimensions whose input or
    output has a size read from data. Inductor's lowering asks for its output's strides as numbers (2-D convolutions
    take its channels-last path, which does not)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if not matches_any(node.target, CONVOLUTIONS):
        return False
    weight = node.args[1].meta.get("val") if len(node.args) > 1 and isinstance(node.args[1], Node) else None
    if not isinstance(weight, torch.Tensor) or weight.dim() == 4:  # [out, in, height, width]: 2 spatial dimensions
        return False
    values = [node.meta.get("val"), *(source.meta.get("val") for source in node.all_input_nodes)]
    return any(isinstance(value, torch.Tensor) and free_unbacked_symbols(value) for value in values)


def is_lone_plain_op(partition: Partition, exported_program: ExportedProgram) -> bool:
    """Whether ``partition`` is one compute op, between other engines' delegates, that the plan can call itself.

    A part that writes a mutated buffer's new value stays claimed: run in the plan, the new
    value would be copied into the buffer at every call, where a delegate updates it in place.
    """
    graph = exported_program.graph
    if compute_node_count(partition.nodes) != 1 or not any(is_delegate_call(node) for node in graph.nodes):
        return False
    mutations = set(exported_program.graph_signature.buffers_to_mutate)
    for node in partition.nodes:
        if node.name in mutations or isinstance(node.target, torch._ops.HigherOrderOperator):
            return False
        if isinstance(node.target, torch._ops.OpOverload) and not runs_as_plain_op(op_name(node.target)):
            return False
    return True
