"""``OrtPartitioner``: claims the ops the dynamo ONNX exporter can translate."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node
from torch.fx.operator_schemas import normalize_function
from torch.utils._pytree import tree_leaves

from ...compile.partitioner import CONTROL_FLOW_OPS, MIN_ISLAND_WORK, PartitionResult, SupportedOpsPartitioner
from ...compile.program_parts import constant_placeholders
from ...errors import LoweringError
from ...format.op_names import OpName, matches_any, normalized_op_name
from ...format.placement import Reason
from ...format.specs import CompileSpec, SpecKey
from .backend import QUANTIZED_ACTIVATIONS, OrtBackend
from .backend import quantized_activations as quantized_activations_spec
from .compile import EXPORTER_REGISTRATION_LOGGER, quieted
from .packages import require_packages
from .quantized import QuantizedGraph, quantized_graph
from .run import providers as providers_named

# What ``quantized_refusal`` answers for a node of no quantized layer.
NOT_QUANTIZED = object()

# Nodes the exporter drops instead of translating.
_DROPPED_BY_EXPORTER = frozenset({
    "aten._assert_scalar.default",
    "aten._assert_async.msg",
    "aten._assert_tensor_metadata.default",
    "aten.sym_constrain_range_for_size.default",
})


class OrtPartitioner(SupportedOpsPartitioner):
    """Claims, for ONNX Runtime, every op the ONNX exporter can translate.

    ``ops`` narrows that to a set, named like ``"aten.linear"`` or given as op objects;
    ``providers`` picks ONNX Runtime's execution providers in priority order. A part lighter than
    ``min_island_work`` beside ops left to others is left too (``SupportedOpsPartitioner``).

    torchao-quantized linears and embeddings (``aotstack.quantize``) are claimed whole, with
    their quantize and dequantize ops, and run on ONNX Runtime's packed-weight kernels
    (``MatMulNBits``, ``DynamicQuantizeMatMul``, ``GatherBlockQuantized``; see ``quantized.py``).
    By default weight-only linears (``8w``, ``4w``) keep float activations, so they match eager
    to float rounding: ``4w`` runs on ``MatMulNBits`` (2x faster than float32 at 4096x4096),
    while ``8w`` is refused, for another engine, as ONNX Runtime's only float-activation 8-bit
    kernel is 30x slower than float32. ``quantized_activations=True`` lets them quantize their
    activations to int8 in blocks along the input dimension, as ``8da`` schemes do: ``4w`` then
    runs 2.5x faster again and ``8w`` 3.7x faster than float32, at the cost of about one int8
    step of each activation against eager.

    Example::

        lowered = aotstack.lower(program, [OrtPartitioner(ops=["aten.linear"]), AotiCpuPartitioner()])
    """

    backend_id = OrtBackend.backend_id

    def __init__(
        self,
        ops: Iterable[OpName] | None = None,
        providers: Iterable[str] | None = None,
        compile_specs: Iterable[CompileSpec] = (),
        *,
        min_block_size: int = 1,
        min_island_work: int = MIN_ISLAND_WORK,
        quantized_activations: bool = False,
    ) -> None:
        specs = list(compile_specs)
        if providers is not None:
            specs.append(CompileSpec(SpecKey.PROVIDERS, ",".join(providers).encode()))
        if quantized_activations:
            specs.append(CompileSpec(QUANTIZED_ACTIVATIONS, b"on"))
        super().__init__(min_block_size=min_block_size, min_island_work=min_island_work, compile_specs=specs)
        require_packages(("onnx", "onnxscript"), "OrtPartitioner needs {missing}", LoweringError)
        self.ops = None if ops is None else frozenset(normalized_op_name(op, "ops") for op in ops)
        self.quantized_activations = quantized_activations_spec(self.compile_specs)
        # While ``partition`` runs: the quantized layers of each graph it looks at, worked out once,
        # and the names of the program's weight placeholders.
        self.quantized: dict[Graph, QuantizedGraph] = {}
        self.weight_names: dict[Graph, frozenset[str]] = {}
        self.computable = computable_dtypes(tuple(providers_named(self.compile_specs)))

    @functools.cached_property
    def control_flow(self) -> frozenset[str]:  # type: ignore[override]
        """The control-flow ops the exporter translates; asked at the first control-flow node, not as the partitioner
        is made: the exporter's table takes 1-3 s to build, and auto makes its partitioners before it starts
        AOTInductor's warm-up."""
        registry = exporter_registry()
        return frozenset(
            name for name in CONTROL_FLOW_OPS
            if hasattr(torch.ops.higher_order, name) and registry.is_registered(getattr(torch.ops.higher_order, name))
        )

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        self.quantized = {}
        self.weight_names = {
            exported_program.graph: frozenset(node.name for node in constant_placeholders(exported_program))
        }
        try:
            return super().partition(exported_program)
        finally:
            self.quantized, self.weight_names = {}, {}

    def node_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        quantized = self.quantized_refusal(node, owner)
        if quantized is not NOT_QUANTIZED:
            return quantized
        uncomputable = sorted(
            {str(dtype).removeprefix("torch.") for dtype in node_dtypes(node) if dtype not in self.computable}
        )
        if uncomputable:
            return self.refusal(
                "unsupported",
                f"ONNX Runtime's {', '.join(providers_named(self.compile_specs))} has no arithmetic kernels "
                f"for {', '.join(uncomputable)}",
            )
        limited = translation_limit(node)
        if limited is not None:
            return self.refusal("unsupported", limited)
        refused = super().node_refusal(node, owner)
        if refused is not None and refused.detail == UNTRACEABLE and isinstance(node.target, torch._ops.OpOverload):
            # The schema's stand-in arguments do not fit every op (an index must be an integer tensor);
            # the node's own do.
            return self.op_refusal_for(node.target, node_arguments(node))
        return refused

    def quantized_refusal(self, node: Node, owner: GraphModule) -> Reason | None | object:
        """For a node of a quantized layer: None when ONNX Runtime takes the layer, else why not.

        ``NOT_QUANTIZED`` for any other node. A taken layer's nodes go with its linear or
        embedding, so ``ops=`` decides for all of them.
        """
        graph = owner.graph
        if graph not in self.quantized:
            # A control-flow subgraph's placeholders are operands, not weights.
            names = self.weight_names.get(graph, frozenset())
            self.quantized[graph] = quantized_graph(graph, names, self.quantized_activations)
        analysis = self.quantized[graph]
        if node in analysis.refusals:
            return self.refusal("unsupported", analysis.refusals[node])
        layer = analysis.layer_of().get(node)
        if layer is None:
            return NOT_QUANTIZED
        return self.op_refusal(layer.op)

    def op_refusal_for(self, op: torch._ops.OpOverload, arguments: CallStandIn | None) -> Reason | None:
        untranslatable = UNTRACEABLE if arguments is None else exporter_refusal(op, arguments)
        return None if untranslatable is None else self.refusal("unsupported", untranslatable)

    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        return self.op_refusal(op) is None

    def op_refusal(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> Reason | None:
        if self.ops is not None and not matches_any(op, self.ops):
            return self.refusal("excluded", "the user's ops= list does not name it")
        untranslatable = exporter_refusal(op)
        return None if untranslatable is None else self.refusal("unsupported", untranslatable)


def translation_limit(node: Node) -> str | None:
    """Why the ONNX exporter's translation of ``node``'s op refuses its arguments, where it has one that does."""
    if node.target is torch.ops.aten.histc.default:
        # The translation fixes the bins' edges when it is made; with min == max torch takes them from the data.
        arguments = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        low, high = (arguments.kwargs["min"], arguments.kwargs["max"]) if arguments else (None, None)
        if low == high:
            return "the ONNX exporter's histc needs its range given (min < max); this one takes the data's"
    return None


def node_dtypes(node: Node) -> set[torch.dtype]:
    """The dtypes of the tensors ``node`` reads and computes; bool masks left out, as every provider passes them."""
    values = [node.meta.get("val")]
    values += [arg.meta.get("val") for arg in node.all_input_nodes if arg.op != "get_attr"]
    return {
        leaf.dtype
        for leaf in tree_leaves(values)
        if isinstance(leaf, torch.Tensor) and leaf.dtype is not torch.bool
    }


@functools.cache
def computable_dtypes(providers: tuple[str, ...]) -> frozenset[torch.dtype]:
    """The dtypes ``providers`` compute in: those of their kernels for the basic arithmetic ops.

    Asked of ONNX Runtime's own kernel registry, so a provider with bf16 or fp16 kernels
    (CUDA's) takes such parts and the CPU provider, which has none for ``Add``, declines them.
    A provider this onnxruntime does not have may exist where the file is loaded: its parts are
    not refused by dtype here.
    """
    require_packages(("onnxruntime",), "OrtPartitioner needs {missing}", LoweringError)
    from onnxruntime.capi import _pybind_state

    kernels = _pybind_state.get_all_opkernel_def()
    if not set(providers) <= {kernel.provider for kernel in kernels}:
        return frozenset(_ONNX_TENSOR_TYPES.values())
    by_op: dict[str, set[str]] = {op: set() for op in _ARITHMETIC}
    for kernel in kernels:
        if kernel.provider in providers and kernel.op_name in by_op and kernel.domain in ("", "ai.onnx"):
            for types in kernel.type_constraints.values():
                by_op[kernel.op_name].update(types)
    names = set.intersection(*by_op.values())
    return frozenset(dtype for name, dtype in _ONNX_TENSOR_TYPES.items() if f"tensor({name})" in names)


# A provider computes in a dtype when it has kernels in it for each of these.
_ARITHMETIC = ("Add", "Mul")
_ONNX_TENSOR_TYPES = {
    "float": torch.float32, "double": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
}


UNTRACEABLE = "the ONNX exporter's decomposition of it could not be traced"


@functools.cache
def exporter_refusal(
    op: torch._ops.OpOverload | torch._ops.HigherOrderOperator, arguments: CallStandIn | None = None
) -> str | None:
    """Why the ONNX exporter cannot translate ``op``; None where it has a translation, direct or by decomposing.

    A decomposition counts only when everything it decomposes into has a translation
    (``lgamma`` decomposes to ``prims.lgamma``, which has none); it is traced on ``arguments``
    (hashable stand-ins, see ``node_arguments``), or on stand-ins built from the schema.
    """
    if str(op) in _DROPPED_BY_EXPORTER or exporter_registry().is_registered(op):
        return None
    decomposition = exporter_decompositions().get(op)
    if decomposition is None:
        return "the ONNX exporter has no translation for it"
    missing = sorted(
        {
            str(inner)
            for inner in decomposed_ops(op, decomposition, arguments)
            if not exporter_registry().is_registered(inner)
        }
    )
    if not missing:
        return None
    if missing == ["None"]:
        return UNTRACEABLE
    return f"it decomposes into ops the ONNX exporter cannot translate: {', '.join(missing)}"


@dataclass(frozen=True)
class TensorStandIn:
    """A tensor argument by dtype and shape: hashable, so a refusal is worked out once per signature."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ListStandIn:
    """A list argument (a convolution's stride, the tensors ``meshgrid`` takes), each item a stand-in."""

    items: tuple[Any, ...]


@dataclass(frozen=True)
class CallStandIn:
    """A node's arguments as stand-ins (``stand_in``): hashable, so a refusal is worked out once per signature."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


def node_arguments(node: Node) -> CallStandIn | None:
    """``node``'s arguments as stand-ins; None where one cannot stand in."""
    args = tuple(stand_in(argument) for argument in node.args)
    kwargs = tuple((name, stand_in(argument)) for name, argument in sorted(node.kwargs.items()))
    if any(argument is UNREPRESENTABLE for argument in (*args, *(argument for _, argument in kwargs))):
        return None
    return CallStandIn(args, kwargs)


# What ``stand_in`` gives for an argument no stand-in represents.
UNREPRESENTABLE = object()


def stand_in(argument: Any) -> Any:
    """A tensor by dtype and static shape, a list item by item, a plain value as it is.

    ``UNREPRESENTABLE`` for a tensor of symbolic shape, or a node whose value is neither a tensor nor a number.
    """
    if isinstance(argument, list | tuple):
        items = tuple(stand_in(item) for item in argument)
        return UNREPRESENTABLE if any(item is UNREPRESENTABLE for item in items) else ListStandIn(items)
    value = argument.meta.get("val") if isinstance(argument, Node) else argument
    if isinstance(value, torch.Tensor):
        if not all(isinstance(size, int) for size in value.shape):
            return UNREPRESENTABLE
        return TensorStandIn(value.dtype, tuple(value.shape))
    if isinstance(argument, Node) and not isinstance(value, int | float | bool):
        return UNREPRESENTABLE
    return value


def decomposed_ops(op: torch._ops.OpOverload, decomposition: Any, stand_ins: CallStandIn | None) -> list[Any]:
    """The ops ``decomposition`` calls, traced on meta tensors for ``stand_ins`` or on arguments from the schema."""
    # A decomposition's ops can depend on its arguments; a trace on meta tensors of the
    # schema's types is a good per-op answer, and an op that cannot be traced is not claimed.
    from torch.fx.experimental.proxy_tensor import make_fx

    keywords: dict[str, Any] = {}
    if stand_ins is None:
        arguments = example_arguments(op)
    else:
        arguments = [standing_for(argument) for argument in stand_ins.args]
        keywords = {name: standing_for(argument) for name, argument in stand_ins.kwargs}
    if arguments is None:
        return [None]
    try:
        traced = make_fx(lambda *args: decomposition(*args, **keywords),
                         decomposition_table=exporter_decompositions())(*arguments)
    except Exception:
        return [None]
    return [node.target for node in traced.graph.nodes if node.op == "call_function"]


def standing_for(argument: Any) -> Any:
    """The argument a stand-in stands for: a meta tensor of its dtype and shape, a list of those, or the value."""
    if isinstance(argument, TensorStandIn):
        return torch.empty(argument.shape, dtype=argument.dtype, device="meta")
    if isinstance(argument, ListStandIn):
        return [standing_for(item) for item in argument.items]
    return argument


def example_arguments(op: torch._ops.OpOverload) -> list[Any] | None:
    arguments = []
    for argument in op._schema.arguments:
        if argument.kwarg_only and argument.has_default_value():
            continue
        kind = str(argument.type)
        if kind == "Tensor":
            arguments.append(torch.rand(2, 3))
        elif argument.has_default_value():
            arguments.append(argument.default_value)
        elif kind in ("int", "SymInt"):
            arguments.append(1)
        elif kind == "float":
            arguments.append(0.5)
        elif kind == "bool":
            arguments.append(False)
        else:
            return None
    return arguments


@functools.cache
def exporter_registry() -> Any:
    """The ONNX exporter's table of translations (about 1 s to build, so built once)."""
    from torch.onnx._internal.exporter import _registration

    with quieted(EXPORTER_REGISTRATION_LOGGER):
        return _registration.ONNXRegistry.from_torchlib()


@functools.cache
def exporter_decompositions() -> dict[Any, Any]:
    """The decompositions the exporter applies before translating."""
    from torch.onnx._internal.exporter import _decomp

    translated = set(_decomp.get_onnx_implemented_overloads(exporter_registry()))
    return _decomp.create_onnx_friendly_decomposition_table(translated)
