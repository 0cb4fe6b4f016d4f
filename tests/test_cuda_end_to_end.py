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
