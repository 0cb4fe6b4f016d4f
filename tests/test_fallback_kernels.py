"""Ops a backend cannot take: an op that needs a fallback kernel the target lacks runs as plain ATen."""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack import CompileSpec
from aotstack.backends.aoti.kernels import kernel_op_name
from tests import models
from tests.conftest import assert_matches_eager, run_in_fresh_process

ONLY_ADDMM = [CompileSpec("fallback_kernels", b"aten.addmm")]


def tags_by_op(partitioner: aotstack.Partitioner, name: str) -> dict[str, str | None]:
    program = aotstack.export(models.build(name), {"forward": models.example_inputs(name)})
    tagged = partitioner.partition(program.methods["forward"]).tagged_exported_program
    return {
        str(node.target): node.meta.get("delegation_tag")
        for node in tagged.graph.nodes
        if isinstance(node.target, torch._ops.OpOverload)
    }


@pytest.mark.parametrize(
    ("kernel", "op"),
    [
        ("aoti_torch_cpu_addmm_out", "aten.addmm.out"),
        ("aoti_torch_cuda_convolution", "aten.convolution.default"),
        ("at::_ops::sort_stable::call", "aten.sort.stable"),
        (
            "aoti_torch_mps__scaled_dot_product_attention_math_for_mps",
            "aten._scaled_dot_product_attention_math_for_mps.default",
        ),
        ("aoti_torch_cpu_no_such_kernel", "aoti_torch_cpu_no_such_kernel"),
    ],
)
def test_inductor_kernel_calls_are_named_as_aten_ops(kernel, op):
    assert kernel_op_name(kernel) == op


def test_an_op_needing_a_missing_kernel_is_left_to_plain_aten():
    tags = tags_by_op(aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM), "median")

    assert tags["aten.median.default"] is None
    assert tags["aten.linear.default"] == tags["aten.relu.default"] == tags["aten.mul.Tensor"] == "aoti_cpu_0"


def test_by_default_the_cpu_backend_takes_every_kernel():
    tags = tags_by_op(aotstack.AotiCpuPartitioner(), "median")

    assert set(tags.values()) == {"aoti_cpu_0"}


def test_strict_names_the_method_and_every_missing_kernel():
    program = aotstack.export(models.build("median"), {"forward": models.example_inputs("median")})
    partitioner = aotstack.AotiCpuPartitioner(compile_specs=[CompileSpec("fallback_kernels", b"")], strict=True)

    with pytest.raises(aotstack.MissingFallbackKernelsError) as raised:
        aotstack.lower(program, [partitioner])

    assert raised.value.method == "forward"
    assert raised.value.kernels == {"aten.addmm.out": ["linear"], "aten.median.default": ["median"]}
    assert "method 'forward'" in str(raised.value) and "aten.median.default (for median)" in str(raised.value)


def test_strict_passes_when_every_kernel_is_there():
    partitioner = aotstack.AotiCpuPartitioner(
        compile_specs=[CompileSpec("fallback_kernels", b"aten.addmm.out,aten.median")], strict=True
    )

    assert set(tags_by_op(partitioner, "median").values()) == {"aoti_cpu_0"}


def test_non_strict_lowers_around_the_op_and_matches_eager(lowered_with):
    lowered, path = lowered_with(
        "median", "aoti_cpu only addmm", lambda: [aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM)]
    )

    (delegate,) = lowered.delegates("forward")
    assert "aten.median.default" not in delegate.ops
    assert_matches_eager(run_in_fresh_process(path, "forward", "median"), "median")


def test_the_compile_refuses_a_kernel_the_partitioner_let_through():
    class Unchecked(aotstack.AotiCpuPartitioner):
        def missing_kernels(self, node):
            return frozenset()

    median_of_sum = aotstack.export(MedianOfSum(), {"forward": models.example_inputs("add")})

    with pytest.raises(aotstack.MissingFallbackKernelsError, match="method 'forward'.*aten.median.default"):
        aotstack.lower(median_of_sum, [Unchecked(compile_specs=ONLY_ADDMM)])


class MedianOfSum(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.median(x + y)


def test_metal_claims_linear_conv_and_attention_but_not_median():
    """Probed on the host, as this machine has no Metal device."""
    tags = tags_by_op(aotstack.MetalPartitioner(), "attention")

    assert tags["aten.median.default"] is None
    for op in ("aten.linear.default", "aten.conv2d.default", "aten.conv1d.default",
               "aten.scaled_dot_product_attention.default"):
        assert tags[op] == "aoti_metal_0", op


def test_a_probe_is_asked_once_per_op_signature_and_its_answer_kept_on_disk(monkeypatch, tmp_path):
    from aotstack.backends.aoti import probe

    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    calls = []
    real = probe.generated_fallback_kernels
    monkeypatch.setattr(probe, "_PROBED", {})
    monkeypatch.setattr(probe, "generated_fallback_kernels", lambda *args: calls.append(1) or real(*args))
    partitioner = aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM)

    first = tags_by_op(partitioner, "median")
    probed = len(calls)
    tags_by_op(partitioner, "median")

    assert probed == 4  # linear, relu, mul, median
    assert len(calls) == probed
    # A new process reads the answers Inductor gave, and makes the same claims.
    monkeypatch.setattr(probe, "_PROBED", {})
    assert tags_by_op(aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM), "median") == first
    assert len(calls) == probed
    # An answer that cannot be read is asked again.
    for entry in (tmp_path / f".{probe.CACHE_KIND}").iterdir():
        entry.write_text("not a list")
    monkeypatch.setattr(probe, "_PROBED", {})
    assert tags_by_op(aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM), "median") == first
    assert len(calls) == 2 * probed
    # Other code (a checkout sharing the cache folder, an edited pass) does not read these answers.
    monkeypatch.setattr(probe, "_PROBED", {})
    other = aotstack.AotiCpuPartitioner(compile_specs=ONLY_ADDMM)
    monkeypatch.setattr(type(other.aoti_backend), "compile_revision", -1)
    assert tags_by_op(other, "median") == first
    assert len(calls) == 3 * probed


def test_aotinductor_says_which_ops_its_code_would_hand_to_atens_own_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("attention"), {"forward": models.example_inputs("attention")})
    nodes = {str(node.target): node for node in program.methods["forward"].graph.nodes if node.op == "call_function"}
    partitioner = aotstack.AotiCpuPartitioner()

    calls_kernel = {op: partitioner.compiled_calls_aten_kernel(node) for op, node in nodes.items()}

    # A matmul, a convolution and an attention run ATen's (oneDNN's) kernels compiled too; the rest is Inductor's code.
    for op in ("aten.linear.default", "aten.conv2d.default", "aten.scaled_dot_product_attention.default"):
        assert calls_kernel[op], op
    for op in ("aten.relu.default", "aten.add.Tensor", "aten.transpose.int"):
        assert not calls_kernel[op], op
    # An op Inductor cannot compile on its own needs ATen's kernel where a partitioner asks, but is not known to call
    # one where auto asks: all its time counts as what compiling could save. Both answers are kept on disk.
    from aotstack.backends.aoti import probe

    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "failing"))
    monkeypatch.setattr(probe, "_PROBED", {})
    monkeypatch.setattr(probe, "generated_fallback_kernels", lambda *args: 1 / 0)
    linear = nodes["aten.linear.default"]
    assert not partitioner.compiled_calls_aten_kernel(linear)
    monkeypatch.setattr(probe, "_PROBED", {})
    monkeypatch.setattr(probe, "generated_fallback_kernels", lambda *args: pytest.fail("asked Inductor again"))
    assert partitioner.aoti_backend.needed_fallback_kernels(linear, []) == {"aten.linear.default"}
    assert not partitioner.compiled_calls_aten_kernel(linear)
    # An engine that says nothing of its code counts every op as what compiling could save.
    class Silent(aotstack.Partitioner):
        def partition(self, exported_program):
            raise AssertionError("not asked")

    assert not any(Silent().compiled_calls_aten_kernel(node) for node in nodes.values())
