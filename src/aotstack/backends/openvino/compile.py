"""OpenVINO compile side: a partition converted by OpenVINO's PyTorch frontend, with its weights left out of the IR."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ...compile.packed_integers import fit_signed, packed_int4
from ...compile.program_parts import program_weights
from ...errors import LoweringError
from .compressed import with_compressed_int8_linears
from .frontend import DROPPED, decompositions
from .packages import require_openvino
from .run import INPUT_ROLE, OUTPUT_ROLE, WEIGHT_ROLE

_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass(frozen=True)
class OpenVinoPartition:
    """A partition as OpenVINO IR whose weights are parameters, with those weights."""

    xml: bytes
    # The IR's .bin: only the constants the frontend made (shapes, scalars), never a weight.
    constants: bytes
    weights: dict[str, torch.Tensor]
    # Each parameter of the IR, in order: ``input:<index>`` or ``weight:<fqn>`` (also its friendly name).
    # An input nothing reads may have none.
    parameters: list[str]
    # For each output of the partition, the result of the IR that holds it (one result may hold two).
    outputs: list[int]
    # What the CPU plugin is asked to compute in: ``f32``, or ``bf16`` for a part all in bfloat16.
    precision: str
    # For each buffer the part owns (its trailing inputs, its leading outputs): whether the IR writes
    # the new value by a scatter into the old one alone, so the run side can give both one memory.
    in_place: list[bool]


def convert_partition(exported_program: ExportedProgram, label: str, state: int = 0) -> OpenVinoPartition:
    """``exported_program`` converted the way ``openvino.convert_model`` converts one, but for its weights.

    ``convert_model`` would make each weight a constant inside the IR, so the package would hold
    a second copy of it for every partition that reads it. Here the weights stay parameters of
    the IR (the frontend converts the program's own graph, whose placeholders they are), the
    package stores each once as named data, and the run side makes each a constant again, over
    the package's bytes, before compiling. The last ``state`` user inputs are buffers the part
    updates, and its first ``state`` outputs their new values (``state_as_arguments``).
    """
    require_openvino("OpenVinoBackend needs openvino to convert a partition", LoweringError)
    try:
        decomposed = with_compressed_int8_linears(exported_program).run_decompositions(decompositions())
    except Exception as error:
        raise LoweringError(f"{label}: OpenVINO's decompositions failed: {error}") from error
    roles = parameter_roles(decomposed, label)
    without_dropped_checks(decomposed.graph_module)
    with_unfolds_counted_from_the_front(decomposed.graph_module)
    outputs = distinct_outputs(decomposed.graph_module)
    model = converted(decomposed.graph_module, label)
    without_identity_broadcasts(model)
    if len(model.get_results()) != len(set(outputs)):
        raise LoweringError(f"{label}: the OpenVINO model has {len(model.get_results())} outputs, "
                            f"the partition {len(set(outputs))}")
    taken = named_parameters(model, roles, label)
    # Names the run side finds its outputs by, whatever order compiling gives them.
    for index, result in enumerate(model.get_results()):
        result.set_friendly_name(f"{OUTPUT_ROLE}{index}")
    inputs = sum(role.startswith(INPUT_ROLE) for role in roles.values())
    in_place = [
        scattered_into(model, f"{INPUT_ROLE}{inputs - state + index}", outputs[index]) for index in range(state)
    ]
    every_weight = program_weights(decomposed)
    weights = {
        role.removeprefix(WEIGHT_ROLE): every_weight[role.removeprefix(WEIGHT_ROLE)].detach().contiguous()
        for role in taken
        if role.startswith(WEIGHT_ROLE)
    }
    for fqn in int4_weights(model, weights):
        weights[fqn] = packed_int4(weights[fqn])
    xml, constants = serialized(model)
    return OpenVinoPartition(
        xml=xml,
        constants=constants,
        weights=weights,
        parameters=taken,
        outputs=outputs,
        precision=part_precision(exported_program),
        in_place=in_place,
    )


# OpenVINO ops a weight may pass through, its values unchanged, on its way to the Convert that decompresses it.
REARRANGING = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Transpose"})


def int4_weights(model: Any, weights: dict[str, torch.Tensor]) -> list[str]:
    """The int8 weights that hold 4-bit values and only reach a Convert: made ``i4`` parameters of ``model``, in place.

    torchao keeps an int4 value in an int8 (``IntxWeightOnlyConfig``, ``8da4w``). OpenVINO's CPU
    plugin decompresses an ``i4`` constant inside its matmul kernel as it does an ``i8`` one, and
    reads half the bytes (measured: ``FullyConnected`` on ``i4``), so such a weight is stored two
    values a byte (``packed_int4``, OpenVINO's layout) and the IR declares it ``i4``. A weight that
    something else reads stays int8: a Gather of an ``i4`` table (an embedding's) is given an
    ``i8`` copy of it by the plugin.
    """
    import openvino

    found = []
    for parameter in model.get_parameters():
        fqn = parameter.get_friendly_name().removeprefix(WEIGHT_ROLE)
        weight = weights.get(fqn)
        if weight is None or weight.dtype != torch.int8 or not weight.numel() \
                or not only_converted(parameter.output(0)) or not fit_signed(weight, 4):
            continue
        parameter.set_element_type(openvino.Type.i4)
        found.append(fqn)
    if found:
        model.validate_nodes_and_infer_types()
    return found


def only_converted(output: Any) -> bool:
    """Whether every reader of ``output`` is a Convert, directly or through ops that only rearrange its values."""
    readers = list(output.get_target_inputs())
    for reader in readers:
        node = reader.get_node()
        kind = node.get_type_name()
        if kind == "Convert":
            continue
        if kind not in REARRANGING or reader.get_index() != 0 or not only_converted(node.output(0)):
            return False
    return bool(readers)


# OpenVINO ops that write their data input's values to their output, and updates over them.
SCATTERS = frozenset({"ScatterUpdate", "ScatterElementsUpdate", "ScatterNDUpdate"})
# Ops that read an input's shape only.
SHAPE_READERS = frozenset({"ShapeOf"})


def scattered_into(model: Any, parameter: str, result: int) -> bool:
    """Whether ``model``'s result ``result`` may be written over parameter ``parameter``'s memory.

    Where it is a scatter into the parameter, which nothing else reads, or where nothing reads the
    parameter's values at all. The run side then hands OpenVINO the buffer's memory as both: the
    CPU plugin copies a scatter's data to its output only when the two are different memory, and
    no other node can read the old value after the new one was written over it.
    """
    source = model.get_results()[result].input_value(0).get_node()
    found = [node for node in model.get_parameters() if node.get_friendly_name() == parameter]
    if len(found) != 1:
        return False
    # OpenVINO hands out a new Python object per node each time: nodes compare by their unique names.
    readers = [target.get_node() for target in found[0].output(0).get_target_inputs()]
    values = [node.get_name() for node in readers if node.get_type_name() not in SHAPE_READERS]
    if not values:
        return source.get_type_name() != "Parameter"
    scatter = source.get_type_name() in SCATTERS and source.input_value(0).get_node().get_name() == found[0].get_name()
    return scatter and values == [source.get_name()]


def named_parameters(model: Any, roles: dict[str, str], label: str) -> list[str]:
    """Give each parameter of ``model`` its role as friendly name; return the roles, in the model's order.

    A parameter carries the name of the placeholder it came from. A placeholder nothing reads may
    have none: the run side then takes that input without handing it to OpenVINO.
    """
    taken = []
    for parameter in model.get_parameters():
        names = parameter.output(0).get_names() & roles.keys()
        if len(names) != 1:
            raise LoweringError(f"{label}: OpenVINO input {sorted(parameter.output(0).get_names())} names no one "
                                "input of the partition")
        role = roles[names.pop()]
        parameter.set_friendly_name(role)
        taken.append(role)
    return taken


def parameter_roles(exported_program: ExportedProgram, label: str) -> dict[str, str]:
    """Each placeholder's name -> what it is: a user input (by position) or a weight (by FQN)."""
    roles, user_inputs = {}, 0
    for spec in exported_program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            roles[spec.arg.name] = f"{INPUT_ROLE}{user_inputs}"
            user_inputs += 1
        elif spec.kind in _WEIGHT_KINDS and spec.target is not None:
            roles[spec.arg.name] = f"{WEIGHT_ROLE}{spec.target}"
        else:
            raise LoweringError(f"{label}: input {spec.arg.name!r} is a {spec.kind.name}, which OpenVINO cannot take")
    for spec in exported_program.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise LoweringError(f"{label}: output {spec.arg.name!r} is a {spec.kind.name}; a part returns values only")
    return roles


def without_dropped_checks(graph_module: torch.fx.GraphModule) -> None:
    """Remove the metadata checks the frontend has no rule for (see ``frontend.DROPPED``), in place."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and str(node.target) in DROPPED and not node.users:
            graph.erase_node(node)
    graph_module.recompile()


def with_unfolds_counted_from_the_front(graph_module: torch.fx.GraphModule) -> None:
    """Write, in place, each ``unfold`` along a dimension counted from the back as the same one counted from the front.

    OpenVINO 2026.4's translation of a negative one builds a transpose of the wrong rank and fails ("Input order
    must have shape [n], where n is the rank of arg"): PatchTSMixer's patches, ``x.unfold(-2, size, step)``.
    """
    changed = False
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.aten.unfold.default and node.args[1] < 0:
            node.args = (node.args[0], node.args[1] + node.args[0].meta["val"].dim(), *node.args[2:])
            changed = True
    if changed:
        graph_module.recompile()


def distinct_outputs(graph_module: torch.fx.GraphModule) -> list[int]:
    """Return each value once, in place; for each output as it was, its index among the values kept.

    The frontend names each output after the tensor that makes it, and fails on a name it has seen.
    """
    output = graph_module.graph.output_node()
    values = list(output.args[0])
    kept = list(dict.fromkeys(values))
    output.args = (type(output.args[0])(kept),)
    graph_module.recompile()
    return [kept.index(value) for value in values]


def converted(graph_module: torch.fx.GraphModule, label: str) -> Any:
    """The frontend's model of ``graph_module``; sizes that are symbols in its fake tensors stay dynamic (-1)."""
    import openvino
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    for attempt in ("as it is", "with fresh outputs"):
        try:
            return openvino.convert_model(TorchFXPythonDecoder(graph_module))
        except Exception as error:
            # Two outputs the frontend reads as one tensor (it elides a clone or an alias) fail by name.
            if attempt == "as it is" and "Tensor name is not a number" in str(error):
                with_fresh_outputs(graph_module)
                continue
            raise LoweringError(f"{label}: OpenVINO could not convert it: {error}") from error
    raise AssertionError("unreachable")


def without_identity_broadcasts(model: Any) -> None:
    """Read, in place, each ``Broadcast`` to the shape its input already has as that input.

    The frontend writes ``buffer.copy_(value)`` as a broadcast of the value to the buffer's shape.
    For a 0-d value that another result of the model also returns (a cache's length, stored in two
    buffers), OpenVINO 2026's CPU plugin dies of SIGSEGV compiling the model (Arcee's AFMoE prefill).
    """
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Broadcast":
            continue
        source = node.input_value(0)
        shape = source.get_partial_shape()
        if shape.is_static and shape == node.output(0).get_partial_shape():
            node.output(0).replace(source)


def with_fresh_outputs(graph_module: torch.fx.GraphModule) -> None:
    """Make each computed output a node of its own (a squeeze of an unsqueeze, which OpenVINO folds away), in place."""
    graph = graph_module.graph
    output = graph.output_node()
    values = []
    for value in output.args[0]:
        if isinstance(value, torch.fx.Node) and value.op != "placeholder":
            with graph.inserting_before(output):
                wider = graph.call_function(torch.ops.aten.unsqueeze.default, (value, 0))
                wider.meta["val"] = value.meta["val"].unsqueeze(0)
                value = graph.call_function(torch.ops.aten.squeeze.dim, (wider, 0))
                value.meta["val"] = wider.meta["val"].squeeze(0)
        values.append(value)
    output.args = (type(output.args[0])(values),)
    graph_module.recompile()


def serialized(model: Any) -> tuple[bytes, bytes]:
    """The model's IR, XML and .bin, exactly as it is (``openvino.save_model`` would compress it to float16).

    OpenVINO serializes to files only; they live in a directory removed before this returns.
    """
    import openvino

    with tempfile.TemporaryDirectory(prefix="aotstack-openvino-") as directory:
        xml, constants = Path(directory, "model.xml"), Path(directory, "model.bin")
        openvino.serialize(model, xml, constants)
        return xml.read_bytes(), constants.read_bytes()


def part_precision(exported_program: ExportedProgram) -> str:
    """``bf16`` for a part of a bfloat16 model; otherwise ``f32``, so float32 stays float32.

    A part whose floating weights are all bfloat16 is a bf16 model's, even where it computes a
    step in float32 (an attention mask, a norm's upcast): OpenVINO alone runs such a model with
    the bf16 hint, and an f32 one cost it 1.5x on a bf16 BERT. A part with no floating weights
    is bf16 only where every floating tensor it holds is.
    """
    weights = {tensor.dtype for tensor in program_weights(exported_program).values() if tensor.is_floating_point()}
    if weights:
        return "bf16" if weights == {torch.bfloat16} else "f32"
    floating = {
        leaf.dtype
        for node in exported_program.graph.nodes
        for leaf in pytree.tree_leaves(node.meta.get("val"))
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    }
    return "bf16" if floating == {torch.bfloat16} else "f32"
