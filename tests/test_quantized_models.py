"""torchao-quantized ``transformers`` models through every engine order: lowered, saved, run in a fresh process.

Each scheme quantizes a decoder (Llama) and an encoder (BERT) with ``aotstack.quantize``; every
engine order lowers it; one child process per model and scheme loads every file and runs it.
The eager quantized model is the reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from tests import hf_models
from tests.conftest import run_child
from tests.test_real_models import RUN_CORPUS

# scheme id -> (linear scheme, embedding scheme); together they cover all four linear and both embedding schemes.
SCHEMES: dict[str, tuple[str, str | None]] = {
    "8w": ("8w", "8w"),
    "8da8w": ("8da8w", None),
    "4w": ("4w", "4w"),
    "8da4w": ("8da4w", "4w"),
}
MODELS = ("llama", "bert")
LOWERINGS: dict[str, Callable[[], list[aotstack.Partitioner] | str]] = {
    "aoti": lambda: [aotstack.AotiCpuPartitioner()],
    "ort+aoti": lambda: [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()],
    "ov+aoti": lambda: [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()],
    "xnnpack+aoti": lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()],
    "auto": lambda: "auto",
}
# auto lowers and times every engine's plan, the orders above, again: one scheme shows it picks among them.
AUTO_SCHEMES = ("8da4w",)
# XNNPACK takes 8da4w linears (and per-channel 8da8w), and refuses weight-only and grouped int8 ones
# to the next engine (test_xnnpack.py checks those refusals); each lowering costs 10 to 20
# AOTInductor compiles between its parts, so the suite runs the scheme it is for.
XNNPACK_SCHEMES = ("8da4w",)
FIRST_ENGINE = {"ort+aoti": "onnxruntime", "ov+aoti": "openvino", "xnnpack+aoti": "xnnpack"}


@dataclass
class QuantizedRun:
    """One model and scheme through every lowering: eager outputs, and what each file computed."""

    float_outputs: list[torch.Tensor]
    eager_outputs: list[torch.Tensor]
    outputs: dict[str, list[torch.Tensor]]
    errors: dict[str, str]
    quantized: dict[str, dict[str, int]]
    engines: dict[str, set[str]]
    # The engines whose delegates hold quantized layers, by lowering.
    quantizing: dict[str, set[str]]


def quantized_model(name: str, scheme: str) -> torch.nn.Module:
    linear, embedding = SCHEMES[scheme]
    return aotstack.quantize(hf_models.build(name), linear=linear, embedding=embedding, group_size=32)


def leaves(value: object) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


@pytest.fixture(scope="session")
def quantized_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], QuantizedRun]:
    done: dict[tuple[str, str], QuantizedRun] = {}

    def run(name: str, scheme: str) -> QuantizedRun:
        if (name, scheme) in done:
            return done[name, scheme]
        directory = tmp_path_factory.mktemp(f"quantized-{name}-{scheme}")
        inputs = hf_models.example_inputs(name)
        with torch.no_grad():
            float_outputs = leaves(hf_models.build(name)(*inputs))
            model = quantized_model(name, scheme)
            eager_outputs = leaves(model(*inputs))
        program = aotstack.export(model, {"forward": inputs})
        result = QuantizedRun(float_outputs, eager_outputs, {}, {}, {}, {}, {})
        jobs = []
        for lowering, partitioners in LOWERINGS.items():
            if not lowering_applies(lowering, scheme):
                continue
            try:
                lowered = aotstack.lower(program, partitioners())
                path = directory / f"{lowering}.pt2"
                lowered.save(path)
            except aotstack.AotstackError as exc:
                result.errors[lowering] = f"{type(exc).__name__}: {exc}"
                continue
            report = lowered.report().method("forward")
            result.engines[lowering] = {share.engine for share in report.engines if share.ops}
            result.quantized[lowering] = {}
            result.quantizing[lowering] = {delegate.engine for delegate in report.delegates if delegate.quantized}
            for delegate in report.delegates:
                for label, count in delegate.quantized.items():
                    result.quantized[lowering][label] = result.quantized[lowering].get(label, 0) + count
            jobs.append(json.dumps([name, str(path), str(directory / f"{lowering}.out")]))
        run_child(RUN_CORPUS, stdin="\n".join(jobs))
        for lowering in filter(lambda lowering: lowering_applies(lowering, scheme), LOWERINGS):
            out = directory / f"{lowering}.out"
            if Path(f"{out}.error").exists():
                result.errors[lowering] = Path(f"{out}.error").read_text()
            elif lowering not in result.errors:
                result.outputs[lowering] = torch.load(out, weights_only=True)
        done[name, scheme] = result
        return result

    return run


def lowering_applies(lowering: str, scheme: str) -> bool:
    if lowering == "xnnpack+aoti":
        return executorch_problem() is None and scheme in XNNPACK_SCHEMES
    return lowering != "auto" or scheme in AUTO_SCHEMES


def expected_layers(name: str, scheme: str) -> dict[str, int]:
    """The quantized layers the report should count: every linear, and the embeddings where quantized.

    A group as wide as a layer's input is one scale per output channel, and is labelled so.
    """
    counts: dict[str, int] = {}
    kinds = zip(("linear", "embedding"), SCHEMES[scheme], (torch.nn.Linear, torch.nn.Embedding))
    for kind, quantized, module_type in kinds:
        for module in hf_models.build(name).modules():
            if quantized is not None and isinstance(module, module_type):
                grouping = "per channel" if module.weight.shape[-1] == 32 else "group 32"
                label = f"{kind} {quantized}, {grouping}"
                counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))


@pytest.mark.parametrize("lowering", list(LOWERINGS))
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("name", MODELS)
def test_quantized_model_matches_eager_from_a_fresh_process(quantized_runs, name, scheme, lowering):
    if lowering == "xnnpack+aoti" and executorch_problem() is not None:
        pytest.skip(executorch_problem())
    if not lowering_applies(lowering, scheme):
        tried = AUTO_SCHEMES if lowering == "auto" else XNNPACK_SCHEMES
        pytest.skip(f"{lowering} is tried on {', '.join(tried)} (see AUTO_SCHEMES, XNNPACK_SCHEMES)")
    run = quantized_runs(name, scheme)
    assert lowering not in run.errors, run.errors[lowering]
    outputs = run.outputs[lowering]
    assert [tuple(t.shape) for t in outputs] == [tuple(t.shape) for t in run.eager_outputs]
    for got, eager, float_ in zip(outputs, run.eager_outputs, run.float_outputs):
        difference = (got - eager).abs().max().item()
        scale = eager.abs().max().item()
        if SCHEMES[scheme][0].startswith("8da"):
            # An engine quantizes activations with its own arithmetic and grouping (per block of a
            # row, not per row): an activation may land one int8 step, under 1/127 of its row's
            # range, from torchao's. That stays well inside what quantizing moved the model, or
            # under 1% of the outputs' range where quantizing 8-bit moved it less than that.
            moved = (eager - float_).abs().max().item()
            assert difference <= max(0.25 * moved, 1e-2 * scale) + 1e-5, (difference, moved, scale)
        else:
            assert difference <= 1e-4 * scale + 1e-5, (difference, scale)
    if lowering in FIRST_ENGINE:
        assert FIRST_ENGINE[lowering] in run.engines[lowering]
    # Every quantized layer was compiled by some engine, and the report counts it.
    assert run.quantized[lowering] == expected_layers(name, scheme)
    if lowering == "xnnpack+aoti" and scheme == "8da4w":
        assert "xnnpack" in run.quantizing[lowering], "XNNPACK's dynamic-quant kernels take the 8da4w linears"


def test_quantize_names_what_it_supports() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    with pytest.raises(aotstack.QuantizationError, match="supported: 8w, 8da8w, 4w, 8da4w"):
        aotstack.quantize(model, linear="int4")
    with pytest.raises(aotstack.QuantizationError, match="supported: 8w, 4w"):
        aotstack.quantize(model, embedding="8da4w")
    with pytest.raises(aotstack.QuantizationError, match="group_size must be a non-negative int"):
        aotstack.quantize(model, linear="8w", group_size=-1)
    assert type(model[0].weight) is torch.nn.Parameter, "a refused call changes nothing"


def test_quantize_names_the_layer_a_group_size_does_not_fit() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 48))
    with pytest.raises(aotstack.QuantizationError, match=r"group_size 32 does not divide .*1 \[48, 8\]"):
        aotstack.quantize(model, linear="8da4w")
    assert type(model[0].weight) is torch.nn.Parameter, "a refused call changes nothing"
    aotstack.quantize(model, linear="8da4w", group_size=0)
    assert type(model[1].weight) is not torch.nn.Parameter


class PooledAttention(torch.nn.Module):
    """A query attending over a sequence through ``nn.MultiheadAttention``, as SigLIP's pooling head does."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(32, 32)
        self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.query = torch.nn.Parameter(torch.randn(1, 1, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        return self.attention(self.query.expand(x.shape[0], -1, -1), x, x)[0]


@pytest.mark.parametrize("scheme", ["8w", "8da4w"])
def test_quantize_leaves_multihead_attentions_output_projection_float(scheme: str) -> None:
    """``nn.MultiheadAttention`` reads its output projection's weight as a plain tensor: quantized, it failed."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = PooledAttention().eval()
    aotstack.quantize(model, linear=scheme)
    assert type(model.project.weight) is not torch.nn.Parameter
    assert type(model.attention.out_proj.weight) is torch.nn.Parameter
    with torch.no_grad():
        assert model(torch.randn(2, 5, 32)).shape == (2, 1, 32)


def wide_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(512, 256), torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    ).eval()


def test_quantized_weights_stay_integers_in_the_file(tmp_path) -> None:
    """The plan's weights are torchao's int8 tensors, not float copies: the file holds a quarter of the bytes."""
    ids = (torch.arange(16).reshape(2, 8),)
    model = aotstack.quantize(wide_model(), linear="8w", embedding="8w", group_size=64)
    program = aotstack.export(model, {"forward": ids})
    weights = program.methods["forward"].state_dict
    integer_weights = [t for fqn, t in weights.items() if fqn.endswith("original0")]
    assert len(integer_weights) == 3 and all(t.dtype == torch.int8 for t in integer_weights)
    aotstack.lower(program, [aotstack.OpenVinoPartitioner()]).save(tmp_path / "q.pt2")
    float_program = aotstack.export(wide_model(), {"forward": ids})
    aotstack.lower(float_program, [aotstack.OpenVinoPartitioner()]).save(tmp_path / "f.pt2")
    # int8 weights and a float scale and zero point per 64: 1.1 bytes a weight where float takes 4.
    assert (tmp_path / "q.pt2").stat().st_size < 0.35 * (tmp_path / "f.pt2").stat().st_size


def test_a_translating_engine_asks_no_custom_op_of_the_loading_process(tmp_path) -> None:
    """OpenVINO translates torchao's ops: the file lists none, so loading needs no torchao import."""
    model = aotstack.quantize(hf_models.build("bert"), linear="8da4w")
    program = aotstack.export(model, {"forward": hf_models.example_inputs("bert")})
    lowered = aotstack.lower(program, [aotstack.OpenVinoPartitioner()])
    lowered.save(tmp_path / "q.pt2")
    report = aotstack.file_report(tmp_path / "q.pt2")
    assert report.custom_ops == []
    modules = run_child(
        "import json, sys, aotstack\n"
        "from tests import hf_models\n"
        f"aotstack.load({str(tmp_path / 'q.pt2')!r}).forward(*hf_models.example_inputs('bert'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao')))\n"
    )
    assert modules == []
