"""Lowering: partition each method, compile each tagged part, splice in delegate calls."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx.passes.utils.fuser_utils import validate_partition

from ..backends.base import backend_class
from ..errors import LoweringError, MissingFallbackKernelsError
from ..format.op_names import op_name
from ..format.ops import is_delegate_call
from ..format.records import Delegate, TensorSpec
from ..format.specs import CompileSpec, DelegationSpec, SpecKey
from ..format.tensor_data import WEIGHT_PREFIX
from .constants import without_unused_constants
from .devices import propagate_device_pass
from .export import Program
from .package import save
from .partitioner import DELEGATION_TAG, Partitioner
from .program_parts import constant_placeholders
from .splice import (
    clear_tags,
    drop_buffer_mutations,
    drop_unused_size_computations,
    drop_unused_subgraphs,
    splice_delegate_call,
)
from .subprogram import partition_program


@dataclass
class LoweredProgram:
    """Every method lowered, with the delegates their graphs call."""

    methods: dict[str, ExportedProgram]
    delegate_table: dict[str, list[Delegate]]

    def delegates(self, method: str) -> list[Delegate]:
        """The delegates of ``method``, in lowering order: partitioner by partitioner, each in graph order."""
        if method not in self.delegate_table:
            raise LoweringError(f"no method {method!r}; methods: {sorted(self.delegate_table)}")
        return list(self.delegate_table[method])

    def save(self, path: str) -> None:
        """Write every method, compiled part and weight into one ``.pt2`` file."""
        save(self.methods, self.delegate_table, path)


logger = logging.getLogger("aotstack")

PartitionerPlan = Sequence[Partitioner] | Mapping[str, Sequence[Partitioner]]


MethodOption = bool | Collection[str]


def lower(
    program: Program,
    partitioners: PartitionerPlan,
    *,
    skip_h2d_for_method_inputs: MethodOption = False,
    skip_d2h_for_method_outputs: MethodOption = False,
) -> LoweredProgram:
    """Apply ``partitioners``, in order, to every method and compile what they claim.

    Then every boundary tensor is given a device, with host-device copies where a delegate runs
    elsewhere. The two ``skip_*`` options (True, or the names of the methods they apply to) keep
    a method's inputs or outputs on the device instead of copying them.

    Example::

        lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
        lowered.save("model.pt2")
    """
    plan = partitioners_by_method(program, partitioners)
    methods: dict[str, ExportedProgram] = {}
    table: dict[str, list[Delegate]] = {}
    for name, exported in program.methods.items():
        lowered, delegates = lower_method(name, exported, plan[name])
        propagate_device_pass(
            lowered,
            {d.delegate_id: (d.backend_id, d.target_device) for d in delegates},
            skip_h2d_for_method_inputs=applies_to(skip_h2d_for_method_inputs, name),
            skip_d2h_for_method_outputs=applies_to(skip_d2h_for_method_outputs, name),
        )
        # Rebuilt so the output specs name the copies that now feed the output.
        methods[name], table[name] = without_unused_constants(lowered, set()), delegates
    return LoweredProgram(methods, table)


def applies_to(option: MethodOption, method: str) -> bool:
    return option if isinstance(option, bool) else method in option


def partitioners_by_method(program: Program, partitioners: PartitionerPlan) -> dict[str, list[Partitioner]]:
    if isinstance(partitioners, Mapping):
        unknown = set(partitioners) - set(program.methods)
        if unknown:
            raise LoweringError(
                f"partitioners given for unknown methods {sorted(unknown)}; methods: {sorted(program.methods)}"
            )
        plan = {name: list(partitioners.get(name, ())) for name in program.methods}
    else:
        plan = {name: list(partitioners) for name in program.methods}
    for name, listed in plan.items():
        for partitioner in listed:
            if not isinstance(partitioner, Partitioner):
                raise LoweringError(
                    f"method {name!r}: expected a Partitioner, got {type(partitioner).__name__}"
                )
    return plan


def lower_method(
    name: str, exported: ExportedProgram, partitioners: list[Partitioner]
) -> tuple[ExportedProgram, list[Delegate]]:
    working = copied_program(exported)
    read_before = {node.name for node in constant_placeholders(working) if node.users}
    delegates: list[Delegate] = []
    # Ids stay unique even in a graph that already calls delegates.
    first_id = sum(1 for node in working.graph.nodes if is_delegate_call(node))
    for partitioner in partitioners:
        try:
            result = partitioner.partition(working)
        except MissingFallbackKernelsError as exc:
            raise exc.in_method(name) from None
        working = result.tagged_exported_program
        for tag, spec in result.partition_tags.items():
            delegate_id = f"{name}.{first_id + len(delegates)}"
            delegates.append(delegate_partition(working, name, tag, spec, delegate_id))
        clear_tags(working.graph)
        drop_unused_size_computations(working.graph)
        working = without_unused_constants(working, read_before)
    return working, delegates


def copied_program(exported: ExportedProgram) -> ExportedProgram:
    """A deep copy whose node names still match its signature.

    Deep-copying an ExportedProgram renames a placeholder that shadows a builtin (``input``
    becomes ``input_1``) but not its signature entry; the original names are put back.
    """
    with warnings.catch_warnings():
        # torch's TreeSpec warns about its own deprecated LeafSpec while being deep-copied.
        warnings.simplefilter("ignore", FutureWarning)
        working = copy.deepcopy(exported)
    for original, copied in zip(exported.graph.nodes, working.graph.nodes, strict=True):
        copied.name = original.name
    return working


def delegate_partition(
    exported: ExportedProgram, method: str, tag: str, spec: DelegationSpec, delegate_id: str
) -> Delegate:
    """Compile the nodes tagged ``tag`` and put one delegate call in their place."""
    graph = exported.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.meta.get(DELEGATION_TAG) == tag]
    if not nodes:
        raise LoweringError(f"method {method!r}: partition {tag!r} tags no call_function node")
    if not validate_partition(nodes):
        raise LoweringError(
            f"method {method!r}: partition {tag!r} is not convex (it would create a dependency cycle)"
        )
    backend = backend_class(spec.backend_id)()
    compile_specs = [s for s in spec.compile_specs if s.key != SpecKey.METHOD_NAME]
    compile_specs.append(CompileSpec(SpecKey.METHOD_NAME, method.encode()))
    try:
        part = partition_program(
            exported, nodes, in_place=lambda buffer: backend.updates_in_place(buffer, compile_specs)
        )
    except LoweringError as exc:
        raise LoweringError(f"method {method!r}, partition {tag!r} ({spec.backend_id}): {exc}") from None
    logger.info("%s: compiling delegate %s (%s, %d nodes) ...", method, delegate_id, spec.backend_id, len(nodes))
    started = time.perf_counter()
    result = backend.preprocess(part.program, compile_specs)
    logger.info("%s: delegate %s ready in %.1f s", method, delegate_id, time.perf_counter() - started)
    for fqn in part.updated_buffers:
        if WEIGHT_PREFIX + fqn not in result.named_data:
            raise LoweringError(
                f"method {method!r}: {spec.backend_id} updates buffer {fqn!r} in place but stores no named data "
                f"{WEIGHT_PREFIX + fqn!r} for it"
            )
    drop_buffer_mutations(exported, part.updated_buffers)
    splice_delegate_call(graph, nodes, delegate_id, part.inputs, part.outputs)
    drop_unused_subgraphs(exported.graph_module)
    return Delegate(
        delegate_id=delegate_id,
        backend_id=spec.backend_id,
        compile_specs=compile_specs,
        ops=sorted({op_name(n.target) for n in nodes if isinstance(n.target, torch._ops.OperatorBase)}),
        inputs=[TensorSpec.of(n.meta["val"]) for n in part.inputs],
        outputs=[TensorSpec.of(n.meta["val"]) for n in part.outputs],
        processed_bytes=result.processed_bytes,
        named_data=dict(result.named_data),
        updated_buffers=list(part.updated_buffers),
    )


