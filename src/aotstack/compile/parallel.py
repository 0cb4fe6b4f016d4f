"""Compiling many partitions at once: identical ones once, the rest in worker processes.

A backend's ``preprocess`` is slow (an AOTInductor compile costs 10-90 s) and mostly single
threaded, so partitions that do not depend on each other compile in forked worker processes,
at most ``workers`` at a time. A forked worker inherits the partition, its backend and every
registered backend as they are in memory; only the result travels back, through a pipe.

Every compile runs in a worker, one at a time with ``workers=1`` too: an engine whose native code
crashes (a signal) then ends its worker, not the caller, and the failure is an
``EngineCrashError`` naming the engine, the partition and the signal (``child.py``). Where fork is
not safe (``child.can_fork``) partitions compile one at a time in this process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import numpy
import torch
from torch.export import ExportedProgram

from ..errors import EngineCrashError, LoweringError
from ..format.archive import usable_cores
from ..format.specs import PreprocessResult
from ..format.tensor_data import BytesLike, tensor_buffer, tensor_is_viewable
from .cache import keep_preprocess, kept_preprocess, preprocess_key
from .child import Child, can_fork, closed, crash_error, death, forked, portable, received, stop
from .jobs import CompileJob, CompileOutcome
from .program_parts import program_weights
from .progress import Progress

logger = logging.getLogger("aotstack")


def compile_all(
    jobs: Sequence[CompileJob], workers: int, progress: Progress, *, stop_on_error: bool
) -> list[CompileOutcome]:
    """Every job's outcome, in the order of ``jobs``.

    Identical jobs (:meth:`CompileJob.identity`) compile once. With ``stop_on_error``, the
    first failure cancels the jobs not yet finished (running workers are stopped), so a caller
    that raises on it does not wait for compiles whose results it would throw away.
    """
    if not jobs:
        return []
    representatives, same_as = distinct_jobs(jobs)
    progress.queued(jobs)
    if can_fork():
        # A partition compiled before costs no worker: its backend's cache answers here.
        results = cached_outcomes(representatives, progress)
        misses = [job for job in representatives if job not in results]
        if misses:
            warm_up_backends(misses)
            first, later = split_by_structure(misses)
            results.update(compiled_in_workers(first, min(workers, len(first)), progress, stop_on_error))
            if later and stop_on_error and any(results[job].error is not None for job in first):
                results.update(cancelled(later, progress))
            elif later:
                # Each shares the code of a job compiled above, which its backend's cache now holds.
                results.update(cached_outcomes(later, progress))
                rest = [job for job in later if job not in results]
                if rest:
                    results.update(compiled_in_workers(rest, min(workers, len(rest)), progress, stop_on_error))
    else:
        results = compiled_here(representatives, progress, stop_on_error)
    outcomes = []
    for job in jobs:
        first = same_as.get(job)
        if first is None:
            outcomes.append(results[job])
            continue
        original = results[first]
        outcome = CompileOutcome(job, original.result, original.error, 0.0, None, first)
        progress.finished(outcome)
        outcomes.append(outcome)
    return outcomes


def cached_outcomes(jobs: Sequence[CompileJob], progress: Progress) -> dict[CompileJob, CompileOutcome]:
    """The jobs their backends answer from a cache, without compiling; a failing lookup counts as a miss."""
    outcomes = {}
    for job in jobs:
        started = time.perf_counter()
        try:
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


def warm_up_backends(jobs: Sequence[CompileJob]) -> None:
    """Each backend's once-per-process work, done here so that every forked worker inherits it.

    Done for one worker too: the next lowering in this process forks from it again.
    """
    for backend in {type(job.backend): job.backend for job in jobs}.values():
        backend.warm_up()


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


def split_by_structure(jobs: Sequence[CompileJob]) -> tuple[list[CompileJob], list[CompileJob]]:
    """The jobs to compile first, and the later ones whose code one of those compiles (``CompileJob.structure``).

    Compiled at once, jobs of one structure would each make the same code in a worker of its own.
    """
    sharing = [job for job in jobs if job.backend.shares_code_across_weights]
    if len(sharing) < 2:
        return list(jobs), []
    seen: set[str] = set()
    later = []
    for job in sharing:
        structure = job.structure()
        if structure in seen:
            later.append(job)
        seen.add(structure)
    return [job for job in jobs if job not in later], later


def cancelled(jobs: Sequence[CompileJob], progress: Progress) -> dict[CompileJob, CompileOutcome]:
    outcomes = {job: CompileOutcome(job) for job in jobs}
    for outcome in outcomes.values():
        progress.finished(outcome)
    return outcomes


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
        # Keyed before preprocess, which may change the program it is given.
        key = preprocess_key(job.backend, job.program, job.compile_specs)
        result = None if key is None else kept_preprocess(key, job.program)
        if result is None:
            with quiet_torch_warnings():
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


def compiled_in_workers(
    jobs: Sequence[CompileJob], workers: int, progress: Progress, stop_on_error: bool
) -> dict[CompileJob, CompileOutcome]:
    """Compile ``jobs`` in up to ``workers`` forked processes at once; outcomes by job."""
    pending = list(jobs)
    running: dict[Child, CompileJob] = {}
    outcomes: dict[CompileJob, CompileOutcome] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                worker = forked(worker_message, (job,), f"aotstack-{job.tag}")
                running[worker] = job
                progress.started(job, worker.pid)
            ready = set(wait([w.connection for w in running] + [w.process.sentinel for w in running]))
            for worker in [w for w in running if w.connection in ready or w.process.sentinel in ready]:
                job = running.pop(worker)
                outcome = outcomes[job] = finished_worker(worker, job)
                progress.finished(outcome)
                if stop_on_error and outcome.error is not None:
                    outcomes.update(cancelled(pending, progress))
                    pending.clear()
                    for other, stopped in running.items():
                        stop(other)
                        outcomes[stopped] = CompileOutcome(stopped, seconds=time.perf_counter() - other.started)
                        progress.finished(outcomes[stopped])
                    running.clear()
                    break
    finally:
        # Interrupted (Ctrl-C) or failed: no worker outlives the call.
        for worker in running:
            stop(worker)
    return outcomes


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


def default_workers() -> int:
    """One worker per core this process may run on."""
    return usable_cores()
