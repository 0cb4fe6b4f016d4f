"""Devices on boundary tensors: annotations, host-device copies, round trips dropped.

A small test backend says its delegates run on a CUDA device. Graph structure needs no GPU; the
runs at the end need one and skip without it.
"""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack import CompileSpec, DelegationSpec, Partitioner, PartitionResult, PreprocessResult
from aotstack.compile.partitioner import DELEGATION_TAG
from aotstack.format.archive import read_manifest
from aotstack.format.devices import Device
from aotstack.format.ops import call_delegate, d2h_copy, h2d_copy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class AddOnDeviceBackend(aotstack.Backend):
    """Runs ``a + b`` wherever its inputs are; the inputs' device is what the copies decide."""

    backend_id = "test_add_on_device"

    def preprocess(self, exported_program, compile_specs):
        return PreprocessResult(b"")

    def init(self, processed_bytes, named_data, compile_specs):
        return None

    def execute(self, handle, inputs):
        return [inputs[0] + inputs[1]]


class NodesOnDevice(Partitioner):
    """Each named add becomes its own delegate on ``device`` (no ``target_device`` when None)."""

    def __init__(self, device: str | None, *names: str) -> None:
        self.specs = [] if device is None else [CompileSpec("target_device", device.encode())]
        self.names = names

    def partition(self, exported_program):
        tags = {}
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            if node.name in self.names:
                node.meta[DELEGATION_TAG] = node.name
                tags[node.name] = DelegationSpec(AddOnDeviceBackend.backend_id, list(self.specs))
        return PartitionResult(exported_program, tags)


class Add(torch.nn.Module):
    def forward(self, a, b):
        return a + b


class AddAdd(torch.nn.Module):
    def forward(self, a, b, c):
        return (a + b) + c


class SharedOutput(torch.nn.Module):
    def forward(self, a, b, c):
        s = a + b
        return s + c, s * 2


def lowered(model: torch.nn.Module, *partitioners: Partitioner, **options) -> torch.export.ExportedProgram:
    inputs = tuple(torch.randn(4) for _ in range(model.forward.__code__.co_argcount - 1))
    program = aotstack.export(model, {"forward": inputs})
    return aotstack.lower(program, list(partitioners), **options).methods["forward"]


def calls(program, target) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.target is target]


def devices(program) -> dict[str, str]:
    return {n.name: str(n.meta["device"]) for n in program.graph.nodes if "device" in n.meta}


def test_one_delegate_on_cuda_copies_its_inputs_there_and_its_output_back():
    program = lowered(Add(), NodesOnDevice("cuda:0", "add"))

    h2d, d2h = calls(program, h2d_copy), calls(program, d2h_copy)
    assert len(h2d) == 2 and len(d2h) == 1
    assert all(n.args[1] == "cuda:0" for n in h2d)
    order = list(program.graph.nodes)
    [call] = calls(program, call_delegate)
    [item] = call.users
    assert max(order.index(n) for n in h2d) < order.index(call) < order.index(item) < order.index(d2h[0])
    where = devices(program)
    assert [where[n.name] for n in h2d] == ["cuda:0", "cuda:0"]
    assert where[call.name] == where[item.name] == "cuda:0"
    assert where[d2h[0].name] == where["a"] == where["b"] == "cpu"
    assert program.graph.output_node().args[0][0] is d2h[0]


def test_without_a_device_spec_nothing_is_copied_and_everything_is_on_the_host():
    program = lowered(Add(), NodesOnDevice(None, "add"))

    assert not calls(program, h2d_copy) and not calls(program, d2h_copy)
    tensor_nodes = [n for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert tensor_nodes and all(str(n.meta["device"]) == "cpu" for n in tensor_nodes)


def test_two_delegates_on_one_device_pass_their_tensor_directly():
    program = lowered(AddAdd(), NodesOnDevice("cuda:0", "add", "add_1"))

    assert len(calls(program, call_delegate)) == 2
    assert len(calls(program, h2d_copy)) == 3
    assert len(calls(program, d2h_copy)) == 1
    first, second = calls(program, call_delegate)
    [first_output] = first.users
    assert first_output in second.args[1]


def test_delegates_on_two_devices_keep_the_copies_between_them():
    program = lowered(AddAdd(), NodesOnDevice("cuda:0", "add"), NodesOnDevice("cuda:1", "add_1"))

    first, second = calls(program, call_delegate)
    [first_output] = first.users
    [to_host] = [n for n in first_output.users if n.target is d2h_copy]
    [to_cuda1] = [n for n in to_host.users if n.target is h2d_copy]
    assert to_cuda1.args[1] == "cuda:1" and to_cuda1 in second.args[1]
    assert len(calls(program, h2d_copy)) == 4 and len(calls(program, d2h_copy)) == 2


def test_an_output_read_on_the_device_and_on_the_host_is_copied_once_for_the_host():
    program = lowered(SharedOutput(), NodesOnDevice("cuda:0", "add", "add_1"))

    first = next(n for n in calls(program, call_delegate) if n.args[0] == "forward.0")
    [s] = first.users
    second = next(n for n in calls(program, call_delegate) if n.args[0] == "forward.1")
    assert s in second.args[1], "the device edge is direct"
    [to_host] = [n for n in s.users if n.target is d2h_copy]
    [mul] = calls(program, torch.ops.aten.mul.Tensor)
    assert mul.args[0] is to_host


def test_a_delegate_on_cuda_1_and_its_getitems_are_on_cuda_1():
    program = lowered(Add(), NodesOnDevice("cuda:1", "add"))

    [call] = calls(program, call_delegate)
    where = devices(program)
    assert where[call.name] == "cuda:1"
    assert all(where[item.name] == "cuda:1" for item in call.users)
    assert {n.args[1] for n in calls(program, h2d_copy)} == {"cuda:1"}


@pytest.mark.parametrize(
    ("options", "h2d", "d2h"),
    [
        ({}, 2, 1),
        ({"skip_h2d_for_method_inputs": True}, 0, 1),
        ({"skip_d2h_for_method_outputs": True}, 2, 0),
        ({"skip_h2d_for_method_inputs": {"forward"}, "skip_d2h_for_method_outputs": {"forward"}}, 0, 0),
        ({"skip_h2d_for_method_inputs": {"other"}}, 2, 1),
    ],
)
def test_each_skip_option_removes_exactly_its_copies(options, h2d, d2h):
    program = lowered(Add(), NodesOnDevice("cuda:0", "add"), **options)
    assert (len(calls(program, h2d_copy)), len(calls(program, d2h_copy))) == (h2d, d2h)


@pytest.mark.parametrize(
    ("spec", "parsed", "text"),
    [
        ("cpu", (aotstack.DeviceType.CPU, 0), "cpu"),
        ("Cuda:2", (aotstack.DeviceType.CUDA, 2), "cuda:2"),
        ("MPS", (aotstack.DeviceType.MPS, 0), "mps:0"),
        ("cuda", (aotstack.DeviceType.CUDA, 0), "cuda:0"),
    ],
)
def test_device_specs_parse_case_insensitively_with_index_0_by_default(spec, parsed, text):
    assert aotstack.parse_device_spec(spec) == parsed
    assert str(Device.parse(spec)) == text


@pytest.mark.parametrize("spec", ["tpu:0", "cuda:x", ""])
def test_a_bad_device_spec_lists_the_valid_types(spec):
    with pytest.raises(ValueError, match="valid types: cpu, cuda, mps|non-negative integer"):
        aotstack.parse_device_spec(spec)


def test_a_delegate_whose_backend_is_unknown_is_named():
    program = aotstack.export(Add(), {"forward": (torch.randn(4), torch.randn(4))}).methods["forward"]
    graph = program.graph
    [add] = calls(program, torch.ops.aten.add.Tensor)
    with graph.inserting_before(add):
        call = graph.call_function(call_delegate, ("forward.0", list(add.args)))
    with pytest.raises(aotstack.BackendNotFoundError, match=f"delegate node {call.name!r}.*'no_such_backend'"):
        aotstack.propagate_device_pass(program, {"forward.0": ("no_such_backend", "cuda:0")})


def test_save_and_load_keep_the_copies_and_inspect_shows_them(tmp_path):
    from tests.test_cli import aotstack_command

    program = aotstack.export(AddAdd(), {"forward": tuple(torch.randn(4) for _ in range(3))})
    aotstack.lower(program, [NodesOnDevice("cuda:0", "add", "add_1")]).save(tmp_path / "cuda.pt2")

    manifest = read_manifest(tmp_path / "cuda.pt2")
    targets = [getattr(step, "target", None) for step in manifest.methods["forward"].plan.steps]
    assert targets.count("aotstack.h2d_copy.default") == 3
    assert targets.count("aotstack.d2h_copy.default") == 1
    assert len(aotstack.load(tmp_path / "cuda.pt2").method("forward").body.actions) == 6
    listing = aotstack_command("inspect", tmp_path / "cuda.pt2", columns=200).stdout
    row = next(line for line in listing.splitlines() if " forward.0 " in line)
    assert "test_add_on_device" in row and "cuda:0" in row
    assert "host-device copies (4): a → cuda:0, b → cuda:0, c → cuda:0, getitem_1 → cpu" in listing


@needs_cuda
@pytest.mark.parametrize("index", [0, torch.cuda.device_count() - 1 if torch.cuda.is_available() else 0])
def test_a_cuda_delegate_runs_after_save_and_load_and_returns_host_tensors(tmp_path, index):
    a, b, c = (torch.randn(4) for _ in range(3))
    program = aotstack.export(AddAdd(), {"forward": (a, b, c)})
    aotstack.lower(program, [NodesOnDevice(f"cuda:{index}", "add", "add_1")]).save(tmp_path / "m.pt2")

    result = aotstack.load(tmp_path / "m.pt2").forward(a, b, c)

    assert result.device.type == "cpu"
    torch.testing.assert_close(result, (a + b) + c)


@needs_cuda
def test_the_skip_options_take_and_return_device_tensors(tmp_path):
    a, b = torch.randn(4), torch.randn(4)
    program = aotstack.export(Add(), {"forward": (a, b)})
    options = {"skip_h2d_for_method_inputs": True, "skip_d2h_for_method_outputs": True}
    aotstack.lower(program, [NodesOnDevice("cuda:0", "add")], **options).save(tmp_path / "m.pt2")

    result = aotstack.load(tmp_path / "m.pt2").forward(a.cuda(), b.cuda())

    assert result.device == torch.device("cuda:0")
    torch.testing.assert_close(result.cpu(), a + b)


class Running(torch.nn.Module):
    """A running total the method updates, and a sum; ``read_on_host`` also reads the total before the update."""

    def __init__(self, read_on_host: bool = False) -> None:
        super().__init__()
        self.read_on_host = read_on_host
        self.register_buffer("total", torch.zeros(4))

    def forward(self, a, b):
        before = self.total * 2 if self.read_on_host else None
        self.total.add_(a)
        return a + b if before is None else (a + b, before)


def test_a_buffer_only_delegates_on_one_device_use_lives_there_and_is_updated_there():
    from aotstack.compile.plan import method_plan
    from aotstack.format.plan import WeightStep

    program = lowered(Running(), NodesOnDevice("cuda:0", "add", "add_1"))

    # No copy of the total to the device and back: the plan holds it there.
    assert [n.args[0].name for n in calls(program, h2d_copy)] == ["a", "b"]
    [new_total, _] = program.graph.output_node().args[0]
    assert new_total.target is not d2h_copy and devices(program)[new_total.name] == "cuda:0"
    assert devices(program)["b_total"] == "cuda:0"
    [step] = [s for s in method_plan(program).steps if isinstance(s, WeightStep)]
    assert (step.fqn, step.device) == ("total", "cuda:0")


def test_a_buffer_a_host_op_also_reads_stays_on_the_host():
    from aotstack.compile.plan import method_plan
    from aotstack.format.plan import WeightStep

    program = lowered(Running(read_on_host=True), NodesOnDevice("cuda:0", "add", "add_1"))

    assert "b_total" in [n.args[0].name for n in calls(program, h2d_copy)]
    assert devices(program)["b_total"] == "cpu"
    [step] = [s for s in method_plan(program).steps if isinstance(s, WeightStep)]
    assert step.device is None
