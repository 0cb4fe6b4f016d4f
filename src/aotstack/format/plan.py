"""The run plan: a lowered method as a flat list of typed steps, and its JSON codec.

The runtime reads this instead of the stock ``ExportedProgram`` schema, whose reader pulls in
``torch._export.serde`` (about 1.5 s to import in a fresh process). Each step names the values
it reads and the value it fills; op targets are stored by name and resolved through ``torch.ops``.

In JSON a step is an object with a ``kind``::

    {"kind": "input", "name": "x"}
    {"kind": "weight", "name": "p_weight", "fqn": "linear.weight"}
    {"kind": "subgraph", "name": "true_graph_0", "plan": {"steps": [...], "output": ...}}
    {"kind": "delegate", "delegate": "forward.0", "inputs": ["x"], "outputs": [[0, "getitem"]]}
    {"kind": "op", "name": "relu", "target": "aten.relu.default", "args": ..., "kwargs": ...}

and a value an op takes is a JSON scalar, ``{"ref": name}`` for another step's value, or a
tagged object for lists, tuples, dicts, non-finite floats and torch's dtypes, devices, memory
formats and layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PackageError
from .tensor_data import dtype_from_name, dtype_name


@dataclass(frozen=True)
class Ref:
    """The value another step computed, by that step's name."""

    name: str


@dataclass(frozen=True)
class InputStep:
    """The method's next user input."""

    name: str


@dataclass(frozen=True)
class WeightStep:
    """A parameter, buffer or constant the method reads, by FQN."""

    name: str
    fqn: str


@dataclass(frozen=True)
class SubgraphStep:
    """A branch or loop body that a control-flow op left to plain ATen calls."""

    name: str
    plan: SubgraphPlan


@dataclass(frozen=True)
class DelegateStep:
    """One call of a compiled partition; ``outputs`` pairs each result's index with its name."""

    delegate: str
    inputs: list[str]
    outputs: list[tuple[int, str]]


@dataclass(frozen=True)
class OpStep:
    """One plain op: ``target`` by name, its arguments with ``Ref`` for other steps' values."""

    name: str
    target: str
    args: list[Any]
    kwargs: dict[str, Any]


Step = InputStep | WeightStep | SubgraphStep | DelegateStep | OpStep


@dataclass(frozen=True)
class SubgraphPlan:
    steps: list[Step]
    output: Any


@dataclass(frozen=True)
class MethodPlan:
    """A method's steps, its user outputs, and the buffers it updates: (FQN, name of the new value)."""

    steps: list[Step]
    outputs: list[Any]
    mutations: list[tuple[str, str]]


# JSON --------------------------------------------------------------------------------------------


def method_plan_to_json(plan: MethodPlan) -> dict[str, Any]:
    return {
        "steps": [step_to_json(step) for step in plan.steps],
        "outputs": [value_to_json(value) for value in plan.outputs],
        "mutations": [list(pair) for pair in plan.mutations],
    }


def method_plan_from_json(data: Any) -> MethodPlan:
    data = expect(data, dict, "a method plan")
    return MethodPlan(
        steps=[step_from_json(step) for step in expect(data.get("steps"), list, "a plan's steps")],
        outputs=[value_from_json(value) for value in expect(data.get("outputs"), list, "a plan's outputs")],
        mutations=[name_pair(pair) for pair in expect(data.get("mutations"), list, "a plan's mutations")],
    )


def step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, InputStep):
        return {"kind": "input", "name": step.name}
    if isinstance(step, WeightStep):
        return {"kind": "weight", "name": step.name, "fqn": step.fqn}
    if isinstance(step, SubgraphStep):
        plan = {"steps": [step_to_json(s) for s in step.plan.steps], "output": value_to_json(step.plan.output)}
        return {"kind": "subgraph", "name": step.name, "plan": plan}
    if isinstance(step, DelegateStep):
        outputs = [[index, name] for index, name in step.outputs]
        return {"kind": "delegate", "delegate": step.delegate, "inputs": list(step.inputs), "outputs": outputs}
    return {
        "kind": "op",
        "name": step.name,
        "target": step.target,
        "args": value_to_json(step.args),
        "kwargs": value_to_json(step.kwargs),
    }


def step_from_json(data: Any) -> Step:
    data = expect(data, dict, "a plan step")
    kind = data.get("kind")
    if kind == "input":
        return InputStep(text(data, "name"))
    if kind == "weight":
        return WeightStep(text(data, "name"), text(data, "fqn"))
    if kind == "subgraph":
        plan = expect(data.get("plan"), dict, "a subgraph's plan")
        steps = [step_from_json(step) for step in expect(plan.get("steps"), list, "a subgraph's steps")]
        return SubgraphStep(text(data, "name"), SubgraphPlan(steps, value_from_json(plan.get("output"))))
    if kind == "delegate":
        inputs = [expect(name, str, "a delegate input") for name in expect(data.get("inputs"), list, "inputs")]
        outputs = [index_name(pair) for pair in expect(data.get("outputs"), list, "a delegate's outputs")]
        return DelegateStep(text(data, "delegate"), inputs, outputs)
    if kind == "op":
        args = value_from_json(data.get("args"))
        kwargs = value_from_json(data.get("kwargs"))
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise PackageError(f"plan step {data.get('name')!r} has malformed arguments")
        return OpStep(text(data, "name"), text(data, "target"), args, kwargs)
    raise PackageError(f"unknown plan step kind {kind!r}")


_MEMORY_FORMATS = {
    str(f).removeprefix("torch."): f
    for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}
_LAYOUTS = {str(layout).removeprefix("torch."): layout for layout in (torch.strided, torch.sparse_coo)}


def value_to_json(value: Any) -> Any:
    """``value`` as JSON; a value no step can take raises ``TypeError`` (the caller names the node)."""
    if isinstance(value, Ref):
        return {"ref": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"list": [value_to_json(item) for item in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"dict": {key: value_to_json(item) for key, item in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    raise TypeError(f"a {type(value).__name__} ({value!r})")


def value_from_json(value: Any) -> Any:
    """The inverse of :func:`value_to_json`, with references as ``Ref``."""
    if not isinstance(value, dict):
        if isinstance(value, list):
            raise PackageError("a bare list in a run plan; lists are tagged")
        return value
    try:
        if "ref" in value:
            return Ref(expect(value["ref"], str, "a reference"))
        if "list" in value:
            items = [value_from_json(item) for item in expect(value["list"], list, "a list")]
            return tuple(items) if value.get("tuple") else items
        if "dict" in value:
            return {key: value_from_json(item) for key, item in expect(value["dict"], dict, "a dict").items()}
        if "float" in value:
            return float(expect(value["float"], str, "a float"))
        if "dtype" in value:
            return dtype_from_name(value["dtype"])
        if "device" in value:
            return torch.device(value["device"])
        if "memory_format" in value:
            return _MEMORY_FORMATS[value["memory_format"]]
        if "layout" in value:
            return _LAYOUTS[value["layout"]]
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise PackageError(f"malformed value {value!r} in a run plan ({exc})") from None
    raise PackageError(f"unknown value {value!r} in a run plan")


def expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PackageError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def text(data: dict[str, Any], key: str) -> str:
    return expect(data.get(key), str, f"a plan step's {key!r}")


def name_pair(pair: Any) -> tuple[str, str]:
    pair = expect(pair, list, "a pair")
    if len(pair) != 2 or not all(isinstance(item, str) for item in pair):
        raise PackageError(f"expected [FQN, name], got {pair!r}")
    return pair[0], pair[1]


def index_name(pair: Any) -> tuple[int, str]:
    pair = expect(pair, list, "a pair")
    if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or not isinstance(pair[1], str):
        raise PackageError(f"expected [index, name], got {pair!r}")
    return pair[0], pair[1]
