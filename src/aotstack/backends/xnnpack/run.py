"""XNNPACK run side: each delegate a program loaded by ExecuTorch's runtime from the package's bytes.

ExecuTorch reads a program from a Python ``bytes`` object, and a program's external data from
a second one (``_load_for_executorch_from_buffer(program, data_map_buffer=...)``); it accepts
no other buffer, so both are copies of the mapped package: the program is small, and the data
file is put back together from its frame and segments, each verified named data
(``assembled_data_map``), in one copy. XNNPACK packs the weights it multiplies into memory of
its own when it first runs the program. Nothing is written to disk; nothing is unpickled.

Inputs are handed over as they are (contiguous, detached): the programs are written with
unplanned inputs, so ExecuTorch reads the caller's memory. Outputs are copied once out of
ExecuTorch's memory, which the next call reuses.

The runtime is imported as its extension module alone: ``portable_lib``, its public face,
imports ExecuTorch's whole compiler (and torch's) for a warning class, about 2 s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import re
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.pages import libc_madvise, on_huge_pages
from ...engine.session import DelegateFiles, SessionRuntime, engine_inputs
from ...errors import AotstackError, DelegateInitError, PackageError, RunError
from ...format import processed as processed_json
from ...format.archive import page_ranges
from ...format.boundary import BoundaryCheck
from ...format.specs import SpecKey, count_spec
from ...format.tensor_data import BytesLike
from .packages import require_executorch

logger = logging.getLogger("aotstack")

# Named data: the ``.pte`` program, the ``.ptd``'s frame, and each of its segments (``data:<key>``).
PROGRAM_NAME = "program.pte"
FRAME_NAME = "data.ptd-frame"
DATA_PREFIX = "data:"
# The method each program holds.
METHOD = "forward"
# The processed JSON this run side reads.
PROCESSED_VERSION = 1
# A FlatTensor file: 8 bytes of flatbuffer preamble, then its header's magic.
FLAT_TENSOR_MAGIC = b"FH01"
# A range of bytes, (start, end).
Span = tuple[int, int]

# ExecuTorch's runtime shares one thread pool and each program's planned memory between calls:
# one call at a time in this process (XNNPACK's pool runs one parallel job at a time anyway).
_RUNTIME_LOCK = threading.Lock()


@dataclass
class ThreadPool:
    """ExecuTorch's one thread pool in this process, as its XNNPACK delegates use it.

    Each delegate keeps the pool it started on: replacing the pool under a started delegate
    (``_unsafe_reset_threadpool``) crashed its next call (SIGSEGV going from 2 threads to 1, a hang
    back to 2). So the pool follows torch's thread count while no started delegate is alive, and
    keeps its count while one is.
    """

    # The handles of delegates started on it, while they are alive.
    started: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    # Whether a call was told the pool cannot follow torch's thread count now.
    warned: bool = False
    # The count the pool last had when asked, or was given.
    seen: int | None = None

    def follow(self, threads: int) -> None:
        """Give the pool ``threads`` threads, where no delegate started on it is alive."""
        if threads == self.seen and self.started:
            # Nothing would change: while a delegate started on it lives, the pool keeps its count. Asking
            # ExecuTorch costs about 2 µs, at each of a decode step's dozen XNNPACK calls.
            return
        # Read otherwise: whoever else holds ExecuTorch's runtime in this process may have resized it.
        with pool_notes_dropped():
            current = self.seen = runtime_module()._threadpool_get_thread_count()
        if current == threads:
            return
        if not self.started:
            with pool_notes_dropped():
                runtime_module()._unsafe_reset_threadpool(threads)
            self.seen = threads
        elif not self.warned:
            self.warned = True
            logger.warning(
                "XNNPACK keeps the %d thread(s) its loaded delegates started on: ExecuTorch's thread pool cannot be "
                "replaced under them, so a call asking for %d (its delegate's threads spec, else torch's thread "
                "count) runs on %d until they are released",
                current, threads, current,
            )


_POOL = ThreadPool()

# What ExecuTorch's C++ runtime prints to stderr as its pool starts (what it read of the CPU: on an x86 machine,
# "Failed to open midr file", an ARM register) or is resized: notes, at every load of an XNNPACK file, not problems.
POOL_NOTES = re.compile(rb"\[(cpuinfo_utils|threadpool)\.cpp:\d+\] ")
# One catch at a time: a second, nested in another thread's, would put back the first one's file as stderr.
_STDERR_LOCK = threading.Lock()


@contextmanager
def pool_notes_dropped() -> Iterator[None]:
    """The block run with the process's stderr (file descriptor 2) caught, and what it caught written back but for
    ExecuTorch's pool notes (``POOL_NOTES``): another thread's lines in the meantime come out after it, not lost.
    ExecuTorch's Python bindings have no log level to set instead."""
    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no stderr to catch (a closed or replaced one): the notes go where they go
            yield
            return
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                kept = [line for line in caught.read().splitlines(keepends=True) if not POOL_NOTES.match(line)]
                if kept:
                    os.write(2, b"".join(kept))


@dataclass(frozen=True)
class Segment:
    """One segment of the data file: the named data holding it, and where it sits after the frame."""

    name: str
    offset: int
    size: int

    def to_json(self) -> list[Any]:
        return [self.name, self.offset, self.size]


class XnnpackRuntime(SessionRuntime):
    """XNNPACK's run side: one ExecuTorch module per delegate."""

    backend_id = "xnnpack"
    readable_versions = (PROCESSED_VERSION,)
    required_named_data = (PROGRAM_NAME,)

    def open(self, delegate: DelegateFiles) -> XnnpackHandle:
        label, processed, named_data = delegate.label, delegate.processed, delegate.named_data
        outputs = processed_json.field(processed, "outputs", int, label)
        data_size = processed_json.field(processed, "data_size", int, label)
        segments = read_segments(processed, label)
        needed = [*([FRAME_NAME] if data_size else []), *(segment.name for segment in segments)]
        missing = [name for name in needed if name not in named_data]
        if missing:
            raise PackageError(f"{label}: the package holds no named data {', '.join(map(repr, missing))}")
        frame = named_data.get(FRAME_NAME, b"")
        data_map = assembled_data_map(frame, segments, named_data, data_size, label)
        program = bytes(named_data[PROGRAM_NAME])
        module = loaded_module(program, data_map, label)
        base = memoryview(frame).nbytes
        packed = packed_spans(processed, segments, base, label)
        return XnnpackHandle(module, [program, data_map], outputs, label, delegate.boundary.checker(label),
                             unsettled=list(range(len(delegate.boundary.inputs))),
                             packed=packed, read=read_spans(segments, base, packed),
                             threads=count_spec(delegate.compile_specs, SpecKey.THREADS))

    def execute(self, handle: XnnpackHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


def read_segments(processed: Mapping[str, Any], label: str) -> list[Segment]:
    segments = []
    for entry in processed_json.field(processed, "segments", list, label):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and all(type(n) is int and n >= 0 for n in entry[1:])):
            raise PackageError(f"{label}: processed field 'segments' must list [name, offset, size], got {entry!r}")
        if not entry[0].startswith(DATA_PREFIX):
            raise PackageError(f"{label}: segment {entry[0]!r} is not named data {DATA_PREFIX}<key>")
        segments.append(Segment(*entry))
    return segments


def packed_spans(processed: Mapping[str, Any], segments: list[Segment], base: int, label: str) -> list[Span]:
    """Where in the data file lie the segments its ``packed`` field names (none where the field is absent)."""
    names = processed.get("packed", [])
    known = {segment.name for segment in segments}
    if not isinstance(names, list) or not all(isinstance(name, str) and name in known for name in names):
        raise PackageError(f"{label}: processed field 'packed' must list segments of its data file, got {names!r}")
    return [(base + segment.offset, base + segment.offset + segment.size) for segment in segments
            if segment.name in names]


def read_spans(segments: list[Segment], base: int, packed: list[Span]) -> list[Span]:
    """Where in the data file lie its frame and the segments XNNPACK keeps reading (those not ``packed``)."""
    spans = [(base + segment.offset, base + segment.offset + segment.size) for segment in segments]
    return [(0, base), *(span for span in spans if span not in packed)]


def frame_header(frame: BytesLike, label: str, error: type[AotstackError] = PackageError) -> tuple[int, int]:
    """Where a FlatTensor file's segments start, and how many bytes they take, read from its header."""
    view = memoryview(frame)
    if view.nbytes < 48 or bytes(view[8:12]) != FLAT_TENSOR_MAGIC:
        raise error(f"{label}: its data file does not start with a FlatTensor header")
    base = int.from_bytes(view[32:40], "little")
    data_size = int.from_bytes(view[40:48], "little")
    return base, data_size


def assembled_data_map(
    frame: BytesLike, segments: list[Segment], data: Mapping[str, BytesLike], size: int, label: str
) -> bytes | None:
    """The data file as ExecuTorch wrote it: its frame, then each segment at its offset, zeros between; one copy.

    Every size and offset is checked against the frame's header and the named data first, so a
    file that does not add up is a ``PackageError`` before ExecuTorch reads it. None where the
    program has no external data.
    """
    if not segments and not len(frame):
        if size:
            raise PackageError(f"{label}: processed data gives its data file {size} bytes, but it has no frame")
        return None
    base, data_size = frame_header(frame, label)
    if len(frame) != base or base + data_size != size:
        raise PackageError(f"{label}: its data file's frame does not match the size it was written with")
    pieces: list[BytesLike] = [frame]
    end = 0
    for segment in segments:
        blob = data[segment.name]
        if memoryview(blob).nbytes != segment.size:
            raise PackageError(f"{label}: named data {segment.name!r} holds {memoryview(blob).nbytes} bytes, "
                               f"its segment {segment.size}")
        if segment.offset < end or segment.offset + segment.size > data_size:
            raise PackageError(f"{label}: segment {segment.name!r} overlaps another or lies outside the data file")
        pieces += [bytes(segment.offset - end), blob]
        end = segment.offset + segment.size
    pieces.append(bytes(data_size - end))
    return b"".join(pieces)


@functools.cache  # asked at every call (the thread pool's size): imported once
def runtime_module() -> Any:
    """ExecuTorch's runtime extension (see the module's docstring for why not ``portable_lib``)."""
    require_executorch("an xnnpack partition needs executorch to run", DelegateInitError)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from executorch.extension.pybindings import _C
    return _C


def loaded_module(program: bytes, data_map: bytes | None, label: str) -> Any:
    """An ExecuTorch module over ``program`` and its data file, its program read and verified now.

    XNNPACK itself starts (and packs its weights) at the first call.
    """
    runtime = runtime_module()
    if "XnnpackBackend" not in runtime._get_registered_backend_names():
        raise DelegateInitError(f"{label}: this ExecuTorch runtime has no XNNPACK backend")
    try:
        module = runtime._load_for_executorch_from_buffer(
            program, data_map_buffer=data_map, program_verification=runtime.Verification.InternalConsistency
        )
        module.method_meta(METHOD)
    except Exception as error:
        raise DelegateInitError(f"{label}: ExecuTorch could not load the program: {error}") from error
    return module


@dataclass(eq=False)  # by identity: the thread pool keeps started ones in a weak set
class XnnpackHandle:
    module: Any
    # The program and data file: ExecuTorch reads them where they are, so they must outlive the module.
    keep_alive: list[bytes | None]
    outputs: int
    label: str
    check: BoundaryCheck | None
    # The inputs a call makes plain and contiguous (``engine_inputs``): every one, until the plan vouches for some.
    unsettled: list[int]
    # Whether a call has run: ExecuTorch sets XNNPACK up at the first.
    started: bool = False
    # (start, end) in the data file of the constants XNNPACK reads only to pack them, at the first call,
    # and of what it reads at every call.
    packed: list[Span] = field(default_factory=list)
    read: list[Span] = field(default_factory=list)
    # Its ``threads`` spec: the pool's size at its first call; None follows torch's thread count.
    threads: int | None = None


def run(handle: XnnpackHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call: inputs checked, handed to ExecuTorch as plain contiguous tensors, outputs copied out once."""
    if handle.check is not None:
        handle.check(inputs)
    # ExecuTorch takes exactly torch.Tensor (not a Parameter), contiguous, with no pending negation.
    feeds = engine_inputs(inputs, handle.unsettled)
    if not handle.started:
        return first_run(handle, feeds)
    with _RUNTIME_LOCK:
        # XNNPACK's pool follows the delegate's threads spec, else torch's thread count as every other engine here
        # does, while no started delegate holds it.
        _POOL.follow(handle.threads or torch.get_num_threads())
        try:
            return handle.module.run_method(METHOD, feeds, True)
        except RuntimeError as error:
            raise RunError(f"{handle.label}: ExecuTorch could not run it: {error}") from error


def first_run(handle: XnnpackHandle, feeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first call, which sets XNNPACK up: it packs its weights (on huge pages), and its outputs are counted."""
    with _RUNTIME_LOCK:
        _POOL.follow(handle.threads or torch.get_num_threads())
        _POOL.started.add(handle)
        try:
            with on_huge_pages():
                outputs = handle.module.run_method(METHOD, feeds, True)
        except RuntimeError as error:
            raise DelegateInitError(f"{handle.label}: ExecuTorch could not run it: {error}") from error
        handle.started = True
        release_packed(handle)
    if len(outputs) != handle.outputs:
        raise PackageError(f"{handle.label}: the program returned {len(outputs)} outputs, its record says "
                           f"{handle.outputs}")
    return list(outputs)


def release_packed(handle: XnnpackHandle) -> None:
    """Give back the memory of the data file's constants XNNPACK packed at its first call (Linux; elsewhere a no-op).

    ExecuTorch hands XNNPACK each constant as a pointer into the data file. When it creates
    XNNPACK's runtime (at the first call), the nodes that pack their weights (fully connected
    and convolutions: filter, bias, their scales) copy them into XNNPACK's own memory, and
    ExecuTorch drops its pointers to them (XNNCompiler.cpp: the buffers of packed values are
    freed once the runtime exists); every other constant (a multiplier, a PReLU slope) is
    read where it is at each call, so its pages stay. The data file is a ``bytes`` object,
    private memory: a page given back reads as zeros afterwards, which no one reads.
    """
    data_map = handle.keep_alive[1]
    if not handle.packed or data_map is None or not sys.platform.startswith("linux"):
        return
    address = ctypes.cast(ctypes.c_char_p(data_map), ctypes.c_void_p).value or 0
    end = address + len(data_map)
    # Whatever lies around the bytes object (its header, other objects) keeps its pages too.
    kept = [(address + start, address + stop) for start, stop in handle.read] + [(address - 1, address), (end, end + 1)]
    dropped = [(address + start, address + stop) for start, stop in handle.packed]
    madvise = libc_madvise()
    for start, stop in page_ranges(dropped, kept, mmap.PAGESIZE, 1 << 64):
        madvise(start, stop - start, mmap.MADV_DONTNEED)

