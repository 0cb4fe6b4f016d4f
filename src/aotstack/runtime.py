"""Loading a package and running its methods.

Each method's graph is turned once into a flat list of steps over a list of slots, so a call
costs little more than the compiled code it runs: delegate calls go to their backend's run
side, the few ops nobody claimed run as plain ATen ops.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node
from torch.utils import _pytree as pytree

from .backend import Backend, backend_class
from .delegate_op import is_delegate_call, is_delegate_output
from .errors import InputError, MethodNotFoundError, PackageError
from .package import PackageContents, read_package
from .specs import CompileSpec
from .tensor_data import dtype_from_name, tensor_from_bytes

Step = Callable[[list[Any]], None]


class LoadedDelegate:
    """A delegate's run side, initialised once."""

    def __init__(self, backend: Backend, handle: Any) -> None:
        self.backend = backend
        self.handle = handle

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.backend.execute(self.handle, inputs)


class InputCheck:
    """The tensors a method takes, checked before any compiled code sees them."""

    def __init__(self, method: str, inputs: list[dict[str, Any]], in_spec: pytree.TreeSpec) -> None:
        self.method = method
        self.names = [spec["name"] for spec in inputs]
        self.dtypes = [dtype_from_name(spec["dtype"]) for spec in inputs]
        self.shapes = [tuple(spec["shape"]) for spec in inputs]
        self.in_spec = in_spec
        # Plain positional tensors, the usual case, need no pytree walk.
        self.flat_positional = in_spec == pytree.tree_flatten((tuple(range(len(inputs))), {}))[1]

    def flat_arguments(self, args: tuple[Any, ...]) -> Sequence[Any]:
        if self.flat_positional:
            flat = args
        else:
            flat, spec = pytree.tree_flatten((args, {}))
            if spec != self.in_spec:
                raise InputError(
                    f"{self.method}(): arguments structured as {spec}, expected {self.in_spec}"
                )
        if len(flat) != len(self.names):
            raise InputError(
                f"{self.method}() takes {len(self.names)} argument(s) ({', '.join(self.names)}), "
                f"got {len(flat)}"
            )
        for index, value in enumerate(flat):
            if not isinstance(value, torch.Tensor):
                raise InputError(
                    f"{self.method}(): argument {self.names[index]!r} must be a tensor, got {type(value).__name__}"
                )
            if value.dtype != self.dtypes[index]:
                raise InputError(
                    f"{self.method}(): argument {self.names[index]!r} has dtype {value.dtype}, "
                    f"expected {self.dtypes[index]}"
                )
            if not shape_matches(value.shape, self.shapes[index]):
                raise InputError(
                    f"{self.method}(): argument {self.names[index]!r} has shape {list(value.shape)}, "
                    f"expected {shape_text(self.shapes[index])}"
                )
        return flat


def shape_matches(shape: torch.Size, expected: tuple[int | None, ...]) -> bool:
    if len(shape) != len(expected):
        return False
    return all(want is None or have == want for have, want in zip(shape, expected))


def shape_text(shape: Sequence[int | None]) -> str:
    """``[4, *, 16]``, a star for each dynamic dimension."""
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


class Method:
    """One loaded method: call it with the same arguments as the eager method."""

    def __init__(
        self,
        name: str,
        program: ExportedProgram,
        weights: dict[str, torch.Tensor],
        delegates: dict[str, LoadedDelegate],
        check: InputCheck,
        out_spec: pytree.TreeSpec,
    ) -> None:
        self.name = name
        self.check = check
        self.out_spec = out_spec
        self.template, self.user_slots, self.steps, self.output_slots, self.mutations = build_plan(
            program, weights, delegates
        )
        self.single_output = out_spec.is_leaf() if hasattr(out_spec, "is_leaf") else False

    def __call__(self, *args: Any) -> Any:
        flat = self.check.flat_arguments(args)
        env = self.template.copy()
        for slot, value in zip(self.user_slots, flat):
            env[slot] = value
        for step in self.steps:
            step(env)
        for target, slot in self.mutations:
            target.copy_(env[slot])
        outputs = [env[slot] for slot in self.output_slots]
        if self.single_output:
            return outputs[0]
        return pytree.tree_unflatten(outputs, self.out_spec)


def build_plan(
    program: ExportedProgram, weights: dict[str, torch.Tensor], delegates: dict[str, LoadedDelegate]
) -> tuple[list[Any], list[int], list[Step], list[int], list[tuple[torch.Tensor, int]]]:
    """Slots for every node, the steps that fill them, and where inputs and outputs are."""
    signature = program.graph_signature
    spec_by_name = {spec.arg.name: spec for spec in signature.input_specs}
    slot: dict[Node, int] = {}
    template: list[Any] = []
    user_slots: list[int] = []
    steps: list[Step] = []

    def new_slot(node: Node, value: Any = None) -> int:
        slot[node] = len(template)
        template.append(value)
        return slot[node]

    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = spec_by_name[node.name]
            if spec.kind == InputKind.USER_INPUT:
                user_slots.append(new_slot(node))
            else:
                new_slot(node, weights.get(spec.target))
        elif is_delegate_call(node):
            steps.append(delegate_step(node, delegates[node.args[0]], slot, new_slot))
        elif is_delegate_output(node):
            continue  # filled by its delegate's step
        elif node.op == "call_function":
            steps.append(op_step(node, slot, new_slot(node)))
        elif node.op == "output":
            output_nodes = node.args[0]
    outputs_by_kind = list(zip(signature.output_specs, output_nodes))
    output_slots = [slot[n] for spec, n in outputs_by_kind if spec.kind == OutputKind.USER_OUTPUT]
    mutations = [
        (weights[spec.target], slot[n])
        for spec, n in outputs_by_kind
        if spec.kind == OutputKind.BUFFER_MUTATION
    ]
    return template, user_slots, steps, output_slots, mutations


def delegate_step(
    node: Node, delegate: LoadedDelegate, slot: dict[Node, int], new_slot: Callable[[Node], int]
) -> Step:
    input_slots = [slot[n] for n in node.args[1]]
    outputs = [(user.args[1], new_slot(user)) for user in node.users if user.target is operator.getitem]

    def run_delegate(env: list[Any]) -> None:
        results = delegate([env[i] for i in input_slots])
        for index, out in outputs:
            env[out] = results[index]

    return run_delegate


def op_step(node: Node, slot: dict[Node, int], out: int) -> Step:
    target = node.target
    args, kwargs = node.args, node.kwargs

    def resolve(value: Any, env: list[Any]) -> Any:
        return torch.fx.node.map_arg(value, lambda n: env[slot[n]])

    def run_op(env: list[Any]) -> None:
        env[out] = target(*resolve(args, env), **resolve(kwargs, env))

    return run_op


class LoadedProgram:
    """A package opened by :func:`load`; each method is callable by name or as an attribute."""

    def __init__(self, path: str, methods: dict[str, Method]) -> None:
        self.path = path
        self._methods = methods

    @property
    def method_names(self) -> list[str]:
        return list(self._methods)

    def method(self, name: str) -> Method:
        try:
            return self._methods[name]
        except KeyError:
            raise MethodNotFoundError(
                f"{self.path} has no method {name!r}; it has: {', '.join(self._methods)}"
            ) from None

    def run(self, method: str, *args: Any) -> Any:
        """Run ``method`` on ``args``, e.g. ``loaded.run("encode", x)``."""
        return self.method(method)(*args)

    def __getattr__(self, name: str) -> Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.method(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))


def load(path: str | os.PathLike[str]) -> LoadedProgram:
    """Open a ``.pt2`` written by :meth:`LoweredProgram.save` and get it ready to run.

    Example::

        loaded = aotstack.load("model.pt2")
        y = loaded.forward(x)

    Every blob is checked against its SHA-256 before any shared library is opened.
    """
    contents = read_package(path)
    methods = {}
    for name, manifest in contents.manifest["methods"].items():
        methods[name] = load_method(contents, name, manifest)
    return LoadedProgram(contents.path, methods)


def load_method(contents: PackageContents, name: str, manifest: dict[str, Any]) -> Method:
    weights = {
        fqn: tensor_from_bytes(contents.blobs[meta["blob"]], dtype_from_name(meta["dtype"]), meta["shape"])
        for fqn, meta in manifest["weights"].items()
    }
    program = deserialized_program(contents, name, weights)
    delegates = {d["id"]: loaded_delegate(contents, d) for d in manifest["delegates"]}
    in_spec = pytree.treespec_loads(manifest["in_spec"])
    check = InputCheck(name, manifest["inputs"], in_spec)
    return Method(name, program, weights, delegates, check, pytree.treespec_loads(manifest["out_spec"]))


def deserialized_program(
    contents: PackageContents, name: str, weights: dict[str, torch.Tensor]
) -> ExportedProgram:
    try:
        serialized = _bytes_to_dataclass(schema.ExportedProgram, contents.programs[name])
        signature = serialized.graph_module.signature
        parameter_names = {
            spec.parameter.parameter_name for spec in signature.input_specs if spec.type == "parameter"
        }
        constant_names = {
            spec.tensor_constant.tensor_constant_name
            for spec in signature.input_specs
            if spec.type == "tensor_constant"
        }
        state_dict = {
            k: torch.nn.Parameter(v, requires_grad=False) if k in parameter_names else v
            for k, v in weights.items()
            if k not in constant_names
        }
        constants = {k: v for k, v in weights.items() if k in constant_names}
        return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)
    except Exception as exc:
        raise PackageError(f"{contents.path}: cannot read the program of method {name!r}: {exc}") from exc


def loaded_delegate(contents: PackageContents, manifest: dict[str, Any]) -> LoadedDelegate:
    backend = backend_class(manifest["backend_id"])()
    compile_specs = [CompileSpec(key, bytes.fromhex(value)) for key, value in manifest["compile_specs"]]
    named_data = {local: contents.blobs[key] for local, key in manifest["named_data"].items()}
    handle = backend.init(contents.blobs[manifest["processed"]], named_data, compile_specs)
    return LoadedDelegate(backend, handle)
