"""CUDA graphs: a method whose plan runs wholly on one GPU, replayed as one graph per call.

At batch 1 a decode step is hundreds of small kernels, and launching them, not their arithmetic,
sets its speed; a graph launches them all at once. A graphed method runs its first calls as any
method does (``WARM_UP_CALLS``: the libraries' kernels load, cuBLAS makes its workspace), then
captures its steps once, and from then on each call:

- copies its arguments into the buffers the capture read (a host argument straight into the device
  buffer its ``h2d_copy`` step filled, so the host-to-device copy happens, but outside the graph);
- replays the graph: weights and state sit at addresses fixed since load, and state is only ever
  written in place (``reset()`` too), so the graph keeps reading and updating the live state;
- returns copies of the graph's outputs (a ``d2h_copy`` step's host tensor is already one): a
  result stays valid after the next call, at the price of one device copy per output.

Capturing records the work without running it, so the call that captures then replays. A method
that cannot be captured (``why_not_captured``) runs as before, and its status says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..engine.registry import runtime_class
from ..errors import MethodNotFoundError
from ..format.devices import Device
from ..format.manifest import MethodRecord
from ..format.plan import InputStep, MethodPlan, OpStep, Ref, SubgraphStep, WeightStep, refs
from .interpreter import StepProgram, write_back

# Plain calls before the capture: the first call of an AOTInductor library loads its kernels, and
# cuBLAS makes its workspace on its first GEMM; neither may happen during a capture.
WARM_UP_CALLS = 3

H2D_COPY = "aotstack.h2d_copy.default"
D2H_COPY = "aotstack.d2h_copy.default"


class GraphableMethod(Protocol):
    """What a graph needs of a loaded method (``load.Method``): its steps, outputs and updates, and its plain call."""

    body: StepProgram
    plan_outputs: list[Any]
    output_resolvers: list[Callable[[list[Any]], Any]]
    mutations: list[tuple[torch.Tensor, int]]
    lock: threading.Lock | None
    graph: GraphedCall | None

    def plain_call(self, flat: Sequence[Any]) -> list[Any]: ...


class Graph(Protocol):
    """One captured graph: ``capture`` records what ``body`` launches, ``replay`` launches it again."""

    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Record ``body``'s work without running it; the tensors it returns, which each replay rewrites."""
        ...

    def replay(self) -> None: ...


class GraphMaker(Protocol):
    """Makes the graphs of the methods loaded with graphs; ``device_type``: the devices it captures on."""

    device_type: str

    def __call__(self, device: Device) -> Graph: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` on one device, captured with the private memory pool torch gives it."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        # Relaxed: AOTInductor's runner asks whether its last run's event completed before each
        # run, a query the stricter modes refuse while any stream of the process captures.
        with torch.cuda.device(str(self.device)), torch.cuda.graph(self.graph, capture_error_mode="relaxed"):
            return body()

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphs:
    """The graphs ``aotstack.load(path, cuda_graphs=...)`` captures methods in."""

    device_type = "cuda"

    def __call__(self, device: Device) -> Graph:
        return CudaGraph(device)


def why_not_captured(record: MethodRecord, device_type: str) -> str | Device:
    """The one device ``record``'s plan runs wholly on, where it can be captured; else why it cannot.

    Capturable: static shapes; every delegate on one device of ``device_type``, each of an engine
    whose run side only launches work there (``BackendRuntime.captures_in_graph``); no step on the
    host but the copies of the method's inputs to the device and of its outputs back.
    """
    for item in record.inputs:
        if item.kind == "tensor" and not all(isinstance(size, int) for size in item.shape or []):
            return f"input {item.name!r} has a dynamic shape"
        if item.kind in ("int", "float", "bool") and item.value is None:
            return f"input {item.name!r} is a {item.kind} that changes between calls"
    if not record.delegates:
        return "it calls no delegate"
    devices = {delegate.target_device for delegate in record.delegates}
    for delegate in record.delegates:
        if not delegate.target_device.startswith(device_type):
            return f"delegate {delegate.id} runs on {delegate.target_device}, not on a {device_type} device"
        if not getattr(runtime_class(delegate.backend_id), "captures_in_graph", False):
            return f"delegate {delegate.id} runs on {delegate.backend_id}, whose run side cannot be captured"
        if delegate.calls:
            # A custom op runs whatever its author wrote, a wait for the host (``.item()``) included.
            return f"delegate {delegate.id} calls custom op {delegate.calls[0]} back through torch"
    if len(devices) > 1:
        return f"its delegates run on {len(devices)} devices ({', '.join(sorted(devices))})"
    host_steps = host_work(record.plan)
    if host_steps:
        return f"step {host_steps[0]} runs on the host"
    return Device.parse(devices.pop())


def host_work(plan: MethodPlan) -> list[str]:
    """The steps that a graph cannot hold: all but delegates, the copies in and the copies out.

    A copy in takes a method input or a buffer the plan reads (a one-element counter the plan
    updates) to the device; a copy out brings back an output or a buffer's new value. Each runs
    on every call, outside the graph, into or out of the buffers the graph reads and writes.
    """
    sources = {step.name for step in plan.steps if isinstance(step, (InputStep, WeightStep))}
    results = set(refs(plan.outputs)) | {name for _, name in plan.mutations}
    found = []
    for step in plan.steps:
        if isinstance(step, SubgraphStep):
            found.append(f"{step.name!r} (a branch or loop)")
        elif isinstance(step, OpStep) and not (is_copy_in(step, sources) or is_copy_out(step, results)):
            found.append(f"{step.name!r} ({step.target})")
    return found


def is_copy_in(step: OpStep, sources: set[str]) -> bool:
    return step.target == H2D_COPY and isinstance(step.args[0], Ref) and step.args[0].name in sources


def is_copy_out(step: OpStep, results: set[str]) -> bool:
    return step.target == D2H_COPY and step.name in results


class GraphedCall:
    """A method's calls: plain ones first, then one capture, then replays (see the module's notes).

    Called with the method and a flat list of its checked arguments. It keeps what it derives from
    the method (its steps split into copies in, captured work and copies out), never the method
    itself: a method holding a graph that holds the method would be a cycle, freed only by the
    garbage collector, which may run in a forked child, where freeing an engine's session can hang.
    """

    def __init__(self, method: GraphableMethod, device: Device, graph_maker: GraphMaker) -> None:
        self.device = device
        self.graph_maker = graph_maker
        self.calls = 0
        self.graph: Graph | None = None
        self.failure: str | None = None
        body = method.body
        self.body = body
        inputs = {slot: index for index, slot in enumerate(body.input_slots)}
        results = {body.slot(ref) for ref in refs(method.plan_outputs)}
        results |= {slot for _, slot in method.mutations}
        # Each copy in: what it copies (an argument, or a buffer's current value) and the slot it fills.
        self.prologue: list[tuple[Reader, int]] = []
        self.captured: list[Callable[[list[Any]], None]] = []
        self.epilogue: list[Callable[[list[Any]], None]] = []
        self.epilogue_slots: set[int] = set()
        for action, step in zip(body.actions, body.action_steps, strict=True):
            if isinstance(step, OpStep) and step.target == H2D_COPY:
                source = body.slot(step.args[0].name)
                self.prologue.append((source_reader(source, inputs, body.template), body.slot(step.name)))
            elif isinstance(step, OpStep) and step.target == D2H_COPY and body.slot(step.name) in results:
                self.epilogue.append(action)
                self.epilogue_slots.add(body.slot(step.name))
            else:
                self.captured.append(action)
        copied = {read.argument for read, _ in self.prologue}
        self.direct_inputs = [(index, slot) for slot, index in inputs.items() if index not in copied]
        # A buffer the plan updates on the graph's device is written inside the graph; one on the host after it.
        self.captured_mutations = [(target, slot) for target, slot in method.mutations if on(target, device)]
        self.host_mutations = [(target, slot) for target, slot in method.mutations if not on(target, device)]
        # (what it copies, the buffer the graph reads it from)
        self.static: list[tuple[Reader, torch.Tensor]] = []
        self.slots: list[Any] = []
        self.outputs: list[Callable[[list[Any]], Any]] = []

    @property
    def status(self) -> str:
        if self.failure is not None:
            return f"not captured: {self.failure}"
        if self.graph is not None:
            return f"captured on {self.device}"
        return f"warming up ({self.calls} of {WARM_UP_CALLS} plain calls before the capture)"

    def __call__(self, method: GraphableMethod, flat: Sequence[Any]) -> list[Any]:
        if self.graph is not None:
            return self.replayed(flat)
        if self.failure is not None or self.calls < WARM_UP_CALLS:
            self.calls += 1
            return method.plain_call(flat)
        try:
            self.capture(method, flat)
        except Exception as exc:
            # The method runs on as before; the graph's status keeps why.
            self.failure = f"capture failed: {type(exc).__name__}: {exc}"
            self.graph = None
            return method.plain_call(flat)
        return self.replayed(flat)

    def capture(self, method: GraphableMethod, flat: Sequence[Any]) -> None:
        slots = self.body.template.copy()
        self.static = []
        for read, slot in self.prologue:
            slots[slot] = self.static_buffer(read, torch.as_tensor(read(flat)).to(str(self.device)))
        for index, slot in self.direct_inputs:
            value = flat[index]
            slots[slot] = self.static_buffer(Reader(index), value) if isinstance(value, torch.Tensor) else value
        graph = self.graph_maker(self.device)
        written: list[int] = []

        def run_captured() -> list[torch.Tensor]:
            # On a copy of the slots: what the graph rewrites on each replay is what it returned.
            work = slots.copy()
            for action in self.captured:
                action(work)
            write_back(self.captured_mutations, work)
            if not written:
                written.extend(i for i, value in enumerate(work) if isinstance(value, torch.Tensor))
            return [work[i] for i in written]

        captured = graph.capture(run_captured)
        for index, tensor in zip(written, captured, strict=True):
            slots[index] = tensor
        self.slots = slots
        self.outputs = [self.copied_out(resolve) for resolve in method.output_resolvers]
        self.graph = graph

    def static_buffer(self, read: Reader, value: torch.Tensor) -> torch.Tensor:
        buffer = value.clone()
        self.static.append((read, buffer))
        return buffer

    def copied_out(self, resolve: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``resolve``, its value copied where it is one the next replay rewrites in place."""
        value = resolve(self.slots)
        if not isinstance(value, torch.Tensor) or any(value is self.slots[slot] for slot in self.epilogue_slots):
            return resolve
        return lambda slots: resolve(slots).clone()

    def replayed(self, flat: Sequence[Any]) -> list[Any]:
        for read, buffer in self.static:
            value = read(flat)
            if not (isinstance(value, torch.Tensor) and value.data_ptr() == buffer.data_ptr()):
                buffer.copy_(value)
        assert self.graph is not None
        self.graph.replay()
        slots = self.slots
        for action in self.epilogue:
            action(slots)
        write_back(self.host_mutations, slots)
        return [output(slots) for output in self.outputs]


def on(tensor: torch.Tensor, device: Device) -> bool:
    return tensor.device.type == device.type.value and (tensor.device.index or 0) == device.index


@dataclass(frozen=True)
class Reader:
    """What a copy into the graph's buffers copies on each call: argument ``argument``, else ``value`` (a buffer)."""

    argument: int | None
    value: Any = None

    def __call__(self, flat: Sequence[Any]) -> Any:
        return self.value if self.argument is None else flat[self.argument]


def source_reader(slot: int, inputs: dict[int, int], template: list[Any]) -> Reader:
    """The reader of what fills ``slot``: the argument whose slot it is, or the weight or state the plan put there."""
    return Reader(inputs[slot]) if slot in inputs else Reader(None, template[slot])


def graphed_methods(
    requested: bool | Iterable[str] | None, records: dict[str, MethodRecord]
) -> list[str]:
    """The methods ``cuda_graphs`` asks for: none, all (True), or those it names, each checked to exist."""
    if requested is None or requested is False:
        return []
    if requested is True:
        return list(records)
    if isinstance(requested, str):
        requested = [requested]
    names = list(requested)
    for name in names:
        if name not in records:
            raise MethodNotFoundError(
                f"cuda_graphs names method {name!r}, which the file lacks; it has: {', '.join(records)}"
            )
    return names


def use_graphs(
    methods: dict[str, GraphableMethod], records: dict[str, MethodRecord], names: list[str], maker: GraphMaker
) -> dict[str, str]:
    """Give each named method its graph where it can be captured; each one's status, or why not."""
    statuses = {}
    for name in names:
        where = why_not_captured(records[name], maker.device_type)
        if isinstance(where, str):
            statuses[name] = f"not captured: {where}"
            continue
        method = methods[name]
        method.graph = GraphedCall(method, where, maker)
        if method.lock is None:
            # Every call of a graph reads and writes the same buffers.
            method.lock = threading.Lock()
    return statuses
