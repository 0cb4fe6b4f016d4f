"""Opening an AOTInductor library so that its C++ symbols bind to its own code first (Linux, glibc).

A library AOTInductor builds carries its own copies of the C++ templates it uses (``std::regex``'s
scanner and compiler among them, for its device string) and takes the rest of the C++ runtime
from libstdc++. torch's runner opens it with ``RTLD_LOCAL``, and glibc binds each of its symbols
to the first definition in the process's global scope (the executable and what it needs, then
every library opened with ``RTLD_GLOBAL``, in load order), and only then to its own. A CUDA build
of torch opens NVIDIA's libraries with ``RTLD_GLOBAL`` as it imports (``_preload_cuda_deps``), and
libcufile exports the ``std::regex`` instantiations of the GCC it was built with (GCC 11) and
default constructors of the string streams: an AOTInductor library opened after it runs its
regex scanner and compiler from there, on objects its own headers laid out (seen with glibc's
``LD_DEBUG=bindings``, libcufile from NVIDIA's wheel opened by hand in a CPU build of torch).
On the GPU machines' image (g++ 13.3, torch 2.11+cu130) every AOTInductor library crashed while
opening, in ``parse_device_str``'s ``std::regex``, unless libstdc++ was preloaded; mixed copies
like these are the likely cause, not yet confirmed there.

Opening the library first with ``RTLD_DEEPBIND`` puts its own scope (itself, then what it needs,
libstdc++ included) ahead of the global one for its symbols. glibc keeps one copy of a file: the
runner, opening the same path next, gets the object already loaded and bound this way. Symbols
glibc makes unique in the whole process (``STB_GNU_UNIQUE``: a template's static tables) still
go to their first definition; ``RTLD_DEEPBIND`` cannot move those.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

logger = logging.getLogger("aotstack")

# Paths opened here, each once per process. ctypes never closes a library, so each stays loaded,
# as it would for the runners that use it.
_OPENED: set[str] = set()


def preopened_library(path: str) -> str:
    """``path``, its library opened so that its symbols bind to its own code before the global scope's.

    Call it just before torch's runner opens ``path``. Where the system cannot (not Linux with
    glibc), or should not (see ``deep_binding_allowed``), or the open fails, nothing is opened
    and the runner opens the library as it always does, and reports any error itself.

    Nothing loaded from a file makes aotstack import or run code of the file's choosing, and this
    keeps it so: the library was verified by its hash before this is called, and the runner opens
    and runs that same library right after. Opening it a moment earlier (its static constructors
    run here instead of there) runs no code that would not run anyway.
    """
    if path in _OPENED or not deep_binding_allowed():
        return path
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_DEEPBIND)
    except OSError as exc:
        logger.debug("could not open %s with its own symbols first: %s", path, exc)
        return path
    _OPENED.add(path)
    return path


def deep_binding_allowed() -> bool:
    """Whether this process can open a library with ``RTLD_DEEPBIND`` and should.

    Only glibc has it. Not where ``LD_PRELOAD`` is set: whoever preloads a library (an allocator
    such as jemalloc, a sanitizer, or libstdc++ itself against this very problem) means it to
    come first for every library, and deep binding would let the library's own dependencies,
    libc's ``malloc`` among them, come before it.
    """
    if not sys.platform.startswith("linux") or not hasattr(os, "RTLD_DEEPBIND"):
        return False
    if os.environ.get("LD_PRELOAD", "").strip():
        return False
    return runs_on_glibc()


@functools.cache
def runs_on_glibc() -> bool:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # not a name this C library knows: musl, say
        return False
    return bool(version) and version.startswith("glibc")
