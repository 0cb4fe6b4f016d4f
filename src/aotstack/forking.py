"""Making ``os.fork`` safe for a process that has run torch: OpenMP's pool paused first.

GNU OpenMP's threads do not survive fork: a child that enters a parallel region of the pool
its parent used waits forever, and generated CPU code names its thread count, whatever the
child's setting. A paused runtime starts a fresh pool at its next parallel region, in either
process. Both the compile workers (``compile/parallel.py``) and the AOTInductor run side
(before a user's fork) pause it.

A child that ends itself with ``os._exit`` skips the exit hooks (``atexit``) of everything it
made: a temporary directory made in the child for its own use is removed by ``end_child``
instead, which the child calls in place of ``os._exit``. This module imports nothing of aotstack.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
from typing import Any, NoReturn

# omp_pause_soft from omp.h: release the threads, keep the runtime's state.
OMP_PAUSE_SOFT = 1

OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp")


def pause_openmp() -> None:
    """Release the threads of every OpenMP runtime this process loaded; call it just before a fork.

    A process can hold several (torch's own libgomp, and another bundled by a package such as
    sentencepiece): pausing only one leaves the other's pool to hang the child.
    """
    for pause in openmp_pauses(loaded_openmp_libraries()):
        pause(OMP_PAUSE_SOFT)


def loaded_openmp_libraries() -> tuple[str, ...]:
    """The OpenMP runtimes mapped into this process now; a library loaded later shows up at the next call."""
    try:
        with open("/proc/self/maps") as maps:
            return tuple(sorted({line.split()[-1] for line in maps
                                 if any(name in line.rsplit("/", 1)[-1] for name in OPENMP_LIBRARIES)}))
    except OSError:
        return ()


@functools.cache
def openmp_pauses(paths: tuple[str, ...]) -> list[Any]:
    """``omp_pause_resource_all`` of each runtime in ``paths`` that has one."""
    pauses = []
    for path in paths:
        try:
            pauses.append(ctypes.CDLL(path).omp_pause_resource_all)
        except (OSError, AttributeError):
            continue
    return pauses


# The directories ``remove_at_exit`` was given, each with the process that made it.
_OWNED_DIRECTORIES: list[tuple[str, int]] = []


def remove_at_exit(directory: str) -> None:
    """Remove ``directory`` when this process ends, whether it exits or, a forked child, ends with ``end_child``.

    A forked child inherits the hook but not the directory: only the process that called this removes it.
    """
    owner = os.getpid()
    _OWNED_DIRECTORIES.append((directory, owner))
    atexit.register(remove_if_owned, directory, owner)


def remove_if_owned(directory: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


def end_child(code: int) -> NoReturn:
    """End a forked child at once (``os._exit``), removing the directories it made for itself first."""
    for directory, owner in _OWNED_DIRECTORIES:
        remove_if_owned(directory, owner)
    os._exit(code)
