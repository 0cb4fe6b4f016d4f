"""One copy of the weights: the file's pages an engine no longer reads leave memory, and outputs stay right.

Loading verifies every blob, which reads every page of the file; what nothing reads in place
afterwards is dropped (``MappedPages``, ``BackendRuntime.released_named_data``). Which pages
this process has mapped is read from ``/proc/self/pagemap``: a page dropped is not mapped until
it is read again. Each engine's package is lowered by that engine alone (what it leaves runs as
plain ATen), so no test waits for an AOTInductor compile it does not need.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy
import pytest
import torch

import aotstack
from aotstack import Backend, DelegationSpec, Partitioner, PartitionResult, PreprocessResult
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.format.archive import page_ranges, read_manifest
from tests.conftest import run_child

needs_pagemap = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")


def address(data: memoryview | bytes) -> int:
    """Where ``data``'s bytes are in this process."""
    return numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data


def mapped_pages(start: int, length: int) -> tuple[int, int]:
    """(mapped, all) of the pages wholly inside ``[start, start + length)``; mapped ones are in memory now."""
    page = mmap.PAGESIZE
    first, last = -(-start // page), (start + length) // page
    if last <= first:
        return 0, 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        entries = struct.unpack(f"<{last - first}Q", os.pread(pagemap.fileno(), 8 * (last - first), 8 * first))
    return sum(entry >> 63 for entry in entries), last - first


def blob_pages(loaded: aotstack.LoadedProgram, path: Path, backend_id: str, prefix: str = "") -> tuple[int, int]:
    """(mapped, all) pages of the named data starting with ``prefix`` of ``backend_id``'s delegates, in the file."""
    keys = {
        key
        for method in read_manifest(path).methods.values()
        for delegate in method.delegates if delegate.backend_id == backend_id
        for name, key in delegate.named_data.items() if name.startswith(prefix)
    }
    counts = [mapped_pages(address(loaded._state.blobs[key]), loaded._state.blobs[key].nbytes) for key in keys]
    return sum(mapped for mapped, _ in counts), sum(total for _, total in counts)


class Wide(torch.nn.Module):
    """Two linears of 256 KB of weights each, and a running total the method updates (so ``reset`` has work).

    No biases: an engine reads a bias in place, and reading a page maps up to 15 cached pages
    around it too (the kernel's fault-around), some of them a weight's.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(128, 512, bias=False)
        self.down = torch.nn.Linear(512, 128, bias=False)
        self.register_buffer("total", torch.zeros(4, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        self.total.add_(y)
        return y + self.total


INPUTS = [torch.randn(4, 128, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]


def eager_answers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's answers to INPUTS, then to the first again after a reset (its running total back to zero)."""
    with torch.no_grad():
        answers = [model(x) for x in INPUTS]
        model.total.zero_()
        return [*answers, model(INPUTS[0])]


def loaded_answers(loaded: aotstack.LoadedProgram, between: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    """What ``eager_answers`` asks, of the loaded file; ``between`` runs after the first two calls, before the reset."""
    answers = [loaded.forward(x) for x in INPUTS]
    between()
    loaded.reset()
    return [*answers, loaded.forward(INPUTS[0])]


# Each engine alone, and how close it comes to eager: the quantized one quantizes activations its own way.
ENGINES = {
    "onnxruntime": ("onnxruntime", None, lambda: [aotstack.OrtPartitioner()]),
    "openvino": ("openvino", None, lambda: [aotstack.OpenVinoPartitioner()]),
    "xnnpack": ("executorch", None, lambda: [aotstack.XnnpackPartitioner()]),
    "xnnpack-8da4w": ("executorch", "8da4w", lambda: [aotstack.XnnpackPartitioner()]),
}


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[torch.Tensor]]]:
    """Per engine, lowered on first use: its file and eager's answers."""
    directory, built = tmp_path_factory.mktemp("released"), {}

    def package(engine: str) -> tuple[Path, list[torch.Tensor]]:
        module, scheme, partitioners = ENGINES[engine]
        pytest.importorskip(module)
        if module == "executorch" and executorch_problem() is not None:
            pytest.skip(str(executorch_problem()))
        if engine not in built:
            model = Wide().eval()
            if scheme is not None:
                pytest.importorskip("torchao")
                aotstack.quantize(model, linear=scheme, group_size=32)
            path = directory / f"{engine}.pt2"
            aotstack.lower(aotstack.export(model, {"forward": (INPUTS[0],)}), partitioners()).save(path)
            built[engine] = (path, eager_answers(model))
        return built[engine]

    return package


def assert_close(got: list[torch.Tensor], expected: list[torch.Tensor], quantized: bool) -> None:
    for answer, reference in zip(got, expected, strict=True):
        # XNNPACK's 4-bit kernels round activations and scales their own way (see test_xnnpack).
        tolerance = {"atol": 0.02 * float(reference.abs().max()), "rtol": 0.0} if quantized else {}
        torch.testing.assert_close(answer, reference, **tolerance)


@needs_pagemap
@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_engine_that_packs_leaves_no_copy_of_its_weights_in_the_file_pages(packages, engine):
    path, expected = packages(engine)
    loaded = aotstack.load(path)
    backend_id = engine.split("-")[0]
    mapped, pages = blob_pages(loaded, path, backend_id)
    assert pages >= 10, "the test's weights span whole pages"
    assert mapped == 0, f"{mapped} of {pages} pages of the {backend_id} delegate's named data stayed after load"

    def weights_not_read_again() -> None:
        # A weight the engine reads in place comes back when read; these linears' weights were packed.
        mapped, _ = blob_pages(loaded, path, backend_id, "weight:" if backend_id != "xnnpack" else "data:")
        assert mapped == 0, f"{mapped} pages of packed weights were read again"

    assert_close(loaded_answers(loaded, weights_not_read_again), expected, quantized="8da4w" in engine)


@needs_pagemap
@pytest.mark.parametrize("engine", ["xnnpack", "xnnpack-8da4w"])
def test_xnnpack_gives_back_its_copy_of_what_it_packed_at_the_first_call(packages, engine):
    from aotstack.backends.xnnpack.run import XnnpackHandle

    path, expected = packages(engine)
    loaded = aotstack.load(path)
    [handle] = [h for h in handles(loaded) if isinstance(h, XnnpackHandle)]
    data_map = handle.keep_alive[1]
    packed = sum(end - start for start, end in handle.packed)
    # Every linear's weights, 4-bit ones two a byte.
    weights = sum(p.numel() * p.element_size() for p in Wide().parameters())
    assert packed > 0.9 * weights / (8 if "8da4w" in engine else 1)
    before = sum(mapped_pages(address(data_map) + start, end - start)[0] for start, end in handle.packed)

    answers = loaded_answers(loaded)

    after = sum(mapped_pages(address(data_map) + start, end - start)[0] for start, end in handle.packed)
    assert before > 0 and after == 0, f"{after} pages of the data file XNNPACK packed stayed after its first call"
    assert_close(answers, expected, quantized="8da4w" in engine)


def handles(loaded: aotstack.LoadedProgram) -> list[object]:
    """The run-side handles of ``loaded.forward``'s delegates, found in its step closures."""
    return [
        cell.cell_contents
        for action in loaded.method("forward").body.actions
        for cell in action.__closure__ or ()
        if type(cell.cell_contents).__name__.endswith("Handle")
    ]


# A process that locks its memory (as a latency-bound server may): every mapping made from now on is
# locked, the package's included, and the kernel refuses to drop a locked page (EINVAL).
LOCKED_RUN = """
import ctypes, json, sys
import torch
import aotstack
from tests.test_weights_released import INPUTS, loaded_answers
MCL_FUTURE = 2
if ctypes.CDLL(None, use_errno=True).mlockall(MCL_FUTURE) != 0:
    print(json.dumps({"skip": f"mlockall failed (errno {ctypes.get_errno()})"}))
    sys.exit()
loaded = aotstack.load(sys.argv[1])
with torch.no_grad():
    print(json.dumps({"answers": [answer.tolist() for answer in loaded_answers(loaded)]}))
"""


def can_lock_memory() -> bool:
    """Whether this process may lock all it maps: as root, or with no limit on locked memory."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY


@pytest.mark.skipif(not hasattr(os, "geteuid") or not hasattr(mmap, "MADV_DONTNEED"), reason="needs POSIX madvise")
@pytest.mark.parametrize("engine", ["onnxruntime", "openvino", "xnnpack"])
def test_a_process_that_locked_its_memory_keeps_the_pages_and_gets_right_answers(packages, engine):
    if not can_lock_memory():
        pytest.skip("locking a process's memory needs root or an unlimited RLIMIT_MEMLOCK here")
    path, expected = packages(engine)
    result = run_child(LOCKED_RUN, str(path))
    if "skip" in result:
        pytest.skip(result["skip"])
    assert_close([torch.tensor(answer) for answer in result["answers"]], expected, quantized=False)


@needs_pagemap
def test_aotinductor_keeps_the_weights_it_reads_in_place_and_drops_its_library(tmp_path):
    model = Wide().eval()
    path = tmp_path / "aoti.pt2"
    aotstack.lower(aotstack.export(model, {"forward": (INPUTS[0],)}), [aotstack.AotiCpuPartitioner()]).save(path)
    loaded = aotstack.load(path)

    weights, weight_pages = blob_pages(loaded, path, "aoti_cpu", "weight:")
    library, library_pages = blob_pages(loaded, path, "aoti_cpu", "model.so")
    assert weight_pages >= 100 and weights == weight_pages
    assert library_pages > 0 and library == 0
    assert_close(loaded_answers(loaded), eager_answers(model), quantized=False)


class Lookup(torch.nn.Module):
    """An embedding table of 1 MB (256 pages), a call reading a few of its rows, and a linear read whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(4096, 64)
        self.project = torch.nn.Linear(64, 1024, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.project(self.embed(ids))


@needs_pagemap
def test_aotinductor_lets_an_embedding_table_go_after_the_first_call_and_reads_rows_back(tmp_path):
    model = Lookup().eval()
    path = tmp_path / "lookup.pt2"
    lowered = aotstack.lower(aotstack.export(model, {"forward": (torch.tensor([[7]]),)}),
                             [aotstack.AotiCpuPartitioner()])
    lowered.save(path)
    (delegate,) = lowered.delegates("forward")
    assert json.loads(bytes(delegate.processed_bytes))["gathered"] == ["embed.weight"]
    loaded = aotstack.load(path)
    assert blob_pages(loaded, path, "aoti_cpu", "weight:embed")[0] >= 250, "verified, not yet let go"

    first = loaded.forward(torch.tensor([[7]]))

    table, table_pages = blob_pages(loaded, path, "aoti_cpu", "weight:embed")
    weights, weight_pages = blob_pages(loaded, path, "aoti_cpu", "weight:project")
    assert table_pages >= 250 and table <= 64, (table, table_pages)  # a row's page and the kernel's fault-around
    assert weight_pages >= 60 and weights == weight_pages
    with torch.no_grad():
        torch.testing.assert_close(first, model(torch.tensor([[7]])))
        for token in (4095, 0, 1234):  # rows whose pages were let go, read back from the file
            torch.testing.assert_close(loaded.forward(torch.tensor([[token]])), model(torch.tensor([[token]])))


# A backend of the user's own, with no compiler: its delegate adds a 64 KB table it stores as named data.
TABLE = torch.arange(16384, dtype=torch.float32)


class TableBackend(Backend):
    """Reads its table where the file holds it, at every call, and (the default) names nothing released."""

    backend_id = "test_released_table"

    def preprocess(self, exported_program, compile_specs):
        return PreprocessResult(b"", {"table": TABLE.numpy().tobytes()})

    def init(self, processed_bytes, named_data, compile_specs):
        return torch.frombuffer(named_data["table"], dtype=torch.float32)

    def execute(self, handle, inputs):
        return [inputs[0] + handle]


class ForgetfulTableBackend(TableBackend):
    """Names its table released after init, yet reads it in place at every call: a wrong answer to the hook."""

    backend_id = "test_released_table_forgetful"

    def released_named_data(self, handle, named_data, called):
        return named_data


class AddPartitioner(Partitioner):
    def __init__(self, backend_id: str) -> None:
        self.backend_id = backend_id

    def partition(self, exported_program):
        tags = {}
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            if node.target == torch.ops.aten.add.Tensor:
                node.meta["delegation_tag"] = "add"
                tags["add"] = DelegationSpec(self.backend_id, [])
        return PartitionResult(exported_program, tags)


class Adds(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1) * 2


@needs_pagemap
@pytest.mark.parametrize("backend", [TableBackend, ForgetfulTableBackend])
def test_a_page_dropped_too_eagerly_is_read_back_from_the_file(tmp_path, backend):
    path = tmp_path / "table.pt2"
    x = torch.randn(16384)
    aotstack.lower(aotstack.export(Adds(), {"forward": (x,)}), [AddPartitioner(backend.backend_id)]).save(path)
    loaded = aotstack.load(path)
    mapped, pages = blob_pages(loaded, path, backend.backend_id)
    released = backend is ForgetfulTableBackend

    assert pages >= 15 and mapped == (0 if released else pages)
    # Read again, the table is back, the same bytes, from the page cache (dropped again after the
    # first call, as the forgetful backend asks, and back at the second).
    for _ in range(2):
        torch.testing.assert_close(loaded.forward(x), (x + TABLE) * 2)
    assert blob_pages(loaded, path, backend.backend_id)[0] == pages


def test_page_ranges_are_whole_pages_of_what_is_dropped_that_hold_nothing_kept():
    def expected(dropped, kept, page, size):
        pages = {p for start, end in dropped if end > start for p in range(start // page, -(-end // page))}
        pages -= {p for start, end in kept if end > start for p in range(start // page, -(-end // page))}
        ranges: list[tuple[int, int]] = []
        for p in sorted(p for p in pages if p * page < size):
            if ranges and ranges[-1][1] == p * page:
                ranges[-1] = (ranges[-1][0], min((p + 1) * page, size))
            else:
                ranges.append((p * page, min((p + 1) * page, size)))
        return ranges

    generator = random.Random(0)

    def span(size: int) -> tuple[int, int]:
        start = generator.randint(0, size)
        return start, min(size, start + generator.randint(0, 40))

    for _ in range(3000):
        size = generator.randint(1, 200)
        dropped = [(0, size)] if generator.random() < 0.3 else [span(size) for _ in range(generator.randint(0, 5))]
        kept = [span(size) for _ in range(generator.randint(0, 8))]
        assert page_ranges(dropped, kept, 8, size) == expected(dropped, kept, 8, size), (dropped, kept, size)
