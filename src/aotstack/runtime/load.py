"""Loading a package: its weights mapped once, its delegates initialised, its methods ready to call."""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..engine.registry import runtime_class
from ..errors import AotstackError, DelegateInitError, MethodNotFoundError, PackageError, RunError
from ..format.archive import PackageContents, advise_dont_need, read_package
from ..format.boundary import ProvenInput
from ..format.custom_ops import allowed_op_names, check_custom_ops
from ..format.devices import HOST, Device
from ..format.manifest import DelegateRecord, InputRecord, MethodRecord, WeightRecord
from ..format.op_names import OpName
from ..format.plan import MethodPlan, WeightStep, refs, step_reads
from ..format.seal import PublicKeyLike, keys_from_environment, public_keys
from ..format.state import state_devices
from ..format.tensor_data import WEIGHT_PREFIX, BytesLike, NamedDataValue, dtype_from_name, tensor_from_bytes
from .graphs import CudaGraphs, GraphedCall, GraphMaker, graphed_methods, use_graphs
from .handover import Handover
from .inputs import InputCheck
from .interpreter import LoadedDelegate, Slots, StepProgram, write_back
from .proven import proven_inputs, vouched_inputs


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
        self.plan_outputs = plan.outputs
        self.output_resolvers = [self.body.resolver(value) for value in plan.outputs]
        self.mutations = [(weights[fqn], self.body.slot(name)) for fqn, name in plan.mutations]
        # Where set (``graphs.use_graphs``), calls are replayed as a CUDA graph once it is captured.
        self.graph: GraphedCall | None = None
        # The program's one state lock (ProgramState.lock) where this method reads or updates a
        # buffer that some method or delegate updates; LoadedProgram sets it. None: nothing this
        # method reads changes, so calls run concurrently, from any number of threads.
        self.lock: threading.Lock | None = None
        # Run once, after the first call, on its slots: its delegates' engines say what they packed by then, and
        # are told what the plan vouches for (runtime/proven.py).
        self.after_first_call: Callable[[Slots], None] | None = None
        # Where engines keep buffers this method touches: moves them to where it reads them
        # (``Handover.claim``), under the state lock, before its plan runs.
        self.claim_state: Callable[[], None] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Checked outside the lock: a bad call never waits for, or holds up, another thread.
        flat = self.check.flat_arguments(args, kwargs)
        if self.lock is None:
            outputs = self.plain_call(flat) if self.graph is None else self.graph(self, flat)
        else:
            with self.lock:
                outputs = self.plain_call(flat) if self.graph is None else self.graph(self, flat)
        if self.single_output:
            return outputs[0]
        return pytree.tree_unflatten(outputs, self.out_spec)

    @property
    def inputs(self) -> list[InputRecord]:
        """What each flat input of the method must be, as exported: its name, kind, dtype and shape.

        Example: ``loaded.method("decode").inputs[0].shape == [1, 1]``; a dynamic size is a ``Dim``.
        """
        return list(self.check.records)

    def plain_call(self, flat: Sequence[Any]) -> list[Any]:
        """The plan run on checked arguments; its outputs, flat."""
        slots = self.run(flat)
        return [output(slots) for output in self.output_resolvers]

    def run(self, flat: Sequence[Any]) -> list[Any]:
        """The plan run on checked arguments, and the buffers it updates written back."""
        if self.claim_state is not None:
            self.claim_state()
        slots = self.body.run(flat)
        write_back(self.mutations, slots)
        if self.after_first_call is not None:
            done, self.after_first_call = self.after_first_call, None
            done(slots)
        return slots


class LoadedProgram:
    """A package opened by :func:`load`; each method is callable by name or as an attribute."""

    def __init__(
        self, path: str, methods: dict[str, Method], state: ProgramState, graph_statuses: dict[str, str] | None = None
    ) -> None:
        self.path = path
        self._methods = methods
        self._state = state
        # Why a method asked to run as a CUDA graph cannot be (``graphs.why_not_captured``).
        self._graph_statuses = graph_statuses or {}
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

    @property
    def cuda_graphs(self) -> dict[str, str]:
        """Each method loaded with ``cuda_graphs``, and whether it is captured, warming up, or why it is not.

        Example: ``{"decode": "captured on cuda:0", "prefill": "not captured: input 'input_ids' has a
        dynamic shape"}``.
        """
        statuses = dict(self._graph_statuses)
        statuses.update({name: method.graph.status for name, method in self._methods.items() if method.graph})
        return statuses

    @property
    def state_devices(self) -> dict[str, str]:
        """Each buffer the methods update (a KV cache) and where its one state lives: ``cpu``, ``cuda:0``."""
        return self._state.state_places()

    @property
    def kept_state(self) -> dict[str, dict[str, str]]:
        """Per method, each buffer an engine keeps inside itself there, and the delegate that keeps it.

        Example: ``{"decode": {"cache.key_0": "decode/decode.0"}}`` where OpenVINO holds the KV
        cache as its own state. A buffer not named is updated in place in its one memory
        (``state_devices``). The report lists which delegate owns each buffer; this says where
        loading put it.
        """
        return self._state.handover.keepers_by_method()

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
    path: str | os.PathLike[str],
    public_key: PublicKeyLike = None,
    *,
    allow_ops: Iterable[OpName] = (),
    cuda_graphs: bool | Iterable[str] | None = None,
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

    ``cuda_graphs`` (True for every method, or a list of names, e.g. ``cuda_graphs=["decode"]``)
    replays each named method whose plan runs wholly on one GPU with static shapes as one CUDA
    graph, after three plain calls; each call's results are copies, valid after the next call.
    ``loaded.cuda_graphs`` says which were captured, and why the others were not; those run as
    without graphs. Off by default: a graph keeps its own pool of device memory, and a method
    called once or with changing shapes gains nothing from one.
    """
    return loaded_program(path, public_key, allowed_ops=allowed_op_names(allow_ops), cuda_graphs=cuda_graphs)


# Given a delegate's id and its run side, what the plan calls in its place.
DelegateWrapper = Callable[[str, LoadedDelegate], LoadedDelegate]


def loaded_program(
    path: str | os.PathLike[str],
    public_key: PublicKeyLike = None,
    *,
    allowed_ops: frozenset[str] | None = frozenset(),
    wrap_delegate: DelegateWrapper | None = None,
    cuda_graphs: bool | Iterable[str] | None = None,
    graph_maker: GraphMaker | None = None,
) -> LoadedProgram:
    """What :func:`load` returns; with ``wrap_delegate``, every delegate is passed through it first.

    Internal: the numerical check wraps each delegate to record what it was given and gave
    back. Wrapping happens once, at load, so a plain load's calls run exactly as before.
    ``allowed_ops=None`` allows every custom op the file lists: for the process that lowered it.
    ``graph_maker`` makes the graphs ``cuda_graphs`` asks for (``CudaGraphs`` by default; the
    tests' stand-in captures on the host).
    """
    trusted = public_keys(public_key) if public_key is not None else keys_from_environment()
    contents = read_package(path, trusted)
    custom_ops = contents.manifest.custom_ops
    if allowed_ops is None:
        allowed_ops = frozenset(record.name for record in custom_ops)
    check_custom_ops(custom_ops, allowed_ops)
    records = contents.manifest.methods
    graphed = graphed_methods(cuda_graphs, records)
    state = ProgramState(contents)
    methods = {
        name: load_method(state, name, record, wrap_delegate, allowed_ops)
        for name, record in records.items()
    }
    state.handover.settled()
    for name in state.handover.places:
        methods[name].claim_state = functools.partial(state.handover.claim, name)
    # Verifying read every page of the file; what nothing reads in place now leaves memory.
    state.release_unread()
    statuses = use_graphs(methods, records, graphed, graph_maker or CudaGraphs())
    return LoadedProgram(contents.path, methods, state, statuses)


class ProgramState:
    """The weights of every method, each held once in memory and shared by the methods that read it.

    A weight is a read-only view of its verified blob. A buffer that a method or a delegate
    updates (a KV cache) gets one writable copy per FQN, which every method and delegate reads
    and updates: two methods that share a cache share it here too.
    """

    def __init__(self, contents: PackageContents) -> None:
        self.blobs = contents.blobs
        self.pages = contents.pages
        devices = state_devices(contents.manifest.methods)
        self.mutable: dict[str, StateBuffer] = {}
        # The blob each buffer in ``mutable`` starts from: read again only by reset().
        self.initial_blobs: set[str] = set()
        for method in contents.manifest.methods.values():
            for fqn, _ in method.plan.mutations:
                self.add_mutable(fqn, method.weights[fqn].blob, devices[fqn])
            for delegate in method.delegates:
                for fqn in delegate.updates:
                    self.add_mutable(fqn, delegate.named_data[WEIGHT_PREFIX + fqn], devices[fqn])
        # Who reads each blob where the file holds it: PLAN_READER for a method's weights, a
        # delegate by its id; the pages of a blob no one reads are dropped from memory.
        self.readers: dict[str, set[str]] = {}
        for method in contents.manifest.methods.values():
            for fqn, record in method.weights.items():
                if fqn not in self.mutable:
                    self.readers.setdefault(record.blob, set()).add(PLAN_READER)
        self.readers_lock = threading.Lock()
        # One lock guards the state: a call of a method that reads or updates a buffer in
        # ``mutable`` holds it while it runs, and so does reset(); other methods take none.
        self.lock = threading.Lock()
        # Per method, the buffers in ``mutable`` its plan or delegates read or update.
        mutable = set(self.mutable)
        self.touched = {name: touched_state(method, mutable) for name, method in contents.manifest.methods.items()}
        self.locked_methods = {name for name, fqns in self.touched.items() if fqns}
        # The buffers each delegate (by reader name) alone reads and updates in its method, which
        # its engine may keep inside itself (``Handover`` hands them between methods).
        self.keepable = keepable_buffers(contents.manifest.methods, mutable)
        self.handover = Handover(self.release_state)

    def add_mutable(self, fqn: str, key: str, device: Device) -> None:
        if fqn not in self.mutable:
            self.mutable[fqn] = StateBuffer.starting_from(fqn, self.blobs[key], device)
            self.initial_blobs.add(key)

    def add_reader(self, reader: str, delegate: DelegateRecord, released: Collection[str]) -> None:
        """``reader`` (a delegate) reads its named data where the file holds it, but ``released`` and its buffers."""
        with self.readers_lock:
            for key in read_blobs(delegate, released):
                self.readers.setdefault(key, set()).add(reader)

    def drop_reader(self, reader: str, delegate: DelegateRecord, released: Collection[str]) -> None:
        """``reader`` no longer reads ``released``: the pages of what no one else reads leave memory."""
        if not released:
            return
        with self.readers_lock:
            unread = []
            for key in {delegate.named_data[name] for name in released if name in delegate.named_data}:
                readers = self.readers.get(key, set())
                readers.discard(reader)
                if not readers:
                    self.readers.pop(key, None)
                    unread.append(key)
            self.release(unread)

    def release_unread(self) -> None:
        """Drop from memory every page of the file that holds no blob someone reads."""
        with self.readers_lock:
            self.release(None)

    def release(self, blobs: Collection[str] | None) -> None:
        # Called with readers_lock held: the blobs still read cannot change meanwhile.
        if self.pages is not None and (blobs is None or blobs):
            self.pages.release(blobs, keep=list(self.readers))

    def method_weights(self, weights: Mapping[str, WeightRecord]) -> dict[str, torch.Tensor]:
        return {fqn: self.weight(fqn, record) for fqn, record in weights.items()}

    def weight(self, fqn: str, record: WeightRecord) -> torch.Tensor:
        data = self.mutable[fqn].current if fqn in self.mutable else self.blobs[record.blob]
        return tensor_from_bytes(data, dtype_from_name(record.dtype), record.shape)

    def delegate_named_data(self, delegate: DelegateRecord) -> dict[str, NamedDataValue]:
        """The delegate's named data; a buffer it updates in place is the shared, writable state, where it lives."""
        named_data: dict[str, NamedDataValue] = {local: self.blobs[key] for local, key in delegate.named_data.items()}
        for fqn in delegate.updates:
            named_data[WEIGHT_PREFIX + fqn] = self.mutable[fqn].shared()
        return named_data

    def state_places(self) -> dict[str, str]:
        """Each buffer the methods update -> where its state lives: ``cpu``, ``cuda:0``."""
        return {fqn: str(buffer.device) for fqn, buffer in self.mutable.items()}

    def release_state(self, fqns: Iterable[str]) -> None:
        """Let the host memory of ``fqns`` leave memory: an engine holds their values now."""
        for fqn in fqns:
            self.mutable[fqn].release()

    def reset(self) -> None:
        for buffer in self.mutable.values():
            buffer.reset()
        self.handover.reset()
        # Copying read the initial values back in; they are not read again until the next reset.
        with self.readers_lock:
            self.release([key for key in self.initial_blobs if key not in self.readers])


@dataclass(eq=False)
class StateBuffer:
    """One buffer's state: its memory where it lives (host bytes, or bytes on a device), and its value in the file.

    The memory is allocated once and only ever written in place, so every delegate, method and
    captured CUDA graph that holds its address keeps seeing the current value, ``reset()`` included.
    On the host it is a private anonymous mapping, so that while an engine keeps the value, its
    pages can leave memory (``release``) and the cache is held once, not twice.
    """

    current: mmap.mmap | bytearray | torch.Tensor
    initial: memoryview
    device: Device

    @classmethod
    def starting_from(cls, fqn: str, initial: BytesLike, device: Device) -> StateBuffer:
        view = memoryview(initial)
        if device == HOST:
            if not view.nbytes:
                return cls(bytearray(), view, device)
            # Private: a forked child's state is its own (mmap's default, MAP_SHARED, would share it).
            current = mmap.mmap(-1, view.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            current[:] = view.cast("B")
            return cls(current, view, device)
        try:
            current = tensor_from_bytes(view, torch.uint8, [view.nbytes]).to(str(device))
        except (RuntimeError, AssertionError) as exc:
            # torch's own words for a device this build or machine lacks.
            raise DelegateInitError(f"buffer {fqn!r} lives on {device}, which this process cannot use: {exc}") from None
        return cls(current, view, device)

    def shared(self) -> NamedDataValue:
        """What a delegate that updates this buffer is handed: writable, its updates seen by all."""
        return self.current if isinstance(self.current, torch.Tensor) else memoryview(self.current)

    def reset(self) -> None:
        if isinstance(self.current, torch.Tensor):
            self.current.copy_(tensor_from_bytes(self.initial, torch.uint8, [self.initial.nbytes]))
        else:
            self.current[:] = self.initial.cast("B")

    def release(self) -> None:
        """Let the pages of the host memory leave memory: its value is stale (an engine holds the current one).

        Read again, the pages are zeros until written; the address stays.
        """
        if isinstance(self.current, mmap.mmap):
            advise_dont_need(self.current, 0, len(self.current))


# The reader of a method's own weights (its plan's weight steps), in ProgramState.readers.
PLAN_READER = "plan"


def read_blobs(delegate: DelegateRecord, released: Collection[str]) -> set[str]:
    """The blobs ``delegate`` reads where the file holds them: its named data but ``released`` and its buffers."""
    owned = {WEIGHT_PREFIX + fqn for fqn in delegate.updates}
    return {key for name, key in delegate.named_data.items() if name not in owned and name not in released}


def touched_state(method: MethodRecord, mutable: set[str]) -> set[str]:
    """The ``mutable`` buffers ``method``'s plan or delegates read or update."""
    return plan_state(method, mutable).union(*(held_state(delegate, mutable) for delegate in method.delegates))


def plan_state(method: MethodRecord, mutable: set[str]) -> set[str]:
    """The ``mutable`` buffers that ``method``'s plan itself reads or updates, outside its delegates."""
    steps = method.plan.steps
    read = set(refs(method.plan.outputs)).union(*(step_reads(step) for step in steps))
    weights = {step.fqn for step in steps if isinstance(step, WeightStep) and step.fqn in mutable and step.name in read}
    return weights | {fqn for fqn, _ in method.plan.mutations}


def held_state(delegate: DelegateRecord, mutable: set[str]) -> set[str]:
    """The ``mutable`` buffers ``delegate`` is handed as named data, to read or update."""
    return {local.removeprefix(WEIGHT_PREFIX) for local in delegate.named_data} & mutable


def keepable_buffers(methods: Mapping[str, MethodRecord], mutable: set[str]) -> dict[str, frozenset[str]]:
    """Per delegate (``method/id``), the ``mutable`` buffers it updates that nothing else in its method reads."""
    keepable = {}
    for name, method in methods.items():
        touched: dict[str, list[str]] = {fqn: [PLAN_READER] for fqn in plan_state(method, mutable)}
        for delegate in method.delegates:
            for fqn in held_state(delegate, mutable):
                touched.setdefault(fqn, []).append(delegate_reader(name, delegate))
        for delegate in method.delegates:
            reader = delegate_reader(name, delegate)
            keepable[reader] = frozenset(fqn for fqn in delegate.updates if touched.get(fqn) == [reader])
    return keepable


def delegate_reader(method: str, delegate: DelegateRecord) -> str:
    """How ``ProgramState`` names a delegate among the readers of blobs and state: ``method/id``."""
    return f"{method}/{delegate.id}"


def load_method(
    state: ProgramState,
    name: str,
    record: MethodRecord,
    wrap_delegate: DelegateWrapper | None = None,
    allowed_ops: frozenset[str] = frozenset(),
) -> Method:
    weights = state.method_weights(record.weights)
    # Each delegate is a reader of the file's blobs, named by its method and id.
    opened = [(delegate_reader(name, d), d, loaded_delegate(state, name, d)) for d in record.delegates]
    state.handover.add_method(name, state.touched[name])
    delegates = {d.id: delegate for _, d, delegate in opened}
    if wrap_delegate is not None:
        delegates = {delegate_id: wrap_delegate(delegate_id, loaded) for delegate_id, loaded in delegates.items()}
    in_spec, out_spec = treespec(name, "in_spec", record.in_spec), treespec(name, "out_spec", record.out_spec)
    if in_spec.num_leaves != len(record.inputs) or out_spec.num_leaves != len(record.plan.outputs):
        raise PackageError(f"method {name!r}: its pytree specs do not match its inputs and outputs")
    try:
        check = InputCheck(name, record.inputs, in_spec, record.guards)
        method = Method(name, record.plan, weights, delegates, check, out_spec, allowed_ops)
    except PackageError as exc:
        raise PackageError(f"method {name!r}: {exc}") from None
    if opened:
        vouched = vouched_inputs(record, weights)
        slot_of = method.body.slot
        method.after_first_call = lambda slots: after_first_call(
            state, opened, proven_inputs(vouched, lambda name: slots[slot_of(name)])
        )
    return method


def treespec(method: str, what: str, text: str) -> pytree.TreeSpec:
    try:
        return pytree.treespec_loads(text)
    except Exception as exc:
        unregistered = unregistered_type(exc)
        if unregistered is not None:
            module = unregistered.rpartition(".")[0]
            raise PackageError(
                f"method {method!r}: its {'inputs' if what == 'in_spec' else 'outputs'} are a {unregistered}, a type "
                f"its module registers with torch's pytree when imported; import {module} before aotstack.load (a "
                "file never makes aotstack import anything)"
            ) from None
        # treespec_loads raises what its JSON and its registry raise; each means a bad spec.
        raise PackageError(f"method {method!r}: unreadable {what} ({type(exc).__name__}: {exc})") from None


def unregistered_type(error: Exception) -> str | None:
    """The serialized name of the pytree type ``error`` says no module registered in this process, or None."""
    text = str(error)
    prefix, suffix = "Deserializing ", " in pytree is not registered"
    if not isinstance(error, NotImplementedError) or not text.startswith(prefix) or suffix not in text:
        return None
    return text[len(prefix):text.index(suffix)]


def loaded_delegate(state: ProgramState, method: str, record: DelegateRecord) -> LoadedDelegate:
    reader = delegate_reader(method, record)
    runtime = runtime_class(record.backend_id)()
    named_data = state.delegate_named_data(record)
    keepable = state.keepable.get(reader, frozenset())
    try:
        handle, kept = runtime.init_keeping_state(
            bytes(state.blobs[record.processed]), named_data, list(record.compile_specs), keepable
        )
        released = runtime.released_named_data(handle, list(named_data), False)
    except AotstackError:
        raise
    except Exception as exc:
        # A run side's own failure, from a built-in engine or a user's, named for the person loading.
        raise DelegateInitError(
            f"delegate {record.id} ({record.backend_id}) could not start: {type(exc).__name__}: {exc}"
        ) from exc
    if not set(kept) <= keepable:
        raise DelegateInitError(
            f"delegate {record.id} ({record.backend_id}) says it keeps buffers {sorted(set(kept) - keepable)} it "
            f"was not offered; it may keep only {sorted(keepable)}"
        )
    state.add_reader(reader, record, released)
    loaded = LoadedDelegate(runtime, handle)
    if kept:
        state.handover.add_keeper(method, reader, loaded, frozenset(kept))
    return loaded


def after_first_call(
    state: ProgramState,
    delegates: list[tuple[str, DelegateRecord, LoadedDelegate]],
    proven: Mapping[str, Mapping[int, ProvenInput]],
) -> None:
    """Once a method's first call has run: drop the file's pages of what each delegate's engine packed by then
    (``released_named_data``), and tell each engine which inputs the plan vouches for from now on.

    The first call checked every input, so a part whose outputs do not match its record has been
    refused before any check is left out (``runtime/proven.py``).
    """
    for reader, record, loaded in delegates:
        try:
            released = loaded.runtime.released_named_data(loaded.handle, list(record.named_data), True)
            if record.id in proven:
                loaded.runtime.trust_inputs(loaded.handle, proven[record.id])
        except Exception as exc:
            raise RunError(f"delegate {record.id} ({record.backend_id}): after its first call: {exc}") from exc
        state.drop_reader(reader, record, released)
