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
    """Release OpenMP's threads, if this process loaded an OpenMP runtime; call it just before a fork."""
    pause = openmp_pause()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)


@functools.cache
def openmp_pause() -> Any:
    """``omp_pause_resource_all`` of the OpenMP runtime this process loaded; None where none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if any(name in line for name in OPENMP_LIBRARIES)})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
    return None
