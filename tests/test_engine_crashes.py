"""An engine that crashes (a signal in its native code) ends a child process of lowering, never the caller's.

The engines here are real user backends that really crash: they send their own process SIGFPE,
read address 0 (SIGSEGV) or abort. Each refuses to crash in the test process itself, raising
instead, so a lowering that ran it there fails the test rather than ending the test run.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import resource
import shutil
import signal

import pytest
import torch

import aotstack
from aotstack.compile import auto as auto_module
from aotstack.compile.measure import TIMED_CALLS, WARM_UP_CALLS
from aotstack.engine.registry import BUILT_IN, Engine

TEST_PROCESS = os.getpid()


def crash(how: str) -> None:
    """End this process the way a crash in an engine's native code would."""
    if os.getpid() == TEST_PROCESS:
        raise RuntimeError("the engine ran in the test process; lowering should have run it in a child")
    if how == "SIGFPE":
        os.kill(os.getpid(), signal.SIGFPE)
    elif how == "SIGSEGV":
        ctypes.string_at(0)
    elif how == "SIGABRT":
        os.abort()
    else:
        os._exit(3)


class CrashingRelu(aotstack.Backend):
    """Runs relu; the subclasses crash in one of their steps."""

    backend_id = "test_crash_relu"

    def preprocess(self, exported_program, compile_specs):
        return aotstack.PreprocessResult(b"")

    def init(self, processed_bytes, named_data, compile_specs):
        return None

    def execute(self, handle, inputs):
        return [torch.relu(inputs[0])]


class FpeCompiling(CrashingRelu):
    backend_id = "test_fpe_compiling"

    def preprocess(self, exported_program, compile_specs):
        crash("SIGFPE")


class SegvCompiling(CrashingRelu):
    backend_id = "test_segv_compiling"

    def preprocess(self, exported_program, compile_specs):
        crash("SIGSEGV")


class AbortCompiling(CrashingRelu):
    backend_id = "test_abort_compiling"

    def preprocess(self, exported_program, compile_specs):
        crash("SIGABRT")


class ExitCompiling(CrashingRelu):
    backend_id = "test_exit_compiling"

    def preprocess(self, exported_program, compile_specs):
        crash("exit")


class SegvLoading(CrashingRelu):
    """Compiles; dies at load, as OpenVINO compiling its model in ``init`` can."""

    backend_id = "test_segv_loading"

    def init(self, processed_bytes, named_data, compile_specs):
        crash("SIGSEGV")


class SegvOpening(SegvLoading):
    """Converts only, and compiles when opened (as OpenVINO does); dies there."""

    backend_id = "test_segv_opening"
    compiles_when_opened = True


class RaisingOpening(CrashingRelu):
    """Converts only, and compiles when opened; fails there with an exception."""

    backend_id = "test_raising_opening"
    compiles_when_opened = True
    cached_by_packages = ("torch",)  # lowering keeps its results, as OpenVINO's

    def init(self, processed_bytes, named_data, compile_specs):
        raise ValueError("this part cannot be compiled for this machine")


class FpeRunning(CrashingRelu):
    """Compiles and loads; dies in its first call."""

    backend_id = "test_fpe_running"

    def execute(self, handle, inputs):
        crash("SIGFPE")


class FpeRunningAgain(CrashingRelu):
    """Compiles, loads and runs as many calls as one timing makes; dies in the next, as timing it again makes."""

    backend_id = "test_fpe_running_again"
    calls = 0

    def execute(self, handle, inputs):
        FpeRunningAgain.calls += 1
        if FpeRunningAgain.calls > WARM_UP_CALLS + TIMED_CALLS[1]:
            crash("SIGFPE")
        return super().execute(handle, inputs)


class CollectingCompiling(CrashingRelu):
    """Compiles after a full garbage collection, as the allocations of a long compile start one."""

    backend_id = "test_collecting_compiling"

    def preprocess(self, exported_program, compile_specs):
        gc.collect()
        return super().preprocess(exported_program, compile_specs)


class ReluPartitioner(aotstack.SupportedOpsPartitioner):
    """Claims relu for the backend named by the subclass."""

    backend_id = "test_crash_relu"

    def supports_op(self, op):
        return op is torch.ops.aten.relu.default


# One partitioner per test engine (the crashing ones, and one that collects garbage), by backend id; auto builds
# them with no arguments.
PARTITIONERS = {
    cls.backend_id: type(f"{cls.__name__}Partitioner", (ReluPartitioner,), {"backend_id": cls.backend_id})
    for cls in (FpeCompiling, SegvCompiling, AbortCompiling, ExitCompiling, SegvLoading, SegvOpening,
                RaisingOpening, FpeRunning, FpeRunningAgain, CollectingCompiling)
}
globals().update({partitioner.__name__: partitioner for partitioner in PARTITIONERS.values()})


class Relu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


X = torch.randn(4, 8)


def relu_program() -> aotstack.Program:
    return aotstack.export(Relu(), {"forward": (X,)})


@pytest.fixture(autouse=True)
def no_core_files():
    """The children's crashes write no core files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """One compile cache for the module: AOTInductor compiles the relu once, for every test here."""
    return tmp_path_factory.mktemp("crash-cache")


@pytest.fixture
def crashing_engines(monkeypatch: pytest.MonkeyPatch, cache_dir):
    """The crashing engines, each a candidate auto may be asked to measure."""
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(cache_dir))
    for backend_id, partitioner in PARTITIONERS.items():
        monkeypatch.setitem(BUILT_IN, backend_id, Engine(__name__, __name__, f"{__name__}:{partitioner.__name__}"))


@pytest.mark.parametrize(
    ("backend_id", "death", "signal_name"),
    [
        ("test_fpe_compiling", "died of SIGFPE", "SIGFPE"),
        ("test_segv_compiling", "died of SIGSEGV", "SIGSEGV"),
        ("test_abort_compiling", "died of SIGABRT", "SIGABRT"),
        ("test_exit_compiling", "exited with code 3", None),
    ],
)
def test_an_engine_dying_while_compiling_is_an_error_naming_it(backend_id, death, signal_name):
    # jobs=1 compiles one partition at a time, in a worker all the same.
    with pytest.raises(aotstack.EngineCrashError) as raised:
        aotstack.lower(relu_program(), [PARTITIONERS[backend_id]()], jobs=1, progress=False)

    error = raised.value
    assert isinstance(error, aotstack.LoweringError) and error.signal == signal_name
    message = str(error)
    assert f"method 'forward', partition '{backend_id}_0' ({backend_id}, delegate forward.0)" in message
    assert f"{backend_id} {death} while compiling partition" in message and "aten.relu.default" in message
    if signal_name is not None:
        # The worker's Python stack as it died says where: in the backend's preprocess.
        notes = "\n".join(getattr(error.__cause__, "__notes__", []))
        assert "in preprocess" in notes and "in crash" in notes


@pytest.mark.parametrize(
    ("backend_id", "failure"),
    [
        ("test_segv_opening", "test_segv_opening died of SIGSEGV while opening partition 'test_segv_opening_0' of "
                              "method 'forward' once, as loading will"),
        ("test_raising_opening", "test_raising_opening failed opening partition 'test_raising_opening_0' of method "
                                 "'forward' once, as loading will: ValueError: this part cannot be compiled for"),
    ],
)
def test_an_engine_that_compiles_when_opened_is_opened_once_while_lowering(crashing_engines, tmp_path, backend_id,
                                                                           failure):
    # Its crash at load would end the loading process; lowering meets it first, in a child. Again the second
    # time: a result its engine failed to open is not kept for the next lowering.
    for _ in range(2):
        with pytest.raises(aotstack.LoweringError, match="method 'forward', partition") as raised:
            aotstack.lower(relu_program(), [PARTITIONERS[backend_id]()], progress=False)
        assert failure in str(raised.value)

    lowered = aotstack.lower(relu_program(), [PARTITIONERS[backend_id](), aotstack.AotiCpuPartitioner()],
                             on_compile_error="fallback", progress=False)
    [fallen] = lowered.compile_failures["forward"]
    assert fallen.backend_id == backend_id and failure in fallen.error
    assert [d.backend_id for d in lowered.delegates("forward")] == ["aoti_cpu"]
    lowered.save(tmp_path / "opened.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "opened.pt2").forward(X), torch.relu(X))


class Teardown:
    """Garbage whose teardown writes the process it ran in, as an engine's session winds down its threads."""

    def __init__(self, record):
        self.record = record
        self.cycle = self

    def __del__(self):
        with open(self.record, "a") as record:
            record.write(f"{os.getpid()}\n")


def test_a_lowering_child_leaves_the_callers_garbage_to_the_caller(tmp_path):
    # Freed in a forked child, garbage owning an OpenVINO session waits forever there on threads
    # fork did not copy; it hung a benchmark's compile worker. The caller frees its own garbage.
    record = tmp_path / "freed-in"
    gc.disable()
    try:
        Teardown(record)
        aotstack.lower(relu_program(), [PARTITIONERS["test_collecting_compiling"]()], jobs=1, progress=False)
        assert not record.exists(), f"freed in process {record.read_text().split()}, not the caller {TEST_PROCESS}"
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text().split() == [str(TEST_PROCESS)]


def test_fallback_leaves_a_crashed_partition_to_the_next_engine(crashing_engines, tmp_path):
    lowered = aotstack.lower(
        relu_program(), [PARTITIONERS["test_fpe_compiling"](), aotstack.AotiCpuPartitioner()],
        on_compile_error="fallback", progress=False,
    )

    [failure] = lowered.compile_failures["forward"]
    assert failure.backend_id == "test_fpe_compiling" and "died of SIGFPE while compiling" in failure.error
    assert [d.backend_id for d in lowered.delegates("forward")] == ["aoti_cpu"]
    lowered.save(tmp_path / "fallback.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "fallback.pt2").forward(X), torch.relu(X))


@pytest.mark.parametrize(
    ("backend_id", "reason"),
    [
        ("test_fpe_compiling", "test_fpe_compiling died of SIGFPE while compiling partition"),
        ("test_segv_loading", "test_segv_loading died of SIGSEGV while loading the lowered program to time it"),
        # Auto loads each plan to time it, so it does not open what compiles when opened once more beforehand.
        ("test_segv_opening", "test_segv_opening died of SIGSEGV while loading the lowered program to time it"),
        ("test_fpe_running", "test_fpe_running died of SIGFPE while timing method 'forward' (delegate forward.0"),
    ],
)
def test_auto_drops_a_plan_whose_engine_dies_and_keeps_another(crashing_engines, tmp_path, backend_id, reason):
    lowered = aotstack.lower(relu_program(), aotstack.Auto(engines=["aoti_cpu", backend_id]), progress=False)

    chosen = lowered.placements["forward"].selection
    alone, crashed = chosen.candidates
    assert crashed.engines == [backend_id, "aoti_cpu"] and crashed.seconds is None
    assert crashed.error.startswith(f"EngineCrashError: {reason}"), crashed.error
    assert alone.seconds is not None and chosen.chosen == 0
    assert f"{backend_id} > aoti_cpu could not be lowered or run" in chosen.reason
    assert reason in lowered.report().text(width=400)
    lowered.save(tmp_path / "kept.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "kept.pt2").forward(X), torch.relu(X))


def test_auto_keeps_a_plans_first_timing_where_its_engine_dies_as_it_is_timed_again(
    crashing_engines, cache_dir, monkeypatch, caplog
):
    # Every plan contends, so each is timed again in the process that timed it first, which still holds it loaded;
    # AOTInductor alone is timed now too, not read from an earlier test's measurements.
    monkeypatch.setattr(auto_module, "CONTENDING", 1e6)
    shutil.rmtree(cache_dir / f".{auto_module.CACHE_KIND}", ignore_errors=True)

    with caplog.at_level("WARNING", logger="aotstack"):
        lowered = aotstack.lower(relu_program(), aotstack.Auto(engines=["aoti_cpu", "test_fpe_running_again"]),
                                 progress=False)

    alone, again = lowered.placements["forward"].selection.candidates
    assert again.engines == ["test_fpe_running_again", "aoti_cpu"] and again.seconds is not None
    assert alone.seconds is not None
    died = [r.getMessage() for r in caplog.records if "could not be timed again" in r.getMessage()]
    assert died and "test_fpe_running_again died of SIGFPE while timing method 'forward'" in died[0], died
    assert not [child for child in multiprocessing.active_children() if child.name == "aotstack-timing"]


def test_auto_still_times_other_engines_in_a_child_once_openvino_ran_here(crashing_engines, tmp_path):
    # OpenVINO's CPU plugin leaves threads a forked child would wait on, so a plan using OpenVINO
    # is timed in this process once it ran here; a plan without it still is not.
    pytest.importorskip("openvino")
    aotstack.lower(relu_program(), [aotstack.OpenVinoPartitioner()], progress=False).save(tmp_path / "ov.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "ov.pt2").forward(X), torch.relu(X))

    lowered = aotstack.lower(relu_program(), aotstack.Auto(engines=["aoti_cpu", "test_fpe_running"]), progress=False)

    alone, crashed = lowered.placements["forward"].selection.candidates
    assert crashed.error.startswith("EngineCrashError: test_fpe_running died of SIGFPE while timing"), crashed.error
    assert alone.seconds is not None
