"""A session engine's ``threads`` compile spec: the threads its session runs on, whatever torch's count is."""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.errors import CompileSpecError
from aotstack.format.specs import CompileSpec, SpecKey
from tests.conftest import run_child

pytest.importorskip("onnxruntime")


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def lowered_by(partitioner_class: type, threads: bytes | None) -> aotstack.LoweredProgram:
    torch.manual_seed(0)
    exported = torch.export.export(Small().eval(), (torch.randn(2, 16),))
    specs = [] if threads is None else [CompileSpec(SpecKey.THREADS, threads)]
    return aotstack.lower(aotstack.Program({"forward": exported}), [partitioner_class(compile_specs=specs)])


def opened(lowered: aotstack.LoweredProgram, runtime: object) -> object:
    (delegate,) = lowered.delegates("forward")
    files = runtime.delegate_files(delegate.processed_bytes, delegate.named_data, delegate.compile_specs)
    return runtime.open(files)


def ort_threads(handle: object) -> int:
    return handle.session.get_session_options().intra_op_num_threads


def openvino_threads(handle: object) -> int:
    return int(handle.compiled.get_property("INFERENCE_NUM_THREADS"))


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_a_session_runs_on_the_threads_its_spec_names(engine, monkeypatch):
    if engine == "onnxruntime":
        from aotstack.backends.ort.run import OrtRuntime as runtime_class
        partitioner, threads_of = aotstack.OrtPartitioner, ort_threads
    else:
        pytest.importorskip("openvino")
        from aotstack.backends.openvino.run import OpenVinoRuntime as runtime_class
        partitioner, threads_of = aotstack.OpenVinoPartitioner, openvino_threads
    outer = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert threads_of(opened(lowered_by(partitioner, b"1"), runtime_class())) == 1
        assert threads_of(opened(lowered_by(partitioner, None), runtime_class())) == 2
    finally:
        torch.set_num_threads(outer)


XNNPACK_POOL = """
import json, sys, torch
import aotstack
from aotstack.backends.xnnpack.run import runtime_module

torch.set_num_threads(2)
loaded = aotstack.load(sys.argv[1])
x = torch.randn(2, 16)
loaded.forward(x)
print(json.dumps({"pool": runtime_module()._threadpool_get_thread_count()}))
"""


@pytest.mark.skipif(executorch_problem() is not None, reason=f"executorch: {executorch_problem()}")
def test_xnnpacks_pool_takes_the_threads_its_spec_names(tmp_path):
    counts = {}
    for threads in (b"1", None):
        path = tmp_path / f"xnnpack-{threads}.pt2"
        lowered_by(aotstack.XnnpackPartitioner, threads).save(path)
        counts[threads] = run_child(XNNPACK_POOL, str(path))["pool"]
    assert counts == {b"1": 1, None: 2}


@pytest.mark.parametrize("partitioner_name", ["OrtPartitioner", "OpenVinoPartitioner", "XnnpackPartitioner"])
def test_a_threads_spec_that_is_no_count_is_refused_when_lowering_even_with_the_part_compiled(
    partitioner_name, monkeypatch, tmp_path
):
    """The compile cache's key leaves the spec out (only the run side reads it), so the part compiled with another
    thread count is in the cache: the spec is refused all the same."""
    if partitioner_name == "OpenVinoPartitioner":
        pytest.importorskip("openvino")
    if partitioner_name == "XnnpackPartitioner" and executorch_problem() is not None:
        pytest.skip(f"executorch: {executorch_problem()}")
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    partitioner = getattr(aotstack, partitioner_name)
    lowered_by(partitioner, b"1")
    with pytest.raises((CompileSpecError, aotstack.LoweringError), match="threads"):
        lowered_by(partitioner, b"two")
