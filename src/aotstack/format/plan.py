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

The plan is closed: a step may call only what a lowered program contains (ATen and prims ops that
write into none of their arguments, aotstack's copies, the control-flow ops, and the ``operator``
and ``torch.sym_*`` functions export emits), so an edited manifest cannot reach arbitrary Python. A custom op
(``format/custom_ops.py``) is callable only where the loader names it in ``allow_ops``, and one
that writes into its arguments only through ``auto_functionalized``, which hands it copies.
Reading checks that every name a step reads was computed before it, and bounds sizes and nesting.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PackageError
from .custom_ops import OP_NAME_PATTERN, is_allowed, is_custom_op_name, qualified_name, registered_op
from .tensor_data import dtype_from_name, dtype_name


@dataclass(frozen=True)
class Ref:
    """The value another step computed, by that step's name."""

    name: str


@dataclass(frozen=True)
class OpRef:
    """An op passed as a value, by name: the op ``auto_functionalized`` calls on copies of its inputs."""

    name: str


@dataclass(frozen=True)
class InputStep:
    """The method's next user input."""

    name: str


@dataclass(frozen=True)
class WeightStep:
    """A parameter, buffer or constant the method reads, by FQN.

    ``device``: where a buffer the plan updates lives, where that is not the host (``cuda:0``):
    every reader of it and the producer of its new value are delegates on that device.
    """

    name: str
    fqn: str
    device: str | None = None


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


# Bounds on what a manifest may hold, so that a hostile one cannot make reading loop or recurse deep.
MAX_STEPS = 1 << 20
MAX_VALUE_DEPTH = 32
MAX_SUBGRAPH_DEPTH = 16


# What a step may call ----------------------------------------------------------------------------

# The functions export emits besides ops: arithmetic and comparisons on sizes, and getitem.
OPERATOR_FUNCTIONS = frozenset(
    {
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
        "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift",
    }
)  # fmt: skip
# The ones it emits for a builtin on sizes (``max(n - 5, 0)`` is ``torch.sym_max``), called as ``torch.<name>``.
SYMBOLIC_FUNCTIONS = frozenset({"sym_not", "sym_max", "sym_min", "sym_float", "sym_int", "sym_ite", "sym_sum"})
CONTROL_FLOW_OPS = frozenset({"cond", "while_loop", "map_impl", "scan"})
# Functionalized calls of an op that writes into its arguments; the op is an ``OpRef`` argument.
FUNCTIONALIZED_OPS = frozenset({"auto_functionalized", "auto_functionalized_v2"})
OP_NAMESPACES = frozenset({"aten", "prims"})
AOTSTACK_OPS = frozenset({"aotstack.h2d_copy.default", "aotstack.d2h_copy.default"})
# ATen ops that reach outside the program: a file, the console.
OUTSIDE_OPS = frozenset({"aten.from_file", "aten._print"})


@functools.cache
def resolved_op(name: str, allowed: frozenset[str] = frozenset()) -> Any:
    """What a step named ``name`` calls, if a lowered program may call it; else ``PackageError``.

    ``allowed`` names the custom ops the loader lets the plan call (see ``format/custom_ops.py``).

    >>> resolved_op("aten.relu.default")
    <OpOverload(op='aten.relu', overload='default')>
    """
    namespace, _, rest = name.partition(".")
    if namespace == "operator":
        if rest not in OPERATOR_FUNCTIONS:
            raise PackageError(f"calls {name!r}, which is not one of the operator functions a lowered program uses")
        return getattr(operator, rest)
    if namespace == "torch":
        if rest not in SYMBOLIC_FUNCTIONS:
            raise PackageError(f"calls {name!r}, which is not one of the size functions {sorted(SYMBOLIC_FUNCTIONS)}")
        return getattr(torch, rest)
    if namespace == "higher_order":
        if rest not in CONTROL_FLOW_OPS | FUNCTIONALIZED_OPS:
            raise PackageError(f"calls {name!r}, which is not one of the control-flow ops {sorted(CONTROL_FLOW_OPS)}")
        return torch_op(name, lambda: getattr(torch.ops.higher_order, rest))
    if is_custom_op_name(name):
        op = resolved_custom_op(name, allowed)
        if op._schema.is_mutable:
            raise PackageError(f"calls {name!r}, which writes into its arguments outside auto_functionalized")
        return op
    packet, _, overload = rest.rpartition(".")
    if name in AOTSTACK_OPS:
        from . import ops  # noqa: F401  (registers torch.ops.aotstack)
    elif namespace not in OP_NAMESPACES or f"{namespace}.{packet}" in OUTSIDE_OPS:
        raise PackageError(f"calls {name!r}; a run plan may call only ATen and prims ops and aotstack's copies")
    op = torch_op(name, lambda: getattr(getattr(getattr(torch.ops, namespace), packet), overload))
    if not isinstance(op, torch._ops.OpOverload):
        raise PackageError(f"calls {name!r}, which is not an op overload")
    if op._schema.is_mutable:
        raise PackageError(f"calls {name!r}, which writes into its arguments; a lowered program is functional")
    return op


def runs_as_plain_op(name: str) -> bool:
    """Whether a loaded package may call op ``name`` outside any delegate, with no custom op allowed."""
    try:
        resolved_op(name)
    except PackageError:
        return False
    return True


@functools.cache
def resolved_custom_op(name: str, allowed: frozenset[str]) -> torch._ops.OpOverload:
    """Custom op ``name``, if ``allowed`` names it and this process registered it; else ``PackageError``.

    It may write into its arguments: a step calls such an op only through ``auto_functionalized``.
    """
    if not OP_NAME_PATTERN.fullmatch(name):
        raise PackageError(f"calls {name[:80]!r}, which is not an op name like 'mylib.op.default'")
    if not is_allowed(name, allowed):
        raise PackageError(
            f"calls custom op {qualified_name(name)} outside any engine; a run plan may call only ATen and prims "
            f"ops and aotstack's copies unless the loader names it: aotstack.load(path, "
            f"allow_ops=[{name.rsplit('.', 1)[0]!r}])"
        )
    op = registered_op(name)
    if op is None:
        raise PackageError(f"calls custom op {qualified_name(name)}, which this process has not registered")
    return op


def torch_op(name: str, find: Any) -> Any:
    try:
        return find()
    except (AttributeError, RuntimeError):
        raise PackageError(f"calls op {name!r}, which this torch does not have") from None


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
        steps=[step_from_json(step) for step in bounded(data.get("steps"), list, "a plan's steps")],
        outputs=[value_from_json(value) for value in expect(data.get("outputs"), list, "a plan's outputs")],
        mutations=[name_pair(pair) for pair in expect(data.get("mutations"), list, "a plan's mutations")],
    )


def step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, InputStep):
        return {"kind": "input", "name": step.name}
    if isinstance(step, WeightStep):
        weight = {"kind": "weight", "name": step.name, "fqn": step.fqn}
        return weight if step.device is None else {**weight, "device": step.device}
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


def step_from_json(data: Any, depth: int = 0) -> Step:
    data = expect(data, dict, "a plan step")
    kind = data.get("kind")
    if kind == "input":
        return InputStep(text(data, "name"))
    if kind == "weight":
        device = data.get("device")
        return WeightStep(text(data, "name"), text(data, "fqn"), None if device is None else text(data, "device"))
    if kind == "subgraph":
        if depth >= MAX_SUBGRAPH_DEPTH:
            raise PackageError(f"subgraphs in a run plan are nested deeper than {MAX_SUBGRAPH_DEPTH} levels")
        plan = expect(data.get("plan"), dict, "a subgraph's plan")
        steps = [step_from_json(step, depth + 1) for step in bounded(plan.get("steps"), list, "a subgraph's steps")]
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
        name, target = text(data, "name"), text(data, "target")
        try:
            # A custom op is resolved at load, against the loader's allow_ops; its name is checked here.
            if not (is_custom_op_name(target) and OP_NAME_PATTERN.fullmatch(target)):
                resolved_op(target)
        except PackageError as exc:
            raise PackageError(f"plan step {name!r}: {exc}") from None
        return OpStep(name, target, args, kwargs)
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
    if isinstance(value, OpRef):
        return {"op": value.name}
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


def value_from_json(value: Any, depth: int = 0) -> Any:
    """The inverse of :func:`value_to_json`, with references as ``Ref``."""
    if depth > MAX_VALUE_DEPTH:
        raise PackageError(f"a value in a run plan is nested deeper than {MAX_VALUE_DEPTH} levels")
    if not isinstance(value, dict):
        if isinstance(value, list):
            raise PackageError("a bare list in a run plan; lists are tagged")
        return value
    try:
        if "ref" in value:
            return Ref(expect(value["ref"], str, "a reference"))
        if "op" in value:
            name = expect(value["op"], str, "an op")
            if not (is_custom_op_name(name) and OP_NAME_PATTERN.fullmatch(name)):
                raise PackageError(f"an op value may name only a custom op, got {name[:80]!r}")
            return OpRef(name)
        if "list" in value:
            items = [value_from_json(item, depth + 1) for item in expect(value["list"], list, "a list")]
            return tuple(items) if value.get("tuple") else items
        if "dict" in value:
            items = expect(value["dict"], dict, "a dict")
            return {key: value_from_json(item, depth + 1) for key, item in items.items()}
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


def bounded(value: Any, kind: type, what: str, limit: int = MAX_STEPS) -> Any:
    """``value``, a list or dict of at most ``limit`` items: a hostile manifest cannot make reading loop long."""
    value = expect(value, kind, what)
    if len(value) > limit:
        raise PackageError(f"{what} number {len(value)}, more than the {limit} allowed")
    return value


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


# References --------------------------------------------------------------------------------------


def checked_names(steps: list[Step], what: str) -> set[str]:
    """The names ``steps`` compute, each computed once and none read before it is computed.

    A subgraph is its own scope: it reads only what its own steps compute.
    """
    names: set[str] = set()
    for step in steps:
        reads = step_reads(step)
        if isinstance(step, SubgraphStep):
            inner = checked_names(step.plan.steps, f"subgraph {step.name!r}")
            check_reads(refs(step.plan.output), inner, f"subgraph {step.name!r}'s output")
        check_reads(reads, names, f"{what}: step {step_label(step)!r}")
        for name in step_writes(step):
            if name in names:
                raise PackageError(f"{what}: two steps compute {name!r}")
            names.add(name)
    return names


def check_reads(reads: list[str], names: set[str], where: str) -> None:
    for name in reads:
        if name not in names:
            raise PackageError(f"{where} reads {name!r} before any step computes it")


def step_reads(step: Step) -> list[str]:
    if isinstance(step, OpStep):
        return refs([step.args, step.kwargs])
    if isinstance(step, DelegateStep):
        return list(step.inputs)
    return []


def step_writes(step: Step) -> list[str]:
    if isinstance(step, DelegateStep):
        return [name for _, name in step.outputs]
    return [step.name]


def step_label(step: Step) -> str:
    return step.delegate if isinstance(step, DelegateStep) else step.name


def custom_op_names(steps: list[Step]) -> set[str]:
    """The custom ops ``steps`` call, as step targets or as ops handed to ``auto_functionalized``."""
    names: set[str] = set()
    for step in steps:
        if isinstance(step, SubgraphStep):
            names |= custom_op_names(step.plan.steps)
        elif isinstance(step, OpStep):
            if is_custom_op_name(step.target):
                names.add(step.target)
            names |= set(op_refs([step.args, step.kwargs]))
    return names


def op_refs(value: Any) -> list[str]:
    """The custom ops ``value`` hands to another op, in order."""
    return [op.name for op in found_in(value, OpRef)]


def refs(value: Any) -> list[str]:
    """The names ``value`` reads, in order."""
    return [ref.name for ref in found_in(value, Ref)]


def found_in(value: Any, kind: type) -> list[Any]:
    """Every ``kind`` inside ``value``'s lists, tuples and dicts, in order."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)):
        return [found for item in value for found in found_in(item, kind)]
    if isinstance(value, dict):
        return [found for item in value.values() for found in found_in(item, kind)]
    return []
