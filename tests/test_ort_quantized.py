"""torchao-quantized linears and embeddings through ONNX Runtime's packed-weight kernels.

Each scheme (ExecuTorch's names, applied by ``aotstack.quantize``) is lowered to ONNX Runtime alone,
saved, loaded in a fresh process that never imports torchao, and compared with the eager quantized
model. Where ONNX Runtime quantizes activations to int8 itself (``8da`` schemes, and weight-only
ones under ``quantized_activations=True``), the tolerance is the most that rounding activations
can move an output: each rounded activation moves by at most half its quantization step, so an
output moves by at most the sum of those half steps times its weights' magnitudes, once for ONNX
Runtime's rounding and once for torchao's. The ONNX model in the file must hold the contrib ops
and integer weights only; a layer ONNX Runtime cannot take is refused with a reason naming it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import aotstack
from tests.conftest import run_child

pytest.importorskip("torchao")
pytest.importorskip("onnxruntime")

IN, OUT, VOCAB = 256, 96, 64


class EmbedThenProject(torch.nn.Module):
    """An embedding and a linear over it: the linear's input (the embedding's rows) is known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, IN)
        self.project = torch.nn.Linear(IN, OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.project(self.embed(ids))


@dataclass(frozen=True)
class Case:
    linear: str
    embedding: str
    group: int
    ids_shape: tuple[int, ...]
    quantized_activations: bool
    # The ONNX Runtime op the linear must become, and how ONNX Runtime rounds its activations:
    # "block" (int8 per block of ``block`` along K), "tensor" (uint8 over the whole tensor), None.
    kernel: str
    rounding: str | None
    block: int = 32

    @property
    def name(self) -> str:
        grouping = "channel" if self.group == 0 else f"g{self.group}"
        int8_note = "-int8-activations" if self.quantized_activations else ""
        return f"{self.linear}-{grouping}-emb{self.embedding}-{'x'.join(map(str, self.ids_shape))}{int8_note}"


CASES = [
    Case("8w", "8w", 32, (2, 3), True, "MatMulNBits", "block"),
    Case("8w", "4w", 0, (2, 3), True, "MatMulNBits", "block", block=128),
    # One row per channel: DynamicQuantizeMatMul rounds activations exactly as torchao does.
    Case("8da8w", "4w", 0, (1, 1), False, "DynamicQuantizeMatMul", "tensor"),
    Case("8da8w", "8w", 32, (2, 3), False, "MatMulNBits", "block"),
    # Several rows per channel: torchao's per-token rounding in ONNX ops, then an integer matmul.
    Case("8da8w", "8w", 0, (2, 3), False, "MatMulInteger", None, block=128),
    Case("4w", "4w", 32, (2, 3), True, "MatMulNBits", "block"),
    Case("4w", "8w", 32, (2, 3), False, "MatMulNBits", None),
    Case("8da4w", "4w", 32, (2, 3), False, "MatMulNBits", "block"),
]


@dataclass
class Lowered:
    case: Case
    model: EmbedThenProject
    ids: torch.Tensor
    lowered: aotstack.LoweredProgram
    path: Path


@pytest.fixture(scope="module")
def lowered_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Lowered]:
    """Every case lowered to ONNX Runtime alone and saved, once (ONNX Runtime compiles take about 0.5 s)."""
    directory = tmp_path_factory.mktemp("ort-quantized")
    built = {}
    for index, case in enumerate(CASES):
        torch.manual_seed(index)
        model = aotstack.quantize(EmbedThenProject().eval(), linear=case.linear, embedding=case.embedding,
                                  group_size=case.group)
        ids = torch.randint(0, VOCAB, case.ids_shape)
        program = aotstack.export(model, {"forward": (ids,)})
        lowered = aotstack.lower(program, [aotstack.OrtPartitioner(quantized_activations=case.quantized_activations)])
        path = directory / f"{case.name}.pt2"
        lowered.save(path)
        built[case.name] = Lowered(case, model, ids, lowered, path)
    return built


FRESH_RUNS = """
import json, sys
import torch
import aotstack

cases = torch.load(sys.argv[1])
outputs = {name: aotstack.load(path).forward(ids) for name, (path, ids) in cases.items()}
torch.save(outputs, sys.argv[2])
print(json.dumps({"torchao_imported": "torchao" in sys.modules}))
"""


@pytest.fixture(scope="module")
def fresh_outputs(lowered_cases: dict[str, Lowered], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case's file loaded and run in one fresh process: its outputs, and whether it imported torchao."""
    directory = tmp_path_factory.mktemp("ort-quantized-runs")
    cases, outputs = directory / "cases.pt", directory / "outputs.pt"
    torch.save({name: (str(built.path), built.ids) for name, built in lowered_cases.items()}, cases)
    facts = run_child(FRESH_RUNS, str(cases), str(outputs))
    return {"outputs": torch.load(outputs), **facts}


def rounding_bound(case: Case, activations: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most |ONNX Runtime - eager| can be, per output, from rounding the linear's activations.

    Rounding moves each activation by at most half its step; an output moves by at most the sum
    of those half steps times the absolute weights. Steps: ONNX Runtime's ``block`` rounding is
    symmetric int8 per block along K (max|x| / 127), its ``tensor`` rounding asymmetric uint8
    over the whole tensor (range / 255), torchao's ``8da`` asymmetric int8 per token (range / 255).
    A small relative slack covers float summation order.
    """
    rows = activations.reshape(-1, activations.shape[-1])
    half_steps = torch.zeros_like(rows)
    if case.rounding == "block":
        blocks = rows.reshape(rows.shape[0], -1, case.block).abs().amax(dim=-1, keepdim=True)
        half_steps += (blocks / 127 / 2).expand(-1, -1, case.block).reshape(rows.shape)
    elif case.rounding == "tensor":
        half_steps += (rows.max().clamp(min=0) - rows.min().clamp(max=0)) / 255 / 2
    if case.linear.startswith("8da"):
        spans = rows.amax(dim=-1, keepdim=True).clamp(min=0) - rows.amin(dim=-1, keepdim=True).clamp(max=0)
        half_steps += spans / 255 / 2
    magnitudes = weight.abs().t()
    slack = 1e-5 * (rows.abs() @ magnitudes) + 1e-6
    return (half_steps @ magnitudes + slack).reshape(*activations.shape[:-1], -1)


def eager_and_bound(built: Lowered) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        expected = built.model(built.ids)
        activations = built.model.embed(built.ids)
        weight = built.model.project.weight.dequantize()
    return expected, rounding_bound(built.case, activations, weight)


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_each_scheme_matches_eager_after_a_fresh_load(name, lowered_cases, fresh_outputs):
    built = lowered_cases[name]
    expected, bound = eager_and_bound(built)
    for got in (fresh_outputs["outputs"][name], aotstack.load(built.path).forward(built.ids)):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        excess = ((got - expected).abs() - bound).max()
        assert excess <= 0, f"{name}: differs from eager by {excess:.3g} more than activation rounding allows"
    if built.case.rounding is None:
        # Float activations, or torchao's own rounding: eager's arithmetic, up to summation order.
        torch.testing.assert_close(fresh_outputs["outputs"][name], expected, rtol=1e-5, atol=1e-5)


def test_the_loading_process_needs_no_torchao(fresh_outputs):
    assert fresh_outputs["torchao_imported"] is False


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_onnx_runtime_takes_every_layer_and_keeps_its_weights_packed(name, lowered_cases):
    import onnx

    built = lowered_cases[name]
    (delegate,) = built.lowered.delegates("forward")
    assert delegate.backend_id == "onnxruntime"
    assert delegate.quantized == {
        f"embedding {built.case.embedding}, {grouping(built.case)}": 1,
        f"linear {built.case.linear}, {grouping(built.case)}": 1,
    }
    model = onnx.load_from_string(bytes(delegate.named_data["model.onnx"]))
    ops = {node.op_type: node for node in model.graph.node}
    assert {"GatherBlockQuantized", built.case.kernel} <= set(ops)
    # Nothing dequantizes weights or multiplies floats by a float weight.
    assert not {"MatMul", "Gemm", "Gather", "DequantizeLinear"} & set(ops)
    if built.case.kernel == "MatMulNBits":
        attributes = {attribute.name: attribute.i for attribute in ops["MatMulNBits"].attribute}
        bits = 4 if built.case.linear.endswith("4w") else 8
        level = 4 if built.case.quantized_activations or built.case.linear.startswith("8da") else 0
        assert attributes == {"K": IN, "N": OUT, "bits": bits, "block_size": built.case.block, "accuracy_level": level}
    weights = {
        initializer.name: onnx.helper.tensor_dtype_to_np_dtype(initializer.data_type)
        for initializer in model.graph.initializer
    }
    kernel_inputs = set(ops[built.case.kernel].input[1:2]) | set(ops["GatherBlockQuantized"].input[:1])
    assert {str(weights[name]) for name in kernel_inputs} <= {"uint8", "int8"}
    # The only float weights left: scales and the bias.
    float_weights = {name for name, dtype in weights.items() if dtype.kind == "f"}
    assert all(name.endswith(".scales") or name == "project.bias" for name in float_weights), float_weights
    # Stored outside the model, as named data of their packed size.
    assert all(initializer.data_location == onnx.TensorProto.EXTERNAL for initializer in model.graph.initializer)
    packed_bytes = sum(
        memoryview(data).nbytes for key, data in delegate.named_data.items() if key.endswith(".values")
    )
    bits = 4 if built.case.linear.endswith("4w") else 8
    embedding_bits = 4 if built.case.embedding == "4w" else 8
    assert packed_bytes == (OUT * IN * bits + VOCAB * IN * embedding_bits) // 8


def grouping(case: Case) -> str:
    return "per channel" if case.group == 0 else f"group {case.group}"


def test_file_of_int4_weights_is_under_a_third_of_float(lowered_cases, tmp_path):
    float_path = tmp_path / "float.pt2"
    ids = torch.randint(0, VOCAB, (2, 3))
    aotstack.lower(aotstack.export(EmbedThenProject().eval(), {"forward": (ids,)}),
                   [aotstack.OrtPartitioner()]).save(float_path)
    int4_path = lowered_cases[Case("8da4w", "4w", 32, (2, 3), False, "MatMulNBits", "block").name].path
    assert int4_path.stat().st_size <= 0.3 * float_path.stat().st_size


# --- refusals -------------------------------------------------------------------------------


def refusals(model: torch.nn.Module, example: torch.Tensor, **options) -> dict[str, aotstack.Reason]:
    program = aotstack.export(model, {"forward": (example,)})
    result = aotstack.OrtPartitioner(**options).partition(program.methods["forward"])
    tagged = {node.name for node in result.tagged_exported_program.graph.nodes if "delegation_tag" in node.meta}
    return {name: reason for name, reason in result.refusals.items() if name not in tagged}


def test_8w_with_float_activations_is_refused_naming_the_layer_and_why():
    model = aotstack.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), linear="8w", group_size=32)
    refused = refusals(model, torch.randn(2, 64))
    assert {"linear", "dequantize_affine"} <= set(refused)
    detail = refused["linear"].detail
    assert "linear 'linear' (8w, group 32): 8-bit weights with float activations" in detail
    assert "OrtPartitioner(quantized_activations=True)" in detail
    assert refused["linear"].engine == "onnxruntime" and refused["linear"].kind == "unsupported"


def test_a_group_without_a_power_of_two_block_is_refused():
    model = aotstack.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), linear="4w", group_size=8)
    refused = refusals(model, torch.randn(2, 64))
    assert "no such block divides the group of 8" in refused["linear"].detail
    assert "group of 8" in refused["dequantize_affine"].detail


def test_an_embedding_too_narrow_for_a_block_is_left_to_the_next_engine(tmp_path):
    """T5's relative position bias is a table of 4 heads: quantized per row, one scale per 4 values, which no
    ``GatherBlockQuantized`` block holds. It failed the whole partition's compile; now ONNX Runtime leaves it."""
    model = torch.nn.Embedding(32, 4).eval()
    model = aotstack.quantize(model, embedding="8w", group_size=4)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    refused = refusals(model, ids)
    assert "embedding 'embedding' (8w, per channel)" in refused["embedding"].detail
    assert "no such block divides the group of 4" in refused["embedding"].detail
    lowered = aotstack.lower(aotstack.export(model, {"forward": (ids,)}), [aotstack.OrtPartitioner()])
    lowered.save(tmp_path / "narrow.pt2")
    # Left with no engine after ONNX Runtime, it runs as torchao's op, which the load allows by name.
    loaded = aotstack.load(tmp_path / "narrow.pt2", allow_ops=["torchao.dequantize_affine"])
    torch.testing.assert_close(loaded.forward(ids), model(ids))


class DequantizedElsewhere(torch.nn.Module):
    """torchao's ops by hand: a dequantized weight that also feeds a matmul, and one that feeds only a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stored", torch.randint(-8, 8, (32, 64), dtype=torch.int8))
        self.register_buffer("scales", torch.rand(32, 2))
        self.register_buffer("zero_points", torch.zeros(32, 2, dtype=torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dequantize = torch.ops.torchao.dequantize_affine
        weight = dequantize(self.stored, [1, 32], self.scales, self.zero_points, torch.int8, -8, 7)
        shared = torch.nn.functional.linear(x, weight) + (x @ weight.t())
        other = dequantize(self.stored, [1, 32], self.scales, self.zero_points, torch.int8, -8, 7)
        return shared + other.sum()


def test_a_dequantized_weight_read_by_another_op_keeps_its_linear_out_with_it():
    import torchao.quantization.quant_primitives  # noqa: F401 - registers torchao's ops

    refused = refusals(DequantizedElsewhere().eval(), torch.randn(2, 64))
    # ``x @ weight.t()`` reads the dequantized weight through a transpose.
    assert "weights are also read by 't'" in refused["linear"].detail
    assert refused["dequantize_affine"].detail == refused["linear"].detail
    assert "not part of a quantized linear or embedding" in refused["dequantize_affine_1"].detail


def test_ops_filter_decides_for_a_quantized_layer_as_for_its_linear():
    model = aotstack.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), linear="8da4w", group_size=32)
    refused = refusals(model, torch.randn(2, 64), ops=["aten.relu"])
    quantized_nodes = {"linear", "dequantize_affine", "dequantize_affine_1", "quantize_affine",
                       "choose_qparams_affine", "getitem", "getitem_1"}
    assert quantized_nodes <= set(refused)
    assert {refused[name].kind for name in quantized_nodes} == {"excluded"}


# --- a transformers decoder -----------------------------------------------------------------


@pytest.mark.parametrize(
    "linear, embedding, group, options",
    [("4w", "4w", 32, {}), ("8da8w", "8w", 0, {})],
    ids=["4w", "8da8w-per-channel"],
)
def test_a_quantized_llama_decodes_as_eager_through_onnx_runtime_alone(linear, embedding, group, options, tmp_path):
    """Float activations, or torchao's own per-token rounding (DynamicQuantizeMatMul, one token a call):
    the logits of every step match eager's closely, so the tokens are eager's."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from tests.test_language_models import CACHE, PROMPT, STEPS, small_llama, token_by_token

    model = aotstack.quantize(small_llama(), linear=linear, embedding=embedding, group_size=group)
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    exported = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.OrtPartitioner(**options)])
    assert {delegate.backend_id for delegate in lowered.delegates("forward")} == {"onnxruntime"}
    assert sum(sum(delegate.quantized.values()) for delegate in lowered.delegates("forward")) == 2 * 7 + 2
    lowered.save(tmp_path / "llama.pt2")
    loaded = aotstack.load(tmp_path / "llama.pt2")
    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
    logits: list[tuple[torch.Tensor, torch.Tensor]] = []

    def both(ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        want = eager(input_ids=ids, cache_position=position)
        got = loaded.forward(input_ids=ids, cache_position=position)
        logits.append((got, want))
        return want

    token_by_token(both, PROMPT, STEPS)
    for got, want in logits:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_analysis_names_each_layer_once():
    """Each quantized layer's nodes are its own: no node belongs to two layers."""
    from aotstack.backends.ort.quantized import quantized_graph

    model = aotstack.quantize(EmbedThenProject().eval(), linear="8da4w", embedding="4w", group_size=32)
    program = aotstack.export(model, {"forward": (torch.randint(0, VOCAB, (2, 3)),)})
    analysis = quantized_graph(program.methods["forward"].graph, None, True)
    nodes = [node for layer in analysis.layers for node in layer.nodes]
    assert len(nodes) == len(set(nodes)) and not analysis.refusals
    assert sorted(layer.kernel.op for layer in analysis.layers) == ["GatherBlockQuantized", "MatMulNBits"]
    assert operator.getitem in {node.target for node in nodes}
