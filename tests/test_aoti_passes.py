"""The graph passes and decompositions the AOTInductor backends run before compiling (no compiles)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node

import aotstack
from aotstack.backends.aoti.cuda import conv1d_as_conv2d
from aotstack.backends.aoti.few_queries import MAX_QUERY_ROWS, FewQueriesAttentionPass
from aotstack.backends.aoti.few_rows import FewRowsProductAsReductionPass, IntMmRowMajorPass
from aotstack.backends.aoti.filled_keys import MIN_KEYS, FilledKeysAttentionPass
from aotstack.backends.aoti.metal import LinearAsMatmulPass
from aotstack.backends.aoti.packed_weights import with_packed_weights
from tests import models

aten = torch.ops.aten


def targets(graph_module: GraphModule) -> list:
    return [node.target for node in graph_module.graph.nodes if node.op == "call_function"]


def one_copy_graph(copy_op, args, then=None) -> GraphModule:
    """``copy_op(x, *args)``, optionally followed by ``then(result)``, returned."""
    graph = Graph()
    x = graph.placeholder("x")
    result = graph.call_function(copy_op, (x, *args))
    if copy_op is aten.split_copy.Tensor:
        result = graph.call_function(operator.getitem, (result, 0))
    if then is not None:
        result = then(graph, result)
    graph.output(graph.call_function(aten.mul.Tensor, (result, 2)) if then is None else result)
    return GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    ("copy_op", "args", "view_op"),
    [
        (aten.slice_copy.Tensor, (1, 1, 3), aten.slice.Tensor),
        (aten.select_copy.int, (0, 1), aten.select.int),
        (aten.split_copy.Tensor, (2, 1), aten.split.Tensor),
    ],
)
def test_view_copy_pass_turns_each_copy_into_its_view(copy_op, args, view_op):
    module = one_copy_graph(copy_op, args)
    x = torch.randn(4, 5)
    expected = module(x)

    assert aotstack.ReplaceViewCopyWithViewPass()(module) is True

    assert view_op in targets(module) and copy_op not in targets(module)
    torch.testing.assert_close(module(x), expected)


def test_view_copy_pass_keeps_a_copy_whose_result_is_mutated_in_place():
    module = one_copy_graph(
        aten.slice_copy.Tensor, (1, 1, 3), then=lambda g, r: g.call_function(aten.add_.Tensor, (r, 1))
    )

    assert aotstack.ReplaceViewCopyWithViewPass()(module) is False
    assert aten.slice_copy.Tensor in targets(module)


def test_view_copy_pass_keeps_a_copy_whose_result_is_viewed():
    module = one_copy_graph(
        aten.select_copy.int, (0, 1), then=lambda g, r: g.call_function(aten.unsqueeze.default, (r, 0))
    )

    assert aotstack.ReplaceViewCopyWithViewPass()(module) is False
    assert aten.select_copy.int in targets(module)


def test_view_copy_pass_keeps_a_split_whose_piece_is_mutated():
    module = one_copy_graph(
        aten.split_copy.Tensor, (2, 1), then=lambda g, r: g.call_function(aten.mul_.Tensor, (r, 3))
    )

    assert aotstack.ReplaceViewCopyWithViewPass()(module) is False
    assert aten.split_copy.Tensor in targets(module)


def test_view_copy_pass_keeps_a_copy_returned_from_the_partition():
    graph = Graph()
    graph.output(graph.call_function(aten.slice_copy.Tensor, (graph.placeholder("x"), 0, 0, 2)))
    module = GraphModule(torch.nn.Module(), graph)

    assert aotstack.ReplaceViewCopyWithViewPass()(module) is False


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = torch.nn.Linear(8, 6)
        self.batched = torch.nn.Linear(6, 4, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat(x), self.batched(y)


def test_metal_linear_pass_rewrites_linear_as_matmul_and_keeps_the_numbers():
    model = TwoLinears().eval()
    x, y = torch.randn(3, 8), torch.randn(2, 5, 6)
    exported = aotstack.export(model, {"forward": (x, y)}).methods["forward"]
    module = exported.graph_module

    assert LinearAsMatmulPass()(module) is True
    module.recompile()

    ops = targets(module)
    assert aten.linear.default not in ops and aten.addmm.default not in ops
    assert ops.count(aten.matmul.default) == 2
    # The 2-D input goes through a leading dimension of one; the bias-free one has no add.
    assert ops.count(aten.unsqueeze.default) == 1 and ops.count(aten.squeeze.dims) == 1
    assert ops.count(aten.add.Tensor) == 1
    flat = next(n for n in module.graph.nodes if n.target is aten.squeeze.dims)
    assert tuple(flat.meta["val"].shape) == (3, 6)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x, y), model(x, y))


def test_metal_linear_pass_means_inductor_calls_mm_not_addmm():
    """Probed on the host (no Mac here): the rewritten linear needs ``mm``, which Metal has."""
    program = aotstack.export(torch.nn.Linear(8, 6).eval(), {"forward": (torch.randn(3, 8),)})
    node = next(n for n in program.methods["forward"].graph.nodes if n.target is aten.linear.default)

    metal = aotstack.MetalBackend().needed_fallback_kernels(node, [])
    cpu = aotstack.AotiCpuBackend().needed_fallback_kernels(node, [])

    assert cpu == {"aten.addmm.out"}
    assert metal == {"aten.mm.out"}


def test_cuda_decomposes_conv1d_into_conv2d_with_the_same_numbers():
    conv = torch.nn.Conv1d(4, 6, kernel_size=3, stride=2, padding=1, dilation=2).eval()
    x = torch.randn(2, 4, 17)
    exported = aotstack.export(conv, {"forward": (x,)}).methods["forward"]

    decomposed = exported.run_decompositions(aotstack.CudaBackend().decomposition_table())

    names = {str(node.target) for node in decomposed.graph.nodes if node.op == "call_function"}
    assert "aten.conv1d.default" not in names
    convolutions = [n for n in decomposed.graph.nodes if "conv" in str(n.target)]
    assert convolutions and all(len(n.meta["val"].shape) == 4 for n in convolutions)
    with torch.no_grad():
        torch.testing.assert_close(decomposed.module()(x), conv(x))


def test_conv1d_as_conv2d_takes_unbatched_inputs():
    x, weight, bias = torch.randn(4, 9), torch.randn(6, 2, 3), torch.randn(6)

    got = conv1d_as_conv2d(x, weight, bias, [1], [1], [1], 2)

    torch.testing.assert_close(got, torch.nn.functional.conv1d(x, weight, bias, 1, 1, 1, 2))


@pytest.mark.parametrize("scheme", ["8da4w", "8w"])
def test_dequantized_linear_of_one_row_becomes_a_reduction_that_keeps_the_numbers(scheme):
    model = aotstack.quantize(models.LinearsOfBothKinds().eval(), linear=scheme, group_size=32)
    x = torch.randn(1, 1, 64)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    assert FewRowsProductAsReductionPass()(exported.graph_module) is True

    ops = targets(exported.graph_module)
    assert aten.linear.default not in ops and ops.count(aten.add.Tensor) == 1
    # The activation (quantized per token, for 8da4w) is made once, not inside the reduction.
    assert ops.count(torch.ops.prims.inductor_force_stride_order.default) == 2
    # Per linear: its product over the weights, dequantized without their zero points, less what the
    # zero points add (the activation's sums per group of 32 against them): 3 sums, 1 difference.
    reduced = [n for n in exported.graph_module.graph.nodes if n.target is aten.sum.dim_IntList]
    products = [n for n in reduced if n.args[0].target is aten.mul.Tensor and isinstance(n.args[0].args[1], Node)
                and n.args[0].args[1].target is torch.ops.torchao.dequantize_affine.default]
    assert [tuple(n.meta["val"].shape) for n in products] == [(1, 1, 32), (1, 1, 16)]
    assert all(n.args[0].args[1].args[3] is None for n in products)
    assert sorted(tuple(n.meta["val"].shape) for n in reduced if n not in products) == [
        (1, 1, 1), (1, 1, 2), (1, 1, 16), (1, 1, 32)]
    assert ops.count(aten.sub.Tensor) == 2
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_linear_of_one_or_two_rows_becomes_a_reduction_that_keeps_the_numbers(dtype):
    model = models.LinearsOfBothKinds().eval().to(dtype)
    x = torch.randn(2, 64, dtype=dtype)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    assert FewRowsProductAsReductionPass()(exported.graph_module) is True

    ops = targets(exported.graph_module)
    assert aten.linear.default not in ops and ops.count(aten.sum.dim_IntList) == 2
    reduced = [n for n in exported.graph_module.graph.nodes if n.target is aten.sum.dim_IntList]
    # Each weight multiplied as stored, [out, in], so the sum runs along its rows.
    assert [tuple(n.args[0].args[1].meta["val"].shape) for n in reduced] == [(32, 64), (16, 32)]
    with torch.no_grad():
        tolerance = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(exported.module()(x), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("quantized", "rows"),
    [(False, 3), (True, 8)],
    ids=["float weights, three rows", "dequantized weights, eight rows"],
)
def test_few_rows_pass_keeps_products_of_more_rows_as_linear(quantized, rows):
    model = models.LinearsOfBothKinds().eval()
    if quantized:
        model = aotstack.quantize(model, linear="8da4w", group_size=32)
    exported = aotstack.export(model, {"forward": (torch.randn(rows, 64),)}).methods["forward"]

    assert FewRowsProductAsReductionPass()(exported.graph_module) is False
    assert targets(exported.graph_module).count(aten.linear.default) == 2


class InputMajorWeight(torch.nn.Module):
    """GPT-2's ``Conv1D``: the weight stored ``[in, out]``, multiplied by ``addmm(bias, x, weight)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32))
        self.bias = torch.nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def test_few_rows_pass_keeps_a_float_weight_stored_across_its_input_dimension():
    exported = aotstack.export(InputMajorWeight().eval(), {"forward": (torch.randn(1, 64),)}).methods["forward"]

    assert FewRowsProductAsReductionPass()(exported.graph_module) is False
    assert targets(exported.graph_module) == [aten.addmm.default]


def test_dequantized_linear_pass_takes_a_product_over_a_cast_of_int8_weights():
    """``Int8WeightOnlyConfig`` leaves ``mm(x, w_int8.t().to(float))`` and the scales after it."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = models.LinearsOfBothKinds().eval()
    quantize_(model, Int8WeightOnlyConfig())
    x = torch.randn(1, 1, 64)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    assert targets(exported.graph_module).count(aten.mm.default) == 2
    with torch.no_grad():
        expected = exported.module()(x)

    assert FewRowsProductAsReductionPass()(exported.graph_module) is True

    ops = targets(exported.graph_module)
    assert aten.mm.default not in ops and ops.count(aten.sum.dim_IntList) == 2
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"])
def test_int8_weights_a_product_reads_transposed_are_packed_and_one_row_reduces_each_slot(config):
    """A cast of them to float for ``mm``, or ``_int_mm``'s operand: words of four, then one product per slot."""
    import torchao.quantization

    model = models.LinearsOfBothKinds().eval()
    torchao.quantization.quantize_(model, getattr(torchao.quantization, config)())
    x = torch.randn(1, 1, 64)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    integers = stored_integers(exported)
    with torch.no_grad():
        expected = exported.module()(x)

    packed = with_packed_weights(exported)

    assert sorted(shape for _, shape in integers.values()) == [(16, 32), (32, 64)]
    assert stored_as(packed, integers) == {fqn: (F32, (rows, columns // 4)) for fqn, (_, (rows, columns))
                                           in integers.items()}
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=0, atol=0)
    assert FewRowsProductAsReductionPass()(packed.graph_module) is True
    ops = targets(packed.graph_module)
    assert not {aten.mm.default, aten._int_mm.default, aten.cat.default} & set(ops)
    assert ops.count(aten.sum.dim_IntList) == 8
    # ``_int_mm``'s slots are read as the int32 values they hold, not narrowed to int8 (a slow conversion).
    assert not [n for n in packed.graph_module.graph.nodes if n.kwargs.get("dtype") is torch.int8]
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=1e-5, atol=1e-5)


class EmbeddingThenLinears(torch.nn.Module):
    """An embedding read twice (one read is returned as it is) and two linears, for weights packed or not."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, width)
        self.first = torch.nn.Linear(width, 32)
        self.second = torch.nn.Linear(32, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.embed(ids)
        return self.second(torch.relu(self.first(rows))), self.embed(ids + 1)


def stored_integers(program) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The program's integer weights of more than one value per row, by FQN: their dtypes and shapes."""
    weights = {**program.state_dict, **program.constants}
    return {fqn: (value.dtype, tuple(value.shape)) for fqn, value in weights.items()
            if not value.dtype.is_floating_point and value.shape[-1] > 4}


def stored_as(program, fqns) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    weights = {**program.state_dict, **program.constants}
    return {fqn: (weights[fqn].dtype, tuple(weights[fqn].shape)) for fqn in fqns}


F32, U8 = torch.float32, torch.uint8


@pytest.mark.parametrize(
    ("width", "linear", "embedding", "group_size", "words"),
    [
        # 8 int4 slots of 256 // 8 columns each hold whole groups of 32; the 32-wide linear is one group.
        (256, "8da4w", "4w", 32, {"embed": (F32, (100, 32)), "first": (F32, (32, 32)), "second": (F32, (16, 4))}),
        # 8 slots of 128 // 8 columns split groups of 32 in halves: groups of 16, each with its scale.
        (128, "8da4w", "4w", 32, {"embed": (F32, (100, 16)), "first": (F32, (32, 16)), "second": (F32, (16, 4))}),
        # 8 slots of 64 // 8 columns would split groups of 32 finer than 16 columns, two do not: int4 two a byte.
        (64, "8da4w", "4w", 32, {"embed": (U8, (100, 32)), "first": (U8, (32, 32)), "second": (F32, (16, 4))}),
        # Two a byte, in groups of 16 (two slots of 48 columns).
        (96, "8da4w", "4w", 32, {"embed": (U8, (100, 48)), "first": (U8, (32, 48)), "second": (F32, (16, 4))}),
        (64, "4w", "4w", 0, {"embed": (F32, (100, 8)), "first": (F32, (32, 8)), "second": (F32, (16, 4))}),
        (128, "8da8w", "8w", 32, {"embed": (F32, (100, 32)), "first": (F32, (32, 32)), "second": (F32, (16, 8))}),
    ],
    ids=["int4-g32-words", "int4-g32-words-finer", "int4-g32-bytes", "int4-g32-bytes-finer", "int4-channel",
         "int8-g32"],
)
def test_weights_are_packed_into_the_widest_words_whose_slots_hold_whole_groups(
        width, linear, embedding, group_size, words):
    model = aotstack.quantize(EmbeddingThenLinears(width).eval(), linear=linear, embedding=embedding,
                              group_size=group_size)
    ids = torch.tensor([[3, 97]])
    exported = aotstack.export(model, {"forward": (ids,)}).methods["forward"]
    before = stored_integers(exported)
    fqns = {name: next(fqn for fqn in before if fqn.startswith(name)) for name in words}
    with torch.no_grad():
        expected = exported.module()(ids)

    packed = with_packed_weights(exported)

    assert stored_integers(exported) == before, "the program given is not changed"
    assert all(dtype is torch.int8 for dtype, _ in before.values())
    assert stored_as(packed, fqns.values()) == {fqns[name]: stored for name, stored in words.items()}
    ops = targets(packed.graph_module)
    # Each linear reads the join of its slots; each of the two embeddings joins the rows it gathered from each.
    slots = width // words["embed"][1][1]
    assert ops.count(aten.cat.default) == 4 and ops.count(aten.embedding.default) == 2 * slots
    with torch.no_grad():
        for got, want in zip(packed.module()(ids), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_packed_linear_of_one_row_reduces_each_slot_where_it_lies():
    model = aotstack.quantize(models.LinearsOfBothKinds().eval(), linear="8da4w", group_size=32)
    x = torch.randn(1, 1, 64)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)
    packed = with_packed_weights(exported)

    assert FewRowsProductAsReductionPass()(packed.graph_module) is True

    # One product per slot of each linear's input (two bytes' halves for ``first``, eight words' slots for
    # ``second``), and no join of the slots left to compile.
    assert aten.cat.default not in targets(packed.graph_module)
    products = [n for n in packed.graph_module.graph.nodes if n.target is aten.sum.dim_IntList
                and n.args[0].target is aten.mul.Tensor and isinstance(n.args[0].args[1], Node)
                and n.args[0].args[1].target is torch.ops.torchao.dequantize_affine.default]
    assert sorted(n.args[0].args[0].meta["val"].shape[-1] for n in products) == [4] * 8 + [32, 32]
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("width", "linear", "group_size"), [(96, "8w", 32)], ids=["int8, 24 columns a slot"])
def test_weights_whose_slots_would_split_groups_finer_than_16_columns_stay_as_they_are(width, linear, group_size):
    model = aotstack.quantize(EmbeddingThenLinears(width).eval(), linear=linear, embedding="8w", group_size=group_size)
    exported = aotstack.export(model, {"forward": (torch.tensor([[3]]),)}).methods["forward"]

    packed = with_packed_weights(exported)

    unpacked = {fqn: shape for fqn, shape in stored_integers(packed).items() if not fqn.startswith("second")}
    assert set(unpacked) == {fqn for fqn in stored_integers(exported) if not fqn.startswith("second")}
    assert all(dtype is torch.int8 for dtype, _ in unpacked.values()), unpacked


def test_slots_that_split_groups_read_scales_stored_for_each_part_and_no_zero_points_of_zeros():
    model = aotstack.quantize(EmbeddingThenLinears(128).eval(), linear="8da4w", embedding="4w", group_size=32)
    ids = torch.tensor([[3, 97]])
    exported = aotstack.export(model, {"forward": (ids,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(ids)
    weights = {**exported.state_dict, **exported.constants}
    scales = {fqn: value for fqn, value in weights.items() if value.dtype.is_floating_point and value.shape[-1] == 4}
    zero_points = {fqn for fqn, value in weights.items() if value.dtype is torch.int8 and value.shape[-1] == 4}
    assert len(scales) == 2 and len(zero_points) == 2 and not any(weights[fqn].any() for fqn in zero_points)

    packed = with_packed_weights(exported)

    # The embedding's and the first linear's 128 columns are 8 slots of 16: each scale of 32 stored twice.
    packed_weights = {**packed.state_dict, **packed.constants}
    for fqn, scale in scales.items():
        assert torch.equal(packed_weights[fqn], scale.repeat_interleave(2, dim=1)), fqn
    # Symmetric quantization's zero points, all zero, are not read: the slots' offset is subtracted alone.
    placeholders = {spec.target: spec.arg.name for spec in packed.graph_signature.input_specs if spec.target}
    nodes = {node.name: node for node in packed.graph.nodes}
    assert all(not nodes[placeholders[fqn]].users for fqn in zero_points)
    with torch.no_grad():
        for got, want in zip(packed.module()(ids), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert FewRowsProductAsReductionPass()(packed.graph_module) is True
    with torch.no_grad():
        for got, want in zip(packed.module()(ids), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class AsymmetricInt4Linear(torch.nn.Module):
    """torchao's ``dequantize_affine`` by hand: int4 in groups of 32 with zero points of every value, and a bias."""

    def __init__(self, columns: int, dtype: torch.dtype, rows: int = 24) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        groups = columns // 32
        self.register_buffer("values", torch.randint(-8, 8, (rows, columns), dtype=torch.int8, generator=generator))
        self.register_buffer("scales", torch.rand(rows, groups, generator=generator) / 8)
        self.register_buffer("zeros", torch.randint(-8, 8, (rows, groups), generator=generator).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(rows, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchao.quantization  # noqa: F401  (registers torchao's ops)

        weight = torch.ops.torchao.dequantize_affine(self.values, [1, 32], self.scales, self.zeros, torch.int8, -8, 7)
        return torch.nn.functional.linear(x, weight, self.bias)


@pytest.mark.parametrize(("columns", "dtype", "word", "zeros_stored"), [
    (256, torch.int8, torch.float32, (24, 8)),  # 8 slots of 32 columns: whole groups
    (384, torch.int32, torch.float32, (24, 24)),  # 8 slots of 48: groups of 16, each zero point stored twice
    (96, torch.int8, torch.uint8, (24, 6)),  # 2 slots of 48, two a byte, groups of 16
], ids=["words", "words-finer", "bytes-finer"])
def test_zero_points_and_the_packing_offset_leave_the_loop_of_a_packed_linear_and_keep_its_numbers(
        columns, dtype, word, zeros_stored):
    model = AsymmetricInt4Linear(columns, dtype).eval()
    x = torch.randn(1, 1, columns)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    packed = with_packed_weights(exported)

    assert packed.state_dict.get("values", packed.constants.get("values")).dtype is word
    weights = {**packed.state_dict, **packed.constants}
    # Stored as the product reads them: float32, the packing's offset of 8 added, repeated per finer group.
    repeats = zeros_stored[1] // model.zeros.shape[1]
    offset_zeros = model.zeros.to(torch.float32).repeat_interleave(repeats, dim=1) + 8
    assert weights["zeros"].dtype is torch.float32 and torch.equal(weights["zeros"], offset_zeros)
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=0, atol=0)
    assert FewRowsProductAsReductionPass()(packed.graph_module) is True
    # The slots' loops read no zero point: one product of group sums and zero points corrects their sum.
    dequantized = [n for n in packed.graph.nodes if n.target is torch.ops.torchao.dequantize_affine.default]
    assert dequantized and all(n.args[3] is None for n in dequantized)
    corrections = [n for n in packed.graph.nodes if n.target is aten.sub.Tensor
                   and n.args[1].target is aten.sum.dim_IntList]
    assert len(corrections) == 1
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=1e-5, atol=1e-5)


def test_a_quantized_linear_reading_another_reads_its_rewrite():
    """Two quantized linears back to back (a low-rank pair, an MLP without activation): the second's product read the
    first's erased node, and the partition failed to compile (``KeyError: linear``)."""
    model = torch.nn.Sequential(AsymmetricInt4Linear(256, torch.int8, rows=64), AsymmetricInt4Linear(64, torch.int8))
    x = torch.randn(1, 1, 256)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    packed = with_packed_weights(exported)
    assert FewRowsProductAsReductionPass()(packed.graph_module) is True
    packed.graph.lint()
    assert not [n for n in packed.graph.nodes if n.target is aten.linear.default]
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=1e-5, atol=1e-5)


class OneWeightReadTwoWays(torch.nn.Module):
    """int8 values read as int4 in groups of 32 by one product, and cast whole by another."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("values", torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=generator))
        self.register_buffer("scales", torch.rand(16, 2, generator=generator))
        self.register_buffer("zeros", torch.zeros(16, 2, dtype=torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchao.quantization  # noqa: F401  (registers torchao's ops)

        weight = torch.ops.torchao.dequantize_affine(self.values, [1, 32], self.scales, self.zeros, torch.int8, -8, 7)
        return torch.nn.functional.linear(x, weight) + torch.mm(x, self.values.t().to(torch.float32))


def test_a_weight_two_readers_would_pack_differently_stays_as_it_is():
    x = torch.randn(1, 64)
    exported = aotstack.export(OneWeightReadTwoWays().eval(), {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    packed = with_packed_weights(exported)

    # As int4 in groups of 32 it would go two a byte; as int8 cast whole, four a word.
    assert stored_integers(packed) == {"values": (torch.int8, (16, 64))}
    with torch.no_grad():
        torch.testing.assert_close(packed.module()(x), expected, rtol=0, atol=0)


def test_int_mm_pass_hands_the_product_a_row_major_activation():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = models.LinearsOfBothKinds().eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(1, 1, 64)
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    with torch.no_grad():
        expected = exported.module()(x)

    assert IntMmRowMajorPass()(exported.graph_module) is True

    products = [n for n in exported.graph_module.graph.nodes if n.target is aten._int_mm.default]
    assert len(products) == 2
    for product in products:
        operand = product.args[0]
        assert operand.target is torch.ops.prims.inductor_force_stride_order.default
        assert operand.args[1] == [operand.meta["val"].shape[-1], 1]
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), expected)


class NumbersWrittenIntoATensor(torch.nn.Module):
    """BEiT's relative position index: Python numbers written into a tensor, which export lifts as 0-d constants."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.zeros(5, 5, dtype=torch.long)
        index[1:, 1:] = x.shape[1]
        index[0, 0:] = 7
        index[0, 0] = 9
        self.steps.add_(1)
        return (x + index) * self.scale + self.steps


def test_single_value_weights_are_read_as_full_and_leave_the_inputs_but_an_updated_one():
    from aotstack.backends.aoti.scalar_weights import with_scalar_weights_inlined

    x = torch.randn(5, 5)
    exported = aotstack.export(NumbersWrittenIntoATensor(), {"forward": (x,)}).methods["forward"]
    before = [spec.target for spec in exported.graph_signature.input_specs]

    inlined = with_scalar_weights_inlined(exported)

    assert [spec.target for spec in exported.graph_signature.input_specs] == before, "the program given is unchanged"
    kept = [spec.target for spec in inlined.graph_signature.input_specs if spec.target is not None]
    assert kept == ["steps"], "the updated buffer stays an input; the constants and the scale are written as values"
    assert set(inlined.constants) == set() and "scale" not in inlined.state_dict
    fills = [node.args[1] for node in inlined.graph.nodes if node.target is aten.full.default and node.args[0] == []]
    assert sorted(fills) == [0.5, 5, 7, 9]  # the scale, the width of x, then 7 and 9
    torch.testing.assert_close(inlined.module()(x), NumbersWrittenIntoATensor()(x))


def test_lifted_constants_reach_inductor_as_buffers_named_by_their_fqn():
    from aotstack.backends.aoti.lifted_constants import with_constants_as_buffers

    x = torch.randn(3, 6)
    exported = aotstack.export(models.build("state_kinds"), {"forward": (x,)}).methods["forward"]
    kinds = {spec.target: spec.kind for spec in exported.graph_signature.input_specs}
    assert kinds["scale"] is InputKind.CONSTANT_TENSOR

    program = with_constants_as_buffers(exported)

    assert {spec.target: spec.kind for spec in exported.graph_signature.input_specs} == kinds, "the program given"
    [scale] = [spec for spec in program.graph_signature.input_specs if spec.target == "scale"]
    assert scale.kind is InputKind.BUFFER and scale.persistent is False
    assert program.constants["scale"] is exported.constants["scale"]
    assert [spec.kind for spec in program.graph_signature.input_specs if spec.target != "scale"] == [
        kind for target, kind in kinds.items() if target != "scale"
    ]
    assert with_constants_as_buffers(program) is program, "nothing left to hand over"


class AttentionOverACache(torch.nn.Module):
    """Two layers' queries attending to their static caches of ``keys`` positions; which they see is the mask given."""

    def __init__(self, keys: int, is_causal: bool = False) -> None:
        super().__init__()
        self.is_causal = is_causal
        for layer in range(2):
            self.register_buffer(f"key_{layer}", torch.randn(1, 2, keys, 16))
            self.register_buffer(f"value_{layer}", torch.randn(1, 2, keys, 16))

    def forward(self, query: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in range(2):
            query = torch.nn.functional.scaled_dot_product_attention(
                query, getattr(self, f"key_{layer}"), getattr(self, f"value_{layer}"), attn_mask=mask,
                is_causal=self.is_causal,
            )
        return query


def keys_read(module: GraphModule, *args: torch.Tensor) -> list[int]:
    """How many keys each attention of ``module`` read, running it on ``args``."""
    read: list[int] = []

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is aten.scaled_dot_product_attention.default:
                read.append(kwargs["key"].shape[-2] if "key" in kwargs else args[1].shape[-2])
            return super().call_function(target, args, kwargs)

    Recorder(module).run(*args)
    return read


def graph_inputs(exported: torch.export.ExportedProgram, *user_inputs: torch.Tensor) -> list[torch.Tensor]:
    """What ``exported``'s graph takes: its lifted buffers and ``user_inputs``, in its placeholders' order."""
    given = iter(user_inputs)
    stored = {**exported.state_dict, **exported.constants}
    return [next(given) if spec.kind is InputKind.USER_INPUT else stored[spec.target]
            for spec in exported.graph_signature.input_specs]


def visible(rows: int, keys: int, last: list[int]) -> torch.Tensor:
    """A ``[1, 1, rows, keys]`` mask whose row ``r`` sees keys ``0 ..= last[r]``."""
    return torch.arange(keys).expand(rows, keys).le(torch.tensor(last)[:, None])[None, None]


def test_an_attention_over_a_static_cache_reads_keys_up_to_the_last_its_mask_lets_a_query_see():
    keys = 80
    module = AttentionOverACache(keys).eval()
    query = torch.randn(1, 2, 3, 16)
    rows = torch.export.Dim("rows", max=keys)  # a prompt's, or one token's
    exported = torch.export.export(module, (query, visible(3, keys, [9, 10, 11])),
                                   dynamic_shapes=({2: rows}, {2: rows}))

    assert FilledKeysAttentionPass()(exported.graph_module) is True

    graph = exported.graph_module.graph
    [length] = [node for node in graph.nodes if node.target is aten.item.default]  # one for both layers
    attentions = [node for node in graph.nodes if node.target is aten.scaled_dot_product_attention.default]
    cut = [attention.kwargs[name] for attention in attentions for name in ("key", "value", "attn_mask")]
    assert len(cut) == 6 and all(n.target is aten.slice.Tensor and n.args[3] is length for n in cut)
    assert cut[2] is cut[5], "the mask is cut once"
    assert targets(exported.graph_module).count(aten._assert_scalar.default) == 2  # 2 <= length <= keys
    holes = torch.zeros(1, 1, 3, keys, dtype=torch.bool)
    holes[..., [0, 5, 50]] = True
    cases = {
        "a prompt's causal rows": (visible(3, keys, [9, 10, 11]), 12),
        "one token, most of the cache unwritten": (visible(1, keys, [39]), 40),
        "masked keys before the last seen one": (holes, 51),
        "every key seen": (visible(1, keys, [keys - 1]), keys),
        "the first key alone": (visible(1, keys, [0]), 2),
        "no key seen": (torch.zeros(1, 1, 1, keys, dtype=torch.bool), 2),
    }
    for name, (mask, read) in cases.items():
        queries = torch.randn(1, 2, mask.shape[-2], 16)
        assert keys_read(exported.graph_module, *graph_inputs(exported, queries, mask)) == [read, read], name
        torch.testing.assert_close(exported.module()(queries, mask), module(queries, mask), equal_nan=True, msg=name)


@pytest.mark.parametrize(
    ("keys", "mask", "is_causal"),
    [
        (MIN_KEYS - 1, torch.ones(1, 1, 1, MIN_KEYS - 1, dtype=torch.bool), False),
        (80, torch.zeros(1, 1, 1, 80), False),
        (80, torch.ones(1, 1, 1, 1, dtype=torch.bool), False),
        (80, None, True),
    ],
    ids=["a short cache", "an additive float mask", "a mask broadcast over the keys", "a causal flag, no mask"],
)
def test_filled_keys_pass_leaves_attentions_it_cannot_cut_as_they_are(keys, mask, is_causal):
    query = torch.randn(1, 2, 1 if mask is None else mask.shape[-2], 16)
    exported = torch.export.export(AttentionOverACache(keys, is_causal).eval(), (query, mask))

    assert FilledKeysAttentionPass()(exported.graph_module) is False
    assert aten.slice.Tensor not in targets(exported.graph_module)


def with_holes(rows: int, keys: int) -> torch.Tensor:
    """A float ``[1, 1, rows, keys]`` mask adding -inf to every third key and a small bias to the rest."""
    mask = torch.linspace(-1, 1, keys).expand(1, 1, rows, keys).clone()
    mask[..., ::3] = -torch.inf
    return mask


@pytest.mark.parametrize(
    ("rows", "mask", "dtype"),
    [
        (1, visible(1, 40, [29]), torch.float32),
        (3, visible(3, 40, [9, 10, 11]), torch.float32),
        (MAX_QUERY_ROWS, with_holes(MAX_QUERY_ROWS, 40), torch.float32),
        (2, None, torch.float32),
        (3, visible(3, 40, [20, 30, 39]), torch.bfloat16),
    ],
    ids=["one row, a cache filled in part", "a group's rows", "the most rows, an additive mask", "no mask",
         "bfloat16"],
)
def test_an_attention_of_a_few_query_rows_becomes_a_reduction_and_a_product_with_its_numbers(rows, mask, dtype):
    module = AttentionOverACache(40).to(dtype).eval()
    query = torch.randn(1, 2, rows, 16, dtype=dtype)
    mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    exported = torch.export.export(module, (query, mask))

    assert FewQueriesAttentionPass()(exported.graph_module) is True

    kinds = targets(exported.graph_module)
    assert aten.scaled_dot_product_attention.default not in kinds
    assert kinds.count(aten.sum.dim_IntList) == 2 and kinds.count(aten._softmax.default) == 2  # two layers
    assert kinds.count(aten.bmm.default) == 2
    [first_sum, _] = [node for node in exported.graph_module.graph.nodes if node.target is aten.sum.dim_IntList]
    query_operand = first_sum.args[0].args[0].args[0]
    assert query_operand.target is torch.ops.prims.inductor_force_stride_order.default, "the query computed once"
    close = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(exported.module()(query, mask), module(query, mask), **close)


def test_few_query_rows_attend_over_the_cut_keys():
    keys = 80
    module = AttentionOverACache(keys).eval()
    query, mask = torch.randn(1, 2, 3, 16), visible(3, keys, [9, 10, 11])
    exported = torch.export.export(module, (query, mask))

    assert FilledKeysAttentionPass()(exported.graph_module) is True
    assert FewQueriesAttentionPass()(exported.graph_module) is True

    graph = exported.graph_module.graph
    [length] = [node for node in graph.nodes if node.target is aten.item.default]
    key_operands = [n.args[0] for n in graph.nodes if n.target is aten.unsqueeze.default and n.args[1] == -3]
    value_operands = [node.args[1].args[0] for node in graph.nodes if node.target is aten.bmm.default]
    read = key_operands + value_operands
    assert len(read) == 4 and all(n.target is aten.slice.Tensor and n.args[3] is length for n in read)
    for last in ([9, 10, 11], [39, 39, 39], [keys - 1] * 3):
        mask = visible(3, keys, last)
        torch.testing.assert_close(exported.module()(query, mask), module(query, mask), rtol=0, atol=1e-6)


class HeadsJoinedAfterAttention(torch.nn.Module):
    """transformers' attention output: its heads joined by a transpose and a view."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value)
        batch, _, rows, _ = attended.shape
        return attended.transpose(1, 2).contiguous().view(batch, rows, -1)


def test_an_attention_rewritten_keeps_the_layout_its_result_was_recorded_with():
    query, key, value = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    exported = torch.export.export(HeadsJoinedAfterAttention(), (query, key, value))
    [attention] = [n for n in exported.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    # As torch 2.11 records it (ATen's CPU kernel writes each row's heads together): the transpose after it is
    # then contiguous, and export leaves a view of it where 2.13 leaves a copy.
    recorded = attention.meta["val"]
    attention.meta["val"] = recorded.transpose(1, 2).contiguous().transpose(1, 2)
    users = list(attention.users)

    assert FewQueriesAttentionPass()(exported.graph_module) is True

    [result] = {user.args[0] for user in users}
    assert result.meta["val"].stride() == (256, 8, 32, 1)
    torch.testing.assert_close(exported.module()(query, key, value), HeadsJoinedAfterAttention()(query, key, value),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("rows", "dynamic", "is_causal"),
    [(MAX_QUERY_ROWS + 1, False, False), (3, True, False), (1, False, True)],
    ids=["more rows than a decode step's", "rows known only at run time (a prompt)", "a causal flag"],
)
def test_few_queries_pass_leaves_other_attentions_as_they_are(rows, dynamic, is_causal):
    query = torch.randn(1, 2, rows, 16)
    mask = None if is_causal else visible(rows, 40, list(range(rows)))
    shapes = ({2: torch.export.Dim("rows", max=40)}, None if mask is None else {2: torch.export.Dim("rows", max=40)})
    exported = torch.export.export(AttentionOverACache(40, is_causal).eval(), (query, mask),
                                   dynamic_shapes=shapes if dynamic else None)

    assert FewQueriesAttentionPass()(exported.graph_module) is False
    assert targets(exported.graph_module).count(aten.scaled_dot_product_attention.default) == 2


def test_inductors_stride_analysis_leaves_a_large_index_as_it_stands_within_the_bound():
    """What Inductor's CPU code generation simplifies to find an index's stride: a small index as before, one of more
    than ``SIMPLIFIED_INDEX_OPS`` operations untouched (a conformer's relative shift over symbolic frames made
    indices that sympy took most of a minute each to simplify); torch's own again after the block."""
    import sympy

    from aotstack.backends.aoti.index_analysis import (
        SIMPLIFIED_INDEX_OPS,
        bounded_index_simplification,
        stride_analysis_module,
    )

    module = stride_analysis_module()
    assert module is not None, "this torch keeps its stride analysis elsewhere: the bound would do nothing"
    x, frames = sympy.symbols("x frames", integer=True, nonnegative=True)
    small = (x**2 - 1) / (x - 1) + frames
    # Sixty such terms: sympy's simplify runs past minutes on them, so only the bound lets this test end.
    terms = sympy.symbols("t0:60", integer=True, positive=True)
    large = sum((term**2 - 1) / (term - 1) for term in terms)
    assert sympy.count_ops(large) > SIMPLIFIED_INDEX_OPS >= sympy.count_ops(small)
    with bounded_index_simplification():
        assert module.sympy.simplify(small) == x + 1 + frames
        assert module.sympy.simplify(large) is large
        with bounded_index_simplification():  # a block inside another leaves the bound to the outer one
            assert module.sympy.simplify(large) is large
        assert module.sympy.simplify(large) is large
    assert module.sympy is sympy
