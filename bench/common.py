"""Helpers shared by the benchmarks: settings, figures, packages, round-robin timing, fresh processes, tables."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import aotstack

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)


@dataclass(frozen=True)
class Settings:
    """What every benchmark function takes: a private scratch directory, thread count, how thorough."""

    workdir: str
    threads: int = 1
    quick: bool = False
    calls: int | None = None  # timed rounds of the round-robin benchmarks; None: by ``quick``
    warmup: int | None = None

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full

    def rounds(self) -> tuple[int, int]:
        """(timed rounds, warm-up rounds) for round-robin timing."""
        return self.calls or self.pick(2000, 300), self.warmup or self.pick(100, 30)

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)


@dataclass
class Figure:
    """One measured figure. With a baseline, its ratio to it; with a target, pass or miss.

    The target bounds the ratio when there is a baseline and the value when there is none; it is a
    ceiling unless ``higher_is_better``. ``value`` None: not measured here, ``note`` says why.
    """

    value: float | None
    unit: str
    baseline: float | None = None
    target: float | None = None
    higher_is_better: bool = False
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline:
            return None
        return self.value / self.baseline

    @property
    def checked(self) -> float | None:
        """The number the target applies to."""
        return self.ratio if self.baseline is not None else self.value

    @property
    def result(self) -> str | None:
        if self.target is None or self.checked is None:
            return None
        met = self.checked >= self.target if self.higher_is_better else self.checked <= self.target
        return "pass" if met else "miss"

    def target_text(self) -> str:
        if self.target is None:
            return ""
        bound = ">=" if self.higher_is_better else "<="
        return f"{bound} {self.target:g}x" if self.baseline is not None else f"{bound} {self.target:g} {self.unit}"

    def as_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "target": self.target,
            "target_on": None if self.target is None else ("ratio" if self.baseline is not None else "value"),
            "better": "higher" if self.higher_is_better else "lower",
            "result": self.result,
            "note": self.note,
        }


Figures = dict[str, Figure]


def quantity(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 100:
        digits = 0
    else:
        digits = min(3, max(1, 2 - math.floor(math.log10(abs(value)))))
    return f"{value:.{digits}f} {unit}".rstrip()


def figure_rows(figures: Figures, prefix: str = "") -> list[list[str]]:
    return [
        [
            prefix + name,
            quantity(f.value, f.unit),
            quantity(f.baseline, f.unit),
            "" if f.ratio is None else f"{f.ratio:.3f}x",
            f.target_text(),
            f.result or ("n/a" if f.value is None else ""),
        ]
        for name, f in figures.items()
    ]


FIGURE_HEADERS = ["figure", "value", "baseline", "ratio", "target", "result"]


def print_figures(figures: Figures) -> None:
    print()
    print_table(FIGURE_HEADERS, figure_rows(figures))
    notes = [f"  {name}: {f.note}" for name, f in figures.items() if f.note]
    if notes:
        print("\nnotes:")
        print("\n".join(notes))


def quiet_known_warnings() -> None:
    """torch warns about its own deprecated LeafSpec while AOTInductor deep-copies a program."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)


def cache_env(directory: str) -> dict[str, str]:
    """Environment variables sending aotstack's and Inductor's compile caches under ``directory``."""
    return {
        "AOTSTACK_CACHE_DIR": os.path.join(directory, "aotstack-cache"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(directory, "inductor-cache"),
    }


def use_private_caches(directory: str) -> None:
    """Send this process's (and its children's) compile caches under ``directory``.

    Results then do not depend on what the user's caches hold. Inductor specialises CPU kernels on
    ``torch.get_num_threads()``, and a library compiled under another thread count must not come back.
    """
    os.environ.update(cache_env(directory))


def progress(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def lower_and_save(
    program: aotstack.Program,
    path: str,
    partitioners: Sequence[aotstack.Partitioner],
    keep_on_device: bool = False,
    **options: Any,
) -> aotstack.LoweredProgram:
    """``aotstack.lower`` then ``save``; ``keep_on_device``: the methods take and return device tensors."""
    lowered = aotstack.lower(
        program,
        list(partitioners),
        skip_h2d_for_method_inputs=keep_on_device,
        skip_d2h_for_method_outputs=keep_on_device,
        **options,
    )
    lowered.save(path)
    return lowered


def build_aotstack(model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: Sequence[str] = ()) -> int:
    """Lower ``model.forward`` with the AOTI CPU partitioner, save it to ``path``; the delegate count."""
    return len(build_lowered(model, args, path, [aotstack.AotiCpuPartitioner(exclude_ops=list(exclude_ops))]))


def build_lowered(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    path: str,
    partitioners: Sequence[aotstack.Partitioner],
    keep_on_device: bool = False,
) -> list[aotstack.Delegate]:
    """Lower ``model.forward`` with ``partitioners`` in order, save it to ``path``; its delegates."""
    program = aotstack.export(model, {"forward": args})
    return lower_and_save(program, path, partitioners, keep_on_device).delegates("forward")


def build_raw_aoti(model: torch.nn.Module, args: tuple[Any, ...], path: str) -> None:
    """The baseline: the whole model through stock ``aoti_compile_and_package``."""
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(torch.export.export(model, args), package_path=path)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


EAGER = "eager (no_grad)"


@dataclass
class Variant:
    """One way of running a model, timed call by call."""

    name: str
    call: Callable[[], Any]
    delegates: int | None = None  # None: not an aotstack package
    samples_ns: list[int] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return median(self.samples_ns) / 1e3


def eager_call(model: torch.nn.Module, args: tuple[Any, ...]) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return model(*args)

    return call


def measure(variants: Sequence[Variant], calls: int, warmup: int, seed: int = 0) -> None:
    """One call of each variant per round, in a shuffled order (seeded); warm-up rounds are dropped.

    Shuffling keeps a variant from always following the same neighbour, whose caches it would inherit.
    """
    order = list(variants)
    shuffle = random.Random(seed).shuffle
    gc.collect()
    gc.disable()
    try:
        for round_index in range(warmup + calls):
            shuffle(order)
            for variant in order:
                started = time.perf_counter_ns()
                variant.call()
                elapsed = time.perf_counter_ns() - started
                if round_index >= warmup:
                    variant.samples_ns.append(elapsed)
    finally:
        gc.enable()


def child_command(args: Sequence[str], env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``python bench/child.py args...``.

    ``bench/`` and the repository root are on the child's path; ``env`` is added to this environment.
    """
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, REPO, environment.get("PYTHONPATH")) if p)
    return [sys.executable, os.path.join(BENCH, "child.py"), *args], environment


def run_child(args: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python bench/child.py args...`` in a fresh process; the JSON object on its last line of output."""
    command, environment = child_command(args, env)
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Worker:
    """A file open in an engine, in a process of its own (``bench/child.py serve``), as a user's process runs one.

    Engines keep thread pools per process (ExecuTorch's XNNPACK pool is one per process: files side by side would
    all run on the pool the first one started), and one that dies (OpenVINO's compile, of SIGFPE) takes only its
    own process. A forward (``inputs``: a ``save_inputs`` file of its arguments) answers ``output`` and ``block``;
    a decoder ``generate`` and ``forced``. Raises where the engine cannot open the file.
    """

    def __init__(self, kind: str, path: str, threads: int, inputs: str | None = None, state: str | None = None,
                 precision: str = "f32") -> None:
        options = [*(["--inputs", inputs] if inputs else []), *(["--state", state] if state else [])]
        command, environment = child_command(["serve", kind, path, str(threads), *options, "--precision", precision])
        self.name = f"{kind} {os.path.basename(path)}"
        self.errors = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                        text=True, env=environment)
        try:
            self.answer()  # {"ready": true} once the engine has opened the file
        except Exception:
            self.close()
            raise

    def ask(self, **request: Any) -> dict[str, Any]:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the process ended: answer() says how
        return self.answer()

    def answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            ended = self.process.wait()
            how = f"killed by {signal.Signals(-ended).name}" if ended < 0 else f"exit status {ended}"
            self.errors.seek(0)
            last = [line.strip() for line in self.errors.read().splitlines() if line.strip()][-3:]
            raise RuntimeError(f"{self.name}: its process ended ({how}): {' / '.join(last)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def output(self) -> torch.Tensor:
        """A forward's output, one call."""
        return self.saved(output=True)

    def block(self, calls: int) -> float:
        """A forward's milliseconds per call over ``calls`` back-to-back calls."""
        return self.ask(block=calls)["ms"]

    def generate(self, tokens: int) -> tuple[list[int], float]:
        """From a reset: the prompt, then ``tokens`` greedy tokens; the tokens and the seconds their steps took."""
        reply = self.ask(generate=tokens)
        return reply["tokens"], reply["seconds"]

    def forced(self, sequence: Sequence[int]) -> torch.Tensor:
        """From a reset, one step per token of ``sequence``: each step's last-position logits, stacked."""
        return self.saved(forced=list(sequence))

    def saved(self, **request: Any) -> torch.Tensor:
        """The tensor the worker saves answering ``request``."""
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "answer.pt")
            self.ask(**request, path=path)
            return torch.load(path, weights_only=True)

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.errors.close()


def save_inputs(path: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> str:
    """Store a call's arguments for a child process to read with ``torch.load(weights_only=True)``."""
    torch.save({"args": list(args), "kwargs": kwargs or {}}, path)
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-align the first column, right-align the others."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        return "  ".join([first, *(str(c).rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def standalone_parser(description: str | None, round_robin: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark script takes: --threads, --quick; round-robin ones also --calls, --warmup."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, for compiling and running")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    if round_robin:
        parser.add_argument("--calls", type=int, default=None, help="timed rounds (one call per variant each)")
        parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    return parser


def run_standalone(
    description: str | None,
    benchmark: Callable[..., Figures],
    round_robin: bool = False,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """A benchmark script's ``main``: parse its options, run it under private caches, print its figures.

    ``extra`` adds the script's own options; every option beyond the shared ones is passed to
    ``benchmark`` as a keyword.
    """
    import tempfile

    parser = standalone_parser(description, round_robin)
    if extra is not None:
        extra(parser)
    options = vars(parser.parse_args())
    calls, warmup = options.pop("calls", None), options.pop("warmup", None)
    if calls is not None and calls < 200:
        parser.error("--calls must be at least 200")
    threads, quick = options.pop("threads"), options.pop("quick")
    quiet_known_warnings()
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, torch.get_num_threads() = {threads}")
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_caches(directory)
        settings = Settings(directory, threads, quick, calls, warmup)
        print_figures(benchmark(settings, **options))
