"""Huge pages under the weights an engine packs into memory of its own (Linux; elsewhere nothing happens).

XNNPACK (at a delegate's first call), ONNX Runtime and OpenVINO (when a session opens) copy the
weights their kernels read into memory they allocate, which the C library maps in 4 KiB pages
unless the process asked it for huge ones before it started (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
A decode step reads every weight once, a page at a time: each 4 KiB is a miss of the CPU's
address cache, and inside a virtual machine each miss walks two page tables. Weights in a mapped
file fare better: the kernel's page cache holds large files in 2 MiB pages already.

``on_huge_pages`` turns what a block of code mapped and filled into 2 MiB pages after it
(``MADV_COLLAPSE``, Linux 6.1 and later): every 2 MiB stretch of newly mapped private memory, and of
malloc's heap, whose pages are all resident. The memory earlier such blocks mapped counts too: one
delegate's weights may end in a stretch the next one's fill. The heap, because a process that has
run a while (a server that loaded a model before, a test suite) has freed heap memory, which
malloc hands the engine's packing again rather than mapping more. A stretch left partly empty is
left alone, so resident memory does not grow, and nothing is asked of other memory mapped outside
such blocks. Where the kernel refuses
(an older kernel, huge pages turned off), the memory stays as it was. ``AOTSTACK_HUGE_PAGES=0``
turns it off.

The 99.5 M Llama's ``8da4w`` decode (1 thread, cache 256, a 2-core VM; processes alternating):
XNNPACK+AOTInductor 174 and 208 tokens/s switched off, 209 and 283 on; ONNX Runtime+AOTInductor 113
and 105 off, 153 and 126 on.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..format.archive import merged

HUGE_PAGE = 2 << 20
# Linux's advice numbers (``<asm-generic/mman-common.h>``); Python's ``mmap`` names MADV_COLLAPSE
# only from 3.13 on.
MADV_COLLAPSE = 25
SWITCH = "AOTSTACK_HUGE_PAGES"

# Each byte of mincore's answer to 1 where its page is resident, to 0 where not (its other bits are reserved).
RESIDENT_BIT = bytes(value & 1 for value in range(256))

# [start, end) in the process's address space.
Span = tuple[int, int]


def enabled() -> bool:
    """Whether this process moves packed weights onto huge pages: on Linux, unless ``AOTSTACK_HUGE_PAGES=0``."""
    return sys.platform.startswith("linux") and os.environ.get(SWITCH, "1") != "0"


@contextlib.contextmanager
def on_huge_pages() -> Iterator[list[Span]]:
    """Run the block, then put what it mapped and filled on huge pages; the list it yields gets the stretches there.

    >>> with on_huge_pages() as moved:
    ...     session = open_session(...)   # packs its weights into memory of its own
    """
    moved: list[Span] = []
    if not enabled():
        yield moved
        return
    before, _ = private_memory()
    yield moved
    after, heap = private_memory()
    # malloc's heap too: in a process that has run a while, an engine packs into heap memory freed before.
    moved.extend(PACKED.collapse_after([*added_spans(before, after), *heap]))


class PackedMemory:
    """The memory engines mapped while packing, in this process.

    Kept across blocks: one delegate's packed weights may end in a 2 MiB stretch that the next
    delegate's fill, and neither block alone maps the whole of it.
    """

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def collapse_after(self, added: Sequence[Span]) -> list[Span]:
        """Add ``added``; every stretch of all the spans that is filled now, put on a huge page (a no-op for one
        that is already); the stretches the kernel put there."""
        with self.lock:
            self.spans = merged([*self.spans, *added])
            return collapsed(filled_stretches(self.spans))


PACKED = PackedMemory()


def private_memory() -> tuple[list[Span], list[Span]]:
    """The process's private, writable, anonymous mappings (malloc's heap among them), and the heap's alone, from
    ``/proc/self/maps``."""
    spans, heap = [], []
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return [], []
    for line in lines:
        fields = line.split()
        named_heap = len(fields) == 6 and fields[5] == "[heap]"
        if (len(fields) == 5 or named_heap) and fields[1].startswith("rw") and fields[1][3] == "p":
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16)))
            if named_heap:
                heap.append(spans[-1])
    return spans, heap


def added_spans(before: Sequence[Span], after: Sequence[Span]) -> list[Span]:
    """The parts of ``after`` no span of ``before`` covers (each list sorted and disjoint, as the maps list them)."""
    ends = [end for _, end in before]
    added = []
    for start, end in after:
        # The old spans that may overlap this one: from the first ending past its start.
        for old_start, old_end in before[bisect.bisect_right(ends, start):]:
            if old_start >= end:
                break
            if old_start > start:
                added.append((start, old_start))
            start = old_end
            if start >= end:
                break
        if start < end:
            added.append((start, end))
    return added


def filled_stretches(spans: Sequence[Span]) -> list[int]:
    """The start of each 2 MiB-aligned stretch lying wholly inside one of ``spans`` with every page resident."""
    mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])
    pages = HUGE_PAGE // mmap.PAGESIZE
    residency = ctypes.create_string_buffer(pages)
    starts = []
    for start, end in spans:
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        for stretch in range(first, end - HUGE_PAGE + 1, HUGE_PAGE):
            if mincore(stretch, HUGE_PAGE, residency) == 0 and 0 not in residency.raw.translate(RESIDENT_BIT):
                starts.append(stretch)
    return starts


def collapsed(starts: Sequence[int]) -> list[Span]:
    """Each 2 MiB stretch at ``starts`` the kernel put on a huge page; the others (refused) stay as they were."""
    madvise = libc_madvise()
    return [(start, start + HUGE_PAGE) for start in starts if madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0]


@functools.cache
def libc_madvise() -> Any:
    """The C library's ``madvise(address, length, advice)``."""
    return libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def libc_function(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name``, returning an int, taking ``argtypes``."""
    function = getattr(ctypes.CDLL(None, use_errno=True), name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
