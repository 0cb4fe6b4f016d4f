"""Partitions compile at once in worker processes: results in graph order, failures named, identical ones once.

The backends here are real ones, registered by defining them; a forked worker inherits them.
``PidReluBackend`` compiles a ``relu`` partition and records, in what it compiles, which
process compiled it and when, so a test can see where and whether compiles overlapped.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch

import aotstack
from aotstack.backends.aoti.compile import CompiledFiles, cached_files, store_files
from aotstack.compile import parallel
from aotstack.compile.jobs import CompileJob
from aotstack.compile.lower import PlanLowering
from aotstack.compile.program_parts import program_weights
from aotstack.compile.progress import LogProgress, Progress
from aotstack.format.tensor_data import weights_as_named_data
from tests import models
from tests.conftest import ROOT, assert_matches_eager, run_in_fresh_process
from tests.test_compile_errors import ClaimAllPartitioner, OpPartitioner

# The process running the tests: a backend that ends its own process only does so in a worker.
TEST_PROCESS = os.getpid()
# How long PidReluBackend's compile takes: long enough that two of them overlap only when run at once.
COMPILE_SECONDS = 1.0


class PidReluBackend(aotstack.Backend):
    """Runs ``relu``; its compile takes COMPILE_SECONDS and records its process and its start and end times."""

    backend_id = "test_pid_relu"

    def preprocess(self, exported_program, compile_specs):
        started = time.time()
        time.sleep(COMPILE_SECONDS)
        record = {"pid": os.getpid(), "started": started, "ended": time.time()}
        return aotstack.PreprocessResult(json.dumps(record).encode())

    def init(self, processed_bytes, named_data, compile_specs):
        return json.loads(processed_bytes)

    def execute(self, handle, inputs):
        return [torch.relu(inputs[0])]


class RaisingInWorkerBackend(aotstack.Backend):
    backend_id = "test_raising_in_worker"

    def preprocess(self, exported_program, compile_specs):
        raise RuntimeError(f"no kernel for this partition (process {os.getpid()})")


class RaisingLaterBackend(aotstack.Backend):
    """Fails after COMPILE_SECONDS, long enough for compiles started beside it to be running."""

    backend_id = "test_raising_later"

    def preprocess(self, exported_program, compile_specs):
        time.sleep(COMPILE_SECONDS)
        raise RuntimeError("no kernel for this partition, found late")


class DyingBackend(aotstack.Backend):
    """Ends its own process mid-compile, as a crash in native code or the out-of-memory killer would."""

    backend_id = "test_dying"

    def preprocess(self, exported_program, compile_specs):
        if os.getpid() == TEST_PROCESS:
            raise RuntimeError("DyingBackend compiled in the test process; it only dies in a worker")
        os.kill(os.getpid(), signal.SIGKILL)


class SlowBackend(aotstack.Backend):
    """A compile that takes a minute, writing its process id first: the one a failure elsewhere must stop."""

    backend_id = "test_slow"
    pid_file: Path | None = None

    def preprocess(self, exported_program, compile_specs):
        assert SlowBackend.pid_file is not None
        SlowBackend.pid_file.write_text(str(os.getpid()))
        time.sleep(60)
        return aotstack.PreprocessResult(b"")


class PidSineBackend(PidReluBackend):
    """Runs ``TwoRelus``' middle, ``sin`` then ``reshape``, recording its compile as ``PidReluBackend`` does."""

    backend_id = "test_pid_sine"

    def execute(self, handle, inputs):
        return [torch.sin(inputs[0]).reshape(8, 4)]


class SlowerSineBackend(PidSineBackend):
    """``PidSineBackend``, expected to compile slowly, as AOTInductor is."""

    backend_id = "test_slower_sine"
    expected_compile_seconds = 10.0


class TwoRelus(torch.nn.Module):
    """Two relus of different shapes with a sine between them: two distinct partitions for a relu-only backend."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.sin(torch.relu(x)).reshape(8, 4))


class TwoMethods(TwoRelus):
    def twin(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def relu_program(model: torch.nn.Module | None = None, methods: tuple[str, ...] = ("forward",)) -> aotstack.Program:
    x = torch.randn(4, 8)
    return aotstack.export(model or TwoRelus(), {method: (x,) for method in methods})


def compile_records(lowered: aotstack.LoweredProgram, method: str = "forward") -> list[dict]:
    return [
        json.loads(delegate.processed_bytes) for delegate in lowered.delegates(method)
    ]


def test_two_partitions_compile_in_two_workers_at_once(tmp_path: Path) -> None:
    lowered = aotstack.lower(relu_program(), [OpPartitioner(relu="test_pid_relu")], jobs=2, progress=False)
    records = compile_records(lowered)
    log = lowered.compile_log["forward"]
    assert [entry.partition for entry in log] == ["relu_0", "relu_1"]
    assert [entry.delegate_id for entry in log] == ["forward.0", "forward.1"]
    pids = [record["pid"] for record in records]
    assert len(set(pids)) == 2 and TEST_PROCESS not in pids
    assert [entry.worker for entry in log] == pids
    # Both compiles ran at the same time: each started before the other ended.
    first, second = records
    assert first["started"] < second["ended"] and second["started"] < first["ended"]
    path = tmp_path / "relus.pt2"
    lowered.save(path)
    x = torch.randn(4, 8)
    torch.testing.assert_close(aotstack.load(path).forward(x), TwoRelus()(x))


class SleepingPartitioner(OpPartitioner):
    """Takes COMPILE_SECONDS to partition, as ExecuTorch's question of a whole method takes seconds; notes when."""

    ended = 0.0

    def partition(self, exported_program):
        time.sleep(COMPILE_SECONDS)
        self.ended = time.time()
        return super().partition(exported_program)


def test_plans_lowered_together_compile_while_the_next_is_partitioned_and_fail_alone() -> None:
    lowering = PlanLowering(4, Progress(), "raise", False, False)
    slow = SleepingPartitioner(relu="test_pid_relu")
    results = lowering.together({
        "first": (relu_program(), [OpPartitioner(relu="test_pid_relu")]),
        "slow": (relu_program(), [slow]),
        "failing": (relu_program(), [OpPartitioner(relu="test_raising_in_worker")]),
    })
    assert isinstance(results["failing"], aotstack.LoweringError)
    assert "no kernel for this partition" in str(results["failing"])
    first, later = (compile_records(results[plan]) for plan in ("first", "slow"))  # type: ignore[arg-type]
    assert len(first) == len(later) == 2
    # The first plan's parts started compiling while this process was still partitioning the next plan.
    assert all(record["started"] < slow.ended for record in first)
    assert all(record["started"] >= slow.ended for record in later)


def test_progress_lines_name_the_plan_where_plans_lower_together(caplog) -> None:
    lowering = PlanLowering(2, LogProgress(), "raise", False, False)
    plans = {
        ("first", "closing"): (relu_program(), [OpPartitioner(relu="test_pid_relu")]),
        ("second", "closing"): (relu_program(), [ClaimAllPartitioner("test_pid_relu")]),
    }
    with caplog.at_level(logging.INFO, logger="aotstack"):
        results = lowering.together(plans)
    assert not any(isinstance(result, Exception) for result in results.values())
    lines = [record.getMessage() for record in caplog.records]
    for plan in ("first > closing", "second > closing"):
        assert any(line.startswith(f"forward ({plan}): compiling ") for line in lines), lines
        assert any(line.startswith(f"forward ({plan}): ") and "(test_pid_relu) " in line for line in lines), lines


class DiskWarmedBackend(PidReluBackend):
    """A warm-up that keeps its work on disk, as AOTInductor's probe of the CPU does; each run appends its process."""

    backend_id = "test_disk_warmed"
    warm_up_fills_disk_cache = True
    log: Path | None = None

    def warm_up(self):
        assert DiskWarmedBackend.log is not None
        time.sleep(COMPILE_SECONDS)
        with DiskWarmedBackend.log.open("a") as log:
            log.write(json.dumps({"pid": os.getpid(), "ended": time.time()}) + "\n")


def test_a_warm_up_kept_on_disk_runs_first_in_a_child_then_from_disk(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(parallel, "WARMED_UP", set())
    DiskWarmedBackend.log = tmp_path / "warm-ups.jsonl"
    first, second = (
        aotstack.lower(relu_program(), [OpPartitioner(relu="test_disk_warmed")], jobs=2, progress=False)
        for _ in range(2)
    )
    child, *after = (json.loads(line) for line in DiskWarmedBackend.log.read_text().splitlines())
    records = compile_records(first) + compile_records(second)
    # The first part's worker, forked while the child warmed up, waited for it, then warmed up itself from disk; the
    # other part's worker forked after this process warmed up, and inherited that. The second lowering did none.
    assert child["pid"] != TEST_PROCESS and len(after) == 2
    assert sorted(warm_up["pid"] == TEST_PROCESS for warm_up in after) == [False, True]
    first_worker = next(warm_up for warm_up in after if warm_up["pid"] != TEST_PROCESS)
    assert first_worker["pid"] in {record["pid"] for record in compile_records(first)}
    assert first_worker["ended"] >= child["ended"] + COMPILE_SECONDS
    assert all(record["started"] >= child["ended"] for record in records)


class OneRelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def test_a_later_lowering_warms_up_here_from_what_a_child_left_on_disk(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(parallel, "WARMED_UP", set())
    monkeypatch.setattr(parallel, "WARMED_UP_ON_DISK", set())
    DiskWarmedBackend.log = tmp_path / "warm-ups.jsonl"
    program = aotstack.export(OneRelu(), {"forward": (torch.randn(4, 8),)})
    first, second = (
        aotstack.lower(program, [OpPartitioner(relu="test_disk_warmed")], jobs=2, progress=False) for _ in range(2)
    )
    # The first lowering's one part compiled in the worker that waited for the child, and warmed up itself: this
    # process did not. The second lowering forked no child to read what the first left on disk: this process read
    # it, then forked the part's worker, which inherited that.
    child, first_worker, here = (json.loads(line) for line in DiskWarmedBackend.log.read_text().splitlines())
    (first_record,), (second_record,) = compile_records(first), compile_records(second)
    assert child["pid"] not in {TEST_PROCESS, first_worker["pid"]}
    assert first_worker["pid"] == first_record["pid"]
    assert here["pid"] == TEST_PROCESS
    assert second_record["pid"] != TEST_PROCESS and second_record["started"] >= here["ended"]


class BusyPartitioner(OpPartitioner):
    """Takes four warm-ups' time to partition, as ExecuTorch's question of a whole method takes seconds."""

    ended = 0.0

    def partition(self, exported_program):
        time.sleep(4 * COMPILE_SECONDS)
        self.ended = time.time()
        return super().partition(exported_program)


def test_a_part_waiting_for_a_warm_up_compiles_as_it_ends_while_this_process_is_busy(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setattr(parallel, "WARMED_UP", set())
    DiskWarmedBackend.log = tmp_path / "warm-ups.jsonl"
    busy = BusyPartitioner(relu="test_pid_relu")
    results = PlanLowering(2, Progress(), "raise", False, False).together({
        "warmed": (relu_program(), [OpPartitioner(relu="test_disk_warmed")]),
        "busy": (relu_program(), [busy]),
    })
    child = json.loads(DiskWarmedBackend.log.read_text().splitlines()[0])
    warmed = compile_records(results["warmed"])  # type: ignore[arg-type]
    # One part compiled once the warm-up child ended, while this process was still partitioning the next plan.
    assert min(record["started"] for record in warmed) < busy.ended
    assert all(record["started"] >= child["ended"] for record in warmed)


def test_one_job_compiles_in_one_worker_at_a_time() -> None:
    # A worker all the same: an engine crashing in it ends the worker, not this process.
    lowered = aotstack.lower(relu_program(), [OpPartitioner(relu="test_pid_relu")], jobs=1, progress=False)
    records = compile_records(lowered)
    pids = [record["pid"] for record in records]
    assert TEST_PROCESS not in pids
    assert records[0]["ended"] <= records[1]["started"]
    assert [entry.worker for entry in lowered.compile_log["forward"]] == pids


def test_aoti_partitions_compile_in_workers_and_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold compile cache of its own: a cached partition is answered in this process, with no worker.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    program = aotstack.export(models.build("split"), {"forward": models.example_inputs("split")})
    partitioners = [aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"])]
    lowered = aotstack.lower(program, partitioners, jobs=2, progress=False)
    log = lowered.compile_log["forward"]
    assert [(entry.backend_id, entry.state) for entry in log] == [("aoti_cpu", "compiled")] * 2
    workers = [entry.worker for entry in log]
    assert None not in workers and len(set(workers)) == 2 and TEST_PROCESS not in workers
    path = tmp_path / "split.pt2"
    lowered.save(path)
    assert_matches_eager(run_in_fresh_process(path, "forward", "split"), "split")

    again = aotstack.lower(program, partitioners, jobs=2, progress=False)
    log = again.compile_log["forward"]
    assert [(entry.state, entry.worker) for entry in log] == [("cached", None)] * 2
    first, second = lowered.delegates("forward"), again.delegates("forward")
    assert [d.named_data["model.so"] for d in second] == [d.named_data["model.so"] for d in first]


def test_identical_partitions_compile_once() -> None:
    program = relu_program(TwoMethods(), ("forward", "twin"))
    lowered = aotstack.lower(program, [OpPartitioner(relu="test_pid_relu")], jobs=2, progress=False)
    twin = lowered.compile_log["twin"]
    assert [entry.same_as for entry in twin] == ["forward/relu_0", "forward/relu_1"]
    assert [entry.state for entry in twin] == ["cached", "cached"]
    # The twin's delegates carry the very result the forward's compile produced.
    assert compile_records(lowered, "twin") == compile_records(lowered, "forward")
    assert all(entry.worker is not None for entry in lowered.compile_log["forward"])


def test_identity_follows_weights_not_method_names() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    first = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    same = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.weight.add_(1.0)
    changed = aotstack.export(other, {"forward": (x,)}).methods["forward"]
    backend = PidReluBackend()

    def job(program, method):
        specs = [aotstack.CompileSpec("method_name", method.encode())]
        return CompileJob(method, "t", backend, program, specs, 1)

    assert job(first, "forward").identity() == job(same, "other").identity()
    assert job(first, "forward").identity() != job(changed, "forward").identity()


def test_a_failing_compile_in_a_worker_names_method_and_partition() -> None:
    with pytest.raises(aotstack.LoweringError) as caught:
        aotstack.lower(relu_program(), [OpPartitioner(relu="test_raising_in_worker")], jobs=2, progress=False)
    # Both partitions fail; the first to fail stops the other, so either may be the one named.
    message = str(caught.value)
    named = r"method 'forward', partition 'relu_(0|1)' \(test_raising_in_worker, delegate forward\.\1\)"
    assert re.search(named, message)
    assert "no kernel for this partition" in message
    cause = caught.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert any("raised in compile worker process" in note for note in getattr(cause, "__notes__", []))


def test_a_worker_that_dies_is_named() -> None:
    with pytest.raises(aotstack.EngineCrashError) as caught:
        aotstack.lower(relu_program(), [OpPartitioner(relu="test_dying")], jobs=2, progress=False)
    message = str(caught.value)
    assert re.search(r"method 'forward', partition 'relu_[01]'", message)
    assert re.search(r"test_dying died of SIGKILL while compiling partition 'relu_[01]'", message)
    assert caught.value.signal == "SIGKILL"


def test_fallback_keeps_a_failed_worker_compile_in_the_method(tmp_path: Path) -> None:
    lowered = aotstack.lower(
        relu_program(), [OpPartitioner(relu="test_dying")], jobs=2, progress=False, on_compile_error="fallback"
    )
    assert lowered.delegates("forward") == []
    assert [f.partition for f in lowered.compile_failures["forward"]] == ["relu_0", "relu_1"]
    assert "died of SIGKILL" in lowered.compile_failures["forward"][0].error
    path = tmp_path / "fallback.pt2"
    lowered.save(path)
    x = torch.randn(4, 8)
    torch.testing.assert_close(aotstack.load(path).forward(x), TwoRelus()(x))


def test_a_failure_stops_the_compiles_still_running(tmp_path: Path) -> None:
    SlowBackend.pid_file = tmp_path / "slow.pid"
    program = relu_program(TwoMethods(), ("forward", "twin"))
    plan = {"forward": [OpPartitioner(relu="test_slow")], "twin": [OpPartitioner(relu="test_raising_in_worker")]}
    started = time.perf_counter()
    with pytest.raises(aotstack.LoweringError, match="method 'twin', partition 'relu_0'"):
        aotstack.lower(program, plan, jobs=4, progress=False)
    # Stopped, not waited for: the slow compiles sleep a minute.
    assert time.perf_counter() - started < 45
    if SlowBackend.pid_file.exists():
        with pytest.raises(ProcessLookupError):
            os.kill(int(SlowBackend.pid_file.read_text()), 0)


def test_the_next_partitioner_claims_and_compiles_while_the_parts_before_it_compile(tmp_path: Path) -> None:
    plan = [OpPartitioner(relu="test_pid_relu"), ClaimAllPartitioner("test_pid_sine")]
    lowered = aotstack.lower(relu_program(), plan, jobs=3, progress=False)
    first, second, middle = compile_records(lowered)
    # The sine's part started before either relu's compile ended: it did not wait for them to be spliced in.
    assert middle["started"] < min(first["ended"], second["ended"])
    log = lowered.compile_log["forward"]
    assert [(entry.partition, entry.delegate_id) for entry in log] == [
        ("relu_0", "forward.0"), ("relu_1", "forward.1"), ("all", "forward.2")
    ]
    path = tmp_path / "ahead.pt2"
    lowered.save(path)
    x = torch.randn(4, 8)
    torch.testing.assert_close(aotstack.load(path).forward(x), TwoRelus()(x))


def test_under_fallback_the_next_partitioner_claims_once_the_parts_before_it_compiled() -> None:
    # A part that fails gives its nodes back to the next partitioner, so it cannot claim before it knows.
    plan = [OpPartitioner(relu="test_pid_relu"), ClaimAllPartitioner("test_pid_sine")]
    lowered = aotstack.lower(relu_program(), plan, jobs=3, progress=False, on_compile_error="fallback")
    first, second, middle = compile_records(lowered)
    assert middle["started"] >= max(first["ended"], second["ended"])


def test_a_part_expected_to_compile_longest_starts_first() -> None:
    plan = [OpPartitioner(relu="test_pid_relu"), ClaimAllPartitioner("test_slower_sine")]
    lowered = aotstack.lower(relu_program(), plan, jobs=1, progress=False)
    first, second, middle = compile_records(lowered)
    # relu_0 took the one worker as it was queued; the sine, queued after relu_1, went before it.
    assert first["ended"] <= middle["started"] and middle["ended"] <= second["started"]


def test_a_failure_stops_the_next_partitioners_compiles_claimed_ahead(tmp_path: Path) -> None:
    SlowBackend.pid_file = tmp_path / "slow.pid"
    plan = [OpPartitioner(relu="test_raising_later"), ClaimAllPartitioner("test_slow")]
    started = time.perf_counter()
    with pytest.raises(aotstack.LoweringError, match="method 'forward', partition 'relu_0'"):
        aotstack.lower(relu_program(), plan, jobs=3, progress=False)
    assert time.perf_counter() - started < 45
    # The slow compile started while the relus compiled, and was stopped with them.
    with pytest.raises(ProcessLookupError):
        os.kill(int(SlowBackend.pid_file.read_text()), 0)


def test_the_compile_cache_never_holds_a_partial_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))

    key = "a" * 64
    original_replace = os.replace

    def replace_once_then_fail(source, target):
        # The hash file lands; writing the library itself fails: the entry must not count.
        if str(target).endswith(".so"):
            raise OSError("No space left on device")
        original_replace(source, target)

    monkeypatch.setattr(os, "replace", replace_once_then_fail)
    store_files(key, CompiledFiles(b"\x7fELF not really a library", None, []))
    monkeypatch.setattr(os, "replace", original_replace)
    assert cached_files(key) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [key + ".so.sha256", key + ".weights", key + ".weights.sha256"]
    store_files(key, CompiledFiles(b"\x7fELF not really a library", None, []))
    assert cached_files(key) == CompiledFiles(b"\x7fELF not really a library", None, [])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]


def test_jobs_must_be_a_positive_int() -> None:
    for jobs in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="jobs must be an int >= 1"):
            aotstack.lower(relu_program(), [], jobs=jobs)


PROGRESS_SCRIPT = """
import logging, sys
import torch
import aotstack
from tests.test_parallel_compile import relu_program
from tests.test_compile_errors import ClaimAllPartitioner, OpPartitioner

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
aotstack.lower(relu_program(), [OpPartitioner(relu="test_pid_relu")], jobs=2)
print("lowered", flush=True)
"""


def run_progress_script(terminal: bool) -> str:
    """Standard error of a lowering: on a pseudo-terminal, or on a pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    if not terminal:
        child = subprocess.run(
            [sys.executable, "-c", PROGRESS_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
        )
        assert child.returncode == 0, child.stderr[-3000:]
        return child.stderr
    import pty

    controller, follower = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", PROGRESS_SCRIPT], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=follower, cwd=ROOT, env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the child exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert child.wait(timeout=120) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_progress_is_a_live_table_in_a_terminal() -> None:
    shown = run_progress_script(terminal=True)
    assert "compiling partitions" in shown
    assert "\x1b[" in shown  # drawn and redrawn in place
    for text in ("relu_0", "relu_1", "test_pid_relu", "compiled"):
        assert text in shown


def test_progress_is_plain_log_lines_on_a_pipe() -> None:
    shown = run_progress_script(terminal=False)
    assert "\x1b" not in shown
    assert "compiling partitions" not in shown
    lines = shown.splitlines()
    for tag in ("relu_0", "relu_1"):
        assert any(line.startswith(f"forward: compiling {tag} (test_pid_relu, 1 nodes) in worker") for line in lines)
        assert any(line.startswith(f"forward: {tag} (test_pid_relu) compiled in") for line in lines)


def test_torch_deprecation_warnings_do_not_reach_the_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold compile cache, so AOTInductor really compiles in this process.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    program = aotstack.export(torch.nn.Linear(8, 4), {"forward": (torch.randn(2, 8),)})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotstack.lower(program, [aotstack.AotiCpuPartitioner()], jobs=1, progress=False)
    torch_root = os.path.dirname(torch.__file__)
    from_torch = [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)
                  and w.filename.startswith(torch_root)]
    assert from_torch == [], [str(w.message)[:200] for w in from_torch]


def test_cli_refuses_a_bad_jobs_count(capsys: pytest.CaptureFixture[str]) -> None:
    from aotstack.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["compile", "tests.models:build", "-o", "never.pt2", "-j", "0"])
    assert exited.value.code == 2
    assert "expected a whole number of at least 1, got '0'" in capsys.readouterr().err


class WeightsBackBackend(aotstack.Backend):
    """Hands back its partition's weights as named data, as the built-in backends do."""

    backend_id = "test_weights_back"

    def preprocess(self, exported_program, compile_specs):
        named_data, _ = weights_as_named_data(program_weights(exported_program))
        return aotstack.PreprocessResult(str(os.getpid()).encode(), named_data)


class LinearTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def doubled(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2


def test_weights_a_worker_hands_back_are_the_programs_own_not_copies() -> None:
    model = LinearTwice()
    program = aotstack.export(model, {"forward": (torch.randn(2, 256),), "doubled": (torch.randn(2, 256),)})
    lowered = aotstack.lower(program, [ClaimAllPartitioner("test_weights_back")], jobs=2, progress=False)
    for method in ("forward", "doubled"):
        (delegate,) = lowered.delegates(method)
        assert int(delegate.processed_bytes) != TEST_PROCESS  # compiled in a worker
        weight = memoryview(delegate.named_data["weight:linear.weight"])
        assert numpy.frombuffer(weight, dtype=numpy.uint8).ctypes.data == model.linear.weight.data_ptr()
        assert weight.tobytes() == model.linear.weight.detach().numpy().tobytes()


class RepeatedBlocks(torch.nn.Module):
    """Blocks of the same shape with their own weights (each over 64 elements), sigmoid between: parts of one structure.

    ``small`` gives each block a 4-element scale, which Inductor writes into its code as values.
    """

    def __init__(self, blocks: int, small: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(blocks))
        for index, block in enumerate(self.blocks):
            block.register_buffer("scale", torch.full((4,), float(index + 2)) if small else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x) if block.scale is None else block(x) * block.scale.repeat(32)
            if index < len(self.blocks) - 1:
                x = torch.sigmoid(x)
        return x


@pytest.mark.parametrize("small", [False, True], ids=["large weights", "values in the code"])
def test_partitions_of_one_structure_compile_once_and_each_runs_its_own_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: bool
) -> None:
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = RepeatedBlocks(3 if not small else 2, small).eval()
    x = torch.randn(2, 128)
    program = aotstack.export(model, {"forward": (x,)})
    partitioners = [aotstack.AotiCpuPartitioner(exclude_ops=["aten.sigmoid"])]
    lowered = aotstack.lower(program, partitioners, jobs=2, progress=False)

    log = lowered.compile_log["forward"]
    libraries = {bytes(d.named_data["model.so"]) for d in lowered.delegates("forward")}
    if small:
        # Each block's scale is in its code: no library serves the other.
        assert [entry.state for entry in log] == ["compiled"] * 2
        assert len(libraries) == 2
    else:
        # The first compiles; the others take its library from the cache in this process, with no worker.
        assert [(entry.state, entry.worker is None) for entry in log] == [("compiled", False)] + [("cached", True)] * 2
        assert len(libraries) == 1
    path = tmp_path / "blocks.pt2"
    lowered.save(path)
    torch.testing.assert_close(aotstack.load(path).forward(x), model(x).detach())
