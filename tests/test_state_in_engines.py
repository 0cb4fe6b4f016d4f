"""State lives with the engine that updates it: ONNX Runtime and OpenVINO update a KV cache in place.

A delegate that owns a buffer takes it as its engine's input and writes its new value as an
output over the same memory, so a decode step copies no cache across a delegate boundary: the
method's plan neither feeds the cache in nor copies it back. Where the engine's update is not a
scatter into the old value alone, the run side copies the new value back instead; both ways give
eager's numbers.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import time
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.engine.registry import BUILT_IN
from aotstack.format.archive import read_manifest
from tests.conftest import run_child
from tests.test_language_models import CACHE, GENERATE_FROM_FILE, PROMPT, STEPS, small_llama, token_by_token

ENGINES = {
    "onnxruntime": lambda: aotstack.OrtPartitioner(),
    "openvino": lambda: aotstack.OpenVinoPartitioner(),
}
CACHES = {f"{kind}_cache_{layer}" for kind in ("key", "value") for layer in range(2)}


def installed(engine: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not BUILT_IN[engine].installed(), reason=f"{engine} is not installed")


def state_records(delegate: aotstack.Delegate) -> dict[str, dict]:
    return json.loads(delegate.processed_bytes).get("state", {})


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def decoder_file(request, tmp_path_factory):
    """transformers' static-cache decoder lowered with one engine first, then AOTInductor; saved."""
    engine = request.param
    if not BUILT_IN[engine].installed():
        pytest.skip(f"{engine} is not installed")
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = small_llama()
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    lowered = aotstack.lower(
        aotstack.Program({"forward": exported}), [ENGINES[engine](), aotstack.AotiCpuPartitioner()]
    )
    path = tmp_path_factory.mktemp("state") / f"{engine}.pt2"
    lowered.save(path)
    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
    expected = token_by_token(lambda ids, pos: eager(input_ids=ids, cache_position=pos), PROMPT, STEPS)
    return engine, lowered, path, expected


def test_the_engine_owns_the_kv_cache_and_updates_it_in_place(decoder_file):
    engine, lowered, path, _ = decoder_file
    [owner] = [d for d in lowered.delegates("forward") if CACHES <= set(d.updated_buffers)]
    assert owner.backend_id == engine
    records = state_records(owner)
    assert {fqn for fqn, record in records.items() if record["in_place"]} >= CACHES

    # Nothing outside the delegate reads or writes the cache: no copy back, no cache among its inputs.
    method = read_manifest(path).methods["forward"]
    assert not CACHES & {fqn for fqn, _ in method.plan.mutations}
    assert all(list(spec.shape) != [1, 2, CACHE, 8] for spec in owner.inputs)


def test_a_decode_with_the_cache_in_the_engine_generates_eager_tokens_again_after_reset(decoder_file):
    _, _, path, expected = decoder_file
    tokens = run_child(GENERATE_FROM_FILE, str(path))
    assert tokens["first"] == expected
    assert tokens["again"] == expected, "reset() puts the cache back in the memory the engine writes"


def test_the_cache_lives_where_the_engine_updates_it(decoder_file):
    """ONNX Runtime writes the program's one state in place; OpenVINO keeps the cache as its own state variables."""
    engine, _, path, _ = decoder_file
    loaded = aotstack.load(path)
    state = {fqn: loaded._state.mutable[fqn].current for fqn in CACHES}
    addresses = {fqn: torch.frombuffer(memory, dtype=torch.uint8).data_ptr() for fqn, memory in state.items()}
    loaded.forward(torch.tensor([[3]]), torch.tensor([0]))
    written = {fqn: torch.frombuffer(memory, dtype=torch.float32).abs().sum().item() for fqn, memory in state.items()}
    if engine == "openvino":
        # Nothing else in the file reads the cache, so it never leaves the infer request: the
        # compiled model neither takes nor returns it, and the program's memory for it stays as loaded.
        [(reader, keeper)] = loaded._state.handover.keepers.items()
        assert loaded.kept_state == {"forward": dict.fromkeys(CACHES, reader)}
        assert {buffer.fqn for buffer in keeper.handle.kept.values()} == CACHES
        cache = [1, 2, CACHE, 8]
        ports = [*keeper.handle.compiled.inputs, *keeper.handle.compiled.outputs]
        assert all(list(port.get_partial_shape().to_shape()) != cache for port in ports)
        loaded.forward(torch.tensor([[5]]), torch.tensor([1]))
        variables = keeper.handle.idle[0].request.query_state()
        assert all(torch.from_numpy(v.state.data.copy()).abs().sum() > 0 for v in variables)
        assert not any(torch.frombuffer(memory, dtype=torch.float32).any() for memory in state.values())
        return
    assert not loaded._state.handover.keepers and loaded.kept_state == {}
    assert all(total > 0 for total in written.values()), "the engine wrote the first position into the state"
    loaded.reset()
    assert not any(torch.frombuffer(memory, dtype=torch.uint8).any() for memory in state.values())
    assert addresses == {fqn: torch.frombuffer(m, dtype=torch.uint8).data_ptr() for fqn, m in state.items()}


class RunningMean(torch.nn.Module):
    """A buffer updated by arithmetic on its old value, not by a scatter: the engine cannot write it in place."""

    def __init__(self) -> None:
        super().__init__()
        # Not zeros: a state an engine keeps starts from the file's values, and reset() restores them.
        self.register_buffer("mean", torch.linspace(-1.0, 1.0, 32).reshape(4, 8))
        self.register_buffer("calls", torch.full((4, 8), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1.0)
        self.mean.mul_(0.5).add_(x * 0.5)
        return self.mean * 2 + self.calls.sum()


INPUTS = [torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


def one_delegate_file(module: type[torch.nn.Module], engine: str, path: Path) -> aotstack.Delegate:
    """``module()`` lowered with ``engine`` then AOTInductor, saved at ``path``; its one delegate."""
    if not BUILT_IN[engine].installed():
        pytest.skip(f"{engine} is not installed")
    program = aotstack.export(module(), {"forward": (INPUTS[0],)})
    lowered = aotstack.lower(program, [ENGINES[engine](), aotstack.AotiCpuPartitioner()])
    lowered.save(path)
    [delegate] = lowered.delegates("forward")
    return delegate


def assert_follows_eager(loaded: aotstack.LoadedProgram, module: type[torch.nn.Module]) -> None:
    """Six calls match a fresh ``module()``'s, and after ``reset()`` a call matches a fresh one's again."""
    eager = module()
    for x in [*INPUTS, *INPUTS]:
        torch.testing.assert_close(loaded.forward(x), eager(x))
    loaded.reset()
    torch.testing.assert_close(loaded.forward(INPUTS[1]), module()(INPUTS[1]))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_buffer_not_updated_by_a_scatter_is_copied_back_and_stays_right(engine, tmp_path):
    delegate = one_delegate_file(RunningMean, engine, tmp_path / "mean.pt2")
    assert delegate.backend_id == engine and set(delegate.updated_buffers) == {"mean", "calls"}
    assert not any(record["in_place"] for record in state_records(delegate).values())
    assert_follows_eager(aotstack.load(tmp_path / "mean.pt2"), RunningMean)


def test_the_report_says_which_delegate_keeps_each_buffer(decoder_file):
    engine, _, path, _ = decoder_file
    report = aotstack.file_report(path)
    [owner] = [d for d in report.to_json()["methods"][0]["delegates"] if d["state"]]
    assert owner["engine"] == engine and CACHES <= set(owner["state"])
    assert "state (cpu): " in report.text(width=200)


class MeanAndSteps(torch.nn.Module):
    """A floating buffer OpenVINO keeps as state, then an integer one it does not: both stay right."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.linspace(-1.0, 1.0, 32).reshape(4, 8))
        self.register_buffer("steps", torch.full((4, 8), 5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.5).add_(x * 0.5)
        self.steps.add_(1)
        return self.mean * self.steps


@pytest.mark.parametrize("engine", list(ENGINES))
def test_kept_and_bound_buffers_of_one_delegate_each_stay_right(engine, tmp_path):
    delegate = one_delegate_file(MeanAndSteps, engine, tmp_path / "mean_and_steps.pt2")
    assert (delegate.backend_id, set(delegate.updated_buffers)) == (engine, {"mean", "steps"})
    loaded = aotstack.load(tmp_path / "mean_and_steps.pt2")
    kept = {buffer.fqn for keeper in loaded._state.handover.keepers.values() for buffer in keeper.handle.kept.values()}
    assert kept == ({"mean"} if engine == "openvino" else set())
    assert_follows_eager(loaded, MeanAndSteps)


class Accumulator(torch.nn.Module):
    """Three methods over one buffer: ``add`` and ``decay`` update it, ``read`` reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.linspace(0.0, 3.0, 32).reshape(4, 8))

    def add(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total * 2

    def read(self, x: torch.Tensor) -> torch.Tensor:
        return self.total * x

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        self.total.mul_(0.5)
        return self.total - x


@pytest.mark.parametrize(
    ("engine", "dtype"),
    [("onnxruntime", torch.float32), ("openvino", torch.float32), ("openvino", torch.bfloat16)],
    ids=["onnxruntime", "openvino", "openvino-bf16"],
)
def test_a_buffer_another_method_reads_is_read_as_it_is_now(engine, dtype, tmp_path):
    if not BUILT_IN[engine].installed():
        pytest.skip(f"{engine} is not installed")
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=dtype)
    program = aotstack.export(Accumulator().to(dtype), {"add": (x,), "read": (x,), "decay": (x,)})
    lowered = aotstack.lower(program, [ENGINES[engine]()])
    [adding], [reading] = lowered.delegates("add"), lowered.delegates("read")
    assert (adding.backend_id, adding.updated_buffers) == (engine, ["total"])
    # ``read``'s delegate takes the buffer as an input, not as a constant of its own, which an
    # engine may copy at load and which would hold the value the file starts from.
    assert "weight:total" not in reading.named_data and len(reading.inputs) == 2
    path = tmp_path / "accumulator.pt2"
    lowered.save(path)

    loaded, eager = aotstack.load(path), Accumulator().to(dtype)
    # OpenVINO keeps the buffer in ``add`` and in ``decay``; loading hands its value between
    # them, and to ``read``, through the buffer's memory whenever the method called changes.
    keepers = ["add/add.0", "decay/decay.0"] if engine == "openvino" else []
    assert sorted(loaded._state.handover.keepers) == keepers
    # Eager rounds the bf16 total after each op; OpenVINO on a CPU without bf16 arithmetic computes
    # in fp32 and rounds once, a few units in the last place apart. A stale total is off by whole units.
    close = {"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {}
    for step in range(3):
        y = torch.randn(4, 8, dtype=dtype)
        torch.testing.assert_close(loaded.add(y), eager.add(y), **close)
        torch.testing.assert_close(loaded.add(y), eager.add(y), **close)
        torch.testing.assert_close(loaded.read(x), eager.read(x), **close, msg=lambda m, s=step: f"step {s}: {m}")
        torch.testing.assert_close(loaded.decay(x), eager.decay(x), **close, msg=lambda m, s=step: f"step {s}: {m}")
    loaded.reset()
    torch.testing.assert_close(loaded.read(x), Accumulator().to(dtype).read(x), **close)


@installed("openvino")
def test_prefill_and_decode_each_keep_the_cache_in_openvino_and_hand_it_over(tmp_path):
    from aotstack.integrations.generation import PrefillDecode
    from tests.test_language_models import decoder_lm_example

    example = decoder_lm_example()
    program = example.export_decoder_lm(example.small_llama(), CACHE)
    lowered = aotstack.lower(program, [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()])
    path = tmp_path / "prefill_decode.pt2"
    lowered.save(path)

    loaded = aotstack.load(path)
    keepers = loaded._state.handover.keepers
    kept = {reader.split("/")[0]: {b.fqn for b in keeper.handle.kept.values()} for reader, keeper in keepers.items()}
    caches = {f"lm.{fqn}" for fqn in CACHES}
    assert kept == {"prefill": caches, "decode": caches}
    eager = PrefillDecode(example.small_llama(), CACHE)
    for prompt in ([5, 17, 42], [9, 1, 4, 4, 30, 2, 8]):
        loaded.reset()
        assert example.greedy_decoder(loaded, prompt, 12) == example.greedy_decoder(eager, prompt, 12)


class LargeCache(torch.nn.Module):
    """A 16 MiB cache written at a position each call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.ones(64, 256, 256))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, position, x)
        return self.cache.mean(0)


def resident_bytes(address: int, size: int) -> int:
    """How many of the ``size`` bytes from ``address`` are in memory, page by page (``mincore``): the buffer's own
    pages, not its whole mapping, which the kernel merges with neighbouring allocations."""
    page = mmap.PAGESIZE
    start = address - address % page
    pages = (address + size - start + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(entry & 1 for entry in vector) * page


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_cache_an_engine_keeps_is_held_once(engine, tmp_path):
    if not BUILT_IN[engine].installed():
        pytest.skip(f"{engine} is not installed")
    model = LargeCache()
    x, position = torch.randn(1, 256, 256), torch.tensor([3])
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x, position)}), [ENGINES[engine]()])
    path = tmp_path / "large_cache.pt2"
    lowered.save(path)

    loaded = aotstack.load(path)
    address = torch.frombuffer(loaded._state.mutable["cache"].current, dtype=torch.uint8).data_ptr()
    size = 64 * 256 * 256 * 4
    assert resident_bytes(address, size) >= size
    for step in range(2):
        torch.testing.assert_close(loaded.forward(x + step, position + step), model(x + step, position + step))
    # OpenVINO holds the cache in its infer request: the program's copy leaves memory.
    assert (resident_bytes(address, size) < size // 16) == (engine == "openvino")
    loaded.reset()
    torch.testing.assert_close(loaded.forward(x, position), LargeCache()(x, position))


@installed("openvino")
def test_an_engine_keeping_a_buffer_it_was_not_offered_is_refused_at_load(tmp_path, monkeypatch):
    from aotstack.backends.openvino.run import OpenVinoRuntime

    x = torch.randn(4, 8)
    program = aotstack.export(Accumulator(), {"add": (x,), "read": (x,), "decay": (x,)})
    path = tmp_path / "accumulator.pt2"
    aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).save(path)
    # ``read`` updates nothing: its delegate is offered no buffer to keep.
    monkeypatch.setattr(OpenVinoRuntime, "kept_state", lambda self, handle: frozenset({"total"}))
    refused = r"delegate read\.0 \(openvino\) says it keeps buffers \['total'\] it was not offered"
    with pytest.raises(aotstack.DelegateInitError, match=refused):
        aotstack.load(path)


@installed("openvino")
def test_a_model_openvino_cannot_make_stateful_loads_with_its_buffers_bound(tmp_path, monkeypatch, caplog):
    from aotstack.backends.openvino import run as ov_run

    path = tmp_path / "mean_and_steps.pt2"
    one_delegate_file(MeanAndSteps, "openvino", path)

    def refused(model, kept, label):
        raise aotstack.DelegateInitError(f"{label}: OpenVINO could not keep its buffers as state: injected")

    monkeypatch.setattr(ov_run, "made_stateful", refused)
    with caplog.at_level("WARNING", logger="aotstack"):
        loaded = aotstack.load(path)
    assert "its buffers stay bound in place, not kept in OpenVINO" in caplog.text
    assert not loaded._state.handover.keepers
    assert_follows_eager(loaded, MeanAndSteps)


@installed("openvino")
def test_auto_times_a_kept_state_plan_the_way_a_decode_loop_runs_it(tmp_path, monkeypatch):
    """After a reset, an engine keeping the state loads it again at its next call: a decode pays that once per
    generation, so the timing auto compares plans by leaves it out."""
    from aotstack.backends.openvino.run import OpenVinoRuntime
    from aotstack.compile.measure import measured_methods

    program = aotstack.export(RunningMean(), {"forward": (INPUTS[0],)})
    lowered = aotstack.lower(program, [aotstack.OpenVinoPartitioner()])
    loading = OpenVinoRuntime.load_state

    def slow_load(self, handle, buffers):
        time.sleep(0.25)
        loading(self, handle, buffers)

    monkeypatch.setattr(OpenVinoRuntime, "load_state", slow_load)
    timing = measured_methods(lowered.methods, lowered.delegate_table, {"forward": ((INPUTS[0],), {})})["forward"]
    assert timing.seconds < 0.1, "a reset's state load was timed as part of each call"
