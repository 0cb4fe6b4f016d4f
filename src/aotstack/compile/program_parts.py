"""What an exported program holds: its weights, its constant and mutated placeholders, sizes and subgraphs."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
from ..format.boundary import Boundary, BoundaryInput
from ..format.plan import FUNCTIONALIZED_OPS
from ..format.tensor_data import content_key, dtype_name, tensor_buffer

_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def subgraph_nodes(node: Node) -> list[Node]:
    """The get_attr nodes among ``node``'s operands: the branches and bodies of a control-flow op."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [leaf for leaf in leaves if isinstance(leaf, Node) and leaf.op == "get_attr"]


def subgraph_modules(node: Node, owner: GraphModule) -> list[GraphModule]:
    modules = [getattr(owner, attr.target) for attr in subgraph_nodes(node)]
    return [module for module in modules if isinstance(module, GraphModule)]


def called_ops(node: Node) -> list[torch._ops.OperatorBase]:
    """The ops ``node`` calls: its target, and the op a functionalized call (``auto_functionalized``) wraps."""
    target = node.target
    if not isinstance(target, torch._ops.OperatorBase):
        return []
    if functionalized_call(node):
        return [target, node.args[0]]
    return [target]


def functionalized_call(node: Node) -> bool:
    """Whether ``node`` calls ``auto_functionalized``, which runs the op it is given on copies of its inputs."""
    return (
        isinstance(node.target, torch._ops.HigherOrderOperator)
        and node.target.__name__ in FUNCTIONALIZED_OPS
        and bool(node.args)
        and isinstance(node.args[0], torch._ops.OpOverload)
    )


def is_size_computation(node: Node) -> bool:
    """Whether ``node`` computes a size or another scalar (``sym_size``, arithmetic on sizes), not a tensor."""
    return node.op == "call_function" and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    )


def node_tensors(node: Node) -> Iterator[torch.Tensor]:
    """The example tensors ``node`` reads and produces."""
    values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
    return (leaf for leaf in pytree.tree_leaves(values) if isinstance(leaf, torch.Tensor))


def constant_placeholders(exported_program: ExportedProgram) -> dict[Node, str]:
    """Placeholders holding parameters, buffers and lifted constants, with their FQNs."""
    targets = {
        spec.arg.name: spec.target
        for spec in exported_program.graph_signature.input_specs
        if spec.kind in _CONSTANT_KINDS and spec.target is not None
    }
    return {
        node: targets[node.name]
        for node in exported_program.graph.nodes
        if node.op == "placeholder" and node.name in targets
    }


def program_weights(exported_program: ExportedProgram) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and lifted constant tensor of the program, by FQN."""
    weights = dict(exported_program.state_dict)
    weights.update(
        (name, value) for name, value in exported_program.constants.items() if isinstance(value, torch.Tensor)
    )
    return weights


def program_fingerprint(program: ExportedProgram) -> str:
    """A SHA-256 of everything a compile of ``program`` depends on, names included.

    Its structure (``program_structure``: its code, every subgraph's too, its inputs' dtypes,
    devices, sizes and strides, its signature and dynamic ranges) with every weight's value, and
    the weights' FQNs, which a backend's result names them by. A weight the graph does not read
    counts too: a backend may store it.
    """
    structure = program_structure(program, every_value=True)
    digest = hashlib.sha256(structure.digest.encode())
    digest.update("\0".join(structure.weights).encode())
    listed = set(structure.weights)
    for fqn, tensor in sorted(program_weights(program).items()):
        if fqn not in listed:
            digest.update(f"{fqn}:{tensor.dtype}:{tuple(tensor.shape)}:{content_key(tensor_buffer(tensor))}".encode())
    return digest.hexdigest()


# A weight of at most this many elements may be written into compiled code as its values: Inductor
# inlines 0-d tensors and 1-d ones of at most 8 elements (``GraphLowering.can_inline_constant``);
# the margin covers a release that inlines more.
VALUES_IN_CODE = 64


@dataclass(frozen=True)
class Structure:
    """A program's code, inputs and signature hashed without its names, and its weights in that hash's order."""

    digest: str
    # FQNs, one per weight role the digest lists: a program with the same digest has its own in the same roles.
    weights: list[str]


def program_structure(program: ExportedProgram, *, every_value: bool = False) -> Structure:
    """What a compile of ``program`` depends on except names, and the values of weights its code does not hold.

    Two partitions cut from one model's repeated layers (the same ops on the same shapes, other
    weights, other node names) share it, so code compiled for one runs the other given its
    weights. A weight small enough that a compiler may write its values into the code
    (``VALUES_IN_CODE``), or every weight with ``every_value`` (a compile that folds them), is
    hashed by value too.
    """
    digest = hashlib.sha256()
    for name, module in program.graph_module.named_modules():
        if isinstance(module, GraphModule):
            digest.update(f"module {name}\n".encode())
            digest.update(graph_text(module.graph).encode())
    signature = program.graph_signature
    position = {node.name: index for index, node in enumerate(program.graph.find_nodes(op="placeholder"))}
    weights = program_weights(program)
    order = [spec.target for spec in signature.input_specs if spec.kind in _CONSTANT_KINDS and spec.target]
    role = {fqn: index for index, fqn in enumerate(order)}
    for spec in signature.input_specs:
        placeholder = position.get(getattr(spec.arg, "name", None))
        digest.update(f"in {spec.kind.name} {placeholder} {spec.persistent}\n".encode())
        tensor = weights.get(spec.target) if spec.target in role else None
        if isinstance(tensor, torch.Tensor):
            digest.update(f"{tensor.dtype}:{tuple(tensor.shape)}:{tensor.stride()}\n".encode())
            if every_value or tensor.numel() <= VALUES_IN_CODE:
                digest.update(content_key(tensor_buffer(tensor)).encode())
    for spec in signature.output_specs:
        # What an update writes to: a weight role, or an input's position (a user input's target is its name).
        if spec.target in role:
            written = f"weight {role[spec.target]}"
        else:
            written = f"input {position[spec.target]}" if spec.target in position else spec.target
        digest.update(f"out {spec.kind.name} {written}\n".encode())
    digest.update(repr(sorted((str(k), str(v)) for k, v in program.range_constraints.items())).encode())
    return Structure(digest.hexdigest(), order)


def graph_text(graph: Graph) -> str:
    """``graph``'s nodes with each named by its position: the ops, their operands, the inputs' types and layouts."""
    index: dict[Node, int] = {}
    lines = []
    for node in graph.nodes:
        index[node] = len(index)
        operands = torch.fx.node.map_arg((node.args, node.kwargs), lambda operand: f"%{index[operand]}")
        line = f"{node.op} {target_text(node)} {operands!r}"
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            line += f" {value.dtype} {value.device} {tuple(value.shape)} {value.stride()}"
        elif node.op == "placeholder":
            line += f" {value!r}"
        lines.append(line)
    return "\n".join(lines)


def target_text(node: Node) -> str:
    if node.op == "placeholder":
        return ""  # its name, which the structure leaves out
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        return torch.fx.node._get_qualified_name(target)
    except (AttributeError, RuntimeError, TypeError):
        return repr(target)


# Placeholder meta: another method of the program updates this buffer. A partition that reads it
# then takes it as an input, like a buffer its own method updates, never as a constant of its
# own: an engine may copy or repack its constants, and would read the value the file starts from.
UPDATED_BY_ANOTHER_METHOD = "aotstack_updated_by_another_method"


def mutated_buffer_names(exported_program: ExportedProgram) -> set[str]:
    """Names of the placeholders whose buffers the method, or another method of its program, mutates."""
    mutated_targets = set(exported_program.graph_signature.buffers_to_mutate.values())
    placeholders = {node.name: node for node in exported_program.graph.nodes if node.op == "placeholder"}
    return {
        spec.arg.name
        for spec in exported_program.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER
        and (spec.target in mutated_targets or UPDATED_BY_ANOTHER_METHOD in placeholders[spec.arg.name].meta)
    }


def updated_buffers(methods: Iterable[ExportedProgram]) -> set[str]:
    """The FQNs of the buffers any of ``methods`` updates: the program's state."""
    return {fqn for exported in methods for fqn in exported.graph_signature.buffers_to_mutate.values()}


def mark_state_of_other_methods(exported_program: ExportedProgram, state: set[str]) -> None:
    """Mark, in place, each buffer of ``state`` that ``exported_program`` reads but another method updates."""
    own = set(exported_program.graph_signature.buffers_to_mutate.values())
    placeholders = {node.name: node for node in exported_program.graph.nodes if node.op == "placeholder"}
    for spec in exported_program.graph_signature.input_specs:
        if spec.kind == InputKind.BUFFER and spec.target in state - own:
            placeholders[spec.arg.name].meta[UPDATED_BY_ANOTHER_METHOD] = True


def drop_metadata_checks(graph_module: GraphModule) -> None:
    """Erase, in place, every ``aten._assert_tensor_metadata`` of ``graph_module`` and of its subgraphs.

    Export leaves one beside each ``.to(dtype)``; it checks a dtype, device and layout that an
    exported program fixes. Kept, it still reads its tensor: where it went to another engine than
    that tensor's producer, the value left the producer's part only to be checked. A weight's
    cast so made an output of its part was read whole at every call and never packed (an
    ``Int8WeightOnlyConfig`` Llama behind ONNX Runtime: 9x its float32 time).
    """
    for module in graph_module.modules():
        if not isinstance(module, GraphModule):
            continue
        checks = [node for node in module.graph.nodes
                  if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in checks:
            module.graph.erase_node(node)
        if checks:
            module.recompile()


def user_input_placeholders(exported_program: ExportedProgram) -> list[Node]:
    """The placeholders of the program's user inputs, in the order a call passes them."""
    user_inputs = set(exported_program.graph_signature.user_inputs)
    return [n for n in exported_program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]


def partition_boundary(exported_program: ExportedProgram, label: str, device: str | None = None) -> Boundary:
    """What a partition's compiled code takes: each user input's dtype, device type and sizes, with symbol ranges.

    Read from the placeholders' fake tensors; a size is an int, a symbol or an expression's text.
    ``device`` is the device type the compiled code takes its inputs on, where that is not the
    one the program was exported on (a partition exported on the CPU, compiled for CUDA).
    """
    inputs = []
    symbols: dict[str, tuple[int, int | None]] = {}
    ranges = {str(symbol): bounds for symbol, bounds in exported_program.range_constraints.items()}
    for node in user_input_placeholders(exported_program):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise LoweringError(f"{label}: partition input {node.name!r} is a {type(value).__name__}, not a tensor")
        sizes: list[int | str] = []
        for size in value.shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else size
            if isinstance(expr, int) or expr.is_number:
                sizes.append(int(expr))
                continue
            sizes.append(str(expr))
            for symbol in expr.free_symbols:
                symbols.setdefault(str(symbol), symbol_bounds(ranges.get(str(symbol))))
        inputs.append(BoundaryInput(dtype_name(value.dtype), device or value.device.type, sizes))
    return Boundary(inputs, symbols)


def symbol_bounds(bounds: Any) -> tuple[int, int | None]:
    """A symbol's range as ints; unbounded above (sympy's integer infinity) is None, and below is 0."""
    if bounds is None:
        return 0, None
    low, high = bounds.lower, bounds.upper
    low = int(low) if getattr(low, "is_Integer", False) and int(low) >= 0 else 0
    return low, int(high) if getattr(high, "is_Integer", False) else None


def contiguous_attention_outputs(exported_program: ExportedProgram) -> None:
    """Follow each attention op with a contiguous copy, in place.

    An exporter that traces the program twice (the ONNX exporter; ExecuTorch's edge lowering)
    meets attention whole first, whose output on the CPU has the fused kernel's layout, so a
    ``reshape`` of it traces as a ``view``; then decomposed, with a contiguous output, where that
    ``view`` fails (GPT-2's attention projection). A contiguous copy has one layout in both.
    """
    graph = exported_program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            with graph.inserting_after(node):
                copy = graph.call_function(
                    torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
                )
            copy.meta = dict(node.meta)
            node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
    exported_program.graph_module.recompile()


def without_outer_guards(exported_program: ExportedProgram) -> ExportedProgram:
    """Drop the shape guards a program inherits from its method's, in place, and return it.

    A part's fake tensors share the method's shape environment, so a program built over them gets
    the method's guards, written over the method's inputs (``L['flat_args'][3]``). An engine that
    traces the program again (the ONNX exporter, OpenVINO's decompositions) evaluates them over the
    program's own inputs, and fails (``name 'L' is not defined``, ``tuple index out of range``)
    wherever the two differ. The method checks its inputs itself, and each run side its part's.
    """
    if hasattr(exported_program, "_guards_code"):
        exported_program._guards_code = []
    return exported_program


def rebuilt(exported_program: ExportedProgram, module: GraphModule, signature: Any, **changes: Any) -> ExportedProgram:
    """``exported_program._update(module, signature, **changes)``, keeping ``exported_program``'s own guards.

    A new program computes its guards afresh from its shape environment, which a part shares with
    its method: a part's rebuilt program would get the method's guards back (``without_outer_guards``).
    """
    program = exported_program._update(module, signature, **changes)
    return with_guards_of(program, exported_program)


def with_guards_of(program: ExportedProgram, source: ExportedProgram) -> ExportedProgram:
    """``program`` guarded as ``source`` is (in place), where this torch keeps guards on a program."""
    if hasattr(source, "_guards_code"):
        program._guards_code = list(source._guards_code)
    return program


def state_as_arguments(exported_program: ExportedProgram) -> tuple[ExportedProgram, list[str]]:
    """``exported_program`` with each buffer it updates taken as a trailing input and given back as a leading output.

    For an engine that compiles pure functions (an ONNX model, an OpenVINO IR): it reads the
    buffer's old value as an input and writes its new one as an output, and its run side binds
    both to the buffer's one memory, so the update happens in place. Returns the new program and
    the FQNs of those buffers, in the order of both the trailing inputs and the leading outputs.
    Unchanged, with no FQNs, where the program updates no buffer.
    """
    signature = exported_program.graph_signature
    fqns = list(signature.buffers_to_mutate.values())
    if not fqns:
        return exported_program, []
    placeholder_of = {spec.target: spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.BUFFER}
    state = [placeholder_of[fqn] for fqn in fqns]
    specs = {spec.arg.name: spec for spec in signature.input_specs}
    placeholders = [n for n in exported_program.graph.nodes if n.op == "placeholder"]
    by_name = {node.name: node for node in placeholders}
    ordered = [n for n in placeholders if n.name not in state] + [by_name[name] for name in state]

    graph = Graph()
    env: dict[Node, Node] = {}
    for node in ordered:
        env[node] = graph.placeholder(node.name)
        env[node].meta = copy.copy(node.meta)
    output_node = exported_program.graph.output_node()
    for node in exported_program.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    # An ExportedProgram lists its buffer updates before its user outputs already.
    graph.output(pytree.tree_map_only(Node, lambda n: env[n], output_node.args[0]))
    module = GraphModule(exported_program.graph_module, graph)

    input_specs = [
        InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), None) if node.name in state else specs[node.name]
        for node in ordered
    ]
    output_specs = [
        OutputSpec(OutputKind.USER_OUTPUT, spec.arg, None) if spec.kind == OutputKind.BUFFER_MUTATION else spec
        for spec in signature.output_specs
    ]
    weights = program_weights(exported_program)
    example_inputs = (
        *(example_tensor(node.meta["val"]) for node in ordered if specs[node.name].kind == InputKind.USER_INPUT),
        *(weights[fqn] for fqn in fqns),
    )
    user_outputs = [spec for spec in output_specs if spec.kind == OutputKind.USER_OUTPUT]
    call_signature = ModuleCallSignature(
        inputs=[], outputs=[],
        in_spec=pytree.tree_flatten((example_inputs, {}))[1],
        out_spec=pytree.tree_flatten(tuple(range(len(user_outputs))))[1],
    )
    program = ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
        state_dict={fqn: value for fqn, value in exported_program.state_dict.items() if fqn not in fqns},
        range_constraints=copy.copy(exported_program.range_constraints),
        module_call_graph=[ModuleCallEntry("", call_signature)],
        example_inputs=(example_inputs, {}),
        constants={fqn: value for fqn, value in exported_program.constants.items() if fqn not in fqns},
    )
    # Its inputs are no longer the method's: buffers became arguments.
    return without_outer_guards(program), fqns


# The size an example tensor gives a data-dependent dimension (a count of routed tokens), which has no hint;
# 2, as torch.export's own examples avoid the 0 and 1 it specializes.
UNBACKED_EXAMPLE_SIZE = 2


def example_tensor(value: torch.Tensor) -> torch.Tensor:
    """A real, contiguous tensor shaped like a fake one (size hints stand in for dynamic dimensions)."""
    return torch.zeros([example_size(d) for d in value.shape], dtype=value.dtype)


def example_size(size: int | torch.SymInt) -> int:
    """``size``, or its hint where it is dynamic, ``UNBACKED_EXAMPLE_SIZE`` for each data-dependent symbol in it."""
    from torch.fx.experimental import symbolic_shapes

    # torch 2.13 renamed 2.11's ``size_hint``.
    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
    return int(hint(size, fallback=UNBACKED_EXAMPLE_SIZE))


@contextmanager
def unbacked_sizes_left_behind_dropped(exported_program: ExportedProgram) -> Iterator[None]:
    """Run an engine's trace of ``exported_program`` and forget the data-dependent sizes it made and left unbound.

    A method and every part cut from it share one shape environment. A trace that makes sizes
    from data (a retraced ``item``) without binding them to a node leaves them pending there
    (ExecuTorch's edge program for XNNPACK's partitioner leaves 7 per ``tolist``), and the next
    trace of any part of the method, in any engine, fails on them: ``Pending unbacked symbols``.
    """
    values = [node.meta.get("val") for node in exported_program.graph.nodes if node.op == "placeholder"]
    try:
        fake_mode = detect_fake_mode([value for value in values if isinstance(value, torch.Tensor)])
    except AssertionError:  # values of more than one fake mode: no one shape environment to keep as it was
        fake_mode = None
    pending = getattr(getattr(fake_mode, "shape_env", None), "pending_fresh_unbacked_symbols", None)
    before = list(pending) if pending is not None else []
    try:
        yield
    finally:
        if pending is not None:
            pending[:] = before
