"""Loading a package: its weights mapped once, its delegates initialised, its methods ready to call."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..engine.registry import runtime_class
from ..errors import AotstackError, DelegateInitError, MethodNotFoundError, PackageError
from ..format.archive import PackageContents, read_package
from ..format.custom_ops import allowed_op_names, check_custom_ops
from ..format.manifest import DelegateRecord, MethodRecord, WeightRecord
from ..format.op_names import OpName
from ..format.plan import MethodPlan, WeightStep, refs, step_reads
from ..format.seal import PublicKeyLike, keys_from_environment, public_keys
from ..format.tensor_data import WEIGHT_PREFIX, BytesLike, dtype_from_name, tensor_from_bytes
from .inputs import InputCheck
from .interpreter import LoadedDelegate, StepProgram


class Method:
    """One loaded method: call it with the same arguments as the eager method."""

    def __init__(
        self,
        name: str,
        plan: MethodPlan,
        weights: Mapping[str, torch.Tensor],
        delegates: Mapping[str, LoadedDelegate],
        check: InputCheck,
        out_spec: pytree.TreeSpec,
        allowed_ops: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self.check = check
        self.out_spec = out_spec
        self.single_output = out_spec.is_leaf()
        self.body = StepProgram(plan.steps, weights, delegates, allowed_ops)
        self.outputs = [self.body.resolver(value) for value in plan.outputs]
        self.mutations = [(weights[fqn], self.body.slot(name)) for fqn, name in plan.mutations]
        # The program's one state lock (ProgramState.lock) where this method reads or updates a
        # buffer that some method or delegate updates; LoadedProgram sets it. None: nothing this
        # method reads changes, so calls run concurrently, from any number of threads.
        self.lock: threading.Lock | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Checked outside the lock: a bad call never waits for, or holds up, another thread.
        flat = self.check.flat_arguments(args, kwargs)
        if self.lock is None:
            slots = self.run(flat)
        else:
            with self.lock:
                slots = self.run(flat)
        if self.single_output:
            return self.outputs[0](slots)
        return pytree.tree_unflatten([output(slots) for output in self.outputs], self.out_spec)

    def run(self, flat: Sequence[Any]) -> list[Any]:
        """The plan run on checked arguments, and the buffers it updates written back."""
        slots = self.body.run(flat)
        for target, slot in self.mutations:
            target.copy_(slots[slot])
        return slots


class LoadedProgram:
    """A package opened by :func:`load`; each method is callable by name or as an attribute."""

    def __init__(self, path: str, methods: dict[str, Method], state: ProgramState) -> None:
        self.path = path
        self._methods = methods
        self._state = state
        for name in state.locked_methods & set(methods):
            methods[name].lock = state.lock
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
        """Put every buffer the methods update (a KV cache, say) back to its value in the file.

        It waits for a running call of a method that reads or updates those buffers to end.
        """
        with self._state.lock:
            self._state.reset()

    def __getattr__(self, name: str) -> Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.method(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))

    def _repr_html_(self) -> str:
        # The report reads the file's manifest only; imported here so loading never pays for it.
        from ..report.model import file_report

        return file_report(self.path)._repr_html_()


def load(
    path: str | os.PathLike[str], public_key: PublicKeyLike = None, *, allow_ops: Iterable[OpName] = ()
) -> LoadedProgram:
    """Open a ``.pt2`` written by :meth:`LoweredProgram.save` and get it ready to run.

    Example::

        loaded = aotstack.load("model.pt2")
        y = loaded.forward(x)

    The file's seal and every entry's SHA-256 are checked before any shared library is opened.
    With ``public_key`` (a key, a PEM file's path or PEM bytes, or a list of them), or with
    ``AOTSTACK_TRUSTED_KEYS`` set to such paths, a file not signed by one of those keys is
    refused before its manifest is parsed.

    A file calling custom ops (``torch.library`` ops outside ATen) needs them registered in this
    process first, by importing the module that defines them; ``CustomOpError`` names any missing.
    A custom op that no engine claimed runs as a step of the plan only where ``allow_ops`` names
    it, e.g. ``aotstack.load(path, allow_ops=["mylib.gather_qmv"])``.
    """
    return loaded_program(path, public_key, allowed_ops=allowed_op_names(allow_ops))


# Given a delegate's id and its run side, what the plan calls in its place.
DelegateWrapper = Callable[[str, LoadedDelegate], LoadedDelegate]


def loaded_program(
    path: str | os.PathLike[str],
    public_key: PublicKeyLike = None,
    *,
    allowed_ops: frozenset[str] | None = frozenset(),
    wrap_delegate: DelegateWrapper | None = None,
) -> LoadedProgram:
    """What :func:`load` returns; with ``wrap_delegate``, every delegate is passed through it first.

    Internal: the numerical check wraps each delegate to record what it was given and gave
    back. Wrapping happens once, at load, so a plain load's calls run exactly as before.
    ``allowed_ops=None`` allows every custom op the file lists: for the process that lowered it.
    """
    trusted = public_keys(public_key) if public_key is not None else keys_from_environment()
    contents = read_package(path, trusted)
    custom_ops = contents.manifest.custom_ops
    if allowed_ops is None:
        allowed_ops = frozenset(record.name for record in custom_ops)
    check_custom_ops(custom_ops, allowed_ops)
    state = ProgramState(contents)
    methods = {
        name: load_method(state, name, record, wrap_delegate, allowed_ops)
        for name, record in contents.manifest.methods.items()
    }
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
        for method in contents.manifest.methods.values():
            for fqn, _ in method.plan.mutations:
                self.add_mutable(fqn, method.weights[fqn].blob)
            for delegate in method.delegates:
                for fqn in delegate.updates:
                    self.add_mutable(fqn, delegate.named_data[WEIGHT_PREFIX + fqn])
        # One lock guards the state: a call of a method that reads or updates a buffer in
        # ``mutable`` holds it while it runs, and so does reset(); other methods take none.
        self.lock = threading.Lock()
        self.locked_methods = {
            name for name, method in contents.manifest.methods.items() if reads_state(method, set(self.mutable))
        }

    def add_mutable(self, fqn: str, key: str) -> None:
        if fqn not in self.mutable:
            initial = self.blobs[key]
            self.mutable[fqn] = (bytearray(initial), initial)

    def method_weights(self, weights: Mapping[str, WeightRecord]) -> dict[str, torch.Tensor]:
        return {fqn: self.weight(fqn, record) for fqn, record in weights.items()}

    def weight(self, fqn: str, record: WeightRecord) -> torch.Tensor:
        data = self.mutable[fqn][0] if fqn in self.mutable else self.blobs[record.blob]
        return tensor_from_bytes(data, dtype_from_name(record.dtype), record.shape)

    def delegate_named_data(self, delegate: DelegateRecord) -> dict[str, BytesLike]:
        """The delegate's named data; a buffer it updates in place is the shared, writable state."""
        named_data: dict[str, BytesLike] = {local: self.blobs[key] for local, key in delegate.named_data.items()}
        for fqn in delegate.updates:
            named_data[WEIGHT_PREFIX + fqn] = memoryview(self.mutable[fqn][0])
        return named_data

    def reset(self) -> None:
        for current, initial in self.mutable.values():
            current[:] = initial


def reads_state(method: MethodRecord, mutable: set[str]) -> bool:
    """Whether ``method``'s plan or delegates read or update one of the ``mutable`` buffers."""
    steps = method.plan.steps
    state = {step.name for step in steps if isinstance(step, WeightStep) and step.fqn in mutable}
    read = set(refs(method.plan.outputs)).union(*(step_reads(step) for step in steps))
    held = {local.removeprefix(WEIGHT_PREFIX) for delegate in method.delegates for local in delegate.named_data}
    return bool(method.plan.mutations or state & read or held & mutable)


def load_method(
    state: ProgramState,
    name: str,
    record: MethodRecord,
    wrap_delegate: DelegateWrapper | None = None,
    allowed_ops: frozenset[str] = frozenset(),
) -> Method:
    weights = state.method_weights(record.weights)
    delegates = {delegate.id: loaded_delegate(state, delegate) for delegate in record.delegates}
    if wrap_delegate is not None:
        delegates = {delegate_id: wrap_delegate(delegate_id, loaded) for delegate_id, loaded in delegates.items()}
    in_spec, out_spec = treespec(name, "in_spec", record.in_spec), treespec(name, "out_spec", record.out_spec)
    if in_spec.num_leaves != len(record.inputs) or out_spec.num_leaves != len(record.plan.outputs):
        raise PackageError(f"method {name!r}: its pytree specs do not match its inputs and outputs")
    try:
        check = InputCheck(name, record.inputs, in_spec)
        return Method(name, record.plan, weights, delegates, check, out_spec, allowed_ops)
    except PackageError as exc:
        raise PackageError(f"method {name!r}: {exc}") from None


def treespec(method: str, what: str, text: str) -> pytree.TreeSpec:
    try:
        return pytree.treespec_loads(text)
    except Exception as exc:
        # treespec_loads raises what its JSON and its registry raise; each means a bad spec.
        raise PackageError(f"method {method!r}: unreadable {what} ({type(exc).__name__}: {exc})") from None


def loaded_delegate(state: ProgramState, record: DelegateRecord) -> LoadedDelegate:
    runtime = runtime_class(record.backend_id)()
    named_data = state.delegate_named_data(record)
    try:
        handle = runtime.init(bytes(state.blobs[record.processed]), named_data, list(record.compile_specs))
    except AotstackError:
        raise
    except Exception as exc:
        # A run side's own failure, from a built-in engine or a user's, named for the person loading.
        raise DelegateInitError(
            f"delegate {record.id} ({record.backend_id}) could not start: {type(exc).__name__}: {exc}"
        ) from exc
    return LoadedDelegate(runtime, handle)
