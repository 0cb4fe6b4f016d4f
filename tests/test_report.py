"""The partition report: what each engine took, why each op was left, sizes and compile times; and the dry run.

One stacked lowering is compiled for the whole file: ONNX Runtime first (linear and gelu only),
then AOTInductor with ``tanh`` excluded and ``min_block_size=2``, so ``layer_norm`` is an
island too small to claim.
"""

from __future__ import annotations

import json
from collections import Counter
from html.parser import HTMLParser

import pytest
import torch

import aotstack
from aotstack.format import archive
from aotstack.report.model import file_report
from aotstack.report.schema import REPORT_SCHEMA
from tests import models, tamper
from tests.schema_check import schema_errors
from tests.test_cli import aotstack_command


def stacked_partitioners() -> list[aotstack.Partitioner]:
    return [
        aotstack.OrtPartitioner(ops=["aten.linear", "aten.gelu"]),
        aotstack.AotiCpuPartitioner(exclude_ops=["aten.tanh"], min_block_size=2),
    ]


@pytest.fixture(scope="module")
def stacked(lowered_with):
    return lowered_with("stacked", "report: ort linear+gelu, aoti without tanh, min 2", stacked_partitioners)


def ops_by_engine(method) -> dict[str, Counter]:
    taken: dict[str, Counter] = {}
    for delegate in method.delegates:
        taken.setdefault(delegate.engine, Counter()).update(delegate.op_counts)
    return taken


def reasons(method) -> dict[str, list[tuple[str, str]]]:
    return {group.op: [(r.engine, r.kind) for r in group.reasons] for group in method.unclaimed}


def test_the_report_names_each_engines_ops_and_why_each_op_was_left(stacked):
    lowered, _ = stacked
    method = lowered.report().method("forward")

    taken = ops_by_engine(method)
    assert taken["onnxruntime"] == {"aten.linear.default": 2, "aten.gelu.default": 1}
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= set(taken["aoti_cpu"])
    assert not {"aten.tanh.default", "aten.layer_norm.default", "aten.linear.default"} & set(taken["aoti_cpu"])
    assert reasons(method) == {
        "aten.layer_norm.default": [("onnxruntime", "excluded"), ("aoti_cpu", "min_block_size")],
        "aten.tanh.default": [("onnxruntime", "excluded"), ("aoti_cpu", "excluded")],
    }
    shares = {share.engine: share.ops for share in method.engines}
    assert shares["aten"] == 2 and shares["onnxruntime"] == 3
    assert sum(shares.values()) == method.ops
    assert abs(sum(share.share for share in method.engines) - 1) < 1e-9
    for delegate in method.delegates:
        assert delegate.code_bytes > 0 and delegate.compile_state in ("compiled", "cached")
        assert delegate.compile_seconds is not None and delegate.compile_seconds >= 0
        assert delegate.inputs and delegate.outputs


def test_the_text_shows_each_delegate_and_each_reason(stacked):
    lowered, _ = stacked
    report = lowered.report()
    text = report.text(width=200)

    for delegate in report.method("forward").delegates:
        assert delegate.id in text
    assert "onnxruntime: excluded: the user's ops= list does not name it" in text
    assert "aoti_cpu: excluded: the user's exclude_ops names it" in text
    assert "aoti_cpu: below min_block_size: its part has 1 compute op, fewer than min_block_size=2" in text
    assert "plain ATen 2 (" in text


def test_a_saved_file_reports_what_the_lowered_program_did(stacked):
    lowered, path = stacked
    saved, unsaved = file_report(path).to_json(), lowered.report().to_json()

    assert saved["methods"] == unsaved["methods"]
    assert saved["sizes"]["saved"] and not unsaved["sizes"]["saved"]
    assert saved["sizes"]["total"] == path.stat().st_size
    assert sum(part["bytes"] for part in saved["sizes"]["parts"]) == path.stat().st_size
    assert saved["source"] == str(path)


def test_inspect_json_follows_the_schema_and_agrees_with_the_text(stacked):
    _, path = stacked
    as_json = aotstack_command("inspect", path, "--json")
    # Wide enough that no table cell wraps, so each reason reads as one line.
    as_text = aotstack_command("inspect", path, columns=400)
    assert as_json.returncode == 0 and as_text.returncode == 0, as_json.stderr + as_text.stderr

    data = json.loads(as_json.stdout)
    assert schema_errors(data, REPORT_SCHEMA) == []
    for method in data["methods"]:
        assert f"method {method['name']}(" in as_text.stdout
        assert f"{method['ops']} ops:" in as_text.stdout
        for delegate in method["delegates"]:
            row = next(line for line in as_text.stdout.splitlines() if f" {delegate['id']} " in line)
            assert delegate["engine"] in row and f" {delegate['ops']}: " in row
            for op, count in delegate["op_counts"].items():
                assert f"{op.removeprefix('aten.').removesuffix('.default')} ×{count}" in row
        for group in method["unclaimed"]:
            assert group["op"] in as_text.stdout
            for reason in group["reasons"]:
                assert reason["detail"] in as_text.stdout
    schema = aotstack_command("inspect", "--schema")
    assert json.loads(schema.stdout) == json.loads(json.dumps(REPORT_SCHEMA))


def test_the_schema_check_catches_a_report_that_breaks_it(stacked):
    lowered, _ = stacked
    data = lowered.report().to_json()
    del data["methods"][0]["delegates"][0]["engine"]
    data["methods"][0]["unclaimed"][0]["reasons"][0]["kind"] = "because"
    data["sizes"]["total"] = -1

    errors = schema_errors(data, REPORT_SCHEMA)
    assert any("lacks 'engine'" in error for error in errors)
    assert any("'because' is not one of" in error for error in errors)
    assert any("sizes.total: -1 is below 0" in error for error in errors)


class Tables(HTMLParser):
    """Counts tables and collects the text of an HTML fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tables += tag == "table"

    def handle_data(self, data) -> None:
        self.text.append(data)


def test_a_lowered_or_loaded_program_shows_as_html_in_a_notebook(stacked):
    lowered, path = stacked
    for shown in (lowered._repr_html_(), aotstack.load(path)._repr_html_()):
        page = Tables()
        page.feed(shown)
        text = " ".join(page.text)
        # delegates, left to plain ATen, sizes
        assert page.tables == 3
        for delegate in lowered.delegates("forward"):
            assert delegate.delegate_id in text
        assert "aten.tanh.default" in text and "min_block_size=2" in text


def test_a_file_written_before_placements_were_recorded_still_reports(stacked, tmp_path):
    _, path = stacked
    old = tamper.manifest_edited(path, tmp_path / "old.pt2", lambda m: m["methods"]["forward"].pop("placement"))
    report = file_report(old)

    method = report.method("forward")
    assert method.ops is None and method.unclaimed == [] and method.engines == []
    assert all(d.op_count is None and d.compile_state is None for d in method.delegates)
    assert "not recorded" in report.text(width=160)
    assert schema_errors(report.to_json(), REPORT_SCHEMA) == []


def test_a_damaged_placement_is_refused_naming_it(stacked, tmp_path):
    _, path = stacked

    def damage(manifest):
        manifest["methods"]["forward"]["placement"]["unclaimed"][0]["reasons"][0]["kind"] = "because"

    bad = tamper.manifest_edited(path, tmp_path / "bad.pt2", damage)
    with pytest.raises(aotstack.PackageError, match=r"method 'forward': placement: .*kind is 'because'"):
        archive.read_manifest(bad)


def test_explain_partitions_like_lower_without_compiling_or_exporting_anything(stacked, monkeypatch):
    lowered, _ = stacked

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run started a compiler or an export")

    import subprocess

    from torch._inductor.codecache import AotCodeCompiler

    monkeypatch.setattr(AotCodeCompiler, "compile", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(torch.onnx, "export", refuse)
    program = aotstack.export(models.build("stacked"), {"forward": models.example_inputs("stacked")})
    report = aotstack.explain(program, stacked_partitioners())

    assert report.planned
    planned, compiled = report.method("forward"), lowered.report().method("forward")
    assert ops_by_engine(planned) == ops_by_engine(compiled)
    assert reasons(planned) == reasons(compiled) and planned.engines == compiled.engines
    assert [d.weight_bytes for d in planned.delegates] == [d.weight_bytes for d in compiled.delegates]
    assert all(d.code_bytes is None and d.compile_state == "planned" for d in planned.delegates)
    assert "dry run" in report.text()
    assert schema_errors(report.to_json(), REPORT_SCHEMA) == []


def test_explain_on_the_command_line_takes_compiles_options(tmp_path):
    graph = tmp_path / "demo.svg"
    result = aotstack_command(
        "explain", "aotstack.demo:demo_model", "--ort-op", "aten.linear", "--exclude-op", "aten.gelu",
        "--min-block-size", "2", "--json", "--graph", graph,
    )
    assert result.returncode == 0, result.stderr

    data = json.loads(result.stdout)
    assert schema_errors(data, REPORT_SCHEMA) == [] and data["planned"]
    embed = next(method for method in data["methods"] if method["name"] == "embed")
    why = {group["op"]: [(r["engine"], r["kind"]) for r in group["reasons"]] for group in embed["unclaimed"]}
    assert why["aten.gelu.default"] == [("onnxruntime", "excluded"), ("aoti_cpu", "excluded")]
    assert ("aoti_cpu", "min_block_size") in why["aten.layer_norm.default"]
    assert graph.read_text().startswith("<svg") or "<svg" in graph.read_text()[:200]


def test_a_dry_run_cannot_be_saved(tmp_path):
    from aotstack.compile.lower import lowered_program, lowering_steps, planned_outcomes

    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")})
    steps = lowering_steps(
        program,
        [aotstack.AotiCpuPartitioner()],
        skip_h2d_for_method_inputs=False,
        skip_d2h_for_method_outputs=False,
        planned=True,
    )
    lowered = lowered_program(steps, planned_outcomes)
    with pytest.raises(aotstack.LoweringError, match="dry run"):
        lowered.save(tmp_path / "x.pt2")
    assert not (tmp_path / "x.pt2").exists()


def test_a_part_that_failed_to_compile_and_a_partitioner_without_reasons_are_reported():
    from tests.test_compile_errors import OpPartitioner, add_relu_program

    program, _ = add_relu_program()
    lowered = aotstack.lower(
        program, [OpPartitioner(relu="test_failing", add="test_working_add")], on_compile_error="fallback", jobs=1
    )
    method = lowered.report().method("forward")

    why = {group.op: [(r.engine, r.kind) for r in group.reasons] for group in method.unclaimed}
    assert why["aten.relu.default"] == [("test_failing", "compile_failed")]
    assert why["aten.mul.Tensor"] == [("test_failing, test_working_add", "not_claimed")]
    failed = [group for group in method.unclaimed if group.op == "aten.relu.default"]
    assert sorted(node for group in failed for node in group.nodes) == ["relu", "relu_1"]
    assert all("boom: this backend cannot compile anything" in group.reasons[0].detail for group in failed)
    assert ops_by_engine(method) == {"test_working_add": {"aten.add.Tensor": 2}}


def test_draw_and_inspect_graph_draw_a_box_per_delegate(stacked, tmp_path):
    from xml.etree import ElementTree

    lowered, path = stacked
    lowered.draw(tmp_path / "lowered.svg")
    assert aotstack_command("inspect", path, "--graph", tmp_path / "saved.svg").returncode == 0

    for picture in ("lowered.svg", "saved.svg"):
        root = ElementTree.parse(tmp_path / picture).getroot()
        groups = root.iter("{http://www.w3.org/2000/svg}g")
        boxes = [g for g in groups if {"node", "delegate"} <= set(g.get("class", "").split())]
        assert sorted(g.get("data-delegate") for g in boxes) == [d.delegate_id for d in lowered.delegates("forward")]
        assert {g.get("data-engine") for g in boxes} == {"onnxruntime", "aoti_cpu"}


# A custom op with a CUDA kernel only: no CPU engine takes it, so it is left to the plan.
@torch.library.custom_op("aotstack_test::twice_on_cuda", mutates_args=(), device_types="cuda")
def twice_on_cuda(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice_on_cuda.register_fake
def _(x):
    return torch.empty_like(x)


class CustomOpModel(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(twice_on_cuda(torch.sin(x))) + 1


def test_the_dry_run_says_a_custom_op_left_to_the_plan_needs_allow_ops():
    program = aotstack.export(CustomOpModel(), {"forward": (torch.randn(3),)})
    report = aotstack.explain(program, [aotstack.AotiCpuPartitioner()])

    assert reasons(report.method("forward")) == {
        "aotstack_test.twice_on_cuda.default": [("aoti_cpu", "unsupported"), ("aotstack", "needs_allow_ops")]
    }
    text = report.text(width=300)
    assert "no kernel for cpu" in text
    assert "allow_ops=['aotstack_test.twice_on_cuda']" in text


def test_an_op_needing_a_kernel_the_runtime_lacks_is_reported_with_the_kernel():
    only_addmm = [aotstack.CompileSpec("fallback_kernels", b"aten.addmm")]
    program = aotstack.export(models.build("median"), {"forward": models.example_inputs("median")})
    report = aotstack.explain(program, [aotstack.AotiCpuPartitioner(compile_specs=only_addmm)])

    method = report.method("forward")
    assert reasons(method) == {"aten.median.default": [("aoti_cpu", "missing_kernels")]}
    detail = method.unclaimed[0].reasons[0].detail
    assert "aten.median" in detail and "lacks" in detail
