"""Compiling many partitions at once: identical ones once, the rest in worker processes.

A backend's ``preprocess`` is slow (an AOTInductor compile costs 10-90 s) and mostly single
threaded, so partitions that do not depend on each other compile in forked worker processes,
at most ``workers`` at a time. A forked worker inherits the partition, its backend and every
registered backend as they are in memory; only the result travels back, through a pipe.

Fork is used where it is safe: on Linux, before CUDA is initialised in this process (a CUDA
context does not survive fork), and with OpenMP's pool paused first (``aotstack.forking``).
Elsewhere partitions compile one at a time in this process, as with ``workers=1``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy
import torch
from torch.export import ExportedProgram

from ..errors import LoweringError
from ..forking import pause_openmp
from ..format.archive import usable_cores
from ..format.specs import PreprocessResult
from ..format.tensor_data import BytesLike, tensor_buffer, tensor_is_viewable
from .cache import keep_preprocess, kept_preprocess, preprocess_key
from .jobs import CompileJob, CompileOutcome
from .program_parts import program_weights
from .progress import Progress

logger = logging.getLogger("aotstack")


class WorkerDiedError(LoweringError):
    """A compile worker process ended without a result: killed, out of memory, or a crash in native code."""


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
    if workers > 1 and len(representatives) > 1 and can_fork():
        # A partition compiled before costs no worker: its backend's cache answers here.
        results = cached_outcomes(representatives, progress)
        misses = [job for job in representatives if job not in results]
        if len(misses) > 1:
            warm_up_backends(misses)
            results.update(compiled_in_workers(misses, min(workers, len(misses)), progress, stop_on_error))
        else:
            results.update(compiled_here(misses, progress, stop_on_error))
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
    """Each backend's once-per-process work, done here so that every forked worker inherits it."""
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


def can_fork() -> bool:
    """Whether a worker can be forked from this process; why not is logged once."""
    if not sys.platform.startswith("linux"):
        reason = "fork is only safe here on Linux"
    elif torch.cuda.is_initialized():
        reason = "CUDA is initialised in this process, and its context does not survive fork"
    else:
        return True
    logger.info("compiling partitions one at a time: %s", reason)
    return False


@dataclass(eq=False)
class Running:
    job: CompileJob
    process: Any
    connection: Connection
    started: float = field(default_factory=time.perf_counter)


def compiled_in_workers(
    jobs: Sequence[CompileJob], workers: int, progress: Progress, stop_on_error: bool
) -> dict[CompileJob, CompileOutcome]:
    """Compile ``jobs`` in up to ``workers`` forked processes at once; outcomes by job."""
    pending = list(jobs)
    running: list[Running] = []
    outcomes: dict[CompileJob, CompileOutcome] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                worker = started_worker(pending.pop(0))
                running.append(worker)
                progress.started(worker.job, worker.process.pid)
            ready = set(wait([w.connection for w in running] + [w.process.sentinel for w in running]))
            for worker in [w for w in running if w.connection in ready or w.process.sentinel in ready]:
                running.remove(worker)
                outcome = outcomes[worker.job] = finished_worker(worker)
                progress.finished(outcome)
                if stop_on_error and outcome.error is not None:
                    for job in pending:
                        outcomes[job] = CompileOutcome(job)
                        progress.finished(outcomes[job])
                    pending.clear()
                    for other in running:
                        stop(other)
                        outcomes[other.job] = CompileOutcome(other.job, seconds=time.perf_counter() - other.started)
                        progress.finished(outcomes[other.job])
                    running.clear()
                    break
    finally:
        # Interrupted (Ctrl-C) or failed: no worker outlives the call.
        for worker in running:
            stop(worker)
    return outcomes


def started_worker(job: CompileJob) -> Running:
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    process = context.Process(
        target=worker_main, args=(job, sending, torch.get_num_threads()), name=f"aotstack-{job.tag}", daemon=True
    )
    pause_openmp()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a threaded process may deadlock; the child takes no
        # lock another thread could hold: it compiles, sends its result and exits.
        warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
        process.start()
    sending.close()
    return Running(job, process, receiving)


def worker_main(job: CompileJob, connection: Connection, threads: int) -> None:
    """In the forked worker: compile the job and send back its result or its error."""
    # A live display may have put a proxy over the streams whose lock a thread of the parent
    # held at the fork; the worker writes to the streams themselves.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    # Generated CPU code names its thread count: the worker compiles for the parent's.
    torch.set_num_threads(threads)
    # The parent shows progress; the worker's own log lines would only interleave with it.
    logging.getLogger("aotstack").setLevel(logging.WARNING)
    outcome = compiled(job)
    if outcome.result is not None:
        result = outcome.result
        message: tuple[Any, ...] = (
            "done", result.processed_bytes, portable_named_data(job.program, result.named_data),
            result.from_cache, outcome.seconds,
        )
    else:
        message = ("failed", portable(outcome.error), outcome.seconds)
    connection.send(message)
    connection.close()
    # Ended at once: a normal exit would first wind down what the compile started (Inductor's
    # pool of compile processes among it), seconds the parent would spend waiting in join().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def portable(error: Exception | None) -> Exception:
    """``error`` as it can cross to the parent: itself where it pickles, else a LoweringError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        assert error is not None
        return error
    except Exception:
        return LoweringError(f"{type(error).__name__}: {error}")


def finished_worker(worker: Running) -> CompileOutcome:
    """The outcome a worker sent, or a ``WorkerDiedError`` where it ended without sending one."""
    job, process = worker.job, worker.process
    pid = process.pid
    message = None
    try:
        if worker.connection.poll():
            message = worker.connection.recv()
    except (EOFError, OSError):
        message = None
    finally:
        worker.connection.close()
    process.join()
    seconds = time.perf_counter() - worker.started
    if message is None:
        died = WorkerDiedError(
            f"the compile worker (process {pid}) {exit_reason(process.exitcode)} before sending a result"
        )
        return CompileOutcome(job, error=died, seconds=seconds, worker=pid)
    if message[0] == "failed":
        error = message[1]
        error.add_note(f"raised in compile worker process {pid}")
        return CompileOutcome(job, error=error, seconds=message[2], worker=pid)
    _, processed, named_data, from_cache, seconds = message
    result = PreprocessResult(processed, received_named_data(job.program, named_data), from_cache)
    return CompileOutcome(job, result, seconds=seconds, worker=pid)


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop(worker: Running) -> None:
    """End a running worker: its result is no longer wanted. The compile cache is written atomically."""
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join()
    worker.connection.close()


def default_workers() -> int:
    """One worker per core this process may run on."""
    return usable_cores()
