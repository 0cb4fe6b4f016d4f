"""A partition as a standalone ExportedProgram: its nodes, the sizes they read, its inputs, outputs and weights."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
from torch.utils import _pytree as pytree

from ..errors import LoweringError
from .program_parts import (
    constant_placeholders,
    example_tensor,
    is_size_computation,
    mutated_buffer_names,
    program_weights,
    without_outer_guards,
)


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
    # A buffer the partition overwrites without reading its old value (a prompt's convolution state) is its
    # own all the same: an input nothing reads, there for the update to land in.
    owned += [placeholder for placeholder in updated if placeholder not in owned]

    graph = Graph()
    env: dict[Node, Node] = {}
    input_specs = []
    ranges = with_roots_of_derived_sizes(exported.range_constraints)
    stand_ins = compound_size_stand_ins([n.meta["val"] for n in user_inputs], ranges)
    for node in owned + user_inputs:
        placeholder = graph.placeholder(node.name)
        placeholder.meta = copy.copy(node.meta)
        env[node] = placeholder
        # A mutated buffer the partition does not own is fed at run time like a user input; its
        # state stays in the method.
        fqn = constants[node] if node in owned else None
        if fqn is None:
            placeholder.meta["val"] = contiguous_like(node.meta["val"], stand_ins)
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
        range_constraints={**ranges, **stand_in_ranges(stand_ins)},
        module_call_graph=[ModuleCallEntry("", call_signature)],
        example_inputs=(example_inputs, {}),
        constants=sub_constants,
    )
    without_outer_guards(sub_program)
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


def contiguous_like(value: torch.Tensor, stand_ins: Mapping[Any, torch.SymInt] | None = None) -> torch.Tensor:
    """A fake tensor of ``value``'s shape, dtype and device, laid out contiguously.

    A delegate is compiled for contiguous inputs whatever layout the exported graph gave them:
    with a dynamic size, a compiled kernel's strides are expressions of the sizes, and only a
    contiguous layout is one every producer (another engine, a plain ATen op) can be asked for.
    A size ``stand_ins`` maps (by its expression) is replaced by the size it maps to.
    """
    stand_ins = stand_ins or {}
    shape = [
        stand_ins.get(size.node.expr, size) if isinstance(size, torch.SymInt) else size for size in value.shape
    ]
    fake_mode = detect_fake_mode([value])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return torch.empty(shape, dtype=value.dtype, device=value.device)


def stand_in_ranges(stand_ins: Mapping[Any, torch.SymInt]) -> dict[Any, Any]:
    """Each stand-in size's range, as its program's ``range_constraints`` records a size's: what its boundary checks."""
    return {size.node.expr: size.node.shape_env.var_to_range[size.node.expr] for size in stand_ins.values()}


def is_derived_size(expr: Any) -> bool:
    """Whether ``expr`` is ``a * s + b`` of one size ``s`` (integers ``a``, ``b``), as torch.export's derived dims are
    (an image's height, a multiple of 32: ``32 * s``): an engine solves it for ``s`` from the size it is fed."""
    import sympy

    if len(expr.free_symbols) != 1:
        return False
    try:
        polynomial = sympy.Poly(expr, *expr.free_symbols)
    except sympy.PolynomialError:
        return False
    return polynomial.degree() == 1 and all(coefficient.is_Integer for coefficient in polynomial.all_coeffs())


def derived_size_terms(expr: Any) -> tuple[Any, int, int]:
    """``expr``, a derived size ``a * s + b`` (``is_derived_size``), as ``(s, a, b)``."""
    (symbol,) = expr.free_symbols
    return symbol, int(expr.coeff(symbol)), int(expr.subs(symbol, 0))


def with_roots_of_derived_sizes(ranges: Mapping[Any, Any]) -> dict[Any, Any]:
    """``ranges`` (a program's ``range_constraints``) with each size a derived size is a multiple of widened to what
    the derived size's range allows.

    torch.export declares an image side of ``32 * s`` in [32, 2048] and ``s`` in [2, 64]: its shape environment
    takes a dynamic size to be at least 2, even where the multiple declares one step (32 pixels). The program holds
    there (plain AOTInductor runs it, checking the multiple alone), so a part's boundary lets it in too.
    """
    from torch.utils._sympy.value_ranges import ValueRanges

    widened = dict(ranges)
    for expr, bounds in ranges.items():
        if expr.is_Symbol or not is_derived_size(expr):
            continue
        symbol, scale, offset = derived_size_terms(expr)
        own = widened.get(symbol)
        if own is None or scale <= 0 or not bounds.lower.is_Integer:
            continue
        lower = min(own.lower, -(-(int(bounds.lower) - offset) // scale))
        upper = own.upper
        if bounds.upper.is_Integer and own.upper.is_Integer:
            upper = max(own.upper, (int(bounds.upper) - offset) // scale)
        widened[symbol] = ValueRanges(lower, upper)
    return widened


def compound_size_stand_ins(
    inputs: list[torch.Tensor], declared: Mapping[Any, Any] | None = None
) -> dict[Any, torch.SymInt]:
    """For each size of ``inputs`` computed from sizes no input has as a size of its own, a fresh data-dependent one.

    ``batch * length``: tokens flattened for a matmul by one engine and read by another (every
    transformers linear, where an engine declines the matmul); ``u0 + u1``: rows routed to two
    experts, concatenated. An engine reads an input's sizes from the tensor it is fed, and cannot
    solve one product or sum for the sizes in it (AOTInductor asserts it has them), unless the inputs
    have them as sizes or as multiples of sizes, or it is a multiple of one size (``is_derived_size``). Otherwise the
    expression stands as a size of its own (one per distinct expression, so inputs of the same size
    keep sharing it).

    Its range is the expression's over ``declared`` (the method's ``range_constraints``: the sizes its
    inputs may have), at least 0; an engine that plans memory (ExecuTorch) needs its largest, and one
    whose ops ask whether a size is empty (XNNPACK's) a smallest above 0 where the sizes allow it.
    """
    from torch.utils._sympy.value_ranges import bound_sympy

    sizes = [size.node.expr for value in inputs for size in value.shape if isinstance(size, torch.SymInt)]
    # The sizes an engine reads off its inputs: each that is a size, or a multiple of one (Swin's windows, of an image
    # whose sides are multiples of 8, are ``4*s0*s1*s2``, and the image gives s1 and s2).
    read = {symbol for expr in sizes if expr.is_Symbol or is_derived_size(expr) for symbol in expr.free_symbols}
    fake_mode = detect_fake_mode(inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    stand_ins: dict[Any, torch.SymInt] = {}
    # Over the declared ranges, not the shape environment's: it takes a dynamic size to be at least 2, where an input
    # may be 1 or 0.
    known = {**(shape_env.var_to_range if shape_env is not None else {}), **(declared or {})}
    for expr in dict.fromkeys(sizes):
        if shape_env is None or expr.is_Symbol or expr.free_symbols <= read or is_derived_size(expr):
            continue
        # An input's size is bound by the tensor fed, not computed by an op of the partition.
        with shape_env.ignore_fresh_unbacked_symbols():
            stand_in = shape_env.create_unbacked_symint()
        reach = bound_sympy(expr, {symbol: known[symbol] for symbol in expr.free_symbols if symbol in known})
        torch._check(stand_in >= (1 if reach.lower.is_Integer and reach.lower >= 1 else 0))
        if reach.upper.is_Integer:  # torch's int_oo is not
            torch._check(stand_in <= int(reach.upper))
        stand_ins[expr] = stand_in
    return stand_ins
