"""ExecuTorch's XNNPACK delegate as an engine: real lowerings and runs, compared with eager PyTorch in a fresh process.

Stacked in several orders with AOTInductor, ONNX Runtime and OpenVINO; torchao-quantized
linears (``8da4w``, ``8da8w``) reaching XNNPACK's quantized kernels, and the ones it leaves
(weight-only, grouped int8) left to the next engine; the partitioner's reasons; weights stored
once across methods, packed; the errors of each side. Every lowering is made once per session.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.engine.registry import BUILT_IN

pytestmark = pytest.mark.skipif(executorch_problem() is not None, reason=str(executorch_problem()))

from aotstack.backends.xnnpack import run as xnn_run  # noqa: E402
from aotstack.compile.program_parts import node_tensors  # noqa: E402
from aotstack.format.archive import read_manifest  # noqa: E402
from aotstack.format.tensor_data import content_key, tensor_bytes  # noqa: E402
from tests import models  # noqa: E402
from tests.conftest import assert_matches_eager, run_child, run_in_fresh_process  # noqa: E402
from tests.test_stacked_end_to_end import plain_ops  # noqa: E402

# Lowerings of the "stacked" model (linear, gelu, layer_norm, linear, tanh, mul, slice, add), by name:
# the partitioners in order, and the engines that must end up with a delegate. AOTInductor closing
# claims lone ops too (min_block_size=1), so every op has an engine and each engine a delegate.
ORDERS = {
    "xnnpack-aoti": (
        lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner(min_block_size=1)], {"xnnpack", "aoti_cpu"}
    ),
    "aoti-xnnpack": (
        lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear"]), aotstack.XnnpackPartitioner()],
        {"xnnpack", "aoti_cpu"},
    ),
    "ort-xnnpack-aoti": (
        lambda: [
            aotstack.OrtPartitioner(ops=["aten.linear"]),
            aotstack.XnnpackPartitioner(),
            aotstack.AotiCpuPartitioner(min_block_size=1),
        ],
        {"onnxruntime", "xnnpack", "aoti_cpu"},
    ),
    "xnnpack-ov": (lambda: [aotstack.XnnpackPartitioner(), aotstack.OpenVinoPartitioner()], {"xnnpack", "openvino"}),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_xnnpack_stacked_in_any_order_matches_eager_from_a_fresh_process(lowered_with, order):
    make, engines = ORDERS[order]
    lowered, path = lowered_with("stacked", f"xnnpack-{order}", make)

    assert {d.backend_id for d in lowered.delegates("forward")} == engines
    assert plain_ops(lowered) == [], "every op is claimed by one engine or another"
    assert_matches_eager(run_in_fresh_process(path, "forward", "stacked"), "stacked")


def test_xnnpack_takes_what_the_earlier_engine_left(lowered_with):
    lowered, _ = lowered_with("stacked", "xnnpack-aoti-xnnpack", ORDERS["aoti-xnnpack"][0])
    by_backend: dict[str, set[str]] = {}
    for delegate in lowered.delegates("forward"):
        by_backend.setdefault(delegate.backend_id, set()).update(delegate.ops)
    assert by_backend["xnnpack"] == {"aten.linear.default"}
    assert "aten.linear.default" not in by_backend["aoti_cpu"]


class QuantizedMlp(torch.nn.Module):
    """Token embeddings and two linears: what ExecuTorch's LLM export quantizes."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 64)
        self.up = torch.nn.Linear(64, hidden)
        self.down = torch.nn.Linear(hidden, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(ids))))


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

# Quantization (linear, embedding, group size) -> the partitioners it is lowered with, and
# whether XNNPACK takes its linears. XNNPACK takes the dynamically quantized linears; it leaves
# weight-only ones and grouped int8 ones (ExecuTorch 1.5.1 miscomputes or refuses them) to
# AOTInductor, and never takes an embedding.
QUANTIZED = {
    "8da4w": (("8da4w", None, 32), True),
    "8da8w-per-channel": (("8da8w", None, 0), True),
    "8da4w-embedding-4w": (("8da4w", "4w", 32), True),
    "8w": (("8w", None, 32), False),
    "8da8w-group": (("8da8w", None, 32), False),
}

# A lowering of a quantized model, the eager quantized model's answer, and where the fresh process wrote its answer.
Quantized = tuple[aotstack.LoweredProgram, torch.Tensor, Path]

RUN_FILES = """
import json, sys
import torch
import aotstack

for line in sys.stdin:
    path, inputs, out = json.loads(line)
    torch.save(aotstack.load(path).forward(*torch.load(inputs, weights_only=True)), out)
print(json.dumps("done"))
"""


@pytest.fixture(scope="session")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Quantized]:
    """Each QUANTIZED lowering, saved, with the eager quantized model's answer and the answer from a fresh process."""
    directory = tmp_path_factory.mktemp("xnnpack-quantized")
    torch.save((IDS,), directory / "inputs.pt")
    built, jobs = {}, []
    for name, ((linear, embedding, group_size), _) in QUANTIZED.items():
        model = aotstack.quantize(QuantizedMlp().eval(), linear=linear, embedding=embedding, group_size=group_size)
        with torch.no_grad():
            expected = model(IDS)
        lowered = aotstack.lower(
            aotstack.export(model, {"forward": (IDS,)}), [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()]
        )
        path = directory / f"{name}.pt2"
        lowered.save(path)
        built[name] = (lowered, expected, directory / f"{name}.out")
        jobs.append(json.dumps([str(path), str(directory / "inputs.pt"), str(directory / f"{name}.out")]))
    run_child(RUN_FILES, stdin="\n".join(jobs))
    return built


def quantized_tolerance(expected: torch.Tensor) -> dict[str, float]:
    """How far XNNPACK's quantized kernels may be from torchao's eager reference.

    XNNPACK stores a 4-bit linear's group scales in bfloat16 (a relative rounding of up to
    2**-9 per scale) and quantizes activations with its own zero points, so an output can move
    by a few of the activations' int8 steps: measured, 0.4% of the largest output. 2% of it
    leaves room and still catches a wrong kernel, which misses by orders of magnitude.
    """
    return {"atol": 0.02 * float(expected.abs().max()), "rtol": 0.0}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_models_match_their_eager_answers_from_a_fresh_process(quantized, name):
    lowered, expected, out = quantized[name]
    _, xnnpack_takes_linears = QUANTIZED[name]
    taken = {op for d in lowered.delegates("forward") if d.backend_id == "xnnpack" for op in d.ops}
    assert ("aten.linear.default" in taken) == xnnpack_takes_linears
    if xnnpack_takes_linears:
        assert {"torchao.dequantize_affine.default", "torchao.quantize_affine.default"} <= taken
    assert "aten.embedding.default" not in taken
    got = torch.load(out, weights_only=True)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if xnnpack_takes_linears:
        torch.testing.assert_close(got, expected, **quantized_tolerance(expected))
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_quantized_linear_stays_packed_in_the_file(quantized):
    lowered, _, _ = quantized["8da4w"]
    [delegate] = [d for d in lowered.delegates("forward") if d.backend_id == "xnnpack"]
    sizes = sorted(len(blob) for name, blob in delegate.named_data.items() if name.startswith(xnn_run.DATA_PREFIX))
    model = QuantizedMlp()
    # Two 4-bit weights a byte: each linear's weight takes half a byte per element.
    for linear in (model.up, model.down):
        assert linear.weight.numel() // 2 in sizes
    assert max(sizes) == max(model.up.weight.numel(), model.down.weight.numel()) // 2
    assert len(delegate.named_data[xnn_run.PROGRAM_NAME]) < 64 * 1024, "the program holds no weights"


def test_weights_are_stored_once_across_methods(lowered_with):
    lowered, path = lowered_with(
        "shared", "xnnpack-alone", lambda: [aotstack.XnnpackPartitioner()], methods=("forward", "score")
    )
    encoder = models.build("shared").encoder.weight
    key = content_key(tensor_bytes(encoder))
    readers = [
        d for method in ("forward", "score") for d in lowered.delegates(method)
        if key in {content_key(blob) for blob in d.named_data.values()}
    ]
    assert {d.backend_id for d in readers} == {"xnnpack"} and len(readers) == 2
    for delegate in readers:
        assert len(delegate.named_data[xnn_run.PROGRAM_NAME]) < encoder.numel() * 4 // 100
    manifest = read_manifest(path)
    stored = [k for method in manifest.methods.values() for d in method.delegates for k in d.named_data.values()]
    assert stored.count(key) == 2, "two delegates name the encoder's weight, one blob holds it"
    assert_matches_eager(run_in_fresh_process(path, "score", "shared"), "shared", "score")


class Declined(torch.nn.Module):
    """A weight-only quantized linear and ops XNNPACK has no kernel for."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.relu(self.linear(x)).cumsum(0), torch.median(x)


def test_the_partitioner_says_why_it_leaves_each_op():
    model = aotstack.quantize(Declined().eval(), linear="8w", group_size=32)
    exported = aotstack.export(model, {"forward": (torch.randn(4, 64),)}).methods["forward"]
    # Every part is kept, however light beside the linears XNNPACK refuses: this asks why each op is refused.
    result = aotstack.XnnpackPartitioner(min_island_work=0).partition(exported)
    ops = {node.name: str(node.target) for node in exported.graph.nodes}
    reasons = {ops[name]: f"{reason.kind}: {reason.detail}" for name, reason in result.refusals.items()}

    assert reasons["aten.linear.default"].startswith(
        "unsupported: XNNPACK's quantized kernels take only 8da4w and per-channel 8da8w linears and compute this "
        "one (linear 8w, group 32) wrongly"
    )
    assert reasons["torchao.dequantize_affine.default"].startswith(
        "unsupported: ExecuTorch's XnnpackPartitioner takes it only with the quantized op it feeds"
    )
    assert "does not delegate it" in reasons["aten.cumsum.default"]
    assert "aten.median.default" in reasons
    assert "aten.relu.default" not in reasons, "an op XNNPACK takes is claimed"
    assert all(reason.engine == "xnnpack" for reason in result.refusals.values())


def test_executorch_is_asked_once_about_a_program_partitioned_again_and_again_about_another(monkeypatch):
    from aotstack.backends.xnnpack import claims

    asked: list[str] = []
    real = claims.xnnpack_answer

    def answer(exported_program, **kwargs):
        asked.append(exported_program.graph_signature.parameters[0])
        return real(exported_program, **kwargs)

    monkeypatch.setattr(claims, "xnnpack_answer", answer)
    model, changed = models.build("linear"), models.build("linear")
    with torch.no_grad():
        changed.linear.weight.copy_(model.linear.weight + 1.0)
        changed.linear.bias.copy_(model.linear.bias)
    x = models.example_inputs("linear")
    first, again, other = (aotstack.export(m, {"forward": x}).methods["forward"] for m in (model, model, changed))

    tags = [set(aotstack.XnnpackPartitioner().partition(program).partition_tags) for program in (first, again, other)]

    # The same code and weights, exported again (auto lowers a method again once it has timed XNNPACK's parts alone),
    # are answered from memory; the same code on other weights is asked about (a weight can decide a claim).
    assert len(asked) == 2 and tags[0] == tags[1] == tags[2] != set()


def torchao_linear_configs() -> dict[str, tuple[object, str | None]]:
    """torchao configs a user may apply: (config, what XNNPACK's refusal of the linear says; None: it takes it)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    asymmetric = MappingType.ASYMMETRIC
    return {
        "2w-g32": (IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(32)), "(linear 2w, group 32)"),
        "6w-channel": (IntxWeightOnlyConfig(weight_dtype=torch.int6, granularity=PerAxis(0)),
                       "(linear 6w, per channel)"),
        "8da8w-channel-asymmetric": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0),
                                                  weight_mapping_type=asymmetric),
            "would drop this layer's zero points (linear 8da8w, per channel, asymmetric)"),
        "8da4w-g32-asymmetric": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                  weight_mapping_type=asymmetric),
            "would drop this layer's zero points (linear 8da4w, group 32, asymmetric)"),
        "8da4w-g16": (Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(16)),
                      "blocks of a multiple of 32 inputs, and this layer's are of 16 (linear 8da4w, group 16)"),
        "8da4w-channel-48": (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerAxis(0)),
            "blocks of a multiple of 32 inputs, and this layer's are of 48 (linear 8da4w, per channel)"),
        "8da4w-g32": (Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
                      None),
    }


@pytest.mark.parametrize("name", ["2w-g32", "6w-channel", "8da8w-channel-asymmetric", "8da4w-g32-asymmetric",
                                  "8da4w-g16", "8da4w-channel-48", "8da4w-g32"])
def test_xnnpack_takes_only_the_quantized_linears_its_kernels_compute_right(name):
    """ExecuTorch's partitioner claims these linears too; XNNPACK computed the refused ones 7% to 1e7x off, or
    (4-bit blocks of other than a multiple of 32 inputs) ExecuTorch failed to lower them."""
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    config, refusal = torchao_linear_configs()[name]
    # A 4-bit weight per channel is one block a row to XNNPACK: 48 inputs is no multiple of 32.
    inputs = 48 if name == "8da4w-channel-48" else 64
    model = torch.nn.Sequential(torch.nn.Linear(inputs, 64)).eval()
    quantize_(model, config)
    exported = aotstack.export(model, {"forward": (torch.randn(4, inputs),)}).methods["forward"]
    result = aotstack.XnnpackPartitioner().partition(exported)
    linear = next(node.name for node in exported.graph.nodes if node.target is torch.ops.aten.linear.default)
    if refusal is None:
        assert linear not in result.refusals and result.partition_tags
    else:
        assert result.refusals[linear].kind == "unsupported"
        assert refusal in result.refusals[linear].detail


def test_xnnpack_leaves_tensors_of_dtypes_executorch_lacks():
    """A float8 weight's transpose and cast passed ExecuTorch's partitioner, then failed its dtype checks when
    lowered; they are left to the next engine."""
    pytest.importorskip("torchao")
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
    quantize_(model, Float8WeightOnlyConfig())
    exported = aotstack.export(model, {"forward": (torch.randn(4, 64),)}).methods["forward"]
    result = aotstack.XnnpackPartitioner(min_island_work=0).partition(exported)
    float8 = [node for node in exported.graph.nodes if node.op == "call_function"
              and torch.float8_e4m3fn in {value.dtype for value in node_tensors(node)}]
    assert float8
    for node in float8:
        assert "delegation_tag" not in node.meta, node.format_node()
        assert "float8_e4m3fn tensor, which ExecuTorch has no ops for" in result.refusals[node.name].detail
    assert result.partition_tags, "the float ops around it are still XNNPACK's"


class Gapped(torch.nn.Module):
    """Two linears XNNPACK takes, a cumsum it does not take between them, and another after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(32, 32)
        self.second = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).cumsum(-1)).cumsum(-1)


@pytest.mark.parametrize(
    ("portable_kernels", "rows", "most_rows", "joined"),
    [(True, 4, None, True), (False, 4, None, False), (True, 1024, None, False),
     # Dynamic rows count at their bound: a prefill's longest prompt.
     (True, 4, 64, True), (True, 4, 1024, False)],
)
def test_ops_between_xnnpacks_parts_run_on_executorchs_portable_kernels_in_its_program(
        portable_kernels, rows, most_rows, joined):
    # 1024 rows: the cumsum reads and writes 32768 elements, too many for a plain loop to beat a boundary.
    dynamic = None if most_rows is None else {"forward": {"x": {0: torch.export.Dim("rows", max=most_rows)}}}
    exported = aotstack.export(Gapped().eval(), {"forward": (torch.randn(rows, 32),)},
                               dynamic_shapes=dynamic).methods["forward"]
    result = aotstack.XnnpackPartitioner(portable_kernels=portable_kernels).partition(exported)
    tags = {str(node.target): set() for node in exported.graph.nodes if node.op == "call_function"}
    for node in exported.graph.nodes:
        if node.op == "call_function":
            tags[str(node.target)].add(node.meta.get("delegation_tag"))

    # The cumsum between the linears joins their parts; the one after them is left to the next engine.
    assert len(result.partition_tags) == (1 if joined else 2)
    assert tags["aten.cumsum.default"] == ({*result.partition_tags, None} if joined else {None})
    left = [reason.detail for reason in result.refusals.values()]
    assert len(left) == (1 if joined else 2)
    assert all("does not delegate it" in detail for detail in left)


class TanhGeluBetweenLinears(torch.nn.Module):
    """Gemma's MLP: ``gelu(approximate="tanh")``, which XNNPACK computes as the exact GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x), approximate="tanh"))


def test_a_tanh_gelu_runs_in_xnnpacks_part_spelled_out_as_the_approximation_it_is(tmp_path):
    # ExecuTorch hands XNNPACK a tanh GELU as its exact one: 1.9e-4 of the output's range off unless spelled out.
    x = torch.randn(4, 32) * 3
    model = TanhGeluBetweenLinears().eval()
    with torch.no_grad():
        model.up.weight.mul_(4)
    program = aotstack.export(model, {"forward": (x,)})
    result = aotstack.XnnpackPartitioner().partition(program.methods["forward"])

    assert not result.refusals
    assert len(result.partition_tags) == 1
    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner()])
    [delegate] = lowered.delegates("forward")
    assert json.loads(delegate.processed_bytes)["portable_ops"] == [], "XNNPACK computes all of it"
    lowered.save(tmp_path / "gelu.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "gelu.pt2").forward(x), model(x), rtol=2e-6, atol=2e-6)


class AttentionThenTanhGelu(torch.nn.Module):
    """Gemma's layer in small: heads attended, put back side by side, projected, then a tanh GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 8, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.gelu(self.out(attended.transpose(1, 2).contiguous().reshape(2, 8, 16)),
                                        approximate="tanh")


def test_attention_followed_by_a_tanh_gelu_lowers_to_xnnpack(tmp_path):
    # Spelling out the GELU traced the part again, where the reshape of attention's output became a view, and the
    # contiguous copy put after attention then left that view on a transposed layout: "Cannot view a tensor".
    model, x = AttentionThenTanhGelu().eval(), torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()], jobs=1)
    assert {"aten.scaled_dot_product_attention.default", "aten.gelu.default"} <= {
        op for delegate in lowered.delegates("forward") for op in delegate.ops}
    lowered.save(tmp_path / "attention.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "attention.pt2").forward(x), model(x))


class RotaryOnWholeHeads(torch.nn.Module):
    """Phi-3's rotary split where the rotated part is the whole head: the part passed through has no width."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.project(x).view(2, 8, 4, 8).transpose(1, 2)
        rotated, passed = heads[..., :8], heads[..., 8:]
        turned = torch.cat([-rotated[..., 4:], rotated[..., :4]], -1)
        return self.out(torch.cat([turned, passed], -1).transpose(1, 2).reshape(2, 8, 32))


EMPTY_INPUT_RUN = """
import json, sys
import torch
import aotstack
x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
print(json.dumps(aotstack.load(sys.argv[1]).forward(x).flatten().tolist()))
"""


def test_an_empty_tensor_reaches_executorch_with_the_strides_it_expects(tmp_path):
    # torch takes an empty slice for contiguous whatever its strides; ExecuTorch's runtime aborted the process on
    # them (check_tensor_meta: "Strides don't match dim order"), so the call runs in a child.
    model, x = RotaryOnWholeHeads().eval(), torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()], jobs=1)
    lowered.save(tmp_path / "rotary.pt2")
    got = torch.tensor(run_child(EMPTY_INPUT_RUN, str(tmp_path / "rotary.pt2")))
    with torch.no_grad():
        torch.testing.assert_close(got, model(x).flatten())


class RotaryByComplexNumbers(torch.nn.Module):
    """Llama 4's rotary embedding: query pairs as complex numbers, turned by multiplying with unit ones."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(16, 16)
        self.register_buffer("turns", torch.polar(torch.ones(8, 8), torch.randn(8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(self.project(x).reshape(*x.shape[:-1], -1, 2))
        return self.project(torch.view_as_real(pairs * self.turns).flatten(-2))


def test_a_method_with_complex_numbers_lowers_xnnpack_first_and_leaves_them_to_the_next_engine(tmp_path):
    # ExecuTorch's edge passes traced the method with gradients on, which views of complex tensors refuse.
    model, x = RotaryByComplexNumbers().eval(), torch.randn(8, 16)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}),
                             [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner(min_block_size=1)])
    assert {delegate.backend_id for delegate in lowered.delegates("forward")} == {"xnnpack", "aoti_cpu"}
    lowered.save(tmp_path / "rotary.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "rotary.pt2").forward(x), model(x), rtol=1e-5, atol=1e-5)


class ReshapesOverTwoDynamicSizes(torch.nn.Module):
    """SqueezeBERT's and ConvBERT's layers over a batch and a length both dynamic: a 1-D convolution, an unsqueeze."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 8)
        self.mix = torch.nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        mixed = self.mix(h.transpose(1, 2)).transpose(1, 2)
        return self.project(mixed * h.mean(-1).unsqueeze(-1))


def test_reshapes_with_two_dynamic_sizes_are_left_to_the_next_engine(tmp_path):
    # ExecuTorch's partitioner takes them, then its lowering refuses them: XNNPACK reshapes with one dynamic size.
    model = ReshapesOverTwoDynamicSizes().eval()
    batch, length = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("length", min=2, max=32)
    program = aotstack.export(model, {"forward": (torch.randn(2, 5, 8),)},
                              dynamic_shapes={"forward": ({0: batch, 1: length},)})
    result = aotstack.XnnpackPartitioner().partition(program.methods["forward"])
    refused = {name: reason.detail for name, reason in result.refusals.items()}
    assert {name for name, detail in refused.items() if "at most one dynamic dimension" in detail} == {
        "conv1d", "unsqueeze"}
    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner(min_block_size=1)])
    lowered.save(tmp_path / "reshapes.pt2")
    loaded = aotstack.load(tmp_path / "reshapes.pt2")
    with torch.no_grad():
        for shape in ((3, 7, 8), (1, 2, 8)):
            x = torch.randn(*shape)
            torch.testing.assert_close(loaded.forward(x), model(x), rtol=1e-5, atol=1e-5)



class SumsOfRowsBySizes(torch.nn.Module):
    """Rows cut by sizes read from a tensor (``tolist``), as a vision tower splits its patches per image."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        return torch.stack([rows.sum(0) for rows in torch.split(self.project(x), sizes.tolist())])


def test_a_method_that_reads_sizes_from_its_data_lowers_xnnpack_first(tmp_path):
    # ExecuTorch's edge program for XNNPACK's partitioner left sizes it made from the data pending in the shape
    # environment the method's parts share, and every part's compile then failed on them (Pending unbacked symbols).
    model, x = SumsOfRowsBySizes().eval(), torch.randn(6, 16)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x, torch.tensor([2, 4]))}),
                             [aotstack.XnnpackPartitioner()], jobs=1)
    assert {op for delegate in lowered.delegates("forward") for op in delegate.ops} >= {"aten.linear.default"}
    lowered.save(tmp_path / "sizes.pt2")
    loaded = aotstack.load(tmp_path / "sizes.pt2")
    with torch.no_grad():
        for sizes in ([2, 4], [5, 1]):
            torch.testing.assert_close(loaded.forward(x, torch.tensor(sizes)), model(x, torch.tensor(sizes)))

class RowsRewrittenWhereChosen(torch.nn.Module):
    """A copy of a linear's output rewritten at the rows a mask chooses: the copy and the output both read on."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.rewrite = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        chosen = h[:, 0] > 0
        out = h.clone()
        out[chosen] = self.rewrite(h[chosen])
        return out


class PositivesSummed(torch.nn.Module):
    """``masked_select`` between ops XNNPACK takes: ExecuTorch's runtime has a kernel for it, its edge dialect not."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        positives = torch.masked_select(h, h > 0)
        return torch.cat([positives.sum().reshape(1), (positives * 2).max().reshape(1)])


class IntegerRemainders(torch.nn.Module):
    """Remainders of integers between linears: int64 by a number, int32 by an int64 count ATen promotes."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.mix = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = self.project(x) * 20
        wide, narrow = scaled.to(torch.int64), scaled.to(torch.int32)
        return self.mix((wide % 5).float()), self.mix((narrow % (narrow.abs().max() // 3 + 1)).float())


@pytest.mark.parametrize("model, left", [
    # XNNPACK drops the clone; its part would return the linear's output twice, which it refuses.
    (RowsRewrittenWhereChosen, "aten.clone.default"),
    (PositivesSummed, "aten.masked_select.default"),
    # ExecuTorch's portable remainder of integers takes the dividend's sign (-14 % 5 gave -4); its edge
    # dialect refuses an op on tensors of two dtypes.
    (IntegerRemainders, "aten.remainder.Scalar"),
    (IntegerRemainders, "aten.remainder.Tensor"),
])
def test_xnnpack_leaves_what_executorch_would_refuse_or_miscompute(tmp_path, model, left):
    model, x = model().eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()], jobs=1)
    taken = {op for delegate in lowered.delegates("forward") for op in delegate.ops}
    assert "aten.linear.default" in taken and left not in taken
    lowered.save(tmp_path / "model.pt2")
    with torch.no_grad():
        torch.testing.assert_close(aotstack.load(tmp_path / "model.pt2").forward(x), model(x))


def test_min_block_size_leaves_small_parts(lowered_with):
    lowered, _ = lowered_with(
        "stacked", "xnnpack-min3",
        lambda: [aotstack.XnnpackPartitioner(min_block_size=3), aotstack.AotiCpuPartitioner()],
    )
    for delegate in lowered.delegates("forward"):
        if delegate.backend_id == "xnnpack":
            assert len(delegate.ops) >= 3


def test_a_target_device_other_than_the_cpu_is_refused():
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    spec = aotstack.CompileSpec(aotstack.SpecKey.TARGET_DEVICE, b"cuda")
    with pytest.raises(aotstack.LoweringError, match="target_device"):
        aotstack.lower(program, [aotstack.XnnpackPartitioner(compile_specs=[spec])], jobs=1)


def delegate_record(lowered_with) -> aotstack.Delegate:
    lowered, _ = lowered_with("linear", "xnnpack", lambda: [aotstack.XnnpackPartitioner()])
    [delegate] = lowered.delegates("forward")
    return delegate


def test_a_malformed_delegate_is_a_package_or_init_error(lowered_with):
    delegate = delegate_record(lowered_with)
    runtime = xnn_run.XnnpackRuntime()
    processed = json.loads(delegate.processed_bytes)
    [segment, *_] = processed["segments"]
    bad = [
        b"not json",
        json.dumps({**processed, "version": 99}).encode(),
        json.dumps({k: v for k, v in processed.items() if k != "segments"}).encode(),
        json.dumps({**processed, "segments": [[segment[0], segment[1], segment[2] + 1]]}).encode(),
        json.dumps({**processed, "segments": [["weight:x", 0, 4]]}).encode(),
        json.dumps({**processed, "data_size": processed["data_size"] + 64}).encode(),
    ]
    for processed_bytes in bad:
        with pytest.raises(aotstack.PackageError):
            runtime.init(processed_bytes, delegate.named_data, delegate.compile_specs)
    named_data = {k: v for k, v in delegate.named_data.items() if k != xnn_run.PROGRAM_NAME}
    with pytest.raises(aotstack.PackageError, match="program.pte"):
        runtime.init(delegate.processed_bytes, named_data, delegate.compile_specs)
    named_data = {**delegate.named_data, xnn_run.PROGRAM_NAME: b"not a program"}
    with pytest.raises(aotstack.DelegateInitError, match="ExecuTorch could not load the program"):
        runtime.init(delegate.processed_bytes, named_data, delegate.compile_specs)


def test_a_bad_call_reaching_the_delegate_is_an_input_error(lowered_with):
    delegate = delegate_record(lowered_with)
    runtime = xnn_run.XnnpackRuntime()
    handle = runtime.init(delegate.processed_bytes, delegate.named_data, delegate.compile_specs)
    x = models.example_inputs("linear")[0]
    for bad in ([x[:2]], [x.double()], [x, x], [x.to("meta")], [3.0]):
        with pytest.raises(aotstack.InputError):
            runtime.execute(handle, bad)
    # Views a call may pass are made what ExecuTorch reads: transposed, negated, a Parameter, asking for gradients.
    model = models.build("linear")
    for view in (x.t().contiguous().t(), torch.neg(x)._neg_view(), torch.nn.Parameter(x.clone()),
                 x.clone().requires_grad_()):
        torch.testing.assert_close(runtime.execute(handle, [view])[0], model(view).detach(), rtol=1e-5, atol=1e-5)


def test_inputs_are_read_in_place_and_outputs_are_fresh(lowered_with):
    delegate = delegate_record(lowered_with)
    runtime = xnn_run.XnnpackRuntime()
    handle = runtime.init(delegate.processed_bytes, delegate.named_data, delegate.compile_specs)
    x = models.example_inputs("linear")[0]
    first = runtime.execute(handle, [x])[0]
    second = runtime.execute(handle, [x * 2])[0]
    assert first.data_ptr() != second.data_ptr(), "a later call does not overwrite an earlier output"
    model = models.build("linear")
    torch.testing.assert_close(first, model(x).detach(), rtol=1e-5, atol=1e-5)


def test_threads_calling_one_delegate_each_get_their_own_answer(lowered_with):
    _, path = lowered_with("stacked", "xnnpack-xnnpack-aoti", ORDERS["xnnpack-aoti"][0])
    loaded, model = aotstack.load(path), models.build("stacked")
    inputs = [torch.randn(4, 16) for _ in range(6)]
    results: dict[int, torch.Tensor] = {}

    def call(index: int) -> None:
        for _ in range(30):
            results[index] = loaded.forward(inputs[index])

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, x in enumerate(inputs):
        torch.testing.assert_close(results[index], model(x).detach(), rtol=1e-5, atol=1e-5)


WITHOUT_EXECUTORCH = """
import json, sys
sys.modules["executorch"] = None  # as if it were not installed
import aotstack
messages = []
try:
    aotstack.load(sys.argv[1])
except aotstack.DelegateInitError as exc:
    messages.append(str(exc))
try:
    aotstack.XnnpackPartitioner()
except aotstack.LoweringError as exc:
    messages.append(str(exc))
print(json.dumps(messages))
"""


def test_without_executorch_installed_both_sides_say_how_to_install_it(lowered_with):
    _, path = lowered_with("linear", "xnnpack", lambda: [aotstack.XnnpackPartitioner()])
    messages = run_child(WITHOUT_EXECUTORCH, str(path))
    assert len(messages) == 2
    assert all("executorch" in message and "pip install 'aotstack[xnnpack]'" in message for message in messages)


def test_xnnpack_is_a_candidate_of_auto():
    engine = BUILT_IN["xnnpack"]
    assert engine.partitioner_class() is aotstack.XnnpackPartitioner
    assert engine.devices == ("cpu",) and not engine.takes_every_op


LOAD_ONLY = """
import json, sys
import torch
import aotstack
loaded = aotstack.load(sys.argv[1])
loaded.forward(torch.ones(4, 16))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("executorch", "torch._dynamo", "torch._inductor")))))
"""


def test_loading_imports_only_executorchs_runtime(lowered_with):
    _, path = lowered_with("stacked", "xnnpack-xnnpack-aoti", ORDERS["xnnpack-aoti"][0])
    modules = run_child(LOAD_ONLY, str(path))
    assert "executorch.extension.pybindings._C" in modules
    assert not [m for m in modules if m.startswith(("executorch.exir", "torch._dynamo", "torch._inductor"))]


STDERR_OF_A_CALL = """
import json, os, sys, tempfile, torch
caught = tempfile.TemporaryFile()
os.dup2(caught.fileno(), 2)
import aotstack
from tests import models
torch.set_num_threads(1)
aotstack.load(sys.argv[1]).forward(*models.example_inputs("stacked"))
os.write(2, b"a line of the caller's own\\n")
caught.seek(0)
print(json.dumps(caught.read().decode(errors="replace")))
"""


def test_a_call_prints_none_of_executorchs_notes_as_its_thread_pool_starts_or_is_resized(lowered_with):
    """ExecuTorch's C++ runtime printed six lines at the first call of every XNNPACK file ("Failed to open midr
    file ..." on an x86 machine, "Resetting threadpool to 1 threads.")."""
    _, path = lowered_with("stacked", "xnnpack-xnnpack-aoti", ORDERS["xnnpack-aoti"][0])
    stderr = run_child(STDERR_OF_A_CALL, str(path))

    assert "cpuinfo_utils.cpp" not in stderr and "threadpool.cpp" not in stderr
    assert "a line of the caller's own" in stderr


def test_only_executorchs_pool_notes_are_dropped_from_what_reaches_stderr_meanwhile(capfd):
    with xnn_run.pool_notes_dropped():
        os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\n"
                    b"another thread's line\n[threadpool.cpp:66] Resetting threadpool to 1 threads.\n")
    assert capfd.readouterr().err == "another thread's line\n"


THREAD_COUNTS = """
import gc, json, logging, sys, torch
import aotstack
from aotstack.backends.xnnpack.run import runtime_module
from tests import models

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
inputs = models.example_inputs("stacked")
torch.set_num_threads(2)
loaded = aotstack.load(sys.argv[1])
outputs = []
for threads in (2, 1, 2):
    torch.set_num_threads(threads)
    outputs.append(loaded.forward(*inputs))
kept = runtime_module()._threadpool_get_thread_count()
del loaded
gc.collect()
torch.set_num_threads(1)
again = aotstack.load(sys.argv[1]).forward(*inputs)
print(json.dumps({"same": all(torch.equal(o, outputs[0]) for o in outputs + [again]), "kept": kept,
                  "after_release": runtime_module()._threadpool_get_thread_count()}))
"""


def test_changing_torchs_thread_count_between_calls_leaves_xnnpacks_started_pool_alone(lowered_with):
    """Replacing ExecuTorch's thread pool under a started delegate crashed its next call (2 threads, then 1)."""
    make, _ = ORDERS["xnnpack-aoti"]
    _, path = lowered_with("stacked", "xnnpack-xnnpack-aoti", make)
    result = run_child(THREAD_COUNTS, str(path))

    assert result["same"]
    assert result["kept"] == 2, "the pool kept the threads its delegates started on"
    assert result["after_release"] == 1, "with those delegates released, it follows torch again"


class RepeatedBlocks(torch.nn.Module):
    """Float blocks of the same shapes, each with its own weights; a layer norm (which XNNPACK leaves) between them."""

    def __init__(self, blocks: int = 4, zero_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.ModuleList(torch.nn.Linear(96, 192) for _ in range(blocks))
        self.down = torch.nn.ModuleList(torch.nn.Linear(192, 96) for _ in range(blocks))
        if zero_first:
            torch.nn.init.zeros_(self.down[0].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down, strict=True):
            x = torch.nn.functional.layer_norm(down(torch.relu(up(x))) + x, (96,))
        return x


def lowered_blocks(model: torch.nn.Module, tmp_path: Path) -> aotstack.LoweredProgram:
    """``model`` lowered XNNPACK-first, saved, loaded and checked against eager."""
    x = torch.randn(3, 96)
    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()], progress=False)
    lowered.save(tmp_path / "blocks.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "blocks.pt2").forward(x), model(x).detach())
    return lowered


def test_a_models_repeated_layers_lower_once_each_keeping_its_own_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))

    lowered = lowered_blocks(RepeatedBlocks(), tmp_path)

    assert [record.state for record in lowered.compile_log["forward"]] == ["compiled", "cached", "cached", "cached"]
    delegates = lowered.delegates("forward")
    data = [{name for name in d.named_data if name.startswith(xnn_run.DATA_PREFIX)} for d in delegates]
    assert all(len(names) == 4 for names in data)
    assert len(set().union(*data)) == 16, "each block's partition reads its own weights"


def test_a_layer_whose_weight_a_reordering_would_leave_unchanged_is_no_template_for_the_others(tmp_path, monkeypatch):
    # The first block's zero weight reads the same however XNNPACK lays it out, so its partition cannot show
    # that XNNPACK stores that weight as it is: the second and third blocks, whose weights differ, lower with
    # ExecuTorch side by side (the second does not hold the third back), and the last is made from one of their
    # lowerings. The numbers are checked against eager.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(3, 96)
    program = aotstack.export(RepeatedBlocks(zero_first=True), {"forward": (x,)})

    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner()], progress=False, jobs=2)

    assert [r.state for r in lowered.compile_log["forward"]] == ["compiled", "compiled", "compiled", "cached"]
    lowered.save(tmp_path / "blocks.pt2")
    model = RepeatedBlocks(zero_first=True)
    torch.testing.assert_close(aotstack.load(tmp_path / "blocks.pt2").forward(x), model(x).detach())


class ScaledBlocks(torch.nn.Module):
    """Blocks of the same shapes, each scaling a linear's output by a vector of its own (a layer scale, a norm's
    weight): XNNPACK multiplies by the vector as a constant that ExecuTorch writes into the program itself, not
    into its data file."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(96, 96) / 10) for _ in range(blocks))
        self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(96)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight, scale in zip(self.weights, self.scales, strict=True):
            x = torch.nn.functional.layer_norm(torch.nn.functional.linear(x, weight) * scale, (96,))
        return x


def test_layers_whose_weights_executorch_writes_into_the_program_each_lower_with_their_own(tmp_path, monkeypatch):
    # A template of the first block's lowering would carry its scale, in the program, into every other block.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(2, 5, 96)
    model = ScaledBlocks().eval()

    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()],
                             progress=False)

    assert [r.state for r in lowered.compile_log["forward"]] == ["compiled"] * 3
    lowered.save(tmp_path / "blocks.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "blocks.pt2").forward(x), model(x).detach())


class TransposedWeightProduct(torch.nn.Module):
    """``x @ w.T`` and ``w.t()``, as Falcon's linears and hand-written layers compute them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Parameter(torch.randn(128, 64) / 8)
        self.second = torch.nn.Parameter(torch.randn(64, 128) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.first.T) @ self.second.t()


def test_a_product_by_a_weights_transpose_runs_as_xnnpacks_fully_connected_layer(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(2, 5, 64)
    model = TransposedWeightProduct().eval()

    lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [aotstack.XnnpackPartitioner()],
                             progress=False)

    [delegate] = lowered.delegates("forward")
    assert json.loads(delegate.processed_bytes)["portable_ops"] == [], "no product left to ExecuTorch's portable mm"
    lowered.save(tmp_path / "product.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "product.pt2").forward(x), model(x).detach())


class Maxima(torch.nn.Module):
    """Maxima of a linear's 4-D output: over its last dimension counted from the end, then a softmax of what is
    left (GPT-OSS's attention scores), over its second, and over its last without keeping it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.linear(x)
        stable = torch.softmax(h - h.max(-1, keepdim=True).values, dim=-1)
        return stable, h.max(1, keepdim=True).values, h.max(3).values


def test_xnnpack_takes_the_maxima_it_lowers_and_leaves_the_others(tmp_path, monkeypatch):
    # ExecuTorch's partitioner claims all three; its lowering failed on each (it reads -1 as no dimension it takes).
    # Once it took the first, the softmax after it normalized over the channels of its channels-last input: 0.5 off.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model, x = Maxima().eval(), torch.randn(1, 2, 8, 16)
    program = aotstack.export(model, {"forward": (x,)})
    graph = program.methods["forward"].graph
    maxima = [node.name for node in graph.nodes if node.target is torch.ops.aten.max.dim]
    [softmax] = [node.name for node in graph.nodes if node.target is torch.ops.aten.softmax.int]

    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner()], progress=False)

    taken = set().union(*(delegate.nodes for delegate in lowered.delegates("forward")))
    assert [name in taken for name in maxima] == [True, False, False]
    assert softmax not in taken
    lowered.save(tmp_path / "maxima.pt2")
    with torch.no_grad():
        for got, want in zip(aotstack.load(tmp_path / "maxima.pt2").forward(x), model(x), strict=True):
            torch.testing.assert_close(got, want)


class Frames(torch.nn.Module):
    """Strided convolutions over log-mel frames (``[1, frames, bins]``, as Parakeet's subsampling takes them), then a
    projection of each frame left: as many as the frames allow."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.project = torch.nn.Linear(4 * 16, 8)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv(features.unsqueeze(1)))
        return self.project(hidden.transpose(1, 2).reshape(1, hidden.shape[2], -1)) * 2


def test_an_op_over_sizes_without_an_upper_bound_is_left_to_the_next_engine(tmp_path, monkeypatch):
    # ExecuTorch plans memory for a program's largest sizes; with audio of any length (Dim.DYNAMIC) it failed to write
    # the program ("Cannot evaluate a finite upper bound", or a guard on a size it made up), failing the lowering.
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = Frames().eval()
    program = aotstack.export(model, {"forward": (torch.randn(1, 100, 32),)},
                              dynamic_shapes={"forward": {"features": {1: torch.export.Dim.DYNAMIC}}})
    exported = program.methods["forward"]
    result = aotstack.XnnpackPartitioner(min_island_work=0).partition(exported)
    ops = {node.name: str(node.target) for node in exported.graph.nodes}
    reasons = {ops[name]: reason.detail for name, reason in result.refusals.items()}
    assert "has no upper bound" in reasons["aten.conv2d.default"]
    assert "has no upper bound" in reasons["aten.linear.default"]

    # Nor rows of any number: ExecuTorch planned for the example's 4 and failed at 50 (error 0x10).
    rows = aotstack.export(Gapped().eval(), {"forward": (torch.randn(4, 32),)},
                           dynamic_shapes={"forward": {"x": {0: torch.export.Dim("rows")}}}).methods["forward"]
    gapped = aotstack.XnnpackPartitioner().partition(rows)
    assert not gapped.partition_tags
    assert {reason.detail.split(" (")[0] for name, reason in gapped.refusals.items()
            if name.startswith("linear")} == {"a size of its result"}

    lowered = aotstack.lower(program, [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()], progress=False)
    lowered.save(tmp_path / "frames.pt2")
    loaded = aotstack.load(tmp_path / "frames.pt2")
    for length in (57, 3000):
        features = torch.randn(1, length, 32)
        with torch.no_grad():
            torch.testing.assert_close(loaded.forward(features), model(features))
