"""Writing the run plan (``format/plan.py``) of a lowered method's graph."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from ..errors import LoweringError, PackageError
from ..format.custom_ops import is_custom_op_name
from ..format.devices import HOST
from ..format.op_names import op_name
from ..format.ops import is_delegate_call, is_delegate_output
from ..format.plan import (
    SYMBOLIC_FUNCTIONS,
    DelegateStep,
    InputStep,
    MethodPlan,
    OpRef,
    OpStep,
    Ref,
    Step,
    SubgraphPlan,
    SubgraphStep,
    WeightStep,
    resolved_op,
    value_to_json,
)


def method_plan(program: ExportedProgram, *, runnable_only: bool = True) -> MethodPlan:
    """The steps that run ``program``'s graph, in graph order.

    ``runnable_only=False`` also writes a step calling an op the runtime refuses (a custom op
    no backend claimed): for a plan that is only described, never saved.
    """
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    weights = {name: spec.target for name, spec in specs.items() if spec.kind != InputKind.USER_INPUT}
    output_values = program.graph.output_node().args[0]
    pairs = list(zip(program.graph_signature.output_specs, output_values))
    return MethodPlan(
        steps=graph_steps(program.graph_module, weights, runnable_only),
        outputs=[plan_value(value, None) for spec, value in pairs if spec.kind == OutputKind.USER_OUTPUT],
        mutations=[(spec.target, value.name) for spec, value in pairs if spec.kind == OutputKind.BUFFER_MUTATION],
    )


def graph_steps(graph_module: GraphModule, weights: dict[str, str], runnable_only: bool = True) -> list[Step]:
    """The steps of one graph; placeholders named in ``weights`` read that weight's FQN."""
    steps: list[Step] = []
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            steps.append(weight_step(node, weights[node.name]) if node.name in weights else InputStep(node.name))
        elif node.op == "get_attr":
            steps.append(SubgraphStep(node.name, subgraph_plan(graph_module, node, runnable_only)))
        elif is_delegate_call(node):
            outputs = [(user.args[1], user.name) for user in node.users if is_delegate_output(user)]
            steps.append(DelegateStep(node.args[0], [n.name for n in node.args[1]], outputs))
        elif node.op == "call_function" and not is_delegate_output(node):
            args, kwargs = plan_value(list(node.args), node), plan_value(dict(node.kwargs), node)
            steps.append(OpStep(node.name, target_name(node, runnable_only), args, kwargs))
    return steps


def weight_step(node: Node, fqn: str) -> WeightStep:
    """The step reading ``fqn``; with its device where the device pass put it off the host (a buffer's state)."""
    device = node.meta.get("device")
    return WeightStep(node.name, fqn, None if device is None or device == HOST else str(device))


def subgraph_plan(graph_module: GraphModule, node: Node, runnable_only: bool = True) -> SubgraphPlan:
    body = getattr(graph_module, str(node.target))
    if not isinstance(body, GraphModule):
        raise LoweringError(f"node {node.name!r} reads {node.target!r}, which is not a subgraph a package can store")
    return SubgraphPlan(graph_steps(body, {}, runnable_only), plan_value(body.graph.output_node().args[0], None))


def target_name(node: Node, runnable_only: bool = True) -> str:
    """The name a step calls ``node``'s target by; one the loader's closed list refuses is refused here.

    A custom op passes: the loader runs it where its ``allow_ops`` names it (format/custom_ops.py).
    """
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        name = op_name(target)
    elif getattr(operator, getattr(target, "__name__", ""), None) is target:
        name = f"operator.{target.__name__}"
    elif getattr(target, "__name__", "") in SYMBOLIC_FUNCTIONS and getattr(torch, target.__name__) is target:
        name = f"torch.{target.__name__}"
    else:
        raise LoweringError(f"node {node.name!r} calls {target!r}, which a package cannot store; only ops can run")
    try:
        if runnable_only:
            resolved_op(name, frozenset({name}) if is_custom_op_name(name) else frozenset())
    except PackageError as exc:
        raise LoweringError(
            f"node {node.name!r} {exc}; claim it with a backend's partitioner, as a loaded package runs only "
            "the ops on that list"
        ) from None
    return name


def op_value(op: torch._ops.OpOverload, node: Node | None) -> OpRef:
    """An op handed to another (``auto_functionalized``'s first argument): only a custom op can be."""
    name = op_name(op)
    if not is_custom_op_name(name):
        where = f"node {node.name!r}" if node is not None else "the method's output"
        raise LoweringError(f"{where} takes op {name} as a value, which a package can store only for a custom op")
    return OpRef(name)


def plan_value(value: Any, node: Node | None) -> Any:
    """``value`` with node references as ``Ref`` and ops as ``OpRef``, checked to be storable in JSON."""
    value = pytree.tree_map_only(Node, lambda n: Ref(n.name), value)
    value = pytree.tree_map_only(torch._ops.OpOverload, lambda op: op_value(op, node), value)
    try:
        value_to_json(value)
    except TypeError as exc:
        where = f"node {node.name!r}" if node is not None else "the method's output"
        raise LoweringError(f"{where} takes {exc}, which a package cannot store") from None
    return value
