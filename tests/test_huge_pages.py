"""The weights an engine packs into its own memory go on huge pages (``engine/pages.py``), and nothing else does.

Whether a stretch of memory is on huge pages is read from ``/proc/self/smaps`` (``AnonHugePages``).
Each test first asks the kernel to collapse a stretch itself: where it cannot (another system, an
older kernel, huge pages turned off), or where it gives every process huge pages unasked (THP
``always``), the tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import sys

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.engine import pages
from tests.conftest import run_child

HUGE = pages.HUGE_PAGE
PROT_NONE = 0


@dataclasses.dataclass
class Region:
    """``size`` bytes of private anonymous memory at ``start``, between two inaccessible guard pages.

    The kernel joins a new mapping to an alike neighbour (another test's memory, a thread's malloc
    arena), and ``/proc/self/smaps`` then counts the two as one: the guards differ from any neighbour.
    """

    mapping: mmap.mmap
    start: int
    size: int

    def __setitem__(self, offset: int, value: int) -> None:
        self.mapping[mmap.PAGESIZE + offset] = value

    def close(self) -> None:
        self.mapping.close()


def huge_bytes(start: int = 0, end: int = 1 << 64) -> int:
    """Bytes of the mappings inside ``[start, end)`` on huge pages, from ``/proc/self/smaps``; every mapping
    overlapping the range must lie inside it (smaps counts a whole mapping)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                overlaps = low < end and high > start
                assert not overlaps or start <= low and high <= end, "the kernel joined a test region to another"
            elif overlaps and fields[0] == "AnonHugePages:":
                total += int(fields[1]) * 1024
    return total


def huge_bytes_of(region: Region) -> int:
    return huge_bytes(region.start, region.start + region.size)


def resident_bytes(region: Region) -> int:
    residency = ctypes.create_string_buffer(region.size // mmap.PAGESIZE)
    assert pages.libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])(
        region.start, region.size, residency) == 0
    return sum(flag & 1 for flag in residency.raw) * mmap.PAGESIZE


def new_region(size: int, fill_every: int = 1) -> Region:
    """``size`` bytes of private anonymous memory, guarded on both sides, one byte written in every
    ``fill_every``-th page."""
    mapping = mmap.mmap(-1, size + 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + mmap.PAGESIZE
    mprotect = pages.libc_function("mprotect", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    for guard in (start - mmap.PAGESIZE, start + size):
        assert mprotect(guard, mmap.PAGESIZE, PROT_NONE) == 0, f"errno {ctypes.get_errno()}"
    region = Region(mapping, start, size)
    for offset in range(0, size, mmap.PAGESIZE * fill_every):
        region[offset] = 1
    return region


@pytest.fixture(scope="module")
def collapsing_kernel() -> None:
    """Skip unless this kernel puts a filled, private 2 MiB stretch on a huge page when asked."""
    if not sys.platform.startswith("linux"):
        pytest.skip("huge pages are moved on Linux only")
    with contextlib.suppress(OSError), open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
        if "[always]" in mode.read():
            pytest.skip("this kernel gives all memory huge pages as it is touched (THP 'always'): nothing to compare")
    probe = new_region(3 * HUGE)
    stretch = -(-probe.start // HUGE) * HUGE
    if pages.libc_madvise()(stretch, HUGE, pages.MADV_COLLAPSE) != 0:
        pytest.skip(f"this kernel does not collapse memory into huge pages (errno {ctypes.get_errno()})")
    probe.close()


def test_a_block_s_filled_memory_goes_on_huge_pages_and_nothing_else_does(collapsing_kernel, monkeypatch):
    monkeypatch.delenv(pages.SWITCH, raising=False)
    # What engines in earlier tests mapped counts in later blocks, and `earlier` may reuse its addresses.
    monkeypatch.setattr(pages, "PACKED", pages.PackedMemory())
    earlier = new_region(6 * HUGE)
    with pages.on_huge_pages() as moved:
        filled = new_region(6 * HUGE)
        sparse = new_region(6 * HUGE, fill_every=2)
    sparse_resident = resident_bytes(sparse)

    # At least the four whole, aligned stretches inside six.
    assert huge_bytes_of(filled) >= 4 * HUGE
    low, high = filled.start, filled.start + filled.size
    assert len([start for start, end in moved if low <= start and end <= high]) >= 4
    # Memory mapped before the block, and memory the block left half empty, stay as they were: resident memory
    # does not grow to fill a huge page.
    assert huge_bytes_of(earlier) == 0
    assert huge_bytes_of(sparse) == 0
    assert resident_bytes(sparse) == sparse_resident == 3 * HUGE


def test_switched_off_a_block_s_memory_stays_on_small_pages(collapsing_kernel, monkeypatch):
    monkeypatch.setenv(pages.SWITCH, "0")
    with pages.on_huge_pages() as moved:
        filled = new_region(6 * HUGE)
    assert moved == [] and huge_bytes_of(filled) == 0


class Wide(torch.nn.Module):
    """One linear of 8 MiB of float32 weights: every engine here packs it into memory of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(1024, 2048, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


ENGINES = {
    "onnxruntime": ("onnxruntime", aotstack.OrtPartitioner),
    "openvino": ("openvino", aotstack.OpenVinoPartitioner),
    "xnnpack": ("executorch", aotstack.XnnpackPartitioner),
}


# Loads a file in a process of its own and calls it: the process's bytes on huge pages the load and the call added,
# and the output. In the suite's long-lived processes, memory earlier tests asked huge pages for collapses whenever
# the kernel's background thread gets to it, a window of this test's included (14 MiB in one run).
LOAD_AND_CALL = """
import json, sys, torch, aotstack

def huge_bytes():
    with open("/proc/self/smaps") as smaps:
        return sum(int(line.split()[1]) * 1024 for line in smaps if line.startswith("AnonHugePages:"))

x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(0))
before = huge_bytes()
loaded = aotstack.load(sys.argv[1])
output = loaded.forward(x)
print(json.dumps({"added": huge_bytes() - before, "output": output.flatten().tolist()}))
"""


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_weights_an_engine_packs_go_on_huge_pages_by_the_first_call(collapsing_kernel, engine, tmp_path,
                                                                        monkeypatch):
    module, partitioner = ENGINES[engine]
    pytest.importorskip(module)
    if module == "executorch" and executorch_problem() is not None:
        pytest.skip(str(executorch_problem()))
    model, x = Wide().eval(), torch.randn(2, 1024, generator=torch.Generator().manual_seed(0))  # the child's x
    path = tmp_path / f"{engine}.pt2"
    aotstack.lower(aotstack.export(model, {"forward": (x,)}), [partitioner()]).save(path)
    with torch.no_grad():
        expected = model(x)

    def huge_bytes_added_by_load_and_call(switch: str) -> int:
        monkeypatch.setenv(pages.SWITCH, switch)
        result = run_child(LOAD_AND_CALL, str(path))
        torch.testing.assert_close(torch.tensor(result["output"]).reshape(expected.shape), expected,
                                   atol=1e-4, rtol=1e-4)
        return result["added"]

    # Switched off first: the engine's own allocations put nothing on huge pages, so what follows is this.
    assert huge_bytes_added_by_load_and_call("0") <= 0
    assert huge_bytes_added_by_load_and_call("1") >= HUGE
