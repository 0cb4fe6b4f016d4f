"""Stacked engines, control flow and ``min_block_size``: real compiles, loaded in a fresh process."""

from __future__ import annotations

import json

import pytest
import torch

import aotstack
from aotstack.backends.ort.run import OrtHandle
from aotstack.format.archive import read_manifest
from aotstack.format.ops import call_delegate
from aotstack.format.tensor_data import content_key, tensor_bytes
from tests import models
from tests.conftest import assert_matches_eager, run_in_fresh_process

ORT_THEN_AOTI = (
    "ort-then-aoti",
    lambda: [aotstack.OrtPartitioner(ops=["aten.linear", "aten.gelu"]), aotstack.AotiCpuPartitioner()],
)
AOTI_THEN_ORT = (
    "aoti-then-ort",
    lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear"]), aotstack.OrtPartitioner()],
)


def plain_ops(lowered: aotstack.LoweredProgram) -> list[str]:
    graph = lowered.methods["forward"].graph
    return [str(n.target) for n in graph.nodes if n.op == "call_function" and not is_boundary(n)]


def is_boundary(node: torch.fx.Node) -> bool:
    return node.target is call_delegate or node.target.__name__ == "getitem"


@pytest.mark.parametrize(
    ("order", "plain"),
    [
        # The layer_norm alone between ONNX Runtime's linears and gelu runs as plain ATen: no compile for one op.
        (ORT_THEN_AOTI, ["aten.layer_norm.default"]),
        (AOTI_THEN_ORT, []),
    ],
    ids=["ort-then-aoti", "aoti-then-ort"],
)
def test_stacked_engines_share_a_method_and_match_eager(lowered_with, order, plain):
    lowered, path = lowered_with("stacked", *order)

    delegates = lowered.delegates("forward")
    assert {d.backend_id for d in delegates} == {"onnxruntime", "aoti_cpu"}
    by_backend = {b: {op for d in delegates if d.backend_id == b for op in d.ops} for b in ("onnxruntime", "aoti_cpu")}
    assert "aten.linear.default" in by_backend["onnxruntime"]
    assert "aten.linear.default" not in by_backend["aoti_cpu"]
    assert "aten.tanh.default" in by_backend["aoti_cpu"]
    assert plain_ops(lowered) == plain
    assert_matches_eager(run_in_fresh_process(path, "forward", "stacked"), "stacked")


@pytest.mark.parametrize("partitioner", [aotstack.OrtPartitioner, aotstack.AotiCpuPartitioner])
def test_control_flow_runs_inside_a_delegate(lowered_with, partitioner):
    lowered, path = lowered_with("cond", partitioner.__name__, lambda: [partitioner()])

    [delegate] = lowered.delegates("forward")
    assert "higher_order.cond" in delegate.ops
    graph = lowered.methods["forward"].graph
    assert not [n for n in graph.nodes if n.op == "get_attr"], "the branches went into the delegate"
    assert_matches_eager(run_in_fresh_process(path, "forward", "cond"), "cond")
    loaded, model = aotstack.load(path), models.build("cond")
    for x in (torch.full((3, 8), 2.0), torch.full((3, 8), -2.0)):
        torch.testing.assert_close(loaded.forward(x), model(x).detach())


def test_control_flow_no_engine_takes_runs_as_plain_aten(lowered_with):
    lowered, path = lowered_with("map", "ort", lambda: [aotstack.OrtPartitioner()])

    assert "higher_order.map_impl" in {op for d in lowered.delegates("forward") for op in d.ops} | {
        f"higher_order.{n.target.__name__}"
        for n in lowered.methods["forward"].graph.nodes
        if isinstance(n.target, torch._ops.HigherOrderOperator)
    }
    assert not any("higher_order.map_impl" in d.ops for d in lowered.delegates("forward"))
    assert_matches_eager(run_in_fresh_process(path, "forward", "map"), "map")


def test_min_block_size_moves_a_small_island_to_plain_aten(lowered_with):
    lowered, path = lowered_with(
        "island", "min2", lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"], min_block_size=2)]
    )

    assert len(lowered.delegates("forward")) == 2
    assert sorted(plain_ops(lowered)) == ["aten.add.Tensor", "aten.sigmoid.default", "aten.sigmoid.default"]
    assert_matches_eager(run_in_fresh_process(path, "forward", "island"), "island")


def test_a_weight_read_on_both_sides_of_a_delegate_is_in_both_partitions_and_the_file_once(lowered_with):
    lowered, path = lowered_with(
        "shared_weight",
        "mul-then-add",
        lambda: [aotstack.OrtPartitioner(ops=["aten.mul"]), aotstack.OrtPartitioner(ops=["aten.add"])],
    )

    delegates = lowered.delegates("forward")
    assert [d.ops for d in delegates] == [["aten.mul.Tensor"], ["aten.add.Tensor"], ["aten.add.Tensor"]]
    weight_key = content_key(tensor_bytes(models.build("shared_weight").w))
    readers = [d for d in delegates if weight_key in {content_key(b) for b in d.named_data.values()}]
    assert len(readers) == 2
    assert weight_key in read_manifest(path).blobs
    assert_matches_eager(run_in_fresh_process(path, "forward", "shared_weight"), "shared_weight")


def test_a_buffer_updated_inside_a_delegate_persists_between_calls(lowered_with):
    _, path = lowered_with("buffer", "ort", lambda: [aotstack.OrtPartitioner()])

    loaded, model = aotstack.load(path), models.build("buffer")
    for seed in (1, 2, 3):
        x = models.example_inputs("buffer", seed)[0]
        torch.testing.assert_close(loaded.forward(x), model(x))


def test_ort_feeds_contiguous_inputs_without_a_copy(lowered_with, monkeypatch):
    _, path = lowered_with("linear", "ort", lambda: [aotstack.OrtPartitioner()])
    loaded = aotstack.load(path)
    [delegate_step] = loaded.method("forward").body.actions
    session = next(
        cell.cell_contents.session for cell in delegate_step.__closure__
        if isinstance(cell.cell_contents, OrtHandle)
    )
    seen = []
    real_run = session.run
    monkeypatch.setattr(session, "run", lambda names, feeds: seen.append(feeds) or real_run(names, feeds))

    x = models.example_inputs("linear")[0]
    loaded.forward(x)

    [feeds] = seen
    [array] = feeds.values()
    assert array.__array_interface__["data"][0] == x.data_ptr()


def test_an_execution_provider_missing_at_load_is_named(lowered_with):
    missing = ["NoSuchExecutionProvider"]
    _, path = lowered_with("linear", "ort-missing", lambda: [aotstack.OrtPartitioner(providers=missing)])
    with pytest.raises(aotstack.DelegateInitError, match="NoSuchExecutionProvider"):
        aotstack.load(path)


def test_a_providers_spec_that_names_no_provider_is_refused():
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    with pytest.raises(aotstack.LoweringError, match="compile spec 'providers'"):
        aotstack.lower(program, [aotstack.OrtPartitioner(providers=["cpu"])])


def test_onnx_runtime_keeps_a_dynamic_batch_dynamic(tmp_path):
    model = models.build("stacked")
    batch = torch.export.Dim("batch", min=1, max=64)
    program = aotstack.export(
        model, {"forward": models.example_inputs("stacked")}, dynamic_shapes={"forward": ({0: batch},)}
    )
    aotstack.lower(program, [aotstack.OrtPartitioner()]).save(tmp_path / "dynamic.pt2")

    loaded = aotstack.load(tmp_path / "dynamic.pt2")
    for size in (1, 5, 33):
        x = torch.randn(size, 16)
        torch.testing.assert_close(loaded.forward(x), model(x).detach())


def test_onnx_runtime_declines_bf16_and_the_next_engine_takes_it(tmp_path):
    model = models.build("stacked").to(torch.bfloat16)
    x = models.example_inputs("stacked")[0].to(torch.bfloat16)
    program = aotstack.export(model, {"forward": (x,)})

    alone = aotstack.explain(program, [aotstack.OrtPartitioner()]).method("forward")
    assert alone.delegates == [] and alone.unclaimed
    assert all("no arithmetic kernels for bfloat16" in g.reasons[0].detail for g in alone.unclaimed)

    # check=True: a bf16 output is judged by bf16's default tolerance, not float32's (which it would fail).
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()], check=True)
    assert lowered.check_result.passed and "(atol 1e-01, rtol 5e-02): passed" in lowered.check_result.text()
    assert {d.backend_id for d in lowered.delegates("forward")} == {"aoti_cpu"}
    assert plain_ops(lowered) == [], "AOTInductor took everything ONNX Runtime declined"
    lowered.save(tmp_path / "bf16.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "bf16.pt2").forward(x), model(x).detach(), atol=1e-2, rtol=2e-2)


class ConvNormRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, bias=False)
        self.norm = torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


def test_onnx_runtime_gets_a_bias_free_convolution_with_no_computed_bias_and_its_weights_outside():
    import onnx

    from aotstack.backends.ort.compile import export_partition

    model = ConvNormRelu().eval()
    model.norm.running_mean.uniform_(-1, 1)
    program = aotstack.export(model, {"forward": (torch.randn(1, 3, 8, 8),)}).methods["forward"]
    partition = export_partition(program, "conv")

    onnx_model = onnx.load_from_string(partition.model)
    ops = [node.op_type for node in onnx_model.graph.node]
    # The exporter's zero bias (Expand of a zero) is folded away, so ONNX Runtime can fuse the norm into the conv.
    assert "Expand" not in ops and ops.count("Conv") == 1
    external = {i.name for i in onnx_model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL}
    assert external == set(partition.weights) == {
        "conv.weight", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"
    }


class PatchEmbedding3d(torch.nn.Module):
    """Rows of patch values embedded by a bias-free 3-D convolution over (frames, height, width): Qwen2-VL's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.conv(rows.view(-1, 3, 2, 4, 4)).view(-1, 8)


def test_onnx_runtime_runs_a_bias_free_3d_convolution(tmp_path):
    # The exporter's zero bias for it is [channels, 2], which ONNX Runtime refused at the first run; it is dropped.
    model, rows = PatchEmbedding3d().eval(), torch.randn(6, 96)
    program = aotstack.export(model, {"forward": (rows,)})
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner()])
    assert [d.backend_id for d in lowered.delegates("forward")] == ["onnxruntime"]
    lowered.save(tmp_path / "conv3d.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "conv3d.pt2").forward(rows), model(rows).detach())


class RoutedRows(torch.nn.Module):
    """Rows picked by two data-dependent masks, concatenated, then added back by index: a mixture of experts' shape."""

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        first, second = x[:, 0] > 0, x[:, 1] > 0
        rows = torch.cat([x[first], x[second]]) * 2
        slots = torch.cat([slot[first], slot[second]])
        return torch.zeros(4, x.shape[1]).index_add(0, slots, rows)


def test_a_tensor_sized_by_a_sum_of_data_dependent_sizes_crosses_into_aotinductor(tmp_path):
    model, slot = RoutedRows(), torch.tensor([0, 1, 2, 3, 0, 1])
    program = aotstack.export(model, {"forward": (torch.randn(6, 3), slot)})
    # ONNX Runtime concatenates (rows: u0 + u1) and declines index_add; AOTInductor adds the rows back, reading
    # their count from the tensor fed.
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()])
    by_backend = {d.backend_id: d.ops for d in lowered.delegates("forward")}
    assert "aten.cat.default" in by_backend["onnxruntime"] and "aten.index_add.default" in by_backend["aoti_cpu"]
    lowered.save(tmp_path / "routed.pt2")

    loaded = aotstack.load(tmp_path / "routed.pt2")
    for seed in range(3):
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(loaded.forward(x, slot), model(x, slot))
    nothing_routed = -torch.ones(6, 3)
    torch.testing.assert_close(loaded.forward(nothing_routed, slot), torch.zeros(4, 3))


class FlattenedTokens(torch.nn.Module):
    """Batch and sequence flattened into one dimension for a matmul, as every transformers linear is traced."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.weight = torch.nn.Parameter(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.norm(x).reshape(-1, 16)
        hidden = torch.mm(rows, self.weight)
        return torch.relu((torch.nn.functional.silu(hidden) * hidden).reshape(x.shape[0], x.shape[1], 32))


def test_a_tensor_sized_by_a_product_of_dynamic_sizes_crosses_into_aotinductor(tmp_path):
    model = FlattenedTokens().eval()
    batch, length = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("length", min=2, max=32)
    program = aotstack.export(model, {"forward": (torch.randn(2, 8, 16),)},
                              dynamic_shapes={"forward": ({0: batch, 1: length},)})
    # ONNX Runtime normalizes and flattens (rows: batch * length), and unflattens after the ops it declines.
    # AOTInductor's partition has no input sized by batch or length alone: it reads the rows' count from the
    # tensor fed (it cannot solve one product for the sizes in it), from 1 (batch and length are at least 1) up to
    # the product's largest value (an engine that plans memory at a size's largest, ExecuTorch, needs one).
    ort = aotstack.OrtPartitioner(ops=["aten.layer_norm", "aten.view", "aten.relu"], min_island_work=0)
    lowered = aotstack.lower(program, [ort, aotstack.AotiCpuPartitioner()])
    delegates = lowered.delegates("forward")
    assert any("aten.layer_norm.default" in d.ops for d in delegates if d.backend_id == "onnxruntime")
    [aoti] = [d for d in delegates if d.backend_id == "aoti_cpu"]
    assert aoti.ops == ["aten.mm.default", "aten.mul.Tensor", "aten.silu.default"]
    boundary = json.loads(aoti.processed_bytes)["boundary"]
    rows = boundary["inputs"][0]["sizes"][0]
    assert boundary["symbols"][rows] == [1, 8 * 32], "any count of rows the declared sizes make, up to the largest"
    lowered.save(tmp_path / "flattened.pt2")

    loaded = aotstack.load(tmp_path / "flattened.pt2")
    with torch.no_grad():
        for shape in ((2, 8), (1, 2), (8, 32), (5, 31)):
            x = torch.randn(*shape, 16)
            torch.testing.assert_close(loaded.forward(x), model(x))


class Patches(torch.nn.Module):
    """Non-overlapping 16-pixel patches of an image, each projected, and the image's features upsampled."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(4, 8, 16, 16)
        self.project = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.patches(x)
        tokens = self.project(features.flatten(2).transpose(1, 2)).relu()
        return tokens, torch.nn.functional.interpolate(features, scale_factor=2.0) + 1


def test_an_image_whose_sides_are_multiples_of_a_size_keeps_them_dynamic_in_aotinductor(tmp_path):
    """Sides declared as multiples (``32 * Dim``, a processor padding to 32) reach each partition as the multiple
    of one size, which an engine solves from the tensor fed: AOTInductor failed to compile it before, given a
    data-dependent stand-in for each side instead ("Could not extract specialized integer")."""
    model = Patches().eval()
    rows, columns = torch.export.Dim("rows", min=1, max=64), torch.export.Dim("columns", min=1, max=64)
    program = aotstack.export(model, {"forward": (torch.randn(2, 4, 224, 160),)},
                              dynamic_shapes={"forward": ({0: torch.export.Dim("batch", max=8), 2: 32 * rows,
                                                           3: 32 * columns},)})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    for delegate in lowered.delegates("forward"):
        boundary = json.loads(delegate.processed_bytes)["boundary"]
        assert [str(size)[:3] for size in boundary["inputs"][0]["sizes"][2:]] == ["32*", "32*"]
        assert not [symbol for symbol in boundary["symbols"] if symbol.startswith("u")], "no stand-in"
    lowered.save(tmp_path / "patches.pt2")

    loaded = aotstack.load(tmp_path / "patches.pt2")
    with torch.no_grad():
        # A side of one step (32 pixels) too: torch.export holds ``rows`` >= 2 and ``32 * rows`` >= 32, and the program
        # runs there, as plain AOTInductor's does (``subprogram.with_roots_of_derived_sizes``).
        for shape in ((1, 4, 64, 96), (3, 4, 224, 160), (2, 4, 128, 64), (1, 4, 32, 64), (2, 4, 32, 32)):
            x = torch.randn(shape)
            for got, want in zip(loaded.forward(x), model(x), strict=True):
                torch.testing.assert_close(got, want)
    with pytest.raises(aotstack.InputError, match="32"):
        loaded.forward(torch.randn(1, 4, 48, 64))


def test_a_part_after_another_engines_reads_the_grids_sides_off_the_image(tmp_path):
    """PatchGrid reads its grid's sides off its convolution's output; with the linear between them left to plain ATen,
    the part after it lays the tokens out by those sides, now read off the image (``compile/input_sizes.py``), which
    it takes as an input for its sizes alone."""
    from tests.test_stacking import patch_grid_program

    model = models.build("patch_grid")
    lowered = aotstack.lower(patch_grid_program(), [aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear"])])
    first, after = lowered.delegates("forward")
    assert "aten.conv2d.default" in first.ops and "aten.relu.default" in after.ops
    boundary = json.loads(after.processed_bytes)["boundary"]
    image, tokens = (tensor["sizes"] for tensor in boundary["inputs"])
    assert (len(image), image[1], len(tokens)) == (4, 3, 3), "the image (not the grid) and the mixed tokens"
    lowered.save(tmp_path / "grid.pt2")

    loaded = aotstack.load(tmp_path / "grid.pt2")
    with torch.no_grad():
        for shape in ((2, 3, 16, 24), (1, 3, 64, 8), (5, 3, 28, 44)):
            x = torch.randn(shape)
            torch.testing.assert_close(loaded.forward(x), model(x))


def test_xnnpack_takes_an_images_patches_flattened_by_its_dynamic_sides(tmp_path):
    """XNNPACK's partition reads the patches flattened (rows ``4 * rows * columns``, a product no input has): the
    stand-in for that count is at least 1 where the declared sizes say so, as XNNPACK's ops ask; it failed to
    compile before ("Could not guard on data-dependent expression u0 < 1")."""
    from aotstack.backends.xnnpack.packages import executorch_problem

    if executorch_problem() is not None:
        pytest.skip(str(executorch_problem()))
    model = Patches().eval()
    rows, columns = torch.export.Dim("rows", min=1, max=64), torch.export.Dim("columns", min=1, max=64)
    program = aotstack.export(model, {"forward": (torch.randn(2, 4, 224, 160),)},
                              dynamic_shapes={"forward": ({0: torch.export.Dim("batch", min=1, max=8), 2: 32 * rows,
                                                           3: 32 * columns},)})
    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()])
    xnnpack = [op for d in lowered.delegates("forward") if d.backend_id == "xnnpack" for op in d.ops]
    # The convolution too: the grid's sides the flattening reads are read off the image, not the convolution's output
    # (``compile/input_sizes.py``), which had pinned ExecuTorch's size read on the convolution.
    assert {"aten.linear.default", "aten.conv2d.default"} <= set(xnnpack)
    lowered.save(tmp_path / "patches.pt2")

    loaded = aotstack.load(tmp_path / "patches.pt2")
    with torch.no_grad():
        for shape in ((1, 4, 64, 96), (3, 4, 224, 160), (1, 4, 32, 32)):
            x = torch.randn(shape)
            for got, want in zip(loaded.forward(x), model(x), strict=True):
                torch.testing.assert_close(got, want)


class IntegerArithmetic(torch.nn.Module):
    """Integers made from a linear's output, in the arithmetic whose rounding and signs engines differ on."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.project, self.mix = torch.nn.Linear(8, 8), torch.nn.Linear(8 * 9, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = (self.project(x) * 20).to(self.dtype)
        results = (
            n // 7, torch.div(n, 7, rounding_mode="floor"), torch.div(n, 7, rounding_mode="trunc"), n % 5,
            n % (n.abs().amax() // 3 + 1), torch.fmod(n, 5), (n << 2) >> 1, (n & 6) ^ 3, n.cumsum(-1),
        )
        return self.mix(torch.cat([result.float() for result in results], -1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("engine", ["onnxruntime", "openvino", "xnnpack"])
def test_integer_division_and_remainders_round_as_torch_does_in_every_engine(tmp_path, engine, dtype):
    # OpenVINO rounded floor divisions toward zero (-20 // 7 gave -2); ExecuTorch's portable remainder took the
    # dividend's sign (-14 % 5 gave -4). Negative integers are half of these.
    from aotstack.backends.xnnpack.packages import executorch_problem
    from aotstack.engine.registry import BUILT_IN

    if engine == "xnnpack" and executorch_problem() is not None:
        pytest.skip(str(executorch_problem()))
    model, x = IntegerArithmetic(dtype).eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    partitioner = BUILT_IN[engine].partitioner_class()()
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [partitioner], jobs=1)
    assert any(delegate.backend_id == engine for delegate in lowered.delegates("forward"))
    lowered.save(tmp_path / "integers.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "integers.pt2").forward(x), model(x))
