"""The AOTInductor Metal backend, for Apple GPUs (``mps``). Not yet verified on Apple hardware.

Its fallback-kernel list is what ExecuTorch's Metal runtime implements; ``linear`` is
rewritten so that it needs ``mm``, which that runtime has, rather than ``addmm``, which it lacks.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.fx import GraphModule
from torch.nn.attention import SDPBackend

from ...compile.graph_edits import inserted_call, replace_node
from .backend import AotiBackend
from .partitioner import AotiPartitioner
from .passes import GraphPass

aten = torch.ops.aten


class MetalBackend(AotiBackend):
    backend_id = "aoti_metal"
    device_name = "mps"
    default_fallback_kernels = frozenset(
        {
            "aten.mm.out",
            "aten.bmm.out",
            "aten.convolution.default",
            "aten._scaled_dot_product_attention_math_for_mps.default",
        }
    )

    def custom_passes(self) -> list[GraphPass]:
        return [LinearAsMatmulPass()]

    def attention_kernels(self) -> list[SDPBackend]:
        # The math kernel is the attention ExecuTorch's Metal runtime implements.
        return [SDPBackend.MATH]


class LinearAsMatmulPass:
    """Rewrite ``linear`` as ``matmul`` plus a bias ``add``, never as ``addmm``.

    ``linear`` of a 2-D input with a bias becomes ``addmm``; a 3-D input takes the ``matmul``
    path, which AOTInductor turns into ``mm``. So a 2-D input gets a leading dimension of one
    for the product and loses it after.
    """

    def __call__(self, graph_module: GraphModule) -> bool:
        graph = graph_module.graph
        linears = [node for node in graph.nodes if node.op == "call_function" and node.target is aten.linear.default]
        for node in linears:
            input, weight, *rest = node.args
            bias = rest[0] if rest else node.kwargs.get("bias")
            flat = input.meta["val"].dim() == 2
            with graph.inserting_before(node):
                if flat:
                    input = inserted_call(graph, aten.unsqueeze.default, (input, 0))
                result = inserted_call(
                    graph, aten.matmul.default, (input, inserted_call(graph, aten.t.default, (weight,)))
                )
                if bias is not None:
                    result = inserted_call(graph, aten.add.Tensor, (result, bias))
                if flat:
                    result = inserted_call(graph, aten.squeeze.dims, (result, [0]))
            replace_node(graph, node, result)
        return bool(linears)


class MetalPartitioner(AotiPartitioner):
    """Claims what AOTInductor compiles for Metal and its runtime's fallback kernels can run.

    Example::

        lowered = aotstack.lower(program, [MetalPartitioner(), AotiCpuPartitioner()])
    """

    backend: ClassVar[type[AotiBackend]] = MetalBackend
