"""Engines mixed per region: which regions the measured plans propose, and the mixed plan lowered, run and timed."""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack.compile import lower as lower_module
from aotstack.compile.mixing import MARGIN, KeptRegion, MeasuredPlan, Mix, Region, RegionPartitioner, mixed_cover
from aotstack.engine.registry import BUILT_IN

WORK = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}


def region(engine: str, names: str, milliseconds: float) -> Region:
    return Region(engine, {name: WORK[name] for name in names}, milliseconds / 1e3)


ALONE = MeasuredPlan(("aoti_cpu",), [region("aoti_cpu", "abcd", 4.0)])


def test_each_engines_region_that_beats_every_other_plan_is_kept_and_the_rest_left_to_the_closing_engine():
    fast_front = MeasuredPlan(("xnnpack", "aoti_cpu"), [region("xnnpack", "ab", 0.5), region("aoti_cpu", "cd", 2.0)])
    fast_back = MeasuredPlan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.6), region("aoti_cpu", "ab", 2.0)])

    mix = mixed_cover([ALONE, fast_front, fast_back], "aoti_cpu")

    assert mix is not None
    assert mix.labels == ["xnnpack (1 region)", "openvino (1 region)", "aoti_cpu"]
    assert mix.regions("xnnpack") == [frozenset("ab")] and mix.regions("openvino") == [frozenset("cd")]
    assert "xnnpack on 2 nodes: 0.5 ms, 2 ms in aoti_cpu" in mix.explanation()


def test_a_region_within_the_margin_of_another_plans_estimate_is_not_kept():
    close = MeasuredPlan(("xnnpack", "aoti_cpu"), [region("xnnpack", "ab", 2.0 * (1 - MARGIN / 2)),
                                                   region("aoti_cpu", "cd", 2.0)])
    fast_back = MeasuredPlan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.6), region("aoti_cpu", "ab", 2.0)])

    assert mixed_cover([ALONE, close, fast_back], "aoti_cpu") is None, "openvino's own plan is no mix"


def test_of_two_overlapping_regions_the_one_saving_more_is_kept():
    wide = MeasuredPlan(("xnnpack", "aoti_cpu"), [region("xnnpack", "abc", 0.3), region("aoti_cpu", "d", 1.0)])
    narrow = MeasuredPlan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.5), region("aoti_cpu", "ab", 2.0)])
    last = MeasuredPlan(("onnxruntime", "aoti_cpu"), [region("onnxruntime", "d", 0.05), region("aoti_cpu", "abc", 3.0)])

    mix = mixed_cover([ALONE, wide, narrow, last], "aoti_cpu")

    # openvino's region beats every estimate for c and d too, but shares c with xnnpack's, which saves more.
    assert mix is not None
    kept = [(kept.region.engine, kept.region.names) for kept in mix.kept]
    assert kept == [("xnnpack", frozenset("abc")), ("onnxruntime", frozenset("d"))]


def test_a_region_estimate_shares_a_delegates_time_by_the_work_of_its_nodes():
    plan = MeasuredPlan(("aoti_cpu",), [Region("aoti_cpu", {"mm": 9.0, "add": 1.0}, 1.0)])

    assert plan.estimate({"mm": 9.0}) == pytest.approx(0.9)
    assert plan.estimate({"add": 1.0, "absent": 5.0}) == pytest.approx(0.1)


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.nn.functional.gelu(self.first(x)))


def ort_installed() -> bool:
    return BUILT_IN["onnxruntime"].installed()


@pytest.mark.skipif(not ort_installed(), reason="onnxruntime is not installed")
def test_a_region_partitioner_keeps_only_its_regions_and_the_next_engine_takes_the_rest(tmp_path):
    model, x = Chain().eval(), torch.randn(4, 16)
    program = aotstack.export(model, {"forward": (x,)})
    ort = aotstack.OrtPartitioner(ops=["aten.linear"])

    lowered = aotstack.lower(
        program, [RegionPartitioner(ort, "onnxruntime", [frozenset({"linear"})]), aotstack.AotiCpuPartitioner()]
    )

    by_engine = {d.backend_id: d for d in lowered.delegates("forward")}
    assert set(by_engine) == {"onnxruntime", "aoti_cpu"}
    assert set(by_engine["onnxruntime"].nodes) == {"linear"}
    assert {"gelu", "linear_1"} <= set(by_engine["aoti_cpu"].nodes)
    lowered.save(tmp_path / "mixed.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "mixed.pt2").forward(x), model(x).detach())


@pytest.mark.skipif(not ort_installed(), reason="onnxruntime is not installed")
def test_auto_measures_the_mix_its_plans_propose_names_it_and_reads_it_back_from_the_cache(monkeypatch, tmp_path):
    """The proposal is pinned (ONNX Runtime's region of its own plan), so the rest of the path runs for real."""
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    proposals = []

    def ort_region(plans, closing):
        ort = next(plan for plan in plans if plan.engines[0] == "onnxruntime")
        [taken] = [r for r in ort.regions if r.engine == "onnxruntime"]
        proposals.append([plan.engines for plan in plans])
        return Mix([KeptRegion(taken, taken.seconds * 2, ("aoti_cpu",))], closing)

    monkeypatch.setattr(lower_module, "mixed_cover", ort_region)
    model, x = Chain().eval(), torch.randn(4, 16)
    program = aotstack.export(model, {"forward": (x,)})
    auto = aotstack.Auto(engines=["aoti_cpu", "onnxruntime"])

    lowered = aotstack.lower(program, auto, progress=False)

    chosen = lowered.placements["forward"].selection
    labels = [candidate.engines for candidate in chosen.candidates]
    assert labels == [["aoti_cpu"], ["onnxruntime", "aoti_cpu"], ["onnxruntime (1 region)", "aoti_cpu"]]
    assert chosen.candidates[2].seconds is not None and set(chosen.candidates[2].engine_seconds) == {"onnxruntime"}
    assert "regions kept: onnxruntime on 3 nodes" in chosen.reason
    assert proposals == [[("aoti_cpu",), ("onnxruntime", "aoti_cpu")]]
    lowered.save(tmp_path / "auto.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "auto.pt2").forward(x), model(x).detach())

    # Warm: every plan, the mix included, is read from the cache; nothing is timed again.
    monkeypatch.setattr(lower_module, "measured_methods", lambda *args: pytest.fail("measured again"))
    again = aotstack.lower(program, auto, progress=False).placements["forward"].selection
    assert [c.engines for c in again.candidates] == labels
    assert [c.seconds for c in again.candidates] == [c.seconds for c in chosen.candidates]
