"""The AOTInductor CUDA backend: partitions compiled to Triton kernels in a shared library.

Compile specs beyond the shared ones (see ``AotiBackend``):

- ``autotune``: ``ON`` (the default) or ``OFF``. ON benchmarks GEMM and convolution choices
  while compiling: slower to build, faster to run.

``emulate_precision_casts`` (every AOTI backend reads it) matters most here: ON makes bf16 match
eager exactly and costs GPU time (1.26x plain AOTInductor's on a bf16 BERT on an H100).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ...format.specs import CompileSpec, SpecKey, switch_spec
from .backend import AotiBackend
from .partitioner import AotiPartitioner

aten = torch.ops.aten


class CudaBackend(AotiBackend):
    backend_id = "aoti_cuda"
    device_name = "cuda"

    def decomposition_table(self) -> dict[Any, Callable[..., Any]]:
        # Inductor's Triton convolution templates are two-dimensional.
        return {aten.conv1d.default: conv1d_as_conv2d}

    def inductor_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        options: dict[str, Any] = {
            # The cubins go inside the library, which is the one file a delegate carries.
            "aot_inductor.embed_kernel_binary": True,
            "max_autotune": switch_spec(compile_specs, SpecKey.AUTOTUNE, default=True),
        }
        if options["max_autotune"]:
            # ATen's GEMMs are fallback kernels: only a runtime with all of them may pick one.
            choices = "ATEN,TRITON" if self.fallback_kernels(compile_specs) is None else "TRITON"
            options["max_autotune_gemm_backends"] = choices
            options["max_autotune_conv_backends"] = choices
        return options


def conv1d_as_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Sequence[int] = (1,),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    groups: int = 1,
) -> torch.Tensor:
    """``conv1d`` as a ``conv2d`` over a height of one, for batched and unbatched inputs alike."""
    output = aten.conv2d.default(
        input.unsqueeze(-2),
        weight.unsqueeze(-2),
        bias,
        [1, stride[0]],
        [0, padding[0]],
        [1, dilation[0]],
        groups,
    )
    return output.squeeze(-2)


class CudaPartitioner(AotiPartitioner):
    """Claims what AOTInductor compiles for a CUDA GPU; ``target_device`` defaults to ``cuda:0``.

    Example::

        partitioner = CudaPartitioner(compile_specs=[CompileSpec(SpecKey.TARGET_DEVICE, b"cuda:1")])
    """

    backend: ClassVar[type[AotiBackend]] = CudaBackend
