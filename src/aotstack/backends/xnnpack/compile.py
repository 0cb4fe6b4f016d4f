"""XNNPACK compile side: a partition lowered by ExecuTorch into a ``.pte`` whose constants sit in a ``.ptd`` beside it.

ExecuTorch's XNNPACK delegate serializes each constant it reads (a weight as XNNPACK lays it
out: int4 packed two to a byte, scales in bfloat16, ...) as named data keyed by the SHA-256 of
its bytes. A constant tagged ``delegate_constant_tag`` goes to an external ``.ptd`` data file
instead of the program, so the ``.pte`` holds only the XNNPACK graph and ExecuTorch's plan.

The ``.ptd`` is a FlatTensor file: a header and a flatbuffer index (the ``frame``), then each
segment of data at an aligned offset. The package stores the frame once per partition and
each segment as named data of its own, keyed by content like every engine's weights, so a
constant two partitions, two methods or two engines read is stored once. The run side puts the
file back together in memory (``run.assembled_data_map``); ``ptd_layout`` checks here that this
gives the very bytes ExecuTorch wrote.
"""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassResult

from ...compile.program_parts import constant_placeholders, contiguous_attention_outputs
from ...errors import LoweringError, PackageError
from .claims import DELEGATION_TAG, edge_op_name, quiet_executorch, runtime_operators
from .packages import require_executorch
from .run import DATA_PREFIX, Segment, assembled_data_map, frame_header

# The tag ExecuTorch names the external data file after; one file per partition.
DATA_TAG = "aotstack"
# Edge ops that may stay outside the delegate: they only take an output of it.
_OUTSIDE_THE_DELEGATE = frozenset({"executorch_call_delegate", "getitem"})


@dataclass(frozen=True)
class XnnpackPartition:
    """A partition as ExecuTorch wrote it: the program, and its external data split into frame and segments."""

    program: bytes
    # The ``.ptd``'s header and index, up to its first segment; empty where the program has no constants.
    frame: bytes
    segments: list[Segment]
    # Segment name (``data:<key>``) -> its bytes.
    data: dict[str, bytes]
    data_size: int
    outputs: int
    # Edge ops XNNPACK did not take in this part, which ExecuTorch runs on its portable kernels.
    portable: list[str]
    # The segments only XNNPACK's packing nodes read: not read again once XNNPACK has packed them.
    packed: list[str] = field(default_factory=list)
    # Bytes of constants the program holds itself rather than in its data file: a vector XNNPACK multiplies by, a
    # weight an op outside XNNPACK reads or XNNPACK takes as an input rather than packs.
    constants_in_program: int = 0


def lower_partition(exported_program: ExportedProgram, label: str) -> XnnpackPartition:
    """``exported_program`` lowered by ``to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])``.

    The partitioner claims what XNNPACK takes in the context of the whole method; in a part of
    its own, XNNPACK may leave an op (an ``add`` whose operand was a constant there). ExecuTorch
    then runs it on its portable kernels, as it would alone; an op its runtime has no kernel for
    (torchao's quantize ops, outside XNNPACK) is a ``LoweringError`` naming it.
    """
    require_executorch("XnnpackBackend needs executorch to lower a partition", LoweringError)
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    # Attention's copy first: spelling out GELUs traces the program again, and a reshape of attention's output then
    # traces as a view of the layout the copy decides (Gemma's attention projection).
    contiguous_attention_outputs(exported_program)
    weight_products_as_linears(exported_program)
    maxima_over_counted_dims(exported_program)
    exported_program = with_tanh_gelus_spelled_out(exported_program)
    try:
        with quiet_executorch(), torch.no_grad():
            edge = to_edge_transform_and_lower(
                exported_program, transform_passes=[constants_kept_outside], partitioner=[XnnpackPartitioner()]
            )
    except Exception as error:
        raise LoweringError(f"{label}: ExecuTorch could not lower it to XNNPACK: {error}") from error
    left = left_outside(edge.exported_program())
    try:
        with quiet_executorch():
            # Inputs are not planned: ExecuTorch then reads each input where the caller's tensor is, not a copy.
            program = edge.to_executorch(
                ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
            )
    except Exception as error:
        raise LoweringError(f"{label}: ExecuTorch could not write the program: {error}") from error
    unrunnable = sorted(set(program_operators(program)) - runtime_operators())
    if unrunnable:
        raise LoweringError(f"{label}: XNNPACK does not take {', '.join(left)}, and ExecuTorch's runtime has no "
                            f"kernel for {', '.join(unrunnable)}")
    ptd = data_file(program, label)
    frame, segments, data, keys = ptd_layout(ptd, label) if ptd else (b"", [], {}, {})
    outputs = len(edge.exported_program().graph_signature.user_outputs)
    packed = packed_keys(edge.exported_program(), label)
    return XnnpackPartition(program.buffer, frame, segments, data, len(ptd), outputs, left,
                            packed=[name for name, read in keys.items() if read <= packed],
                            constants_in_program=program_constant_bytes(program))


# Ops that transpose a matrix, with the arguments that make them do so: ``permute(w, [1, 0])``, ``w.t()``, ``w.T``.
_TRANSPOSES = {torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
               torch.ops.aten.numpy_T.default}
_PRODUCTS = {torch.ops.aten.matmul.default, torch.ops.aten.mm.default}


def weight_products_as_linears(exported_program: ExportedProgram) -> None:
    """Each product by a weight's transpose (``x @ w.T``), in place, as ``linear(x, w)``.

    XNNPACK's partitioner takes a ``linear`` as a fully connected layer on its packed weights. A
    product by ``w.T`` (Falcon's linears are written so) it leaves to ExecuTorch's portable matrix
    product, after copying the weight transposed, and ExecuTorch writes the weight into the program.
    """
    weights = {node for node, fqn in constant_placeholders(exported_program).items()
               if fqn not in exported_program.graph_signature.buffers_to_mutate.values()}
    graph = exported_program.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _PRODUCTS or len(node.args) != 2:
            continue
        left, right = node.args
        weight = transposed_matrix(right)
        if weight not in weights:
            continue
        with graph.inserting_before(node):
            linear = graph.call_function(torch.ops.aten.linear.default, (left, weight))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        if not right.users:
            graph.erase_node(right)
        changed = True
    if changed:
        exported_program.graph_module.recompile()


def maxima_over_counted_dims(exported_program: ExportedProgram) -> None:
    """Each ``max.dim`` over a dimension counted from the end (``x.max(-1, keepdim=True)``), in place, over the same
    dimension counted from the start: XNNPACK's max reads its dimension as given (``claims.unlowerable_max``)."""
    changed = False
    for node in exported_program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.max.dim and node.args[1] < 0:
            node.args = (node.args[0], node.args[1] % node.args[0].meta["val"].dim(), *node.args[2:])
            changed = True
    if changed:
        exported_program.graph_module.recompile()


def transposed_matrix(node: Any) -> torch.fx.Node | None:
    """The 2-D node that ``node`` transposes; None where it is no transpose of a matrix."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    if node.target is torch.ops.aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target is torch.ops.aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        return None
    return source


def with_tanh_gelus_spelled_out(exported_program: ExportedProgram) -> ExportedProgram:
    """``exported_program`` with each tanh-approximated GELU written as the arithmetic it stands for.

    XNNPACK's GELU is the exact (erf) one, and ExecuTorch hands it Gemma's, SigLIP's or
    StarCoder2's ``gelu(approximate="tanh")`` without the argument, though its partitioner claims
    it: 1.9e-4 of the output's range off. Spelled out, XNNPACK computes it with its own multiply,
    add and tanh, in the same part as the linears around it. The program given is not changed.
    """
    if not any(node.target is torch.ops.aten.gelu.default and node.kwargs.get("approximate") == "tanh"
               for node in exported_program.graph.nodes):
        return exported_program
    return exported_program.run_decompositions({torch.ops.aten.gelu.default: tanh_gelu_spelled_out})


def tanh_gelu_spelled_out(x: torch.Tensor, approximate: str = "none") -> Any:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, as ATen computes it; the exact GELU is kept."""
    if approximate != "tanh":
        return NotImplemented
    # Float literals: an int one becomes an int64 tensor and a cast in ExecuTorch's edge program, outside XNNPACK.
    return x * 0.5 * (torch.tanh((x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)) + 1.0)


@functools.cache
def warmed_lowering() -> None:
    """Lower a tiny program once, so what ExecuTorch sets up at its first lowering is done in this process."""
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    lower_partition(torch.export.export(tiny, (torch.randn(1, 8),)), "xnnpack warm-up")


def constants_kept_outside(graph_module: torch.fx.GraphModule) -> PassResult:
    """Tag every placeholder so XNNPACK writes the constants it reads to the external data file, not the program.

    XNNPACK reads the tag on constants only; a user input's tag is never looked at. aotstack's
    own partition tags, which the edge program inherits under the key ExecuTorch's partitioner
    writes, are dropped: that partitioner refuses a node tagged already.
    """
    for node in graph_module.graph.nodes:
        node.meta.pop(DELEGATION_TAG, None)
        if node.op == "placeholder":
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = DATA_TAG
    return PassResult(graph_module, True)


def program_operators(program: Any) -> list[str]:
    """The kernels ExecuTorch's runtime must have for ``program`` (``aten::add.out``, ...)."""
    return [
        f"{operator.name}.{operator.overload}" if operator.overload else operator.name
        for plan in program.executorch_program.execution_plan
        for operator in plan.operators
    ]


def program_constant_bytes(program: Any) -> int:
    """How many bytes of constant tensors ``program`` (an ExecuTorch program manager) holds in itself."""
    constants = program.executorch_program.constant_buffer
    return sum(len(buffer.storage) for buffer in constants)


def left_outside(edge: ExportedProgram) -> list[str]:
    """The ops of the lowered edge program that did not go into an XNNPACK delegate."""
    return sorted({
        edge_op_name(node)
        for node in edge.graph.nodes
        if node.op == "call_function" and getattr(node.target, "__name__", "") not in _OUTSIDE_THE_DELEGATE
    })


def data_file(program: object, label: str) -> bytes:
    """The one external data file ExecuTorch wrote for ``program``; empty where there is none.

    ExecuTorch writes its data files only to a directory, which is removed before this returns.
    """
    with tempfile.TemporaryDirectory(prefix="aotstack-xnnpack-") as directory:
        try:
            program.write_tensor_data_to_file(directory)
        except AssertionError:  # no external data at all
            return b""
        files = sorted(Path(directory).iterdir())
        if len(files) > 1:
            raise LoweringError(f"{label}: ExecuTorch wrote {len(files)} data files, where one was asked for")
        return files[0].read_bytes() if files else b""


def ptd_layout(ptd: bytes, label: str) -> tuple[bytes, list[Segment], dict[str, bytes], dict[str, set[str]]]:
    """The ``.ptd`` split into its frame and its segments, each named by the first key that reads it; each one's keys.

    Checked by putting it back together as the run side does: a layout this aotstack does not
    read is a ``LoweringError`` here, never a wrong file at load.
    """
    from executorch.extension.flat_tensor.serialize.serialize import _deserialize_to_flat_tensor

    base, data_size = frame_header(ptd, label, LoweringError)
    header_length = int.from_bytes(ptd[8 + 8:8 + 16], "little") + int.from_bytes(ptd[8 + 16:8 + 24], "little")
    with quiet_executorch():
        index = _deserialize_to_flat_tensor(ptd[:header_length])
    names: dict[int, str] = {}
    keys: dict[int, set[str]] = {}
    for entry in index.named_data:
        names.setdefault(entry.segment_index, f"{DATA_PREFIX}{entry.key}")
        keys.setdefault(entry.segment_index, set()).add(entry.key)
    segments, data = [], {}
    for position, segment in enumerate(index.segments):
        name = names.get(position, f"{DATA_PREFIX}segment-{position}")
        segments.append(Segment(name, segment.offset, segment.size))
        data[name] = ptd[base + segment.offset:base + segment.offset + segment.size]
    if base + data_size != len(ptd):
        raise LoweringError(f"{label}: ExecuTorch's data file holds {len(ptd)} bytes, its header {base + data_size}")
    frame = ptd[:base]
    try:
        rebuilt = assembled_data_map(frame, segments, data, len(ptd), label)
    except PackageError as error:
        raise LoweringError(str(error)) from None
    if rebuilt != ptd:
        raise LoweringError(f"{label}: ExecuTorch's data file is laid out in a way this aotstack cannot rebuild")
    # A segment no key names is read by no one we know of: never counted as packed.
    return frame, segments, data, {segment.name: keys.get(position, {""}) for position, segment in enumerate(segments)}


# The XNNPACK nodes that pack their filter and bias into XNNPACK's own memory when ExecuTorch creates
# XNNPACK's runtime (at a program's first call), as ExecuTorch's XNNCompiler lists them (getPackedValueIds):
# ExecuTorch lets go of those constants then; every other constant XNNPACK keeps reading where it is.
PACKING_NODES = {"XNNFullyConnected", "XNNConv2d", "XNNDepthwiseConv2d", "XNNConvTranspose2d"}


def packed_keys(edge: ExportedProgram, label: str) -> set[str]:
    """The named data keys that only packing nodes read, in every XNNPACK graph of ``edge``."""
    from executorch.exir.lowered_backend_module import get_lowered_backend_modules

    packed: set[str] = set()
    unpacked: set[str] = set()
    for module in get_lowered_backend_modules(edge.graph_module):
        if module.backend_id != "XnnpackBackend":
            continue
        graph = xnnpack_graph(module.processed_bytes, label)
        keys = [entry.get("named_key", "") for entry in graph.get("constant_data", [])]
        filters, others = packing_uses(graph.get("xnodes", []))
        filters -= others  # a value another node reads too stays where it is
        for value in graph.get("xvalues", []):
            tensor = value["xvalue_union"].get("tensor_value", value["xvalue_union"])
            quantization = value["xvalue_union"].get("quant_params") or {}
            read = {keys[index] for index in (tensor.get("constant_buffer_idx", 0),
                                              quantization.get("scale_buffer_idx", 0)) if 0 < index < len(keys)}
            (packed if tensor.get("id_out") in filters else unpacked).update(key for key in read if key)
    return packed - unpacked


def packing_uses(nodes: list[dict[str, Any]]) -> tuple[set[int], set[int]]:
    """The value ids packing nodes read as filter or bias, and the ids every other use (any node's ``*_id``) names."""
    filters: set[int] = set()
    others: set[int] = set()
    for node in nodes:
        packing = node.get("xnode_union_type") in PACKING_NODES
        for role, value in node.get("xnode_union", {}).items():
            ids = value if isinstance(value, list) else [value]
            if packing and role in ("filter_id", "bias_id"):
                filters.update(ids)
            elif role.endswith(("_id", "_ids")):
                others.update(ids)
    return filters, others


def xnnpack_graph(processed: bytes, label: str) -> dict[str, Any]:
    """An XNNPACK delegate's graph (its flatbuffer, ``XNNGraph``) as JSON, read with ExecuTorch's flatc and schema."""
    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import XNNHeader, _get_schema_bytes
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    header = XNNHeader.from_bytes(processed[:XNNHeader.EXPECTED_LENGTH])
    with tempfile.TemporaryDirectory(prefix="aotstack-xnnpack-") as directory:
        folder = Path(directory)
        (folder / "schema.fbs").write_bytes(_get_schema_bytes())
        (folder / "graph.bin").write_bytes(
            processed[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size])
        try:
            _flatc_decompile(directory, str(folder / "schema.fbs"), str(folder / "graph.bin"), ["--raw-binary"])
            text = (folder / "graph.json").read_text()
        except Exception as error:
            raise LoweringError(f"{label}: could not read XNNPACK's graph: {error}") from error
    # flatc writes infinite floats (a clamp's bounds) as bare inf, which JSON lacks.
    return json.loads(re.sub(r"(?<![\w\"])(-?)inf(?![\w\"])", r"\1Infinity", text))
