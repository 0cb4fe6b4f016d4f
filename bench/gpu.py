"""One command for a GPU machine (``make gpu-check``): does aotstack work there, and how fast is it?

Run by the image's own ``python3`` (it has torch with CUDA; aotstack is not installed, so
``PYTHONPATH=src:.``), in up to four steps, each in fresh processes (``bench/gpu_child.py``):

1. probe (only when ``--steps`` names it): a tiny model compiled as a plain AOTInductor package and as
           an aotstack file, each opened in a fresh process without ``LD_PRELOAD``; the later steps run
           with ``LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6`` where an open dies of a signal. Without
           the probe they run with that preload wherever the file exists (``--no-preload``: never): the
           lent GPU image's python3 segfaults opening any AOTInductor library without it (the probe found
           so on an H100 on 2026-11-25), and its cold compiles made the probe alone take 269 s of a call.
2. tests:  ``pytest tests/test_cuda_end_to_end.py`` and every test marked as needing CUDA elsewhere in
           ``tests/`` (a ``skipif(not torch.cuda.is_available())`` marker); pass/fail counts.
3. corpus: the test suite's transformers corpus (``tests/hf_models.py``) lowered with ``CudaPartitioner``
           (autotune OFF), saved, loaded in one fresh process, compared with eager: one line per model.
4. speed:  per row and dtype, one process compiles nothing and times every column side by side:
           eager, plain AOTI (``aoti_compile_and_package`` on the GPU), ``torch.compile(mode="reduce-overhead")``,
           aotstack (``CudaPartitioner``, autotune OFF, inputs and outputs on the GPU) loaded plain and with
           ``cuda_graphs``; each checked against eager first. Rows: BERT, ResNet-50 (ms per call), the
           99.5 M Llama decode at cache 256 and 2048 and a 0.49 B one at cache 1024 (tokens/s).

The compiles of steps 2 to 4 run side by side (``--jobs``) before anything is timed; torch.compile's
caches are filled then too, so its compile in the timed process is mostly a cache hit. The whole run
keeps to ``--budget`` seconds: builds still running when only the timing's share is left are stopped,
and a row with no time left is skipped; the last lines name what did not run.

    python3 bench/gpu.py [--quick] [--only bert,llama-256] [--dtypes fp32,bf16] [--steps tests,corpus,speed]
                         [--jobs N] [--budget 570] [--no-preload] [--json PATH] [--keep DIR]

Exit status: 0 when every check that ran passed (what the budget left out is named, not failed),
and on a machine without a CUDA GPU (nothing to check); 1 when a test failed, a corpus model did
not match or failed, or a speed cell is WRONG, failed or crashed; 2 when this python has no torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
PRELOAD = "/lib/x86_64-linux-gnu/libstdc++.so.6"
STEPS = ("probe", "tests", "corpus", "speed")
DEFAULT_STEPS = ("tests", "corpus", "speed")
DTYPES = ("fp32", "bf16")
# The speed table's rows (gpu_child.ROWS builds them), their labels, and columns, in order.
ROWS = ("bert", "resnet", "llama-256", "llama-2048", "0.5b-1024")
ROW_LABELS = {
    "bert": "BERT 28.8 M, 128 tokens",
    "resnet": "ResNet-50, 224x224",
    "llama-256": "Llama 99.5 M decode, cache 256",
    "llama-2048": "Llama 99.5 M decode, cache 2048",
    "0.5b-1024": "Llama 0.49 B decode, cache 1024",
}
DECODERS = ("llama-256", "llama-2048", "0.5b-1024")
EAGER, AOTI, COMPILE, STACK, GRAPHS = "eager", "plain AOTI", "torch.compile", "aotstack", "aotstack graphs"
VARIANTS = (EAGER, AOTI, COMPILE, STACK, GRAPHS)
QUICK_ROWS, QUICK_DTYPES = ("bert", "llama-256"), ("fp32",)
QUICK_CORPUS = ("llama", "bert", "resnet", "whisper")
# Seconds one row's measuring process is expected to take (start, loads, torch.compile from warm caches,
# checks, rounds): the timing's share of the budget, which the compiles leave to it. Measured on an H100
# (2026-11-25): llama-256 80 s with every column; bert 46 s and resnet 52 s with only eager and
# torch.compile. The rest are estimates: correct them from a run's log (each row's process prints when it ends).
ROW_SECONDS = {"bert": 60, "resnet": 65, "llama-256": 80, "llama-2048": 90, "0.5b-1024": 150}
FAILED_STATUSES = ("WRONG", "failed", "crashed")
OUT_OF_TIME = "out of time"  # in a reason: skipped for the budget, not failed


def package_path(directory: str, kind: str, row: str, dtype: str) -> str:
    """Where a build of ``kind`` (``aoti``, ``aotstack``) leaves the row's file; its record is beside it."""
    return os.path.join(directory, f"{row}-{dtype}-{kind}.pt2")


def build_record(directory: str, kind: str, row: str, dtype: str) -> str:
    return os.path.join(directory, f"{row}-{dtype}-{kind}.json")


# Running children: each a process group of its own (Inductor's compile workers included), logged to a file.


@dataclass
class Job:
    """One child process: ``gpu_child.py ARGS --result PATH``, or a whole ``command`` (pytest)."""

    name: str
    args: list[str]
    timeout: float
    result: str = ""
    after: tuple[str, ...] = ()  # jobs that must have ended first
    command: list[str] | None = None
    log: str = ""
    process: subprocess.Popen[bytes] | None = None
    started: float | None = None
    seconds: float | None = None
    returncode: int | None = None
    stopped: str = ""  # why it was stopped or never started: "timed out after 300 s", "out of time"

    def outcome(self) -> dict[str, Any] | None:
        if not self.result or not os.path.exists(self.result):
            return None
        with open(self.result) as file:
            return json.load(file)

    def last_stage(self) -> str:
        """The last ``@@`` line the child printed: what it was doing when it ended."""
        stages = [line[3:].strip() for line in log_lines(self.log) if line.startswith("@@ ")]
        return stages[-1] if stages else ""

    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def failure(self) -> str:
        """'' when it ended normally; otherwise how it ended, and what it was doing."""
        doing = f" while {self.last_stage()}" if self.last_stage() else ""
        if self.stopped:
            return f"{self.stopped}{doing}"
        if self.signal_name():
            return f"died of {self.signal_name()}{doing}"
        if self.returncode:
            tail = [line for line in log_lines(self.log) if line.strip() and not line.startswith("@@ ")]
            return f"exit status {self.returncode}{doing}: {tail[-1].strip()[:300] if tail else 'no output'}"
        return ""


def log_lines(path: str) -> list[str]:
    if not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as file:
        return file.read().splitlines()


class Runner:
    """Starts children in one environment, at most ``width`` at a time, in list order as their ``after`` allows."""

    def __init__(self, workdir: str, environment: dict[str, str], width: int = 1) -> None:
        self.workdir = workdir
        self.environment = environment
        self.width = width
        os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)

    def command(self, job: Job) -> list[str]:
        if job.command is not None:
            return job.command
        return [sys.executable, os.path.join(BENCH, "gpu_child.py"), "--result", job.result, *job.args]

    def start(self, job: Job) -> None:
        if not job.result and job.command is None:
            job.result = os.path.join(self.workdir, "logs", f"{safe(job.name)}.json")
        job.log = os.path.join(self.workdir, "logs", f"{safe(job.name)}.log")
        environment = self.environment
        if job.command is not None:  # pytest: the benchmarks' modules (common, load, run, ...) are not its to import
            paths = environment.get("PYTHONPATH", "").split(os.pathsep)
            environment = {**environment, "PYTHONPATH": os.pathsep.join(p for p in paths if p != BENCH)}
        with open(job.log, "wb") as log:
            job.process = subprocess.Popen(self.command(job), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                           env=environment, start_new_session=True)
        job.started = time.perf_counter()

    def stop(self, job: Job, why: str) -> None:
        """Kill the job's process group: the child and the compile workers it started."""
        if job.process is not None and job.process.poll() is None:
            try:
                os.killpg(job.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.process.wait()
        job.stopped = why

    def run(self, jobs: Sequence[Job], deadline: float, done: Callable[[Job], None] = lambda job: None) -> None:
        """Every job to its end, ``done(job)`` as each ends; those still running at ``deadline`` are stopped."""
        waiting, running = list(jobs), []
        try:
            while waiting or running:
                for job in list(running):
                    ended = job.process.poll() is not None
                    assert job.started is not None
                    if not ended and time.perf_counter() - job.started > job.timeout:
                        self.stop(job, f"timed out after {job.timeout:.0f} s")
                    elif not ended and time.perf_counter() > deadline:
                        self.stop(job, f"stopped: {OUT_OF_TIME}")
                    elif not ended:
                        continue
                    job.returncode = job.process.returncode
                    job.seconds = time.perf_counter() - job.started
                    running.remove(job)
                    done(job)
                finished = {job.name for job in jobs if job.seconds is not None or job.stopped}
                for job in list(waiting):
                    if len(running) >= self.width:
                        break
                    if time.perf_counter() > deadline:
                        waiting.remove(job)
                        job.stopped = f"not started: {OUT_OF_TIME}"
                        done(job)
                    elif all(name in finished for name in job.after):
                        waiting.remove(job)
                        self.start(job)
                        running.append(job)
                time.sleep(0.2)
        finally:
            for job in running:
                self.stop(job, "stopped")

    def run_one(self, job: Job, deadline: float | None = None) -> Job:
        self.run([job], deadline if deadline is not None else math.inf)
        return job


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def child_environment(workdir: str, preload: bool, compile_threads: int | None = None) -> dict[str, str]:
    """This environment, with ``bench/``, ``src`` and the repository on the path and private compile caches.

    ``preload``: ``PRELOAD`` in ``LD_PRELOAD``; otherwise ``LD_PRELOAD`` as this process has it.
    """
    from common import cache_env

    environment = {**os.environ, **cache_env(workdir), "PYTHONUNBUFFERED": "1"}
    paths = [BENCH, os.path.join(REPO, "src"), REPO, environment.get("PYTHONPATH", "")]
    environment["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if preload:
        environment["LD_PRELOAD"] = " ".join(p for p in (PRELOAD, environment.get("LD_PRELOAD", "")) if p)
    if compile_threads is not None:
        environment["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    return environment


# Step 1: the probe.


@dataclass
class Probe:
    """What the probe found: whether the later steps need the preload, and one line per open."""

    preload: bool = False
    lines: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"preload": self.preload, "lines": self.lines}


PROBES = {"plain": "plain AOTI (aoti_load_package)", "aotstack": "aotstack (aotstack.load)"}


def probe(workdir: str, device: str) -> Probe:
    """Compile the two tiny packages, then open each in a fresh process without ``LD_PRELOAD``; side by side."""
    from common import progress

    directory = os.path.join(workdir, "probe")
    os.makedirs(directory)
    bare = Runner(workdir, without_preload(child_environment(workdir, False)), width=2)
    preloaded = Runner(workdir, child_environment(workdir, True), width=2)
    found = Probe()
    progress("probe: compiling a tiny model as a plain AOTI package and as an aotstack file ...")
    built = probe_jobs("probe-build", directory, device, 300)
    bare.run(list(built.values()), math.inf)
    if any(job.signal_name() for job in built.values()):
        found.preload = True
        found.lines += [f"compiling {kind} without LD_PRELOAD {job.failure()}" for kind, job in built.items()
                        if job.signal_name()]
        built = probe_jobs("probe-build-preloaded", directory, device, 300)
        preloaded.run(list(built.values()), math.inf)
    failed = [f"{kind}: {job.failure() or 'no result'}" for kind, job in built.items()
              if job.failure() or job.outcome() is None]
    if failed:
        found.lines.append(f"compiling the probe's packages failed: {'; '.join(failed)}")
        print_lines(found.lines)
        return found
    seconds = {kind: (job.outcome() or {}).get("seconds", 0.0) for kind, job in built.items()}
    found.lines.append("compiled: " + ", ".join(f"{kind} in {value:.1f} s" for kind, value in seconds.items()))
    opened = probe_jobs("probe-open", directory, device, 120)
    bare.run(list(opened.values()), math.inf)
    crashed = [kind for kind, job in opened.items() if job.signal_name()]
    again = probe_jobs("probe-open-preloaded", directory, device, 120, crashed)
    preloaded.run(list(again.values()), math.inf)
    for kind, job in opened.items():
        line = f"{PROBES[kind]}, no LD_PRELOAD: {open_text(job)}"
        if kind in again:
            line += f"; with LD_PRELOAD={PRELOAD}: {open_text(again[kind])}"
        found.lines.append(line)
    found.preload = found.preload or bool(crashed)
    if found.preload and not os.path.exists(PRELOAD):
        found.lines.append(f"{PRELOAD} does not exist here: the later steps run without it")
        found.preload = False
    elif found.preload:
        found.lines.append(f"=> every later step runs with LD_PRELOAD={PRELOAD}, so the rest still gives figures")
    else:
        found.lines.append("=> both open without LD_PRELOAD; the later steps run without it")
    print_lines(found.lines)
    return found


def probe_jobs(command: str, directory: str, device: str, timeout: float,
               kinds: Sequence[str] = tuple(PROBES)) -> dict[str, Job]:
    verb = command.removesuffix("-preloaded")
    return {kind: Job(f"{command}-{kind}", [verb, kind, directory, device], timeout) for kind in kinds}


def without_preload(environment: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items() if name != "LD_PRELOAD"}


def open_text(job: Job) -> str:
    outcome = job.outcome()
    if job.failure() or outcome is None:
        return ("does NOT survive: " if job.signal_name() else "FAILED: ") + (job.failure() or "no result")
    return f"survives (opened in {outcome['open_s']:.2f} s, max |difference from eager| {outcome['max_abs']:.1e})"


def print_lines(lines: Sequence[str], indent: str = "    ") -> None:
    for line in lines:
        print(indent + line, flush=True)


# Step 2: the CUDA tests.


def needs_cuda_marker(node: ast.expr) -> bool:
    """``skipif(not ....cuda.is_available(), ...)``: skipped without CUDA (not the tests that check its absence)."""
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func).endswith("skipif")
        and bool(node.args)
        and isinstance(node.args[0], ast.UnaryOp)
        and isinstance(node.args[0].op, ast.Not)
        and "cuda.is_available" in ast.unparse(node.args[0].operand)
    )


def cuda_test_ids(tests: str, whole: Sequence[str] = ("test_cuda_end_to_end.py",)) -> list[str]:
    """The ``whole`` files, and every test elsewhere in ``tests`` that needs CUDA, as pytest node ids.

    A test needs CUDA when a decorator of it (or of its class, or the module's ``pytestmark``) is such
    a ``skipif``, or a name bound to one (``needs_cuda = pytest.mark.skipif(...)``).
    """
    ids = [os.path.join(os.path.basename(tests), name) for name in whole]
    for name in sorted(os.listdir(tests)):
        if not (name.startswith("test_") and name.endswith(".py")) or name in whole:
            continue
        with open(os.path.join(tests, name)) as file:
            module = ast.parse(file.read())
        markers = {target.id for node in module.body if isinstance(node, ast.Assign) and needs_cuda_marker(node.value)
                   for target in node.targets if isinstance(target, ast.Name)}

        def marked(decorators: list[ast.expr], markers: set[str] = markers) -> bool:
            return any(needs_cuda_marker(d) or ast.unparse(d).split(".")[-1] in markers for d in decorators)

        path = os.path.join(os.path.basename(tests), name)
        module_marks = [node.value for node in module.body if isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
        if marked([e for mark in module_marks for e in (mark.elts if isinstance(mark, ast.List) else [mark])]):
            ids.append(path)
            continue
        for node in module.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and marked(node.decorator_list):
                ids.append(f"{path}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                if marked(node.decorator_list):
                    ids.append(f"{path}::{node.name}")
                    continue
                ids += [f"{path}::{node.name}::{item.name}" for item in node.body
                        if isinstance(item, ast.FunctionDef) and marked(item.decorator_list)]
    return ids


def tests_job(workdir: str, timeout: float) -> Job:
    report = os.path.join(workdir, "logs", "pytest.xml")
    ids = cuda_test_ids(os.path.join(REPO, "tests"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *ids]
    return Job("pytest", ids, timeout, result=report, command=command)


def tests_summary(job: Job) -> tuple[list[str], str]:
    """Lines to print, and ``passed``, ``failed`` or ``incomplete`` (stopped for the budget)."""
    lines = [f"{len(job.args)} selection(s): {' '.join(job.args)}"]
    if job.stopped or not os.path.exists(job.result):
        tail = [line for line in log_lines(job.log) if line.strip()][-15:]
        verdict = "incomplete" if OUT_OF_TIME in job.failure() else "failed"
        return [*lines, f"pytest gave no report: {job.failure() or 'no report'}", *tail], verdict
    root = ElementTree.parse(job.result).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    lines.append(f"{passed} passed, {count['failures']} failed, {count['errors']} errors, {count['skipped']} skipped "
                 f"in {job.seconds or 0:.0f} s")
    for case in root.iter("testcase"):
        for problem in [*case.findall("failure"), *case.findall("error")]:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            lines.append(f"  {problem.tag.upper()}: {case.get('classname')}::{case.get('name')}: "
                         f"{message[0][:200] if message else ''}")
    passed = count["failures"] + count["errors"] == 0 and job.returncode in (0, 5)
    return lines, "passed" if passed else "failed"


# Step 3: the corpus.


def corpus_names(quick: bool) -> list[str]:
    if quick:
        return list(QUICK_CORPUS)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests.hf_models import CORPUS  # builds nothing: the names only

    return list(CORPUS)


def corpus_jobs(directory: str, device: str, names: Sequence[str], chunks: int) -> list[Job]:
    """Lowering in ``chunks`` processes side by side, then one fresh process loading every file."""
    size = max(1, math.ceil(len(names) / chunks))
    groups = [list(names[i:i + size]) for i in range(0, len(names), size)]
    builds = [Job(f"corpus-build-{i}", ["corpus-build", directory, device, *group], timeout=480)
              for i, group in enumerate(groups)]
    run = Job("corpus-run", ["corpus-run", directory, device, *names], timeout=240,
              after=tuple(job.name for job in builds))
    return [*builds, run]


def corpus_summary(jobs: Sequence[Job], names: Sequence[str]) -> dict[str, Any]:
    """Print one line per model (match, max |difference|, delegates); per model its figures and verdict."""
    from common import print_table

    built: dict[str, dict[str, Any]] = {}
    for job in jobs[:-1]:
        outcome = job.outcome()
        for name in job.args[3:]:
            built[name] = (outcome or {}).get(name) or {"error": f"its lowering process {job.failure() or 'ended'}"}
    ran = jobs[-1].outcome() or {}
    figures, rows = {}, []
    for name in names:
        lowering, running = built.get(name, {}), ran.get(name)
        if "error" in lowering:
            verdict, difference = f"FAILED to lower: {lowering['error'][:160]}", "-"
        elif running is None:
            verdict, difference = f"not run: the loading process {jobs[-1].failure() or 'gave no result'}", "-"
        elif "error" in running:
            verdict, difference = f"FAILED to run: {running['error'][:160]}", "-"
        else:
            verdict = "match" if running["match"] else f"MISMATCH: {running['why']}"
            difference = "-" if running["max_abs"] is None else f"{running['max_abs']:.1e}"
        seconds = lowering.get("seconds")
        rows.append([name, verdict, difference, lowering.get("delegates", "-"),
                     "-" if seconds is None else f"{seconds:.0f} s"])
        figures[name] = {"lowering": lowering, "run": running, "verdict": verdict}
    print_table(["model", "result", "max |diff|", "delegates", "lowered in"], rows)
    return figures


# Step 4: the speed table.


def speed_build_jobs(directory: str, device: str, size: str, cases: Sequence[tuple[str, str]]) -> list[Job]:
    """Per row and dtype: the plain AOTI package, the aotstack file, and torch.compile's caches filled."""
    jobs = []
    for row, dtype in cases:
        for kind in ("aoti", "aotstack", "warm"):
            jobs.append(Job(f"{kind}:{row}-{dtype}", ["build", kind, row, dtype, directory, device, size],
                            timeout=540, result=build_record(directory, kind, row, dtype)))
    return jobs


@dataclass(frozen=True)
class Timing:
    rounds: int
    decoder_rounds: int
    tokens: int
    block: float


def measure_row(runner: Runner, directory: str, device: str, size: str, row: str, dtype: str, timing: Timing,
                deadline: float) -> dict[str, dict[str, Any]]:
    """The row's cells, from one measuring process; a column that crashes it is left out and the row run again."""
    skip: list[str] = []
    crashed: dict[str, str] = {}
    decoder = row in DECODERS
    while True:
        left = deadline - time.perf_counter()
        if left < 15:
            cells = {name: {"status": "n/a", "reason": f"skipped: {OUT_OF_TIME}"} for name in VARIANTS}
            break
        rounds = timing.decoder_rounds if decoder else timing.rounds
        args = ["measure", row, dtype, directory, device, size, "--rounds", str(rounds), "--tokens",
                str(timing.tokens), "--block", str(timing.block), *(["--skip", *skip] if skip else [])]
        job = runner.run_one(Job(f"measure:{row}-{dtype}-{len(skip)}", args, timeout=min(420, left)), deadline)
        outcome = job.outcome()
        if outcome is not None:
            cells = outcome["cells"]
            break
        stage = job.last_stage()
        culprit = next((name for name in VARIANTS if stage.endswith(f" {name}")), None)
        if job.signal_name() and culprit is not None and culprit not in skip:
            crashed[culprit] = job.failure()
            skip.append(culprit)
            continue
        status = "n/a" if OUT_OF_TIME in job.failure() else "failed"
        cells = {name: {"status": status, "reason": f"the measuring process {job.failure()}"} for name in VARIANTS}
        break
    for name, why in crashed.items():
        cells[name] = {"status": "crashed", "reason": f"the measuring process {why}; the row ran again without it"}
    return cells


def cell_text(cell: dict[str, Any], eager: dict[str, Any] | None, decoder: bool, note: Callable[[str], int]) -> str:
    """``1.23 (4.5x)``: the median and its speed over eager's; otherwise the status and a note's number."""
    from common import quantity

    status, value = cell.get("status", "failed"), cell.get("value")
    if status in ("ok", "tie") and value is not None:
        text = quantity(value, "")
        if eager is not None and eager.get("value") and eager is not cell:
            text += f" ({speedup(value, eager['value'], decoder):.2f}x)"
        text += f" *[{note(cell['reason'])}]" if status == "tie" else ""
        return text + (f" [{note(cell['note'])}]" if cell.get("note") else "")
    reason = cell.get("reason", "")
    if status == "n/a" and reason.startswith("n/a"):
        return reason
    return f"{status} [{note(reason)}]" if reason else status


def speedup(value: float, baseline: float, decoder: bool) -> float:
    """How many times faster than ``baseline``: tokens/s over tokens/s, or ms over ms the other way round."""
    return value / baseline if decoder else baseline / value


def ratio_text(cells: dict[str, dict[str, Any]], name: str, baseline: str, decoder: bool) -> str:
    a, b = cells.get(name, {}), cells.get(baseline, {})
    if a.get("status") in ("ok", "tie") and b.get("status") in ("ok", "tie") and a.get("value") and b.get("value"):
        return f"{speedup(a['value'], b['value'], decoder):.2f}x"
    return "-"


def print_speed(results: dict[tuple[str, str], dict[str, dict[str, Any]]], labels: dict[str, str]) -> None:
    from common import print_table

    notes: dict[str, int] = {}

    def note(text: str) -> int:
        return notes.setdefault(text, len(notes) + 1)

    rows, details = [], []
    for (row, dtype), cells in results.items():
        decoder = row in DECODERS
        eager = cells.get(EAGER)
        rows.append([row, dtype, "tokens/s" if decoder else "ms",
                     *(cell_text(cells.get(name, {}), eager, decoder, note) for name in VARIANTS),
                     ratio_text(cells, STACK, AOTI, decoder), ratio_text(cells, GRAPHS, COMPILE, decoder)])
        said = [f"{name}: {cells[name]['detail']}" for name in VARIANTS if cells.get(name, {}).get("detail")]
        if said:
            details.append(f"  {row} {dtype}: {'; '.join(said)}")
    print("\n  median of the rounds, batch 1, TF32 off, autotune off; (x): times as fast as eager; the last two "
          "columns:\n  aotstack's speed over plain AOTI's, aotstack with CUDA graphs over torch.compile's "
          "(reduce-overhead); > 1: aotstack faster")
    print_table(["row", "dtype", "unit", *VARIANTS, "aotstack/AOTI", "graphs/compile"], rows)
    for text, number in notes.items():
        print(f"  [{number}] {text}")
    print("  rows: " + "; ".join(f"{name}: {label}" for name, label in labels.items()))
    if details:
        print("  details:")
        print("\n".join(details))


# The whole run.


def versions() -> str:
    found = []
    for name in ("torch", "transformers", "onnxruntime", "pytest", "cryptography"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    return ", ".join(found)


def comma_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(allowed)}")
        return values

    return parse


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: rows {','.join(QUICK_ROWS)} in {','.join(QUICK_DTYPES)}, "
                             f"corpus {','.join(QUICK_CORPUS)}, fewer rounds and tokens")
    parser.add_argument("--only", type=comma_list(ROWS), default=None, metavar="ROWS",
                        help=f"speed rows, of {','.join(ROWS)}")
    parser.add_argument("--dtypes", type=comma_list(DTYPES), default=None, help="fp32,bf16 (default both)")
    parser.add_argument("--steps", type=comma_list(STEPS), default=list(DEFAULT_STEPS),
                        help=f"of {','.join(STEPS)} (default {','.join(DEFAULT_STEPS)})")
    parser.add_argument("--jobs", type=int, default=None, help="compiles side by side (default: cores / 3, at most 6)")
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole run (default 570)")
    parser.add_argument("--no-preload", dest="preload", action="store_false",
                        help=f"never set LD_PRELOAD={PRELOAD} (default: set where the file exists, or where the "
                             "probe, when asked for, finds an open dies without it)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every result here")
    parser.add_argument("--keep", default=None, metavar="DIR", help="work in DIR (packages, logs) and keep it")
    # A smoke run of the machinery on the host: small models, AotiCpuPartitioner, no CUDA graphs.
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = options(argv)
    if importlib.util.find_spec("torch") is None:
        print(f"{sys.executable} has no torch: run this with the GPU image's python3 (make gpu-check GPU_PYTHON=...)")
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA GPU: nothing to check (torch {torch.__version__} sees none); exit status 0")
        return 0
    if BENCH not in sys.path:  # imported as bench.gpu: the benchmarks' modules import one another by name
        sys.path.insert(0, BENCH)
    workdir = args.keep or tempfile.mkdtemp(prefix="aotstack-gpu-")
    os.makedirs(workdir, exist_ok=True)
    try:
        return run(plan_of(args, workdir))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class Plan:
    """What one run does, and by when."""

    args: argparse.Namespace
    workdir: str
    device: str  # cuda, or cpu in the smoke mode
    size: str  # the models' size: full, or quick (the smoke mode's small ones)
    cases: list[tuple[str, str]]  # speed rows: (row, dtype)
    timing: Timing
    width: int  # compiles side by side
    compile_threads: int  # Inductor's compile workers per process
    started: float
    deadline: float

    @property
    def packages(self) -> str:
        return os.path.join(self.workdir, "packages")

    def environment(self, preload: bool) -> dict[str, str]:
        # One Inductor configuration for every child: torch.compile's cache key includes it.
        return child_environment(self.workdir, preload, self.compile_threads)


def plan_of(args: argparse.Namespace, workdir: str) -> Plan:
    cores = os.cpu_count() or 1
    width = args.jobs or max(1, min(6, cores // 3))
    rows = args.only or list(QUICK_ROWS if args.quick else ROWS)
    dtypes = args.dtypes or list(QUICK_DTYPES if args.quick else DTYPES)
    started = time.perf_counter()
    return Plan(args, workdir, args.device, "full" if args.device == "cuda" else "quick",
                [(row, dtype) for row in rows for dtype in dtypes],
                Timing(2, 2, 16, 0.05) if args.quick else Timing(5, 3, 64, 0.2),
                width, max(1, cores // width), started, started + args.budget)


def run(plan: Plan) -> int:
    """Every step asked for, in order; 0 where everything ran and matched, else 1."""
    import torch

    import aotstack

    args = plan.args
    where = torch.cuda.get_device_name() if plan.device == "cuda" else "the host (smoke mode: small models)"
    graphs = "cuda_graphs" in inspect.signature(aotstack.load).parameters
    print(f"aotstack GPU check on {where}: {sys.executable} (Python {sys.version.split()[0]}), {versions()}, "
          f"torch CUDA {torch.version.cuda}, {os.cpu_count()} cores; {plan.width} compiles side by side; budget "
          f"{args.budget:.0f} s; aotstack.load {'takes' if graphs else 'has no'} cuda_graphs", flush=True)
    report: dict[str, Any] = {"device": where, "versions": versions(), "quick": args.quick}
    phases: dict[str, float] = {}

    preload = args.preload and os.path.exists(PRELOAD)
    if "probe" in args.steps:
        print("\n== 1. probe: open an AOTInductor library without LD_PRELOAD", flush=True)
        found = probe(plan.workdir, plan.device)
        preload = args.preload and found.preload
        report["probe"] = found.as_json()
    print(f"\n   every later step runs {f'with LD_PRELOAD={PRELOAD}' if preload else 'without LD_PRELOAD'}",
          flush=True)
    phases["probe"] = time.perf_counter() - plan.started

    tests, corpus, names = compile_everything(plan, preload, report)
    phases["compiles"] = time.perf_counter() - plan.started - sum(phases.values())
    failed: list[str] = []
    incomplete: list[str] = []
    if tests is not None:
        print("\n== 2. tests: the CUDA tests (pytest)", flush=True)
        lines, verdict = tests_summary(tests)
        print_lines(lines)
        if verdict != "passed":
            (incomplete if verdict == "incomplete" else failed).append("the tests")
        report["tests"] = {"lines": lines, "verdict": verdict}
    if corpus:
        partitioner = "CudaPartitioner (autotune OFF)" if plan.device == "cuda" else "AotiCpuPartitioner"
        print(f"\n== 3. corpus: {len(names)} transformers models, {partitioner}, loaded in a fresh process, against "
              "eager on the host", flush=True)
        report["corpus"] = corpus_summary(corpus, names)
        for name, figures in report["corpus"].items():
            if figures["verdict"] != "match":
                (incomplete if OUT_OF_TIME in figures["verdict"] else failed).append(f"corpus {name}")
    if "speed" in args.steps and plan.cases:
        results = time_rows(plan, preload)
        for (row, dtype), cells in results.items():
            failed += [f"{row} {dtype} {name}" for name, c in cells.items() if c.get("status") in FAILED_STATUSES]
            incomplete += [f"{row} {dtype} {name}" for name, c in cells.items() if OUT_OF_TIME in c.get("reason", "")]
        report["speed"] = {f"{row} {dtype}": cells for (row, dtype), cells in results.items()}
        phases["timing"] = time.perf_counter() - plan.started - sum(phases.values())
    total = time.perf_counter() - plan.started
    print()
    if failed:
        print(f"SOME CHECKS FAILED: {', '.join(failed)}")
    if incomplete:
        print(f"NOT RUN for lack of time (--budget {args.budget:.0f} s): {', '.join(incomplete)}; run them in a second "
              "call (--only, --dtypes, --steps)")
    if not failed:
        print("every check that ran passed")
    print(f"{total:.0f} s in all (" + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in phases.items()) + ")",
          flush=True)
    good = not failed
    report.update(seconds=total, phases=phases, failed=failed, incomplete=incomplete)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0 if good else 1


def compile_everything(plan: Plan, preload: bool, report: dict[str, Any]) -> tuple[Job | None, list[Job], list[str]]:
    """The tests, the corpus and the speed rows' builds, side by side; stopped where only the timing's share is left.

    The timing's share: what the speed rows are expected to take (``ROW_SECONDS``). Returns the tests'
    job, the corpus' jobs and its model names.
    """
    from common import progress

    args = plan.args
    jobs: list[Job] = []
    if "tests" in args.steps and importlib.util.find_spec("pytest") is None:
        print(f"\n== 2. tests: skipped: {sys.executable} has no pytest (carry its wheel: see the README)")
    elif "tests" in args.steps:
        jobs.append(tests_job(plan.workdir, timeout=480))
    names = corpus_names(args.quick) if "corpus" in args.steps else []
    corpus = corpus_jobs(os.path.join(plan.workdir, "corpus"), plan.device, names, min(3, plan.width)) if names else []
    builds = speed_build_jobs(plan.packages, plan.device, plan.size, plan.cases) if "speed" in args.steps else []
    # Longest first: the 0.5 B decoder's builds, the tests, the corpus, then the smaller rows.
    big = [job for job in builds if "0.5b" in job.name]
    jobs = [*big, *jobs, *corpus, *(job for job in builds if job not in big)]
    if not jobs:
        return None, [], []
    share = sum(ROW_SECONDS[row] for row, _ in plan.cases) * (0.5 if args.quick else 1) if builds else 0
    build_deadline = plan.deadline - share
    for directory in (plan.packages, os.path.join(plan.workdir, "corpus")):
        os.makedirs(directory, exist_ok=True)
    left = max(0, build_deadline - time.perf_counter())
    print(f"\n   compiling side by side: {len(jobs)} processes, {plan.width} at a time, for at most {left:.0f} s "
          f"(then {share:.0f} s are left for the timing)", flush=True)

    def done(job: Job) -> None:
        progress(job_line(job))
        if job in builds and job.outcome() is None:  # the row's measuring process reads why its file is missing
            with open(job.result, "w") as file:
                json.dump({"error": job.failure() or "no result", "out_of_time": OUT_OF_TIME in job.failure()}, file)

    Runner(plan.workdir, plan.environment(preload), plan.width).run(jobs, build_deadline, done)
    report["jobs"] = {job.name: {"seconds": job.seconds, "failure": job.failure()} for job in jobs}
    tests = next((job for job in jobs if job.name == "pytest"), None)
    return tests, corpus, names


def time_rows(plan: Plan, preload: bool) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """Each row timed in a process of its own, one after another (nothing else running); the table."""
    from common import progress

    print(f"\n== 4. speed: {len(plan.cases)} row(s), each timed in one process, columns side by side", flush=True)
    runner = Runner(plan.workdir, plan.environment(preload))
    results: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row, dtype in plan.cases:
        cells = measure_row(runner, plan.packages, plan.device, plan.size, row, dtype, plan.timing, plan.deadline)
        results[(row, dtype)] = cells
        progress(f"{row} {dtype}: " + ", ".join(f"{name} {short_cell(cells.get(name, {}))}" for name in VARIANTS))
    labels = {row: ROW_LABELS[row] for row in dict.fromkeys(row for row, _ in plan.cases)}
    if plan.size != "full":
        labels = {row: f"{label} (smoke mode: a small model of this architecture)" for row, label in labels.items()}
    print_speed(results, labels)
    return results


def job_line(job: Job) -> str:
    failure = job.failure()
    outcome = job.outcome() if job.command is None else None
    if not failure and outcome and "error" in outcome:
        failure = outcome["error"][:200]
    took = f" in {job.seconds:.0f} s" if job.seconds is not None else ""
    return f"{job.name}: {'FAILED: ' + failure if failure else 'done'}{took}"


def short_cell(cell: dict[str, Any]) -> str:
    from common import quantity

    if cell.get("status") in ("ok", "tie") and cell.get("value") is not None:
        return quantity(cell["value"], "") + ("*" if cell["status"] == "tie" else "")
    return cell.get("status", "-")


if __name__ == "__main__":
    sys.exit(main())
