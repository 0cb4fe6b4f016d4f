"""The CPU, CUDA and Metal backends on the shared AOTInductor base: options, specs, partitioning.

Nothing here compiles or needs a GPU; the CUDA runs are in test_cuda_end_to_end.py.
"""

from __future__ import annotations

import re

import pytest
import torch

import aotstack
from aotstack import CompileSpec
from aotstack.format.specs import compile_spec_value
from tests import models

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


def autotune(value: bytes) -> list[CompileSpec]:
    return [CompileSpec("autotune", value)]


def emulate_precision_casts(value: bytes) -> list[CompileSpec]:
    return [CompileSpec("emulate_precision_casts", value)]


def test_cpu_compile_options_keep_weights_out_of_the_library():
    assert aotstack.AotiCpuBackend().compile_options([]) == {
        "emulate_precision_casts": False,
        "freezing": False,
        "aot_inductor.package_constants_in_so": False,
    }


def test_cuda_compile_options_with_autotuning_on_by_default():
    options = aotstack.CudaBackend().compile_options([])

    assert options == {
        "aot_inductor.embed_kernel_binary": True,
        "emulate_precision_casts": False,
        "max_autotune": True,
        "max_autotune_gemm_backends": "ATEN,TRITON",
        "max_autotune_conv_backends": "ATEN,TRITON",
        "freezing": False,
        "aot_inductor.package_constants_in_so": False,
    }


@pytest.mark.parametrize("value", [b"OFF", b"off", b" Off "])
def test_cuda_autotuning_switched_off(value):
    options = aotstack.CudaBackend().compile_options(autotune(value))

    assert options["max_autotune"] is False
    assert not any(key.startswith("max_autotune_") for key in options)


def test_cuda_autotuning_without_aten_kernels_tunes_among_triton_templates_only():
    specs = [*autotune(b"ON"), CompileSpec("fallback_kernels", b"aten.median")]

    options = aotstack.CudaBackend().compile_options(specs)

    assert options["max_autotune_gemm_backends"] == options["max_autotune_conv_backends"] == "TRITON"


def test_metal_compile_options_and_kernel_list():
    backend = aotstack.MetalBackend()

    assert backend.compile_options([]) == {
        "emulate_precision_casts": False,
        "freezing": False,
        "aot_inductor.package_constants_in_so": False,
    }
    assert backend.fallback_kernels([]) == {
        "aten.mm.out",
        "aten.bmm.out",
        "aten.convolution.default",
        "aten._scaled_dot_product_attention_math_for_mps.default",
    }
    assert aotstack.CudaBackend().fallback_kernels([]) is None
    assert aotstack.AotiCpuBackend().fallback_kernels([]) is None


@pytest.mark.parametrize("value", [b"yes", b"1", b"", b"ONN"])
def test_an_autotune_value_other_than_on_or_off_is_refused_naming_the_spec(value):
    with pytest.raises(aotstack.CompileSpecError, match=r"compile spec 'autotune' must be ON or OFF, got"):
        aotstack.CudaPartitioner(compile_specs=autotune(value))
    with pytest.raises(aotstack.CompileSpecError, match="autotune"):
        aotstack.CudaBackend().compile_options(autotune(value))


BACKENDS = [aotstack.AotiCpuBackend, aotstack.CudaBackend, aotstack.MetalBackend]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("specs", "emulated"),
    [([], False), (emulate_precision_casts(b"OFF"), False), (emulate_precision_casts(b" on "), True)],
)
def test_emulating_eager_precision_casts_is_a_compile_spec_off_by_default(backend, specs, emulated):
    options = backend().compile_options(specs)

    assert options["emulate_precision_casts"] is emulated


class InductorCalled(Exception):
    pass


@pytest.mark.parametrize(("value", "emulated"), [(None, False), (b"ON", True), (b"off", False)])
def test_the_precision_casts_spec_reaches_inductor(value, emulated, monkeypatch):
    """What a compile hands AOTInductor, caught before it compiles anything."""
    seen: list[dict] = []

    def recording(program, package_path, inductor_configs):
        seen.append(dict(inductor_configs))
        raise InductorCalled

    monkeypatch.setenv("AOTSTACK_CACHE_DIR", "off")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recording)
    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")}).methods["forward"]
    specs = [] if value is None else emulate_precision_casts(value)

    with pytest.raises(aotstack.LoweringError) as raised:
        aotstack.AotiCpuBackend().preprocess(program, specs)

    assert isinstance(raised.value.__cause__, InductorCalled)
    # Set either way, so TORCHINDUCTOR_EMULATE_PRECISION_CASTS cannot decide in the spec's place.
    assert [configs["emulate_precision_casts"] for configs in seen] == [emulated]


def test_the_precision_casts_spec_reaches_the_cuda_compile_steps():
    steps = aotstack.CudaBackend().compile_steps(emulate_precision_casts(b"ON"))

    assert steps.options["emulate_precision_casts"] is True
    assert aotstack.CudaBackend().compile_steps([]).options["emulate_precision_casts"] is False


@pytest.mark.parametrize("value", [b"yes", b"1", b"", b"ONN"])
@pytest.mark.parametrize("partitioner", [aotstack.AotiCpuPartitioner, aotstack.CudaPartitioner])
def test_an_emulate_precision_casts_value_other_than_on_or_off_is_refused_naming_it(partitioner, value):
    message = rf"compile spec 'emulate_precision_casts' must be ON or OFF, got {re.escape(repr(value))}"
    with pytest.raises(aotstack.CompileSpecError, match=message):
        partitioner(compile_specs=emulate_precision_casts(value))
    with pytest.raises(aotstack.CompileSpecError, match="emulate_precision_casts"):
        partitioner.backend().compile_options(emulate_precision_casts(value))


def test_an_unknown_fallback_kernel_is_refused_naming_the_spec():
    with pytest.raises(aotstack.CompileSpecError, match=r"'aten.not_an_op' in compile spec 'fallback_kernels'"):
        aotstack.AotiCpuPartitioner(compile_specs=[CompileSpec("fallback_kernels", b"aten.mm,aten.not_an_op")])


@pytest.mark.parametrize(
    ("partitioner", "device", "message"),
    [
        (aotstack.CudaPartitioner, b"cpu", "aoti_cuda compiles for cuda devices"),
        (aotstack.MetalPartitioner, b"cuda:0", "aoti_metal compiles for mps devices"),
        (aotstack.AotiCpuPartitioner, b"mps", "aoti_cpu compiles for cpu devices"),
        (aotstack.CudaPartitioner, b"gpu:0", "unknown device type 'gpu'"),
    ],
)
def test_a_target_device_of_another_kind_is_refused(partitioner, device, message):
    with pytest.raises(aotstack.CompileSpecError, match=message):
        partitioner(compile_specs=[CompileSpec("target_device", device)])


def test_compile_spec_errors_are_value_errors_and_lowering_errors():
    assert issubclass(aotstack.CompileSpecError, ValueError)
    assert issubclass(aotstack.CompileSpecError, aotstack.LoweringError)


@pytest.mark.parametrize(
    ("specs", "device"),
    [([], "cuda:0"), ([CompileSpec("target_device", b"CUDA:1")], "CUDA:1")],
)
def test_cuda_partitioner_claims_conv_linear_and_attention_for_its_device(specs, device):
    program = aotstack.export(models.build("attention"), {"forward": models.example_inputs("attention")})

    result = aotstack.CudaPartitioner(compile_specs=specs).partition(program.methods["forward"])

    (spec,) = result.partition_tags.values()
    assert spec.backend_id == "aoti_cuda"
    assert compile_spec_value(spec.compile_specs, "target_device") == device.encode()
    untagged = [
        node.name
        for node in result.tagged_exported_program.graph.nodes
        if node.op == "call_function" and "delegation_tag" not in node.meta
    ]
    assert untagged == []


def test_the_device_index_reaches_the_compile_steps():
    specs = [CompileSpec("target_device", b"cuda:1")]

    steps = aotstack.CudaBackend().compile_steps(specs)

    assert str(steps.device) == "cuda:1"
    assert [type(p).__name__ for p in steps.passes] == ["ReplaceViewCopyWithViewPass"]
    assert [type(p).__name__ for p in aotstack.MetalBackend().compile_steps([]).passes] == [
        "ReplaceViewCopyWithViewPass",
        "LinearAsMatmulPass",
    ]


@needs_no_cuda
def test_lowering_for_cuda_without_a_gpu_says_so():
    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")})

    with pytest.raises(aotstack.LoweringError, match="compiles for cuda:0, which this machine lacks"):
        aotstack.lower(program, [aotstack.CudaPartitioner()])


@pytest.mark.parametrize("backend", [aotstack.CudaBackend, aotstack.MetalBackend, aotstack.AotiCpuBackend])
def test_concrete_aoti_backends_are_final(backend):
    with pytest.raises(TypeError, match="is final"):
        type("Derived", (backend,), {"backend_id": "derived_" + backend.backend_id})


@needs_no_cuda
@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the error on a machine without MPS")
@pytest.mark.parametrize("device", ["cuda:0", "mps"])
def test_loading_a_gpu_delegate_where_there_is_no_gpu_names_the_device(device):
    from aotstack.backends.aoti.run import runner_factory
    from aotstack.format.devices import Device

    with pytest.raises(aotstack.DelegateInitError, match=f"runs on {Device.parse(device)}, which this machine lacks"):
        runner_factory(Device.parse(device), "a partition")


@pytest.mark.parametrize("value", [b"0", b"-2", b"two", b"", b"1.5"])
def test_a_threads_value_other_than_a_positive_integer_is_refused_naming_it(value):
    message = rf"compile spec 'threads' must be a positive integer, got {re.escape(repr(value))}"
    with pytest.raises(aotstack.CompileSpecError, match=message):
        aotstack.AotiCpuPartitioner(compile_specs=[CompileSpec("threads", value)])


def test_the_threads_spec_sets_the_thread_count_of_the_generated_code():
    assert aotstack.AotiCpuBackend().compile_options([CompileSpec("threads", b" 1 ")])["cpp.threads"] == 1
    assert "cpp.threads" not in aotstack.AotiCpuBackend().compile_options([])

