"""OpenVINO as an engine: real conversions and compiles, compared with eager PyTorch, loaded in a fresh process.

Stacked in every order with ONNX Runtime and AOTInductor; a dynamic batch; bfloat16; float32
kept float32 on a CPU that would otherwise compute in bfloat16; a decoder with a static KV cache;
the partitioner's reasons; weights stored once; and the errors of each side.
"""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import torch

import aotstack
from aotstack.backends.openvino import run as ov_run
from aotstack.backends.openvino.partitioner import OpenVinoPartitioner
from aotstack.compile.measure import MANY_CORES, ONE_CORE
from aotstack.format.archive import read_manifest
from aotstack.format.specs import CompileSpec, SpecKey
from aotstack.format.tensor_data import WEIGHT_PREFIX, content_key, tensor_bytes
from tests import models
from tests.conftest import assert_matches_eager, run_child, run_in_fresh_process
from tests.test_language_models import CACHE, GENERATE_FROM_FILE, PROMPT, STEPS, small_llama, token_by_token
from tests.test_stacked_end_to_end import plain_ops

# Lowerings of the "stacked" model (linear, gelu, layer_norm, linear, tanh, mul, slice, add), by name:
# the partitioners in order, and the engines that must end up with a delegate.
ORDERS = {
    "ov": (lambda: [aotstack.OpenVinoPartitioner()], {"openvino"}),
    "ov-then-aoti": (
        # min_block_size=1: the layer_norm alone between OpenVINO's parts is claimed too, so no op runs as plain ATen.
        lambda: [
            aotstack.OpenVinoPartitioner(ops=["aten.linear", "aten.gelu"]),
            aotstack.AotiCpuPartitioner(min_block_size=1),
        ],
        {"openvino", "aoti_cpu"},
    ),
    "aoti-then-ov": (
        lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear"]), aotstack.OpenVinoPartitioner()],
        {"openvino", "aoti_cpu"},
    ),
    "ort-ov-aoti": (
        lambda: [
            aotstack.OrtPartitioner(ops=["aten.linear"]),
            aotstack.OpenVinoPartitioner(ops=["aten.gelu", "aten.layer_norm"]),
            aotstack.AotiCpuPartitioner(),
        ],
        {"onnxruntime", "openvino", "aoti_cpu"},
    ),
    "ov-ort": (
        lambda: [aotstack.OpenVinoPartitioner(ops=["aten.linear"]), aotstack.OrtPartitioner()],
        {"openvino", "onnxruntime"},
    ),
    "aoti-ov-ort": (
        lambda: [
            aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear", "aten.layer_norm"]),
            aotstack.OpenVinoPartitioner(ops=["aten.layer_norm"]),
            aotstack.OrtPartitioner(),
        ],
        {"aoti_cpu", "openvino", "onnxruntime"},
    ),
}


def lowered_stacked(lowered_with, order: str):
    make, _ = ORDERS[order]
    return lowered_with("stacked", f"openvino-{order}", make)


def handle_of(loaded: aotstack.LoadedProgram, method: str = "forward") -> list[ov_run.OpenVinoHandle]:
    """The OpenVINO handles a loaded method's steps hold."""
    found = []
    for step in loaded.method(method).body.actions:
        for cell in step.__closure__ or ():
            if isinstance(cell.cell_contents, ov_run.OpenVinoHandle):
                found.append(cell.cell_contents)
    return found


@pytest.mark.parametrize("order", list(ORDERS))
def test_openvino_stacked_in_any_order_matches_eager_from_a_fresh_process(lowered_with, order):
    lowered, path = lowered_stacked(lowered_with, order)

    delegates = lowered.delegates("forward")
    assert {d.backend_id for d in delegates} == ORDERS[order][1]
    assert plain_ops(lowered) == [], "every op is claimed by one engine or another"
    assert_matches_eager(run_in_fresh_process(path, "forward", "stacked"), "stacked")


def test_openvino_takes_what_the_earlier_engine_left(lowered_with):
    lowered, _ = lowered_stacked(lowered_with, "aoti-then-ov")
    by_backend = {}
    for delegate in lowered.delegates("forward"):
        by_backend.setdefault(delegate.backend_id, set()).update(delegate.ops)
    assert by_backend["openvino"] == {"aten.linear.default"}
    assert "aten.linear.default" not in by_backend["aoti_cpu"]


def test_a_dynamic_batch_runs_at_every_size_in_its_range(tmp_path):
    model = models.build("stacked")
    batch = torch.export.Dim("batch", min=1, max=64)
    program = aotstack.export(
        model, {"forward": models.example_inputs("stacked")}, dynamic_shapes={"forward": ({0: batch},)}
    )
    aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).save(tmp_path / "dynamic.pt2")

    loaded = aotstack.load(tmp_path / "dynamic.pt2")
    [handle] = handle_of(loaded)
    assert handle.outputs[0].shape is None, "the output's batch stays dynamic in the compiled model"
    for size in (1, 5, 33, 64, 2):
        x = torch.randn(size, 16)
        torch.testing.assert_close(loaded.forward(x), model(x).detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(aotstack.InputError, match="outside the range"):
        loaded.forward(torch.randn(65, 16))


class Patched(torch.nn.Module):
    """A series cut into patches along a dimension counted from the back, as PatchTSMixer cuts its windows."""

    def forward(self, series: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return series.unfold(-2, 8, 4) * 2, image.unfold(-1, 4, 4).sum(-1)


def test_openvino_cuts_patches_along_a_dimension_counted_from_the_back(tmp_path):
    # OpenVINO 2026.4's own translation of unfold(-2, ...) failed to convert ("Input order must have shape [n]").
    model = Patched()
    batch = torch.export.Dim("batch", min=1, max=16)
    program = aotstack.export(model, {"forward": (torch.randn(2, 32, 3), torch.randn(2, 3, 6, 16))},
                              dynamic_shapes={"forward": ({0: batch}, {0: batch})})
    lowered = aotstack.lower(program, [aotstack.OpenVinoPartitioner()], jobs=1)
    assert plain_ops(lowered) == [] and all(d.backend_id == "openvino" for d in lowered.delegates("forward"))
    lowered.save(tmp_path / "patches.pt2")
    loaded = aotstack.load(tmp_path / "patches.pt2")
    for size in (1, 5):
        inputs = (torch.randn(size, 32, 3), torch.randn(size, 3, 6, 16))
        for got, want in zip(loaded.forward(*inputs), model(*inputs), strict=True):
            torch.testing.assert_close(got, want)


def test_dynamic_outputs_of_successive_calls_do_not_share_memory(tmp_path):
    model = models.build("stacked")
    program = aotstack.export(
        model, {"forward": models.example_inputs("stacked")},
        dynamic_shapes={"forward": ({0: torch.export.Dim("batch", min=1, max=64)},)},
    )
    aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).save(tmp_path / "dynamic.pt2")
    loaded = aotstack.load(tmp_path / "dynamic.pt2")

    inputs = [torch.randn(3, 16), torch.randn(3, 16), torch.randn(7, 16)]
    outputs = [loaded.forward(x) for x in inputs]
    for x, y in zip(inputs, outputs, strict=True):
        torch.testing.assert_close(y, model(x).detach(), rtol=1e-5, atol=1e-5)


def test_bfloat16_runs_in_openvino_in_bfloat16_even_with_onnx_runtime_first(tmp_path):
    model = models.build("stacked").to(torch.bfloat16)
    x = models.example_inputs("stacked")[0].to(torch.bfloat16)
    program = aotstack.export(model, {"forward": (x,)})
    lowered = aotstack.lower(
        program, [aotstack.OrtPartitioner(), aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()]
    )
    assert {d.backend_id for d in lowered.delegates("forward")} == {"openvino"}
    assert json.loads(lowered.delegates("forward")[0].processed_bytes)["precision"] == "bf16"
    lowered.save(tmp_path / "bf16.pt2")

    loaded = aotstack.load(tmp_path / "bf16.pt2")
    for seed in (1, 2):
        x = models.example_inputs("stacked", seed)[0].to(torch.bfloat16)
        got = loaded.forward(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, model(x).detach(), rtol=1.6e-2, atol=2e-2)


class WideLinear(torch.nn.Module):
    """Long dot products: computed in bfloat16 they are visibly off float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(512, 512)
        self.second = torch.nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_float32_stays_float32_where_openvino_would_pick_bfloat16(tmp_path):
    model = WideLinear().eval()
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.OpenVinoPartitioner()])
    [delegate] = lowered.delegates("forward")
    lowered.save(tmp_path / "wide.pt2")
    expected = model(x).detach()

    loaded = aotstack.load(tmp_path / "wide.pt2")
    [handle] = handle_of(loaded)
    assert str(handle.compiled.get_property("INFERENCE_PRECISION_HINT")) in ("<Type: 'float32'>", "f32")
    torch.testing.assert_close(loaded.forward(x), expected, rtol=1e-5, atol=1e-5)

    # The same part asked to compute in bfloat16 misses that tolerance: the check above can tell.
    import openvino

    if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bfloat16 kernels: OpenVINO computes a bf16 request in f32, nothing to tell apart")
    files = ov_run.OpenVinoRuntime().delegate_files(delegate.processed_bytes, delegate.named_data,
                                                    delegate.compile_specs)
    part = ov_run.read_part(files)
    in_bf16 = ov_run.compiled_model(ov_run.read_model(part, files.label), "bf16", 1, files.label)
    request = in_bf16.create_infer_request()
    request.infer({0: x.numpy()})
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.from_numpy(request.get_output_tensor(0).data.copy()), expected,
                                   rtol=1e-5, atol=1e-5)


class GatedMlp(torch.nn.Module):
    """A Llama-style MLP, ``down(act(gate(x)) * up(x))``; with ``gated=False``, a BERT-style ``down(act(up(x)))``."""

    def __init__(self, gated: bool = True, act: str = "silu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gated, self.act = gated, getattr(torch.nn.functional, act)
        self.gate = torch.nn.Linear(128, 256, bias=False)
        self.up = torch.nn.Linear(128, 256, bias=False)
        self.down = torch.nn.Linear(256, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
        return self.down(hidden)


@pytest.mark.parametrize(
    ("gated", "act", "shape", "found"),
    [
        (True, "silu", (1, 1, 128), True),
        (True, "gelu", (1, 1, 128), True),
        (False, "gelu", (1, 1, 128), False),
        # OpenVINO fuses only a gated MLP over (batch, sequence, features).
        (True, "silu", (1, 128), False),
    ],
)
def test_gated_mlps_are_told_from_plain_ones_in_the_ir(gated, act, shape, found):
    import openvino

    x = torch.randn(*shape, dtype=torch.bfloat16)
    model = openvino.convert_model(torch.export.export(GatedMlp(gated, act).to(torch.bfloat16).eval(), (x,)))
    model.reshape(list(shape))  # static shapes, as aotstack's IR has them
    assert ov_run.has_gated_mlp(model) is found


# Loads argv[1] on argv[3] threads, on argv[4] cores (all where absent), and runs it on argv[2].
ONE_THREAD_RUN = """
import json, os, sys, torch, aotstack
torch.set_num_threads(int(sys.argv[3]))
if len(sys.argv) > 4:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:int(sys.argv[4])])
x = torch.load(sys.argv[2])
print(json.dumps(aotstack.load(sys.argv[1]).forward(x).float().flatten().tolist()))
"""


@pytest.mark.parametrize("cores", [None, 1], ids=["one thread", "two threads on one core"])
def test_a_bfloat16_gated_mlp_loads_on_one_thread_on_a_cpu_with_amx(tmp_path, cores):
    # OpenVINO's CPU plugin dies of SIGFPE compiling this for one thread on such a CPU, unless loading asks for f32.
    from aotstack.engine.processor import cpu_features

    if not ov_run.FUSED_MLP_FEATURES <= cpu_features():
        pytest.skip("this CPU has no AMX: OpenVINO does not fuse gated MLPs here, so nothing can crash")
    if cores is not None and not hasattr(os, "sched_setaffinity"):
        pytest.skip("this OS sets no CPU affinity")
    model = GatedMlp().to(torch.bfloat16).eval()
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.OpenVinoPartitioner()])
    assert {d.backend_id for d in lowered.delegates("forward")} == {"openvino"}
    lowered.save(tmp_path / "mlp.pt2")
    torch.save(x, tmp_path / "x.pt")

    threads = ["1"] if cores is None else ["2", str(cores)]
    got = torch.tensor(run_child(ONE_THREAD_RUN, str(tmp_path / "mlp.pt2"), str(tmp_path / "x.pt"), *threads))
    torch.testing.assert_close(got, model(x).detach().float().flatten(), rtol=1.6e-2, atol=2e-2)


# Times an MLP lowered to ONNX Runtime, then to OpenVINO, as auto times two plans, on 2 threads; with argv[1]
# "serialized", after OpenVINO serialized a model in this process, which leaves every child forked from it running
# OpenVINO on one thread. Prints the OpenVINO timing's busy cores and the warnings.
TIMED_AFTER_SERIALIZING = """
import json, logging, os, sys, tempfile, torch, openvino, aotstack
from aotstack.compile.measure import SavedPrograms, measured_methods
torch.set_num_threads(2)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).eval()
x = torch.randn(256, 1024)
exported = torch.export.export(model, (x,))
if sys.argv[1] == "serialized":
    folder = tempfile.mkdtemp()
    openvino.serialize(openvino.convert_model(exported), os.path.join(folder, "m.xml"), os.path.join(folder, "m.bin"))
warned = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warned.append(record.getMessage())
logging.getLogger("aotstack").addHandler(handler)
cores = []
with SavedPrograms() as saved:
    for partitioner in (aotstack.OrtPartitioner(), aotstack.OpenVinoPartitioner()):
        lowered = aotstack.lower(aotstack.Program({"forward": exported}), [partitioner])
        timing = measured_methods(lowered.methods, lowered.delegate_table, {"forward": ((x,), {})}, saved)
        cores.append(timing["forward"].cores)
print(json.dumps({"reference": cores[0], "cores": cores[1], "warned": warned}))
"""


@pytest.mark.parametrize("before", ["serialized", "nothing"])
def test_a_plan_whose_forked_timing_ran_on_one_core_is_timed_on_its_threads_in_this_process(before):
    from aotstack.format.archive import usable_cores

    if usable_cores() < 2:
        pytest.skip("one core: every timing runs on one")
    pytest.importorskip("onnxruntime")
    got = run_child(TIMED_AFTER_SERIALIZING, before)
    if got["reference"] < MANY_CORES:  # the rule needs a plan that kept two busy: other work had the cores
        pytest.skip(f"ONNX Runtime's timing kept only {got['reference']:.2f} cores busy")
    assert got["cores"] > ONE_CORE, got
    retimed = [message for message in got["warned"] if "timed again in this process" in message]
    assert len(retimed) == (before == "serialized"), got["warned"]
    if retimed:
        assert "openvino" in retimed[0] and "one core" in retimed[0]


def test_a_static_cache_decoder_generates_eager_tokens_from_a_fresh_process(tmp_path):
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = small_llama()
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    lowered = aotstack.lower(
        aotstack.Program({"forward": exported}), [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()]
    )
    delegates = lowered.delegates("forward")
    assert {d.backend_id for d in delegates} == {"openvino"}
    # The cache is the delegate's own state, updated in place (tests/test_state_in_engines.py): it
    # neither takes it as an input nor returns it.
    cache = [1, 2, CACHE, 8]  # batch, key-value heads, positions, head size
    assert all({"key_cache_0", "value_cache_1"} <= set(d.updated_buffers) for d in delegates)
    assert not any(spec.shape == cache for d in delegates for spec in [*d.inputs, *d.outputs])
    path = tmp_path / "lm.pt2"
    lowered.save(path)

    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
    expected = token_by_token(lambda ids, pos: eager(input_ids=ids, cache_position=pos), PROMPT, STEPS)
    tokens = run_child(GENERATE_FROM_FILE, str(path))
    assert tokens["first"] == expected
    assert tokens["again"] == expected, "reset() puts the KV cache back to its saved state"


def test_weights_are_stored_once_across_methods_and_engines(lowered_with):
    lowered, path = lowered_with(
        "shared", "openvino-then-aoti",
        lambda: [aotstack.OpenVinoPartitioner(ops=["aten.linear"]), aotstack.AotiCpuPartitioner()],
        methods=("forward", "score"),
    )
    encoder = models.build("shared").encoder.weight
    key = content_key(tensor_bytes(encoder))
    readers = [
        d for method in ("forward", "score") for d in lowered.delegates(method)
        if key in {content_key(blob) for blob in d.named_data.values()}
    ]
    assert {d.backend_id for d in readers} == {"openvino"} and len(readers) == 2
    for delegate in readers:
        # The IR does not hold the weight: its constants file is far smaller than the weight.
        assert len(delegate.named_data[ov_run.CONSTANTS_NAME]) < encoder.numel() * 4 // 100
    manifest = read_manifest(path)
    assert key in manifest.blobs
    stored = [k for method in manifest.methods.values() for d in method.delegates
              for local, k in d.named_data.items() if local == WEIGHT_PREFIX + "encoder.weight"]
    assert len(stored) == 2 and len(set(stored)) == 1, "two delegates, one blob"
    assert_matches_eager(run_in_fresh_process(path, "score", "shared"), "shared", "score")


def refusals(model: torch.nn.Module, x: torch.Tensor, partitioner: OpenVinoPartitioner) -> list[tuple[str, str]]:
    """What ``partitioner`` says of each node of ``model`` it leaves: (op name, reason)."""
    exported = aotstack.export(model, {"forward": (x,)}).methods["forward"]
    result = partitioner.partition(exported)
    ops = {node.name: str(node.target) for node in exported.graph.nodes}
    return [(ops[name], f"{reason.kind}: {reason.detail}") for name, reason in result.refusals.items()]


class Frac(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.frac()


class Declined(torch.nn.Module):
    """One node for each reason OpenVINO has to leave an op."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide = x.to(torch.float64) * 3  # the CPU plugin computes float64 in float32
        ids = (x * 10).to(torch.int64)
        return (
            wide,
            torch.median(x),  # no conversion rule
            x.frac(),  # decomposed into trunc, which has none
            ids + 2**40,  # an int64 literal the CPU plugin's int32 arithmetic would wrap
            torch.view_as_real(x.to(torch.complex64)),
            torch.relu(x) + ids,
            # A dilated window wider than the input, which torch allows with ceil_mode (export narrows an undilated one)
            torch.nn.functional.max_pool2d(x[None], (1, 3), stride=(1, 4), dilation=(1, 3), ceil_mode=True),
            # A count per row: its converter takes one count for all, and failed to convert the partition
            torch.repeat_interleave(x, (x[:, 0] > 0).to(torch.int64) + 1, dim=0),
            ids // 3,  # rounded toward zero by OpenVINO: -20 // 7 gave -2
        )


def test_the_partitioner_says_why_it_leaves_each_op(tmp_path):
    reasons = refusals(Declined(), torch.randn(4, 4), OpenVinoPartitioner())
    texts = [text for _, text in reasons]

    assert ("aten.median.default", "unsupported: OpenVINO's PyTorch frontend has no conversion rule for it") in reasons
    # How frac reaches OpenVINO depends on torch's decomposition table: on 2.13 it decomposes into trunc, which
    # has no rule; on 2.11 it converts. Either way the answer must hold.
    frac = [text for op, text in reasons if op == "aten.frac.default"]
    if frac:
        assert frac == ["unsupported: OpenVINO decomposes it into ops its frontend has no conversion rule "
                        "for: aten.trunc.default"]
    else:
        x = torch.randn(4, 4)
        program = aotstack.export(Frac(), {"forward": (x,)})
        lowered = aotstack.lower(program, [OpenVinoPartitioner()])
        assert [d.backend_id for d in lowered.delegates("forward")] == ["openvino"]
        lowered.save(tmp_path / "frac.pt2")
        torch.testing.assert_close(aotstack.load(tmp_path / "frac.pt2").forward(x), x.frac())
    assert any("float64 tensor, and OpenVINO's CPU plugin computes float64 in float32" in text for text in texts)
    assert any(f"int64 argument other={2**40} does not fit" in text for text in texts)
    assert any("torch.complex64 tensor, and OpenVINO's PyTorch frontend has no element type" in text for text in texts)
    assert ("aten.max_pool2d.default", "unsupported: its window of 7 along spatial axis 1 is wider than the padded "
            "input (4 + 2 x 0), which torch allows with ceil_mode and OpenVINO's pooling does not") in reasons
    assert ("aten.floor_divide.default", "unsupported: it divides torch.int64 integers rounding down, which OpenVINO "
            "rounds toward zero") in reasons
    assert ("aten.repeat_interleave.self_Tensor", "unsupported: it repeats each element by a count of its own, and "
            "OpenVINO's converter takes one count for all") in reasons
    assert "aten.relu.default" not in {op for op, _ in reasons}, "an op it converts is claimed"


class DropoutThenReshape(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dropout(self.linear(x)).reshape(4, 2, 8))


def test_a_program_from_torch_export_is_claimed_whole_as_one_from_aotstack_export():
    """``torch.export.export`` gives the training IR (eval-mode dropout, reshape), which OpenVINO's converter lacks:
    Program brings it to the form ``aotstack.export`` gives, so OpenVINO takes the model in one part."""
    model, x = DropoutThenReshape().eval(), torch.randn(4, 16)
    with torch.no_grad():
        exported = torch.export.export(model, (x,))
    assert exported.dialect == "TRAINING" and "aten.dropout.default" in graph_ops(exported)

    program = aotstack.Program({"forward": exported})
    assert not {"aten.dropout.default", "aten.reshape.default"} & set(graph_ops(program.methods["forward"]))
    explained = aotstack.explain(program, [OpenVinoPartitioner()]).method("forward")
    assert len(explained.delegates) == 1 and not explained.unclaimed


def graph_ops(exported: torch.export.ExportedProgram) -> list[str]:
    return [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]


def test_ops_narrows_what_it_claims():
    reasons = dict(refusals(models.build("stacked"), models.example_inputs("stacked")[0],
                            OpenVinoPartitioner(ops=["aten.linear"])))
    assert reasons["aten.gelu.default"] == "excluded: the user's ops= list does not name it"
    assert "aten.linear.default" not in reasons


def test_min_block_size_leaves_small_parts(lowered_with):
    lowered, _ = lowered_with(
        "island", "openvino-min2",
        lambda: [aotstack.OpenVinoPartitioner(ops=["aten.linear", "aten.relu", "aten.add"], min_block_size=2)],
    )
    assert [sorted(d.ops) for d in lowered.delegates("forward")] == [
        ["aten.linear.default", "aten.relu.default"], ["aten.linear.default", "aten.relu.default"]
    ]


class Crowded(torch.nn.Module):
    """A model whose ops OpenVINO converts, with ``median``, which it cannot."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + torch.median(x)


class ClaimsEverything(OpenVinoPartitioner):
    """A partitioner that claims what OpenVINO cannot convert, to reach the compile side's error."""

    def op_refusal(self, op):
        return None


def test_a_partition_openvino_cannot_convert_is_a_lowering_error_naming_it():
    program = aotstack.export(Crowded(), {"forward": (torch.randn(4, 4),)})
    with pytest.raises(aotstack.LoweringError, match="an openvino partition of method 'forward'") as raised:
        aotstack.lower(program, [ClaimsEverything()], jobs=1)
    assert "aten.median" in str(raised.value)

    lowered = aotstack.lower(program, [ClaimsEverything(), aotstack.AotiCpuPartitioner()],
                             on_compile_error="fallback", jobs=1)
    assert [failure.backend_id for failure in lowered.compile_failures["forward"]] == ["openvino"]


def test_a_target_device_other_than_the_cpu_is_refused():
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    spec = CompileSpec(SpecKey.TARGET_DEVICE, b"cuda")
    with pytest.raises(aotstack.LoweringError, match="target_device"):
        aotstack.lower(program, [aotstack.OpenVinoPartitioner(compile_specs=[spec])], jobs=1)


def delegate_record(lowered_with):
    lowered, _ = lowered_with("linear", "openvino", lambda: [aotstack.OpenVinoPartitioner()])
    [delegate] = lowered.delegates("forward")
    return delegate


def test_a_malformed_processed_blob_is_a_package_error(lowered_with):
    delegate = delegate_record(lowered_with)
    runtime = ov_run.OpenVinoRuntime()
    processed = json.loads(delegate.processed_bytes)
    bad = [
        b"not json",
        json.dumps({**processed, "version": 99}).encode(),
        json.dumps({k: v for k, v in processed.items() if k != "parameters"}).encode(),
        json.dumps({**processed, "precision": "f64"}).encode(),
        json.dumps({**processed, "outputs": [1]}).encode(),
        json.dumps({**processed, "parameters": ["input:0", "input:0"]}).encode(),
    ]
    for processed_bytes in bad:
        with pytest.raises(aotstack.PackageError):
            runtime.init(processed_bytes, delegate.named_data, delegate.compile_specs)
    named_data = {k: v for k, v in delegate.named_data.items() if k != ov_run.MODEL_NAME}
    with pytest.raises(aotstack.PackageError, match="openvino.xml"):
        runtime.init(delegate.processed_bytes, named_data, delegate.compile_specs)


def test_a_model_openvino_cannot_read_is_a_delegate_init_error(lowered_with):
    delegate = delegate_record(lowered_with)
    named_data = {**delegate.named_data, ov_run.MODEL_NAME: b"<net><layers><layer/></layers></net>"}
    with pytest.raises(aotstack.DelegateInitError, match="OpenVINO could not read the model"):
        ov_run.OpenVinoRuntime().init(delegate.processed_bytes, named_data, delegate.compile_specs)


def int4_delegate() -> aotstack.Delegate:
    """A linear quantized ``4w``, lowered to OpenVINO alone: its weight's values stored two a byte as ``i4``."""
    torch.manual_seed(0)
    model = aotstack.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), linear="4w", group_size=32)
    program = aotstack.export(model, {"forward": (torch.randn(2, 64),)})
    [delegate] = aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).delegates("forward")
    return delegate


def with_weight_resized(delegate: aotstack.Delegate, dtype: str, change: int) -> tuple[bytes, dict, str]:
    """The delegate's processed blob and named data with its first ``dtype`` weight ``change`` values longer."""
    processed = json.loads(delegate.processed_bytes)
    fqn, entry = next(((fqn, entry) for fqn, entry in processed["weights"].items() if entry["dtype"] == dtype),
                      (None, processed["weights"]))
    assert fqn is not None, entry
    count = math.prod(entry["shape"]) + change
    entry["shape"] = [count]
    data = torch.zeros(count, dtype=getattr(torch, dtype))
    named_data = {**delegate.named_data, WEIGHT_PREFIX + fqn: tensor_bytes(data)}
    return json.dumps(processed).encode(), named_data, fqn


def test_an_int4_weight_whose_bytes_do_not_fit_its_shape_is_a_package_error():
    delegate = int4_delegate()
    processed_bytes, named_data, fqn = with_weight_resized(delegate, "uint8", -1)
    with pytest.raises(aotstack.PackageError, match=f"{fqn}.*takes 1024 bytes of uint8, its data is 1023"):
        ov_run.OpenVinoRuntime().init(processed_bytes, named_data, delegate.compile_specs)


def test_a_weight_openvino_cannot_take_is_a_delegate_init_error():
    delegate = int4_delegate()
    processed_bytes, named_data, fqn = with_weight_resized(delegate, "float32", 1)
    with pytest.raises(aotstack.DelegateInitError, match="OpenVINO could not take (the )?weight"):
        ov_run.OpenVinoRuntime().init(processed_bytes, named_data, delegate.compile_specs)


TORCHAO_AFTER_A_FIRST_LOWERING = """
import json, sys
import torch, aotstack
x = torch.randn(2, 64)
aotstack.lower(aotstack.export(torch.nn.Linear(64, 32).eval(), {"forward": (x,)}), [aotstack.OpenVinoPartitioner()])
first = "torchao" in sys.modules
torch.manual_seed(0)
model = aotstack.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), linear="4w", group_size=32)
lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.OpenVinoPartitioner()])
[delegate] = lowered.delegates("forward")
weights = json.loads(bytes(delegate.processed_bytes))["weights"].values()
print(json.dumps([first, sorted(entry["dtype"] for entry in weights)]))
"""


def test_torchao_imported_after_a_first_lowering_still_has_its_layers_taken_whole():
    """OpenVINO's decomposition table is built again for ops registered since: torchao's dequantizations."""
    torchao_before, dtypes = run_child(TORCHAO_AFTER_A_FIRST_LOWERING)
    assert torchao_before is False
    assert dtypes == ["float32", "float32", "uint8", "uint8"]


WITHOUT_OPENVINO = """
import json, sys
sys.modules["openvino"] = None  # as if it were not installed
import aotstack
try:
    aotstack.load(sys.argv[1])
    print(json.dumps(None))
except aotstack.DelegateInitError as exc:
    print(json.dumps(str(exc)))
"""


def test_loading_without_openvino_installed_is_a_delegate_init_error(lowered_with):
    _, path = lowered_with("linear", "openvino", lambda: [aotstack.OpenVinoPartitioner()])
    message = run_child(WITHOUT_OPENVINO, str(path))
    assert message is not None and "pip install 'aotstack[openvino]'" in message


def test_a_bad_call_reaching_the_delegate_is_an_input_error(lowered_with):
    delegate = delegate_record(lowered_with)
    runtime = ov_run.OpenVinoRuntime()
    handle = runtime.init(delegate.processed_bytes, delegate.named_data, delegate.compile_specs)
    x = models.example_inputs("linear")[0]
    for bad in ([x[:2]], [x.double()], [x, x], [x.to("meta")], [3.0]):
        with pytest.raises(aotstack.InputError):
            runtime.execute(handle, bad)
    # Views a call may pass are made what OpenVINO reads: transposed, negated, asking for gradients.
    model = models.build("linear")
    for view in (x.t().contiguous().t(), torch.neg(x)._neg_view(), x.clone().requires_grad_()):
        torch.testing.assert_close(runtime.execute(handle, [view])[0], model(view).detach(), rtol=1e-5, atol=1e-5)


def test_large_tensors_cross_without_a_copy(tmp_path):
    model = WideLinear().eval()
    x = torch.randn(128, 512)  # in 256 kB, out 32 kB: both past the size that is copied
    aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.OpenVinoPartitioner()]).save(
        tmp_path / "wide.pt2"
    )
    loaded = aotstack.load(tmp_path / "wide.pt2")
    [handle] = handle_of(loaded)

    y = loaded.forward(x)
    [slot] = handle.idle
    assert slot.request.get_input_tensor(0).data.__array_interface__["data"][0] == x.data_ptr()
    assert slot.request.get_output_tensor(0).data.__array_interface__["data"][0] == y.data_ptr()
    torch.testing.assert_close(y, model(x).detach(), rtol=1e-5, atol=1e-5)


def test_threads_calling_one_delegate_each_get_their_own_answer(lowered_with):
    _, path = lowered_with("stacked", "openvino-ov", ORDERS["ov"][0])
    loaded, model = aotstack.load(path), models.build("stacked")
    inputs = [torch.randn(4, 16) for _ in range(8)]
    results: dict[int, torch.Tensor] = {}

    def call(index: int) -> None:
        for _ in range(50):
            results[index] = loaded.forward(inputs[index])

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, x in enumerate(inputs):
        torch.testing.assert_close(results[index], model(x).detach(), rtol=1e-5, atol=1e-5)


def test_a_forked_child_can_call_a_delegate_its_parent_loaded(lowered_with):
    _, path = lowered_with("stacked", "openvino-ov", ORDERS["ov"][0])
    loaded = aotstack.load(path)
    x = models.example_inputs("stacked")[0]
    expected = loaded.forward(x)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child computes nothing but the call, and ends without exit handlers
        os.close(read)
        os.write(write, loaded.forward(x).numpy().tobytes())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        got = pipe.read()
    _, status = os.waitpid(child, 0)
    assert status == 0
    assert got == expected.numpy().tobytes()


def test_random_bad_calls_are_input_errors_and_odd_good_ones_match_eager(tmp_path):
    from tests.test_bad_calls import MAX_N, MIN_N, RANDOM_CALLS, build_model

    n = torch.export.Dim("n", min=MIN_N, max=MAX_N)
    program = aotstack.export(
        build_model(), {"forward": (torch.randn(4, 8), torch.randn(4, 8))},
        dynamic_shapes={"forward": {"x": {0: n}, "y": {0: n}}},
    )
    paths = {}
    for name, partitioners in {
        "openvino": [aotstack.OpenVinoPartitioner()],
        # OpenVINO between two AOTInductor delegates: it takes cat's [2*n, 8] and sigmoid.
        "aoti-openvino": [aotstack.AotiCpuPartitioner(exclude_ops=["aten.cat", "aten.sigmoid"]),
                          aotstack.OpenVinoPartitioner()],
    }.items():
        lowered = aotstack.lower(program, partitioners)
        assert "openvino" in {d.backend_id for d in lowered.delegates("forward")}
        paths[name] = str(tmp_path / f"{name}.pt2")
        lowered.save(paths[name])

    result = run_child(RANDOM_CALLS, json.dumps(paths), "20261124", "500")
    assert result["failures"] == []
    assert any("(good)" in kind for kind in result["counts"])


class PassThrough(torch.nn.Module):
    """Outputs that only copy an input, which OpenVINO's CPU plugin compiles into the input's memory."""

    def forward(self, small: torch.Tensor, large: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return small.clone(), large.clone(), large.to(torch.float32), small * 2, large.view(-1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_an_output_that_copies_an_input_leaves_the_input_alone(tmp_path, dynamic):
    small, large = torch.randn(3, 4), torch.randn(128, 64)
    shapes = {"forward": ({0: torch.export.Dim("a", min=1, max=8)}, {0: torch.export.Dim("b", min=2, max=512)})}
    program = aotstack.export(PassThrough(), {"forward": (small, large)}, dynamic_shapes=shapes if dynamic else None)
    aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).save(tmp_path / "pass.pt2")
    loaded = aotstack.load(tmp_path / "pass.pt2")

    for _ in range(3):
        small, large = torch.randn(3, 4), torch.randn(128, 64)
        before = (small.clone(), large.clone())
        got = loaded.forward(small, large)
        assert torch.equal(small, before[0]) and torch.equal(large, before[1]), "the call changed its inputs"
        for out, want in zip(got, PassThrough()(*before), strict=True):
            torch.testing.assert_close(out, want)
        assert got[1].data_ptr() != large.data_ptr(), "a copy of an input is a tensor of its own"


def test_a_broadcast_to_the_shape_its_input_has_is_read_as_that_input():
    """A prompt's length returned, and copied into a 0-d buffer: as converted, the copy is a broadcast that OpenVINO
    2026's CPU plugin dies of SIGSEGV compiling beside the length itself (Arcee's AFMoE prefill)."""
    import numpy
    import openvino
    import openvino.opset13 as ops

    from aotstack.backends.openvino.compile import without_identity_broadcasts

    tokens = ops.parameter([1, -1], numpy.int64, name="tokens")
    stored = ops.parameter([], numpy.int64, name="stored")
    length = ops.gather(ops.shape_of(tokens), ops.constant(1, numpy.int64), ops.constant(0, numpy.int64))
    last = ops.gather(ops.range(ops.constant(0, numpy.int64), length, ops.constant(1, numpy.int64), "i64"),
                      ops.constant(-1, numpy.int64), ops.constant(0, numpy.int64))
    widened = ops.broadcast(ops.convert(last, "f32"), ops.constant([2, 3], numpy.int64))  # a real broadcast stays
    model = openvino.Model([ops.result(last), ops.result(ops.broadcast(last, ops.shape_of(stored))),
                            ops.result(widened)], [tokens, stored], "lengths")

    without_identity_broadcasts(model)
    assert [op.get_type_name() for op in model.get_ordered_ops()].count("Broadcast") == 1
    compiled = openvino.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1})
    results = list(compiled({"tokens": numpy.zeros((1, 5), numpy.int64), "stored": numpy.array(0)}).values())
    assert [int(results[0]), int(results[1])] == [4, 4]
    assert results[2].tolist() == [[4.0] * 3] * 2


class IndexAdd(torch.nn.Module):
    """Rows summed into slots, as a mixture of experts gathers its experts' outputs (JetMoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return torch.zeros(4, 8).index_add(0, slots, self.linear(rows)).relu() * 2


def test_index_add_as_export_writes_it_converts(tmp_path):
    """torch.export leaves ``alpha`` out at its default; OpenVINO's rule for ``index_add`` failed without it."""
    inputs = (torch.randn(6, 8), torch.tensor([0, 2, 2, 3, 1, 0]))
    model = IndexAdd().eval()
    program = aotstack.export(model, {"forward": inputs})
    lowered = aotstack.lower(program, [OpenVinoPartitioner(min_island_work=0), aotstack.AotiCpuPartitioner()])
    assert "openvino" in {delegate.backend_id for delegate in lowered.delegates("forward")}
    lowered.save(tmp_path / "index_add.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "index_add.pt2").forward(*inputs), model(*inputs))


class CacheFromEmpty(torch.nn.Module):
    """Keys concatenated onto an empty start, as transformers' ``DynamicCache`` does on a model's first step."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([torch.tensor([]), self.project(x)], dim=-2)
        return torch.softmax(x @ keys.transpose(-1, -2), dim=-1) @ keys


def test_a_concatenation_onto_an_empty_start_is_converted_whole(tmp_path):
    # torch skips the empty operand; OpenVINO's Concat would refuse its rank (the partition failed to convert).
    model, x = CacheFromEmpty().eval(), torch.randn(1, 2, 5, 8)
    length = torch.export.Dim("length", min=2, max=32)
    program = aotstack.export(model, {"forward": (x,)}, dynamic_shapes={"forward": ({2: length},)})
    lowered = aotstack.lower(program, [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()])
    assert [d.backend_id for d in lowered.delegates("forward")] == ["openvino"]
    lowered.save(tmp_path / "cache.pt2")

    loaded = aotstack.load(tmp_path / "cache.pt2")
    with torch.no_grad():
        for size in (5, 2, 17):
            x = torch.randn(1, 2, size, 8)
            torch.testing.assert_close(loaded.forward(x), model(x), rtol=1e-5, atol=1e-5)
