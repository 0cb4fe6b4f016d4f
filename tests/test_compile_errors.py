"""A partition whose compile fails: an error naming where by default, plain ATen with ``on_compile_error="fallback"``.

The backends here are real ones, registered by defining them, so the error comes out of ``preprocess`` as a
user's broken backend would raise it.
"""

from __future__ import annotations

import logging

import pytest
import torch

import aotstack
from aotstack.compile.lower import OPS_IN_MESSAGE
from aotstack.format.op_names import op_name
from tests import models
from tests.conftest import assert_matches_eager


class FailingBackend(aotstack.Backend):
    """Every compile fails, as a backend hitting an op it cannot build would."""

    backend_id = "test_failing"

    def preprocess(self, exported_program, compile_specs):
        raise RuntimeError("boom: this backend cannot compile anything")


class VerboseFailingBackend(aotstack.Backend):
    """Fails as a compiler does that prints its whole graph and traceback into its message."""

    backend_id = "test_verbose_failing"

    def preprocess(self, exported_program, compile_specs):
        raise RuntimeError("boom: guard failed\n" + "  File line, in frame\n" * 2000)


class AddBackend(aotstack.Backend):
    """Compiles a two-tensor ``aten.add.Tensor`` and runs it with ``torch.add``."""

    backend_id = "test_working_add"

    def preprocess(self, exported_program, compile_specs):
        return aotstack.PreprocessResult(processed_bytes=b"add")

    def init(self, processed_bytes, named_data, compile_specs):
        assert processed_bytes == b"add"
        return torch.add

    def execute(self, handle, inputs):
        return [handle(*inputs)]


class SpecErrorBackend(aotstack.Backend):
    backend_id = "test_spec_error"

    def preprocess(self, exported_program, compile_specs):
        raise aotstack.CompileSpecError("compile spec 'level' must be 1 or 2, got b'7'")


class MissingKernelBackend(aotstack.Backend):
    backend_id = "test_missing_kernel"

    def preprocess(self, exported_program, compile_specs):
        raise aotstack.MissingFallbackKernelsError(self.backend_id, {"aten.median.default": []})


def is_two_tensor_add(node: torch.fx.Node) -> bool:
    return node.target == torch.ops.aten.add.Tensor and len(node.all_input_nodes) == 2


class OpPartitioner(aotstack.Partitioner):
    """One partition per relu and per two-tensor add, each kind for the backend named for it (or left alone)."""

    def __init__(self, relu: str | None = None, add: str | None = None) -> None:
        self.relu, self.add = relu, add

    def partition(self, exported_program):
        tags = {}
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            if node.target == torch.ops.aten.relu.default and self.relu:
                kind, backend_id = "relu", self.relu
            elif is_two_tensor_add(node) and self.add:
                kind, backend_id = "add", self.add
            else:
                continue
            tag = f"{kind}_{sum(t.startswith(kind) for t in tags)}"
            node.meta["delegation_tag"] = tag
            tags[tag] = aotstack.DelegationSpec(backend_id, [])
        return aotstack.PartitionResult(exported_program, tags)


class ClaimAllPartitioner(aotstack.Partitioner):
    """Every compute node in one partition, for ``backend_id``."""

    def __init__(self, backend_id: str) -> None:
        self.backend_id = backend_id

    def partition(self, exported_program):
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            node.meta["delegation_tag"] = "all"
        return aotstack.PartitionResult(exported_program, {"all": aotstack.DelegationSpec(self.backend_id, [])})


class AddReluModel(torch.nn.Module):
    """``relu(relu(x + y) * y) + x``: adds for a working backend, relus for a failing one."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(x + y) * y) + x


class ManyOpsModel(torch.nn.Module):
    """Ten distinct ops: more than an error message lists."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) + torch.cos(x)
        y = torch.exp(-y) * torch.tanh(y)
        return torch.sigmoid(y).abs().sqrt().relu() - x.neg()


def add_relu_program() -> tuple[aotstack.Program, tuple[torch.Tensor, torch.Tensor]]:
    inputs = (torch.randn(4, 5), torch.randn(4, 5))
    return aotstack.export(AddReluModel(), {"forward": inputs}), inputs


def compute_targets(program: torch.export.ExportedProgram) -> list:
    return [node.target for node in program.graph.nodes if node.op == "call_function"]


def test_a_failed_compile_raises_naming_method_partition_backend_and_ops():
    program, _ = add_relu_program()

    with pytest.raises(aotstack.LoweringError) as raised:
        aotstack.lower(program, [OpPartitioner(relu=FailingBackend.backend_id)])

    message = str(raised.value)
    assert "method 'forward', partition 'relu_0' (test_failing, delegate forward.0) failed to compile" in message
    assert "(ops: aten.relu.default)" in message
    assert "RuntimeError: boom: this backend cannot compile anything" in message
    assert "on_compile_error='fallback') (--on-compile-error fallback on the command line)" in message
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_a_long_list_of_ops_is_cut_short():
    program = aotstack.export(ManyOpsModel(), {"forward": (torch.randn(3, 4),)})

    with pytest.raises(aotstack.LoweringError) as raised:
        aotstack.lower(program, [ClaimAllPartitioner(FailingBackend.backend_id)])

    ops = {op_name(target) for target in compute_targets(program.methods["forward"])}
    assert len(ops) > OPS_IN_MESSAGE
    message = str(raised.value)
    assert "partition 'all'" in message and "aten.abs.default" in message
    assert f"and {len(ops) - OPS_IN_MESSAGE} more)" in message


def test_a_compile_spec_error_stays_one_and_names_the_method():
    program, _ = add_relu_program()

    with pytest.raises(aotstack.CompileSpecError) as raised:
        aotstack.lower(program, [OpPartitioner(relu=SpecErrorBackend.backend_id)])

    assert isinstance(raised.value, ValueError)
    assert "method 'forward', partition 'relu_0' (test_spec_error" in str(raised.value)
    assert "compile spec 'level' must be 1 or 2" in str(raised.value)


def test_missing_fallback_kernels_keep_their_type_and_gain_the_method():
    program, _ = add_relu_program()

    with pytest.raises(aotstack.MissingFallbackKernelsError) as raised:
        aotstack.lower(program, [OpPartitioner(relu=MissingKernelBackend.backend_id)])

    assert raised.value.method == "forward"
    assert raised.value.kernels == {"aten.median.default": []}
    assert "method 'forward'" in str(raised.value)


def test_fallback_leaves_failed_partitions_to_plain_aten_and_says_so(tmp_path, caplog):
    program, inputs = add_relu_program()
    partitioner = OpPartitioner(relu=FailingBackend.backend_id, add=AddBackend.backend_id)

    with caplog.at_level(logging.WARNING, logger="aotstack"):
        lowered = aotstack.lower(program, [partitioner], on_compile_error="fallback")

    failures = lowered.compile_failures["forward"]
    assert [f.partition for f in failures] == ["relu_0", "relu_1"]
    assert all(f.method == "forward" and f.backend_id == "test_failing" for f in failures)
    assert all(f.ops == ("aten.relu.default",) for f in failures)
    assert all(f.error == "RuntimeError: boom: this backend cannot compile anything" for f in failures)
    with pytest.raises(AttributeError):
        failures[0].partition = "changed"  # frozen: a record, not a handle
    # The partitions after a failed one are still compiled, with ids that skip none.
    assert [(d.delegate_id, d.backend_id, d.ops) for d in lowered.delegates("forward")] == [
        ("forward.0", "test_working_add", ["aten.add.Tensor"]),
        ("forward.1", "test_working_add", ["aten.add.Tensor"]),
    ]
    assert compute_targets(lowered.methods["forward"]).count(torch.ops.aten.relu.default) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "test_failing failed to compile partition 'relu_0' (ops: aten.relu.default)" in warnings[0]
    assert "RuntimeError: boom" in warnings[0]

    path = tmp_path / "fallback.pt2"
    lowered.save(path)
    torch.testing.assert_close(aotstack.load(path).forward(*inputs), AddReluModel()(*inputs))


def test_a_file_whose_engine_failed_at_length_loads_and_reports_the_failures_start(tmp_path):
    from aotstack.format.placement import MAX_TEXT
    from aotstack.report.model import file_report

    program, inputs = add_relu_program()
    lowered = aotstack.lower(program, [OpPartitioner(relu=VerboseFailingBackend.backend_id, add=AddBackend.backend_id)],
                             on_compile_error="fallback")
    path = tmp_path / "verbose.pt2"
    lowered.save(path)

    torch.testing.assert_close(aotstack.load(path).forward(*inputs), AddReluModel()(*inputs))
    details = sorted({reason.detail for group in file_report(path).method("forward").unclaimed
                      for reason in group.reasons if reason.kind == "compile_failed"})
    for part, detail in zip(("relu_0", "relu_1"), details, strict=True):
        assert detail.startswith(f"its part {part} failed to compile: boom: guard failed")
        assert len(detail) == MAX_TEXT and detail.endswith("characters)")


def test_a_clean_lowering_records_no_failures():
    program, _ = add_relu_program()

    lowered = aotstack.lower(program, [OpPartitioner(add=AddBackend.backend_id)], on_compile_error="fallback")

    assert lowered.compile_failures == {"forward": []}


def test_fallback_lets_a_later_partitioner_claim_the_nodes(tmp_path):
    """The linear layer AOTInductor compiles here is the one other tests compile, so the compile cache has it."""
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})

    lowered = aotstack.lower(
        program,
        [ClaimAllPartitioner(FailingBackend.backend_id), aotstack.AotiCpuPartitioner()],
        on_compile_error="fallback",
    )

    [failure] = lowered.compile_failures["forward"]
    assert (failure.partition, failure.backend_id, failure.ops) == ("all", "test_failing", ("aten.linear.default",))
    [delegate] = lowered.delegates("forward")
    assert (delegate.delegate_id, delegate.backend_id, delegate.ops) == ("forward.0", "aoti_cpu", list(failure.ops))
    path = tmp_path / "linear.pt2"
    lowered.save(path)
    loaded = aotstack.load(path)
    assert_matches_eager([loaded.forward(*models.example_inputs("linear"))], "linear")


@pytest.mark.parametrize("value", ["ignore", "RAISE", "", None, True])
def test_an_unknown_on_compile_error_is_refused_before_partitioning(value):
    program, _ = add_relu_program()
    partitioned = []

    class Recording(aotstack.Partitioner):
        def partition(self, exported_program):
            partitioned.append(exported_program)
            return aotstack.PartitionResult(exported_program, {})

    with pytest.raises(ValueError, match=r"on_compile_error must be one of 'raise', 'fallback', got"):
        aotstack.lower(program, [Recording()], on_compile_error=value)
    assert partitioned == []


@pytest.mark.parametrize("value", ["forward", 1, None, [1]])
def test_a_skip_option_that_is_not_a_bool_or_method_names_is_refused(value):
    program, _ = add_relu_program()

    with pytest.raises(TypeError, match="skip_h2d_for_method_inputs must be a bool or a collection of method names"):
        aotstack.lower(program, [], skip_h2d_for_method_inputs=value)


def test_compile_command_takes_on_compile_error():
    from aotstack.cli import argument_parser

    parser = argument_parser()
    base = ["compile", "tests.models:build", "-o", "out.pt2"]
    assert parser.parse_args(base).on_compile_error == "raise"
    assert parser.parse_args([*base, "--on-compile-error", "fallback"]).on_compile_error == "fallback"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--on-compile-error", "ignore"])
