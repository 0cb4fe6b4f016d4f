"""``lower(program, "auto")``: each engine's plan lowered, loaded and timed; the fastest kept, and why."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import time

import pytest
import torch

import aotstack
from aotstack.compile import auto as auto_module
from aotstack.compile import lower as lower_module
from aotstack.compile import measure as measure_module
from aotstack.engine.registry import BUILT_IN, Engine
from aotstack.format.placement import Candidate, placement_from_json
from aotstack.format.records import Delegate
from aotstack.format.specs import CompileSpec, SpecKey
from aotstack.report.schema import REPORT_SCHEMA
from tests import models
from tests.schema_check import schema_errors

SLEEPY = "test_sleepy_relu"
# What the sleepy engine adds to each of its calls: far more than a small model's whole call, even on a busy machine.
SLEEP_SECONDS = 0.05


class SleepyReluBackend(aotstack.Backend):
    """A real engine that runs relu, slowly: a plan through it must lose to AOTInductor alone."""

    backend_id = SLEEPY

    def preprocess(self, exported_program, compile_specs):
        return aotstack.PreprocessResult(b"")

    def init(self, processed_bytes, named_data, compile_specs):
        return None

    def execute(self, handle, inputs):
        time.sleep(SLEEP_SECONDS)
        return [torch.relu(inputs[0])]


class SleepyReluPartitioner(aotstack.SupportedOpsPartitioner):
    backend_id = SLEEPY

    def supports_op(self, op):
        return op is torch.ops.aten.relu.default


LOUD = "test_slow_when_loud_relu"
# Past this size a value is loud: the shared model's example inputs (randn) stay far below it, inputs 1000 times
# larger far above.
LOUD_VALUE = 50.0


class SlowWhenLoudReluBackend(SleepyReluBackend):
    """A relu whose calls are slow only on loud inputs, as a decoder's step is slower deep into its cache."""

    backend_id = LOUD

    def execute(self, handle, inputs):
        if inputs[0].abs().max() > LOUD_VALUE:
            time.sleep(SLEEP_SECONDS)
        return [torch.relu(inputs[0])]


class SlowWhenLoudReluPartitioner(SleepyReluPartitioner):
    backend_id = LOUD


HOARDING = "test_hoarding_relu"
# What the hoarding engine holds once it is loaded: far more than the rest of a small model's plan.
HOARD_BYTES = 64 * 2**20


class HoardingReluBackend(SleepyReluBackend):
    """A sleepy engine that also keeps memory of its own from its init on, as an engine that repacks weights does."""

    backend_id = HOARDING

    def init(self, processed_bytes, named_data, compile_specs):
        return torch.ones(HOARD_BYTES // 4)


class HoardingReluPartitioner(SleepyReluPartitioner):
    backend_id = HOARDING


class BrokenReluBackend(SleepyReluBackend):
    backend_id = "test_broken_relu"

    def execute(self, handle, inputs):
        raise RuntimeError("this engine cannot run here")


class BrokenReluPartitioner(SleepyReluPartitioner):
    backend_id = "test_broken_relu"


class UnusableReluPartitioner(SleepyReluPartitioner):
    """An engine installed but unusable here (ExecuTorch built for another torch): its partitioner cannot be made."""

    backend_id = "test_unusable_relu"

    def __init__(self, *args, **kwargs):
        raise aotstack.LoweringError("this engine's package is built for another torch")


def engine(partitioner: str) -> Engine:
    return Engine(__name__, __name__, f"{__name__}:{partitioner}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A cache of this module's own, so each measurement here is made here, not read from an earlier run."""
    return tmp_path_factory.mktemp("auto-cache")


@pytest.fixture
def test_engines(monkeypatch: pytest.MonkeyPatch, cache_dir):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(cache_dir))
    monkeypatch.setitem(BUILT_IN, SLEEPY, engine("SleepyReluPartitioner"))
    monkeypatch.setitem(BUILT_IN, HOARDING, engine("HoardingReluPartitioner"))
    monkeypatch.setitem(BUILT_IN, LOUD, engine("SlowWhenLoudReluPartitioner"))
    monkeypatch.setitem(BUILT_IN, "test_broken_relu", engine("BrokenReluPartitioner"))
    monkeypatch.setitem(BUILT_IN, "test_unusable_relu", engine("UnusableReluPartitioner"))


def mlp_program() -> tuple[torch.nn.Module, tuple[torch.Tensor], aotstack.Program]:
    """Linear, relu, linear: the shared model's forward alone."""
    model, inputs = models.build("shared"), models.example_inputs("shared")
    return model, inputs, aotstack.export(model, {"forward": inputs})


def relu_program() -> tuple[torch.nn.Module, tuple[torch.Tensor], aotstack.Program]:
    """A relu alone, which a test engine takes whole: its plan leaves AOTInductor nothing, so it is timed whole."""
    model, inputs = torch.nn.ReLU(), (torch.randn(2, 256),)
    return model, inputs, aotstack.export(model, {"forward": inputs})


def lowered_plans(monkeypatch) -> list[tuple[str, ...]]:
    """The plans auto makes partitioners for, from now on, in order."""
    plans: list[tuple[str, ...]] = []
    real = lower_module.plan_partitioners

    def partitioners(plan, *args, **kwargs):
        plans.append(tuple(plan))
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(lower_module, "plan_partitioners", partitioners)
    return plans


def test_auto_keeps_the_plan_its_measurement_favours_and_says_why(test_engines, tmp_path, monkeypatch):
    model, inputs, program = mlp_program()
    plans = lowered_plans(monkeypatch)

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    # The sleepy engine's relu alone took longer than AOTInductor's whole call, so AOTInductor never compiled the
    # linears it leaves: its plan is listed as its opening engine measured it, those linears run as plain ATen.
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], [SLEEPY]]
    assert plans == [("aoti_cpu",), (SLEEPY,)]
    alone, sleepy = chosen.candidates
    assert sleepy.engine_seconds[SLEEPY] >= SLEEP_SECONDS and sleepy.seconds >= SLEEP_SECONDS
    assert alone.seconds < sleepy.seconds
    assert chosen.chosen == 0 and chosen.threads == torch.get_num_threads()
    assert "aoti_cpu is the fastest" in chosen.reason
    assert f"{SLEEPY} > aoti_cpu was not lowered whole: {SLEEPY}'s parts alone took" in chosen.reason
    assert "so its aoti_cpu parts were not compiled" in chosen.reason
    assert {d.backend_id for d in lowered.delegates("forward")} == {"aoti_cpu"}

    lowered.save(tmp_path / "auto.pt2")
    report = aotstack.file_report(tmp_path / "auto.pt2")
    assert schema_errors(report.to_json(), REPORT_SCHEMA) == []
    saved = report.method("forward")
    assert saved.selection == chosen
    assert saved.delegates[0].run_seconds is not None and saved.delegates[0].run_seconds <= alone.seconds
    text = report.text(width=160)
    assert "engines chosen by measuring" in text and f"{SLEEPY} > aoti_cpu" in text and "linear ×2" in text
    html = report._repr_html_()
    assert "engines chosen by measuring" in html and "kept: aoti_cpu is the fastest" in html
    torch.testing.assert_close(aotstack.load(tmp_path / "auto.pt2").forward(*inputs), model(*inputs).detach())


def test_a_plan_whose_opening_engine_is_within_reach_is_lowered_whole(test_engines, cache_dir, monkeypatch):
    # Within reach of the fastest plan however slow: its closing engine's parts are compiled, and it is timed whole,
    # where what they would take is worth it (here, whatever it is).
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    monkeypatch.setattr(auto_module, "CLOSING_CONTENDING", float("inf"))
    monkeypatch.setattr(auto_module, "CLOSING_WORTH", 0.0)
    _, _, program = mlp_program()
    plans = lowered_plans(monkeypatch)

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert plans == [("aoti_cpu",), (SLEEPY,), (SLEEPY, "aoti_cpu")]
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], [SLEEPY, "aoti_cpu"]]
    assert chosen.candidates[1].seconds >= SLEEP_SECONDS and "not lowered whole" not in chosen.reason


def test_a_plan_whose_opening_engine_alone_cannot_be_timed_is_lowered_whole(test_engines, cache_dir, monkeypatch):
    # Ops an engine leaves can fail as plain ATen (a kernel only the closing engine has): its opening timing says
    # nothing of the whole plan, which is lowered whole and timed like any other.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    _, _, program = mlp_program()
    plans = lowered_plans(monkeypatch)
    real, timed = lower_module.measured_plan, []

    def failing_opening(program, plan, lowered, *args):
        timed.append(plan)
        if plan == (SLEEPY, "aoti_cpu") and timed.count(plan) == 1:
            raise aotstack.LoweringError("an op it leaves has no ATen kernel here")
        return real(program, plan, lowered, *args)

    monkeypatch.setattr(lower_module, "measured_plan", failing_opening)

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert plans == [("aoti_cpu",), (SLEEPY,), (SLEEPY, "aoti_cpu")]
    assert timed.count((SLEEPY, "aoti_cpu")) == 2
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], [SLEEPY, "aoti_cpu"]]
    assert chosen.candidates[1].seconds >= SLEEP_SECONDS and chosen.candidates[1].error is None
    assert "not lowered whole" not in chosen.reason and "no ATen kernel" not in chosen.reason


def opened(engine: str, seconds: float, engine_seconds: float) -> auto_module.Measurement:
    return Candidate([engine], seconds, {engine: engine_seconds}), {}, []


def test_a_plan_is_lowered_whole_where_its_opening_engine_alone_is_within_reach_of_the_fastest():
    plan = ("xnnpack", "aoti_cpu")
    whole = {("aoti_cpu",): (Candidate(["aoti_cpu"], 0.020, {"aoti_cpu": 0.019}), {}, []),
             ("openvino", "aoti_cpu"): (Candidate(["openvino", "aoti_cpu"], 0.010, {"openvino": 0.009}), {}, [])}
    reach = 0.010 * auto_module.CLOSING_CONTENDING
    # Its delegates' time is the least the whole plan can take, whatever its ops left as plain ATen took.
    assert auto_module.closing_refusal(plan, opened("xnnpack", 0.500, reach * 0.99), whole) is None
    refusal = auto_module.closing_refusal(plan, opened("xnnpack", 0.500, reach * 1.01), whole)
    assert refusal == (f"xnnpack > aoti_cpu was not lowered whole: xnnpack's parts alone took "
                       f"{reach * 1.01 * 1e3:.3g} ms a call (the ops it leaves run as plain ATen), 1.36x the "
                       "fastest plan, openvino > aoti_cpu (10 ms), so its aoti_cpu parts were not compiled")
    # Where either could not be timed, nothing bounds the whole plan: it is lowered whole.
    failed = (Candidate(["xnnpack"], None, {}, "broken"), {}, [])
    assert auto_module.closing_refusal(plan, failed, whole) is None
    untimed = {plan: (Candidate(list(plan), None, {}, "broken"), {}, []) for plan in whole}
    assert auto_module.closing_refusal(plan, opened("xnnpack", 0.500, 0.400), untimed) is None


def test_a_timing_says_what_each_plain_op_took_the_first_time_a_process_times_its_method(test_engines, tmp_path):
    # The sleepy engine takes the relu; the linears it leaves run as plain ATen, each timed on its own at the
    # method's first timing in a process, apart from the timed calls.
    model, inputs, program = mlp_program()
    lowered = aotstack.lower(program, [SleepyReluPartitioner()], progress=False)
    lowered.save(tmp_path / "sleepy.pt2")
    stage = measure_module.Stage([d.delegate_id for d in lowered.delegates("forward")])
    loaded = measure_module.loaded_to_time(str(tmp_path / "sleepy.pt2"), stage)

    first, again = (measure_module.timed_methods(loaded, ["forward"], {"forward": (inputs, {})})["forward"]
                    for _ in range(2))

    assert set(first.plain_op_seconds) == {"linear", "linear_1"}
    assert all(0 < seconds < SLEEP_SECONDS for seconds in first.plain_op_seconds.values())
    assert again.plain_op_seconds == {} and again.seconds >= SLEEP_SECONDS


def test_a_call_failing_while_its_plain_ops_are_timed_leaves_the_timing_and_the_method_as_they_were(
    test_engines, tmp_path, monkeypatch
):
    model, inputs, program = mlp_program()
    aotstack.lower(program, [SleepyReluPartitioner()], progress=False).save(tmp_path / "sleepy.pt2")
    loaded = measure_module.loaded_to_time(str(tmp_path / "sleepy.pt2"), measure_module.Stage([]))

    def failing(action, times):
        def run(slots):
            raise RuntimeError("out of memory with the timers on")
        return run

    monkeypatch.setattr(measure_module, "timed_action", failing)
    timing = measure_module.timed_methods(loaded, ["forward"], {"forward": (inputs, {})})["forward"]

    assert timing.plain_op_seconds == {} and timing.seconds >= SLEEP_SECONDS
    torch.testing.assert_close(loaded.loaded.forward(*inputs), model(*inputs).detach())


def test_a_plan_whose_closing_engine_would_take_too_little_is_its_opening_engine_alone(
    test_engines, cache_dir, monkeypatch, tmp_path
):
    # The linears the sleepy engine leaves in the shared MLP are lone ops beside its part, which AOTInductor would
    # not take: lowered whole, the plan would be its opening lowering again, after AOTInductor's claim. So its
    # opening engine alone is the plan, as it was timed, and kept where it is the fastest.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    monkeypatch.setattr(auto_module, "CLOSING_CONTENDING", float("inf"))
    timed: list[str] = []
    seconds = {"aoti_cpu": [0.030], SLEEPY: [0.010]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    model, inputs, program = mlp_program()
    auto = aotstack.Auto(engines=["aoti_cpu", SLEEPY])

    lowered = aotstack.lower(program, auto, progress=False)

    chosen = lowered.placements["forward"].selection
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], [SLEEPY]]
    assert chosen.chosen == 1 and chosen.candidates[1].seconds == 0.010
    assert (f"{SLEEPY} > aoti_cpu was not lowered whole: its aoti_cpu engine would take none of the ops {SLEEPY} "
            f"leaves") in chosen.reason
    assert [d.backend_id for d in lowered.delegates("forward")] == [SLEEPY]
    lowered.save(tmp_path / "auto.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "auto.pt2").forward(*inputs), model(*inputs).detach())

    # Warm: the same choice from the cache, nothing timed, no dry run asked again (the refusal is kept), the plan
    # made again from the opening engine alone.
    monkeypatch.setattr(lower_module, "measured_methods", lambda *args: pytest.fail("a warm auto lower timed again"))
    monkeypatch.setattr(lower_module, "closing_nodes", lambda *args: pytest.fail("a warm auto lower dry-ran again"))
    plans = lowered_plans(monkeypatch)
    warm = aotstack.lower(program, auto, progress=False).placements["forward"].selection
    assert warm.candidates == chosen.candidates and warm.chosen == 1 and warm.reason == chosen.reason
    assert plans == [(SLEEPY, "aoti_cpu"), (SLEEPY,)]


class ReluThenAttention(torch.nn.Module):
    """A relu for the sleepy engine, then an attention and two pointwise ops, one part, for AOTInductor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h) * 2 + 1


def test_a_plan_is_its_opening_engine_alone_where_its_closing_parts_cost_is_an_attention_compiled_code_calls_too(
    test_engines, cache_dir, monkeypatch, tmp_path
):
    # As plain ATen the attention takes 20% of the sleepy plan's call, the two pointwise ops 2%. AOTInductor's code
    # for the attention calls ATen's own kernel, so its part could save 2% at most: no compile is worth that.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    monkeypatch.setattr(auto_module, "CLOSING_CONTENDING", float("inf"))
    timed: list[str] = []
    scripted = timed_as_the_machine_did({"aoti_cpu": [0.030], SLEEPY: [0.010]}, timed)

    def measured(*args):
        timings = scripted(*args)
        return {name: dataclasses.replace(t, plain_op_seconds={
            op: 0.002 if "scaled_dot_product" in op else 0.0001 for op in t.plain_op_seconds
        }) for name, t in timings.items()}

    monkeypatch.setattr(lower_module, "measured_methods", measured)
    model, inputs = ReluThenAttention(), (torch.randn(1, 2, 16, 8),)
    program = aotstack.export(model, {"forward": inputs})

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], [SLEEPY]] and chosen.chosen == 1
    assert (f"{SLEEPY} > aoti_cpu was not lowered whole: the 3 ops its aoti_cpu parts would take ran 2.2 ms a call "
            f"as plain ATen beside {SLEEPY}'s parts; compiled, scaled_dot_product_attention (2 ms) would still call "
            "ATen's own kernels; so those parts could save at most 0.2 ms (2.0% of the call") in chosen.reason
    assert [d.backend_id for d in lowered.delegates("forward")] == [SLEEPY]
    lowered.save(tmp_path / "auto.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "auto.pt2").forward(*inputs), model(*inputs))


def test_a_plan_is_lowered_whole_where_the_ops_its_closing_engine_would_take_cost_enough_as_plain_aten():
    plan, took = ("xnnpack", "aoti_cpu"), opened("xnnpack", 0.100, 0.080)
    worth = 0.100 * auto_module.CLOSING_WORTH
    ops = {"embedding": worth * 0.6, "layer_norm": worth * 0.3, "sdpa": 0.010}
    # What those ops took as plain ATen is the most the closing engine's parts could save.
    refusal = auto_module.closing_gain_refusal(plan, took, {"embedding", "layer_norm"}, ops)
    assert refusal == ("xnnpack > aoti_cpu was not lowered whole: the 2 ops its aoti_cpu parts would take ran "
                       f"{worth * 0.9 * 1e3:.3g} ms a call as plain ATen beside xnnpack's parts; so those parts could "
                       f"save at most {worth * 0.9 * 1e3:.3g} ms (2.7% of the call; under 3%), and xnnpack alone, the "
                       "ops it leaves run as plain ATen, is the plan")
    assert auto_module.closing_gain_refusal(plan, took, {"embedding", "layer_norm", "sdpa"}, ops) is None
    # But an op whose compiled code would call ATen's own kernel all the same saves nothing compiled. The costliest
    # ops are asked first, and only until the answer is sure.
    asked = []

    def only_sdpa_calls_a_kernel(node):
        asked.append(node)
        return node == "sdpa"

    refusal = auto_module.closing_gain_refusal(plan, took, {"embedding", "layer_norm", "sdpa"}, ops,
                                               only_sdpa_calls_a_kernel)
    assert asked == ["sdpa"]
    assert refusal == ("xnnpack > aoti_cpu was not lowered whole: the 3 ops its aoti_cpu parts would take ran "
                       f"{(worth * 0.9 + 0.010) * 1e3:.3g} ms a call as plain ATen beside xnnpack's parts; compiled, "
                       "sdpa (10 ms) would still call ATen's own kernels; so those parts could save at most "
                       f"{worth * 0.9 * 1e3:.3g} ms (2.7% of the call; under 3%), and xnnpack alone, the ops it "
                       "leaves run as plain ATen, is the plan")
    asked.clear()
    assert auto_module.closing_gain_refusal(plan, took, {"embedding", "layer_norm", "gelu_kernel"},
                                            {**ops, "gelu_kernel": worth * 0.5}, only_sdpa_calls_a_kernel) is None
    assert asked == ["embedding", "gelu_kernel"]
    # Where what it would take, or what that took, is not known, or the opening engine could not be timed, it is.
    assert auto_module.closing_gain_refusal(plan, took, None, ops) is None
    assert auto_module.closing_gain_refusal(plan, took, {"embedding"}, None) is None
    assert auto_module.closing_gain_refusal(plan, took, {"embedding", "gelu"}, ops) is None
    failed = (Candidate(["xnnpack"], None, {}, "broken"), {}, [])
    assert auto_module.closing_gain_refusal(plan, failed, {"embedding"}, ops) is None


def test_auto_measures_the_memory_each_plan_holds_once_loaded_and_called(test_engines):
    _, _, program = mlp_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY, HOARDING]), progress=False)

    alone, sleepy, hoarding = lowered.placements["forward"].selection.candidates
    assert hoarding.engines == [HOARDING]
    assert 0 <= sleepy.resident_bytes < HOARD_BYTES // 4, sleepy
    assert HOARD_BYTES <= hoarding.resident_bytes - sleepy.resident_bytes < HOARD_BYTES * 1.25, (sleepy, hoarding)
    assert alone.resident_bytes is not None
    memory_cells = [line for line in lowered.report().text(width=200).splitlines() if HOARDING in line]
    assert any(" MB" in line for line in memory_cells), memory_cells


def timed_as_the_machine_did(seconds: dict[str, list[float]], timed: list[str]):
    """A stand-in for ``measured_methods`` that times for real, then gives each plan (named by its first engine) the
    next of its ``seconds``, the last one again once they run out; the plans it timed go to ``timed``."""
    real = lower_module.measured_methods

    def measured(methods, delegates, inputs, saved=None):
        timings = real(methods, delegates, inputs, saved)
        engine = [d.backend_id for table in delegates.values() for d in table if d.backend_id != "aoti_cpu"]
        plan = engine[0] if engine else "aoti_cpu"
        timed.append(plan)
        figure = seconds[plan][min(timed.count(plan), len(seconds[plan])) - 1]
        return {name: dataclasses.replace(t, seconds=figure) for name, t in timings.items()}

    return measured


def test_a_plan_that_beat_aoti_alone_is_timed_again_with_it(test_engines, cache_dir, monkeypatch):
    # A burst of load while AOTInductor alone is timed the first time (1.5x its time, as measured on a
    # shared machine): the sleepy plan wins the first round, and only timing both again keeps AOTInductor alone.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    timed: list[str] = []
    seconds = {"aoti_cpu": [0.015, 0.010, 0.010], SLEEPY: [0.012]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    _, _, program = relu_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    alone, sleepy = chosen.candidates
    assert timed == ["aoti_cpu", SLEEPY, SLEEPY, "aoti_cpu", SLEEPY, "aoti_cpu"]
    assert chosen.chosen == 0 and (alone.seconds, sleepy.seconds) == (0.010, 0.012)
    assert f"{SLEEPY} > aoti_cpu and aoti_cpu were timed 2 more times, alternately" in chosen.reason
    assert {d.backend_id for d in lowered.delegates("forward")} == {"aoti_cpu"}


def test_a_warm_auto_lower_decides_what_to_lower_as_the_cold_one_did_though_timing_again_moved_the_figures(
    test_engines, cache_dir, monkeypatch
):
    # Cold: AOTInductor alone's first timing, 30 ms, puts the sleepy plan out of reach (its relu alone takes 50 ms);
    # timed again, AOTInductor alone takes 45 ms, within reach, and wins over the loud plan, which took 20 ms once.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    monkeypatch.setattr(auto_module, "CLOSING_WORTH", 0.0)
    timed: list[str] = []
    # The loud engine's first figure is its opening timing, the next its whole plan's.
    seconds = {"aoti_cpu": [0.030, 0.045], LOUD: [0.010, 0.020, 0.060], SLEEPY: [0.070]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    _, _, program = mlp_program()
    auto = aotstack.Auto(engines=["aoti_cpu", LOUD, SLEEPY])

    cold = aotstack.lower(program, auto, progress=False).placements["forward"].selection

    assert [c.engines for c in cold.candidates] == [["aoti_cpu"], [LOUD, "aoti_cpu"], [SLEEPY]]
    assert cold.chosen == 0 and [c.seconds for c in cold.candidates[:2]] == [0.045, 0.060]
    assert f"{SLEEPY} > aoti_cpu was not lowered whole" in cold.reason

    # Warm: the same plans, read from the cache; the sleepy one still not lowered whole, though by the medians it
    # would be within reach.
    monkeypatch.setattr(lower_module, "measured_methods", lambda *args: pytest.fail("a warm auto lower timed again"))
    plans = lowered_plans(monkeypatch)
    warm = aotstack.lower(program, auto, progress=False).placements["forward"].selection

    assert plans == [("aoti_cpu",)]
    assert warm.candidates == cold.candidates and warm.chosen == cold.chosen


def counted_saves(monkeypatch) -> list[str]:
    """The paths auto's timings save plans to, from now on."""
    paths: list[str] = []
    real_save = measure_module.save

    def save(methods, delegates, path):
        paths.append(path)
        real_save(methods, delegates, path)

    monkeypatch.setattr(measure_module, "save", save)
    return paths


def counted_timing_processes(monkeypatch) -> list[str]:
    """The paths auto's timing processes load, one for each process started from now on."""
    paths: list[str] = []
    real_started = measure_module.TimingProcess.started.__func__

    def started(cls, path, inputs, engines):
        paths.append(path)
        return real_started(cls, path, inputs, engines)

    monkeypatch.setattr(measure_module.TimingProcess, "started", classmethod(started))
    return paths


@pytest.mark.parametrize(
    ("free_space_share", "free_memory_share", "saves", "loads"),
    [(0.25, 0.0, 2, 2), (0.25, 2.0, 2, 6), (0.0, 2.0, 6, 6)],
    ids=["kept loaded", "memory too short to keep it loaded", "disk too full to keep the file either"],
)
def test_a_plan_timed_again_is_timed_by_the_process_that_loaded_it_else_from_its_file(
    test_engines, cache_dir, monkeypatch, free_space_share, free_memory_share, saves, loads
):
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    timed: list[str] = []
    seconds = {"aoti_cpu": [0.015, 0.010, 0.010], SLEEPY: [0.012]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    monkeypatch.setattr(measure_module.SavedPrograms, "FREE_SPACE_SHARE", free_space_share)
    monkeypatch.setattr(measure_module.SavedPrograms, "FREE_MEMORY_SHARE", free_memory_share)
    saved_files = counted_saves(monkeypatch)
    loaded_files = counted_timing_processes(monkeypatch)
    _, _, program = relu_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    # Six timings of two plans: each plan loaded once where memory allows to keep both loaded, else every time,
    # from the file saved once where the disk has room to keep both files; the folder and the processes gone once
    # auto chose.
    assert len(timed) == 6 and len(saved_files) == saves and len(loaded_files) == loads
    assert set(loaded_files) <= set(saved_files)
    assert not any(os.path.exists(os.path.dirname(path)) for path in saved_files)
    assert not [child for child in multiprocessing.active_children() if child.name == "aotstack-timing"]
    assert {d.backend_id for d in lowered.delegates("forward")} == {"aoti_cpu"}


def test_aoti_alone_far_slower_than_the_plan_that_beat_it_is_not_timed_again(test_engines, cache_dir, monkeypatch):
    # AOTInductor alone took more than CONTENDING times the sleepy plan's time: no burst of load
    # measured here explains that much, and each confirming round would cost a timing of every contender.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    timed: list[str] = []
    seconds = {"aoti_cpu": [0.012 * auto_module.CONTENDING * 1.1], SLEEPY: [0.012]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    _, _, program = relu_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert timed == ["aoti_cpu", SLEEPY]
    assert chosen.candidates[chosen.chosen].engines == [SLEEPY, "aoti_cpu"]
    assert "timed 2 more times" not in chosen.reason


def test_a_plan_close_to_the_fastest_is_timed_again_and_wins_where_it_is_faster(
    test_engines, cache_dir, monkeypatch, tmp_path
):
    # Each plan's call as the machine would time it: the sleepy plan's first timing caught a burst of
    # load (16.5 ms, 1.65x AOTInductor alone's 10 ms, the worst burst measured here) and is 8 ms since;
    # AOTInductor alone's second caught a quiet stretch (7 ms), so its fastest timing would still win;
    # the hoarding plan is 25 ms, too slow to contend, and is timed once.
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)
    timed: list[str] = []
    seconds = {"aoti_cpu": [0.010, 0.007, 0.010], SLEEPY: [0.0165, 0.008], HOARDING: [0.025]}
    monkeypatch.setattr(lower_module, "measured_methods", timed_as_the_machine_did(seconds, timed))
    model, inputs, program = relu_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY, HOARDING]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert timed == ["aoti_cpu", SLEEPY, HOARDING, "aoti_cpu", SLEEPY, "aoti_cpu", SLEEPY]
    assert [c.seconds for c in chosen.candidates] == [0.010, 0.008, 0.025]
    assert chosen.candidates[chosen.chosen].engines == [SLEEPY, "aoti_cpu"]
    assert f"aoti_cpu and {SLEEPY} > aoti_cpu were timed 2 more times, alternately" in chosen.reason
    assert SLEEPY in {d.backend_id for d in lowered.delegates("forward")}
    lowered.save(tmp_path / "close.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "close.pt2").forward(*inputs), model(*inputs).detach())


def test_a_warm_auto_lower_reads_its_measurements_instead_of_timing_again(test_engines, monkeypatch, tmp_path):
    model = models.build("shared")
    x = models.example_inputs("shared")
    program = aotstack.export(model, {"forward": x, "score": x})
    cold = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    def no_timing(*args, **kwargs):
        raise AssertionError("a warm auto lower timed a plan again")

    monkeypatch.setattr(lower_module, "measured_methods", no_timing)
    warm = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu", SLEEPY]), progress=False)

    for method in ("forward", "score"):
        assert warm.placements[method].selection == cold.placements[method].selection
        assert {r.state for r in warm.compile_log[method]} == {"cached"}, warm.compile_log
    # The sleepy engine takes relu, which only forward calls: for score its plan is AOTInductor alone, timed once.
    assert [c.engines for c in cold.placements["forward"].selection.candidates] == [["aoti_cpu"], [SLEEPY]]
    assert [c.engines for c in cold.placements["score"].selection.candidates] == [["aoti_cpu"]]
    warm.save(tmp_path / "warm.pt2")
    loaded = aotstack.load(tmp_path / "warm.pt2")
    torch.testing.assert_close(loaded.run("score", *x), model.score(*x).detach())


def test_auto_times_a_method_on_the_inputs_auto_inputs_gives_it(test_engines, tmp_path):
    model, inputs, program = mlp_program()
    loud = (inputs[0] * 1000,)

    def loud_plan_seconds(auto: aotstack.Auto) -> float:
        lowered = aotstack.lower(program, auto, progress=False)
        lowered.save(tmp_path / "loud.pt2")
        # Values a thousand times the example's: float32's rounding a thousand times larger too.
        torch.testing.assert_close(aotstack.load(tmp_path / "loud.pt2").forward(*loud), model(*loud).detach(),
                                   rtol=1e-5, atol=1e-3)
        return next(c for c in lowered.placements["forward"].selection.candidates if c.engines[0] == LOUD).seconds

    # Timed on the example inputs, the engine is quick; on the loud inputs given, every one of its calls sleeps.
    assert loud_plan_seconds(aotstack.Auto(engines=["aoti_cpu", LOUD])) < SLEEP_SECONDS
    assert loud_plan_seconds(aotstack.Auto(engines=["aoti_cpu", LOUD], inputs={"forward": (loud, {})})) >= SLEEP_SECONDS


def test_inputs_given_to_auto_key_its_measurements_by_their_values():
    _, inputs, program = mlp_program()
    exported = program.methods["forward"]

    def key(call, given):
        return auto_module.measurement_key("program", auto_module.TimingInputs(call, given), ("aoti_cpu",), 1)

    def timing_inputs(call):
        return auto_module.timing_inputs(program.methods, aotstack.Auto(inputs={"forward": call}))["forward"]

    # Example inputs are often random, made anew at each export: only their shapes key a measurement.
    assert key((inputs, {}), False) == key(((inputs[0] + 1,), {}), False)
    assert key((inputs, {}), True) != key(((inputs[0] + 1,), {}), True)
    assert timing_inputs((inputs, {})) == auto_module.TimingInputs((inputs, {}), True)
    assert auto_module.timing_inputs(program.methods, aotstack.Auto())["forward"].call[0] == exported.example_inputs[0]


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        ({"decode": ((torch.zeros(2, 256),), {})}, "Auto.inputs names 'decode', which the program lacks; its methods: "
                                                   "forward"),
        ({"forward": (torch.zeros(2, 256),)}, r"Auto.inputs\['forward'\] must be \(args, kwargs\)"),
        ({"forward": ((torch.zeros(3, 256),), {})}, r"Auto.inputs\['forward'\] does not fit the method: .*shape"),
        ({"forward": ((torch.zeros(2, 256, dtype=torch.int64),), {})}, r"Auto.inputs\['forward'\] .*int64"),
    ],
)
def test_inputs_auto_cannot_time_a_method_on_are_refused_before_anything_compiles(inputs, error, test_engines):
    _, _, program = mlp_program()

    with pytest.raises(aotstack.LoweringError, match=error):
        aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu"], inputs=inputs), progress=False)


def test_a_method_without_example_inputs_is_timed_on_the_inputs_given_or_refused_by_name(test_engines, tmp_path):
    model, inputs, program = mlp_program()
    program.methods["forward"].example_inputs = None

    with pytest.raises(aotstack.LoweringError, match=r"'forward' has none .* Auto\(inputs=\{'forward': \(args, kwar"):
        aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu"]), progress=False)
    lowered = aotstack.lower(program, aotstack.Auto(engines=["aoti_cpu"], inputs={"forward": (inputs, {})}),
                             progress=False)
    assert lowered.placements["forward"].selection.candidates[0].seconds is not None
    lowered.save(tmp_path / "given.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "given.pt2").forward(*inputs), model(*inputs).detach())


@pytest.mark.parametrize(
    ("broken_engine", "error"),
    [("test_broken_relu", "this engine cannot run here"), ("test_unusable_relu", "built for another torch")],
)
def test_a_plan_that_cannot_run_is_reported_and_another_kept(test_engines, tmp_path, broken_engine, error):
    model, inputs, program = mlp_program()

    lowered = aotstack.lower(program, aotstack.Auto(engines=[broken_engine]), progress=False)

    chosen = lowered.placements["forward"].selection
    broken = chosen.candidates[1]
    assert broken.seconds is None and error in broken.error
    assert f"{broken_engine} > aoti_cpu could not be lowered or run" in chosen.reason
    lowered.save(tmp_path / "kept.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "kept.pt2").forward(*inputs), model(*inputs).detach())


def test_every_installed_engine_proposes_a_plan_and_the_result_matches_eager(tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(cache_dir))
    model, inputs, program = mlp_program()

    lowered = aotstack.lower(program, progress=False)

    chosen = lowered.placements["forward"].selection
    installed = [name for name, e in BUILT_IN.items() if "cpu" in e.devices and e.installed()]
    assert sorted(c.engines[0] for c in chosen.candidates) == sorted(installed)
    assert all(c.engines[-1] == "aoti_cpu" for c in chosen.candidates)
    timed = [c for c in chosen.candidates if c.seconds is not None]
    fastest = min(c.seconds for c in timed)
    kept = chosen.candidates[chosen.chosen]
    # The fastest, or one level with it: AOTInductor alone on a tie, or a plan holding much less memory.
    assert kept.seconds <= fastest * (1 + auto_module.TIE)
    assert chosen.chosen == auto_module.selection("forward", chosen.candidates, chosen.threads).chosen
    lowered.save(tmp_path / "default.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "default.pt2").forward(*inputs), model(*inputs).detach())


def candidate(
    engines: list[str], seconds: float | None, error: str | None = None, megabytes: float | None = None
) -> Candidate:
    return Candidate(engines, seconds, {}, error, None if megabytes is None else int(megabytes * 1e6))


def test_the_fastest_plan_wins_and_the_runner_up_is_named():
    kept = auto_module.selection(
        "forward", [candidate(["aoti_cpu"], 0.020), candidate(["onnxruntime", "aoti_cpu"], 0.010)], 1
    )
    assert kept.chosen == 1
    assert kept.reason == ("onnxruntime > aoti_cpu is the fastest (10 ms a call), 2.00x faster than the next, "
                           "aoti_cpu (20 ms)")


def test_aoti_alone_wins_a_tie():
    kept = auto_module.selection(
        "forward", [candidate(["aoti_cpu"], 0.0102), candidate(["openvino", "aoti_cpu"], 0.0100)], 1
    )
    assert kept.chosen == 0 and "within 3% of the fastest plan" in kept.reason


def test_a_plan_level_with_the_fastest_and_much_lighter_wins():
    plans = [
        candidate(["aoti_cpu"], 0.020, megabytes=50),
        candidate(["onnxruntime", "aoti_cpu"], 0.0100, megabytes=200),
        candidate(["xnnpack", "aoti_cpu"], 0.0102, megabytes=60),
    ]
    kept = auto_module.selection("forward", plans, 1)
    assert kept.chosen == 2
    assert kept.reason == ("xnnpack > aoti_cpu is within 3% of the fastest plan, onnxruntime > aoti_cpu (10 ms a "
                           "call), and holds 60.00 MB of memory against its 200.00 MB")


@pytest.mark.parametrize(
    ("seconds", "megabytes", "aoti_seconds"),
    [
        (0.0110, 60, 0.020),  # lighter, but 10% slower: not level
        (0.0102, 190, 0.020),  # level, but only 5% lighter
        (0.0102, 60, 0.0102),  # level and lighter, but AOTInductor alone is level too, and it keeps its place
    ],
)
def test_a_lighter_plan_does_not_displace_a_faster_one_or_aoti_alone(seconds, megabytes, aoti_seconds):
    plans = [
        candidate(["aoti_cpu"], aoti_seconds, megabytes=300),
        candidate(["onnxruntime", "aoti_cpu"], 0.0100, megabytes=200),
        candidate(["xnnpack", "aoti_cpu"], seconds, megabytes=megabytes),
    ]
    kept = auto_module.selection("forward", plans, 1)
    assert kept.chosen == (0 if aoti_seconds < 0.011 else 1), kept.reason


@pytest.mark.parametrize("xnnpack_seconds", [0.0102, 0.0098])
def test_plans_that_hold_no_memory_leave_the_fastest_in_place_and_say_so(xnnpack_seconds):
    plans = [
        candidate(["aoti_cpu"], 0.020, megabytes=300),
        candidate(["onnxruntime", "aoti_cpu"], 0.0100, megabytes=0),
        candidate(["xnnpack", "aoti_cpu"], xnnpack_seconds, megabytes=0),
    ]
    kept = auto_module.selection("forward", plans, 1)
    fastest = 1 if xnnpack_seconds > 0.0100 else 2
    assert kept.chosen == fastest
    assert kept.reason.startswith(f"{auto_module.plan_text(plans[fastest].engines)} is the fastest"), kept.reason


@pytest.mark.parametrize("held", [-1, 1.5, "64 MB", True])
def test_a_file_whose_plan_memory_is_not_a_count_is_refused(held):
    plan = {"engines": ["aoti_cpu"], "seconds": 0.01, "engine_seconds": {}, "error": None, "resident_bytes": held}
    data = {"delegates": {}, "unclaimed": [], "selection": {"candidates": [plan], "chosen": 0, "threads": 1,
                                                              "reason": "alone"}}
    with pytest.raises(aotstack.PackageError, match="a candidate's resident_bytes is"):
        placement_from_json(data)
    plan["resident_bytes"] = 7
    assert placement_from_json(data).selection.candidates[0].resident_bytes == 7


def test_no_plan_that_works_is_an_error_naming_each():
    with pytest.raises(aotstack.LoweringError, match="method 'forward'.*aoti_cpu: boom.*openvino > aoti_cpu: bang"):
        auto_module.selection(
            "forward", [candidate(["aoti_cpu"], None, "boom"), candidate(["openvino", "aoti_cpu"], None, "bang")], 1
        )


def test_auto_names_an_unknown_or_uninstalled_engine():
    with pytest.raises(aotstack.LoweringError, match="no engine 'tensorrt' for device 'cpu'"):
        auto_module.candidate_plans(aotstack.Auto(engines=["tensorrt"]))
    with pytest.raises(aotstack.LoweringError, match="partitioners names 'fastest'; engines: auto, aoti, ort, ov"):
        aotstack.lower(mlp_program()[2], "fastest")


def test_explain_says_auto_needs_compiled_parts():
    with pytest.raises(aotstack.LoweringError, match="explain is a dry run"):
        aotstack.explain(mlp_program()[2], "auto")


def test_a_timing_counts_as_run_on_one_core_only_where_another_kept_two_busy_and_no_part_is_pinned():
    # The ONE_CORE rule: a small model's calls keep one core busy in every plan, and a plan with auto's
    # one-thread AOTInductor may keep one busy by design; only a plan beside one that kept two busy, with
    # nothing pinned, lost its engines' threads in the fork.
    def delegates(*specs: CompileSpec) -> dict[str, list[Delegate]]:
        return {"forward": [Delegate("openvino_0", "openvino", list(specs), [], [], [], b"", {})]}

    def timed(cores: float) -> dict[str, measure_module.MethodTiming]:
        return {"forward": measure_module.MethodTiming(0.01, cores=cores)}

    free, pinned = delegates(), delegates(CompileSpec(SpecKey.THREADS, b"1"))
    with measure_module.SavedPrograms() as saved:
        assert not saved.ran_on_one_core(timed(1.0), free)
        assert not saved.ran_on_one_core(timed(1.9), free)
        assert saved.ran_on_one_core(timed(1.0), free)
        assert not saved.ran_on_one_core(timed(1.0), pinned)
        assert not saved.ran_on_one_core(timed(1.3), free)
        # Calls that waited (a sleep, a device) rather than ran keep less than one core busy.
        assert not saved.ran_on_one_core(timed(0.3), free)


class ScriptedProcess:
    """A timing process whose timings keep the given cores busy, one after another."""

    kept_many_cores = False

    def __init__(self, *cores: float) -> None:
        self.cores = list(cores)

    def timed(self, names):
        return {name: measure_module.MethodTiming(0.01, cores=self.cores.pop(0)) for name in names}


def test_a_process_that_kept_two_cores_busy_once_has_its_threads_and_a_later_timing_on_one_is_load():
    free = {"forward": [Delegate("openvino_0", "openvino", [], [], [], [], b"", {})]}
    healthy, starved = ScriptedProcess(1.9, 1.0), ScriptedProcess(1.0, 1.0)
    with measure_module.SavedPrograms() as saved:
        assert measure_module.timed_on_its_threads(healthy, ["forward"], saved, free)["forward"].cores == 1.9
        assert measure_module.timed_on_its_threads(healthy, ["forward"], saved, free)["forward"].cores == 1.0
        assert measure_module.timed_on_its_threads(starved, ["forward"], saved, free) is None
