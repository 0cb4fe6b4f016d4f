"""The run plan: a lowered method as a flat JSON list of steps.

The runtime reads this instead of the stock ``ExportedProgram`` schema, whose reader pulls in
``torch._export.serde`` (about 1.5 s to import in a fresh process). Each step names the slots
it reads and fills; op targets are stored by name and resolved through ``torch.ops``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node

from .delegate_op import is_delegate_call, is_delegate_output
from .errors import LoweringError, PackageError
from .op_names import op_name
from .tensor_data import dtype_from_name, dtype_name

_MEMORY_FORMATS = {
    str(f).removeprefix("torch."): f
    for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}
_LAYOUTS = {str(layout).removeprefix("torch."): layout for layout in (torch.strided, torch.sparse_coo)}


def method_plan(program: ExportedProgram) -> dict[str, Any]:
    """The steps that run ``program``'s graph, in graph order."""
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    weights = {name: spec.target for name, spec in specs.items() if spec.kind != InputKind.USER_INPUT}
    steps = graph_steps(program.graph_module, weights)
    output_values = program.graph.output_node().args[0]
    pairs = list(zip(program.graph_signature.output_specs, output_values))
    return {
        "steps": steps,
        "outputs": [encoded(value, None) for spec, value in pairs if spec.kind == OutputKind.USER_OUTPUT],
        "mutations": [[spec.target, value.name] for spec, value in pairs if spec.kind == OutputKind.BUFFER_MUTATION],
    }


def graph_steps(graph_module: GraphModule, weights: dict[str, str]) -> list[dict[str, Any]]:
    """The steps of one graph; placeholders named in ``weights`` read that weight's FQN."""
    steps: list[dict[str, Any]] = []
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            if node.name in weights:
                steps.append({"weight": node.name, "fqn": weights[node.name]})
            else:
                steps.append({"input": node.name})
        elif node.op == "get_attr":
            steps.append({"subgraph": node.name, "plan": subgraph_plan(graph_module, node)})
        elif is_delegate_call(node):
            outputs = [[user.args[1], user.name] for user in node.users if is_delegate_output(user)]
            steps.append({"delegate": node.args[0], "inputs": [n.name for n in node.args[1]], "outputs": outputs})
        elif is_delegate_output(node):
            continue
        elif node.op == "call_function":
            steps.append({
                "op": node.name,
                "target": target_name(node),
                "args": encoded(node.args, node),
                "kwargs": encoded(dict(node.kwargs), node),
            })
    return steps


def subgraph_plan(graph_module: GraphModule, node: Node) -> dict[str, Any]:
    """The plan of a branch or loop body that a control-flow op left to plain ATen calls."""
    body = getattr(graph_module, str(node.target))
    if not isinstance(body, GraphModule):
        raise LoweringError(f"node {node.name!r} reads {node.target!r}, which is not a subgraph a package can store")
    return {"steps": graph_steps(body, {}), "output": encoded(body.graph.output_node().args[0], None)}


def target_name(node: Node) -> str:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return op_name(target)
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return f"operator.{target.__name__}"
    raise LoweringError(f"node {node.name!r} calls {target!r}, which a package cannot store; only ops can run")


def resolved_target(name: str) -> Any:
    namespace, _, rest = name.partition(".")
    try:
        if namespace == "operator":
            return getattr(operator, rest)
        if namespace == "higher_order":
            return getattr(torch.ops.higher_order, rest)
        op, _, overload = rest.rpartition(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError:
        raise PackageError(f"the package calls op {name!r}, which this torch does not have") from None


def encoded(value: Any, node: Node | None) -> Any:
    """``value`` as JSON: node references, scalars, and the torch enums ops take."""
    if isinstance(value, Node):
        return {"ref": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"list": [encoded(item, node) for item in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"dict": {key: encoded(item, node) for key, item in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    where = f"node {node.name!r}" if node is not None else "the method's output"
    raise LoweringError(f"{where} takes a {type(value).__name__} ({value!r}), which a package cannot store")


def decoded(value: Any, slots: dict[str, int]) -> Any:
    """The inverse of :func:`encoded`, with node references turned into ``Slot`` markers."""
    if not isinstance(value, dict):
        return value
    if "ref" in value:
        return Slot(slots[value["ref"]])
    if "list" in value:
        items = [decoded(item, slots) for item in value["list"]]
        return tuple(items) if value["tuple"] else items
    if "dict" in value:
        return {key: decoded(item, slots) for key, item in value["dict"].items()}
    if "float" in value:
        return float(value["float"])
    if "dtype" in value:
        return dtype_from_name(value["dtype"])
    if "device" in value:
        return torch.device(value["device"])
    if "memory_format" in value:
        return _MEMORY_FORMATS[value["memory_format"]]
    if "layout" in value:
        return _LAYOUTS[value["layout"]]
    raise PackageError(f"unknown value {value!r} in a run plan")


class Slot:
    """A reference to the value another step computed."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index
