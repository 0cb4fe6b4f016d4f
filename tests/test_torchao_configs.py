"""Every torchao config a user applies with ``quantize_``, lowered in every engine order a user might pick.

One small model (an embedding, three linears) is quantized with each config, straight from
torchao, not through ``aotstack.quantize``: ``Int8WeightOnlyConfig`` and
``Int8DynamicActivationInt8WeightConfig`` leave their ``Int8Tensor`` linears in plain ATen ops
(``mm`` over a cast of int8 weights, ``_int_mm``), the ``Intx`` configs leave torchao's
``dequantize_affine`` pattern. Each is lowered with AOTInductor alone, with ONNX Runtime,
OpenVINO or XNNPACK first, and by ``auto``; each file, loaded, must compute what the eager
quantized model computes, and each engine that holds a quantized layer must run it on a kernel
that reads its packed integer weights (ONNX Runtime's contrib ops, OpenVINO's compressed
matmuls and gathers), or leave it whole to the next engine.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.engine.registry import BUILT_IN

pytest.importorskip("torchao")

from torchao.quantization import (  # noqa: E402 - after the skip: the configs need torchao
    Int8DynamicActivationInt8WeightConfig,
    Int8DynamicActivationIntxWeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerAxis, PerGroup  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

VOCAB, DIM, HIDDEN = 512, 128, 256
# One batch of eight tokens. (XNNPACK's delegate fails on a [1, 1, K] input, float or not.)
IDS = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))


class Tiny(torch.nn.Module):
    """Token embeddings, a residual MLP (one linear without bias) and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        hidden = hidden + self.down(torch.relu(self.up(hidden)))
        return self.head(hidden)


@dataclass(frozen=True)
class Config:
    """A torchao config for the linears, one for the embedding, and the layers the report must count."""

    linear: Callable[[], Any]
    embedding: Callable[[], Any]
    labels: dict[str, int]
    # Activations quantized as the model runs: an engine may round one a step from torchao.
    dynamic: bool = False
    int4: bool = False


def int8_rows() -> Any:
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def int4_rows() -> Any:
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))


def int4_rows_asymmetric() -> Any:
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC)


def linears(label: str) -> dict[str, int]:
    return {f"linear {label}": 3}


CONFIGS: dict[str, Config] = {
    "int8-weight-only": Config(Int8WeightOnlyConfig, int8_rows,
                               {**linears("8w, per channel"), "embedding 8w, per channel": 1}),
    "int8-dynamic": Config(Int8DynamicActivationInt8WeightConfig, int8_rows,
                           {**linears("8da8w, per channel"), "embedding 8w, per channel": 1}, dynamic=True),
    "intx-int4-g32": Config(int4_rows, int4_rows,
                            {**linears("4w, group 32"), "embedding 4w, group 32": 1}, int4=True),
    "intx-int8-channel": Config(int8_rows, int8_rows,
                                {**linears("8w, per channel"), "embedding 8w, per channel": 1}),
    "8da8w-channel": Config(
        lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
        int8_rows, {**linears("8da8w, per channel"), "embedding 8w, per channel": 1}, dynamic=True),
    "8da8w-g32": Config(
        lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerGroup(32)),
        int8_rows, {**linears("8da8w, group 32"), "embedding 8w, per channel": 1}, dynamic=True),
    "8da4w-channel": Config(
        lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerAxis(0)),
        int4_rows, {**linears("8da4w, per channel"), "embedding 4w, group 32": 1}, dynamic=True, int4=True),
    "8da4w-g32": Config(
        lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
        int4_rows, {**linears("8da4w, group 32"), "embedding 4w, group 32": 1}, dynamic=True, int4=True),
    # Zero points other than 0: XNNPACK's kernels take symmetric weights only (it dropped them: 38% errors).
    "8da4w-g32-asymmetric": Config(
        lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                      weight_mapping_type=MappingType.ASYMMETRIC),
        int4_rows_asymmetric, {**linears("8da4w, group 32"), "embedding 4w, group 32": 1}, dynamic=True, int4=True),
}

# Order -> (its partitioners, made afresh, or "auto"; the engine it puts first).
ORDERS: dict[str, tuple[Callable[[], Any], str]] = {
    "aoti": (lambda: [aotstack.AotiCpuPartitioner()], "aoti_cpu"),
    "ort+aoti": (lambda: [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()], "onnxruntime"),
    "ov+aoti": (lambda: [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()], "openvino"),
    "xnnpack+aoti": (lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()], "xnnpack"),
    "auto": (lambda: "auto", "aoti_cpu"),
}

# The engine that holds the quantized linears, where it is not the order's first: ONNX Runtime refuses
# 8-bit weights with float activations (its only kernel for them runs 30x slower than float32);
# XNNPACK takes only its dynamic-quantization kernels' layers (8da4w, per-channel 8da8w).
LINEARS_ELSEWHERE = {
    ("int8-weight-only", "ort+aoti"): "aoti_cpu",
    ("intx-int8-channel", "ort+aoti"): "aoti_cpu",
    **{(name, "xnnpack+aoti"): "aoti_cpu" for name in ("int8-weight-only", "int8-dynamic", "8da8w-g32",
                                                        "8da4w-g32-asymmetric")},
}
# XNNPACK never takes an embedding; every other first engine takes the quantized one.
EMBEDDING_ELSEWHERE = {"xnnpack+aoti": "aoti_cpu"}

# Pairs left out, with why: each XNNPACK lowering costs an AOTInductor compile for every part
# between XNNPACK's, and ``auto`` lowers and times every order's plan again.
# - XNNPACK refuses weight-only Intx linears (ExecuTorch computes them wrongly) and grouped int8
#   ones the same way as it does 8da8w-g32 here (tests/test_xnnpack.py checks those refusals);
#   8da4w per channel reaches the same kernel as per group.
# - auto: one config per pattern, the Int8Tensor ones (weight-only, dynamic) and torchao's
#   dequantize pattern (8da4w-g32), shows the choice; every plan it picks from is checked above.
LEFT_OUT = {
    **{(name, "xnnpack+aoti"): "XNNPACK refuses these layers as it does 8da8w-g32's; tests/test_xnnpack.py"
       for name in ("intx-int4-g32", "intx-int8-channel", "8da4w-channel")},
    **{(name, "auto"): "auto picks among the orders checked above; three configs show it"
       for name in CONFIGS if name not in ("int8-weight-only", "int8-dynamic", "8da4w-g32")},
}
# Where the engine repeats torchao's own activation rounding (ONNX Runtime's MatMulInteger after
# torchao's per-token arithmetic in ONNX ops), a dynamic layer matches eager to float rounding.
EXACT_DYNAMIC = {("int8-dynamic", "ort+aoti"), ("8da8w-channel", "ort+aoti")}

CASES = [(name, order) for name in CONFIGS for order in ORDERS]


def case_id(case: tuple[str, str]) -> str:
    return f"{case[0]}-{case[1]}"


def missing_engine(order: str) -> str | None:
    """Why ``order`` cannot run here (its first engine is not installed, or not for this torch), or None."""
    engine = ORDERS[order][1]
    if engine == "xnnpack":
        return executorch_problem()
    if not BUILT_IN[engine].installed():
        return f"{engine} is not installed: pip install 'aotstack[{BUILT_IN[engine].extra}]'"
    return None


def quantized(config: Config) -> torch.nn.Module:
    """The shared model's weights, quantized with ``config`` as a user would: embeddings first, then linears."""
    torch.manual_seed(0)
    model = Tiny().eval()
    quantize_(model, config.embedding(), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Embedding))
    quantize_(model, config.linear())
    return model


@dataclass
class Lowering:
    lowered: aotstack.LoweredProgram
    path: Path
    expected: torch.Tensor


@pytest.fixture(scope="module")
def lowering(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Lowering]:
    """``lowering(config, order)``: the config's model lowered in that order and saved, once per module."""
    directory = tmp_path_factory.mktemp("torchao-configs")
    done: dict[tuple[str, str], Lowering] = {}

    def lower(name: str, order: str) -> Lowering:
        if (name, order) in LEFT_OUT:
            pytest.skip(LEFT_OUT[name, order])
        problem = missing_engine(order)
        if problem is not None:
            pytest.skip(problem)
        if (name, order) not in done:
            model = quantized(CONFIGS[name])
            with torch.no_grad():
                expected = model(IDS)
            lowered = aotstack.lower(aotstack.export(model, {"forward": (IDS,)}), ORDERS[order][0]())
            path = directory / f"{name}-{order}.pt2"
            lowered.save(path)
            done[name, order] = Lowering(lowered, path, expected)
        return done[name, order]

    return lower


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_file_computes_what_the_eager_quantized_model_does(lowering, case):
    name, order = case
    built = lowering(name, order)
    got = aotstack.load(built.path).forward(IDS)
    expected = built.expected
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = expected.abs().max().item()
    if CONFIGS[name].dynamic and case not in EXACT_DYNAMIC:
        # An engine that rounds activations itself (in its own blocks, or breaking a tie the other
        # way) may put one a step from torchao's: 1/127 of its row's range, so a layer's output moves
        # by under 1% of its range; the head reads the MLP's two rounded layers' sum, hence 2%.
        assert (got - expected).abs().max().item() <= 2e-2 * scale
    else:
        # torchao's arithmetic on the same integers; only the order of float sums differs.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * scale)


def engine_labels(lowered: aotstack.LoweredProgram) -> dict[str, Counter]:
    """The quantized layers each engine's delegates hold, counted by label."""
    held: dict[str, Counter] = {}
    for delegate in lowered.delegates("forward"):
        held.setdefault(delegate.backend_id, Counter()).update(delegate.quantized)
    return held


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_each_quantized_layer_is_held_whole_by_the_engine_expected(lowering, case):
    name, order = case
    held = engine_labels(lowering(name, order).lowered)
    config = CONFIGS[name]
    assert sum(held.values(), Counter()) == Counter(config.labels), held
    if order == "auto":
        return
    first = ORDERS[order][1]
    for label, count in config.labels.items():
        kind = label.split()[0]
        where = LINEARS_ELSEWHERE.get(case, first) if kind == "linear" else EMBEDDING_ELSEWHERE.get(order, first)
        assert held.get(where, Counter())[label] == count, (label, held)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_onnx_runtime_reads_its_quantized_layers_packed(lowering, name):
    """ONNX Runtime's delegates multiply no float weight: every weight a quantized layer reads is an integer."""
    import onnx

    built = lowering(name, "ort+aoti")
    for delegate in built.lowered.delegates("forward"):
        if delegate.backend_id != "onnxruntime":
            continue
        model = onnx.load_from_string(bytes(delegate.named_data["model.onnx"]))
        ops = {node.op_type for node in model.graph.node}
        assert not {"MatMul", "Gemm", "DequantizeLinear"} & ops, ops
        for initializer in model.graph.initializer:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(initializer.data_type)
            elements = int(torch.tensor(list(initializer.dims)).prod()) if initializer.dims else 1
            # Float tensors left: scales (one per group), biases; no layer's weights.
            assert dtype.kind != "f" or elements <= VOCAB * DIM // 32, (initializer.name, dtype, elements)
        if delegate.quantized:
            assert ops & {"MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "GatherBlockQuantized"}


def openvino_weights(delegate: aotstack.Delegate) -> list[tuple[str, str, int]]:
    """Each matmul's weight and each gather's table in the model OpenVINO's CPU plugin compiles the delegate
    into, as the run side compiles it (weights made constants, float32): (op, element type, elements)."""
    import openvino

    from aotstack.backends.openvino import run as ov_run
    from aotstack.format import processed as processed_json

    processed = json.loads(bytes(delegate.processed_bytes))
    weights = processed_json.weights(processed, delegate.named_data, "test")
    core = openvino.Core()
    model = core.read_model(bytes(delegate.named_data[ov_run.MODEL_NAME]),
                            ov_run.byte_tensor(delegate.named_data[ov_run.CONSTANTS_NAME]))
    ov_run.with_weights_as_constants(model, weights, "test")
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                 "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    found = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        if kind in ("FullyConnected", "MatMul", "Gather"):
            weight = op.input(0 if kind == "Gather" else 1)
            found.append((kind, weight.get_element_type().get_type_name(), int(torch.Size(weight.get_shape()).numel())))
    return found


@pytest.mark.parametrize("name", list(CONFIGS))
def test_openvino_runs_its_quantized_layers_on_integer_weights(lowering, name):
    """OpenVINO folds weights it does not read as compressed into a float32 copy; here every matmul reads int8
    weights, or int4 ones two a byte where the config is 4-bit, and every gather an int8 table (the float
    tables left are a quantized table's scales)."""
    built = lowering(name, "ov+aoti")
    (delegate,) = [d for d in built.lowered.delegates("forward") if d.backend_id == "openvino"]
    weights = openvino_weights(delegate)
    assert {kind for kind, _, _ in weights} == {"FullyConnected", "Gather"}, weights
    matmuls = "i4" if CONFIGS[name].int4 else "i8"
    assert all(element == matmuls for kind, element, _ in weights if kind == "FullyConnected"), weights
    assert all(element == "i8" or elements <= VOCAB * DIM // 32 for kind, element, elements in weights
               if kind == "Gather"), weights


@pytest.fixture(scope="module")
def float_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The float32 model lowered in an order and saved: what a quantized file's size is compared with."""
    directory = tmp_path_factory.mktemp("torchao-configs-float")
    done: dict[str, Path] = {}

    def lower(order: str) -> Path:
        if order not in done:
            torch.manual_seed(0)
            path = directory / f"{order}.pt2"
            aotstack.lower(aotstack.export(Tiny().eval(), {"forward": (IDS,)}), ORDERS[order][0]()).save(path)
            done[order] = path
        return done[order]

    return lower


@pytest.mark.parametrize("name", [name for name, config in CONFIGS.items() if config.int4])
def test_an_int4_file_through_onnx_runtime_is_under_a_third_of_float(lowering, float_file, name):
    """ONNX Runtime packs two int4 values a byte (MatMulNBits, GatherBlockQuantized): 1/8 of float32, plus
    a float scale per 32 values (1/32), under 0.3x with the float biases. (An AOTInductor file of this small
    model is mostly its library; its weights' bytes are checked below.)"""
    built = lowering(name, "ort+aoti")
    assert built.path.stat().st_size <= 0.3 * float_file("ort+aoti").stat().st_size


@pytest.mark.parametrize("name", [name for name, config in CONFIGS.items() if config.int4])
def test_aotinductor_stores_every_int4_weight_packed(lowering, name):
    """The linears' weights and the embedding's table alike, half a byte a value, no large int8 left: eight values a
    32-bit word (typed float32). A slot of DIM // 8 columns splits groups of 32: its scales are stored per 16."""
    built = lowering(name, "aoti")
    (delegate,) = built.lowered.delegates("forward")
    entries = json.loads(bytes(delegate.processed_bytes))["weights"].values()
    stored = [(entry["dtype"], entry["shape"]) for entry in entries]
    # up [HIDDEN, DIM], down [DIM, HIDDEN], head [VOCAB, DIM]; the embedding's table (groups of 32) [VOCAB, DIM].
    words = [("float32", [DIM, HIDDEN // 8]), ("float32", [HIDDEN, DIM // 8])] + [("float32", [VOCAB, DIM // 8])] * 2
    grouped = "per channel" not in next(iter(CONFIGS[name].labels))
    finer_scales = [("float32", [VOCAB, DIM // 16])] + ([("float32", [HIDDEN, DIM // 16])] if grouped else [])
    assert not [shape for dtype, shape in stored if dtype == "uint8"], stored
    assert all(stored.count(word) >= words.count(word) for word in words), stored
    assert all(scales in stored for scales in finer_scales), stored
    assert not [shape for dtype, shape in stored if dtype == "int8" and math.prod(shape) > VOCAB * DIM // 32]
    if "asymmetric" in name:
        # Stored as the product reads them, float32 ``z + 8``: read as int8 and widened each call, a Llama's
        # asymmetric int4 call took 0.65x float32's time, against 0.45x symmetric.
        assert not [shape for dtype, shape in stored if dtype == "int8"], stored
        # The embedding's and the head's scales and zero points.
        assert stored.count(("float32", [VOCAB, DIM // 16])) == 4, stored


@pytest.mark.parametrize("order", ["ort+aoti", "xnnpack+aoti"])
def test_aotinductor_packs_the_int8_linears_it_takes_behind_another_engine(lowering, order):
    """Export checks each ``.to(float)`` with ``_assert_tensor_metadata``. Where the first engine took the check of a
    weight's transpose, that transpose was an output of AOTInductor's part: read whole each call, never packed (the
    Llama of ``bench/torchao_configs.py`` behind ONNX Runtime: 9x its float32 time). No check is left to cut a part."""
    built = lowering("int8-weight-only", order)
    delegates = built.lowered.delegates("forward")
    held = [delegate for delegate in delegates if delegate.backend_id == "aoti_cpu" and delegate.quantized]
    linears = [count for delegate in held for label, count in delegate.quantized.items() if label.startswith("linear")]
    assert sum(linears) == 3
    for delegate in held:
        assert not [spec for spec in delegate.outputs if spec.dtype == "int8"], delegate.outputs
        entries = json.loads(bytes(delegate.processed_bytes))["weights"].values()
        assert not [entry for entry in entries if entry["dtype"] == "int8" and math.prod(entry["shape"]) >= DIM * 8]
    assert not [op for delegate in delegates for op in delegate.ops if "_assert_tensor_metadata" in op]
    # XNNPACK refuses these linears; the relu, the residual add and the head's bias are too light for parts of its own.
    if order == "xnnpack+aoti":
        assert [delegate.backend_id for delegate in delegates] == ["aoti_cpu"]


@pytest.mark.parametrize("name", [name for name, config in CONFIGS.items() if config.int4])
def test_openvino_stores_int4_linear_weights_two_a_byte(lowering, name):
    """torchao holds each int4 value in an int8; OpenVINO's delegate stores its linears' values packed, half the
    bytes (the embedding's table, which a gather reads, stays int8)."""
    built = lowering(name, "ov+aoti")
    (delegate,) = [d for d in built.lowered.delegates("forward") if d.backend_id == "openvino"]
    stored = json.loads(bytes(delegate.processed_bytes))["weights"].values()
    packed = Counter(math.prod(entry["shape"]) for entry in stored if entry["dtype"] == "uint8")
    assert packed[DIM * HIDDEN // 2] >= 2 and packed[DIM * VOCAB // 2] >= 1, packed
    large_int8 = [entry["shape"] for entry in stored if entry["dtype"] == "int8"
                  and math.prod(entry["shape"]) > VOCAB * DIM // 32]
    assert large_int8 == [[VOCAB, DIM]], large_int8


# --- a transformers model -------------------------------------------------------------------


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


# (config, order, the label of its linears). ONNX Runtime with Int8WeightOnlyConfig is left out: it refuses
# those linears, and AOTInductor compiles each as a part of its own.
LLAMA_CASES = [
    ("int8-dynamic", "ort+aoti", "linear 8da8w, per channel"),
    ("int8-dynamic", "ov+aoti", "linear 8da8w, per channel"),
    ("int8-weight-only", "ov+aoti", "linear 8w, per channel"),
]


@pytest.mark.parametrize("name, order, label", LLAMA_CASES, ids=[f"{n}-{o}" for n, o, _ in LLAMA_CASES])
def test_a_llama_runs_every_int8_linear_in_the_first_engine(tmp_path, name, order, label):
    """The reported case: ``Int8DynamicActivationInt8WeightConfig`` on a Llama, ONNX Runtime first. ONNX
    Runtime took the float ops around each ``_int_mm`` and left the rest, alternating with AOTInductor
    several times a layer; now it takes every linear whole, on MatMulInteger, and the model in one part.
    OpenVINO too, each linear over int8 weights (attention's output projection reads rows flattened
    from heads, which its rewrite must not look through)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    problem = missing_engine(order)
    if problem is not None:
        pytest.skip(problem)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Logits(LlamaForCausalLM(config).eval())
    quantize_(model, CONFIGS[name].linear())
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (ids,)}), ORDERS[order][0]())
    held = engine_labels(lowered)
    first = ORDERS[order][1]
    # Seven linears a layer and the head.
    assert held == {first: Counter({label: 2 * 7 + 1})}, held
    assert [delegate.backend_id for delegate in lowered.delegates("forward")] == [first]
    lowered.save(tmp_path / "llama.pt2")
    got = aotstack.load(tmp_path / "llama.pt2").forward(ids)
    if CONFIGS[name].dynamic:
        # torchao's rounding, repeated; but a norm or attention summed in another order can tip an
        # activation across a rounding boundary, one int8 step (under 1% of its row's range).
        assert (got - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


def test_one_token_through_aotinductor_reads_each_kind_of_intx_weight_right(tmp_path):
    """A decode step (one row): AOTInductor reduces over integer weights (``FewRowsProductAsReductionPass``).

    One model carries four kinds of layer, so one compile covers them: an int4 embedding, int4 in groups with
    activations quantized as it runs (``up``), ``Int8WeightOnlyConfig``'s product over a cast of
    int8 weights (``down``), and ``Int8DynamicActivationInt8WeightConfig``'s ``_int_mm`` with a
    bias (``head``), which plain AOTInductor computes wrongly at one row (``IntMmRowMajorPass``).
    """
    torch.manual_seed(0)
    model = Tiny().eval()
    quantize_(model, int4_rows(), filter_fn=lambda module, fqn: fqn == "embed")
    quantize_(model, CONFIGS["8da4w-g32"].linear(), filter_fn=lambda module, fqn: fqn == "up")
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: fqn == "down")
    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda module, fqn: fqn == "head")
    token = IDS[:, :1]
    with torch.no_grad():
        expected = model(token)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (token,)}), [aotstack.AotiCpuPartitioner()])
    lowered.save(tmp_path / "one-token.pt2")

    output = aotstack.load(tmp_path / "one-token.pt2").forward(token)

    assert {delegate.backend_id for delegate in lowered.delegates("forward")} == {"aoti_cpu"}
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    # The int4 table and ``up``'s weight are read from words of eight values each, their scales stored per 16
    # columns, as each slot of DIM // 8 holds half a group of 32 (``packed_weights.py``).
    (delegate,) = lowered.delegates("forward")
    entries = json.loads(bytes(delegate.processed_bytes))["weights"].values()
    stored = [(entry["dtype"], entry["shape"]) for entry in entries]
    assert not [shape for dtype, shape in stored if dtype == "uint8"], stored
    assert all(entry in stored for entry in [("float32", [HIDDEN, DIM // 8]), ("float32", [VOCAB, DIM // 8]),
                                             ("float32", [HIDDEN, DIM // 16]), ("float32", [VOCAB, DIM // 16])])


@pytest.mark.parametrize("name", ["int8-weight-only", "8da4w-g32"])
def test_quantized_weights_that_ask_for_gradients_export(name):
    """transformers loads a torchao checkpoint's weights as parameters asking for gradients; unwrapping their
    integer parts failed ("Only Tensors of floating point and complex dtype can require gradients")."""
    torch.manual_seed(0)
    model = Tiny().eval()
    quantize_(model, CONFIGS[name].linear())
    for module in (model.up, model.down, model.head):
        module.weight = torch.nn.Parameter(module.weight, requires_grad=True)

    program = aotstack.export(model, {"forward": (IDS,)})

    assert model.up.weight.requires_grad, "the caller's model keeps its parameters as they were"
    with torch.no_grad():
        torch.testing.assert_close(program.methods["forward"].module()(IDS), model(IDS))


class TwoMethods(Tiny):
    """``forward``, and ``hidden``, which reads the embedding and ``up`` alone (as Whisper's ``decode`` reads none
    of its encoder's weights)."""

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(self.embed(ids)))


def test_a_method_that_reads_some_quantized_weights_lowers_with_every_engine_first(tmp_path):
    """Unwrapping torchao's weights left each one the method never read in its program, whole and under no
    input; fingerprinting the program (XNNPACK's claims) read them and failed."""
    problem = missing_engine("xnnpack+aoti")
    if problem is not None:
        pytest.skip(problem)
    torch.manual_seed(0)
    model = TwoMethods().eval()
    quantize_(model, CONFIGS["8da4w-g32"].linear())
    # Traced by TorchDynamo, as aotstack exports an encoder-decoder's halves.
    program = aotstack.export(model, {"forward": (IDS,), "hidden": (IDS,)}, strict=True)
    hidden = program.methods["hidden"]
    named = {spec.target for spec in hidden.graph_signature.input_specs}
    assert set(hidden.state_dict) <= named, "a weight the program holds is one its signature names"

    lowered = aotstack.lower(program, ORDERS["xnnpack+aoti"][0]())
    lowered.save(tmp_path / "two.pt2")
    loaded = aotstack.load(tmp_path / "two.pt2")
    with torch.no_grad():
        for method in ("forward", "hidden"):
            expected = getattr(model, method)(IDS)
            got = getattr(loaded, method)(IDS)
            assert (got - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
