"""One loaded program, many threads: stateless methods run concurrently, state-updating ones in turn; fork.

Results from eight threads must equal one thread's. A method that updates a buffer (here a
counter) holds the program's one state lock for its run, so concurrent calls see every count
exactly once, and ``reset()`` waits for them. A child made by ``os.fork`` can call a CPU program
its parent loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import aotstack
from tests.conftest import ROOT, run_child
from tests.test_stacked_end_to_end import ORT_THEN_AOTI

THREADS = 8
CALLS_PER_THREAD = 40


class WideModel(torch.nn.Module):
    """Large enough for the compiled code to run OpenMP parallel loops; the batch is dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * 2


class CounterModel(torch.nn.Module):
    """``step`` counts its calls in two buffers: ``count`` (updated in place inside the compiled code)
    and ``tally`` (one element: the method copies its new value back); ``double`` reads no state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4))
        self.register_buffer("tally", torch.zeros(1))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.tally.add_(1)
        return x + self.count + self.tally

    def peek(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.count * 10 + self.tally

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    program = aotstack.export(
        WideModel().eval(), {"forward": (torch.randn(64, 256),)},
        dynamic_shapes={"forward": {"x": {0: Dim("batch", min=1, max=1024)}}},
    )
    path = tmp_path_factory.mktemp("concurrency") / "wide.pt2"
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()]).save(path)
    return path


@pytest.fixture(scope="module")
def counter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    x = torch.zeros(4)
    program = aotstack.export(CounterModel(), {"step": (x,), "peek": (x,), "double": (x,)})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    assert [d.updated_buffers for d in lowered.delegates("step")] == [["count"]], "count is updated in place"
    path = tmp_path_factory.mktemp("concurrency") / "counter.pt2"
    lowered.save(path)
    return path


def in_threads(work, jobs: list) -> list:
    """``work(job)`` for every job, spread over ``THREADS`` threads that start together."""
    start = threading.Barrier(THREADS)

    def run(chunk: list) -> list:
        start.wait()
        return [work(job) for job in chunk]

    chunks = [jobs[i::THREADS] for i in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        done = list(pool.map(run, chunks))
    # Back in job order.
    results: list = [None] * len(jobs)
    for i, chunk in enumerate(done):
        results[i::THREADS] = chunk
    return results


def test_threads_calling_one_program_get_what_one_thread_gets(wide_path, lowered_with):
    _, stacked_path = lowered_with("stacked", *ORT_THEN_AOTI)
    wide, stacked = aotstack.load(wide_path), aotstack.load(stacked_path)
    assert wide.method("forward").lock is None and stacked.method("forward").lock is None
    generator = torch.Generator().manual_seed(0)
    jobs = [
        (wide, torch.randn(int(torch.randint(1, 513, (1,), generator=generator)), 256, generator=generator))
        if i % 2 else (stacked, torch.randn(4, 16, generator=generator))
        for i in range(THREADS * CALLS_PER_THREAD)
    ]
    alone = [program.forward(x) for program, x in jobs]

    together = in_threads(lambda job: job[0].forward(job[1]), jobs)

    for one, many in zip(alone, together, strict=True):
        assert torch.equal(one, many)


def test_state_updating_calls_run_one_at_a_time_and_reset_waits_for_them(counter_path):
    loaded = aotstack.load(counter_path)
    step, peek, double = (loaded.method(name) for name in ("step", "peek", "double"))
    assert step.lock is not None and step.lock is peek.lock, "methods sharing state share one lock"
    assert double.lock is None, "a method that reads no state takes no lock"
    x = torch.zeros(4)
    calls = THREADS * CALLS_PER_THREAD

    def work(i: int) -> torch.Tensor:
        # The stateless method runs beside the counting one, on other threads, without waiting.
        return step(x) if i % 2 == 0 else double(torch.full((4,), float(i)))

    results = in_threads(work, list(range(2 * calls)))

    counts = sorted(int(r[0]) // 2 for r in results[::2])
    # Each call saw both buffers at the same new count, and no two calls the same one.
    assert all(torch.equal(r, r[:1].expand(4)) and int(r[0]) % 2 == 0 for r in results[::2])
    assert counts == list(range(1, calls + 1))
    for i, r in zip(range(1, 2 * calls, 2), results[1::2]):
        assert torch.equal(r, torch.full((4,), 2.0 * i))

    resetting = threading.Thread(target=loaded.reset)
    with step.lock:
        resetting.start()
        resetting.join(timeout=0.2)
        assert resetting.is_alive(), "reset() waits for the state lock"
    resetting.join()
    assert torch.equal(step(x), torch.full((4,), 2.0)), "reset() put the counters back to zero"


FORK = """
import json, os, select, sys, time
import torch
import aotstack

wide_path, stacked_path, counter_path = sys.argv[1:4]
wide, stacked, counter = aotstack.load(wide_path), aotstack.load(stacked_path), aotstack.load(counter_path)
x, small, zeros = torch.randn(1024, 256), torch.randn(4, 16), torch.zeros(4)
# The parent uses its OpenMP threads first: a child's parallel region could wait on them forever.
want_wide, want_stacked = wide.forward(x), stacked.forward(small)
threads = torch.get_num_threads()
counter.step(zeros)

read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    try:
        report = {
            "wide": torch.equal(wide.forward(x), want_wide),
            "stacked": torch.equal(stacked.forward(small), want_stacked),
            # The child has its own copy of the state: its count goes on from the parent's.
            "step": counter.step(zeros).tolist(),
            "threads": torch.get_num_threads(),
        }
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}"}
    os.write(write, json.dumps(report).encode())
    # Not sys.exit: ONNX Runtime's exit-time teardown waits on threads a forked child lacks.
    os._exit(0)
os.close(write)
ready, _, _ = select.select([read], [], [], 120)
child = json.loads(os.read(read, 1 << 16) or b"{}") if ready else {"error": "the child hung"}
if not ready:
    os.kill(pid, 9)
_, status = os.waitpid(pid, 0)
child["exit"] = os.waitstatus_to_exitcode(status)
parent = {"step": counter.step(zeros).tolist(), "threads": torch.get_num_threads(), "parent_threads": threads}
print(json.dumps({"child": child, "parent": parent}))
"""


def test_a_forked_child_can_call_a_program_its_parent_loaded(wide_path, counter_path, lowered_with):
    _, stacked_path = lowered_with("stacked", *ORT_THEN_AOTI)

    result = run_child(FORK, str(wide_path), str(stacked_path), str(counter_path))

    child, parent = result["child"], result["parent"]
    assert "error" not in child, child
    assert child["exit"] == 0
    assert child["wide"] and child["stacked"], "the child's results equal the parent's"
    assert child["step"] == [4.0] * 4, "the child's state went on from the parent's (count 2, tally 2)"
    assert parent["step"] == [4.0] * 4, "the parent's state is its own"
    assert child["threads"] == 1, "GNU OpenMP's threads do not survive fork: the child runs on one"
    assert parent["threads"] == parent["parent_threads"], "the parent's threads are untouched"


TWO_OPENMP_RUNTIMES = """
import json, os, torch
torch.set_num_threads(2)
x = torch.randn(2048, 2048)
x.clone().sum()  # torch's OpenMP pool is running
import sentencepiece  # its wheel bundles a second libgomp
from aotstack.forking import loaded_openmp_libraries, pause_openmp
runtimes = loaded_openmp_libraries()
pause_openmp()
pid = os.fork()
if pid == 0:
    x.clone().sum()  # a parallel region in the child: hangs if torch's pool was not paused
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps({"runtimes": runtimes, "exit": status}))
"""


def test_a_fork_pauses_every_openmp_runtime_loaded(tmp_path):
    """Two libgomp copies (torch's and sentencepiece's): pausing only one left the child waiting forever."""
    pytest.importorskip("sentencepiece")
    child = subprocess.run([sys.executable, "-c", TWO_OPENMP_RUNTIMES], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(result["runtimes"]) >= 2, "the case needs two OpenMP runtimes in one process"
    assert result["exit"] == 0


LIBRARIES_IN_A_CHILD = """
import glob, json, os, sys, tempfile
import torch
import aotstack
from aotstack.compile.child import forked, received

scratch, path = sys.argv[1], sys.argv[2]
tempfile.tempdir = scratch

def load_and_call():
    # The first library this process opens.
    loaded = aotstack.load(path)
    loaded.run("forward", torch.ones(2, 256))
    opened = [line.split()[-2] for line in open("/proc/self/maps") if "memfd:aotstack-" in line]
    return [sorted(set(opened)), glob.glob(os.path.join(scratch, "*"))]

child = forked(load_and_call, (), "loader")
outcome = received(child)
child.process.join()
print(json.dumps({"outcome": outcome[0], "while_running": outcome[1], "after": glob.glob(os.path.join(scratch, "*"))}))
"""

KILLED_AFTER_LOADING = """
import glob, json, os, signal, subprocess, sys

scratch, path = sys.argv[1], sys.argv[2]
loader = (
    "import os, signal, sys, tempfile, torch, aotstack\\n"
    "tempfile.tempdir = sys.argv[1]\\n"
    "aotstack.load(sys.argv[2]).run('forward', torch.ones(2, 256))\\n"
    "os.kill(os.getpid(), signal.SIGKILL)\\n"
)
ended = subprocess.run([sys.executable, "-c", loader, scratch, path], capture_output=True, text=True)
print(json.dumps({"returncode": ended.returncode, "stderr": ended.stderr[-2000:],
                  "left": glob.glob(os.path.join(scratch, "*"))}))
"""


def test_a_lowering_child_that_opens_a_library_leaves_nothing_in_the_temporary_folder(wide_path, tmp_path):
    """Auto's timing and the opening check load files in forked children, which end with ``os._exit``: each
    left a directory of libraries in the temporary folder, as its exit hooks never ran. A library is now opened
    from sealed memory, which ends with the process."""
    result = run_child(LIBRARIES_IN_A_CHILD, str(tmp_path), str(wide_path))

    assert result["outcome"] == "returned"
    opened, files = result["while_running"]
    assert len(opened) == 1 and opened[0].startswith("/memfd:aotstack-"), "the library mapped from sealed memory"
    assert files == [], "no file written while it runs"
    assert result["after"] == []


def test_a_process_killed_after_loading_leaves_no_library_behind(wide_path, tmp_path):
    """A server stopped by SIGTERM or SIGKILL runs no exit hook: a library written to the temporary folder stayed."""
    result = run_child(KILLED_AFTER_LOADING, str(tmp_path), str(wide_path))

    assert result["returncode"] == -9, result["stderr"]
    assert result["left"] == []


def test_an_opened_library_cannot_be_changed_after_it_was_verified(wide_path):
    """The loader reads the library from sealed memory: neither this process nor another can write it."""
    from aotstack.backends.aoti import run as aoti_run

    aotstack.load(wide_path).run("forward", torch.ones(2, 256))
    assert aoti_run._SEALED_LIBRARIES, "the library was opened from sealed memory"
    for fd in aoti_run._SEALED_LIBRARIES:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0", 0)
        with pytest.raises(PermissionError), open(f"/proc/self/fd/{fd}", "r+b") as reopened:
            reopened.write(b"\0")
