"""What OpenVINO's PyTorch frontend converts, and what its CPU plugin runs as torch does, asked of OpenVINO.

``openvino.convert_model`` takes an ExportedProgram in two steps, and a partition goes the same
way (``compile.py``): ``run_decompositions`` with OpenVINO's table (torch's core-ATen
decompositions, less the ops OpenVINO lists in ``ops_to_not_decompose`` to convert whole), then
one conversion rule per op of the result. So an op converts where

- OpenVINO keeps it whole and its frontend has a rule for it, or
- OpenVINO decomposes it and each op of its decomposition has a rule.

The frontend keeps its rules in C++ and lists none in Python, but a failed conversion sorts the
ops it could not convert into those it has no rule for ("No conversion rule found for
operations: ...") and those whose rule failed ("Conversion is failed for: ..."). A rule is looked
up by the op's name before any argument is read, so ``has_conversion_rule`` converts a graph of
one call of the op without arguments and reads which list names it (about a millisecond, cached
per op). A decomposition can depend on its arguments, so it is traced per node, on meta
tensors shaped like the node's own, and cached per op and argument signature.

Dtypes: the frontend's own table says which torch dtypes it has an element type for. Two it has
are not run as torch runs them by OpenVINO's CPU plugin: float64, which it computes in float32,
and int64, which it computes in int32. float64 is refused; int64 is taken (token ids, positions
and indices need it), except by a node that holds an int64 value beyond int32 as a literal.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from ...compile.pooling import pooling_window
from ...compile.program_parts import node_tensors
from .run import ELEMENT_TYPES

# The CPU plugin computes these in a narrower type; results would not be torch's.
_NARROWED = {torch.float64: "OpenVINO's CPU plugin computes float64 in float32"}
INT32 = range(-(2**31), 2**31)
# How a failed conversion lists the ops whose rule ran and failed (those without one are listed apart).
_RULE_FAILED = re.compile(r"Conversion is failed for: ([^\n]*)")


# Ops the frontend lists as converted whole whose rule fails on the graphs torch.export writes: its rule for
# ``index_add`` wants ``alpha``, which export leaves out at its default (JetMoE's experts).
DECOMPOSED_ANYWAY = frozenset({torch.ops.aten.index_add.default})


def decompositions() -> Any:
    """OpenVINO's decomposition table for ExportedPrograms: core ATen, less the ops its frontend converts whole.

    With one of aotstack's own: ``_int_mm`` (torchao's ``Int8DynamicActivationInt8WeightConfig``
    computes its linears with it), which the frontend has no rule for. Built again once a library
    registers ops in a namespace of its own (torchao imported after a first lowering): a table
    built before lacks their decompositions, and OpenVINO would refuse torchao's dequantizations.
    """
    return decompositions_with(frozenset(torch.ops))


@functools.cache
def decompositions_with(namespaces: frozenset[str]) -> Any:
    from openvino.frontend.pytorch.torchdynamo.export_decompositions import ops_to_not_decompose
    from torch.export.decomp_utils import CustomDecompTable

    table = CustomDecompTable()
    for op in ops_to_not_decompose():
        if op not in DECOMPOSED_ANYWAY:
            table.pop(op, None)
    table[torch.ops.aten._int_mm.default] = int_mm_in_float
    return table


def int_mm_in_float(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_int_mm`` as a float matmul of int8 operands: exact while a sum stays within float32's 24-bit integers.

    A sum of ``K`` products of int8 values is at most ``128 * 128 * K``, so up to ``K = 1024``
    always; beyond, a partial sum over 2**24 may round by one part in 2**24. OpenVINO reads a
    constant int8 operand as compressed weights, converted in its matmul kernel.
    """
    return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(torch.int32)


def decomposition_functions() -> dict[Any, Any]:
    """The same table as a plain dict, for tracing one op's decomposition."""
    return decomposition_functions_with(frozenset(torch.ops))


@functools.cache
def decomposition_functions_with(namespaces: frozenset[str]) -> dict[Any, Any]:
    return dict(decompositions_with(namespaces).items())


def decomposes(op: torch._ops.OperatorBase) -> bool:
    """Whether OpenVINO decomposes ``op`` before converting it."""
    return isinstance(op, torch._ops.OpOverload) and op in decompositions()


@functools.cache
def has_conversion_rule(op: torch._ops.OperatorBase) -> bool:
    """Whether OpenVINO's PyTorch frontend has a conversion rule for ``op``, asked with a call of the op alone."""
    from openvino.frontend import FrontEndManager
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    graph = torch.fx.Graph()
    graph.output((graph.call_function(op, ()),))
    decoder = TorchFXPythonDecoder(torch.fx.GraphModule(torch.nn.Module(), graph))
    frontend = FrontEndManager().load_by_framework("pytorch")
    try:
        # The decoder must outlive the conversion: the frontend holds it by a C++ reference only.
        frontend.convert(frontend.load(decoder))
    except Exception as error:
        # A rule that ran and failed on a call without arguments is still a rule.
        failed = _RULE_FAILED.search(str(error))
        return failed is not None and str(op) in failed.group(1).split(", ")
    return True


# Checks of a tensor's dtype, device and sizes, which the trace fixed: a partition drops them before
# converting (compile.py), as the ONNX exporter does, since the frontend has no rule for them.
DROPPED = frozenset({"aten._assert_tensor_metadata.default"})


@functools.cache
def frontend_refusal(op: torch._ops.OperatorBase) -> str | None:
    """Why OpenVINO cannot convert ``op`` wherever it appears; None where it can, or where that depends on the node."""
    if str(op) in DROPPED or decomposes(op):
        return None  # decided per node: see decomposition_refusal
    if has_conversion_rule(op):
        return None
    return "OpenVINO's PyTorch frontend has no conversion rule for it"


@functools.cache
def decomposition_refusal(op: torch._ops.OpOverload, signature: Hashable) -> str | None:
    """Why the ops OpenVINO decomposes ``op`` into, for arguments like ``signature``, do not all convert."""
    from torch.fx.experimental.proxy_tensor import make_fx

    decomposition = decomposition_functions()[op]
    try:
        args, kwargs = example_call(signature)
        traced = make_fx(lambda *a: decomposition(*a, **kwargs), decomposition_table=decomposition_functions())(*args)
    except Exception as error:
        return f"OpenVINO decomposes it, and its decomposition could not be traced here ({type(error).__name__})"
    inner = {node.target for node in traced.graph.nodes if node.op == "call_function"}
    missing = sorted(str(target) for target in inner if isinstance(target, torch._ops.OpOverload)
                     and not has_conversion_rule(target))
    if missing:
        return f"OpenVINO decomposes it into ops its frontend has no conversion rule for: {', '.join(missing)}"
    return None


def argument_signature(node: Node) -> Hashable:
    """The node's arguments with each tensor as its dtype and sizes: what its decomposition may depend on."""
    return signature_of(node.args), signature_of(node.kwargs)


def signature_of(value: Any) -> Hashable:
    if isinstance(value, Node):
        return signature_of(value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(size_hint(size) for size in value.shape))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(signature_of(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, signature_of(item)) for key, item in value.items()))
    if value is None or isinstance(value, _PLAIN_ARGUMENTS):
        return value
    return Opaque(repr(value))


# Arguments a signature holds as they are: hashable, and rebuilt by being themselves.
_PLAIN_ARGUMENTS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class Opaque:
    """An argument a signature cannot rebuild; a decomposition called with it is not traced."""

    text: str


def size_hint(size: Any) -> Any:
    """A symbolic size's example value (2 for one with none), a plain one as it is."""
    node = getattr(size, "node", None)
    if node is None:
        return size
    hint = getattr(node, "hint", None)
    return 2 if hint is None else hint


def example_call(signature: Hashable) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments rebuilt from ``argument_signature``, each tensor an empty meta tensor of its dtype and sizes."""
    args, kwargs = signature
    return example_value(args), example_value(kwargs)


def example_value(signature: Any) -> Any:
    if isinstance(signature, Opaque):
        raise TypeError(f"cannot rebuild the argument {signature.text}")
    if isinstance(signature, tuple) and signature and signature[0] == "tensor":
        return torch.empty(signature[2], dtype=signature[1], device="meta")
    if isinstance(signature, tuple) and signature and signature[0] in ("list", "tuple", "immutable_list"):
        items = [example_value(item) for item in signature[1]]
        return tuple(items) if signature[0] == "tuple" else items
    if isinstance(signature, tuple) and signature and signature[0] in ("dict", "immutable_dict"):
        return {key: example_value(item) for key, item in signature[1]}
    return signature


@functools.cache
def frontend_dtypes() -> frozenset[torch.dtype]:
    """The torch dtypes OpenVINO's PyTorch frontend has an element type for (complex ones it only emulates)."""
    import openvino
    from openvino.frontend.pytorch.utils import pt_to_ov_type_map

    found = set()
    for name, element_type in pt_to_ov_type_map.items():
        dtype = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
        if isinstance(dtype, torch.dtype) and isinstance(element_type, openvino.Type):
            found.add(dtype)
    return frozenset(found)


def dtype_refusal(dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` cannot go to OpenVINO; None where it can."""
    if dtype in _NARROWED:
        return _NARROWED[dtype]
    if dtype not in frontend_dtypes():
        return f"OpenVINO's PyTorch frontend has no element type for {dtype}"
    if dtype not in ELEMENT_TYPES:
        return f"OpenVINO's CPU plugin does not compute in {dtype}"
    return None


def node_dtype_refusal(node: Node) -> str | None:
    """Why a tensor ``node`` reads or produces cannot go to OpenVINO."""
    for tensor in node_tensors(node):
        refused = dtype_refusal(tensor.dtype)
        if refused is not None:
            return f"it reads or makes a {tensor.dtype} tensor, and {refused}"
    return None


def int64_literal_refusal(node: Node) -> str | None:
    """Why an int64 node's literal value would not survive OpenVINO's int32 arithmetic."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    if all(tensor.dtype != torch.int64 for tensor in node_tensors(node)):
        return None
    for index, argument in enumerate(node.target._schema.arguments):
        if str(argument.type).rstrip("?") not in ("Scalar", "Tensor"):
            continue  # a size or an index (int, SymInt) is not a value computed in int32
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, int) and not isinstance(value, bool) and value not in INT32:
            return (f"its int64 argument {argument.name}={value} does not fit the int32 OpenVINO's CPU plugin "
                    "computes int64 in")
    return None


def repeats_refusal(node: Node) -> str | None:
    """Why OpenVINO would refuse a ``repeat_interleave`` node's repeats: a tensor of more than one count.

    Its converter repeats every element the same number of times, read from a one-element tensor.
    On more counts it fails to convert, or, where their number is known only when run, converts
    and then fails to compile (OpenVINO 2026.4).
    """
    if node.target is not torch.ops.aten.repeat_interleave.self_Tensor:
        return None
    repeats = node.args[1].meta.get("val") if isinstance(node.args[1], Node) else None
    count = repeats.numel() if isinstance(repeats, torch.Tensor) else None
    if isinstance(count, int) and count == 1:  # a size known only when run is a SymInt, never taken for 1
        return None
    return "it repeats each element by a count of its own, and OpenVINO's converter takes one count for all"


def integer_floor_division_refusal(node: Node) -> str | None:
    """Why OpenVINO would miscompute a floor division of integers: it rounds toward zero (-20 // 7 gives -2, not -3).

    Measured with OpenVINO 2026.4 on ``floor_divide`` and ``div(rounding_mode="floor")``, int32 and int64;
    floats divide right.
    """
    floor = node.target in (torch.ops.aten.floor_divide.default, torch.ops.aten.floor_divide.Scalar) or (
        node.target in (torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode)
        and node.kwargs.get("rounding_mode") == "floor"
    )
    value = node.meta.get("val")
    if floor and isinstance(value, torch.Tensor) and not value.dtype.is_floating_point:
        return f"it divides {value.dtype} integers rounding down, which OpenVINO rounds toward zero"
    return None


def pooling_window_refusal(node: Node) -> str | None:
    """Why OpenVINO would refuse a pooling node's window: one wider than its padded input.

    With ``ceil_mode`` torch lets a window overhang the padded input, and averages over what it
    covers; OpenVINO's shape inference requires each window inside the padded input, so the
    partition would fail to convert. ``export`` narrows such windows where it can
    (``compile/pooling.py``); what is left spans a dilated window or a size known only when run.
    """
    window = pooling_window(node)
    if window is None:
        return None
    padded_sizes = window.padded_sizes()
    for axis, (span, size, pad) in enumerate(zip(window.spans(), window.sizes, window.padding, strict=True)):
        if span > size_hint(padded_sizes[axis]):
            return (f"its window of {span} along spatial axis {axis} is wider than the padded input ({size} + 2 x "
                    f"{pad}), which torch allows with ceil_mode and OpenVINO's pooling does not")
    return None
