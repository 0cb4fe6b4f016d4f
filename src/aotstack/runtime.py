"""Loading a package and running its methods.

Each method's run plan (see ``plan.py``) is turned once into closures over a list of slots, so
a call costs little more than the compiled code it runs: delegate calls go to their backend's
run side, the few ops nobody claimed run as plain ATen ops.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .backend import Backend, backend_class
from .errors import MethodNotFoundError
from .inputs import InputCheck
from .package import PackageContents, read_package
from .plan import Slot, decoded, resolved_target
from .specs import CompileSpec
from .tensor_data import WEIGHT_PREFIX, BytesLike, dtype_from_name, tensor_from_bytes

Step = Callable[[list[Any]], None]


@dataclass(frozen=True)
class LoadedDelegate:
    """A delegate's run side, initialised once; its steps call ``backend.execute(handle, ...)``."""

    backend: Backend
    handle: Any


class Method:
    """One loaded method: call it with the same arguments as the eager method."""

    def __init__(
        self,
        name: str,
        plan: dict[str, Any],
        weights: dict[str, torch.Tensor],
        delegates: dict[str, LoadedDelegate],
        check: InputCheck,
        out_spec: pytree.TreeSpec,
    ) -> None:
        self.name = name
        self.check = check
        self.out_spec = out_spec
        self.single_output = out_spec.is_leaf()
        steps = StepList(plan["steps"], weights, delegates)
        self.template = steps.template
        self.user_slots = steps.input_slots
        self.steps = steps.steps
        self.outputs = [resolver(decoded(value, steps.slots)) for value in plan["outputs"]]
        self.mutations = [(weights[fqn], steps.slots[name]) for fqn, name in plan["mutations"]]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.check.flat_arguments(args, kwargs)
        env = self.template.copy()
        for slot, value in zip(self.user_slots, flat):
            env[slot] = value
        for step in self.steps:
            step(env)
        for target, slot in self.mutations:
            target.copy_(env[slot])
        if self.single_output:
            return self.outputs[0](env)
        return pytree.tree_unflatten([output(env) for output in self.outputs], self.out_spec)


class StepList:
    """A plan's steps as closures over one list of slots, ``template`` holding the constants."""

    def __init__(
        self, plan_steps: list[dict[str, Any]], weights: dict[str, torch.Tensor], delegates: dict[str, LoadedDelegate]
    ) -> None:
        self.slots: dict[str, int] = {}
        self.template: list[Any] = []
        self.input_slots: list[int] = []
        self.steps: list[Step] = []
        for step in plan_steps:
            if "input" in step:
                self.input_slots.append(self.new_slot(step["input"]))
            elif "weight" in step:
                self.new_slot(step["weight"], weights.get(step["fqn"]))
            elif "subgraph" in step:
                self.new_slot(step["subgraph"], subgraph_function(step["plan"]))
            elif "delegate" in step:
                inputs = [self.slots[n] for n in step["inputs"]]
                outputs = [(index, self.new_slot(out)) for index, out in step["outputs"]]
                self.steps.append(delegate_step(delegates[step["delegate"]], inputs, outputs))
            else:
                target = resolved_target(step["target"])
                args = [resolver(a) for a in decoded(step["args"], self.slots)]
                kwargs = {k: resolver(v) for k, v in decoded(step["kwargs"], self.slots).items()}
                self.steps.append(op_step(target, args, kwargs, self.new_slot(step["op"])))

    def new_slot(self, name: str, value: Any = None) -> int:
        self.slots[name] = len(self.template)
        self.template.append(value)
        return self.slots[name]


def subgraph_function(plan: dict[str, Any]) -> Callable[..., Any]:
    """A branch or loop body, callable the way a control-flow op calls it."""
    body = StepList(plan["steps"], {}, {})
    output = resolver(decoded(plan["output"], body.slots))

    def run_subgraph(*args: Any) -> Any:
        env = body.template.copy()
        for slot, value in zip(body.input_slots, args):
            env[slot] = value
        for step in body.steps:
            step(env)
        return output(env)

    return run_subgraph


Resolver = Callable[[list[Any]], Any]


def resolver(value: Any) -> Resolver:
    """A function reading ``value`` out of the slots, built once so calls do no tree walks."""
    if isinstance(value, Slot):
        index = value.index
        return lambda env: env[index]
    if isinstance(value, (list, tuple)) and has_slot(value):
        parts = [resolver(item) for item in value]
        kind = type(value)
        return lambda env: kind([part(env) for part in parts])
    return lambda env: value


def has_slot(value: Any) -> bool:
    if isinstance(value, Slot):
        return True
    return isinstance(value, (list, tuple)) and any(has_slot(item) for item in value)


def delegate_step(delegate: LoadedDelegate, inputs: list[int], outputs: list[tuple[int, int]]) -> Step:
    execute, handle = delegate.backend.execute, delegate.handle

    def run_delegate(env: list[Any]) -> None:
        results = execute(handle, [env[i] for i in inputs])
        for index, out in outputs:
            env[out] = results[index]

    return run_delegate


def op_step(target: Callable[..., Any], args: list[Resolver], kwargs: dict[str, Resolver], out: int) -> Step:
    def run_op(env: list[Any]) -> None:
        env[out] = target(*[arg(env) for arg in args], **{key: value(env) for key, value in kwargs.items()})

    return run_op


class LoadedProgram:
    """A package opened by :func:`load`; each method is callable by name or as an attribute."""

    def __init__(self, path: str, methods: dict[str, Method], state: ProgramState) -> None:
        self.path = path
        self._methods = methods
        self._state = state
        # Methods become plain attributes, so a call skips __getattr__; names the class uses stay reachable by run().
        for name, method in methods.items():
            if not hasattr(type(self), name) and name not in vars(self):
                setattr(self, name, method)

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

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on ``args``, e.g. ``loaded.run("encode", x)``."""
        return self.method(method)(*args, **kwargs)

    def reset(self) -> None:
        """Put every buffer the methods update (a KV cache, say) back to its value in the file."""
        self._state.reset()

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
    state = ProgramState(contents)
    methods = {}
    for name, manifest in contents.manifest["methods"].items():
        methods[name] = load_method(contents, state, name, manifest)
    return LoadedProgram(contents.path, methods, state)


class ProgramState:
    """The weights of every method, each held once in memory and shared by the methods that read it.

    A weight is a read-only view of its verified blob. A buffer that a method or a delegate
    updates (a KV cache) gets one writable copy per FQN, which every method and delegate reads
    and updates: two methods that share a cache share it here too.
    """

    def __init__(self, contents: PackageContents) -> None:
        self.blobs = contents.blobs
        self.mutable: dict[str, tuple[bytearray, memoryview]] = {}
        for method in contents.manifest["methods"].values():
            for fqn, _ in method["plan"]["mutations"]:
                self.add_mutable(fqn, method["weights"][fqn]["blob"])
            for delegate in method["delegates"]:
                for fqn in delegate["updates"]:
                    self.add_mutable(fqn, delegate["named_data"][WEIGHT_PREFIX + fqn])

    def add_mutable(self, fqn: str, key: str) -> None:
        if fqn not in self.mutable:
            initial = self.blobs[key]
            self.mutable[fqn] = (bytearray(initial), initial)

    def method_weights(self, weights: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {fqn: self.weight(fqn, meta) for fqn, meta in weights.items()}

    def weight(self, fqn: str, meta: dict[str, Any]) -> torch.Tensor:
        data = self.mutable[fqn][0] if fqn in self.mutable else self.blobs[meta["blob"]]
        return tensor_from_bytes(data, dtype_from_name(meta["dtype"]), meta["shape"])

    def delegate_named_data(self, delegate: dict[str, Any]) -> dict[str, BytesLike]:
        """The delegate's named data; a buffer it updates in place is the shared, writable state."""
        named_data: dict[str, BytesLike] = {local: self.blobs[key] for local, key in delegate["named_data"].items()}
        for fqn in delegate["updates"]:
            named_data[WEIGHT_PREFIX + fqn] = memoryview(self.mutable[fqn][0])
        return named_data

    def reset(self) -> None:
        for current, initial in self.mutable.values():
            current[:] = initial


def load_method(contents: PackageContents, state: ProgramState, name: str, manifest: dict[str, Any]) -> Method:
    weights = state.method_weights(manifest["weights"])
    delegates = {d["id"]: loaded_delegate(contents, state, d) for d in manifest["delegates"]}
    check = InputCheck(name, manifest["inputs"], pytree.treespec_loads(manifest["in_spec"]))
    return Method(name, manifest["plan"], weights, delegates, check, pytree.treespec_loads(manifest["out_spec"]))


def loaded_delegate(contents: PackageContents, state: ProgramState, manifest: dict[str, Any]) -> LoadedDelegate:
    backend = backend_class(manifest["backend_id"])()
    compile_specs = [CompileSpec(key, bytes.fromhex(value)) for key, value in manifest["compile_specs"]]
    named_data = state.delegate_named_data(manifest)
    handle = backend.init(bytes(contents.blobs[manifest["processed"]]), named_data, compile_specs)
    return LoadedDelegate(backend, handle)
