"""Custom ops (``torch.library`` ops outside ATen): AOTInductor claims them as plain AOTInductor does,
a plan runs one only where the loader allows it, and a load refuses what this process cannot run.

The ops live in ``tests/custom_ops_lib.py``; importing it is what registers them, in this process
and in the children that load the files.
"""

from __future__ import annotations

import json

import pytest
import torch

import aotstack
from aotstack.backends.aoti.experts import (
    MOST_UNROLLED_EXPERTS,
    RANGES_COMPILE,
    experts_per_turn,
    with_compiled_experts,
)
from aotstack.cli import main
from aotstack.format.archive import MANIFEST_PATH
from aotstack.report.schema import REPORT_SCHEMA
from tests import custom_ops_lib, models, tamper
from tests.conftest import run_child
from tests.schema_check import schema_errors

OPS = ("aotstack_custom.scale_rows", "aotstack_custom.accumulate")
FULL_NAMES = [f"{name}.default" for name in sorted(OPS)]


def eager_calls(times: int = 2) -> list[torch.Tensor]:
    """The model's answers to ``times`` calls: the running total carries from one call to the next."""
    model = models.build("custom_ops")
    inputs = models.example_inputs("custom_ops")
    return [model(*inputs) for _ in range(times)]


@pytest.fixture(scope="module")
def in_library(lowered_package):
    """AOTInductor alone: both ops inside its library, called through the proxy executor."""
    return lowered_package("custom_ops")


@pytest.fixture(scope="module")
def in_plan(lowered_package):
    """AOTInductor told to leave both ops: they are steps of the run plan."""
    return lowered_package("custom_ops", exclude_ops=OPS)


def test_aoti_claims_the_custom_ops_and_the_manifest_lists_them(in_library):
    lowered, path = in_library
    [delegate] = lowered.delegates("forward")
    assert delegate.backend_id == "aoti_cpu"
    assert set(FULL_NAMES) <= set(delegate.ops)
    records = {record.name: record for record in aotstack.file_report(path).custom_ops}
    assert sorted(records) == FULL_NAMES
    for record in records.values():
        assert record.used_by == [delegate.delegate_id]
        assert record.devices == ["cpu"]
        assert record.module == "tests.custom_ops_lib"
    assert records["aotstack_custom.scale_rows.default"].schema == str(
        torch.ops.aotstack_custom.scale_rows.default._schema
    )


LOAD_AND_CALL = """
import json, sys
import torch
import aotstack
from aotstack.backends.aoti import run as aoti_run
if sys.argv[2] == "import":
    from tests import models
path = sys.argv[1]
allow = json.loads(sys.argv[3])
try:
    loaded = aotstack.load(path, allow_ops=allow)
except aotstack.AotstackError as exc:
    print(json.dumps({"error": type(exc).__name__ + ": " + str(exc), "libraries": len(aoti_run._LIBRARY_PATHS)}))
    raise SystemExit
inputs = models.example_inputs("custom_ops")
print(json.dumps({"outputs": [loaded.forward(*inputs).tolist() for _ in range(2)]}))
"""


def load_in_child(path, *, imports: bool = True, allow: tuple[str, ...] = ()) -> dict:
    return run_child(LOAD_AND_CALL, str(path), "import" if imports else "no import", json.dumps(list(allow)))


def test_a_fresh_process_that_imports_the_ops_runs_the_library_as_eager_does(in_library):
    result = load_in_child(in_library[1])
    for got, want in zip(result["outputs"], eager_calls(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want)


def test_a_process_without_the_ops_is_refused_by_name_before_any_library_opens(in_library):
    result = load_in_child(in_library[1], imports=False)
    assert result["error"].startswith("CustomOpError: import tests.custom_ops_lib before loading")
    assert "aotstack_custom::accumulate, aotstack_custom::scale_rows" in result["error"]
    assert result["libraries"] == 0


def test_an_op_no_engine_claims_runs_in_the_plan_only_where_the_loader_allows_it(in_plan):
    lowered, path = in_plan
    assert all(not set(FULL_NAMES) & set(d.ops) for d in lowered.delegates("forward"))
    plan_ops = [step["target"] for step in tamper.op_steps(json.loads(tamper.entries(path)[MANIFEST_PATH]))]
    assert "aotstack_custom.scale_rows.default" in plan_ops
    # The op writing into the running total is called on copies, through auto_functionalized.
    assert "higher_order.auto_functionalized_v2" in plan_ops

    with pytest.raises(aotstack.CustomOpError, match=r"allow_ops=\['aotstack_custom.accumulate'") as refused:
        aotstack.load(path, allow_ops=["aotstack_custom.scale_rows"])
    assert refused.value.not_allowed == ["aotstack_custom.accumulate.default"]
    with pytest.raises(aotstack.CustomOpError, match="outside any engine"):
        aotstack.load(path)

    result = load_in_child(path, allow=("aotstack_custom::scale_rows", "aotstack_custom.accumulate.default"))
    for got, want in zip(result["outputs"], eager_calls(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want)


def test_allow_ops_takes_op_names_or_op_objects_only():
    with pytest.raises(TypeError, match="write \\['mylib.op'\\]"):
        aotstack.load("unused.pt2", allow_ops="mylib.op")
    with pytest.raises(ValueError, match="op names like 'mylib.op'"):
        aotstack.load("unused.pt2", allow_ops=["os.system; rm"])


OTHER_SCHEMA = """
import json, sys
import torch
import aotstack

@torch.library.custom_op("aotstack_custom::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, scale: torch.Tensor, power: int) -> torch.Tensor:
    return x * scale[:, None] ** power

@torch.library.custom_op("aotstack_custom::accumulate", mutates_args=("total",))
def accumulate(total: torch.Tensor, x: torch.Tensor) -> None:
    total.add_(x)

try:
    aotstack.load(sys.argv[1])
    print(json.dumps("loaded"))
except aotstack.CustomOpError as exc:
    print(json.dumps(str(exc)))
"""


def test_an_op_registered_with_another_schema_is_refused(in_library):
    message = run_child(OTHER_SCHEMA, str(in_library[1]))
    assert "aotstack_custom::scale_rows is registered as" in message
    assert "power" in message and "compiled against" in message
    assert "accumulate" not in message


def test_the_report_shows_the_custom_ops_and_where_each_runs(in_library, in_plan):
    library_report, plan_report = aotstack.file_report(in_library[1]), aotstack.file_report(in_plan[1])
    for report in (library_report, plan_report):
        assert not schema_errors(report.to_json(), REPORT_SCHEMA)
        assert "registered by" in report.text(width=200)
        assert "tests.custom_ops_lib" in report._repr_html_()
    assert "delegate forward.0" in library_report.text(width=200)
    assert "allow_ops=['aotstack_custom.accumulate']" in plan_report.text(width=200)
    assert [r["used_by"] for r in plan_report.to_json()["custom_ops"]] == [["plan"], ["plan"]]


def test_an_edited_op_list_is_refused_like_any_manifest_edit(in_library, in_plan, tmp_path):
    def drop_one(manifest):
        manifest["custom_ops"].pop()

    def rename_module(manifest):
        manifest["custom_ops"][0]["module"] = "os; rm -rf /"

    def change_schema(manifest):
        manifest["custom_ops"][0]["schema"] = "aotstack_custom::accumulate(Tensor(a!) total) -> ()"

    library, plan = in_library[1], in_plan[1]
    with pytest.raises(aotstack.PackageError, match="does not match its seal"):
        aotstack.load(tamper.manifest_edited(library, tmp_path / "unsealed.pt2", drop_one, reseal=False))
    with pytest.raises(aotstack.PackageError, match="calls custom op 'aotstack_custom.scale_rows.default'.*omits"):
        aotstack.load(tamper.manifest_edited(library, tmp_path / "dropped.pt2", drop_one))
    with pytest.raises(aotstack.PackageError, match="its plan calls custom op .* omits"):
        aotstack.load(tamper.manifest_edited(plan, tmp_path / "plan.pt2", drop_one), allow_ops=OPS)
    with pytest.raises(aotstack.PackageError, match="is not a dotted module name"):
        aotstack.load(tamper.manifest_edited(library, tmp_path / "module.pt2", rename_module))
    with pytest.raises(aotstack.CustomOpError, match="compiled against"):
        aotstack.load(tamper.manifest_edited(library, tmp_path / "schema.pt2", change_schema))


def test_a_signed_file_with_an_edited_op_list_is_refused(in_library, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    assert main(["keygen", str(keys / "release")]) == 0
    path = tmp_path / "signed.pt2"
    path.write_bytes(in_library[1].read_bytes())
    aotstack.sign(path, keys / "release")

    def allow_more(manifest):
        manifest["custom_ops"][0]["used_by"].append("plan")

    edited = tamper.manifest_edited(path, tmp_path / "edited.pt2", allow_more)
    with pytest.raises(aotstack.SignatureError, match="does not verify"):
        aotstack.load(edited, public_key=keys / "release.pub")
    assert aotstack.load(path, public_key=keys / "release.pub").forward(*models.example_inputs("custom_ops")).shape


def test_a_step_naming_an_unlisted_custom_op_is_refused(in_plan, tmp_path):
    def call_it(manifest):
        tamper.op_steps(manifest)[0]["target"] = "os.system.default"

    path = tamper.manifest_edited(in_plan[1], tmp_path / "t.pt2", call_it)
    with pytest.raises(aotstack.PackageError, match="custom op 'os.system.default', which the manifest omits"):
        aotstack.load(path, allow_ops=["os.system"])


def test_the_ops_module_registers_what_the_model_calls():
    # Guards the fixture: the model must reach both ops, or the tests above prove nothing.
    program = aotstack.export(models.build("custom_ops"), {"forward": models.example_inputs("custom_ops")})
    called = {str(node.target) for node in program.methods["forward"].graph.nodes}
    assert "aotstack_custom.scale_rows.default" in called
    assert any("auto_functionalized" in name for name in called)
    assert custom_ops_lib.CustomOpModel is type(models.build("custom_ops"))


def test_the_cli_runs_a_plan_custom_op_only_with_allow_op(in_plan, capsys):
    path = str(in_plan[1])
    assert main(["run", path, "--calls", "1"]) == 1
    assert "allow_ops=" in capsys.readouterr().err
    allowed = ["--allow-op", "aotstack_custom.scale_rows", "--allow-op", "aotstack_custom::accumulate"]
    assert main(["run", path, "--calls", "1", "--import", "tests.custom_ops_lib", *allowed]) == 0
    assert "forward(" in capsys.readouterr().out
    assert main(["run", path, "--import", "no_such_module_here", *allowed]) == 1
    assert "--import no_such_module_here" in capsys.readouterr().err


class ExpertsMatmul(torch.nn.Module):
    """transformers' grouped expert matmul on its own: rows sorted by expert, cumulative counts."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, 8, 6, generator=torch.Generator().manual_seed(5)))

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(rows, self.weight, offs=offsets)


def test_expert_matmuls_compile_into_the_library_and_the_file_needs_no_custom_op(tmp_path):
    """Few static rows become one batched matmul; a prompt's rows, one matmul per expert over its range. Either way
    the CPU library calls no custom op, so loading needs no import of transformers. Off the host a prompt keeps the
    op."""
    from transformers.integrations import moe  # noqa: F401  (registers the op)

    model = ExpertsMatmul().eval()
    rows = torch.export.Dim("rows", min=2, max=64)
    cases = {
        "decode": ((torch.randn(3, 8), torch.tensor([1, 1, 3, 3])), None),  # rows <= experts, one expert empty
        "prompt": ((torch.randn(9, 8), torch.tensor([2, 5, 5, 8])), None),  # the last row belongs to no expert
        "dynamic": ((torch.randn(9, 8), torch.tensor([2, 5, 5, 9])), ({0: rows}, None)),
    }
    others = {  # the dynamic file, called at other lengths and groupings
        "dynamic": [
            (torch.randn(2, 8), torch.tensor([0, 0, 2, 2])),
            (torch.randn(40, 8), torch.tensor([10, 10, 25, 39])),
        ]
    }
    for name, (inputs, shapes) in cases.items():
        program = aotstack.export(model, {"forward": inputs}, dynamic_shapes={"forward": shapes}).methods["forward"]
        targets = {str(node.target) for node in with_compiled_experts(program, on_host=True).graph.nodes}
        assert ("transformers.grouped_mm_fallback.default" in targets) == (name != "decode" and not RANGES_COMPILE)
        assert ("aten.bmm.default" in targets) == (name == "decode"), name
        on_gpu = {str(node.target) for node in with_compiled_experts(program, on_host=False).graph.nodes}
        assert ("transformers.grouped_mm_fallback.default" in on_gpu) == (name != "decode"), name  # one wait, not many
        lowered = aotstack.lower(aotstack.Program({"forward": program}), [aotstack.AotiCpuPartitioner()])
        lowered.save(tmp_path / f"{name}.pt2")
        if RANGES_COMPILE:
            assert aotstack.file_report(tmp_path / f"{name}.pt2").custom_ops == [], name
        loaded = aotstack.load(tmp_path / f"{name}.pt2")
        with torch.no_grad():
            for call in [inputs, *others.get(name, [])]:
                torch.testing.assert_close(loaded.forward(*call), model(*call))


def sorted_rows(experts: int, count: int, seed: int, unassigned: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` rows of 8 sorted by a random expert, the last ``unassigned`` of them of no expert; and the
    cumulative counts transformers' op takes."""
    generator = torch.Generator().manual_seed(seed)
    expert = torch.sort(torch.randint(0, experts, (count - unassigned,), generator=generator)).values
    expert = torch.cat([expert, torch.full((unassigned,), experts)])
    return torch.randn(count, 8, generator=generator), torch.searchsorted(expert, torch.arange(experts), right=True)


@pytest.mark.skipif(not RANGES_COMPILE, reason="torch 2.11's Inductor keeps a prompt's grouped matmul as the op")
def test_a_prompts_matmuls_over_many_experts_run_a_block_of_experts_a_turn_of_a_loop(tmp_path):
    """Past ``MOST_UNROLLED_EXPERTS`` a prompt's expert matmuls are not written out one by one (a tiny MiniMax-M2's 256
    experts took over 10 minutes to compile): the library loops over blocks of experts, and matches the op at every
    length, with empty experts and rows of no expert."""
    from transformers.integrations import moe  # noqa: F401  (registers the op)

    assert [experts_per_turn(experts) for experts in (256, 60, 40, 37)] == [8, 6, 8, 1]
    experts = MOST_UNROLLED_EXPERTS + 8
    model = ExpertsMatmul(experts).eval()
    example = sorted_rows(experts, 50, seed=0)
    dynamic = {"forward": ({0: torch.export.Dim("rows", min=2, max=256)}, None)}
    program = aotstack.export(model, {"forward": example}, dynamic_shapes=dynamic).methods["forward"]
    targets = [str(node.target) for node in with_compiled_experts(program, on_host=True).graph.nodes]
    assert "while_loop" in targets and "aten.mm.default" not in targets  # the matmuls are in the loop's body
    lowered = aotstack.lower(aotstack.Program({"forward": program}), [aotstack.AotiCpuPartitioner()])
    lowered.save(tmp_path / "experts.pt2")
    assert aotstack.file_report(tmp_path / "experts.pt2").custom_ops == []
    loaded = aotstack.load(tmp_path / "experts.pt2")
    with torch.no_grad():
        for count, seed, unassigned in [(50, 0, 0), (2, 1, 0), (3, 2, 1), (200, 3, 7)]:
            call = sorted_rows(experts, count, seed, unassigned)
            torch.testing.assert_close(loaded.forward(*call), model(*call))
