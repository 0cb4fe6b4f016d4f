"""The graph picture: ``aotstack.report.graph.program_svg`` draws every method of a lowered program as SVG.

Programs are lowered with a cheap Python test backend (no AOTInductor compile); its delegates say they
run on ``cuda:0``, which needs no GPU and puts host-device copies in the run plan. The large-graph test
draws a synthetic run plan and prints its time (visible with ``-s``); it asserts on structure only.
"""

from __future__ import annotations

import random
import re
import time
import xml.etree.ElementTree as ET

import pytest
import torch

import aotstack
from aotstack.compile.package import BlobStore, method_record
from aotstack.format.archive import read_manifest
from aotstack.format.manifest import DelegateRecord, InputRecord, MethodRecord
from aotstack.format.op_names import op_name
from aotstack.format.ops import d2h_copy, h2d_copy
from aotstack.format.plan import DelegateStep, InputStep, MethodPlan, OpStep, Ref, Step, SubgraphStep, WeightStep
from aotstack.format.records import TensorSpec
from aotstack.report import graph
from aotstack.report.graph import program_svg
from tests import models
from tests.test_devices import NodesOnDevice

SVG = "{http://www.w3.org/2000/svg}"


class Mixed(torch.nn.Module):
    """Two adds for delegates (one on cuda:0, one on the host), a linear, gelu and split left to ATen."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.nn.functional.gelu(self.linear(x + y))
        left, right = hidden.split(4, dim=-1)
        return torch.cat([left * right, right], dim=-1) + y, hidden.relu()


@pytest.fixture(scope="module")
def lowered_mixed() -> aotstack.LoweredProgram:
    program = aotstack.export(Mixed(), {"forward": (torch.randn(2, 8), torch.randn(2, 8))})
    return aotstack.lower(program, [NodesOnDevice("cuda:0", "add"), NodesOnDevice(None, "add_1")], jobs=1)


def record_of(lowered: aotstack.LoweredProgram, name: str = "forward") -> MethodRecord:
    return method_record(name, lowered.methods[name], lowered.delegates(name), BlobStore())


def parsed(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def groups(root: ET.Element, *classes: str) -> list[ET.Element]:
    """Every ``<g>`` whose class list holds all of ``classes``."""
    return [g for g in root.iter(f"{SVG}g") if set(classes) <= set(g.get("class", "").split())]


def label(group: ET.Element) -> list[str]:
    return [t.text or "" for t in group.findall(f"{SVG}text")]


def tooltip(group: ET.Element) -> str:
    return group.find(f"{SVG}title").text or ""


def op_steps(record: MethodRecord, target: str) -> list[OpStep]:
    return [s for s in record.plan.steps if isinstance(s, OpStep) and s.target == target]


# A lowered program ---------------------------------------------------------------------------------


def test_each_delegate_is_one_box_labelled_with_its_engine_id_and_op_count(lowered_mixed):
    record = record_of(lowered_mixed)
    root = parsed(program_svg({"forward": record}))

    boxes = groups(root, "node", "delegate")
    assert sorted(g.get("data-delegate") for g in boxes) == sorted(d.id for d in record.delegates)
    assert len(record.delegates) == 2
    for box in boxes:
        [delegate] = [d for d in record.delegates if d.id == box.get("data-delegate")]
        assert box.get("data-engine") == delegate.backend_id == "test_add_on_device"
        assert box.get("data-device") == delegate.target_device
        lines = label(box)
        assert lines[:2] == ["test_add_on_device", delegate.id]
        assert lines[2].startswith("1 kind of op")
        assert "aten.add.Tensor" in tooltip(box).splitlines()
    on_cuda = [g for g in boxes if g.get("data-device") == "cuda:0"]
    assert len(on_cuda) == 1 and label(on_cuda[0])[2].endswith("cuda:0")


def test_each_host_device_copy_is_one_copy_box_saying_where_it_goes(lowered_mixed):
    record = record_of(lowered_mixed)
    root = parsed(program_svg({"forward": record}))

    to_device = op_steps(record, op_name(h2d_copy))
    to_host = op_steps(record, op_name(d2h_copy))
    assert to_device and to_host, "the cuda:0 delegate needs its inputs copied there and its output back"
    copies = groups(root, "node", "copy")
    assert sorted(g.get("data-step") for g in copies) == sorted(s.name for s in to_device + to_host)
    for box in copies:
        going_to_host = box.get("data-step") in {s.name for s in to_host}
        assert box.get("data-to") == ("cpu" if going_to_host else "cuda:0")
        assert label(box) == (["copy to host"] if going_to_host else ["copy to cuda:0"])


def test_ops_left_to_aten_inputs_and_outputs_are_drawn_and_weights_and_getitems_are_not(lowered_mixed):
    record = record_of(lowered_mixed)
    root = parsed(program_svg({"forward": record}))

    ops = {g.get("data-op"): g for g in groups(root, "node", "op")}
    assert {"aten.linear.default", "aten.gelu.default", "aten.split.Tensor", "aten.relu.default"} <= set(ops)
    assert label(ops["aten.gelu.default"]) == ["aten.gelu"]
    assert "operator.getitem" not in ops
    left_to_aten = [s.name for s in record.plan.steps if isinstance(s, OpStep) and s.target.startswith("aten.")]
    assert sorted(g.get("data-step") for g in groups(root, "node", "op")) == sorted(left_to_aten)
    inputs = groups(root, "node", "input")
    assert [g.get("data-input") for g in sorted(inputs, key=lambda g: top_left(g)[0])] == ["x", "y"]
    assert len(groups(root, "node", "output")) == len(record.plan.outputs) == 2
    weights = {s.name for s in record.plan.steps if isinstance(s, WeightStep)}
    assert weights, "the linear layer's weight and bias"
    drawn = {g.get("data-step") for g in groups(root, "node")}
    assert not drawn & weights
    assert f"{len(weights)} weights (not drawn)" in "".join(root.itertext())


def test_edges_join_drawn_boxes_and_run_downwards(lowered_mixed):
    record = record_of(lowered_mixed)
    root = parsed(program_svg({"forward": record}))

    boxes = {node_key(g): g for g in groups(root, "node")}
    edges = [p for p in root.iter(f"{SVG}path") if p.get("class") == "edge"]
    assert edges
    for edge in edges:
        source, target = boxes[edge.get("data-from")], boxes[edge.get("data-to")]
        assert top_left(source)[1] < top_left(target)[1], (edge.get("data-from"), edge.get("data-to"))
        assert edge.get("d", "").startswith("M") and "C" in edge.get("d", "")
    # x + y feeds the cuda:0 delegate through copies: a path of edges input -> copy -> delegate.
    into = {(e.get("data-from"), e.get("data-to")) for e in edges}
    [cuda_delegate] = [d.id for d in record.delegates if d.target_device == "cuda:0"]
    copies_in = [s.name for s in op_steps(record, op_name(h2d_copy))]
    assert {("x", copies_in[0]), ("y", copies_in[1])} <= into
    assert {(copy, cuda_delegate) for copy in copies_in} <= into


def test_a_saved_program_draws_the_same_picture_as_the_one_in_memory(lowered_mixed, tmp_path):
    path = str(tmp_path / "mixed.pt2")
    lowered_mixed.save(path)

    assert program_svg(read_manifest(path).methods) == program_svg({"forward": record_of(lowered_mixed)})


def test_known_op_counts_label_the_delegates(lowered_mixed):
    record = record_of(lowered_mixed)
    first = record.delegates[0].id
    root = parsed(program_svg({"forward": record}, delegate_op_counts={first: 7}))

    counted = {g.get("data-delegate"): label(g)[2] for g in groups(root, "node", "delegate")}
    assert counted[first].startswith("7 ops")
    assert all(line.startswith("1 kind of op") for key, line in counted.items() if key != first)


def test_the_legend_names_each_engine_in_the_program_with_its_colour(lowered_mixed):
    svg = program_svg({"forward": record_of(lowered_mixed)})
    root = parsed(svg)

    legend = groups(root, "legend-item", "delegate")
    assert [g.get("data-engine") for g in legend] == ["test_add_on_device"]
    assert engine_fills(svg) == {"test_add_on_device": graph.engine_colour("test_add_on_device")}


def test_control_flow_branches_left_to_aten_are_one_box_each():
    program = aotstack.export(models.CondModel(), {"forward": (torch.randn(2, 8),)})
    record = record_of(aotstack.lower(program, [NodesOnDevice(None, "nothing")], jobs=1))
    root = parsed(program_svg({"forward": record}))

    branches = [s.name for s in record.plan.steps if isinstance(s, SubgraphStep)]
    assert len(branches) == 2
    assert sorted(g.get("data-step") for g in groups(root, "node", "subgraph")) == sorted(branches)
    [cond] = [g for g in groups(root, "node", "op") if g.get("data-op") == "higher_order.cond"]
    into_cond = {p.get("data-from") for p in root.iter(f"{SVG}path") if p.get("data-to") == cond.get("data-step")}
    assert set(branches) <= into_cond


# Synthetic plans ------------------------------------------------------------------------------------


def delegate_record(
    delegate_id: str, backend: str, device: str = "cpu", ops: list[str] | None = None
) -> DelegateRecord:
    spec = TensorSpec("float32", [4])
    return DelegateRecord(delegate_id, backend, device, [], ops or ["aten.add.Tensor"], [spec], [spec], "", {})


def method(steps: list[Step], outputs: list, delegates: list[DelegateRecord], **plan) -> MethodRecord:
    inputs = [InputRecord(s.name, "tensor", "float32", [4]) for s in steps if isinstance(s, InputStep)]
    return MethodRecord("", inputs, MethodPlan(steps, outputs, plan.get("mutations", [])), "", "", {}, delegates)


def test_text_is_escaped_and_characters_xml_cannot_hold_are_replaced():
    odd = "weird<&>\"engine's"
    steps = [
        InputStep("x"),
        DelegateStep("m<&>.0", ["x"], [(0, "out")]),
        OpStep("y", "aten.relu.default", [Ref("out")], {}),
    ]
    record = method(steps, [Ref("y"), None], [delegate_record("m<&>.0", odd, ops=["aten.<&>.x\x00"])])
    svg = program_svg({"m<&>\x01": record}, title="a <&> b")
    root = parsed(svg)

    assert "<&>" not in svg and "\x00" not in svg and "\x01" not in svg
    assert root.find(f"{SVG}title").text == "a <&> b"
    [box] = groups(root, "node", "delegate")
    assert box.get("data-delegate") == "m<&>.0" and box.get("data-engine") == odd
    assert label(box)[:2] == [odd, "m<&>.0"]
    assert "aten.<&>.x\ufffd" in tooltip(box)
    [section] = groups(root, "method")
    assert section.get("data-method") == "m<&>\ufffd"
    assert engine_fills(svg) == {odd: graph.engine_colour(odd)}


def test_unknown_engines_get_stable_distinct_colours_and_known_ones_their_own():
    assert graph.engine_colour("aoti_cpu") == graph.ENGINE_COLOURS["aoti_cpu"]
    assert graph.engine_colour("my_engine") == graph.engine_colour("my_engine")
    assert graph.engine_colour("my_engine") != graph.engine_colour("my_other_engine")
    assert re.fullmatch(r"#[0-9a-f]{6}", graph.engine_colour("my_engine"))


def test_buffer_updates_and_constant_outputs_are_outputs_too():
    steps = [InputStep("x"), OpStep("doubled", "aten.mul.Tensor", [Ref("x"), 2], {})]
    record = method(steps, [Ref("doubled"), 3], [], mutations=[("running", "doubled")])
    root = parsed(program_svg({"forward": record}))

    outputs = groups(root, "node", "output")
    assert [g.get("data-output") for g in outputs] == ["0", "1", None]
    assert outputs[2].get("data-update") == "running"
    assert "the constant 3" in tooltip(outputs[1])
    ends = {(p.get("data-from"), p.get("data-to")) for p in root.iter(f"{SVG}path") if p.get("class") == "edge"}
    assert ends == {("x", "doubled"), ("doubled", "output 0"), ("doubled", "update running")}


def test_an_empty_program_and_methods_with_nothing_to_join_still_draw():
    empty = method([], [], [])
    lone = method([InputStep("x")], [None], [])
    root = parsed(program_svg({"empty": empty, "lone": lone}))

    assert [g.get("data-method") for g in groups(root, "method")] == ["empty", "lone"]
    assert len(groups(root, "node")) == 2
    assert not [p for p in root.iter(f"{SVG}path") if p.get("class") in ("edge", "trunk")]
    parsed(program_svg({}))


def test_a_step_fed_only_by_weights_sits_just_above_its_reader_not_among_the_inputs():
    steps: list[Step] = [InputStep("x"), WeightStep("w", "w"), OpStep("t", "aten.t.default", [Ref("w")], {})]
    previous = "x"
    for index in range(5):
        steps.append(OpStep(f"r{index}", "aten.relu.default", [Ref(previous)], {}))
        previous = f"r{index}"
    steps.append(OpStep("mm", "aten.mm.default", [Ref(previous), Ref("t")], {}))
    root = parsed(program_svg({"forward": method(steps, [Ref("mm")], [])}))

    y = {node_key(g): top_left(g)[1] for g in groups(root, "node")}
    assert y["r3"] < y["t"] < y["mm"]
    assert y["t"] == y["r4"]


def test_copy_op_names_match_the_registered_ops():
    assert graph.H2D_COPY == op_name(h2d_copy) and graph.D2H_COPY == op_name(d2h_copy)


def random_method(ops: int, seed: int = 0) -> MethodRecord:
    """``ops`` steps reading mostly recent values, now and then one far back; every 25th a delegate, some copies."""
    rng = random.Random(seed)
    steps: list[Step] = [InputStep("x"), InputStep("mask"), WeightStep("w", "w")]
    values, delegates = ["x"], []
    for index in range(ops):
        reads = {rng.choice(values[-6:]) for _ in range(rng.randint(1, 3))}
        if rng.random() < 0.1:
            reads.add(rng.choice(values + ["mask"]))
        name = f"v{index}"
        if index % 25 == 24:
            delegate_id = f"forward.{len(delegates)}"
            delegates.append(delegate_record(delegate_id, ["aoti_cpu", "onnxruntime", "custom"][len(delegates) % 3]))
            steps.append(DelegateStep(delegate_id, sorted(reads), [(0, name)]))
        elif index % 40 == 39:
            steps.append(OpStep(name, graph.H2D_COPY, [Ref(rng.choice(values[-3:])), "cuda:0"], {}))
        else:
            target = rng.choice(["aten.add.Tensor", "aten.mul.Tensor", "aten.gelu.default", "aten.view.default"])
            steps.append(OpStep(name, target, [[Ref(read) for read in sorted(reads)], Ref("w")], {}))
        values.append(name)
    return method(steps, [Ref(values[-1]), Ref(values[len(values) // 2])], delegates)


def test_a_500_op_method_draws_without_overlaps_and_every_edge_runs_down():
    ops = 500
    record = random_method(ops)
    started = time.perf_counter()
    svg = program_svg({"forward": record})
    elapsed = time.perf_counter() - started
    print(f"\n{ops}-op method: drawn in {elapsed * 1e3:.0f} ms, {len(svg) / 1e3:.0f} kB of SVG")
    root = parsed(svg)

    boxes = groups(root, "node")
    # Every step but the weight is a box, plus the two outputs.
    assert len(boxes) == len(record.plan.steps) - 1 + 2
    assert len(groups(root, "node", "delegate")) == len(record.delegates) == ops // 25
    assert len(groups(root, "node", "copy")) == len(op_steps(record, graph.H2D_COPY)) > 0
    by_key = {node_key(g): g for g in boxes}
    for edge in (p for p in root.iter(f"{SVG}path") if p.get("class") == "edge"):
        assert top_left(by_key[edge.get("data-from")])[1] < top_left(by_key[edge.get("data-to")])[1]
    assert_no_overlaps(boxes)


def test_sweeps_untangle_two_chains_the_plan_lists_in_alternating_order():
    # In plan order the chains swap sides at every rank: 20 crossings before any sweep.
    steps: list[Step] = [InputStep("a"), InputStep("b")]
    left, right = "a", "b"
    for rung in range(20):
        pair = [
            OpStep(f"l{rung}", "aten.relu.default", [Ref(left)], {}),
            OpStep(f"r{rung}", "aten.gelu.default", [Ref(right)], {}),
        ]
        steps += pair[::-1] if rung % 2 == 0 else pair
        left, right = f"l{rung}", f"r{rung}"
    drawn = graph.method_graph(method(steps, [Ref(left), Ref(right)], []), {})
    ranks = graph.node_ranks(drawn)
    rank, hops, trunks = graph.slots_with_dummies(ranks, drawn.edges)
    above, below = graph.neighbours(len(rank), hops, trunks, len(drawn.nodes))
    order = graph.crossing_order(rank, trunks, above, below, set())
    position = [0.0] * len(rank)
    for row in order:
        for index, slot in enumerate(row):
            position[slot] = index

    assert graph.crossings(order, below, position) == 0


# Reading the picture back ---------------------------------------------------------------------------


def node_key(group: ET.Element) -> str:
    """What edges call a box by: the step, delegate or input name; ``output N``; ``update FQN``."""
    for attribute in ("data-delegate", "data-step", "data-input"):
        if group.get(attribute) is not None:
            return group.get(attribute)
    if group.get("data-output") is not None:
        return f"output {group.get('data-output')}"
    return f"update {group.get('data-update')}"


def top_left(group: ET.Element) -> tuple[float, float]:
    x, y = re.fullmatch(r"translate\(([-\d.]+),([-\d.]+)\)", group.get("transform")).groups()
    return float(x), float(y)


def assert_no_overlaps(boxes: list[ET.Element]) -> None:
    rows: dict[float, list[tuple[float, float]]] = {}
    for box in boxes:
        x, y = top_left(box)
        assert x >= 0 and y >= 0
        height = float(box.find(f"{SVG}rect").get("height"))
        rows.setdefault(y + height / 2, []).append((x, x + float(box.find(f"{SVG}rect").get("width"))))
    for spans in rows.values():
        spans.sort()
        for (_, right), (left, _) in zip(spans, spans[1:]):
            assert right < left, spans


def engine_fills(svg: str) -> dict[str, str]:
    """Engine -> the fill its rule in the style block gives its boxes (CSS escapes such as ``\\22 `` undone)."""
    style = parsed(svg).find(f"{SVG}style").text or ""
    rules = re.findall(r'\[data-engine="((?:[^"\\]|\\[0-9a-f]+ )*)"\]>rect\{fill:(#[0-9a-f]{6})\}', style)
    return {re.sub(r"\\([0-9a-f]+) ", lambda m: chr(int(m.group(1), 16)), engine): fill for engine, fill in rules}
