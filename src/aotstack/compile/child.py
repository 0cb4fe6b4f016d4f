"""A forked child process that runs engine code, so that an engine crashing takes only the child with it.

An engine's native code can end the process it runs in: OpenVINO 2026.4 dies of SIGFPE compiling
a bf16 Llama at one thread on a CPU with AMX, where its CPU plugin fuses each gated MLP into one
kernel (``LLMMLP``) that shares the down projection's columns among half its threads, none at one
(its run side now steers clear of that one; the next crash is not known in advance).
Lowering runs each compile (``parallel.py``) and auto-lowering the timing of each plan
(``measure.py``) in a child forked from the caller's process; a timing child serves (``serving``),
keeping its plan loaded to time it again on request. Fork, not spawn: the child
inherits the program, its weights and every backend the caller registered, however it was
defined, and starts in milliseconds instead of the seconds importing torch takes.

Fork is used where ``can_fork`` says it is safe: on Linux, before CUDA is initialised in this
process (a CUDA context does not survive fork), outside a daemonic multiprocessing worker (which
may start no children), and with every OpenMP pool paused first
(``aotstack.forking``). A child ends with ``os._exit`` (``end_child``): a normal exit would wind down what the
engine started (Inductor's compile pool; ONNX Runtime's teardown waits forever on the threads
fork left behind). One that dies of a signal first writes its Python stack (``faulthandler``)
to a file this process reads, so the error can say where it died.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import multiprocessing
import pickle
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import IO, Any, NoReturn

import torch

from ..engine.registry import BUILT_IN
from ..errors import EngineCrashError, LoweringError
from ..forking import end_child, pause_openmp

logger = logging.getLogger("aotstack")

# How many lines of a dead child's Python stack an error carries.
STACK_LINES = 40
# How long a serving child told to end may take before it is stopped.
ENDING_SECONDS = 10.0


@dataclass(eq=False)
class Child:
    """A forked child running one function; ``connection`` brings back what it returned or raised."""

    process: Any
    connection: Connection
    # Where the child writes its Python stack if it dies of a signal.
    crash_log: IO[bytes]
    started: float = field(default_factory=time.perf_counter)

    @property
    def pid(self) -> int:
        return self.process.pid


def can_fork() -> bool:
    """Whether a child can be forked from this process; why not is logged."""
    if not sys.platform.startswith("linux"):
        reason = "fork is only safe here on Linux"
    elif torch.cuda.is_initialized():
        reason = "CUDA is initialised in this process, and its context does not survive fork"
    elif multiprocessing.current_process().daemon:
        reason = "this is a daemonic process, and multiprocessing lets it start no children"
    else:
        return True
    logger.info("engines run in this process, so a crash in one would end it: %s", reason)
    return False


def engines_lost_in_fork() -> list[str]:
    """The engines that ran in this process and whose threads a forked child would wait on forever
    (``Engine.lost_in_fork``). A child that never calls such an engine is unaffected: it frees none of
    its objects either (``collected_only_here``). ONNX Runtime's sessions and ExecuTorch's pool survive
    fork, and OpenMP's pool is paused before it."""
    try:
        with open("/proc/self/maps") as maps:
            names = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(backend_id for backend_id, engine in BUILT_IN.items()
                  if any(name.startswith(library) for library in engine.lost_in_fork for name in names))


def can_run_engines_in_fork(backend_ids: Collection[str]) -> bool:
    """Whether a forked child can load and run ``backend_ids``: ``can_fork``, and none of them ran here already
    in a way the child would hang in."""
    if not can_fork():
        return False
    lost = sorted(set(engines_lost_in_fork()) & set(backend_ids))
    if lost:
        logger.info("engines run in this process, so a crash in one would end it: %s ran here, and its threads "
                    "do not survive fork", " and ".join(lost))
    return not lost


def forked(target: Callable[..., Any], args: tuple[Any, ...], name: str) -> Child:
    """A child, forked now, running ``target(*args)`` in this process's thread count."""
    return started(child_main, (target, args), name, duplex=False)


def serving(setup: Callable[..., Any], args: tuple[Any, ...], name: str) -> Child:
    """A child, forked now, that runs ``setup(*args)``, then answers each request (``requested``) until it is
    ended (``ended``): a timing process keeps a plan loaded, so timing it again loads nothing."""
    return started(server_main, (setup, args), name, duplex=True)


def started(main: Callable[..., None], payload: tuple[Any, ...], name: str, *, duplex: bool) -> Child:
    """A child forked now, running ``main(*payload, connection, crash_log, threads)``."""
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=duplex)
    crash_log = tempfile.TemporaryFile(prefix="aotstack-crash-")
    process = context.Process(
        target=main, args=(*payload, sending, crash_log, torch.get_num_threads()), name=name, daemon=True
    )
    pause_openmp()
    with warnings.catch_warnings(), collected_only_here():
        # Python 3.12+ warns that forking a threaded process may deadlock; the child takes no
        # lock another thread could hold: it runs the engine, sends its result and exits.
        warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
        process.start()
    sending.close()
    return Child(process, receiving, crash_log)


@contextlib.contextmanager
def collected_only_here() -> Iterator[None]:
    """Fork inside this, and the child's garbage collector never frees an object this process made.

    This process may hold garbage not yet collected that owns an engine's session (a file the user
    loaded and let go of). Freeing that in a child runs the engine's teardown there, which can wait
    forever on threads fork did not copy: OpenVINO's executor does, and hung a benchmark's compile
    worker. Frozen objects (``gc.freeze``) are out of every collection's reach, so such garbage is
    freed here, by the next collection after the fork. Freezing and thawing cost the same whatever
    the heap's size. Objects a caller had frozen itself are thawed too: left frozen, every object made
    since would never be collected in this process.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def child_main(
    target: Callable[..., Any], args: tuple[Any, ...], connection: Connection, crash_log: IO[bytes], threads: int
) -> None:
    """In the child: send ``("returned", value)`` or ``("raised", error)``, then end at once."""
    prepared_child(crash_log, threads)
    send_outcome(connection, target, args)
    ended_child(connection)


def server_main(
    setup: Callable[..., Any], args: tuple[Any, ...], connection: Connection, crash_log: IO[bytes], threads: int
) -> None:
    """In a serving child: ``state = setup(*args)``, then for each request ``(function, arguments)`` send back what
    ``function(state, *arguments)`` returned or raised (where setup raised, that, and end); end on ``None``."""
    prepared_child(crash_log, threads)
    try:
        state, failure = setup(*args), None
    except Exception as error:  # noqa: BLE001 - it goes back to the parent as the answer to its request
        state, failure = None, ("raised", portable(error))
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            break
        if request is None:
            break
        if failure is not None:
            connection.send(failure)
            break
        function, arguments = request
        send_outcome(connection, function, (state, *arguments))
    ended_child(connection)


def prepared_child(crash_log: IO[bytes], threads: int) -> None:
    """A child's start: its own streams, its stack written to ``crash_log`` if it dies, the parent's thread count."""
    # A live display may have put a proxy over the streams whose lock a thread of the parent
    # held at the fork; the child writes to the streams themselves.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    faulthandler.enable(crash_log, all_threads=True)
    # Generated CPU code and the engines' pools take the parent's thread count.
    torch.set_num_threads(threads)
    # The parent reports progress; the child's own log lines would only interleave with it.
    logging.getLogger("aotstack").setLevel(logging.WARNING)


def send_outcome(connection: Connection, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Send ``("returned", function(*args))``, or ``("raised", error)``."""
    try:
        message: tuple[str, Any] = ("returned", function(*args))
    except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        message = ("raised", portable(error))
    try:
        connection.send(message)
    except Exception as error:  # noqa: BLE001 - a result that does not pickle is a failure to report too
        connection.send(("raised", LoweringError(f"the child's result could not be sent back: {error}")))


def ended_child(connection: Connection) -> NoReturn:
    connection.close()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    end_child(0)


def portable(error: Exception | None) -> Exception:
    """``error`` as it can cross to the parent: itself where it pickles, else a LoweringError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        assert error is not None
        return error
    except Exception:
        return LoweringError(f"{type(error).__name__}: {error}")


def received(child: Child) -> tuple[str, Any] | None:
    """What ``child`` sent, once it sent it; None where it ended without sending anything.

    A child that sent its result is not waited for: it ends at once, and its exit (tens of
    milliseconds for a large process) overlaps what this process does next. multiprocessing
    reaps it at the next start or at exit.
    """
    try:
        # Both: a process the engine started may hold the pipe open after the child died.
        wait([child.connection, child.process.sentinel])
        if child.connection.poll(0):
            return child.connection.recv()
    except (EOFError, OSError):
        pass
    child.process.join()
    return None


def requested(child: Child, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any] | None:
    """What a serving child (``serving``) answered to ``function(state, *args)``; None where it ended without
    answering. ``function`` and ``args`` are pickled: a function of a module, small arguments."""
    try:
        child.connection.send((function, args))
    except (BrokenPipeError, OSError):
        pass  # it died: ``received`` says so
    return received(child)


def signal_name(exitcode: int | None) -> str | None:
    """The signal that ended a child, from its exit code; None where it exited by itself."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def death(child: Child) -> str:
    """How a child that sent nothing ended: ``died of SIGFPE``, ``exited with code 1``."""
    name = signal_name(child.process.exitcode)
    return f"died of {name}" if name is not None else f"exited with code {child.process.exitcode}"


def crash_stack(child: Child) -> str:
    """The Python stack a child wrote as it died of a signal, innermost frames first; empty where it wrote none."""
    try:
        child.crash_log.seek(0)
        lines = child.crash_log.read().decode(errors="replace").splitlines()
    except (OSError, ValueError):
        return ""
    kept = []
    for line in lines:
        # The frames from child_main down are the fork and the caller's lowering, not the engine's.
        if f'File "{__file__}"' in line:
            break
        if line.strip():
            kept.append(line)
    return "\n".join(kept[:STACK_LINES])


def crash_error(child: Child, message: str) -> EngineCrashError:
    """An ``EngineCrashError`` saying ``message`` about a dead child, with its Python stack as a note."""
    error = EngineCrashError(message, signal_name(child.process.exitcode))
    stack = crash_stack(child)
    if stack:
        error.add_note(f"the Python stack of process {child.pid} when it died:\n{stack}")
    return error


def closed(child: Child) -> None:
    """Let go of a child that has ended: its crash log is no longer needed."""
    child.connection.close()
    child.crash_log.close()


def ended(child: Child) -> None:
    """Let a serving child end by itself (so it removes what it made, ``end_child``), else stop it."""
    try:
        child.connection.send(None)
    except (BrokenPipeError, OSError):
        pass
    child.process.join(ENDING_SECONDS)
    stop(child)


def stop(child: Child) -> None:
    """End a running child whose result is no longer wanted."""
    if child.process.is_alive():
        child.process.kill()
    child.process.join()
    closed(child)
