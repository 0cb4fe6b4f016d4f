"""What ``Program`` makes of a method before any engine sees it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aotstack
from aotstack.backends.openvino.partitioner import OpenVinoPartitioner
from tests import models

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


def repeated_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Each key/value head once per query head of its group, as transformers' ``repeat_kv`` repeats them."""
    batch, heads, length, width = x.shape
    return x[:, :, None].expand(batch, heads, group, length, width).reshape(batch, heads * group, length, width)


class GroupedQueries(torch.nn.Module):
    """Attention over key/value heads repeated per query head: four that can run on the heads themselves, two not."""

    def forward(self, query: torch.Tensor, prompt: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                shared: torch.Tensor, per_head: torch.Tensor) -> tuple[torch.Tensor, ...]:
        keys, values = repeated_heads(key, 3), repeated_heads(value, 3)
        return (
            F.scaled_dot_product_attention(query, keys, values, attn_mask=shared),
            F.scaled_dot_product_attention(query, keys, values, attn_mask=per_head, scale=0.3),
            F.scaled_dot_product_attention(query, keys, values),
            F.scaled_dot_product_attention(query, key, value, enable_gqa=True),
            # Two query tokens, and a causal flag: left as they are.
            F.scaled_dot_product_attention(prompt, keys, values),
            F.scaled_dot_product_attention(query, keys, values, is_causal=True),
        )


def attention_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [node for node in program.graph.nodes if node.target == torch.ops.aten.scaled_dot_product_attention.default]


def reads_the_heads(program: torch.export.ExportedProgram) -> list[bool]:
    """Per attention node, in graph order: whether it reads the inputs ``key`` and ``value`` themselves."""
    return [node.args[1].name == "key" and node.args[2].name == "value" for node in attention_nodes(program)]


def test_a_one_token_attention_over_repeated_key_value_heads_reads_the_heads_themselves(tmp_path):
    arguments = (torch.randn(1, 6, 1, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                 torch.tensor([[[[True, True, False, True, False]]]]), torch.randn(1, 6, 1, 5))
    with torch.no_grad():
        exported = torch.export.export(GroupedQueries(), arguments)

    method = aotstack.Program({"forward": exported}).methods["forward"]

    assert reads_the_heads(method) == [True, True, True, True, False, False]
    assert [node.args[0].meta["val"].shape for node in attention_nodes(method)[:4]] == [torch.Size([1, 2, 3, 8])] * 4
    assert not any(node.kwargs.get("enable_gqa") for node in attention_nodes(method))
    assert reads_the_heads(exported) == [False, False, False, True, False, False], "the user's program is unchanged"
    want = GroupedQueries()(*arguments)
    for got, expected in zip(method.module()(*arguments), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Decomposed to core ATen, as ExecuTorch's lowering takes it: the attention's kernel lays its result out
    # query by query.
    for got, expected in zip(method.run_decompositions().module()(*arguments), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.AotiCpuPartitioner()])
    lowered.save(tmp_path / "grouped.pt2")
    for got, expected in zip(aotstack.load(tmp_path / "grouped.pt2").forward(*arguments), want, strict=True):
        torch.testing.assert_close(got, expected)


def test_torchaos_unsigned_int8_products_of_a_vnni_cpu_become_the_signed_products_they_equal(monkeypatch):
    """torchao exports ``Int8DynamicActivationInt8WeightConfig``'s product shifted to unsigned on a CPU with VNNI
    and without AMX; made so here on any CPU, its program reads as every other CPU's, with the same numbers."""
    from torchao.kernel import intmm
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.utils import torch_version_at_least

    if not torch_version_at_least("2.12.0.dev"):
        pytest.skip("torchao takes its unsigned form with torch 2.12 or newer only (ATen's _int_mm of uint8)")

    from aotstack.compile.int8_tensor import int8_linears

    monkeypatch.setattr(intmm, "_cpu_is_vnni_supported", lambda: True)
    monkeypatch.setattr(intmm, "_cpu_is_amx_tile_supported", lambda: False)
    model = models.LinearsOfBothKinds().eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(3, 64)
    with torch.no_grad():
        exported = torch.export.export(model, (x,))
        expected = model(x)
    as_exported = exported.run_decompositions({})
    assert [n.args[0].meta["val"].dtype for n in as_exported.graph.nodes
            if n.target is torch.ops.aten._int_mm.default] == [torch.uint8] * 2

    normalized = aotstack.Program({"forward": exported}).methods["forward"]

    products = [n for n in normalized.graph.nodes if n.target is torch.ops.aten._int_mm.default]
    assert [n.args[0].meta["val"].dtype for n in products] == [torch.int8] * 2
    targets = {n.target for n in normalized.graph.nodes}
    assert torch.ops.aten.sum.dim_IntList not in targets and torch.ops.aten.sub.Tensor not in targets
    assert len(int8_linears(normalized.graph)) == 2
    with torch.no_grad():
        torch.testing.assert_close(normalized.module()(x), expected, rtol=0, atol=0)
