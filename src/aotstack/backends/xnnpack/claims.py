"""What ExecuTorch's own ``XnnpackPartitioner`` delegates, asked of it and mapped back to the ATen program's nodes.

ExecuTorch's partitioner works on an edge-dialect program: ``to_edge_transform_and_lower``
first decomposes the ATen program, keeping whole the ops the partitioner lists in
``ops_to_not_decompose`` (``linear``, torchao's quantize and dequantize ops, ...), then hands
the result to the partitioner, which tags the nodes XNNPACK takes. The question is asked inside
that very call: a stand-in partitioner (``_Asker``) takes the partitioner's place, lets it tag
the edge program it is handed, and stops the call there by raising, so nothing is lowered or
compiled. The edge program and its tags are the answer.

Each edge node records the ATen nodes it was made from (``meta["from_node"]``, kept by
``run_decompositions``); an ATen node is claimed when every edge node made from it is tagged.
XNNPACK's configs say why they decline a node through ExecuTorch's ``WhyNoPartition`` log
records, which are caught while the partitioner runs and become each refusal's reason.

An op XNNPACK leaves between ops it takes (an RMS norm's ``mean``, a rotary embedding's ``cat``)
would split its part in two, each a program of its own with a boundary crossed at every call.
Where ExecuTorch's runtime has kernels for every edge op made from it and its tensors are small,
it stays in XNNPACK's part instead, and ExecuTorch runs it on its portable kernels inside the
same program (``portable_between``). What reads a buffer the method updates (a KV cache) is
left to the engine that updates it in place (``state_computations``).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from ...compile.int8_tensor import LAYOUT_OPS, int8_linears, integer_weights_cast
from ...compile.partitioner import get_non_lowered_nodes
from ...compile.program_parts import (
    UPDATED_BY_ANOTHER_METHOD,
    constant_placeholders,
    contiguous_attention_outputs,
    is_size_computation,
    mutated_buffer_names,
    program_fingerprint,
    program_weights,
)
from ...compile.quantize import dequantized_weight, is_dequantize, quantized_layer_label, zero_free
from ...compile.subprogram import partition_program
from ...errors import LoweringError
from .run import runtime_module

DELEGATION_TAG = "delegation_tag"
# The most elements a tensor an op XNNPACK leaves reads or writes may have for ExecuTorch's portable kernels to
# run it in XNNPACK's program. Those kernels are plain loops, a few ns an element; what a boundary between two
# parts costs (two engine calls) is a loop of about this many. A decode step's gaps (a norm's mean over one
# token's hidden state) are far below it, a 128-token encoder's (a softmax over its attention scores) far above:
# BERT lowered XNNPACK-first took 71 ms with its gaps run on portable kernels, 57 ms without.
PORTABLE_MAX_ELEMENTS = 16384
# The logger XNNPACK's partitioner configs report a declined node to (``WhyNoPartition``).
WHY_LOGGER = "executorch.backends.xnnpack.partition.config.xnnpack_config"


@dataclass(frozen=True)
class XnnpackAnswer:
    """ExecuTorch's answer for one ATen program: the nodes XNNPACK delegates, and why it leaves the others."""

    claimed: frozenset[str]
    # ATen node name -> why XNNPACK leaves it (for call_function nodes not claimed).
    reasons: dict[str, str] = field(default_factory=dict)
    # Nodes XNNPACK leaves between nodes it takes, which ExecuTorch runs on its portable kernels in the same program.
    portable: frozenset[str] = frozenset()

    def refusal(self, node: Node) -> str | None:
        """Why XNNPACK's part leaves ``node``; None where XNNPACK or ExecuTorch's portable kernels take it."""
        if node.name in self.claimed or node.name in self.portable:
            return None
        return self.reasons.get(node.name, "ExecuTorch's XnnpackPartitioner does not delegate it")


# How many of the last answers are kept: auto asks again about a method it lowers whole once it has timed XNNPACK's
# parts alone (``compile/auto.py``), and each question lowers the whole method through ExecuTorch (6 s for BERT).
REMEMBERED_ANSWERS = 4
_remembered: dict[tuple[str, bool, frozenset[str]], XnnpackAnswer] = {}


def remembered_answer(exported_program: ExportedProgram, *, portable: bool = True) -> XnnpackAnswer:
    """``xnnpack_answer``, asked only where no answer about the same program (code, weights, the buffers another
    method updates) is remembered from this process's last ``REMEMBERED_ANSWERS`` questions."""
    key = (program_fingerprint(exported_program), portable, frozenset(
        node.name for node in exported_program.graph.nodes
        if node.op == "placeholder" and UPDATED_BY_ANOTHER_METHOD in node.meta
    ))
    answer = _remembered.pop(key, None) or xnnpack_answer(exported_program, portable=portable)
    _remembered[key] = answer
    while len(_remembered) > REMEMBERED_ANSWERS:
        del _remembered[next(iter(_remembered))]
    return answer


def xnnpack_answer(exported_program: ExportedProgram, *, portable: bool = True) -> XnnpackAnswer:
    """Ask ExecuTorch's ``XnnpackPartitioner`` which nodes of ``exported_program`` (ATen dialect) it delegates.

    With ``portable``, the answer also names the ops between those that ExecuTorch can run on
    its portable kernels in the same program (``portable_between``).
    """
    edge, declined = tagged_edge_program(question_program(exported_program))
    made_from = edge_nodes_by_origin(edge, {node.name for node in exported_program.graph.nodes})
    claimed, vanished, reasons, miscomputed = set(), [], {}, set()
    fqns, weights = constant_placeholders(exported_program), program_weights(exported_program)
    for node in exported_program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        edge_nodes = made_from.get(node.name, [])
        left = [edge_node for edge_node in edge_nodes if DELEGATION_TAG not in edge_node.meta]
        wrong = (miscomputed_layer(node, fqns, weights) or unlowerable_max(node)
                 or unbounded_size(node, exported_program.range_constraints))
        if wrong is not None and edge_nodes and not left:
            reasons[node.name] = wrong
            miscomputed.add(node.name)
        elif edge_nodes and not left:
            claimed.add(node.name)
        elif not edge_nodes:
            vanished.append(node)
        else:
            reasons[node.name] = decline_reason(node, left[0], declined)
    constants = {node.name for node in fqns}
    # XNNPACK folds a quantized linear's quantize ops into its kernel, so they vanish from the
    # edge program: they rejoin their linear first, then a layer claimed only in part is left whole.
    with_vanished_ops(vanished, claimed, constants, reasons)
    executorch_reasons = dict(reasons)
    without_copies_leaving_beside_their_input(exported_program, {node.name for node in vanished}, claimed, reasons)
    with_whole_quantized_layers(exported_program, claimed, reasons)
    without_softmaxes_of_channels_last_values(exported_program, claimed, reasons)
    without_unpacked_weights(exported_program, constants, claimed, reasons)
    without_dangling_quantize_ops(exported_program, claimed, reasons)
    if not portable:
        return XnnpackAnswer(frozenset(claimed), reasons)
    # Only what ExecuTorch itself left, never what aotstack refused XNNPACK on purpose (a quantized layer, a cast).
    left_by_executorch = {name for name, reason in reasons.items()
                          if executorch_reasons.get(name) == reason and name not in miscomputed}
    stateful = state_computations(exported_program, claimed)
    for name in stateful & claimed:
        claimed.discard(name)
        reasons[name] = "it copies state (a KV cache) that stays with the engine updating it in place"
    runnable = {
        node.name for node in exported_program.graph.nodes
        if node.name in left_by_executorch and node.name not in stateful and small_tensors(node)
        and not is_quantized_arithmetic(node, constants) and runs_on_portable_kernels(made_from.get(node.name, []))
    }
    between = portable_between(exported_program.graph, claimed, runnable)
    return XnnpackAnswer(frozenset(claimed), reasons, frozenset(between))


def portable_between(graph: torch.fx.Graph, claimed: set[str], runnable: set[str]) -> set[str]:
    """The ``runnable`` nodes on a path from a claimed node to a claimed node through runnable nodes alone.

    Taking them joins XNNPACK's parts on either side into one program. A runnable node before
    XNNPACK's first op or after its last (an embedding, the positions a cache reads) is left to
    the next engine: ExecuTorch's portable kernels are plain loops, chosen only where they save
    a boundary.
    """
    nodes = [node for node in graph.nodes if node.op == "call_function"]
    after = set(claimed)
    for node in nodes:
        if node.name in runnable and any(source.name in after for source in node.all_input_nodes):
            after.add(node.name)
    before = set(claimed)
    for node in reversed(nodes):
        if node.name in runnable and any(reader.name in before for reader in node.users):
            before.add(node.name)
    return (after & before) - claimed


def state_computations(exported_program: ExportedProgram, claimed: set[str]) -> set[str]:
    """The nodes that read a buffer the method updates (a KV cache), through nodes XNNPACK leaves or that only copy it.

    They stay with the next engine, which updates the state in place: in ExecuTorch's program the
    whole cache would be copied in and out at every call, and its portable kernels (a cache update,
    attention over it) loop over all of it. A copy XNNPACK would make of the state (transformers'
    ``repeat_kv``, an expand and a clone of the cache) stays with it too, rather than making an
    XNNPACK part of its own between the cache's update and the attention reading it.
    """
    stateful = set(mutated_buffer_names(exported_program))
    for node in exported_program.graph.nodes:
        if (node.op == "call_function" and (node.name not in claimed or only_moves_values(node))
                and any(source.name in stateful for source in node.all_input_nodes)):
            stateful.add(node.name)
    return stateful


def only_moves_values(node: Node) -> bool:
    """Whether ``node`` only views, reshapes or copies its input (``view``, ``expand``, ``clone``, ...)."""
    target = node.target
    return target is operator.getitem or (
        isinstance(target, torch._ops.OpOverload) and (target.is_view or target in LAYOUT_OPS)
    )


def small_tensors(node: Node) -> bool:
    """Whether every tensor ``node`` reads or writes has at most ``PORTABLE_MAX_ELEMENTS`` elements at its largest.

    A dynamic size counts at the bound export gave it (a prefill's longest prompt); an unbounded one is not small.
    """
    values = [source.meta.get("val") for source in node.all_input_nodes] + [node.meta.get("val")]
    tensors = [value for value in pytree.tree_leaves(values) if isinstance(value, torch.Tensor)]
    return all(most_elements(tensor) <= PORTABLE_MAX_ELEMENTS for tensor in tensors)


def most_elements(tensor: torch.Tensor) -> int | float:
    """How many elements ``tensor`` has at most: its size, or for a dynamic one its upper bound (inf if none)."""
    count = tensor.numel()
    if isinstance(count, int):
        return count
    upper = count.node.shape_env.bound_sympy(count.node.expr).upper
    return int(upper) if upper.is_Integer else math.inf  # torch's int_oo is "finite" to sympy


def is_quantized_arithmetic(node: Node, constants: set[str]) -> bool:
    """Whether ``node`` is part of a quantized layer or reads integer weights as float: XNNPACK's kernels or none."""
    return (is_torchao_op(node) or quantized_layer_label(node) is not None
            or integer_weights_cast(node, lambda placeholder: placeholder.name in constants) is not None)


def runs_on_portable_kernels(edge_nodes: list[Node]) -> bool:
    """Whether ExecuTorch's runtime here has a kernel for every op of ``edge_nodes`` (none: it drops them all).

    And whether ExecuTorch's edge dialect takes each op: the claims' edge program is not checked
    (other engines' delegates are in it), a part's is, and it refuses an op outside core ATen
    (``masked_select``) though its runtime has a kernel for it.
    """
    available = runtime_operators()
    return all(
        kernel_name(node.target) in available and in_edge_dialect(node.target) and edge_dtypes_allowed(node)
        and not portable_miscomputes(node)
        for node in edge_nodes
    )


def edge_dtypes_allowed(edge_node: Node) -> bool:
    """Whether ExecuTorch's edge dialect allows the dtypes ``edge_node`` reads and makes together.

    Its dialect refuses an op on tensors of mixed dtypes that ATen promotes (an int32 remainder by
    an int64 count), and the claims' unchecked edge program keeps them.
    """
    schema = getattr(edge_node.target, "_schema", None)
    constraint = getattr(schema, "dtype_constraint", None)
    if constraint is None:
        return True
    dtypes: dict[str, torch.dtype | None] = {}
    for index, argument in enumerate(schema.arguments):
        value = edge_node.kwargs.get(argument.name, None if argument.kwarg_only or index >= len(edge_node.args)
                                     else edge_node.args[index])
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, Node) and isinstance(first.meta.get("val"), torch.Tensor):
            dtypes[argument.name] = first.meta["val"].dtype
    results = edge_node.meta.get("val")
    for index, (returned, value) in enumerate(zip(schema.returns, results if isinstance(results, (list, tuple))
                                                  else [results], strict=False)):
        if isinstance(value, torch.Tensor):
            dtypes[returned.name or f"__ret_{index}"] = value.dtype
    return bool(constraint.validate(dtypes))


def portable_miscomputes(edge_node: Node) -> bool:
    """Whether ExecuTorch's portable kernel for ``edge_node`` computes it otherwise than torch.

    ExecuTorch 1.5.1's integer ``remainder`` takes the dividend's sign, as C's ``%`` does: -14 % 5
    gives -4 where torch gives 1.
    """
    op = getattr(edge_node.target, "_op", edge_node.target)
    value = edge_node.meta.get("val")
    return (op in (torch.ops.aten.remainder.Scalar, torch.ops.aten.remainder.Tensor)
            and isinstance(value, torch.Tensor) and not value.dtype.is_floating_point)


def in_edge_dialect(target: Any) -> bool:
    """Whether ExecuTorch's verifier takes the ATen op behind ``target`` (an edge op) in a program it lowers."""
    op = getattr(target, "_op", target)
    try:
        aten_dialect_verifier().check_valid_op(op)
    except Exception:
        return False
    return True


@functools.cache
def aten_dialect_verifier() -> Any:
    """ExecuTorch's check of the ops a program it lowers may call, as ``to_edge`` makes it."""
    from executorch.exir.verification.verifier import EXIRATenDialectVerifier

    return EXIRATenDialectVerifier()


def kernel_name(target: Any) -> str | None:
    """The runtime kernel ExecuTorch calls for an edge op (``aten::add.out`` for ``aten.add.Tensor``); None if none."""
    from executorch.exir.operator.convert import to_out_variant

    # An edge op wraps its ATen op; an ATen op's own ``_op`` is its C++ function.
    op = target if isinstance(target, torch._ops.OpOverload) else getattr(target, "_op", target)
    if not isinstance(op, torch._ops.OpOverload):
        return None
    try:
        out, _ = to_out_variant(op)
    except Exception:  # no out variant: ExecuTorch's emitter refuses such an op too
        return None
    return f"{out._schema.name}.{out._overloadname}" if out._overloadname != "default" else out._schema.name


@functools.cache
def runtime_operators() -> frozenset[str]:
    """The kernels ExecuTorch's runtime here has (``aten::add.out``, ...)."""
    return frozenset(runtime_module()._get_operator_names())


def with_vanished_ops(vanished: list[Node], claimed: set[str], constants: set[str], reasons: dict[str, str]) -> None:
    """Claim, in place, each op ExecuTorch's edge program drops that reads only what XNNPACK has; say why of others.

    ExecuTorch removes what computes nothing for it (metadata asserts, contiguous clones, casts to
    the dtype a tensor has) and folds what only constants feed. After ops XNNPACK takes, such an
    op goes with them rather than splitting their part. One reading anything else (a user input,
    an op left elsewhere) is not claimed: in a part of its own it would no longer fold away.
    """
    pending = list(vanished)
    while pending:
        joined = [
            node for node in pending
            if all(source.name in claimed or source.name in constants for source in node.all_input_nodes)
            and any(source.name in claimed for source in neighbours(node))
        ]
        if not joined:
            break
        claimed.update(node.name for node in joined)
        pending = [node for node in pending if node not in joined]
    for node in pending:
        reasons[node.name] = "ExecuTorch's edge program drops it, and it reads what XNNPACK does not take"


def without_copies_leaving_beside_their_input(
    exported_program: ExportedProgram, dropped: set[str], claimed: set[str], reasons: dict[str, str]
) -> None:
    """Unclaim, in place, each copy that would leave XNNPACK's part beside the value it copies.

    ExecuTorch drops a copy that changes nothing (a clone; the ``dropped`` ops, which vanish from
    its edge program); where both the copy and its input are read outside the part, the part
    would return one value twice, and XNNPACK refuses a part whose output is another's
    ("already in the inputs"). Left to the next engine, the copy costs one copy.
    """
    changed = True
    while changed:
        changed = False
        for node in exported_program.graph.nodes:
            if (node.name in claimed and (node.name in dropped or node.target in SAME_VALUE_COPIES)
                    and read_outside(node, claimed)
                    and any(source.name in claimed and read_outside(source, claimed, node)
                            for source in node.all_input_nodes)):
                claimed.discard(node.name)
                reasons[node.name] = "it copies a value that leaves XNNPACK's part beside the copy, which XNNPACK drops"
                changed = True


# Copies XNNPACK's lowering removes from its graph.
SAME_VALUE_COPIES = (torch.ops.aten.clone.default, torch.ops.aten.alias.default)


def read_outside(value: Node, claimed: set[str], besides: Node | None = None) -> bool:
    """Whether a node other than ``besides`` and outside ``claimed`` reads ``value``."""
    return any(reader is not besides and reader.name not in claimed for reader in readers(value))


def neighbours(node: Node) -> list[Node]:
    """The nodes ``node`` reads and those that read it, looking through getitems."""
    return [*node.all_input_nodes, *readers(node)]


# The quantized linears XNNPACK's kernels compute as torchao does, by ``quantized_layer_label``'s name
# for them: int8 activations quantized per row as the model runs, over 4-bit weights per channel or
# in groups, or 8-bit weights per channel (XNNPACK's qd8-f32-qc4w, -qb4w and -qc8w), all symmetric.
# ExecuTorch 1.5.1's XnnpackPartitioner claims more, measured with ExecuTorch alone and through
# aotstack (torchao 0.18's configs on a small MLP), and XNNPACK gets each of them wrong:
# - weight-only linears of any width (``IntxWeightOnlyConfig``: int2 to int8) compute garbage, errors
#   of 1e3 to 1e7 on outputs below 1;
# - 8-bit weights in groups fail to lower ("Only 4b group quantization is supported");
# - asymmetric weights (``weight_mapping_type=ASYMMETRIC``) lose their zero points: errors of 7% (8-bit)
#   and 38% (4-bit in groups) of the output's range.
# - 4-bit weights in groups of other than a multiple of 32 inputs, or per channel over such a number of
#   inputs, fail to lower ("Delegation to XNNPACK requires group_size to be a multiple of 32").
# Everything else is left to the next engine.
XNNPACK_LINEARS = ("linear 8da4w, ", "linear 8da8w, per channel")
# The blocks XNNPACK's 4-bit kernels take (a group, or a row per channel) are multiples of this many inputs.
XNNPACK_BLOCK_MULTIPLE = 32


def miscomputed_layer(node: Node, fqns: dict[Node, str], weights: dict[str, torch.Tensor]) -> str | None:
    """Why XNNPACK must not take ``node``, a quantized linear outside its kernels' reach; else None."""
    label = quantized_layer_label(node)
    if label is None or not label.startswith("linear"):
        return None
    if not label.startswith(XNNPACK_LINEARS):
        return (f"XNNPACK's quantized kernels take only 8da4w and per-channel 8da8w linears and compute this one "
                f"({label}) wrongly, though ExecuTorch's partitioner claims it")
    dequantize = node.args[1]
    block = four_bit_block(dequantize)
    if block is not None and block % XNNPACK_BLOCK_MULTIPLE:
        return (f"XNNPACK's 4-bit kernels take blocks of a multiple of {XNNPACK_BLOCK_MULTIPLE} inputs, and this "
                f"layer's are of {block} ({label}): ExecuTorch fails to lower it, though its partitioner claims it")
    if is_dequantize(dequantize) and not zero_free(dequantize_zero_point(dequantize), fqns, weights):
        return (f"XNNPACK's quantized kernels take only symmetric weights and would drop this layer's zero points "
                f"({label}, asymmetric), though ExecuTorch's partitioner claims it")
    return None


def unbounded_size(node: Node, ranges: dict[Any, ValueRanges]) -> str | None:
    """Why ExecuTorch cannot plan ``node``'s memory: a size of its result with no upper bound in the program's
    ``ranges`` (audio of any length, exported with ``Dim.DYNAMIC``); else None. The next engine takes it.

    The program's own ranges, not the size's shape environment: asking ExecuTorch about the program narrows those.
    """
    for value in pytree.tree_leaves(node.meta.get("val")):
        if not isinstance(value, torch.Tensor):
            continue
        for size in value.shape:
            if isinstance(size, torch.SymInt) and bound_sympy(size.node.expr, ranges).upper is int_oo:
                return (f"a size of its result ({size}) has no upper bound, and ExecuTorch plans a program's memory "
                        "for the largest sizes it takes")
    return None


def unlowerable_max(node: Node) -> str | None:
    """Why ExecuTorch fails to lower ``node``, a ``max.dim`` its partitioner claims, to XNNPACK; else None.

    The partitioner claims a max over any dimension of a 4-D tensor; XNNPACK's lowering takes only
    one over its height or width (dimension 2 or 3, as ``compile.maxima_over_counted_dims`` counts
    them), kept as a dimension. GPT-OSS's attention takes its scores' max over the last one.
    """
    if node.target is not torch.ops.aten.max.dim:
        return None
    dims = node.args[0].meta["val"].dim()
    keeps = len(node.args) > 2 and node.args[2] is True
    if dims == 4 and node.args[1] % dims in (2, 3) and keeps:
        return None
    return ("XNNPACK's max takes only a 4-D tensor's max over dimension 2 or 3, kept as a dimension; ExecuTorch "
            "fails to lower this one, though its partitioner claims it")


aten = torch.ops.aten
# Ops whose 4-D results ExecuTorch lays out channels-last in XNNPACK's program (its ChannelsLastTaggedReshapePass)...
CHANNELS_LAST_OPS = frozenset({
    aten.convolution.default, aten.conv2d.default, aten.max.dim, aten.amax.default, aten.mean.dim,
    aten.max_pool2d.default, aten.max_pool2d_with_indices.default, aten.avg_pool2d.default,
    aten.adaptive_avg_pool2d.default, aten.upsample_bilinear2d.vec, aten.prelu.default,
})
# ...and ops that take their inputs back to channels-first; the others pass the layout on.
CHANNELS_FIRST_OPS = frozenset({
    aten.linear.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
})
SOFTMAXES = frozenset({aten.softmax.int, aten._softmax.default})


def without_softmaxes_of_channels_last_values(
    exported_program: ExportedProgram, claimed: set[str], reasons: dict[str, str]
) -> None:
    """Leave each 4-D softmax whose input XNNPACK's program would hold channels-last.

    ExecuTorch keeps a value channels-last from an op that makes it so (a convolution, a pooling,
    a max over one dimension) through the ops after it, and its softmax then normalizes over the
    channels, not the last dimension: GPT-OSS's attention (``softmax(scores - scores.max(-1))``)
    was wrong by 0.5. The softmax runs in the next engine; what is before it stays.
    """
    nodes = {node.name: node for node in exported_program.graph.nodes}
    for name in sorted(claimed):
        node = nodes[name]
        if node.target not in SOFTMAXES or node.args[0].meta["val"].dim() != 4:
            continue
        if channels_last_in_xnnpack(node.args[0], claimed):
            claimed.discard(name)
            reasons[name] = ("ExecuTorch would hold its input channels-last in XNNPACK's program and normalize over "
                             "the channels, not its last dimension")


def channels_last_in_xnnpack(value: Node, claimed: set[str]) -> bool:
    """Whether ``value``, computed in XNNPACK's program, comes channels-last from an op there making it so."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if node.target is operator.getitem:  # a piece of a claimed op's result: as claimed as the op
            node = node.args[0]
        if node.name in seen or node.name not in claimed or node.target in CHANNELS_FIRST_OPS:
            continue
        seen.add(node.name)
        if node.target in CHANNELS_LAST_OPS:
            return True
        pending.extend(node.all_input_nodes)
    return False


def four_bit_block(dequantize: Node) -> int | None:
    """How many inputs share a scale in a 4-bit weight (all of them per channel), or None for other weights.

    ExecuTorch hands XNNPACK every 4-bit weight as blockwise, per channel too, so the block is what
    its kernels check.
    """
    bits_and_group = dequantized_weight(dequantize)
    if bits_and_group is None or bits_and_group[0] != 4:
        return None
    return int(dequantize.args[1][-1])


def dequantize_zero_point(dequantize: Node) -> Any:
    """The zero point operand of torchao's ``dequantize_affine(input, block_size, scale, zero_point, ...)``."""
    return dequantize.args[3] if len(dequantize.args) > 3 else dequantize.kwargs.get("zero_point")


def with_whole_quantized_layers(exported_program: ExportedProgram, claimed: set[str], reasons: dict[str, str]) -> None:
    """Leave, in place, each claimed quantized linear whose quantize ops ExecuTorch's answer does not all claim.

    XNNPACK runs a quantized linear as one kernel over its weight's dequantize and its
    activations' quantize round; given the linear without the round it computes something else
    or cannot lower the part. Such a layer goes whole to the next engine (the round without its
    linear is ``without_dangling_quantize_ops``'s case).
    """
    for node in exported_program.graph.nodes:
        label = quantized_layer_label(node)
        if label is None or not label.startswith("linear"):
            continue
        layer = quantized_layer_nodes(node)
        if node.name in claimed and not all(member.name in claimed for member in layer):
            for member in layer:
                claimed.discard(member.name)
                reasons[member.name] = (f"ExecuTorch's XnnpackPartitioner claims only part of this quantized layer "
                                        f"({label}, at {node.name}); it is left whole to the next engine")


def without_unpacked_weights(
    exported_program: ExportedProgram, constants: set[str], claimed: set[str], reasons: dict[str, str]
) -> None:
    """Leave, in place, each ``Int8Tensor`` linear whole, and any other cast of integer weights to float.

    ExecuTorch's partitioner takes an ``Int8Tensor`` linear's float ops (``mm`` over a cast of its
    int8 weights, the scale products) but not its ``_int_mm`` or quantize ops, and folds a cast of
    a constant into a float constant: XNNPACK would compute the layer on float weights, unpacked,
    or split it between engines. Such a layer goes whole to the next engine.
    """
    for layer in int8_linears(exported_program.graph):
        for member in layer.members:
            claimed.discard(member.name)
            reasons[member.name] = (f"XNNPACK has no packed kernel for torchao's Int8Tensor linear ({layer.label}, "
                                    f"at {layer.matmul.name}); it is left whole to the next engine")
    for node in exported_program.graph.nodes:
        weights = integer_weights_cast(node, lambda placeholder: placeholder.name in constants)
        if node.name in claimed and weights is not None:
            claimed.discard(node.name)
            reasons[node.name] = (f"it converts the integer weights {weights.name!r} to float; XNNPACK would hold "
                                  "them as float weights, unpacked")


def quantized_layer_nodes(linear: Node) -> list[Node]:
    """A quantized linear and the torchao ops that make its operands: weight dequantize, activation quantize round."""
    layer, pending = [linear], [argument for argument in linear.args[:2] if isinstance(argument, Node)]
    while pending:
        node = pending.pop()
        if node in layer:
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            pending.append(node.args[0])
        elif is_torchao_op(node):
            layer.append(node)
            pending.extend(node.all_input_nodes)
    return [node for node in layer if node.op == "call_function"]


def without_dangling_quantize_ops(
    exported_program: ExportedProgram, claimed: set[str], reasons: dict[str, str]
) -> None:
    """Leave, in place, each claimed torchao quantize op whose results no claimed op reads.

    ExecuTorch takes these ops only as part of the quantized op they feed (a linear, with its
    weight's dequantize and its activations' quantize round); left alone in a part, XNNPACK has
    nothing to fold them into.
    """
    changed = True
    while changed:
        changed = False
        for node in reversed(exported_program.graph.nodes):
            if node.name not in claimed or not is_torchao_op(node):
                continue
            if not any(reader.name in claimed for reader in readers(node)):
                claimed.discard(node.name)
                reasons[node.name] = ("ExecuTorch's XnnpackPartitioner takes it only with the quantized op it feeds, "
                                      "which XNNPACK does not take here")
                changed = True


def readers(node: Node) -> list[Node]:
    """The nodes that read ``node``'s results, looking through the getitems that pick them."""
    found = []
    for user in node.users:
        found += list(user.users) if user.target is operator.getitem else [user]
    return found


def is_torchao_op(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "torchao"


def question_program(exported_program: ExportedProgram) -> ExportedProgram:
    """The program ExecuTorch is asked about: ``exported_program`` as one partition of all it offers.

    Made the way a part is made for compiling (``partition_program``), so the question is the
    one the compile side will ask: what earlier engines took is cut out (a delegate call cannot
    be traced; each of its outputs becomes an input, as it is one of whatever reads it), and
    each ``view`` is a ``reshape`` (ExecuTorch's decompositions may give a tensor another layout,
    where the exported ``view`` would fail). Nodes keep their names, so the answer maps back.
    """
    offered = [node for node in get_non_lowered_nodes(exported_program.graph) if not is_size_computation(node)]
    question = partition_program(exported_program, offered).program
    contiguous_attention_outputs(question)
    as_provenance_roots(question)
    return question


def as_provenance_roots(question: ExportedProgram) -> None:
    """Forget where ``question``'s nodes came from, so each edge node's provenance ends at them.

    A program that was itself decomposed (``aotstack.Program`` makes transformers' in-place
    cache programs and torchao's subclass weights functional) remembers the nodes of the program
    before it; their names are another graph's (a quantized linear's ``choose_qparams_affine_4``
    traces back to that graph's ``linear_4``), and matching those roots against this program's
    names pinned edge nodes on the wrong ATen nodes. ``partition_program`` copied each node's
    ``meta`` dict, so the program asked about keeps its own provenance.
    """
    for node in question.graph.nodes:
        node.meta.pop("from_node", None)


def decline_reason(node: Node, edge_node: Node, declined: dict[Node, str]) -> str:
    """Why XNNPACK leaves ``edge_node``, one of the edge nodes made from ``node``, in words."""
    op = edge_op_name(edge_node)
    own = str(node.target) == op
    where = "" if own else f" (ExecuTorch turns it into {op}, which it leaves)"
    reason = declined.get(edge_node)
    if reason is not None:
        return f"ExecuTorch's XnnpackPartitioner declines it{where}: {reason}"
    return f"ExecuTorch's XnnpackPartitioner does not delegate it{where}"


def edge_op_name(node: Node) -> str:
    """``aten.linear.default`` for an edge op, which prints with its schema."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        target = getattr(target, "_op", target)
    return str(target)


def edge_nodes_by_origin(edge: ExportedProgram, names: set[str]) -> dict[str, list[Node]]:
    """ATen node name -> the edge nodes made from it, read from each edge node's ``from_node`` provenance."""
    found: dict[str, list[Node]] = {}
    for node in edge.graph.nodes:
        if node.op != "call_function":
            continue
        for origin in origin_names(node.meta.get("from_node") or []):
            if origin in names:
                found.setdefault(origin, []).append(node)
    return found


def origin_names(sources: list[Any]) -> set[str]:
    """The names at the roots of a node's provenance: the nodes of the first program it was made from."""
    roots, pending = set(), list(sources)
    while pending:
        source = pending.pop()
        parents = getattr(source, "from_node", None) or []
        if parents:
            pending.extend(parents)
        else:
            roots.add(source.name)
    return roots


def tagged_edge_program(exported_program: ExportedProgram) -> tuple[ExportedProgram, dict[Node, str]]:
    """The edge program ``to_edge_transform_and_lower`` would hand XNNPACK's partitioner, tagged by it.

    With the reason XNNPACK's configs gave for each edge node they declined.
    """
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    asker = asker_for(XnnpackPartitioner())
    try:
        with quiet_executorch(), torch.no_grad():
            # Validity is not checked: the program may call delegates other engines took, which are not core ATen.
            to_edge_transform_and_lower(
                exported_program, partitioner=[asker], compile_config=EdgeCompileConfig(_check_ir_validity=False)
            )
    except Answered as answered:
        return answered.edge, answered.declined
    except Exception as error:
        raise LoweringError(f"ExecuTorch could not make the edge program XNNPACK's partitioner reads: {error}") from (
            error
        )
    raise LoweringError("ExecuTorch's to_edge_transform_and_lower never asked XNNPACK's partitioner")


class Answered(Exception):
    """Raised by the stand-in partitioner with the tagged edge program, to stop lowering once it is known."""

    def __init__(self, edge: ExportedProgram, declined: dict[Node, str]) -> None:
        super().__init__("XNNPACK's partitioner has answered")
        self.edge = edge
        self.declined = declined


def asker_for(partitioner: Any) -> Any:
    """A partitioner that decomposes as ``partitioner`` asks, lets it tag the edge program, and raises ``Answered``."""
    from executorch.exir.backend.partitioner import Partitioner

    class _Asker(Partitioner):
        def __init__(self) -> None:
            super().__init__()

        def ops_to_not_decompose(self, program: ExportedProgram) -> Any:
            return partitioner.ops_to_not_decompose(program)

        def transform_for_pre_decomposition(self, program: ExportedProgram) -> ExportedProgram:
            return partitioner.transform_for_pre_decomposition(program)

        def partition(self, program: ExportedProgram) -> Any:
            for node in program.graph.nodes:
                # aotstack tags with the same key; a tag left on the edge program would stop ExecuTorch's partitioner.
                node.meta.pop(DELEGATION_TAG, None)
            with declines_recorded() as declined:
                partitioner.partition(program)
            raise Answered(program, declined)

    return _Asker()


@contextmanager
def declines_recorded() -> Iterator[dict[Node, str]]:
    """Collect, by edge node, the reasons XNNPACK's configs log for the nodes they decline."""
    declined: dict[Node, str] = {}

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # ``WhyNoPartition`` logs itself; it is one object reused for every node, so it is read now.
            node, reason = getattr(record.msg, "node", None), getattr(record.msg, "reason", None)
            if isinstance(node, Node) and isinstance(reason, str):
                declined.setdefault(node, reason)

    logger = logging.getLogger(WHY_LOGGER)
    recorder, level, propagate = Recorder(logging.DEBUG), logger.level, logger.propagate
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    # The records are the answer's, not the user's log.
    logger.propagate = False
    try:
        yield declined
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        logger.propagate = propagate


@contextmanager
def quiet_executorch() -> Iterator[None]:
    """ExecuTorch's own warnings while it works (deprecations in torch and importlib it calls) are not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
