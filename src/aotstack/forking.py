"""Making ``os.fork`` safe for a process that has run torch: OpenMP's pool paused first.

GNU OpenMP's threads do not survive fork: a child that enters a parallel region of the pool
its parent used waits forever, and generated CPU code names its thread count, whatever the
child's setting. A paused runtime starts a fresh pool at its next parallel region, in either
process. Both the compile workers (``compile/parallel.py``) and the AOTInductor run side
(before a user's fork) pause it. This module imports nothing of aotstack.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

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
