"""ONNX Runtime compile side: a partition exported to ONNX, its weights kept out of the model."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from ...compile.program_parts import contiguous_attention_outputs, program_weights
from ...errors import LoweringError
from .packages import require_packages


@dataclass(frozen=True)
class OnnxPartition:
    """An ONNX model whose weight initializers point outside it, with those weights."""

    model: bytes
    weights: dict[str, torch.Tensor]
    input_names: list[str]
    output_names: list[str]
    # The weights the session must hold a copy of (``broadcast_operands``), not read from the package.
    session_owned: list[str]


def export_partition(
    exported_program: ExportedProgram,
    label: str,
    quantized_activations: bool = False,
    translations: dict[Any, Callable[..., Any]] | None = None,
) -> OnnxPartition:
    """``exported_program`` as ONNX, by the dynamo exporter.

    ``optimize=False`` keeps one initializer per weight, named by its FQN; ONNX Runtime
    optimises the graph itself when the session is made. The weights leave the model so the
    package stores each once, even when several partitions or backends read it. Quantized
    layers become ONNX Runtime's packed-weight contrib ops first (``quantized_export.py``);
    ``translations`` are more entries for the exporter's table (``state.py``'s buffer updates).
    """
    require_packages(("onnx", "onnxscript"), "OrtBackend needs {missing} to export a partition", LoweringError)
    import onnx

    from .quantized_export import with_quantized_kernels

    exported_program, quantized = with_quantized_kernels(exported_program, quantized_activations, label)
    table = {**quantized, **(translations or {})}
    try:
        contiguous_attention_outputs(exported_program)
        with_every_dimension_named(exported_program)
        with_counted_repeats_expanded(exported_program)
        with quieted(EXPORTER_REGISTRATION_LOGGER):
            onnx_program = torch.onnx.export(
                exported_program, (), dynamo=True, optimize=False, verbose=False,
                # A table rebuilds the exporter's registry (about 1 s), so only a quantized partition passes one.
                custom_translation_table=table or None,
            )
    except Exception as error:
        raise LoweringError(f"{label}: the ONNX exporter failed: {error}") from error
    weights = program_weights(exported_program)
    fold_small_constants(onnx_program.model, set(weights))
    drop_zero_biases(onnx_program.model, set(weights))
    model = onnx_program.model_proto
    external = {}
    for initializer in model.graph.initializer:
        if initializer.name in weights:
            external[initializer.name] = weights[initializer.name].detach().contiguous()
            mark_external(initializer, onnx)
    return OnnxPartition(
        model=model.SerializeToString(),
        weights=external,
        input_names=[value.name for value in model.graph.input],
        output_names=[value.name for value in model.graph.output],
        session_owned=sorted(broadcast_operands(model) & set(external)),
    )


# ONNX ops that broadcast their operands elementwise: ONNX Runtime's transpose optimizer moves a Transpose through
# them, transposing a constant operand as it goes.
BROADCASTING_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "Where", "PRelu", "BitShift",
    "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor",
})


def broadcast_operands(model: Any) -> set[str]:
    """The initializers of ``model`` (an ``onnx`` ModelProto) that an elementwise op reads, in any of its graphs.

    ONNX Runtime 1.32's transpose optimizer, moving a Transpose through such an op, cannot rewrite an initializer
    the session shares from the caller's memory (``add_initializer``) and runs it untransposed: SAM's vision encoder
    (a convolution's output permuted, plus its position embedding, normalised, then permuted back) failed at its
    first run ("Attempting to broadcast an axis by a dimension other than 1. 8 by 32"). Such operands (biases,
    position embeddings, scales) are small beside the weights matrix products read, which stay shared.
    """
    read: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            if node.op_type in BROADCASTING_OPS:
                read.update(node.input)
            for attribute in node.attribute:  # an If's branches, a Loop's body
                graphs.extend([attribute.g] if attribute.HasField("g") else attribute.graphs)
    return read


def with_every_dimension_named(exported_program: ExportedProgram) -> None:
    """Name, in place, every dimension of each ``amax`` or ``amin`` that reduces them all by naming none.

    The exporter's functions take ``dim`` as required: ``x.amax()`` failed to export ("Required
    parameter 'dim' is not provided"), and an empty list written out is dropped again as the default.
    """
    changed = False
    for node in exported_program.graph.nodes:
        if (node.target in (torch.ops.aten.amax.default, torch.ops.aten.amin.default)
                and not (node.args[1:] or node.kwargs.get("dim"))):
            node.args = (node.args[0], list(range(node.args[0].meta["val"].dim())))
            node.kwargs = {key: value for key, value in node.kwargs.items() if key != "dim"}
            changed = True
    if changed:
        exported_program.graph_module.recompile()


def with_counted_repeats_expanded(exported_program: ExportedProgram) -> None:
    """Write, in place, each ``repeat_interleave`` of a tensor by a count known only when it runs as the
    ``unsqueeze``, ``expand`` and ``flatten`` it is.

    The exporter's translation (onnxscript 0.7) puts such a count on the axis before the new one: its ``Expand``
    failed for every count but 1, or every size but 1 of the axis repeated ("invalid expand shape"; SAM's mask
    decoder repeats each image's embeddings once per prompt). A constant count translates right and is left.
    """
    graph = exported_program.graph
    changed = False
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.repeat_interleave.self_int or isinstance(node.args[1], int):
            continue
        source, count = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None:  # repeats of the flattened tensor: never a symbolic count in the models seen
            continue
        value = source.meta["val"]
        axis = dim % value.dim()
        sizes = [-1] * (value.dim() + 1)
        sizes[axis + 1] = count
        with graph.inserting_before(node):
            unsqueezed = graph.call_function(torch.ops.aten.unsqueeze.default, (source, axis + 1))
            expanded = graph.call_function(torch.ops.aten.expand.default, (unsqueezed, sizes))
            merged = graph.call_function(torch.ops.aten.flatten.using_ints, (expanded, axis, axis + 1))
        unsqueezed.meta["val"] = value.unsqueeze(axis + 1)
        expanded.meta["val"] = unsqueezed.meta["val"].expand(
            [count.meta["val"] if size is count else size for size in sizes]
        )
        merged.meta = dict(node.meta)
        node.replace_all_uses_with(merged)
        graph.erase_node(node)
        changed = True
    if changed:
        exported_program.graph_module.recompile()


EXPORTER_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"
ONNXSCRIPT_OPTIMIZER_LOGGER = "onnxscript.optimizer"
# The largest tensor (elements) a fold may read or write: constants the exporter computes, never a weight.
FOLD_LIMIT = 1 << 14


def fold_small_constants(model: Any, weight_names: set[str]) -> None:
    """Fold the small constants the exporter computes in ``model`` (an ``onnx_ir`` model), in place.

    Without ``optimize``, the exporter gives a convolution without bias a zero bias it computes
    (an ``Expand`` of zero to the weight's channel count). ONNX Runtime then cannot fold the
    ``BatchNormalization`` after it into the convolution: ResNet-50's delegate ran about 1.5x
    slower than ONNX Runtime alone. A node reading a weight is not folded (a ``Shape`` reads only
    its size), so each weight stays one initializer named by its FQN, stored outside the model.
    """
    from onnxscript import optimizer

    def should_fold(node: Any) -> bool | None:
        if node.op_type != "Shape" and any(value is not None and value.name in weight_names for value in node.inputs):
            return False
        return None

    with quieted(ONNXSCRIPT_OPTIMIZER_LOGGER):
        optimizer.fold_constants(
            model, input_size_limit=FOLD_LIMIT, output_size_limit=FOLD_LIMIT, should_fold=should_fold
        )
        optimizer.remove_unused_nodes(model)


def drop_zero_biases(model: Any, weight_names: set[str]) -> None:
    """Drop the bias of each convolution in ``model`` (an ``onnx_ir`` model) whose bias is a zero the exporter
    made (not one of ``weight_names``), in place.

    The zero bias the exporter gives a convolution without one is not always of the shape ONNX
    Runtime takes: a 3-D convolution's (Qwen2-VL's patch embedding) came out ``[channels, 2]``, and
    the session failed at its first run (``bias must be a 1D tensor of size output_channels``).
    Without the input, the convolution has no bias, as the model said.
    """
    for node in model.graph:
        bias = node.inputs[2] if node.op_type == "Conv" and len(node.inputs) == 3 else None
        if bias is not None and bias.name not in weight_names and is_zero(bias):
            node.resize_inputs(2)
            producer = bias.producer()
            if producer is not None and not bias.uses() and not bias.is_graph_output():
                model.graph.remove(producer, safe=True)


def is_zero(value: Any) -> bool:
    """Whether an ``onnx_ir`` value is a constant of zeros, or an ``Expand`` of a zero constant."""
    if value is None:
        return False
    constant = value.const_value
    if constant is not None:
        return not constant.numpy().any()
    producer = value.producer()
    return producer is not None and producer.op_type == "Expand" and is_zero(producer.inputs[0])


def mark_external(initializer, onnx) -> None:  # noqa: ANN001 - onnx is imported lazily
    """Replace an initializer's data by a reference the session fills in at load time."""
    size = len(initializer.raw_data)
    initializer.ClearField("raw_data")
    initializer.data_location = onnx.TensorProto.EXTERNAL
    del initializer.external_data[:]
    for key, value in (("location", "aotstack-named-data"), ("offset", "0"), ("length", str(size))):
        entry = initializer.external_data.add()
        entry.key, entry.value = key, value


@contextmanager
def quieted(*names: str) -> Iterator[None]:
    """Only errors from the loggers ``names`` meanwhile: the exporter's notes about optional packages
    (torchvision) it looked for, the constant folder's note on each node it cannot evaluate (left unfolded)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


