"""Weights are mapped from the file at load, not copied, and saving streams them, not copies them."""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import aotstack
from aotstack.backends.aoti.run import AotiHandle
from aotstack.backends.ort.run import OrtHandle
from aotstack.format.archive import read_manifest
from aotstack.format.tensor_data import tensor_buffer, tensor_bytes, weights_as_named_data
from tests import models
from tests.conftest import assert_matches_eager, run_child

Region = tuple[int, int]


def mapped_regions(path: Path) -> list[Region]:
    """The address ranges at which this process maps ``path`` (from /proc/self/maps)."""
    target = os.path.realpath(path)
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                regions.append((start, end))
    return regions


def inside(regions: list[Region], tensor: torch.Tensor) -> bool:
    """Whether all of ``tensor``'s bytes lie in one of ``regions``."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(low <= start and end <= high for low, high in regions)


def method_weights(loaded: aotstack.LoadedProgram, method: str = "forward") -> list[torch.Tensor]:
    """The weight tensors ``method``'s plan reads directly (its weight slots)."""
    return [value for value in loaded.method(method).body.template if isinstance(value, torch.Tensor)]


def handles(loaded: aotstack.LoadedProgram, kind: type) -> list[Any]:
    """The run-side handles of ``loaded.forward``'s delegates, found in its step closures."""
    found: list[Any] = []
    for action in loaded.method("forward").body.actions:
        for cell in action.__closure__ or ():
            if isinstance(cell.cell_contents, kind) and cell.cell_contents not in found:
                found.append(cell.cell_contents)
    return found


needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")


@pytest.fixture(scope="module")
def undelegated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``linear`` lowered with no partitioner: its weights stay the method's own. Compiles nothing."""
    path = tmp_path_factory.mktemp("mapped") / "undelegated.pt2"
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    aotstack.lower(program, []).save(path)
    return path


@needs_proc_maps
def test_method_weights_are_views_of_the_mapped_file(undelegated: Path) -> None:
    loaded = aotstack.load(undelegated)
    regions = mapped_regions(undelegated)
    weights = method_weights(loaded)

    assert regions, "the package is not mapped"
    assert len(weights) == 2 and all(inside(regions, weight) for weight in weights)
    # The check itself can fail: a copy lies elsewhere.
    assert not any(inside(regions, weight.clone()) for weight in weights)
    assert_matches_eager([loaded.forward(*models.example_inputs("linear"))], "linear")


@needs_proc_maps
def test_aoti_constants_are_views_of_the_mapped_file(lowered_package) -> None:
    _, path = lowered_package("linear")
    loaded = aotstack.load(path)
    regions = mapped_regions(path)
    [handle] = handles(loaded, AotiHandle)
    # What the runner itself reads, not only what aotstack handed it: user-managed constants.
    in_runner = handle.runner.extract_constants_map(False)

    # Inductor folds the bias (8 numbers) into the code; the weight is bound.
    assert handle.constants and all(inside(regions, tensor) for tensor in handle.constants.values())
    assert in_runner.keys() == {"linear.weight"} and all(inside(regions, tensor) for tensor in in_runner.values())
    assert not any(inside(regions, tensor.clone()) for tensor in in_runner.values())


@needs_proc_maps
def test_onnxruntime_initializers_are_views_of_the_mapped_file(lowered_with) -> None:
    pytest.importorskip("onnxruntime")
    _, path = lowered_with("linear", "ort", lambda: [aotstack.OrtPartitioner()])
    loaded = aotstack.load(path)
    regions = mapped_regions(path)
    [handle] = handles(loaded, OrtHandle)
    weights, values = handle.keep_alive

    assert len(values) == 2
    for value in values:
        start, size = value.data_ptr(), value.tensor_size_in_bytes()
        assert any(low <= start and start + size <= high for low, high in regions)
    assert_matches_eager([loaded.forward(*models.example_inputs("linear"))], "linear")


@needs_proc_maps
def test_a_buffer_the_program_updates_is_the_one_writable_copy(tmp_path: Path) -> None:
    path = tmp_path / "buffer.pt2"
    program = aotstack.export(models.build("buffer"), {"forward": models.example_inputs("buffer")})
    aotstack.lower(program, []).save(path)
    loaded = aotstack.load(path)
    regions = mapped_regions(path)
    [(fqn, state)] = loaded._state.mutable.items()
    current = state.current
    copied = [weight for weight in method_weights(loaded) if not inside(regions, weight)]

    # The updated buffer is a copy (it is written to); the buffer only read is the file's.
    assert fqn == "running" and len(method_weights(loaded)) == 2
    assert [weight.data_ptr() for weight in copied] == [torch.frombuffer(current, dtype=torch.uint8).data_ptr()]


WEIGHTS_OUTLIVE_THE_LOADER = """
import gc, json, sys
import torch
import aotstack
from tests import models

def loaded_program(path):
    # Nothing of the load is kept but what load returns.
    loaded = aotstack.load(path)
    return loaded

path, name = sys.argv[1:3]
loaded = loaded_program(path)
gc.collect()
# Memory freed by the load, if the weights pointed into it, is written over here.
junk = [torch.full((1 << 16,), 7.0) for _ in range(64)]
x = models.example_inputs(name)[0]
got = loaded.forward(x)
with torch.no_grad():
    want = models.build(name)(x)
print(json.dumps(torch.allclose(got, want, rtol=1e-5, atol=1e-5)))
"""


def test_weights_stay_valid_after_the_loader_returns(undelegated: Path, lowered_package) -> None:
    _, delegated = lowered_package("linear")
    for path in (undelegated, delegated):
        assert run_child(WEIGHTS_OUTLIVE_THE_LOADER, str(path), "linear") is True


def test_weights_stay_valid_in_this_process_after_gc(lowered_package) -> None:
    _, path = lowered_package("linear")

    def load_and_forget() -> aotstack.LoadedProgram:
        return aotstack.load(path)

    loaded = load_and_forget()
    gc.collect()
    assert_matches_eager([loaded.forward(*models.example_inputs("linear"))], "linear")


# Saving -----------------------------------------------------------------------------------------


def test_tensor_buffer_views_a_contiguous_host_tensor_and_copies_otherwise() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = tensor_buffer(tensor)
    transposed = tensor_buffer(tensor.t())

    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert address == tensor.data_ptr() and view.readonly
    assert torch.frombuffer(transposed, dtype=torch.uint8).data_ptr() != tensor.data_ptr()
    assert bytes(transposed) == tensor.t().contiguous().numpy().tobytes() == tensor_bytes(tensor.t())

    named_data, meta = weights_as_named_data({"w": tensor})
    assert torch.frombuffer(named_data["weight:w"], dtype=torch.uint8).data_ptr() == tensor.data_ptr()
    assert meta == {"w": {"dtype": "float32", "shape": [3, 4]}}


class WideModel(torch.nn.Module):
    """About 96 MB of float32 weights, in three layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4096, 2048, bias=False) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def reset_resident_peak() -> bool:
    """Set VmHWM to the current RSS, so that it reads the peak from now on; False where Linux lacks it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_saving_holds_no_second_copy_of_the_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = WideModel().eval()
    x = torch.randn(2, 4096)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 90 << 20
    path = tmp_path / "wide.pt2"

    gc.collect()
    before = status_bytes("VmRSS") if reset_resident_peak() else None
    tracemalloc.start()
    try:
        lowered.save(path)
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    resident_peak = status_bytes("VmHWM") - before if before is not None else None

    # A copy of every weight (``bytes`` made to be written) is 1x the weights; a streamed save is
    # a few MB of bookkeeping. Python's own allocations, and the whole process's resident memory.
    assert traced_peak < weights // 2, f"save allocated {traced_peak >> 20} MB for {weights >> 20} MB of weights"
    if resident_peak is not None:
        assert resident_peak < weights // 2, f"save grew by {resident_peak >> 20} MB for {weights >> 20} MB"
    assert read_manifest(path).blobs and path.stat().st_size > weights
    torch.testing.assert_close(aotstack.load(path).forward(x), model(x))


class StridedModel(torch.nn.Module):
    """A transposed parameter, which saving must copy, and a buffer viewing part of a tensor, which it need not."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 6).t())
        self.register_buffer("offset", torch.randn(16)[8:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.offset


def test_weights_that_must_be_copied_are_saved_laid_out_contiguously(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = StridedModel().eval()
    x = torch.randn(3, 6)
    assert not model.weight.is_contiguous()
    path = tmp_path / "strided.pt2"
    aotstack.lower(aotstack.export(model, {"forward": (x,)}), []).save(path)

    torch.testing.assert_close(aotstack.load(path).forward(x), model(x))


def test_lowering_shares_the_programs_weights_instead_of_copying_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    program = aotstack.export(model, {"forward": (torch.randn(2, 64),)})
    lowered = aotstack.lower(program, [], jobs=1, progress=False)
    before = {fqn: t.data_ptr() for fqn, t in program.methods["forward"].state_dict.items()}
    after = {fqn: t.data_ptr() for fqn, t in lowered.methods["forward"].state_dict.items()}
    assert after == before and len(after) == 4
