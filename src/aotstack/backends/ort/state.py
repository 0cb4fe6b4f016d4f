"""Buffer updates in forms ONNX Runtime can make in place: the state a delegate owns is bound, not copied.

A partition that owns a buffer (a KV cache) takes it as an input and gives its new value back as
an output; the run side binds both to the buffer's one memory (``run.py``). That is an update in
place only where the output is written by a scatter into the input itself: ONNX Runtime's
ScatterElements and ScatterND copy their data input to their output only when the two are
different memory. The exporter's own form of ``index_copy`` (a cache written at its positions)
transposes the whole cache there and back around a ScatterND, which is correct over shared
memory but reads and writes every element each call; ``index_copy_onnx`` scatters along the
dimension instead.

``updated_in_place`` checks the exported model: for each owned buffer, that its output is a
scatter of its input and that nothing else reads the input, or that nothing reads the input's
values at all (a buffer overwritten, such as a counter set from an input). Where neither holds,
the run side gives the output memory of its own and copies it into the buffer, still right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# ONNX ops that write their data input's values to their output, and their updates over them.
SCATTERS = frozenset({"ScatterElements", "ScatterND"})
# Ops that read only an input's shape, never its values.
SHAPE_READERS = frozenset({"Shape", "Size"})


def state_translations() -> dict[Any, Callable[..., Any]]:
    """The exporter's ``custom_translation_table`` entries for buffer updates."""
    return {torch.ops.aten.index_copy.default: index_copy_onnx}


def index_copy_onnx(self, dim: int, index, source):  # noqa: ANN001, ANN201
    """``self.index_copy(dim, index, source)`` as one ScatterElements along ``dim``, ``index`` spread over it."""
    from onnxscript import opset18 as op

    rank = len(source.shape)
    dim = dim % rank
    axes = op.Constant(value_ints=[axis for axis in range(rank) if axis != dim])
    indices = op.Expand(op.Unsqueeze(index, axes), op.Shape(source))
    return op.ScatterElements(self, indices, source, axis=dim)


def updated_in_place(model: Any, state: list[tuple[str, str]]) -> list[bool]:
    """For each (input, output) of ``state``, whether ``model`` may write the output over that input's memory.

    ``model`` is an ``onnx.ModelProto``. Either nothing reads the input's values, or a scatter
    reads it as its data and makes the output, and nothing else reads it: ONNX Runtime may run
    another reader after the scatter wrote into it.
    """
    producers = {output: node for node in model.graph.node for output in node.output}
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in model.graph.output}
    in_place = []
    for input_name, output_name in state:
        producer = producers.get(output_name)
        value_readers = [node for node in readers.get(input_name, []) if node.op_type not in SHAPE_READERS]
        scattered = (
            producer is not None
            and producer.op_type in SCATTERS
            and producer.input[0] == input_name
            and value_readers == [producer]
        )
        in_place.append((scattered or not value_readers) and input_name not in outputs)
    return in_place
