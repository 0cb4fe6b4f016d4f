"""Compiling many partitions at once: identical ones once, the rest in worker processes.

A backend's ``preprocess`` is slow (an AOTInductor compile costs 10-90 s) and mostly single
threaded, so partitions that do not depend on each other compile in forked worker processes,
at most ``workers`` at a time. A forked worker inherits the partition, its backend and every
registered backend as they are in memory; only the result travels back, through a pipe. One
pool of workers (``CompilePool``) takes batches from several lowerings at once: auto's plans.

Every compile runs in a worker, one at a time with ``workers=1`` too: an engine whose native code
crashes (a signal) then ends its worker, not the caller, and the failure is an
``EngineCrashError`` naming the engine, the partition and the signal (``child.py``). Where fork is
not safe (``child.can_fork``) partitions compile one at a time in this process.

An engine that compiles when a file is opened (``Backend.compiles_when_opened``: OpenVINO's CPU
plugin) has each part it compiled opened once more, in another forked child, as loading will:
its crash or failure there is the partition's, while lowering, not the loading process's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import statistics
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import numpy
import torch
from torch.export import ExportedProgram

from ..engine.interface import Backend
from ..engine.registry import runtime_class
from ..errors import EngineCrashError, LoweringError
from ..format.archive import usable_cores
from ..format.specs import PreprocessResult
from ..format.tensor_data import BytesLike, tensor_buffer, tensor_is_viewable
from .cache import forget_preprocess, keep_preprocess, kept_preprocess, preprocess_key
from .child import (
    Child,
    can_fork,
    can_run_engines_in_fork,
    closed,
    crash_error,
    death,
    forked,
    portable,
    received,
    stop,
)
from .jobs import CompileJob, CompileOutcome
from .program_parts import program_weights, unbacked_sizes_left_behind_dropped
from .progress import Progress

logger = logging.getLogger("aotstack")


@dataclass(eq=False)
class Batch:
    """Jobs submitted together (one partitioner's parts, in every method): done once each has an outcome."""

    jobs: list[CompileJob]
    # The jobs that compile; each other job takes the outcome of the identical one it names in ``same_as``.
    representatives: list[CompileJob]
    same_as: dict[CompileJob, CompileJob]
    stop_on_error: bool
    results: dict[CompileJob, CompileOutcome] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(job in self.results for job in self.representatives)


class CompilePool:
    """Up to ``workers`` forked compile workers, shared by every batch submitted to it.

    Batches from several lowerings (auto's plans) compile at once, so a worker that one plan
    leaves idle compiles another's parts while this process partitions the next plan. A job
    whose code a running job of the same structure compiles (``CompileJob.structure``) waits
    for it, then takes that code from its backend's cache. Used as a context manager, no worker
    outlives it (Ctrl-C included).
    """

    def __init__(self, workers: int, progress: Progress, *, open_once: bool = True) -> None:
        self.workers = workers
        self.progress = progress
        # Whether a part of an engine that compiles when opened is opened once after compiling.
        self.open_once = open_once
        self.forking = can_fork()
        self.pending: list[tuple[Batch, CompileJob]] = []
        self.running: dict[Child, tuple[Batch, CompileJob]] = {}
        # Children running a backend's warm-up whose work stays on disk; its jobs wait for it.
        self.warming: dict[Child, type[Backend]] = {}
        # Workers forked while a warm-up child ran, each waiting for that child to end (``compile_after_warm_up``):
        # the worker, and the child whose slot it takes once the child ends.
        self.after_warm_up: dict[Child, Child] = {}
        # Children opening a compiled part once (``compiles_when_opened``), with the compile's outcome.
        self.opening: dict[Child, tuple[Batch, CompileJob, CompileOutcome]] = {}
        # Each code-sharing job's structure, and the structures a finished job compiled.
        self.structures: dict[CompileJob, str] = {}
        self.compiled_structures: set[str] = set()
        # Structures whose compiled code the backend's cache did not answer a later job with (XNNPACK keeps none for
        # weights it repacks): their jobs compile side by side, not one after another.
        self.unshared_structures: set[str] = set()
        # Seconds each compile of a backend took here, so far.
        self.compile_seconds: dict[type[Backend], list[float]] = {}

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(self, jobs: Sequence[CompileJob], *, stop_on_error: bool) -> Batch:
        """Queue ``jobs``; those their backends' caches answer are done at once, the rest start as workers free.

        Identical jobs (:meth:`CompileJob.identity`) compile once. With ``stop_on_error``, the
        batch's first failure cancels its jobs not yet finished (running workers are stopped), so a
        caller that raises on it does not wait for compiles whose results it would throw away.
        """
        representatives, same_as = distinct_jobs(jobs)
        batch = Batch(list(jobs), representatives, same_as, stop_on_error)
        if not jobs:
            return batch
        self.progress.queued(jobs)
        if not self.forking:
            batch.results.update(compiled_here(representatives, self.progress, stop_on_error))
            return batch
        # A partition compiled before costs no worker: its backend's cache answers here.
        batch.results.update(cached_outcomes(representatives, self.progress))
        misses = [job for job in representatives if job not in batch.results]
        if misses:
            self.warm_up_in_children(misses)
            for job in misses:
                if job.backend.shares_code_across_weights:
                    self.structures[job] = job.structure()
            self.pending.extend((batch, job) for job in misses)
            self.start()
        return batch

    def advance(self) -> None:
        """Wait until a running job ends, record its outcome, and start what can start."""
        self.start()
        if not self.running and not self.warming and not self.opening:
            assert not self.pending, "a pending job waits only on a running job or warm-up"
            return
        self.reap(None)
        self.start()

    def outcomes(self, batch: Batch) -> list[CompileOutcome]:
        """A done batch's outcomes, in the order of its jobs."""
        outcomes = []
        for job in batch.jobs:
            first = batch.same_as.get(job)
            if first is None:
                outcomes.append(batch.results[job])
                continue
            original = batch.results[first]
            outcome = CompileOutcome(job, original.result, original.error, 0.0, None, first)
            self.progress.finished(outcome)
            outcomes.append(outcome)
        return outcomes

    def start(self) -> None:
        """Record the workers that ended, then start pending jobs while a worker is free."""
        self.reap(0)
        self.start_after_warm_ups()
        while self.busy() < self.workers:
            ready = [entry for entry in self.pending if not self.waits(entry[1])]
            if not ready:
                return
            # The longest first (the first queued among equals): a long compile started last would run alone.
            entry = max(ready, key=lambda entry: self.expected_seconds(entry[1]))
            self.pending.remove(entry)
            batch, job = entry
            warmed_up(job.backend)
            if self.structures.get(job) in self.compiled_structures:
                # Its code compiled since it was queued; a failed compile, or a backend that could not reuse it for
                # these weights, leaves nothing to take.
                cached = cached_outcomes([job], self.progress)
                if cached:
                    batch.results.update(cached)
                    continue
                self.unshared_structures.add(self.structures[job])
            worker = forked(worker_message, (job,), f"aotstack-{job.tag}")
            self.running[worker] = entry
            self.progress.started(job, worker.pid)

    def busy(self) -> int:
        """The workers' places taken: a worker waiting for a warm-up child takes that child's once it ends."""
        waiting = sum(1 for child in self.after_warm_up.values() if child in self.warming)
        return len(self.running) - waiting + len(self.warming) + len(self.opening)

    def start_after_warm_ups(self) -> None:
        """For each warm-up child, fork now the worker of the longest job waiting for it alone, to compile as soon
        as the child ends.

        This process may be busy then for seconds (ExecuTorch's question of a whole method, XNNPACK's
        warm-up), and would start that job only once it looks again: auto's longest compile,
        AOTInductor alone, started 6-8 s after its warm-up ended. The worker warms up from what the
        child left on disk (about 1 s for AOTInductor), as this process would have before forking it.
        """
        taken = set(self.after_warm_up.values())
        for child, kind in self.warming.items():
            if child in taken:
                continue
            waiting = [entry for entry in self.pending
                       if type(entry[1].backend) is kind and not self.waits_for_code(entry[1])]
            if not waiting:
                continue
            entry = max(waiting, key=lambda entry: self.expected_seconds(entry[1]))
            self.pending.remove(entry)
            batch, job = entry
            worker = forked(compile_after_warm_up, (child.process.sentinel, job), f"aotstack-{job.tag}")
            self.running[worker] = entry
            self.after_warm_up[worker] = child
            self.progress.started(job, worker.pid)

    def expected_seconds(self, job: CompileJob) -> float:
        """How long ``job`` should take to compile: the median of its backend's compiles so far, else what the
        backend expects."""
        seen = self.compile_seconds.get(type(job.backend))
        return statistics.median(seen) if seen else job.backend.expected_compile_seconds

    def warm_up_in_children(self, jobs: Sequence[CompileJob]) -> None:
        """Start the warm-up of each backend of ``jobs`` whose warm-up fills a cache on disk, in a forked child.

        This process goes on partitioning meanwhile; its own warm-up, before the backend's first
        compile worker forks, then reads what the child left instead of redoing it.
        """
        for backend in {type(job.backend): job.backend for job in jobs}.values():
            kind = type(backend)
            if (backend.warm_up_fills_disk_cache and kind not in WARMED_UP | WARMED_UP_ON_DISK
                    and kind not in self.warming.values()):
                self.warming[forked(backend.warm_up, (), f"aotstack-warm-up-{backend.backend_id}")] = kind

    def waits(self, job: CompileJob) -> bool:
        """Whether a running job compiles the code ``job`` would share, or its backend's warm-up is still running."""
        return type(job.backend) in self.warming.values() or self.waits_for_code(job)

    def waits_for_code(self, job: CompileJob) -> bool:
        """Whether a running job compiles the code ``job`` would share."""
        structure = self.structures.get(job)
        if structure in self.unshared_structures:
            return False
        running = (self.structures.get(other) for _, other in self.running.values())
        return structure is not None and structure in running

    def reap(self, timeout: float | None) -> None:
        """Record the outcome of each worker that ended within ``timeout`` seconds (None: until one does)."""
        children = [*self.running, *self.warming, *self.opening]
        if not children:
            return
        ready = set(wait([c.connection for c in children] + [c.process.sentinel for c in children], timeout))
        for worker in [c for c in children if c.connection in ready or c.process.sentinel in ready]:
            if worker in self.warming:
                # How it went matters only to later lowerings: this process's own warm-up does whatever is left.
                kind = self.warming.pop(worker)
                message = received(worker)
                if message is not None and message[0] == "returned":
                    WARMED_UP_ON_DISK.add(kind)
                closed(worker)
                continue
            if worker in self.opening:
                batch, job, compiled_outcome = self.opening.pop(worker)
                self.finish(batch, job, opened_outcome(worker, compiled_outcome))
                continue
            if worker not in self.running:
                continue  # stopped below, with its batch
            self.after_warm_up.pop(worker, None)
            batch, job = self.running.pop(worker)
            outcome = finished_worker(worker, job)
            if outcome.result is not None and self.open_once and opened_after_compiling(job):
                self.opening[forked(opened_once, (job, outcome.result), f"aotstack-open-{job.tag}")] = (
                    batch, job, outcome,
                )
                continue
            self.finish(batch, job, outcome)

    def finish(self, batch: Batch, job: CompileJob, outcome: CompileOutcome) -> None:
        """Record ``job``'s outcome; a failure cancels the rest of a batch that stops on one."""
        batch.results[job] = outcome
        self.progress.finished(outcome)
        if outcome.state == "compiled":
            self.compile_seconds.setdefault(type(job.backend), []).append(outcome.seconds)
        if job in self.structures:
            self.compiled_structures.add(self.structures[job])
        if batch.stop_on_error and outcome.error is not None:
            self.cancel(batch)

    def cancel(self, batch: Batch) -> None:
        """Give up ``batch``'s jobs that have not finished: pending ones never start, running ones are stopped."""
        for entry in [entry for entry in self.pending if entry[0] is batch]:
            self.pending.remove(entry)
            outcome = batch.results[entry[1]] = CompileOutcome(entry[1])
            self.progress.finished(outcome)
        for worker, (owner, job) in list(self.running.items()):
            if owner is batch:
                stop(worker)
                del self.running[worker]
                self.after_warm_up.pop(worker, None)
                outcome = batch.results[job] = CompileOutcome(job, seconds=time.perf_counter() - worker.started)
                self.progress.finished(outcome)
        for child, (owner, job, compiled_outcome) in list(self.opening.items()):
            if owner is batch:
                stop(child)
                del self.opening[child]
                outcome = batch.results[job] = CompileOutcome(job, seconds=compiled_outcome.seconds)
                self.progress.finished(outcome)

    def close(self) -> None:
        """Stop every worker and warm-up still running; nothing pending starts."""
        for child in [*self.running, *self.warming, *self.opening]:
            stop(child)
        self.running.clear()
        self.after_warm_up.clear()
        self.warming.clear()
        self.opening.clear()
        self.pending.clear()


def cached_outcomes(jobs: Sequence[CompileJob], progress: Progress) -> dict[CompileJob, CompileOutcome]:
    """The jobs their backends answer from a cache, without compiling; a failing lookup counts as a miss."""
    outcomes = {}
    for job in jobs:
        started = time.perf_counter()
        try:
            job.backend.check_specs(job.compile_specs)
            with quiet_torch_warnings():
                result = job.backend.cached_preprocess(job.program, job.compile_specs) or kept_result(job)
        except Exception:
            # preprocess, in a worker, meets the same problem and reports it.
            continue
        if isinstance(result, PreprocessResult):
            cached = dataclasses.replace(result, from_cache=True)
            outcomes[job] = CompileOutcome(job, cached, seconds=time.perf_counter() - started)
            progress.started(job, None)
            progress.finished(outcomes[job])
    return outcomes


def kept_result(job: CompileJob) -> PreprocessResult | None:
    """The result lowering kept for ``job`` from an earlier compile, where its backend asks for that cache."""
    key = preprocess_key(job.backend, job.program, job.compile_specs)
    return None if key is None else kept_preprocess(key, job.program)


# The backends whose warm-up ran in this process; forked workers inherit it.
WARMED_UP: set[type[Backend]] = set()
# The backends whose warm-up ran to its end in a child of this process (``warm_up_in_children``): what it keeps on
# disk is there, so a later lowering (auto lowers several plans after its first ones) warms up here, reading it,
# rather than forking a child that would only read it too (about 1 s for AOTInductor) before the first compile.
WARMED_UP_ON_DISK: set[type[Backend]] = set()


def warmed_up(backend: Backend) -> None:
    """``backend``'s once-per-process work, done here (once) so that every forked worker inherits it.

    A warm-up that fails is left to the compile: the worker meets the same problem and reports
    it against the partition it compiles.
    """
    kind = type(backend)
    if kind in WARMED_UP:
        return
    try:
        backend.warm_up()
    except Exception:  # noqa: BLE001 - see above
        logger.debug("%s's warm-up failed; its compiles do the work themselves", backend.backend_id, exc_info=True)
    WARMED_UP.add(kind)


def distinct_jobs(jobs: Sequence[CompileJob]) -> tuple[list[CompileJob], dict[CompileJob, CompileJob]]:
    """The jobs to compile, and for each other job the earlier identical one it takes its result from."""
    if len(jobs) == 1:
        return list(jobs), {}
    first_by_identity: dict[str, CompileJob] = {}
    same_as = {}
    for job in jobs:
        first = first_by_identity.setdefault(job.identity(), job)
        if first is not job:
            same_as[job] = first
    return [job for job in jobs if job not in same_as], same_as


def compiled_here(
    jobs: Sequence[CompileJob], progress: Progress, stop_on_error: bool
) -> dict[CompileJob, CompileOutcome]:
    """Compile one job after another in this process."""
    outcomes = {}
    failed = False
    for job in jobs:
        if failed:
            outcome = CompileOutcome(job)
        else:
            progress.started(job, None)
            outcome = compiled(job)
            failed = stop_on_error and outcome.error is not None
        outcomes[job] = outcome
        progress.finished(outcome)
    return outcomes


def compiled(job: CompileJob) -> CompileOutcome:
    """``job``'s outcome: its backend's result kept from an earlier lowering, or a compile now."""
    started = time.perf_counter()
    try:
        job.backend.check_specs(job.compile_specs)  # the key may leave a spec out: checked before it is read
        # Keyed before preprocess, which may change the program it is given.
        key = preprocess_key(job.backend, job.program, job.compile_specs)
        result = None if key is None else kept_preprocess(key, job.program)
        if result is None:
            with quiet_torch_warnings(), unbacked_sizes_left_behind_dropped(job.program):
                result = job.backend.preprocess(job.program, job.compile_specs)
            if not isinstance(result, PreprocessResult):
                raise LoweringError(
                    f"{type(job.backend).__name__}.preprocess returned {type(result).__name__}, not a PreprocessResult"
                )
            if key is not None:
                keep_preprocess(key, result)
    except Exception as exc:
        return CompileOutcome(job, error=exc, seconds=time.perf_counter() - started)
    return CompileOutcome(job, result=result, seconds=time.perf_counter() - started)


@contextmanager
def quiet_torch_warnings() -> Iterator[None]:
    """Hide torch's warnings about its own deprecated internals, which lowering triggers but no user can act on.

    Deep-copying or tracing a program touches TreeSpec's deprecated ``LeafSpec``; the ONNX
    exporter's imports reach ``torch.jit``'s deprecated decorators. Warnings raised from the
    user's own code still show.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
        yield


def compile_after_warm_up(warm_up_ended: int, job: CompileJob) -> tuple[Any, ...]:
    """In a worker forked while its backend's warm-up ran in another child: once that child has ended
    (``warm_up_ended``, its sentinel, becomes ready), warm up here from what it left on disk, then compile."""
    wait([warm_up_ended])
    warmed_up(job.backend)
    return worker_message(job)


def worker_message(job: CompileJob) -> tuple[Any, ...]:
    """In the forked worker: the job compiled, as the message that carries its result or its error back."""
    outcome = compiled(job)
    if outcome.result is None:
        return ("failed", portable(outcome.error), outcome.seconds)
    result = outcome.result
    return (
        "done", result.processed_bytes, portable_named_data(job.program, result.named_data),
        result.from_cache, outcome.seconds,
    )


@dataclass(frozen=True)
class ProgramWeight:
    """Stands in, on the way back from a worker, for a blob that is a weight of the job's program as it is."""

    fqn: str


def portable_named_data(program: ExportedProgram, named_data: Mapping[str, BytesLike]) -> dict[str, Any]:
    """The named data to send back: a blob viewing one of the program's own weights goes by name.

    The parent holds the same weights (the worker's are the parent's, shared since the fork),
    so a large model's weights do not cross the pipe, nor end up in the parent twice.
    """
    weights = {
        buffer_address(tensor): fqn for fqn, tensor in program_weights(program).items() if tensor_is_viewable(tensor)
    }
    sent: dict[str, Any] = {}
    for name, data in named_data.items():
        view = memoryview(data)
        fqn = weights.get((view_address(view), view.nbytes)) if view.nbytes else None
        sent[name] = ProgramWeight(fqn) if fqn is not None else bytes(view)
    return sent


def received_named_data(program: ExportedProgram, sent: Mapping[str, Any]) -> dict[str, BytesLike]:
    weights = program_weights(program)
    return {
        name: tensor_buffer(weights[data.fqn]) if isinstance(data, ProgramWeight) else data
        for name, data in sent.items()
    }


def buffer_address(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def view_address(view: memoryview) -> int:
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


def finished_worker(worker: Child, job: CompileJob) -> CompileOutcome:
    """The outcome a worker sent, or an ``EngineCrashError`` where it ended without sending one."""
    message = received(worker)
    pid = worker.pid
    try:
        if message is None:
            return CompileOutcome(job, error=worker_death(worker, job), seconds=time.perf_counter() - worker.started,
                                  worker=pid)
        kind, sent = message
        if kind == "raised" or sent[0] == "failed":
            error, seconds = (sent, time.perf_counter() - worker.started) if kind == "raised" else sent[1:]
            error.add_note(f"raised in compile worker process {pid}")
            return CompileOutcome(job, error=error, seconds=seconds, worker=pid)
        _, processed, named_data, from_cache, seconds = sent
        result = PreprocessResult(processed, received_named_data(job.program, named_data), from_cache)
        return CompileOutcome(job, result, seconds=seconds, worker=pid)
    finally:
        closed(worker)


def worker_death(worker: Child, job: CompileJob) -> EngineCrashError:
    """The error for a worker that died compiling ``job``: the engine, the partition, the signal."""
    return crash_error(
        worker,
        f"{job.backend_id} {death(worker)} while compiling partition {job.tag!r} of method {job.method!r} "
        f"(compile worker process {worker.pid})",
    )


def opened_after_compiling(job: CompileJob) -> bool:
    """Whether lowering opens ``job``'s compiled part once in a child: its engine compiles when opened,
    and a forked child can run that engine (``child.can_run_engines_in_fork``; why not is logged)."""
    return job.backend.compiles_when_opened and can_run_engines_in_fork((job.backend_id,))


def opened_once(job: CompileJob, result: PreprocessResult) -> None:
    """In a forked child: ``result`` opened by its engine's run side, as loading will open it."""
    runtime = runtime_class(job.backend_id)()
    named_data = {name: writable_here(data) for name, data in result.named_data.items()}
    runtime.init(result.processed_bytes, named_data, job.compile_specs)


def writable_here(data: BytesLike) -> BytesLike:
    """``data`` as loading hands a delegate a buffer it updates: writable (bytes are never copied).

    Only in a forked child, whose memory is its own copy of the caller's: a write lands in the
    child's copy, so the program's weights in the caller stay as they were.
    """
    if isinstance(data, torch.Tensor):
        return data
    view = memoryview(data).cast("B")
    if not view.readonly:
        return view
    if not view.nbytes:
        return bytearray()
    return memoryview((ctypes.c_ubyte * view.nbytes).from_address(view_address(view))).cast("B")


def opened_outcome(child: Child, compiled: CompileOutcome) -> CompileOutcome:
    """``compiled``, or the error its engine met opening the part once (``opened_once``), crash or exception."""
    job = compiled.job
    message = received(child)
    try:
        where = f"opening partition {job.tag!r} of method {job.method!r} once, as loading will"
        if message is None:
            error: Exception = crash_error(child, f"{job.backend_id} {death(child)} while {where} "
                                                  f"(child process {child.pid})")
        elif message[0] == "raised":
            error = LoweringError(f"{job.backend_id} failed {where}: {type(message[1]).__name__}: {message[1]}")
            error.__cause__ = message[1]
        else:
            return compiled
        # The worker kept the result for the next lowering; that one must not take it unopened.
        key = preprocess_key(job.backend, job.program, job.compile_specs)
        if key is not None:
            forget_preprocess(key)
        return dataclasses.replace(compiled, result=None, error=error)
    finally:
        closed(child)


def default_workers() -> int:
    """One worker per core this process may run on."""
    return usable_cores()
