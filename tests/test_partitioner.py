"""Partitioner-level behaviour: graph structure after ``partition``, no compiles."""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack.backends.ort.partitioner import exporter_registry
from aotstack.compile.partitioner import DELEGATION_TAG, weight_computations
from aotstack.compile.program_parts import mark_state_of_other_methods
from aotstack.format.ops import call_delegate
from tests import models


def exported(name: str) -> torch.export.ExportedProgram:
    return aotstack.export(models.build(name), {"forward": models.example_inputs(name)}).methods["forward"]


def tags_of(program: torch.export.ExportedProgram) -> dict[str, str]:
    return {n.name: n.meta[DELEGATION_TAG] for n in program.graph.nodes if DELEGATION_TAG in n.meta}


@pytest.mark.parametrize("name", ["add", "conv", "linear"])
def test_a_fully_supported_graph_gets_one_tag(name):
    program = exported(name)
    result = aotstack.AotiCpuPartitioner().partition(program)

    assert list(result.partition_tags) == ["aoti_cpu_0"]
    spec = result.partition_tags["aoti_cpu_0"]
    assert spec.backend_id == "aoti_cpu"
    assert aotstack.CompileSpec("target_device", b"cpu") in spec.compile_specs
    compute = [n for n in program.graph.nodes if n.op == "call_function"]
    assert all(n.meta[DELEGATION_TAG] == "aoti_cpu_0" for n in compute)


def test_weights_take_the_tag_of_their_partition_and_unused_ones_are_tagged_too():
    program = exported("unused")
    aotstack.AotiCpuPartitioner().partition(program)

    tags = tags_of(program)
    for placeholder in ("p_linear_weight", "p_linear_bias", "p_unused_weight", "b_unused_buffer"):
        assert tags[placeholder] == "aoti_cpu_0"
    assert "x" not in tags


def test_exclude_ops_accepts_names_overloads_and_op_objects():
    for excluded in ("sigmoid", "aten.sigmoid", "aten.sigmoid.default", torch.ops.aten.sigmoid.default,
                     torch.ops.aten.sigmoid):
        program = exported("split")
        result = aotstack.AotiCpuPartitioner(exclude_ops=[excluded]).partition(program)
        assert len(result.partition_tags) >= 2, excluded
        [sigmoid] = [n for n in program.graph.nodes if n.target == torch.ops.aten.sigmoid.default]
        assert DELEGATION_TAG not in sigmoid.meta


def test_delegate_calls_and_their_getitems_are_never_offered_again():
    program = exported("split")
    graph = program.graph
    first = next(n for n in graph.nodes if n.op == "call_function")
    with graph.inserting_before(first):
        call = graph.call_function(call_delegate, ("forward.0", [first.args[0]]))
        item = graph.call_function(__import__("operator").getitem, (call, 0))

    offered = aotstack.get_non_lowered_nodes(graph)

    assert call not in offered and item not in offered
    assert first in offered


def test_an_already_lowered_graph_gets_no_new_tags(lowered_package):
    lowered, _ = lowered_package("linear")
    result = aotstack.AotiCpuPartitioner().partition(lowered.methods["forward"])
    assert result.partition_tags == {}


def test_lowering_a_lowered_program_again_names_the_delegate_it_cannot_place(lowered_package):
    lowered, _ = lowered_package("split", exclude_ops=("aten.sigmoid",))
    again = aotstack.Program(dict(lowered.methods))
    # The second pass claims only the sigmoid; the delegates of the first pass are not its own.
    sigmoid_only = aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear", "aten.mul", "aten.add", "aten.sum"])
    with pytest.raises(aotstack.LoweringError, match="delegate node 'call_delegate_default' calls 'forward.0'"):
        aotstack.lower(again, [sigmoid_only])


def sandwich(rows: int) -> torch.export.ExportedProgram:
    return aotstack.export(models.Sandwich(), {"forward": (torch.randn(rows, 512),)}).methods["forward"]


def claimed_relus(program: torch.export.ExportedProgram) -> list[str]:
    return [n.name for n in program.graph.nodes if n.target is torch.ops.aten.relu.default and DELEGATION_TAG in n.meta]


def test_an_engine_leaves_a_light_part_beside_others_ops_to_the_next_engine():
    """Each relu of 512 values reads or feeds a product the engine refuses: a boundary or two for almost no work, so
    both are left. They stay claimed where they do enough work (1024 rows), where ``min_island_work=0`` asks for
    every part, or where a relu is the whole method, with nothing beside it to join."""
    program = sandwich(1)
    result = aotstack.OrtPartitioner(ops=["aten.relu"]).partition(program)
    assert claimed_relus(program) == []
    relus = [n.name for n in program.graph.nodes if n.target is torch.ops.aten.relu.default]
    assert len(relus) == 2
    for relu in relus:
        assert result.refusals[relu].kind == "min_block_size"
        assert "min_island_work" in result.refusals[relu].detail

    program = sandwich(1)
    aotstack.OrtPartitioner(ops=["aten.relu"], min_island_work=0).partition(program)
    assert len(claimed_relus(program)) == 2

    program = sandwich(1024)
    aotstack.OrtPartitioner(ops=["aten.relu"]).partition(program)
    assert len(claimed_relus(program)) == 2

    program = aotstack.export(torch.nn.ReLU(), {"forward": (torch.randn(1, 4),)}).methods["forward"]
    aotstack.OrtPartitioner().partition(program)
    assert claimed_relus(program) == ["relu"]


def test_a_light_part_of_symbolic_sizes_is_weighed_at_the_largest_sizes_they_may_take():
    """Rows of at most 64: each relu does at most 32768 values' work, light at every size, so both are left (a
    prefill's norm split by an op XNNPACK leaves made a part of one ``pow``). Unbounded rows say nothing of the work:
    the relus stay claimed, as do relus of up to 1024 rows."""
    def dynamic_sandwich(largest: int | None) -> torch.export.ExportedProgram:
        rows = torch.export.Dim("rows", min=1, max=largest) if largest else torch.export.Dim("rows")
        return aotstack.export(models.Sandwich(), {"forward": (torch.randn(4, 512),)},
                               dynamic_shapes={"forward": ({0: rows},)}).methods["forward"]

    program = dynamic_sandwich(64)
    result = aotstack.OrtPartitioner(ops=["aten.relu"]).partition(program)
    assert claimed_relus(program) == []
    assert all("does at most about 32,768 multiply-adds" in result.refusals[relu].detail
               for relu in ("relu", "relu_1"))

    for largest in (None, 1024):
        program = dynamic_sandwich(largest)
        aotstack.OrtPartitioner(ops=["aten.relu"]).partition(program)
        assert len(claimed_relus(program)) == 2, largest


def test_min_island_work_must_be_a_count():
    with pytest.raises(ValueError, match="min_island_work must be an int >= 0, got -1"):
        aotstack.OrtPartitioner(min_island_work=-1)


class WeightsReadElsewhere(torch.nn.Module):
    """Products another engine runs, over weights transposed and scaled first; other weight computations read here."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(8, 8))
        self.second = torch.nn.Parameter(torch.randn(8, 8))
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.mm(x, self.first.t() * 2) + self.bias * 3
        return torch.mm(hidden.relu(), self.second.t()), self.bias.neg()


def test_weight_computations_only_for_ops_an_engine_leaves_are_left_with_them():
    """Claimed, ``first.t() * 2`` and ``second.t()`` would be computed by this engine at every call and handed over a
    boundary to the engine running the products. ``bias * 3`` has a reader the engine takes, and ``bias.neg()`` is an
    output: both stay claimed."""
    x = torch.randn(4, 8)
    program = aotstack.export(WeightsReadElsewhere(), {"forward": (x,)}).methods["forward"]
    result = aotstack.AotiCpuPartitioner(exclude_ops=["aten.mm"]).partition(program)

    first_product, second_product = [n for n in program.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert DELEGATION_TAG not in first_product.meta and DELEGATION_TAG not in second_product.meta
    scaled_first = first_product.args[1]
    for node in (scaled_first, scaled_first.args[0], second_product.args[1]):  # first.t() * 2, first.t(), second.t()
        assert DELEGATION_TAG not in node.meta, node.name
        assert result.refusals[node.name].kind == "not_claimed"
        assert "computes from weights alone" in result.refusals[node.name].detail

    [scaled_bias] = [n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 3]
    [negated] = [n for n in program.graph.nodes if n.target is torch.ops.aten.neg.default]
    assert DELEGATION_TAG in scaled_bias.meta and DELEGATION_TAG in negated.meta


class FilledByAnother(torch.nn.Module):
    """``fill`` writes the table; ``read`` transposes it, so the transpose is state's, not the weights'."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(8, 8))

    def fill(self, x: torch.Tensor) -> torch.Tensor:
        self.table.copy_(x)
        return x.sum()

    def read(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.table.t())


def test_a_buffer_another_method_updates_is_not_a_weight_to_compute_from():
    x = torch.randn(8, 8)
    program = aotstack.export(FilledByAnother(), {"fill": (x,), "read": (x,)}).methods["read"]
    assert [node.target for node in weight_computations(program)] == [torch.ops.aten.t.default]

    mark_state_of_other_methods(program, {"table"})
    assert weight_computations(program) == []



def test_an_example_of_a_data_dependent_size_takes_a_stand_in():
    from aotstack.compile.program_parts import UNBACKED_EXAMPLE_SIZE, example_tensor

    class Chosen(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x.nonzero()[:, 0]] * 2

    program = aotstack.export(Chosen(), {"forward": (torch.tensor([0.0, 1.0, 2.0]),)}).methods["forward"]
    [chosen] = [n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert example_tensor(chosen.meta["val"]).shape == (UNBACKED_EXAMPLE_SIZE,)


def test_making_an_onnx_runtime_partitioner_leaves_the_exporters_table_unbuilt():
    # Auto makes every plan's partitioners before it starts AOTInductor's warm-up: building the exporter's table
    # there (1-3 s) held back auto's longest compile.
    exporter_registry.cache_clear()
    partitioner = aotstack.OrtPartitioner()
    assert exporter_registry.cache_info().currsize == 0

    assert "cond" in partitioner.control_flow
    assert exporter_registry.cache_info().currsize == 1
