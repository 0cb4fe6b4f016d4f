"""Time a lowered program as a user runs it: saved, loaded, each method called on its example inputs.

``lower(..., "auto")`` compares engines by these figures. Like the numerical check, it runs what
was packaged the way a user loads it, so it is the other place the compiler uses the runtime.

The load and the calls run in a child forked for each plan (``child.py``): an engine that crashes
loading its part or running it (OpenVINO compiles its model at load, and can die of SIGFPE there)
ends the child, and the plan fails with an ``EngineCrashError`` naming the engine, what it was
doing and the signal, for auto to report while it goes on with the other plans. The child times
what a user's process would run: the file loaded fresh, in this process's thread count, with no
other plan's engines loaded beside it.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.export import ExportedProgram

from ..engine.interface import BackendRuntime
from ..engine.registry import runtime_class
from ..errors import BackendNotFoundError, EngineCrashError
from ..format.archive import read_manifest
from ..format.records import Delegate
from ..runtime.interpreter import LoadedDelegate
from ..runtime.load import DelegateWrapper, loaded_program
from .check import placed_inputs
from .child import Child, can_run_engines_in_fork, closed, crash_error, crash_stack, death, forked, received, stop
from .package import save
from .parallel import quiet_torch_warnings

# A method's arguments, as it is called: positional, then by keyword.
CallInputs = tuple[tuple[Any, ...], dict[str, Any]]
# Calls before timing starts: first-call work (allocations, lazy initialisation) is not what a user pays per call.
WARM_UP_CALLS = 2
# Timed calls per method: at least the first, at most the second, and no more once the budget is spent.
TIMED_CALLS = (5, 15)
TIME_BUDGET_SECONDS = 2.0


@dataclass(frozen=True)
class MethodTiming:
    """A method's median seconds per call, and the median seconds each of its delegates took in a call."""

    seconds: float
    delegate_seconds: dict[str, float] = field(default_factory=dict)
    # What loading the plan's file and calling each of its methods added to resident memory (``held_bytes``).
    resident_bytes: int | None = None


class SavedPrograms:
    """The lowered programs saved to be timed, kept in one temporary folder while auto measures, so that timing one
    again loads the file saved for its first timing instead of saving it again (0.1-0.3 s for a 115 MB encoder).

    A file stays only while all the kept ones fill at most ``FREE_SPACE_SHARE`` of the folder's free space; the
    folder goes when the ``with`` block ends.
    """

    FREE_SPACE_SHARE = 0.25

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="aotstack-measure-")
        # By the programs saved (which the entry keeps alive, so their ids name no other): the file, its size.
        self.files: dict[tuple[tuple[str, int], ...], tuple[str, int, list[ExportedProgram]]] = {}
        self.saves = 0

    def __enter__(self) -> SavedPrograms:
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    @contextmanager
    def saved(self, methods: Mapping[str, ExportedProgram], delegates: Mapping[str, list[Delegate]]) -> Iterator[str]:
        """The path of ``methods`` saved with ``delegates``: the file kept from an earlier timing, or one saved now,
        kept afterwards where the free space allows."""
        key = tuple((name, id(program)) for name, program in methods.items())
        if key in self.files:
            yield self.files[key][0]
            return
        self.saves += 1
        path = os.path.join(self.folder, f"measured-{self.saves}.pt2")
        save(dict(methods), dict(delegates), path)
        try:
            yield path
        finally:
            size = os.path.getsize(path)
            kept = sum(entry[1] for entry in self.files.values()) + size
            if kept <= shutil.disk_usage(self.folder).free * self.FREE_SPACE_SHARE:
                self.files[key] = (path, size, list(methods.values()))
            else:
                os.remove(path)


def measured_methods(
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    inputs: Mapping[str, CallInputs],
    saved: SavedPrograms | None = None,
) -> dict[str, MethodTiming]:
    """Each method of a lowered program, saved to a temporary file, loaded and timed on its ``inputs``
    (``(args, kwargs)``, as the method is called). With ``saved``, a program timed before is loaded from the
    file saved then.
    Every timed call starts from the package's initial state (a KV cache is reset each time), or one call
    after it where an engine keeps the method's state inside itself (``timed_method``).
    The load and the calls run in a forked child where that is safe for the engines the plan uses
    (``child.can_run_engines_in_fork``), else in this process.
    """
    if saved is None:
        with SavedPrograms() as own:
            return measured_methods(methods, delegates, inputs, own)
    with saved.saved(methods, delegates) as path:
        engines = [(d.delegate_id, d.backend_id) for name in methods for d in delegates[name]]
        stage = Stage([delegate_id for delegate_id, _ in engines])
        if not can_run_engines_in_fork({backend_id for _, backend_id in engines}):
            return timings(path, list(methods), inputs, stage)
        return timings_in_child(path, list(methods), inputs, stage, engines)


class Stage:
    """Where the timing is, kept in memory a forked child shares: loading, or in which method and delegate.

    Its parent reads it when the child dies, to say what the child was doing and in which engine.
    """

    LOADING = -1
    OUTSIDE = -1

    def __init__(self, delegate_ids: Sequence[str]) -> None:
        self.memory = mmap.mmap(-1, 8)  # anonymous and shared: the child's writes show here
        self.slots = memoryview(self.memory).cast("i")
        self.index = {delegate_id: index for index, delegate_id in enumerate(delegate_ids)}
        self.loading()

    def loading(self) -> None:
        self.slots[0], self.slots[1] = self.LOADING, self.OUTSIDE

    def calling(self, method: int) -> None:
        self.slots[0], self.slots[1] = method, self.OUTSIDE

    def entering(self, delegate_id: str) -> None:
        self.slots[1] = self.index.get(delegate_id, self.OUTSIDE)

    def left(self) -> None:
        self.slots[1] = self.OUTSIDE

    def position(self) -> tuple[int, int]:
        """The method's index (or ``LOADING``) and the delegate's (or ``OUTSIDE``)."""
        return self.slots[0], self.slots[1]


def timings(
    path: str, names: Sequence[str], inputs: Mapping[str, CallInputs], stage: Stage
) -> dict[str, MethodTiming]:
    """Each method ``names`` lists of the program saved at ``path``, loaded and timed in this process.

    Each timing also carries the memory the loaded program added by the end of the last method's
    calls (``held_bytes``): what the engines allocated (packed weights, runtimes, state) and the
    file's pages they still read.
    """
    spent: dict[str, list[float]] = defaultdict(list)
    before = held_bytes(path)
    stage.loading()
    loaded = loaded_program(path, allowed_ops=None, wrap_delegate=timing_into(spent, stage))
    manifest = read_manifest(path)
    result = {}
    with quiet_torch_warnings(), torch.no_grad():
        for index, name in enumerate(names):
            stage.calling(index)
            args, kwargs = placed_inputs(inputs[name], manifest.methods[name].inputs)
            method = loaded.method(name)
            result[name] = timed_method(
                lambda m=method, a=args, k=kwargs: m(*a, **k), loaded.reset, spent, second=name in loaded.kept_state
            )
    after = held_bytes(path)
    held = None if before is None or after is None else max(after - before, 0)
    return {name: replace(timing, resident_bytes=held) for name, timing in result.items()}


def held_bytes(package: str) -> int | None:
    """Resident bytes of this process's own memory and of ``package``'s mapped pages; None where Linux's
    ``/proc/self/smaps`` cannot be read.

    Shared libraries are left out: their code is shared between processes, and a forked child
    faults in pages of the ones its parent loaded as it runs them, which are no new memory.
    """
    target = os.path.realpath(package)
    held, current = 0, False
    try:
        with open("/proc/self/smaps") as lines:
            for line in lines:
                fields = line.split()
                if fields and not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode, path
                    current = len(fields) < 6 or fields[5] == target or fields[5].startswith("[")
                elif current and fields[0] == "Rss:":
                    held += int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return held


def timings_in_child(
    path: str,
    names: Sequence[str],
    inputs: Mapping[str, CallInputs],
    stage: Stage,
    engines: Sequence[tuple[str, str]],
) -> dict[str, MethodTiming]:
    """``timings`` run in a forked child; an ``EngineCrashError`` where the child dies (``engines``: each
    delegate's id and backend, in ``stage``'s order)."""
    child = forked(timings, (path, names, inputs, stage), "aotstack-timing")
    try:
        message = received(child)
    except BaseException:
        # Interrupted: the child is not left running.
        stop(child)
        raise
    try:
        if message is None:
            raise timing_crash(child, stage, names, engines)
        kind, value = message
        if kind == "raised":
            value.add_note(f"raised in the timing process {child.pid}")
            raise value
        return value
    finally:
        closed(child)


def timing_crash(
    child: Child, stage: Stage, names: Sequence[str], engines: Sequence[tuple[str, str]]
) -> EngineCrashError:
    """What the timing child was doing when it died, and in which engine: ``openvino died of SIGFPE while ...``."""
    died, pid = death(child), child.pid
    method, delegate = stage.position()
    if method == Stage.LOADING:
        backends = sorted({backend for _, backend in engines})
        engine = engine_in_stack(crash_stack(child), backends)
        if engine is None:
            engine = f"one of {', '.join(backends)}" if backends else "the timing process"
        return crash_error(child, f"{engine} {died} while loading the lowered program to time it "
                                  f"(timing process {pid})")
    if delegate == Stage.OUTSIDE:
        return crash_error(child, f"the timing process {pid} {died} while timing method {names[method]!r}, "
                                  "outside its delegates")
    delegate_id, backend = engines[delegate]
    return crash_error(child, f"{backend} {died} while timing method {names[method]!r} "
                              f"(delegate {delegate_id}, timing process {pid})")


def engine_in_stack(stack: str, backend_ids: Iterable[str]) -> str | None:
    """The engine, of ``backend_ids``, whose run side holds the innermost frame of a ``faulthandler`` dump."""
    files = {}
    for backend_id in backend_ids:
        try:
            module = sys.modules.get(runtime_class(backend_id).__module__)
        except BackendNotFoundError:
            continue
        path = getattr(module, "__file__", None)
        if path:
            files[os.path.realpath(path)] = backend_id
    for path in re.findall(r'File "([^"]+)", line', stack):
        engine = files.get(os.path.realpath(path))
        if engine is not None:
            return engine
    return None


def timed_method(
    call: Callable[[], Any], reset: Callable[[], None], spent: dict[str, list[float]], second: bool = False
) -> MethodTiming:
    """The median of a few timed calls of ``call``, after warm-up calls, each from the initial state.

    With ``second``, each timed call is the second after ``reset``: the first, untimed, pays what a
    reset costs the next call where an engine keeps the state inside itself (it loads the state
    again), which a decode loop pays once per generation, not once per token. Timing the first
    call would charge that engine's plans a copy of the whole KV cache every call.
    ``spent`` is where the delegates' wrappers add each call's seconds, by delegate id.
    """
    for _ in range(WARM_UP_CALLS):
        reset()
        call()
    lowest, highest = TIMED_CALLS
    samples: list[float] = []
    by_delegate: dict[str, list[float]] = defaultdict(list)
    budget_end = time.perf_counter() + TIME_BUDGET_SECONDS
    while len(samples) < lowest or (len(samples) < highest and time.perf_counter() < budget_end):
        reset()
        if second:
            call()
        spent.clear()
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        for delegate_id, times in spent.items():
            by_delegate[delegate_id].append(sum(times))
    return MethodTiming(
        statistics.median(samples),
        {delegate_id: statistics.median(times) for delegate_id, times in by_delegate.items()},
    )


class TimingRuntime(BackendRuntime):
    """A delegate's run side that records how long each of its calls took, and marks the ``stage`` it is in."""

    def __init__(self, inner: BackendRuntime, delegate_id: str, spent: dict[str, list[float]], stage: Stage) -> None:
        self.inner, self.delegate_id, self.spent, self.stage = inner, delegate_id, spent, stage

    def execute(self, handle: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        self.stage.entering(self.delegate_id)
        started = time.perf_counter()
        outputs = self.inner.execute(handle, inputs)
        self.spent[self.delegate_id].append(time.perf_counter() - started)
        self.stage.left()
        return outputs


def timing_into(spent: dict[str, list[float]], stage: Stage) -> DelegateWrapper:
    def timing(delegate_id: str, delegate: LoadedDelegate) -> LoadedDelegate:
        return LoadedDelegate(TimingRuntime(delegate.runtime, delegate_id, spent, stage), delegate.handle)

    return timing
