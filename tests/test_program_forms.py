"""What ``Program`` makes of a method before any engine sees it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import aotstack
from aotstack.backends.openvino.partitioner import OpenVinoPartitioner

POOLS = ("aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.max_pool2d.default",
         "aten.max_pool2d_with_indices.default")


class Overhanging(torch.nn.Module):
    """Pooling windows wider than their padded input along an axis, as ``ceil_mode`` allows (EfficientNet's head)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.avg_pool2d(x, 8, ceil_mode=True),
            F.avg_pool2d(x, (2, 9), stride=(2, 9), padding=1, ceil_mode=True, count_include_pad=False),
            # No stride given: the rows keep the kernel's, 3, while the columns' window is narrowed.
            F.avg_pool2d(x, (3, 10), padding=1, ceil_mode=True, divisor_override=7),
            *F.max_pool2d(x, (2, 7), stride=(2, 8), ceil_mode=True, return_indices=True),
            F.avg_pool1d(x[0], 9, ceil_mode=True),
            # A dilated window is left as it is.
            F.max_pool2d(x, (1, 3), stride=(1, 4), dilation=(1, 3), ceil_mode=True),
        )


def pooling_windows(program: torch.export.ExportedProgram) -> list[tuple[list[int], list[int]]]:
    """(kernel, stride) of each pooling node, in graph order."""
    return [(list(node.args[1]), list(node.args[2])) for node in program.graph.nodes if str(node.target) in POOLS]


def test_a_pooling_window_overhanging_its_padded_input_is_narrowed_to_it_with_the_same_numbers(tmp_path):
    x = torch.randn(1, 3, 5, 6)
    with torch.no_grad():
        exported = torch.export.export(Overhanging(), (x,))
    as_exported = pooling_windows(exported)

    method = aotstack.Program({"forward": exported}).methods["forward"]

    assert pooling_windows(method) == [
        ([5, 6], [5, 6]),
        ([2, 8], [2, 8]),
        ([3, 8], [3, 8]),
        ([2, 6], [2, 6]),
        ([6], [6]),
        ([1, 3], [1, 4]),
    ]
    assert pooling_windows(exported) == as_exported, "the user's program is not changed"
    want = Overhanging()(x)
    for got, expected in zip(method.module()(x), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # OpenVINO refuses a window wider than its input: only the dilated one is left.
    refused = OpenVinoPartitioner().partition(method).refusals
    nodes = {node.name: str(node.target) for node in method.graph.nodes}
    assert [nodes[name] for name in refused] == ["aten.max_pool2d.default"]

    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.AotiCpuPartitioner()])
    lowered.save(tmp_path / "pools.pt2")
    for got, expected in zip(aotstack.load(tmp_path / "pools.pt2").forward(x), want, strict=True):
        torch.testing.assert_close(got, expected)
