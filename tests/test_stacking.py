"""Partitioning rules shared by every partitioner, and stacking one partitioner after another.

Graph structure only: these tests partition, they do not compile.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.passes.utils.fuser_utils import validate_partition

import aotstack
from aotstack.compile.partitioner import DELEGATION_TAG
from aotstack.compile.splice import splice_delegate_call
from aotstack.format.ops import call_delegate
from aotstack.format.specs import SpecKey, count_spec
from tests import models

PARTITIONERS = {
    "aoti_cpu": aotstack.AotiCpuPartitioner,
    "onnxruntime": aotstack.OrtPartitioner,
}


def exported(name: str) -> torch.export.ExportedProgram:
    return aotstack.export(models.build(name), {"forward": models.example_inputs(name)}).methods["forward"]


def node(program: torch.export.ExportedProgram, name: str) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if n.name == name)


def tag(program: torch.export.ExportedProgram, name: str) -> str | None:
    return node(program, name).meta.get(DELEGATION_TAG)


def tagged_nodes(program: torch.export.ExportedProgram, tag_name: str) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and n.meta.get(DELEGATION_TAG) == tag_name]


def lower_by_hand(program: torch.export.ExportedProgram, names: list[str], inputs: list[str]) -> torch.fx.Node:
    """Put the nodes called ``names`` behind a delegate call, as an earlier partitioner would."""
    nodes = [node(program, name) for name in names]
    splice_delegate_call(program.graph, nodes, "forward.0", [node(program, n) for n in inputs], nodes[-1:])
    return next(n for n in program.graph.nodes if n.target is call_delegate)


@pytest.mark.parametrize("backend_id", PARTITIONERS)
@pytest.mark.parametrize("name", ["add", "conv", "linear"])
def test_a_fully_supported_graph_gets_one_tag(backend_id, name):
    program = exported(name)
    result = PARTITIONERS[backend_id]().partition(program)

    assert list(result.partition_tags) == [f"{backend_id}_0"]
    spec = result.partition_tags[f"{backend_id}_0"]
    assert spec.backend_id == backend_id
    assert aotstack.CompileSpec("target_device", b"cpu") in spec.compile_specs
    compute = [n for n in program.graph.nodes if n.op == "call_function"]
    assert all(n.meta[DELEGATION_TAG] == f"{backend_id}_0" for n in compute)


@pytest.mark.parametrize("backend_id", PARTITIONERS)
def test_unused_parameters_and_buffers_are_tagged(backend_id):
    program = exported("unused")
    PARTITIONERS[backend_id]().partition(program)
    assert tag(program, "p_unused_weight") == tag(program, "b_unused_buffer") == f"{backend_id}_0"


@pytest.mark.parametrize("backend_id", PARTITIONERS)
def test_a_delegate_call_and_its_getitems_are_not_tagged_again(backend_id):
    program = exported("split")
    call = lower_by_hand(program, ["linear", "mul"], ["x", "p_first_weight", "p_first_bias"])
    [item] = call.users

    PARTITIONERS[backend_id](min_block_size=1).partition(program)

    assert DELEGATION_TAG not in call.meta and DELEGATION_TAG not in item.meta
    assert tag(program, "sigmoid") == f"{backend_id}_0"


def test_a_buffer_read_only_by_an_earlier_delegate_is_not_tagged():
    program = exported("buffer")
    lower_by_hand(program, ["add"], ["x", "b_offset"])

    aotstack.AotiCpuPartitioner(min_block_size=1).partition(program)

    assert tag(program, "b_offset") is None
    assert tag(program, "relu") == "aoti_cpu_0"


def test_a_mutated_buffer_takes_the_tag_of_the_partition_that_computes_it():
    program = exported("buffer")
    aotstack.AotiCpuPartitioner(exclude_ops=["aten.relu"]).partition(program)
    assert tag(program, "add_1") is not None
    assert tag(program, "b_running") == tag(program, "add_1")


def test_two_adds_separated_by_a_delegate_give_two_convex_partitions():
    program = exported("shared_weight")
    lower_by_hand(program, ["mul"], ["add"])

    result = aotstack.AotiCpuPartitioner(min_block_size=1).partition(program)

    assert list(result.partition_tags) == ["aoti_cpu_0", "aoti_cpu_1"]
    for tag_name in result.partition_tags:
        nodes = tagged_nodes(program, tag_name)
        assert [n.target for n in nodes] == [torch.ops.aten.add.Tensor]
        assert validate_partition(nodes)


def test_a_weight_read_on_both_sides_of_a_delegate_goes_with_one_partition():
    program = exported("shared_weight")
    lower_by_hand(program, ["mul"], ["add"])

    result = aotstack.AotiCpuPartitioner(min_block_size=1).partition(program)

    assert tag(program, "p_w") in result.partition_tags


@pytest.mark.parametrize("backend_id", PARTITIONERS)
def test_control_flow_branches_take_the_tag_of_their_op(backend_id):
    program = exported("cond")
    PARTITIONERS[backend_id]().partition(program)

    [cond] = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.cond]
    branches = [n for n in program.graph.nodes if n.op == "get_attr"]
    assert len(branches) == 2 and all(branch in cond.args for branch in branches)
    assert cond.meta[DELEGATION_TAG] == f"{backend_id}_0"
    assert all(branch.meta[DELEGATION_TAG] == f"{backend_id}_0" for branch in branches)


@pytest.mark.parametrize("backend_id", PARTITIONERS)
def test_control_flow_a_backend_cannot_take_is_left_whole(backend_id):
    program = exported("map")
    result = PARTITIONERS[backend_id]().partition(program)

    [map_node] = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.map_impl]
    [body] = [n for n in program.graph.nodes if n.op == "get_attr"]
    assert DELEGATION_TAG not in map_node.meta and DELEGATION_TAG not in body.meta
    assert isinstance(getattr(program.graph_module, body.target), torch.fx.GraphModule)
    # The multiply after it is still claimed, as its own partition.
    assert [n.target for n in tagged_nodes(program, f"{backend_id}_0")] == [torch.ops.aten.mul.Tensor]
    assert len(result.partition_tags) == 1


@pytest.mark.parametrize(
    "partitioner",
    [
        lambda: aotstack.AotiCpuPartitioner(exclude_ops=["higher_order.cond"]),
        lambda: aotstack.AotiCpuPartitioner(exclude_ops=[torch.ops.higher_order.cond]),
        lambda: aotstack.OrtPartitioner(ops=["aten.linear", "aten.sin", "aten.cos", "aten.mul", "aten.add"]),
    ],
    ids=["aoti-exclude-by-name", "aoti-exclude-op-object", "ort-ops-without-cond"],
)
def test_control_flow_can_be_excluded_like_any_op(partitioner):
    program = exported("cond")
    partitioner().partition(program)

    [cond] = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.cond]
    branches = [n for n in program.graph.nodes if n.op == "get_attr"]
    assert DELEGATION_TAG not in cond.meta
    assert all(DELEGATION_TAG not in branch.meta for branch in branches)
    assert tag(program, "linear") is not None


def test_min_block_size_leaves_small_parts_unclaimed():
    program = exported("island")
    aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"], min_block_size=2).partition(program)

    assert tag(program, "add") is None
    assert {tag(program, "linear"), tag(program, "relu")} == {"aoti_cpu_0"}
    assert {tag(program, "linear_1"), tag(program, "relu_1")} == {"aoti_cpu_1"}


def test_a_lone_op_between_other_engines_delegates_is_left_to_plain_aten():
    program = exported("shared_weight")
    lower_by_hand(program, ["mul"], ["add"])

    result = aotstack.AotiCpuPartitioner().partition(program)

    assert result.partition_tags == {}
    reasons = {result.refusals[name].kind for name in ("add", "add_1")}
    assert reasons == {"min_block_size"}
    assert "lone op between other engines' delegates" in result.refusals["add"].detail


def test_a_lone_op_is_claimed_where_no_other_engine_took_a_part():
    program = exported("island")
    result = aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"]).partition(program)

    assert tag(program, "add") is not None
    assert len(result.partition_tags) == 3


def sandwich_around_a_delegate(rows: int) -> torch.export.ExportedProgram:
    """Products of 256 features, the relu between them behind another engine's delegate."""
    program = aotstack.export(models.Sandwich(256), {"forward": (torch.randn(rows, 256),)}).methods["forward"]
    lower_by_hand(program, ["relu_1"], ["matmul"])
    return program


def threads_by_part(rows: int, threads: int) -> dict[str, int | None]:
    """AOTInductor's parts around another engine's relu, for ``rows`` rows at ``threads`` threads: each part's
    threads spec."""
    program = sandwich_around_a_delegate(rows)
    outer = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = aotstack.AotiCpuPartitioner().partition(program)
    finally:
        torch.set_num_threads(outer)
    return {tag: count_spec(spec.compile_specs, SpecKey.THREADS) for tag, spec in result.partition_tags.items()}


def test_a_light_part_between_other_engines_delegates_compiles_for_one_thread():
    """A row's products are light: AOTInductor's second thread, spinning beside them, would hold the core the
    other engine's pool needs. 1024 rows' are not, and at one thread there is no second thread."""
    # The first relu and product; the second product alone, a lone op between delegates, runs as plain ATen.
    assert threads_by_part(1, 2) == {"aoti_cpu_0": 1}
    assert threads_by_part(1024, 2) == {"aoti_cpu_0": None}
    assert threads_by_part(1, 1) == {"aoti_cpu_0": None}

    program = sandwich_around_a_delegate(1)
    named = aotstack.AotiCpuPartitioner(compile_specs=[aotstack.CompileSpec(SpecKey.THREADS, b"2")])
    result = named.partition(program)
    assert {count_spec(spec.compile_specs, SpecKey.THREADS) for spec in result.partition_tags.values()} == {2}


class RunningSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(x)
        self.total.add_(h)
        return h


def test_a_lone_op_that_computes_a_mutated_buffer_stays_claimed():
    program = aotstack.export(RunningSum(), {"forward": (torch.randn(4),)}).methods["forward"]
    lower_by_hand(program, ["sigmoid"], ["x"])

    result = aotstack.AotiCpuPartitioner().partition(program)

    # Run in the plan, the buffer's new value would be copied back at every call; a delegate updates it in place.
    assert tag(program, "add") == "aoti_cpu_0" and list(result.partition_tags) == ["aoti_cpu_0"]
    assert tag(program, "b_total") == "aoti_cpu_0"


class ViewsAroundOneAdd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        middle = torch.sigmoid(x).t() + 1
        return torch.sigmoid(middle.unsqueeze(0))


@pytest.mark.parametrize(("min_block_size", "claimed"), [(1, True), (2, False)])
def test_views_and_getitems_do_not_count_towards_min_block_size(min_block_size, claimed):
    program = aotstack.export(ViewsAroundOneAdd(), {"forward": (torch.randn(3, 4),)}).methods["forward"]
    partitioner = aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"], min_block_size=min_block_size)
    result = partitioner.partition(program)

    middle = [n for n in program.graph.nodes if n.op == "call_function" and n.target != torch.ops.aten.sigmoid.default]
    assert len(middle) == 3  # t, add, unsqueeze: one compute node
    assert bool(result.partition_tags) == claimed


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_min_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="min_block_size"):
        aotstack.AotiCpuPartitioner(min_block_size=bad)


def test_ort_claims_only_ops_the_exporter_translates():
    class WithMedian(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x).median() + 1

    program = aotstack.export(WithMedian(), {"forward": (torch.randn(5),)}).methods["forward"]
    result = aotstack.OrtPartitioner().partition(program)

    assert tag(program, "median") is None
    assert len(result.partition_tags) == 2


class ListArguments(torch.nn.Module):
    """Ops whose arguments are lists or keywords: EfficientNet's "same" convolution, a CNN head's pooling,
    BEiT's ``meshgrid`` of relative positions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(self.conv(x), (1, 1)).flatten(1)
        rows, columns = torch.meshgrid(torch.arange(4), torch.arange(8), indexing="ij")
        return pooled * (rows - columns).sum()


def test_ort_claims_ops_whose_decomposition_reads_list_and_keyword_arguments(tmp_path):
    x, model = torch.randn(2, 3, 8, 8), ListArguments()
    program = aotstack.export(model, {"forward": (x,)})
    result = aotstack.OrtPartitioner().partition(program.methods["forward"])

    assert not result.refusals, {name: reason.detail for name, reason in result.refusals.items()}
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner()])
    assert [delegate.backend_id for delegate in lowered.delegates("forward")] == ["onnxruntime"]
    lowered.save(tmp_path / "lists.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "lists.pt2").forward(x), model(x))


class CountsPerBin(torch.nn.Module):
    """A mixture of experts' count of tokens per expert: ``histc`` over a range given, or the data's own."""

    def __init__(self, **bounds: float) -> None:
        super().__init__()
        self.bounds = bounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.histc(x * 3, bins=4, **self.bounds) * 2


@pytest.mark.parametrize(("bounds", "claimed"), [({"min": 0, "max": 3}, True), ({}, False)])
def test_ort_claims_a_histc_only_over_a_range_given(tmp_path, bounds, claimed):
    # The exporter's translation fixes the bins' edges; with min == max torch finds them in the data.
    x, model = torch.rand(32), CountsPerBin(**bounds)
    program = aotstack.export(model, {"forward": (x,)})
    result = aotstack.OrtPartitioner().partition(program.methods["forward"])
    refused = {name: reason.detail for name, reason in result.refusals.items()}
    assert refused == ({} if claimed else {"histc": "the ONNX exporter's histc needs its range given (min < max); "
                                                    "this one takes the data's"})
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner()])
    lowered.save(tmp_path / "counts.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "counts.pt2").forward(x), model(x))


def test_ort_ops_narrows_what_it_claims():
    program = exported("stacked")
    aotstack.OrtPartitioner(ops=["aten.linear", torch.ops.aten.tanh.default]).partition(program)

    claimed = {str(n.target) for n in program.graph.nodes if n.op == "call_function" and DELEGATION_TAG in n.meta}
    assert claimed == {"aten.linear.default", "aten.tanh.default"}


def test_ort_rejects_an_unknown_op_name():
    with pytest.raises(ValueError, match="'aten.no_such_op' in ops"):
        aotstack.OrtPartitioner(ops=["aten.no_such_op"])


def test_getitems_of_an_unclaimed_op_are_not_claimed():
    program = exported("map")
    aotstack.OrtPartitioner().partition(program)
    items = [n for n in program.graph.nodes if n.target is operator.getitem]
    assert items and all(DELEGATION_TAG not in n.meta for n in items)


def patch_grid_program() -> aotstack.Program:
    """``models.PatchGrid`` for any batch and any sides in steps of its patch's 4 pixels."""
    sides = {0: torch.export.Dim("batch", max=8), 2: 4 * torch.export.Dim("rows", max=16),
             3: 4 * torch.export.Dim("columns", max=16)}
    return aotstack.export(models.build("patch_grid"), {"forward": models.example_inputs("patch_grid")},
                           dynamic_shapes={"forward": (sides,)})


@pytest.mark.parametrize("backend_id", PARTITIONERS)
def test_a_size_read_off_a_computed_tensor_leaves_an_engines_part_whole(backend_id):
    # PatchGrid reads its grid's sides off the convolution's output and lays its tokens out by them after the
    # linear: read there, the sides split the engine's part in two around the method's read.
    report = aotstack.explain(patch_grid_program(), [PARTITIONERS[backend_id]()]).to_json()
    [method] = report["methods"]
    assert len(method["delegates"]) == 1
    assert not method["unclaimed"]


def test_sizes_read_off_computed_tensors_are_read_off_the_inputs_and_others_are_left():
    from aotstack.compile.input_sizes import reads_computed_tensor, sizes_read_from_inputs

    program = patch_grid_program().methods["forward"]
    read_off_grid = {n.name: n.meta["val"].node.expr for n in program.graph.nodes if reads_computed_tensor(n)}
    assert len(read_off_grid) == 2, "the grid's rows and columns"
    readers = {n.name: [user.name for user in n.users] for n in program.graph.nodes if n.name in read_off_grid}

    assert sizes_read_from_inputs(program.graph_module) == 2
    assert not [n for n in program.graph.nodes if reads_computed_tensor(n)]
    nodes = {n.name: n for n in program.graph.nodes}
    for name, expr in read_off_grid.items():
        for reader in readers[name]:
            [side] = [arg for arg in nodes[reader].all_input_nodes if arg.meta["val"] is not None
                      and not isinstance(arg.meta["val"], torch.Tensor) and arg.meta["val"].node.expr == expr]
            assert tensors_sized(side) == ["x"], "the side is read off the image"

    # A size counted from the data (an item's) no input gives: it stays read off its tensor.
    class Kept(torch.nn.Module):
        def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            rows = x[: count.item()].relu()
            return rows.reshape(rows.shape[0], -1)

    kept = aotstack.export(Kept(), {"forward": (torch.randn(6, 2, 3), torch.tensor(4))}).methods["forward"]
    before = [n.name for n in kept.graph.nodes if reads_computed_tensor(n)]
    assert before, "the rows' count, read off the slice"
    assert sizes_read_from_inputs(kept.graph_module) == 0
    assert [n.name for n in kept.graph.nodes if reads_computed_tensor(n)] == before


def tensors_sized(size: torch.fx.Node) -> list[str]:
    """The tensors whose sizes ``size`` is computed from."""
    if isinstance(size.meta.get("val"), torch.Tensor):
        return [size.name]
    return sorted({name for arg in size.all_input_nodes for name in tensors_sized(arg)})
