"""CUDA end to end: convolutions, linear layers and attention on the GPU, ``median`` as plain ATen.

Every test here needs a CUDA GPU and skips without one.
"""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack import CompileSpec
from tests import models
from tests.conftest import run_in_fresh_process

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Autotuning would benchmark every GEMM and convolution while compiling: minutes, not seconds.
QUICK = CompileSpec("autotune", b"OFF")
# What AOTInductor calls for this model on CUDA with autotuning off, less median's kernel. Each device
# lowers scaled_dot_product_attention to its own fused kernel, which Inductor calls as a fallback
# kernel (on the CPU aten._scaled_dot_product_flash_attention_for_cpu). Which one the GPU gets is
# torch's choice for the GPU, dtype and shapes: float32 on an H100 the memory-efficient kernel, fp16
# and bf16 flash or cuDNN; all three are listed.
CUDA_ATTENTION_KERNELS = [
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
]
KERNELS_BUT_MEDIAN = CompileSpec(
    "fallback_kernels",
    ",".join(["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution", *CUDA_ATTENTION_KERNELS]).encode(),
)


def assert_close_to_eager(outputs: list[torch.Tensor]) -> None:
    model = models.build("attention")
    with torch.no_grad():
        expected = model(*models.example_inputs("attention"))
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected, strict=True):
        assert got.device.type == "cpu" and got.shape == want.shape and got.dtype == want.dtype
        # cuDNN and cuBLAS may use TF32, and reductions run in another order than on the CPU.
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@needs_cuda
@pytest.mark.parametrize(
    ("label", "make_partitioner"),
    [
        ("default device, median excluded", lambda: aotstack.CudaPartitioner(["aten.median"], [QUICK])),
        (
            "cuda:0 given, median's kernel missing",
            lambda: aotstack.CudaPartitioner(
                compile_specs=[CompileSpec("target_device", b"cuda:0"), QUICK, KERNELS_BUT_MEDIAN]
            ),
        ),
    ],
)
def test_attention_model_runs_on_the_gpu_after_save_and_load(lowered_with, label, make_partitioner):
    lowered, path = lowered_with("attention", f"cuda {label}", lambda: [make_partitioner()])

    (delegate,) = lowered.delegates("forward")
    assert delegate.backend_id == "aoti_cuda" and delegate.target_device == "cuda:0"
    assert "aten.median.default" not in delegate.ops
    assert {"aten.conv2d.default", "aten.linear.default", "aten.scaled_dot_product_attention.default"} <= set(
        delegate.ops
    )
    assert_close_to_eager(run_in_fresh_process(path, "forward", "attention"))


@needs_cuda
def test_inputs_and_outputs_can_stay_on_the_gpu(tmp_path):
    program = aotstack.export(models.build("attention"), {"forward": models.example_inputs("attention")})
    lowered = aotstack.lower(
        program,
        [aotstack.CudaPartitioner(["aten.median"], [QUICK])],
        skip_h2d_for_method_inputs=True,
        skip_d2h_for_method_outputs=True,
    )
    lowered.save(tmp_path / "attention.pt2")

    image = models.example_inputs("attention")[0].to("cuda:0")
    result, _ = aotstack.load(tmp_path / "attention.pt2").forward(image)

    assert result.device == torch.device("cuda:0")
    with torch.no_grad():
        expected, _ = models.build("attention")(image.cpu())
    torch.testing.assert_close(result.cpu(), expected, rtol=2e-3, atol=2e-3)


@needs_cuda
def test_aotinductor_on_cuda_says_which_ops_its_code_would_hand_to_atens_own_kernel(monkeypatch, tmp_path):
    # Auto asks this of the closing engine before compiling its parts; on the GPU the answer is the GPU's code.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("attention"), {"forward": models.example_inputs("attention")})
    nodes = {str(node.target): node for node in program.methods["forward"].graph.nodes if node.op == "call_function"}
    partitioner = aotstack.CudaPartitioner(compile_specs=[QUICK])
    attention = nodes["aten.scaled_dot_product_attention.default"]

    kernels = partitioner.aoti_backend.probed_fallback_kernels(attention, partitioner.compile_specs)
    assert {kernel.removesuffix(".default") for kernel in kernels} & set(CUDA_ATTENTION_KERNELS)
    for op in ("aten.linear.default", "aten.scaled_dot_product_attention.default"):
        assert partitioner.compiled_calls_aten_kernel(nodes[op]), op
    for op in ("aten.relu.default", "aten.add.Tensor", "aten.transpose.int"):
        assert not partitioner.compiled_calls_aten_kernel(nodes[op]), op


# State on the GPU, and CUDA graphs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_step_on_gpu(tmp_path_factory):
    """test_cuda_graphs.py's toy decode step, its cache owned by one CUDA delegate; inputs and outputs on the GPU."""
    from tests.test_cuda_graphs import CacheStep, step_inputs

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    program = aotstack.export(CacheStep(), {"forward": step_inputs(0)})
    lowered = aotstack.lower(
        program, [aotstack.CudaPartitioner(compile_specs=[QUICK])],
        skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True,
    )
    path = tmp_path_factory.mktemp("cuda-state") / "cache_step.pt2"
    lowered.save(path)
    return lowered, path


def gpu_step_inputs(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.test_cuda_graphs import step_inputs

    return tuple(tensor.to("cuda:0") for tensor in step_inputs(index))


def assert_steps_match_eager(loaded: aotstack.LoadedProgram, count: int) -> None:
    from tests.test_cuda_graphs import eager_steps

    for index, want in enumerate(eager_steps(count)):
        got = loaded.forward(*gpu_step_inputs(index))
        for tensor, expected in zip(got, want, strict=True):
            assert tensor.device == torch.device("cuda:0")
            torch.testing.assert_close(tensor.cpu(), expected, rtol=2e-3, atol=2e-3)


def host_device_copies(call) -> list[str]:
    """The host<->device copies the GPU ran during ``call()``, by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        call()
        torch.cuda.synchronize()
    return [event.name for event in profiled.events() if "HtoD" in event.name or "DtoH" in event.name]


@needs_cuda
def test_a_cuda_delegate_keeps_its_cache_on_the_gpu_and_a_step_copies_nothing_across(cache_step_on_gpu):
    lowered, path = cache_step_on_gpu
    (delegate,) = lowered.delegates("forward")
    assert delegate.updated_buffers == ["cache"]
    loaded = aotstack.load(path)
    # The cache is the delegate's; the one-element counter (which AOTInductor would fold into its code) is the
    # plan's, held on the GPU too.
    assert loaded.state_devices == {"cache": "cuda:0", "calls": "cuda:0"}
    state = loaded._state.mutable["cache"]
    address = state.current.data_ptr()

    assert_steps_match_eager(loaded, 5)
    inputs = gpu_step_inputs(5)
    assert host_device_copies(lambda: loaded.forward(*inputs)) == []

    loaded.reset()
    assert state.current.data_ptr() == address
    assert_steps_match_eager(loaded, 5)


@needs_cuda
def test_a_decode_step_replayed_as_a_cuda_graph_matches_eager_and_survives_reset(cache_step_on_gpu):
    from aotstack.runtime.graphs import WARM_UP_CALLS

    _, path = cache_step_on_gpu
    loaded = aotstack.load(path, cuda_graphs=["forward"])

    assert_steps_match_eager(loaded, WARM_UP_CALLS + 4)
    assert loaded.cuda_graphs == {"forward": "captured on cuda:0"}
    loaded.reset()
    assert_steps_match_eager(loaded, WARM_UP_CALLS + 4)
    inputs = gpu_step_inputs(0)
    assert host_device_copies(lambda: loaded.forward(*inputs)) == []


@needs_cuda
def test_a_transformers_decoder_on_the_gpu_with_graphs_generates_eager_tokens(tmp_path):
    """Host token ids in, host logits out: the copies run outside the graph, the cache stays on the GPU."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from tests.test_language_models import CACHE, PROMPT, STEPS, small_llama, token_by_token

    model = small_llama()
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.CudaPartitioner(compile_specs=[QUICK])])
    lowered.save(tmp_path / "llama.pt2")
    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
    expected = token_by_token(lambda ids, pos: eager(input_ids=ids, cache_position=pos), PROMPT, STEPS)

    loaded = aotstack.load(tmp_path / "llama.pt2", cuda_graphs=True)
    tokens = token_by_token(lambda ids, pos: loaded.forward(input_ids=ids, cache_position=pos), PROMPT, STEPS)

    assert tokens == expected
    assert loaded.cuda_graphs == {"forward": "captured on cuda:0"}
    assert set(loaded.state_devices.values()) == {"cuda:0"}
