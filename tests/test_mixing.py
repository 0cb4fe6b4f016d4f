"""Engines mixed per region: which regions the measured plans propose, and the mixed plan lowered, run and timed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.compile import auto as auto_module
from aotstack.compile import lower as lower_module
from aotstack.compile.auto import ONE_THREAD_CONTENDING, one_thread_base
from aotstack.compile.mixing import MARGIN, KeptRegion, MeasuredPlan, Mix, Region, RegionPartitioner, mixed_cover
from aotstack.engine.registry import BUILT_IN
from aotstack.format.placement import Candidate
from aotstack.format.specs import compile_spec_value
from tests import models

WORK = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}


def region(engine: str, names: str, milliseconds: float) -> Region:
    return Region(engine, {name: WORK[name] for name in names}, milliseconds / 1e3)


def measured_plan(engines: tuple[str, ...], regions: list[Region], between_ms: float = 0.0) -> MeasuredPlan:
    """A plan whose call took its regions' seconds, and ``between_ms`` between them."""
    return MeasuredPlan(engines, regions, sum(r.seconds for r in regions) + between_ms / 1e3)


ALONE = measured_plan(("aoti_cpu",), [region("aoti_cpu", "abcd", 4.0)])


def test_each_engines_region_that_beats_every_other_plan_is_kept_and_the_rest_left_to_the_closing_engine():
    fast_front = measured_plan(("xnnpack", "aoti_cpu"), [region("xnnpack", "ab", 0.5), region("aoti_cpu", "cd", 2.0)])
    fast_back = measured_plan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.6), region("aoti_cpu", "ab", 2.0)])

    mix = mixed_cover([ALONE, fast_front, fast_back], "aoti_cpu")

    assert mix is not None
    assert mix.labels == ["xnnpack (1 region)", "openvino (1 region)", "aoti_cpu"]
    assert mix.regions("xnnpack") == [frozenset("ab")] and mix.regions("openvino") == [frozenset("cd")]
    assert "xnnpack on 2 nodes: 0.5 ms, 2 ms in aoti_cpu" in mix.explanation()


def test_a_region_within_the_margin_of_another_plans_estimate_is_not_kept():
    close = measured_plan(("xnnpack", "aoti_cpu"), [region("xnnpack", "ab", 2.0 * (1 - MARGIN / 2)),
                                                   region("aoti_cpu", "cd", 2.0)])
    fast_back = measured_plan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.6), region("aoti_cpu", "ab", 2.0)])

    assert mixed_cover([ALONE, close, fast_back], "aoti_cpu") is None, "openvino's own plan is no mix"


def test_of_two_overlapping_regions_the_one_saving_more_is_kept():
    wide = measured_plan(("xnnpack", "aoti_cpu"), [region("xnnpack", "abc", 0.3), region("aoti_cpu", "d", 1.0)])
    narrow = measured_plan(("openvino", "aoti_cpu"), [region("openvino", "cd", 0.5), region("aoti_cpu", "ab", 2.0)])
    last = measured_plan(("onnxruntime", "aoti_cpu"),
                         [region("onnxruntime", "d", 0.05), region("aoti_cpu", "abc", 3.0)])

    mix = mixed_cover([ALONE, wide, narrow, last], "aoti_cpu")

    # openvino's region beats every estimate for c and d too, but shares c with xnnpack's, which saves more.
    assert mix is not None
    kept = [(kept.region.engine, kept.region.names) for kept in mix.kept]
    assert kept == [("xnnpack", frozenset("abc")), ("onnxruntime", frozenset("d"))]


def test_a_mix_whose_estimate_does_not_beat_the_fastest_plan_is_proposed_but_not_worth_measuring():
    # BERT at one thread: XNNPACK's regions beat OpenVINO's share for their nodes, but the mix leaves the rest to
    # AOTInductor, which spends far more on it than OpenVINO's plan, the fastest, on the whole call.
    xnnpack = measured_plan(("xnnpack", "aoti_cpu"),
                            [region("xnnpack", "ab", 0.8), region("xnnpack", "c", 0.6), region("aoti_cpu", "d", 0.8)])
    openvino = measured_plan(("openvino", "aoti_cpu"), [region("openvino", "abcd", 2.0)], between_ms=0.1)

    mix = mixed_cover([measured_plan(("aoti_cpu",), [region("aoti_cpu", "abcd", 4.0)], 0.3), xnnpack, openvino],
                      "aoti_cpu")

    assert mix is not None and mix.regions("xnnpack") == [frozenset("ab")]
    # xnnpack's 0.8 ms, AOTInductor alone's 2 ms for c and d, and its 0.3 ms between delegates.
    assert mix.estimate == pytest.approx(3.1e-3) and mix.fastest == pytest.approx(2.1e-3)
    assert not mix.worth_measuring
    assert "estimated at 3.1 ms a call against 2.1 ms for the fastest plan), no faster" in mix.refusal()

    # Where AOTInductor alone is faster on c and d than XNNPACK's plan, the mix would beat OpenVINO's: it is measured.
    faster = mixed_cover([measured_plan(("aoti_cpu",), [region("aoti_cpu", "abcd", 2.4)]), xnnpack, openvino],
                         "aoti_cpu")
    assert faster is not None and faster.estimate == pytest.approx(2.0e-3) and faster.worth_measuring
    assert "estimated at 2 ms a call against 2.1 ms for the fastest plan" in faster.explanation()


def measured(plans: dict[tuple[str, ...], tuple[float, list[Region]]]) -> dict:
    """Plans as auto lists them for one method: each with its candidate, delegates' seconds and regions."""
    return {plan: (Candidate(list(plan), seconds, {}), {}, regions) for plan, (seconds, regions) in plans.items()}


BETWEEN = [region("xnnpack", "ab", 1.0), region("aoti_cpu", "cd", 1.0)]
WHOLE = [region("openvino", "abcd", 1.0)]


def test_the_fastest_plan_running_aotis_parts_between_another_engines_is_timed_on_one_thread_too():
    listed = measured({("aoti_cpu",): (2.0, [region("aoti_cpu", "abcd", 2.0)]),
                       ("openvino", "aoti_cpu"): (1.9, WHOLE),
                       ("onnxruntime", "aoti_cpu"): (2.4, [region("onnxruntime", "ab", 1.0),
                                                           region("aoti_cpu", "cd", 1.4)]),
                       ("xnnpack", "aoti_cpu"): (2.1, BETWEEN)})

    assert one_thread_base(listed, "aoti_cpu", 2, "cpu") == ("xnnpack", "aoti_cpu")
    assert one_thread_base(listed, "aoti_cpu", 1, "cpu") is None, "at one thread it is the same plan"
    assert one_thread_base(listed, "aoti_cuda", 2, "cuda") is None, "the threads spec is AOTInductor's on the CPU"


def test_no_plan_is_timed_on_one_thread_where_none_runs_aotis_parts_between_another_engines_or_it_is_far_slower():
    whole = measured({("aoti_cpu",): (2.0, [region("aoti_cpu", "abcd", 2.0)]), ("openvino", "aoti_cpu"): (1.0, WHOLE)})
    slow = measured({("aoti_cpu",): (1.0, [region("aoti_cpu", "abcd", 1.0)]),
                     ("xnnpack", "aoti_cpu"): (1.0 * ONE_THREAD_CONTENDING * 1.01, BETWEEN)})
    failed = {("xnnpack", "aoti_cpu"): (Candidate(["xnnpack", "aoti_cpu"], None, {}, "broken"), {}, BETWEEN)}

    assert one_thread_base(whole, "aoti_cpu", 2, "cpu") is None
    assert one_thread_base(slow, "aoti_cpu", 2, "cpu") is None
    assert one_thread_base(failed, "aoti_cpu", 2, "cpu") is None


def test_a_stacked_plan_slowed_by_aotis_spinning_threads_is_timed_on_one_thread_by_what_its_opening_engine_took():
    # ONNX Runtime's parts took 1.2 ms alone, but 5 ms between AOTInductor's, whose threads spin on its cores.
    listed = measured({("aoti_cpu",): (2.0, [region("aoti_cpu", "abcd", 2.0)]),
                       ("openvino", "aoti_cpu"): (1.0, WHOLE),
                       ("onnxruntime", "aoti_cpu"): (5.0, [region("onnxruntime", "ab", 4.0),
                                                           region("aoti_cpu", "cd", 1.0)])})
    alone = Candidate(["onnxruntime"], 1.5, {"onnxruntime": 1.2})
    opened = {("onnxruntime", "aoti_cpu"): (alone, {}, [])}

    assert one_thread_base(listed, "aoti_cpu", 2, "cpu") is None, "its whole timing alone is 5x the fastest"
    assert one_thread_base(listed, "aoti_cpu", 2, "cpu", opened) == ("onnxruntime", "aoti_cpu")
    slower = {plan: (Candidate(["onnxruntime"], 3.0, {"onnxruntime": 1.0 * ONE_THREAD_CONTENDING * 1.01}), {}, [])
              for plan in opened}
    assert one_thread_base(listed, "aoti_cpu", 2, "cpu", slower) is None, "its opening engine alone is beyond reach"


def test_a_region_estimate_shares_a_delegates_time_by_the_work_of_its_nodes():
    plan = measured_plan(("aoti_cpu",), [Region("aoti_cpu", {"mm": 9.0, "add": 1.0}, 1.0)])

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
    # Not the plan with AOTInductor's parts on one thread, which a timing close to the fastest would add at 2 threads.
    monkeypatch.setattr(lower_module, "one_thread_base", lambda *args: None)
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

    # The same mix, estimated no faster than the fastest plan: neither measured nor read from the cache, and said why.
    def estimated_slower(plans, closing):
        fastest = min(plan.seconds for plan in plans)
        return dataclasses.replace(ort_region(plans, closing), estimate=1.0, fastest=fastest)

    monkeypatch.setattr(lower_module, "mixed_cover", estimated_slower)
    unmeasured = aotstack.lower(program, auto, progress=False).placements["forward"].selection
    assert [c.engines for c in unmeasured.candidates] == labels[:2]
    assert "(1 region) > aoti_cpu (regions kept: onnxruntime on 3 nodes" in unmeasured.reason
    assert "estimated at 1e+03 ms a call" in unmeasured.reason
    assert "no faster, so it was not measured" in unmeasured.reason


@pytest.mark.skipif(executorch_problem() is not None, reason=f"executorch: {executorch_problem()}")
def test_auto_times_a_plan_again_with_aotis_parts_on_one_thread_and_keeps_it_from_the_cache(monkeypatch, tmp_path):
    """XNNPACK takes the linear and its relu, AOTInductor the median and the product after them. That plan is timed
    again with AOTInductor's part compiled for one thread, and the choice pinned to it, so its lowering, file and
    warm re-lowering run for real (whichever plan a machine times faster)."""
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))

    def one_thread_kept(method, candidates, threads):
        kept = choose(method, candidates, threads)
        [index] = [i for i, c in enumerate(candidates) if c.engines[-1] == "aoti_cpu (1 thread)"]
        return dataclasses.replace(kept, chosen=index)

    choose = lower_module.selection
    monkeypatch.setattr(lower_module, "mixed_cover", lambda plans, closing: None)
    monkeypatch.setattr(lower_module, "one_thread_base", lambda *args: ("xnnpack", "aoti_cpu"))
    # Lowered whole however XNNPACK's part alone times against AOTInductor alone's call, a few microseconds each.
    monkeypatch.setattr(auto_module, "CLOSING_CONTENDING", float("inf"))
    monkeypatch.setattr(lower_module, "selection", one_thread_kept)
    model, inputs = models.build("median"), models.example_inputs("median")
    program = aotstack.export(model, {"forward": inputs})
    auto = aotstack.Auto(engines=["aoti_cpu", "xnnpack"])

    lowered = aotstack.lower(program, auto, progress=False)

    chosen = lowered.placements["forward"].selection
    labels = [candidate.engines for candidate in chosen.candidates]
    assert labels == [["aoti_cpu"], ["xnnpack", "aoti_cpu"], ["xnnpack", "aoti_cpu (1 thread)"],
                      ["xnnpack (1 thread)", "aoti_cpu"]]
    assert chosen.candidates[-1].seconds is not None
    assert set(chosen.candidates[-1].engine_seconds) == {"xnnpack", "aoti_cpu"}
    assert "xnnpack > aoti_cpu (1 thread) is xnnpack > aoti_cpu with aoti_cpu's parts compiled for one" in chosen.reason

    def aoti_threads(lowered_program):
        return [compile_spec_value(d.compile_specs, "threads") for d in lowered_program.delegates("forward")
                if d.backend_id == "aoti_cpu"]

    assert aoti_threads(lowered) == [b"1"]
    lowered.save(tmp_path / "auto.pt2")
    for got, expected in zip(aotstack.load(tmp_path / "auto.pt2").forward(*inputs), model(*inputs), strict=True):
        torch.testing.assert_close(got, expected.detach())

    # Warm: the plan is read from the cache and lowered again as it was measured, its AOTInductor part on one thread.
    monkeypatch.setattr(lower_module, "measured_methods", lambda *args: pytest.fail("measured again"))
    again = aotstack.lower(program, auto, progress=False)
    assert [c.engines for c in again.placements["forward"].selection.candidates] == labels
    assert aoti_threads(again) == [b"1"]

    # The plan with XNNPACK's session on one thread instead, kept: its XNNPACK part says so. AOTInductor's part, light
    # between XNNPACK's, is compiled for one thread in every plan (test_stacking.py), this one too.
    def opening_kept(method, candidates, threads):
        [index] = [i for i, c in enumerate(candidates) if c.engines[0] == "xnnpack (1 thread)"]
        return dataclasses.replace(choose(method, candidates, threads), chosen=index)

    monkeypatch.setattr(lower_module, "selection", opening_kept)
    opening = aotstack.lower(program, auto, progress=False)
    xnnpack_threads = [compile_spec_value(d.compile_specs, "threads") for d in opening.delegates("forward")
                       if d.backend_id == "xnnpack"]
    assert xnnpack_threads and set(xnnpack_threads) == {b"1"}
    assert aoti_threads(opening) == [b"1"]
    opening.save(tmp_path / "opening.pt2")
    for got, expected in zip(aotstack.load(tmp_path / "opening.pt2").forward(*inputs), model(*inputs), strict=True):
        torch.testing.assert_close(got, expected.detach())


def test_a_spec_only_a_run_side_reads_leaves_the_compile_caches_key_as_it_was():
    """A session engine's thread count is read when its session opens: the plan on one thread compiles nothing."""
    from aotstack.backends.ort.backend import OrtBackend
    from aotstack.compile.cache import backend_key
    from aotstack.format.specs import CompileSpec, SpecKey

    one_thread = [CompileSpec(SpecKey.THREADS, b"1")]
    assert backend_key(OrtBackend(), one_thread, "program") == backend_key(OrtBackend(), [], "program")
    providers = [CompileSpec(SpecKey.PROVIDERS, b"CPUExecutionProvider")]
    assert backend_key(OrtBackend(), providers, "program") != backend_key(OrtBackend(), [], "program")
