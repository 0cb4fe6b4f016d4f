"""CUDA graphs, tested on the host: which methods can be captured, and what a graphed call does.

A stand-in for the graph (``RecordingGraph``) captures on the host the way a CUDA graph does on a
GPU: capturing records the work without its effects, and each replay runs it again into the very
tensors the capture returned. So the logic that a real capture can get wrong (warm-up calls, one
capture, arguments copied into the buffers the capture read, outputs copied out, state updated in
place across ``reset()``) is covered here without a GPU; ``test_cuda_end_to_end.py`` runs real
graphs where one is present.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch

import aotstack
from aotstack.errors import MethodNotFoundError, PackageError
from aotstack.format.devices import HOST, Device, DeviceType
from aotstack.format.manifest import DelegateRecord, Dim, InputRecord, MethodRecord
from aotstack.format.plan import DelegateStep, InputStep, MethodPlan, OpStep, Ref, WeightStep
from aotstack.format.state import state_devices
from aotstack.runtime.graphs import WARM_UP_CALLS, why_not_captured
from aotstack.runtime.load import loaded_program

WIDTH, LENGTH = 16, 8


class CacheStep(torch.nn.Module):
    """One decode step of a toy model: writes ``x`` into its cache at ``position``, reads the whole cache.

    It also counts its calls in a one-element buffer, which AOTInductor leaves to the method's plan
    to update (as transformers' caches leave their lengths): state on both sides of a delegate.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.project = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("cache", torch.zeros(1, LENGTH, WIDTH))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(1, position, x.unsqueeze(1))
        self.calls.add_(1)
        mixed = self.project(self.cache.mean(1)) * self.calls
        return mixed, torch.relu(mixed)


def step_inputs(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(index)), torch.tensor([index % LENGTH])


class RecordingGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the host (see the module's notes)."""

    def __init__(self, maker: RecordingGraphs) -> None:
        self.maker = maker
        self.body: Callable[[], list[torch.Tensor]] | None = None
        self.outputs: list[torch.Tensor] = []

    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        if self.maker.fail_with is not None:
            raise self.maker.fail_with
        # A capture launches nothing: the state it would have updated is as it was.
        state = [buffer.current for buffer in self.maker.program()._state.mutable.values()]
        saved = [bytes(current) for current in state]
        self.outputs = body()
        for current, before in zip(state, saved):
            current[:] = before
        self.body = body
        self.maker.captures += 1
        return self.outputs

    def replay(self) -> None:
        assert self.body is not None
        # A replay writes the captured tensors themselves, wherever the body's results land.
        for captured, fresh in zip(self.outputs, self.body(), strict=True):
            if fresh is not captured:
                captured.copy_(fresh)
        self.maker.replays += 1


class RecordingGraphs:
    device_type = "cpu"

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.fail_with = fail_with
        self.captures = 0
        self.replays = 0
        # The program whose state a capture leaves as it was; weakly, as a real graph holds no program.
        self.program: Callable[[], aotstack.LoadedProgram | None] = lambda: None

    def __call__(self, device: Device) -> RecordingGraph:
        assert device == HOST
        return RecordingGraph(self)


@pytest.fixture(scope="module")
def cache_step_file(tmp_path_factory):
    inputs = step_inputs(0)
    program = aotstack.export(CacheStep(), {"forward": inputs})
    path = tmp_path_factory.mktemp("graphs") / "cache_step.pt2"
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()]).save(path)
    return path


def graphed(path, maker: RecordingGraphs) -> aotstack.LoadedProgram:
    program = loaded_program(path, cuda_graphs=["forward"], graph_maker=maker)
    maker.program = weakref.ref(program)
    return program


def eager_steps(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = CacheStep()
    with torch.no_grad():
        return [model(*step_inputs(index)) for index in range(count)]


def test_a_graphed_method_warms_up_captures_once_then_replays_with_each_calls_arguments(cache_step_file):
    maker = RecordingGraphs()
    program = graphed(cache_step_file, maker)
    expected = eager_steps(WARM_UP_CALLS + 4)

    statuses = []
    for index, want in enumerate(expected):
        got = program.forward(*step_inputs(index))
        statuses.append(program.cuda_graphs["forward"])
        torch.testing.assert_close(got, want)

    assert statuses[WARM_UP_CALLS - 1].startswith("warming up (3 of 3")
    assert statuses[WARM_UP_CALLS:] == ["captured on cpu"] * 4
    assert (maker.captures, maker.replays) == (1, 4)


def test_a_graphed_calls_results_stay_valid_after_the_next_call(cache_step_file):
    program = graphed(cache_step_file, RecordingGraphs())
    for index in range(WARM_UP_CALLS):
        program.forward(*step_inputs(index))
    first = program.forward(*step_inputs(WARM_UP_CALLS))
    kept = [tensor.clone() for tensor in first]
    program.forward(*step_inputs(WARM_UP_CALLS + 1))

    assert all(torch.equal(tensor, copy) for tensor, copy in zip(first, kept))


def test_reset_keeps_the_states_address_so_the_graph_reads_the_reset_state(cache_step_file):
    maker = RecordingGraphs()
    program = graphed(cache_step_file, maker)
    state = program._state.mutable["cache"]
    address = torch.frombuffer(state.current, dtype=torch.uint8).data_ptr()
    expected = eager_steps(WARM_UP_CALLS + 2)
    for index in range(WARM_UP_CALLS + 2):
        program.forward(*step_inputs(index))

    program.reset()
    again = [program.forward(*step_inputs(index)) for index in range(WARM_UP_CALLS + 2)]

    assert torch.frombuffer(state.current, dtype=torch.uint8).data_ptr() == address
    assert maker.captures == 1, "the graph captured before reset() is replayed after it"
    for got, want in zip(again, expected):
        torch.testing.assert_close(got, want)


def test_a_capture_that_fails_leaves_the_method_running_as_before(cache_step_file):
    program = graphed(cache_step_file, RecordingGraphs(fail_with=RuntimeError("operation not permitted")))
    expected = eager_steps(WARM_UP_CALLS + 2)

    for index, want in enumerate(expected):
        torch.testing.assert_close(program.forward(*step_inputs(index)), want)
    assert program.cuda_graphs["forward"] == "not captured: capture failed: RuntimeError: operation not permitted"


def test_graphs_on_a_host_only_file_are_refused_with_the_reason_and_calls_run_as_before(cache_step_file):
    program = aotstack.load(cache_step_file, cuda_graphs=True)
    expected = eager_steps(WARM_UP_CALLS + 2)

    for index, want in enumerate(expected):
        torch.testing.assert_close(program.forward(*step_inputs(index)), want)
    assert program.cuda_graphs == {"forward": "not captured: delegate forward.0 runs on cpu, not on a cuda device"}
    assert program.forward.graph is None
    assert aotstack.load(cache_step_file).cuda_graphs == {}


def test_graphs_for_a_method_the_file_lacks_are_refused(cache_step_file):
    with pytest.raises(MethodNotFoundError, match="cuda_graphs names method 'decode'.*it has: forward"):
        aotstack.load(cache_step_file, cuda_graphs=["decode"])


def test_a_graphed_method_takes_a_lock_so_two_threads_never_share_its_buffers(cache_step_file):
    program = graphed(cache_step_file, RecordingGraphs())
    assert program.forward.lock is not None


# Which methods can be captured: decided from the file alone -------------------------------------


def tensor_input(name: str, shape: list) -> InputRecord:
    return InputRecord(name, "tensor", "float32", shape, device="cpu")


def cuda_delegate(delegate_id="d0", backend="aoti_cuda", device="cuda:0", updates=(), calls=()) -> DelegateRecord:
    return DelegateRecord(
        delegate_id, backend, device, [], [], [], [], "0" * 64, {}, updates=list(updates), calls=list(calls)
    )


def method(steps, delegates, inputs=None, outputs=None, mutations=()) -> MethodRecord:
    plan = MethodPlan(steps, outputs or [Ref("y")], list(mutations))
    return MethodRecord("", inputs or [tensor_input("x", [1, 4])], plan, "", "", {}, delegates)


def decode_plan(*middle) -> list:
    return [
        InputStep("x"),
        OpStep("x_cuda", "aotstack.h2d_copy.default", [Ref("x"), "cuda:0"], {}),
        *middle,
        DelegateStep("d0", ["x_cuda"], [(0, "y_cuda")]),
        OpStep("y", "aotstack.d2h_copy.default", [Ref("y_cuda")], {}),
    ]


def test_a_method_wholly_on_one_gpu_with_copies_in_and_out_can_be_captured():
    assert why_not_captured(method(decode_plan(), [cuda_delegate()]), "cuda") == Device(DeviceType.CUDA, 0)


def test_a_counter_the_plan_copies_to_the_gpu_and_back_does_not_stop_a_capture():
    steps = [
        InputStep("x"),
        WeightStep("count", "count"),
        OpStep("x_cuda", "aotstack.h2d_copy.default", [Ref("x"), "cuda:0"], {}),
        OpStep("count_cuda", "aotstack.h2d_copy.default", [Ref("count"), "cuda:0"], {}),
        DelegateStep("d0", ["x_cuda", "count_cuda"], [(0, "y_cuda"), (1, "count_new")]),
        OpStep("y", "aotstack.d2h_copy.default", [Ref("y_cuda")], {}),
        OpStep("count_host", "aotstack.d2h_copy.default", [Ref("count_new")], {}),
    ]
    record = method(steps, [cuda_delegate()], mutations=[("count", "count_host")])

    assert why_not_captured(record, "cuda") == Device(DeviceType.CUDA, 0)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (method(decode_plan(), [cuda_delegate()], inputs=[tensor_input("x", [Dim("s0", 1, 64), 4])]),
         "input 'x' has a dynamic shape"),
        (method(decode_plan(), [cuda_delegate()], inputs=[InputRecord("n", "int", dim=Dim("s0", 1, 8))]),
         "input 'n' is a int that changes between calls"),
        (method([InputStep("x"), OpStep("y", "aten.relu.default", [Ref("x")], {})], []), "it calls no delegate"),
        (method(decode_plan(), [cuda_delegate(backend="aoti_cpu", device="cpu")]),
         "delegate d0 runs on cpu, not on a cuda device"),
        (method(decode_plan(), [cuda_delegate(backend="onnxruntime", device="cuda:0")]),
         "delegate d0 runs on onnxruntime, whose run side cannot be captured"),
        (method(decode_plan(), [cuda_delegate(calls=["mylib.topk_sync.default"])]),
         "delegate d0 calls custom op mylib.topk_sync.default back through torch"),
        (method(decode_plan(), [cuda_delegate(), cuda_delegate("d1", device="cuda:1")]),
         "its delegates run on 2 devices (cuda:0, cuda:1)"),
        (method(decode_plan(OpStep("x_item", "aten.relu.default", [Ref("x_cuda")], {})), [cuda_delegate()]),
         "step 'x_item' (aten.relu.default) runs on the host"),
    ],
    ids=["dynamic shape", "symbolic int", "no delegate", "host delegate", "engine that syncs", "custom op",
         "two devices", "host step"],
)
def test_a_method_that_cannot_be_captured_says_why(record, reason):
    assert why_not_captured(record, "cuda") == reason


# Where each buffer's state lives ------------------------------------------------------------------


def test_state_lives_on_the_device_of_the_delegates_that_update_it_in_place():
    decode = method(decode_plan(), [cuda_delegate(updates=["cache"])])
    prefill = method(decode_plan(), [cuda_delegate("d1", updates=["cache"])])
    counter = method([InputStep("x"), WeightStep("count", "count")], [], mutations=[("count", "x")])

    devices = state_devices({"prefill": prefill, "decode": decode, "count": counter})

    assert devices == {"cache": Device(DeviceType.CUDA, 0), "count": HOST}


def test_a_buffer_updated_on_a_gpu_and_read_on_the_host_is_refused_naming_both():
    decode = method(decode_plan(), [cuda_delegate(updates=["cache"])])
    peek = method([InputStep("x"), WeightStep("cache", "cache")], [])

    with pytest.raises(PackageError, match=r"buffer 'cache' is used on cuda:0 by delegate d0 of 'decode', and on "
                                           r"cpu by method 'peek''s plan, which reads it"):
        state_devices({"decode": decode, "peek": peek})


def test_state_on_a_device_this_process_lacks_is_refused_naming_the_buffer():
    from aotstack.errors import DelegateInitError
    from aotstack.runtime.load import StateBuffer

    with pytest.raises(DelegateInitError, match="buffer 'cache' lives on cuda:63, which this process cannot use"):
        StateBuffer.starting_from("cache", memoryview(bytes(16)), Device(DeviceType.CUDA, 63))


def test_a_buffer_the_plan_holds_on_a_gpu_lives_there_and_its_weight_step_says_so_in_the_file():
    from aotstack.format.plan import step_from_json, step_to_json

    held = WeightStep("length", "length", device="cuda:0")
    decode = method([InputStep("x"), held], [cuda_delegate()], mutations=[("length", "x")])
    on_host = method([InputStep("x"), WeightStep("length", "length")], [], mutations=[("length", "x")])

    assert state_devices({"decode": decode}) == {"length": Device(DeviceType.CUDA, 0)}
    assert step_from_json(step_to_json(held)) == held
    assert step_to_json(WeightStep("w", "w")) == {"kind": "weight", "name": "w", "fqn": "w"}
    with pytest.raises(PackageError, match="buffer 'length' is used on cuda:0 by method 'decode''s plan"):
        state_devices({"decode": decode, "prefill": on_host})


@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graphed"])
def test_a_loaded_program_is_freed_as_soon_as_it_is_dropped(cache_step_file, graphs):
    """No reference cycle: an engine's session freed later by the garbage collector, perhaps in a forked child
    (a compile worker), can hang there waiting for threads the child does not have."""
    import gc

    program = graphed(cache_step_file, RecordingGraphs()) if graphs else aotstack.load(cache_step_file)
    for index in range(WARM_UP_CALLS + 2):
        program.forward(*step_inputs(index))
    method = weakref.ref(program.forward)
    gc.disable()
    try:
        del program
        assert method() is None
    finally:
        gc.enable()
