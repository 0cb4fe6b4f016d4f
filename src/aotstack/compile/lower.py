"""Lowering: partition each method, compile each tagged part, splice in delegate calls."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch.export import ExportedProgram
from torch.fx.passes.utils.fuser_utils import validate_partition

from ..backends.base import backend_class
from ..errors import CompileSpecError, LoweringError, MissingFallbackKernelsError
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


@dataclass(frozen=True)
class CompileFailure:
    """A partition whose compile failed and that ``on_compile_error="fallback"`` left undelegated.

    Its nodes stayed in the method for the partitioners after the one that claimed it, and
    otherwise run as plain ATen ops; this record is how a caller learns the method got slower.
    """

    method: str
    backend_id: str
    # The partitioner's tag for the partition, e.g. ``aoti_cpu_0``.
    partition: str
    # Op names such as ``aten.relu.default``, sorted, each once.
    ops: tuple[str, ...]
    # ``RuntimeError: ...``: the exception the backend's ``preprocess`` raised.
    error: str


@dataclass
class LoweredProgram:
    """Every method lowered, with the delegates their graphs call.

    ``compile_failures`` lists, per method, the partitions left to plain ATen because their
    compile failed under ``on_compile_error="fallback"`` (an empty list where none did).
    """

    methods: dict[str, ExportedProgram]
    delegate_table: dict[str, list[Delegate]]
    compile_failures: dict[str, list[CompileFailure]] = field(default_factory=dict)

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

OnCompileError = Literal["raise", "fallback"]
ON_COMPILE_ERROR: tuple[str, ...] = get_args(OnCompileError)

# How many op names an error message lists before it says how many more there are.
OPS_IN_MESSAGE = 8


def lower(
    program: Program,
    partitioners: PartitionerPlan,
    *,
    skip_h2d_for_method_inputs: MethodOption = False,
    skip_d2h_for_method_outputs: MethodOption = False,
    on_compile_error: OnCompileError = "raise",
) -> LoweredProgram:
    """Apply ``partitioners``, in order, to every method and compile what they claim.

    Then every boundary tensor is given a device, with host-device copies where a delegate runs
    elsewhere. The two ``skip_*`` options (True, or the names of the methods they apply to) keep
    a method's inputs or outputs on the device instead of copying them.

    When a backend fails to compile a partition, ``on_compile_error="raise"`` (the default)
    raises ``LoweringError`` naming the method, the partition and its ops. ``"fallback"`` leaves
    that partition's nodes in the method instead, for the later partitioners or plain ATen, logs
    a warning and records it in ``LoweredProgram.compile_failures``: one unsupported corner of a
    model then costs speed, not the whole package.

    Example::

        lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
        lowered.save("model.pt2")
    """
    check_lower_options(skip_h2d_for_method_inputs, skip_d2h_for_method_outputs, on_compile_error)
    plan = partitioners_by_method(program, partitioners)
    methods: dict[str, ExportedProgram] = {}
    table: dict[str, list[Delegate]] = {}
    failures: dict[str, list[CompileFailure]] = {}
    for name, exported in program.methods.items():
        lowered, delegates, failures[name] = lower_method(name, exported, plan[name], on_compile_error)
        propagate_device_pass(
            lowered,
            {d.delegate_id: (d.backend_id, d.target_device) for d in delegates},
            skip_h2d_for_method_inputs=applies_to(skip_h2d_for_method_inputs, name),
            skip_d2h_for_method_outputs=applies_to(skip_d2h_for_method_outputs, name),
        )
        # Rebuilt so the output specs name the copies that now feed the output.
        methods[name], table[name] = without_unused_constants(lowered, set()), delegates
    return LoweredProgram(methods, table, failures)


def check_lower_options(skip_h2d: object, skip_d2h: object, on_compile_error: object) -> None:
    """Refuse a bad option before any compile starts, rather than after minutes of compiling."""
    if not isinstance(on_compile_error, str) or on_compile_error not in ON_COMPILE_ERROR:
        raise ValueError(
            f"on_compile_error must be one of {', '.join(map(repr, ON_COMPILE_ERROR))}, got {on_compile_error!r}"
        )
    for option, value in (("skip_h2d_for_method_inputs", skip_h2d), ("skip_d2h_for_method_outputs", skip_d2h)):
        # A bare str is a Collection[str] too, and would match its own substrings as method names.
        if isinstance(value, bool):
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Collection) or not all(
            isinstance(name, str) for name in value
        ):
            raise TypeError(
                f"{option} must be a bool or a collection of method names, got {type(value).__name__} {value!r}"
            )


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
    name: str, exported: ExportedProgram, partitioners: list[Partitioner], on_compile_error: OnCompileError = "raise"
) -> tuple[ExportedProgram, list[Delegate], list[CompileFailure]]:
    """Lower one method: its graph, its delegates in order, and the partitions left to plain ATen."""
    working = copied_program(exported)
    read_before = {node.name for node in constant_placeholders(working) if node.users}
    delegates: list[Delegate] = []
    failures: list[CompileFailure] = []
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
            outcome = delegate_partition(working, name, tag, spec, delegate_id, on_compile_error)
            if isinstance(outcome, CompileFailure):
                failures.append(outcome)
            else:
                delegates.append(outcome)
        # Also untags a failed partition's nodes, so the next partitioner may claim them.
        clear_tags(working.graph)
        drop_unused_size_computations(working.graph)
        working = without_unused_constants(working, read_before)
    return working, delegates, failures


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
    exported: ExportedProgram,
    method: str,
    tag: str,
    spec: DelegationSpec,
    delegate_id: str,
    on_compile_error: OnCompileError = "raise",
) -> Delegate | CompileFailure:
    """Compile the nodes tagged ``tag`` and put one delegate call in their place.

    A partition that is malformed (empty, not convex, not expressible as a program) is the
    partitioner's mistake and always raises. A failure of the backend's compile raises, or with
    ``on_compile_error="fallback"`` leaves the graph as it was and returns a ``CompileFailure``.
    """
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
    ops = partition_ops(nodes)
    logger.info("%s: compiling delegate %s (%s, %d nodes) ...", method, delegate_id, spec.backend_id, len(nodes))
    started = time.perf_counter()
    # Nothing above changed the method's graph, so a failure here can leave it as it is.
    try:
        result = backend.preprocess(part.program, compile_specs)
        for fqn in part.updated_buffers:
            if WEIGHT_PREFIX + fqn not in result.named_data:
                raise LoweringError(
                    f"{spec.backend_id} updates buffer {fqn!r} in place but stores no named data "
                    f"{WEIGHT_PREFIX + fqn!r} for it"
                )
    except Exception as exc:
        if on_compile_error == "fallback":
            return compile_failure(method, tag, spec.backend_id, ops, exc)
        error = compile_error(method, tag, spec.backend_id, delegate_id, ops, exc)
        if error is exc:
            raise
        raise error from exc
    logger.info("%s: delegate %s ready in %.1f s", method, delegate_id, time.perf_counter() - started)
    drop_buffer_mutations(exported, part.updated_buffers)
    splice_delegate_call(graph, nodes, delegate_id, part.inputs, part.outputs)
    drop_unused_subgraphs(exported.graph_module)
    return Delegate(
        delegate_id=delegate_id,
        backend_id=spec.backend_id,
        compile_specs=compile_specs,
        ops=list(ops),
        inputs=[TensorSpec.of(n.meta["val"]) for n in part.inputs],
        outputs=[TensorSpec.of(n.meta["val"]) for n in part.outputs],
        processed_bytes=result.processed_bytes,
        named_data=dict(result.named_data),
        updated_buffers=list(part.updated_buffers),
    )


def partition_ops(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    """The op names the nodes call, sorted, each once (getitems and other Python callables left out)."""
    return tuple(sorted({op_name(n.target) for n in nodes if isinstance(n.target, torch._ops.OperatorBase)}))


def ops_text(ops: Sequence[str]) -> str:
    """``aten.add.Tensor, aten.relu.default``, cut short for a partition of many ops."""
    shown = ", ".join(ops[:OPS_IN_MESSAGE]) or "none"
    return shown if len(ops) <= OPS_IN_MESSAGE else f"{shown} and {len(ops) - OPS_IN_MESSAGE} more"


def compile_error(
    method: str, tag: str, backend_id: str, delegate_id: str, ops: Sequence[str], exc: Exception
) -> LoweringError:
    """The error to raise for a failed compile: where it failed, then why.

    ``MissingFallbackKernelsError`` keeps its type and fields, which callers read, and names
    the method already; a ``CompileSpecError`` stays one, so it remains a ``ValueError`` too.
    """
    if isinstance(exc, MissingFallbackKernelsError):
        return exc if exc.method else exc.in_method(method)
    error_type = CompileSpecError if isinstance(exc, CompileSpecError) else LoweringError
    return error_type(
        f"method {method!r}, partition {tag!r} ({backend_id}, delegate {delegate_id}) failed to compile "
        f"(ops: {ops_text(ops)}): {type(exc).__name__}: {exc}\n"
        "lower(..., on_compile_error='fallback') would leave this partition to the next partitioner or plain ATen"
    )


def compile_failure(method: str, tag: str, backend_id: str, ops: tuple[str, ...], exc: Exception) -> CompileFailure:
    """Record, and warn of, a partition left to plain ATen because its compile failed."""
    failure = CompileFailure(method, backend_id, tag, ops, f"{type(exc).__name__}: {exc}")
    logger.warning(
        "%s: %s failed to compile partition %r (ops: %s); its nodes stay in the method for the next partitioner "
        "or plain ATen: %s",
        method, backend_id, tag, ops_text(ops), failure.error,
    )
    return failure
