"""Lowering: partition each method, compile each tagged part, splice in delegate calls."""

from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import operator
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.utils.fuser_utils import validate_partition
from torch.utils import _pytree as pytree

from .backend import backend_class
from .delegate_op import call_delegate, is_delegate_call
from .devices import propagate_device_pass
from .errors import LoweringError, MissingFallbackKernelsError
from .export import Program
from .op_names import op_name
from .partitioner import (
    DELEGATION_TAG,
    Partitioner,
    constant_placeholders,
    is_size_computation,
    mutated_buffer_names,
    program_weights,
)
from .specs import CompileSpec, DelegationSpec, compile_spec_value
from .tensor_data import WEIGHT_PREFIX, dtype_name


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of a tensor crossing a boundary; None for a dynamic dimension."""

    dtype: str
    shape: list[int | None]

    @classmethod
    def of(cls, value: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(value.dtype), [d if isinstance(d, int) else None for d in value.shape])


@dataclass
class Delegate:
    """One compiled partition, as a delegate call in a lowered method."""

    delegate_id: str
    backend_id: str
    compile_specs: list[CompileSpec]
    ops: list[str]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    processed_bytes: bytes
    named_data: dict[str, bytes] = field(repr=False)
    # Buffers the delegate updates in place (their state is its named data ``weight:<fqn>``).
    updated_buffers: list[str] = field(default_factory=list)

    @property
    def target_device(self) -> str:
        value = compile_spec_value(self.compile_specs, "target_device")
        return value.decode() if value else "cpu"


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
        from .package import save

        save(self, path)


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
    compile_specs = [s for s in spec.compile_specs if s.key != "method_name"]
    compile_specs.append(CompileSpec("method_name", method.encode()))
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


def drop_buffer_mutations(exported: ExportedProgram, fqns: Collection[str]) -> None:
    """Take the updates of ``fqns`` out of the method: a delegate now makes them in place."""
    if not fqns:
        return
    output_node = exported.graph.output_node()
    specs = exported.graph_signature.output_specs
    kept = [
        index
        for index, spec in enumerate(specs)
        if not (spec.kind == OutputKind.BUFFER_MUTATION and spec.target in fqns)
    ]
    values = output_node.args[0]
    output_node.args = (tuple(values[index] for index in kept),)
    specs[:] = [specs[index] for index in kept]


def drop_unused_subgraphs(graph_module: GraphModule) -> None:
    """Remove the branches and bodies a delegate took with it."""
    for node in list(graph_module.graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.delete_all_unused_submodules()


@dataclass
class PartitionProgram:
    """One partition as a standalone program, and how it connects to the method around it."""

    program: ExportedProgram
    # Outer nodes that feed it at run time, in its input order.
    inputs: list[Node]
    # Outer nodes it produces for the method, in its output order.
    outputs: list[Node]
    # FQNs of the buffers it updates in place: they are its own state, not inputs or outputs.
    updated_buffers: list[str]


def partition_program(
    exported: ExportedProgram, nodes: list[Node], *, in_place: Callable[[torch.Tensor], bool] = lambda buffer: False
) -> PartitionProgram:
    """A standalone ExportedProgram for ``nodes``, with the weights they read.

    A buffer the method updates that only this partition reads, and whose new value only the
    update uses, becomes the partition's own mutable buffer where ``in_place(buffer)`` says so.
    """
    body = with_size_computations(exported.graph, nodes)
    members = set(body)
    operands = list(dict.fromkeys(arg for n in body for arg in n.all_input_nodes if arg not in members))
    # Branches and loop bodies travel with their control-flow op; they are code, not inputs.
    subgraphs = [n for n in operands if n.op == "get_attr"]
    inputs = [n for n in operands if n.op != "get_attr"]
    claimed = set(nodes)
    candidates = buffers_updated_only_by(exported, claimed, members)
    weights = program_weights(exported) if candidates else {}
    updated = {placeholder: update for placeholder, update in candidates.items() if in_place(weights[update[0]])}
    producers = {producer for _, producer in updated.values()}
    outputs = [n for n in nodes if n not in producers and any(user not in claimed for user in n.users)]
    for node in inputs:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            reader = next(user for user in node.users if user in members)
            raise LoweringError(
                f"node {reader.name!r} reads {node.name!r}, a {type(node.meta.get('val')).__name__}, from outside "
                "its partition; a delegate takes tensors only, so leave that node to plain ATen"
            )
    for node in outputs:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise LoweringError(
                f"node {node.name!r} gives a {type(node.meta.get('val')).__name__} to nodes outside its partition; "
                "a delegate returns tensors only"
            )

    constants = constant_placeholders(exported)
    mutated = mutated_buffer_names(exported)
    owned = [n for n in inputs if n in constants and (n.name not in mutated or n in updated)]
    user_inputs = [n for n in inputs if n not in owned]

    graph = Graph()
    env: dict[Node, Node] = {}
    input_specs = []
    for node in owned + user_inputs:
        placeholder = graph.placeholder(node.name)
        placeholder.meta = copy.copy(node.meta)
        env[node] = placeholder
        # A mutated buffer the partition does not own is fed at run time like a user input; its
        # state stays in the method.
        fqn = constants[node] if node in owned else None
        if fqn is None:
            placeholder.meta["val"] = contiguous_like(node.meta["val"])
        input_specs.append(input_spec_for(exported, node, placeholder.name, fqn))
    for node in subgraphs + body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    # An ExportedProgram lists buffer updates before user outputs.
    graph.output(tuple(env[producer] for _, producer in updated.values()) + tuple(env[n] for n in outputs))
    views_as_reshapes(graph)

    module = GraphModule(exported.graph_module, graph)
    kinds = {spec.arg.name: spec for spec in exported.graph_signature.input_specs}
    state_dict = {}
    sub_constants = {}
    for node in owned:
        fqn = constants[node]
        # Lifted constants and non-persistent buffers live in ``constants``, not the state dict.
        if fqn in exported.state_dict and kinds[node.name].kind != InputKind.CONSTANT_TENSOR:
            state_dict[fqn] = exported.state_dict[fqn]
        else:
            sub_constants[fqn] = exported.constants[fqn]
    signature = ExportGraphSignature(
        input_specs=input_specs,
        output_specs=[
            OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(env[producer].name), fqn)
            for fqn, producer in updated.values()
        ]
        + [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[n].name), None) for n in outputs],
    )
    example_inputs = tuple(example_tensor(n.meta["val"]) for n in user_inputs)
    call_signature = ModuleCallSignature(
        inputs=[],
        outputs=[],
        in_spec=pytree.tree_flatten((example_inputs, {}))[1],
        out_spec=pytree.tree_flatten(tuple(range(len(outputs))))[1],
    )
    sub_program = ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints=copy.copy(exported.range_constraints),
        module_call_graph=[ModuleCallEntry("", call_signature)],
        example_inputs=(example_inputs, {}),
        constants=sub_constants,
    )
    return PartitionProgram(sub_program, user_inputs, outputs, [fqn for fqn, _ in updated.values()])


def buffers_updated_only_by(
    exported: ExportedProgram, claimed: set[Node], members: set[Node]
) -> dict[Node, tuple[str, Node]]:
    """Buffer placeholder -> (FQN, node computing its new value), for the updates a partition can own.

    Only where nothing outside the partition reads the buffer or its new value: an update made
    in place is then seen by no one who expected the old value.
    """
    graph = exported.graph
    by_name = {node.name: node for node in graph.nodes}
    output_node = graph.output_node()
    returned = [value for value in output_node.args[0] if isinstance(value, Node)]
    placeholder_of = {
        spec.target: spec.arg.name for spec in exported.graph_signature.input_specs if spec.kind == InputKind.BUFFER
    }
    updated = {}
    for value_name, fqn in exported.graph_signature.buffers_to_mutate.items():
        producer = by_name.get(value_name)
        placeholder = by_name.get(placeholder_of.get(fqn, ""))
        if (
            producer in claimed
            and placeholder is not None
            and all(user in members for user in placeholder.users)
            and all(user in members or user is output_node for user in producer.users)
            and returned.count(producer) == 1
        ):
            updated[placeholder] = (fqn, producer)
    return updated


def with_size_computations(graph: Graph, nodes: list[Node]) -> list[Node]:
    """``nodes`` and the size computations they read, in graph order.

    A delegate takes tensors only; with dynamic shapes, a partition reads sizes (``sym_size``
    and arithmetic on it) that the method computes. The partition recomputes them from the
    tensors they come from, which become its inputs instead.
    """
    members = set(nodes)
    pending = [arg for node in nodes for arg in node.all_input_nodes]
    while pending:
        node = pending.pop()
        if node not in members and is_size_computation(node):
            members.add(node)
            pending.extend(node.all_input_nodes)
    return [node for node in graph.nodes if node in members]


def views_as_reshapes(graph: Graph) -> None:
    """Turn each ``view`` into ``reshape``: a view wherever the layout allows it, a copy elsewhere.

    An exported ``view`` is valid for the layout its input had at export. A backend traces the
    partition again and may pick another kernel whose output has another layout (attention's
    output, transposed and flattened, is the common case), where the ``view`` would fail. A
    partition is functional, so nothing can tell whether the result aliases its input.
    """
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def input_spec_for(exported: ExportedProgram, node: Node, name: str, fqn: str | None) -> InputSpec:
    """The spec of partition input ``name``, fed by outer ``node`` (a weight when ``fqn`` is set)."""
    if fqn is None:
        return InputSpec(InputKind.USER_INPUT, TensorArgument(name), None)
    outer = next(s for s in exported.graph_signature.input_specs if s.arg.name == node.name)
    return InputSpec(outer.kind, TensorArgument(name), fqn, outer.persistent)


def contiguous_like(value: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``value``'s shape, dtype and device, laid out contiguously.

    A delegate is compiled for contiguous inputs whatever layout the exported graph gave them:
    with a dynamic size, a compiled kernel's strides are expressions of the sizes, and only a
    contiguous layout is one every producer (another engine, a plain ATen op) can be asked for.
    """
    fake_mode = detect_fake_mode([value])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)


def example_tensor(value: torch.Tensor) -> torch.Tensor:
    """A real, contiguous tensor shaped like a fake one (size hints stand in for dynamic dimensions)."""
    shape = [int(d) if isinstance(d, int) else d.node.hint for d in value.shape]
    return torch.zeros(shape, dtype=value.dtype)


def splice_delegate_call(
    graph: Graph, nodes: list[Node], delegate_id: str, inputs: list[Node], outputs: list[Node]
) -> None:
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(call_delegate, (delegate_id, inputs))
    call.meta["val"] = [n.meta["val"] for n in outputs]
    previous = call
    for index, node in enumerate(outputs):
        with graph.inserting_after(previous):
            item = graph.call_function(operator.getitem, (call, index))
        item.meta = {"val": node.meta["val"]}
        node.replace_all_uses_with(item)
        previous = item
    for node in reversed(nodes):
        graph.erase_node(node)
    restore_topological_order(graph)


def restore_topological_order(graph: Graph) -> None:
    """Move nodes, in place and keeping their names, so each follows its inputs.

    The delegate call sits where its partition's last node was; an op outside the partition
    that read an earlier output must now move after it. The order is otherwise kept.
    """
    position = {node: index for index, node in enumerate(graph.nodes)}
    waiting = {node: len(node.all_input_nodes) for node in graph.nodes}
    ready = [(position[node], node) for node, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (position[user], user))
    first = next(iter(graph.nodes))
    if order[0] is not first:
        first.prepend(order[0])
    for previous, node in zip(order, order[1:]):
        if previous.next is not node:
            previous.append(node)


def drop_unused_size_computations(graph: Graph) -> None:
    """Remove the sizes only delegates read: each delegate now computes its own."""
    for node in reversed(list(graph.nodes)):
        if is_size_computation(node) and not node.users:
            graph.erase_node(node)


def clear_tags(graph: Graph) -> None:
    for node in graph.nodes:
        node.meta.pop(DELEGATION_TAG, None)


def without_unused_constants(exported: ExportedProgram, read_before: set[str]) -> ExportedProgram:
    """The program minus the weights that delegates took and nothing else reads.

    Weights unused from the start are kept: they are part of the model's state.
    """
    graph = exported.graph
    gone = {
        node.name
        for node in constant_placeholders(exported)
        if not node.users and node.name in read_before
    }
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in gone:
            graph.erase_node(node)
    exported.graph_module.recompile()
    signature = ExportGraphSignature(
        input_specs=[s for s in exported.graph_signature.input_specs if s.arg.name not in gone],
        output_specs=renamed_output_specs(exported),
    )
    kept_targets = {s.target for s in signature.input_specs}
    return ExportedProgram(
        root=exported.graph_module,
        graph=graph,
        graph_signature=signature,
        state_dict={k: v for k, v in exported.state_dict.items() if k in kept_targets},
        range_constraints=exported.range_constraints,
        module_call_graph=exported.module_call_graph,
        example_inputs=exported.example_inputs,
        constants={k: v for k, v in exported.constants.items() if k in kept_targets},
    )


def renamed_output_specs(exported: ExportedProgram) -> list[OutputSpec]:
    """Output specs naming the nodes the output now reads (a getitem where a delegate took over)."""
    output_node = exported.graph.output_node()
    specs = []
    for spec, value in zip(exported.graph_signature.output_specs, output_node.args[0]):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, Node):
            spec = OutputSpec(spec.kind, TensorArgument(value.name), spec.target)
        specs.append(spec)
    return specs
