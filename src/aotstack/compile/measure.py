"""Time a lowered program as a user runs it: saved, loaded, each method called on its example inputs.

``lower(..., "auto")`` compares engines by these figures. Like the numerical check, it runs what
was packaged the way a user loads it, so it is the other place the compiler uses the runtime.

The load and the calls run in a child forked for each plan (``child.py``): an engine that crashes
loading its part or running it (OpenVINO compiles its model at load, and can die of SIGFPE there)
ends the child, and the plan fails with an ``EngineCrashError`` naming the engine, what it was
doing and the signal, for auto to report while it goes on with the other plans. The child times
what a user's process would run: the file loaded fresh, in this process's thread count, with no
other plan's engines loaded beside it. It stays, the plan loaded and idle, while auto may time the
plan again (``SavedPrograms``): an engine that compiles as it loads (OpenVINO) does so once.

A native library's threads may not survive fork even where the child still runs: once
``openvino.save_model`` (or ``serialize``) ran in a process, OpenVINO (2026.4) runs on one thread
in every child forked from it. So the child also reports how many cores its timed calls kept busy
(``MethodTiming.cores``). A plan whose calls kept about one busy where another plan's kept two
(``SavedPrograms.ran_on_one_core``), twice in a row (a burst of other work passes), is timed again
in this process, where its engines have their threads; it loaded and ran in the child already, so
it is not one that crashes.
"""

from __future__ import annotations

import logging
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
from functools import partial
from typing import Any

import torch
from torch.export import ExportedProgram

from ..engine.interface import BackendRuntime
from ..engine.registry import runtime_class
from ..errors import BackendNotFoundError, EngineCrashError
from ..format.archive import read_manifest
from ..format.manifest import Manifest
from ..format.plan import OpStep
from ..format.records import Delegate
from ..format.specs import SpecKey, count_spec
from ..runtime.interpreter import Action, LoadedDelegate, Slots
from ..runtime.load import DelegateWrapper, LoadedProgram, Method, loaded_program
from .check import placed_inputs
from .child import (
    Child,
    can_run_engines_in_fork,
    crash_error,
    crash_stack,
    death,
    ended,
    requested,
    serving,
    stop,
)
from .package import save
from .parallel import quiet_torch_warnings

# A method's arguments, as it is called: positional, then by keyword.
CallInputs = tuple[tuple[Any, ...], dict[str, Any]]
# Calls before timing starts: first-call work (allocations, lazy initialisation) is not what a user pays per call.
WARM_UP_CALLS = 2
# Timed calls per method: at least the first, at most the second, and no more once the budget is spent.
TIMED_CALLS = (5, 15)
TIME_BUDGET_SECONDS = 2.0
# Calls after a method's first timing with a timer on each plain ATen op (``plain_op_seconds``).
OP_TIMED_CALLS = 3
# Cores a timing's calls kept busy: a plan from WAITING to ONE_CORE ran on one thread (one whose engine lost its
# threads in the fork keeps 0.97-1.02 busy), where another plan's timing reached MANY_CORES (engines running on two
# threads mostly keep more than 1.5 busy; their threads spin a while after each step). Below WAITING, the calls
# waited (a sleep, a device, a lock) rather than ran, which says nothing of their threads.
WAITING = 0.9
ONE_CORE = 1.05
MANY_CORES = 1.5

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodTiming:
    """A method's median seconds per call, and the median seconds each of its delegates took in a call."""

    seconds: float
    delegate_seconds: dict[str, float] = field(default_factory=dict)
    # What loading the plan's file and calling each of its methods added to resident memory (``held_bytes``).
    resident_bytes: int | None = None
    # The cores the timed calls kept busy: the process's CPU time over their wall time.
    cores: float | None = None
    # The median seconds each plain ATen op (a step no engine runs) took a call, by its node's name
    # (``plain_op_seconds``); empty where it has none, or where the process timed the method before.
    plain_op_seconds: dict[str, float] = field(default_factory=dict)


class SavedPrograms:
    """The lowered programs saved to be timed, kept while auto measures: each in one temporary folder, so that timing
    one again loads the file saved for its first timing instead of saving it again (0.1-0.3 s for a 115 MB encoder),
    and, while memory allows, loaded in the child that timed it, so that timing it again loads nothing (an
    OpenVINO part compiles as it loads: about 1 s for that encoder).

    A file stays only while all the kept ones fill at most ``FREE_SPACE_SHARE`` of the folder's free space; a
    timing process stays only while at least ``FREE_MEMORY_SHARE`` of the machine's memory is available. Both go
    when the ``with`` block ends.
    """

    FREE_SPACE_SHARE = 0.25
    FREE_MEMORY_SHARE = 0.5

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="aotstack-measure-")
        # By the programs saved (which the entry keeps alive, so their ids name no other): the file, its size.
        self.files: dict[ProgramsKey, tuple[str, int, list[ExportedProgram]]] = {}
        self.saves = 0
        # By the programs saved: the process keeping them loaded, and the programs (kept alive for their ids).
        self.processes: dict[ProgramsKey, tuple[TimingProcess, list[ExportedProgram]]] = {}
        # The most cores a timing process kept busy so far (``ran_on_one_core``).
        self.most_cores = 0.0

    def __enter__(self) -> SavedPrograms:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process, _ in self.processes.values():
            ended(process.child)
        self.processes.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    @contextmanager
    def saved(self, methods: Mapping[str, ExportedProgram], delegates: Mapping[str, list[Delegate]]) -> Iterator[str]:
        """The path of ``methods`` saved with ``delegates``: the file kept from an earlier timing, or one saved now,
        kept afterwards where the free space allows."""
        key = programs_key(methods)
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

    def loaded(self, methods: Mapping[str, ExportedProgram], inputs: Mapping[str, CallInputs]) -> TimingProcess | None:
        """A process keeping ``methods`` (and maybe others) loaded from an earlier timing on these ``inputs``; None
        where none does."""
        wanted = set(programs_key(methods))
        return next((process for key, (process, _) in self.processes.items()
                     if wanted <= set(key) and process.times(list(methods), inputs)), None)

    def keep_or_end(self, methods: Mapping[str, ExportedProgram], process: TimingProcess) -> None:
        """Keep ``process`` loaded for the next timing of ``methods`` where memory allows, in place of one kept for
        them before (timing other inputs); else end it."""
        replaced = self.processes.pop(programs_key(methods), None)
        if replaced is not None:
            ended(replaced[0].child)
        if memory_to_spare(self.FREE_MEMORY_SHARE):
            self.processes[programs_key(methods)] = (process, list(methods.values()))
        else:
            ended(process.child)

    def ran_on_one_core(self, timings: Mapping[str, MethodTiming], delegates: Mapping[str, list[Delegate]]) -> bool:
        """Whether a timing process ran a plan on about one core (``WAITING`` to ``ONE_CORE``) where one before kept
        ``MANY_CORES`` busy: then its engines lost their threads in the fork. A plan whose work does not
        split, such as a small model's, runs on one core in every plan, so one alone says nothing; nor
        does one with a part compiled for a thread count of its own (auto's one-thread AOTInductor)."""
        cores = [timing.cores for timing in timings.values() if timing.cores is not None]
        if not cores:
            return False
        self.most_cores = max(self.most_cores, *cores)
        pinned = any(count_spec(d.compile_specs, SpecKey.THREADS) for listed in delegates.values() for d in listed)
        return WAITING <= max(cores) < ONE_CORE and self.most_cores >= MANY_CORES and not pinned

    def drop(self, process: TimingProcess) -> None:
        """Forget ``process`` (it failed, or died)."""
        self.processes = {key: kept for key, kept in self.processes.items() if kept[0] is not process}


# Which programs a file or a timing process holds: each method's name and its program's id.
ProgramsKey = tuple[tuple[str, int], ...]


def programs_key(methods: Mapping[str, ExportedProgram]) -> ProgramsKey:
    return tuple((name, id(program)) for name, program in methods.items())


def memory_to_spare(share: float) -> bool:
    """Whether at least ``share`` of this machine's memory is available (Linux's ``MemAvailable``); False where
    that cannot be read."""
    try:
        with open("/proc/meminfo") as lines:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.split()[1:]}
        return fields["MemAvailable"] >= fields["MemTotal"] * share
    except (OSError, ValueError, KeyError, IndexError):
        return False


def measured_methods(
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    inputs: Mapping[str, CallInputs],
    saved: SavedPrograms | None = None,
) -> dict[str, MethodTiming]:
    """Each method of a lowered program, saved to a temporary file, loaded and timed on its ``inputs``
    (``(args, kwargs)``, as the method is called). With ``saved``, a program timed before is timed again in the
    process that timed it, where that still holds it loaded, else loaded from the file saved then.
    Every timed call starts from the package's initial state (a KV cache is reset each time), or one call
    after it where an engine keeps the method's state inside itself (``timed_method``).
    The load and the calls run in a forked child where that is safe for the engines the plan uses
    (``child.can_run_engines_in_fork``), else in this process.
    """
    if saved is None:
        with SavedPrograms() as own:
            return measured_methods(methods, delegates, inputs, own)
    names = list(methods)
    engines = [(d.delegate_id, d.backend_id) for name in methods for d in delegates[name]]
    if not can_run_engines_in_fork({backend_id for _, backend_id in engines}):
        with saved.saved(methods, delegates) as path:
            return timed_in_this_process(path, names, inputs, engines)
    process = saved.loaded(methods, inputs)
    if process is None:
        with saved.saved(methods, delegates) as path:
            # Timed before the file may go (``saved``): the child reads it as it loads.
            process = TimingProcess.started(path, inputs, engines)
            timed = timed_on_its_threads(process, names, saved, delegates)
            if timed is not None:
                saved.keep_or_end(methods, process)
                return timed
            ended(process.child)
            return timed_here(path, names, inputs, engines)
    try:
        timed = timed_on_its_threads(process, names, saved, delegates)
    except BaseException:
        saved.drop(process)
        raise
    if timed is not None:
        return timed
    saved.drop(process)
    ended(process.child)
    with saved.saved(methods, delegates) as path:
        return timed_here(path, names, inputs, engines)


def timed_on_its_threads(
    process: TimingProcess, names: Sequence[str], saved: SavedPrograms, delegates: Mapping[str, list[Delegate]]
) -> dict[str, MethodTiming] | None:
    """``process``'s timing of ``names``; timed once more where it ran on one core (``SavedPrograms.ran_on_one_core``),
    since a burst of other work on the machine passes, and None where it did both times: its engines lost their
    threads in the fork. A process that kept ``MANY_CORES`` busy in a timing before has its threads: a timing of it
    on one core was the machine's load."""
    for _ in range(2):
        timed = process.timed(names)
        lost = saved.ran_on_one_core(timed, delegates) and not process.kept_many_cores
        process.kept_many_cores |= any((t.cores or 0.0) >= MANY_CORES for t in timed.values())
        if not lost:
            return timed
    return None


def timed_here(
    path: str, names: Sequence[str], inputs: Mapping[str, CallInputs], engines: Sequence[tuple[str, str]]
) -> dict[str, MethodTiming]:
    """A plan whose timing process ran it on one core (``SavedPrograms.ran_on_one_core``), timed in this process."""
    logger.warning(
        "a plan with %s ran on one core in its timing process, where another plan kept more busy: a library's "
        "threads did not survive fork here (OpenVINO's do not, once openvino.save_model ran in this process), so "
        "it is timed again in this process",
        ", ".join(sorted({backend_id for _, backend_id in engines})),
    )
    return timed_in_this_process(path, names, inputs, engines)


def timed_in_this_process(
    path: str, names: Sequence[str], inputs: Mapping[str, CallInputs], engines: Sequence[tuple[str, str]]
) -> dict[str, MethodTiming]:
    """The program saved at ``path`` (its delegates: ``engines``) loaded and timed in this process."""
    return timed_methods(loaded_to_time(path, Stage([delegate_id for delegate_id, _ in engines])), names, inputs)


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


@dataclass
class LoadedToTime:
    """A saved program loaded to be timed: its delegates add each call's seconds to ``spent`` and mark ``stage``;
    ``before`` is what this process held before it loaded it (``held_bytes``)."""

    path: str
    loaded: LoadedProgram
    manifest: Manifest
    spent: dict[str, list[float]]
    stage: Stage
    before: int | None
    # The methods whose plain ops this process timed (``plain_op_seconds``): at their first timing only.
    ops_timed: set[str] = field(default_factory=set)


def loaded_to_time(path: str, stage: Stage) -> LoadedToTime:
    """The program saved at ``path``, loaded in this process to be timed."""
    spent: dict[str, list[float]] = defaultdict(list)
    before = held_bytes(path)
    stage.loading()
    loaded = loaded_program(path, allowed_ops=None, wrap_delegate=timing_into(spent, stage))
    return LoadedToTime(path, loaded, read_manifest(path), spent, stage, before)


def timed_methods(
    program: LoadedToTime, names: Sequence[str], inputs: Mapping[str, CallInputs]
) -> dict[str, MethodTiming]:
    """Each method ``names`` lists of ``program``, timed on its ``inputs``.

    Each timing also carries the memory the loaded program added by the end of the last method's
    calls (``held_bytes``): what the engines allocated (packed weights, runtimes, state) and the
    file's pages they still read.
    """
    result = {}
    with quiet_torch_warnings(), torch.no_grad():
        for index, name in enumerate(names):
            program.stage.calling(index)
            args, kwargs = placed_inputs(inputs[name], program.manifest.methods[name].inputs)
            method = program.loaded.method(name)
            second = name in program.loaded.kept_state
            call = partial(method, *args, **kwargs)
            result[name] = timed_method(call, program.loaded.reset, program.spent, second=second)
            if name not in program.ops_timed:
                program.ops_timed.add(name)
                ops = plain_op_seconds(method, call, program.loaded.reset, second)
                result[name] = replace(result[name], plain_op_seconds=ops)
    after = held_bytes(program.path)
    held = None if program.before is None or after is None else max(after - program.before, 0)
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


@dataclass(eq=False)
class TimingProcess:
    """A child forked to load one saved program and time its methods on ``inputs`` (by method), again at each
    ``timed``, until it is ended; an engine crashing in it is an ``EngineCrashError`` (``engines``: each
    delegate's id and backend, in ``stage``'s order)."""

    child: Child
    stage: Stage
    inputs: Mapping[str, CallInputs]
    engines: list[tuple[str, str]]
    # Whether a timing of it kept MANY_CORES busy: its engines' threads survived the fork.
    kept_many_cores: bool = False

    @classmethod
    def started(
        cls, path: str, inputs: Mapping[str, CallInputs], engines: Sequence[tuple[str, str]]
    ) -> TimingProcess:
        stage = Stage([delegate_id for delegate_id, _ in engines])
        # The inputs are the child's from the fork: a tensor sent down a pipe would go through shared memory.
        child = serving(loaded_with_inputs, (path, stage, inputs), "aotstack-timing")
        return cls(child, stage, dict(inputs), list(engines))

    def times(self, names: Sequence[str], inputs: Mapping[str, CallInputs]) -> bool:
        """Whether this process times each of ``names`` on these very ``inputs``."""
        return all(name in self.inputs and inputs[name] is self.inputs[name] for name in names)

    def timed(self, names: Sequence[str]) -> dict[str, MethodTiming]:
        """Each of ``names`` timed once more (the first time, loaded first); where that fails (or is interrupted),
        the process is stopped and the failure raised."""
        try:
            message = requested(self.child, timed_on_its_inputs, (list(names),))
            if message is None:
                raise timing_crash(self.child, self.stage, names, self.engines)
            kind, value = message
            if kind == "raised":
                value.add_note(f"raised in the timing process {self.child.pid}")
                raise value
            return value
        except BaseException:
            stop(self.child)
            raise


def loaded_with_inputs(
    path: str, stage: Stage, inputs: Mapping[str, CallInputs]
) -> tuple[LoadedToTime, Mapping[str, CallInputs]]:
    """A timing process's state: the program at ``path`` loaded to be timed, and what to time it on."""
    return loaded_to_time(path, stage), inputs


def timed_on_its_inputs(
    state: tuple[LoadedToTime, Mapping[str, CallInputs]], names: Sequence[str]
) -> dict[str, MethodTiming]:
    program, inputs = state
    return timed_methods(program, names, inputs)


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
    started_timing, busy_before = time.perf_counter(), time.process_time()
    budget_end = started_timing + TIME_BUDGET_SECONDS
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
    busy, wall = time.process_time() - busy_before, time.perf_counter() - started_timing
    return MethodTiming(
        statistics.median(samples),
        {delegate_id: statistics.median(times) for delegate_id, times in by_delegate.items()},
        cores=busy / wall if wall > 0 else None,
    )


def plain_op_seconds(
    method: Method, call: Callable[[], Any], reset: Callable[[], None], second: bool = False
) -> dict[str, float]:
    """The median seconds each plain ATen op of ``method`` (a step no engine runs) took a call, by its node's name,
    over ``OP_TIMED_CALLS`` calls of ``call`` (each from the initial state, as ``timed_method`` makes them) with a
    timer on each such op; empty where it has none.

    Where a call's time outside its delegates goes, op by op: auto compiles a closing engine's parts only where
    the ops they would take cost enough as they are (``auto.closing_gain_refusal``). Apart from the timed calls, whose
    figure the timers would add to.
    """
    body = method.body
    plain = [index for index, step in enumerate(body.action_steps) if isinstance(step, OpStep)]
    if not plain:
        return {}
    spent: dict[str, list[float]] = defaultdict(list)
    actions = list(body.actions)
    for index in plain:
        body.actions[index] = timed_action(actions[index], spent[body.action_steps[index].name])
    try:
        for _ in range(OP_TIMED_CALLS):
            reset()
            if second:
                call()
            call()
    except Exception:  # noqa: BLE001 - the method timed well just before: its ops' figures are only not known
        logger.debug("a call with each plain op timed failed", exc_info=True)
        return {}
    finally:
        body.actions[:] = actions
    return {name: statistics.median(times) for name, times in spent.items()}


def timed_action(action: Action, times: list[float]) -> Action:
    """``action``, adding its seconds to ``times`` at each run."""

    def timed(slots: Slots) -> None:
        started = time.perf_counter()
        action(slots)
        times.append(time.perf_counter() - started)

    return timed


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
