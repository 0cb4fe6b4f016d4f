"""``lower(..., check=...)``: every output of the lowered program against eager PyTorch, and each delegate's outputs
against the eager ops it replaced.

The backends here are Python test backends whose run side adds an offset (a compile spec) to a two-tensor add, so a
wrong answer is made on purpose and the check must find it; one small AOTInductor package, shared with the other
test files, shows the check on a real engine.
"""

from __future__ import annotations

import json
import math
import tempfile

import pytest
import torch

import aotstack
from aotstack import Check, CheckError, CompileSpec, DelegationSpec, PartitionResult, PreprocessResult
from aotstack.compile.check import (
    CheckResult,
    check_package,
    compared_outputs,
    leaf_difference,
    on_devices,
    placed_inputs,
    tensor_difference,
)
from aotstack.compile.partitioner import DELEGATION_TAG
from aotstack.format.manifest import InputRecord
from tests import models

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def offset_of(compile_specs: list[CompileSpec]) -> float:
    return next((float(spec.value.decode()) for spec in compile_specs if spec.key == "offset"), 0.0)


class OffsetAddBackend(aotstack.Backend):
    """Runs a two-tensor add, then adds its ``offset`` compile spec (0 unless given): a wrong answer made to order."""

    backend_id = "test_check_add"

    def preprocess(self, exported_program, compile_specs):
        return PreprocessResult(b"add")

    def init(self, processed_bytes, named_data, compile_specs):
        return offset_of(compile_specs)

    def execute(self, handle, inputs):
        return [inputs[0] + inputs[1] + handle]


class AddOneBackend(OffsetAddBackend):
    """Adds 1 to every answer, whatever its compile specs say."""

    backend_id = "test_add_one"

    def init(self, processed_bytes, named_data, compile_specs):
        return 1.0


class Adds(aotstack.Partitioner):
    """Each two-tensor add its own delegate: for ``backends[node name]`` where named, else ``default``."""

    def __init__(
        self, default: str = OffsetAddBackend.backend_id, offset: float = 0.0, device: str | None = None, **backends
    ) -> None:
        self.default, self.backends = default, backends
        self.specs = [CompileSpec("offset", str(offset).encode())]
        if device is not None:
            self.specs.append(CompileSpec("target_device", device.encode()))

    def partition(self, exported_program):
        tags = {}
        weights = fixed_weights(exported_program)
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            if (
                node.target == torch.ops.aten.add.Tensor
                and len(node.all_input_nodes) == 2
                and not any(arg.name in weights for arg in node.all_input_nodes)
            ):
                node.meta[DELEGATION_TAG] = node.name
                tags[node.name] = DelegationSpec(self.backends.get(node.name, self.default), list(self.specs))
        return PartitionResult(exported_program, tags)


def fixed_weights(exported_program: torch.export.ExportedProgram) -> set[str]:
    """Placeholders of weights no method updates: a partition reading one owns it, and these backends hold none."""
    signature = exported_program.graph_signature
    updated = set(signature.buffers_to_mutate.values())
    named = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    named.update(signature.inputs_to_lifted_tensor_constants)
    return {name for name, fqn in named.items() if fqn not in updated}


class AddAdd(torch.nn.Module):
    """``(a + b) + c``: two adds, the second reading the first."""

    def forward(self, a, b, c):
        return (a + b) + c


class TwoOutputs(torch.nn.Module):
    """A tuple: ``[0]`` from an add a delegate runs, ``[1]`` from a multiply left to plain ATen."""

    def forward(self, a, b):
        return a + b, a * b


class DictOutput(torch.nn.Module):
    def forward(self, a, b):
        return {"logits": a + b, "scale": a * 2}


def program_of(model: torch.nn.Module, count: int, shape: tuple[int, ...] = (4, 5)) -> aotstack.Program:
    generator = torch.Generator().manual_seed(0)
    return aotstack.export(model, {"forward": tuple(torch.randn(shape, generator=generator) for _ in range(count))})


def test_a_correct_lowering_passes_and_records_each_outputs_differences():
    program = program_of(TwoOutputs(), 2)

    lowered = aotstack.lower(program, [Adds()], check=True)

    result = lowered.check_result
    assert isinstance(result, CheckResult) and result.passed
    assert result.check == Check()
    assert [(d.method, d.output, d.max_abs, d.max_rel, d.passed) for d in result.outputs] == [
        ("forward", "[0]", 0.0, 0.0, True),
        ("forward", "[1]", 0.0, 0.0, True),
    ]
    assert result.delegates == []


def test_no_check_by_default():
    lowered = aotstack.lower(program_of(TwoOutputs(), 2), [Adds(AddOneBackend.backend_id)])

    assert lowered.check_result is None


def test_a_delegate_adding_one_fails_the_check_naming_the_method_and_the_output():
    program = program_of(TwoOutputs(), 2)

    with pytest.raises(CheckError) as raised:
        aotstack.lower(program, [Adds(AddOneBackend.backend_id)], check=True)

    message = str(raised.value)
    assert "method 'forward': output [0] differs from eager: max abs 1.000e+00" in message
    assert "(atol 1e-04, rtol 1e-04)" in message
    assert "output [1]" not in message
    result = raised.value.result
    assert not result.passed
    assert [(d.output, d.passed) for d in result.outputs] == [("[0]", False), ("[1]", True)]
    assert result.outputs[0].max_abs == pytest.approx(1.0)
    eager = program.methods["forward"].module()(*program.methods["forward"].example_inputs[0])[0]
    assert result.outputs[0].max_rel == pytest.approx(float((1 / eager.abs()).max()), rel=1e-4)
    # The lowered program is still there to inspect or save.
    assert isinstance(raised.value.lowered, aotstack.LoweredProgram)
    assert raised.value.lowered.check_result is result
    assert isinstance(raised.value, aotstack.LoweringError)


def test_outputs_are_named_by_their_pytree_path():
    with pytest.raises(CheckError) as raised:
        aotstack.lower(program_of(DictOutput(), 2), [Adds(AddOneBackend.backend_id)], check=True)

    assert "output ['logits'] differs from eager" in str(raised.value)
    assert {d.output: d.passed for d in raised.value.result.outputs} == {"['logits']": False, "['scale']": True}


def test_a_lone_output_is_called_output():
    with pytest.raises(CheckError, match=r"method 'forward': output differs from eager"):
        aotstack.lower(program_of(AddAdd(), 3), [Adds(AddOneBackend.backend_id)], check="outputs")


def test_the_partition_check_names_the_wrong_delegate_and_not_the_one_fed_by_it():
    program = program_of(AddAdd(), 3)

    # The first add is wrong; the second gets its wrong answer, but adds correctly what it gets.
    with pytest.raises(CheckError) as raised:
        aotstack.lower(program, [Adds(add=AddOneBackend.backend_id)], check="partition")

    message = str(raised.value)
    assert "method 'forward': output differs from eager: max abs 2.000e+00" not in message
    assert "method 'forward': output differs from eager: max abs 1.000e+00" in message
    assert "delegate forward.0 (test_add_one): output 0 differs from its eager ops: max abs 1.000e+00" in message
    assert "delegate forward.0 (test_add_one) produced the wrong answer" in message
    assert "forward.1" not in message
    result = raised.value.result
    assert [(d.delegate, d.backend_id, d.output, d.passed) for d in result.delegates] == [
        ("forward.0", "test_add_one", "output 0", False),
        ("forward.1", "test_check_add", "output 0", True),
    ]
    assert result.failing_delegates() == ["forward.0 (test_add_one)"]
    assert set(raised.value.lowered.references["forward"]) == {"forward.0", "forward.1"}


def test_the_partition_check_names_a_wrong_second_delegate_too():
    with pytest.raises(CheckError) as raised:
        aotstack.lower(program_of(AddAdd(), 3), [Adds(add_1=AddOneBackend.backend_id)], check="partition")

    assert "delegate forward.1 (test_add_one) produced the wrong answer" in str(raised.value)
    assert raised.value.result.failing_delegates() == ["forward.1 (test_add_one)"]


def test_a_correct_partition_check_passes_with_every_delegate_compared():
    lowered = aotstack.lower(program_of(AddAdd(), 3), [Adds()], check=Check(partition=True))

    result = lowered.check_result
    assert result.passed
    assert [(d.delegate, d.output, d.max_abs) for d in result.delegates] == [
        ("forward.0", "output 0", 0.0),
        ("forward.1", "output 0", 0.0),
    ]


def test_the_tolerance_is_the_users():
    program = program_of(TwoOutputs(), 2)

    lowered = aotstack.lower(program, [Adds(offset=1e-3)], check=Check(atol=1e-2))
    assert lowered.check_result.passed
    assert lowered.check_result.outputs[0].max_abs == pytest.approx(1e-3, rel=1e-2)

    with pytest.raises(CheckError, match=r"output \[0\] differs from eager: max abs 1\.000e-03"):
        aotstack.lower(program, [Adds(offset=1e-3)], check=True)


@pytest.mark.parametrize("value", ["partitions", "yes", 1, 0.5, Check])
def test_a_bad_check_value_is_refused(value):
    with pytest.raises(ValueError, match="check must be True, False, 'outputs', 'partition' or an aotstack.Check"):
        aotstack.lower(program_of(TwoOutputs(), 2), [Adds()], check=value)


@pytest.mark.parametrize("tolerance", [{"atol": -1e-3}, {"rtol": math.nan}, {"atol": math.inf}, {"rtol": "1e-3"}])
def test_a_bad_tolerance_is_refused(tolerance):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        Check(**tolerance)


def test_a_tolerance_is_written_as_given():
    assert Check(atol=1e-2, rtol=0).tolerance_text() == "atol 1e-02, rtol 0e+00"
    assert Check(atol=1.5e-3).tolerance_text(torch.float32) == "atol 1.500e-03, rtol 1e-04"
    assert Check(atol=1.5e-3).tolerance_text(torch.bfloat16) == "atol 1.500e-03, rtol 5e-02"


def test_an_unset_tolerance_is_the_outputs_dtypes_and_a_given_one_holds_for_every_dtype():
    assert Check().tolerance(torch.float32) == Check().tolerance(torch.float64) == (1e-4, 1e-4)
    assert Check().tolerance(torch.bfloat16) == (1e-1, 5e-2)
    assert Check().tolerance(torch.float16) == (1e-2, 1e-2)
    assert Check(rtol=0).tolerance(torch.bfloat16) == (1e-1, 0)
    assert Check().tolerance_text() == "atol 1e-04, rtol 1e-04"
    assert Check().tolerance_text(torch.float32, torch.bfloat16, torch.float32) == (
        "float32: atol 1e-04, rtol 1e-04; bfloat16: atol 1e-01, rtol 5e-02"
    )


def test_a_bf16_output_a_few_units_off_passes_by_default_and_its_failure_names_the_bf16_tolerance():
    # 1.0 against 1.0625: eight bf16 units (2**-7 each at 1.0) apart, what a fused bf16 layer stack leaves.
    lowered, eager = torch.tensor([1.0625, 3.0], dtype=torch.bfloat16), torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    assert tensor_difference(lowered, eager, Check())[2] is True
    assert tensor_difference(lowered.float(), eager.float(), Check())[2] is False, "float32 keeps 1e-4"
    far = leaf_difference("forward", "output", lowered + 1, eager, Check())
    assert not far.passed and far.failure_line(Check()).endswith("(atol 1e-01, rtol 5e-02)")


def test_the_check_leaves_the_models_buffers_as_they_were():
    model = models.build("buffer")
    model.running.copy_(torch.linspace(-1, 1, 6))
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    program = aotstack.export(model, {"forward": models.example_inputs("buffer")})
    exported = program.methods["forward"]
    assert exported.state_dict["running"] is model.running, "the program shares the model's buffer"

    for check in (True, "partition", True):
        lowered = aotstack.lower(program, [Adds()], check=check)
        assert lowered.check_result.passed

    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    # The eager method updates ``running`` in place: the check would have moved it each time.
    exported.module()(*models.example_inputs("buffer"))
    assert not torch.equal(model.running, before["running"])


def test_a_non_persistent_buffer_is_restored_too():
    model = models.build("state_kinds")
    program = aotstack.export(model, {"forward": models.example_inputs("state_kinds")})

    lowered = aotstack.lower(program, [Adds()], check="partition")

    assert lowered.check_result.passed
    assert torch.equal(model.calls, torch.zeros(1))


def test_the_buffers_are_restored_when_the_check_fails():
    model = models.build("buffer")
    program = aotstack.export(model, {"forward": models.example_inputs("buffer")})

    with pytest.raises(CheckError):
        aotstack.lower(program, [Adds(AddOneBackend.backend_id)], check="partition")

    assert torch.equal(model.running, torch.zeros(6))


def test_each_method_runs_from_the_same_state_eagerly_and_lowered():
    """Two methods updating one buffer: each is compared from the initial state, not after the other."""

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            self.total.copy_(self.total + x)
            return self.total * 1

        def twice(self, x):
            self.total.copy_(self.total + x + x)
            return self.total * 1

    model = Counter()
    x = torch.ones(3)
    program = aotstack.export(model, {"forward": (x,), "twice": (x,)})

    lowered = aotstack.lower(program, [Adds()], check=True)

    assert lowered.check_result.passed
    assert [d.method for d in lowered.check_result.outputs] == ["forward", "twice"]
    assert torch.equal(model.total, torch.zeros(3))


def test_the_temporary_package_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    program = program_of(TwoOutputs(), 2)

    aotstack.lower(program, [Adds()], check=True)
    with pytest.raises(CheckError):
        aotstack.lower(program, [Adds(AddOneBackend.backend_id)], check="partition")

    assert list(tmp_path.iterdir()) == []


def test_a_method_without_example_inputs_cannot_be_checked():
    program = program_of(TwoOutputs(), 2)
    program.methods["forward"].example_inputs = None

    with pytest.raises(aotstack.LoweringError, match="method 'forward' has no example inputs"):
        aotstack.lower(program, [Adds()], check=True)


def test_the_result_as_text_and_json():
    with pytest.raises(CheckError) as raised:
        aotstack.lower(program_of(AddAdd(), 3), [Adds(add=AddOneBackend.backend_id)], check="partition")
    result = raised.value.result

    text = result.text()
    lines = text.splitlines()
    assert lines[0] == "numerical check of outputs and delegates (atol 1e-04, rtol 1e-04): FAILED"
    assert len(lines) == 2 + 3
    assert "method 'forward'" in lines[2] and "1.000e+00" in lines[2] and lines[2].endswith("FAIL")
    assert "delegate forward.1 (test_check_add)" in lines[4] and lines[4].endswith("ok")
    data = json.loads(json.dumps(result.to_json()))
    assert data["check"] == {"partition": True, "atol": None, "rtol": None}, "None: each output's dtype's default"
    assert data["passed"] is False
    assert data["outputs"][0]["output"] == "output" and data["outputs"][0]["max_abs"] == pytest.approx(1.0)
    assert [d["delegate"] for d in data["delegates"]] == ["forward.0", "forward.1"]
    assert data["delegates"][0] == {
        "method": "forward",
        "delegate": "forward.0",
        "backend_id": "test_add_one",
        "output": "output 0",
        "max_abs": pytest.approx(1.0),
        "max_rel": data["delegates"][0]["max_rel"],
        "passed": False,
        "mismatch": None,
        "dtype": "float32",
    }


def test_a_passing_result_says_so():
    result = aotstack.lower(program_of(TwoOutputs(), 2), [Adds()], check=True).check_result

    assert result.text().splitlines()[0] == "numerical check of outputs (atol 1e-04, rtol 1e-04): passed"
    assert result.failure_message() == "every output is within the tolerance (atol 1e-04, rtol 1e-04)"


def test_the_check_of_a_real_aotinductor_package(lowered_package):
    _, path = lowered_package("linear")
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})

    result = check_package(program, str(path), Check(), {})

    assert result.passed, result.failure_message()
    [difference] = result.outputs
    assert difference.output == "output" and 0.0 <= difference.max_abs < 1e-4


@needs_cuda
def test_a_delegate_on_cuda_is_checked_on_the_host():
    program = program_of(AddAdd(), 3)

    lowered = aotstack.lower(program, [Adds(device="cuda:0")], check="partition")
    assert lowered.check_result.passed and len(lowered.check_result.delegates) == 2

    with pytest.raises(CheckError, match=r"delegate forward\.0 \(test_add_one\) produced the wrong answer"):
        aotstack.lower(program, [Adds(add=AddOneBackend.backend_id, device="cuda:0")], check="partition")
    with pytest.raises(CheckError, match=r"output differs from eager"):
        aotstack.lower(
            program, [Adds(AddOneBackend.backend_id, device="cuda:0")], skip_d2h_for_method_outputs=True, check=True
        )
    lowered = aotstack.lower(program, [Adds(device="cuda:0")], skip_h2d_for_method_inputs=True, check=True)
    assert lowered.check_result.passed


def test_inputs_go_where_the_package_and_the_eager_ops_take_them():
    """No GPU needed: ``meta`` stands in for a delegate's device, the moves are the same."""
    x, n = torch.ones(2), 3
    records = [InputRecord("x", "tensor", "float32", [2], device="meta"), InputRecord("n", "int", value=3)]

    (args, kwargs) = placed_inputs(((x, n), {}), records)

    assert args[0].device.type == "meta" and args[1] == 3 and kwargs == {}
    moved = on_devices([x, torch.zeros(1), x], [torch.device("meta"), None, torch.device("cpu")])
    assert [value.device.type for value in moved] == ["meta", "cpu", "cpu"] and moved[2] is x
    kept = placed_inputs(((x,), {}), [InputRecord("x", "tensor", "float32", [2], device="cpu")])[0][0]
    assert kept is not x and torch.equal(kept, x), "a copy: the eager run may update its inputs in place"


# The comparison itself, element by element.


def difference(lowered, eager, check: Check | None = None):
    return tensor_difference(torch.tensor(lowered), torch.tensor(eager), check or Check())


def test_nan_in_the_same_place_and_equal_infinities_count_as_equal():
    assert difference([math.nan, math.inf, -math.inf, 1.0], [math.nan, math.inf, -math.inf, 1.0]) == (0.0, 0.0, True)


@pytest.mark.parametrize(
    ("lowered", "eager"),
    [([math.nan, 1.0], [1.0, 1.0]), ([1.0, 1.0], [math.nan, 1.0]), ([1.0], [math.inf]), ([math.inf], [-math.inf])],
)
def test_nan_or_inf_on_one_side_only_fails(lowered, eager):
    max_abs, max_rel, passed = difference(lowered, eager)
    assert (max_abs, max_rel, passed) == (math.inf, math.inf, False)


def test_relative_difference_ignores_where_both_are_zero_and_is_infinite_against_zero():
    assert difference([0.0, 1.5], [0.0, 1.0]) == (0.5, 0.5, False)
    assert difference([0.0, 1e-5], [0.0, 0.0])[1:] == (math.inf, True)


def test_the_bound_grows_with_the_eager_value():
    assert difference([1000.05], [1000.0])[2] is True
    assert difference([1.05], [1.0])[2] is False


def test_integers_and_bools_compare_exactly():
    loose = Check(atol=10, rtol=10)
    assert difference([1, 2], [1, 3], loose) == (1.0, 1 / 3, False)
    assert difference([True], [False], loose)[2] is False
    assert difference([7], [7], loose) == (0.0, 0.0, True)


def test_half_precision_is_compared_in_64_bits():
    lowered = torch.tensor([1.0, 2.0], dtype=torch.float16)
    eager = torch.tensor([1.0, 2.001953125], dtype=torch.float16)
    assert tensor_difference(lowered, eager, Check(atol=1e-3, rtol=0))[0] == pytest.approx(0.001953125)


def test_shape_dtype_and_structure_mismatches_fail_with_a_reason():
    found = compared_outputs(
        "forward",
        {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.float16), "c": 3, "d": torch.zeros(1), "extra": 1},
        {"a": torch.zeros(3, 2), "b": torch.zeros(2), "c": 4, "d": 1.0, "e": torch.zeros(1)},
        Check(),
    )

    reasons = {d.output: (d.passed, d.mismatch) for d in found}
    assert reasons == {
        "['a']": (False, "shape (2, 3), eager (3, 2)"),
        "['b']": (False, "dtype torch.float16, eager torch.float32"),
        "['c']": (False, "3, eager 4"),
        "['d']": (False, "a Tensor, eager a float"),
        "['e']": (False, "missing from the lowered outputs"),
        "['extra']": (False, "not among eager's outputs"),
    }
    message = CheckResult(Check(), found).failure_message()
    assert "method 'forward': output ['a'] differs from eager: shape (2, 3), eager (3, 2)" in message


def test_equal_plain_values_pass():
    found = compared_outputs("forward", (None, 3), (None, 3), Check())
    assert [(d.output, d.passed, d.max_abs) for d in found][-1] == ("[1]", True, 0.0)
    assert all(d.passed for d in found)
