"""``AotiPartitioner``: claims what an AOTInductor backend can run, in maximal convex parts."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ...delegate_op import is_delegate_call, is_delegate_output
from ...partitioner import (
    DELEGATION_TAG,
    Partitioner,
    tag_constant_data,
    tag_mutated_buffer,
)
from ...specs import CompileSpec, DelegationSpec, PartitionResult
from .backend import AotiBackend

OpName = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket


class AotiOperatorSupport(OperatorSupportBase):
    """Supports ATen call_function nodes the backend can take, minus the excluded ops."""

    def __init__(self, backend: AotiBackend, excluded: frozenset[str]) -> None:
        self.excluded = excluded
        self.fallback_kernels = backend.supported_fallback_kernels()

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: Node) -> bool:
        if node.op != "call_function" or is_delegate_call(node) or is_delegate_output(node):
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, Node) and self.is_node_supported(submodules, source)
        if not isinstance(node.target, torch._ops.OpOverload):
            return False
        if node.target.namespace not in ("aten", "prims"):
            return False
        return not ({op_name(node.target), packet_name(node.target)} & self.excluded)


class AotiPartitioner(Partitioner):
    """Base of the AOTInductor partitioners; a subclass names its backend.

    ``exclude_ops`` lists ops to leave to plain ATen, as ``"aten.relu"`` (every overload),
    ``"aten.relu.default"`` or the op object itself.
    """

    backend: ClassVar[type[AotiBackend]]

    def __init__(
        self,
        exclude_ops: Iterable[OpName] = (),
        compile_specs: Iterable[CompileSpec] = (),
    ) -> None:
        self.exclude_ops = frozenset(normalized_op_name(op) for op in exclude_ops)
        self.compile_specs = list(compile_specs)

    def delegation_spec(self) -> DelegationSpec:
        specs = list(self.compile_specs)
        if not any(spec.key == "target_device" for spec in specs):
            specs.insert(0, CompileSpec("target_device", self.backend.device_name.encode()))
        return DelegationSpec(self.backend.backend_id, specs)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        support = AotiOperatorSupport(self.backend(), self.exclude_ops)
        partitions = CapabilityBasedPartitioner(
            exported_program.graph_module, support, allows_single_node_partition=True
        ).propose_partitions()
        tags: dict[str, DelegationSpec] = {}
        for index, partition in enumerate(sorted(partitions, key=first_node_position(exported_program))):
            tag = f"{self.backend.backend_id}_{index}"
            for node in partition.nodes:
                node.meta[DELEGATION_TAG] = tag
            tags[tag] = self.delegation_spec()
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, tags)


def first_node_position(exported_program: ExportedProgram):
    position = {node: index for index, node in enumerate(exported_program.graph.nodes)}
    return lambda partition: min(position[node] for node in partition.nodes)


def op_name(op: torch._ops.OpOverload) -> str:
    """``aten.relu.default``."""
    return f"{op.namespace}.{op._opname}.{op._overloadname}"


def packet_name(op: torch._ops.OpOverload) -> str:
    """``aten.relu``."""
    return f"{op.namespace}.{op._opname}"


def normalized_op_name(op: OpName) -> str:
    """The name an excluded op is matched by; an unknown name raises ``ValueError``."""
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}"
    if not isinstance(op, str):
        raise TypeError(f"exclude_ops takes op names or op objects, got {op!r}")
    name = op.removeprefix("torch.ops.")
    if "." not in name:
        name = f"aten.{name}"
    parts = name.split(".")
    if len(parts) not in (2, 3) or not resolves_to_op(parts):
        raise ValueError(
            f"unknown op {op!r} in exclude_ops; expected a name like 'aten.relu' or 'aten.relu.default'"
        )
    return name


def resolves_to_op(parts: list[str]) -> bool:
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 3:
            getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        return False
    return True
