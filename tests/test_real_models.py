"""Real ``transformers`` architectures, lowered as a user would, run in a fresh process, compared with eager.

Every corpus model is lowered four times (AOTInductor alone; ONNX Runtime, OpenVINO or XNNPACK
stacked first), and all packages of one lowering are loaded and run in one child process, so the suite
pays one interpreter start per lowering, not per model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem
from aotstack.report.schema import REPORT_SCHEMA
from tests import hf_models
from tests.conftest import report_corpus_line, run_child
from tests.schema_check import schema_errors

LOWERINGS: dict[str, Callable[[], list[aotstack.Partitioner]]] = {
    "aoti": lambda: [aotstack.AotiCpuPartitioner()],
    "ort+aoti": lambda: [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()],
    "ov+aoti": lambda: [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()],
    "xnnpack+aoti": lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()],
}
# XNNPACK leaves norms, rotary embeddings and masks to AOTInductor between its parts: 10 to 17
# AOTInductor compiles a language model, 14 minutes for the whole corpus here. One architecture of
# each kind it changes keeps the suite's time; `AOTSTACK_FULL_CORPUS=1` runs them all.
PARTIAL_LOWERINGS = {"xnnpack+aoti": ("llama", "bert", "resnet", "whisper")}
# The engine each stacked lowering puts first, which must run part of every model.
FIRST_ENGINE = {"ort+aoti": "onnxruntime", "ov+aoti": "openvino", "xnnpack+aoti": "xnnpack"}

RUN_CORPUS = """
import json, sys
import torch
import aotstack
# On torch 2.11 a mixture of experts' prompt still calls transformers::grouped_mm_fallback, which this
# module registers (on 2.13 the file calls no custom op).
import transformers.integrations.moe
from tests import hf_models

for line in sys.stdin:
    name, path, out = json.loads(line)
    try:
        result = aotstack.load(path).forward(*hf_models.example_inputs(name))
        torch.save(list(torch.utils._pytree.tree_leaves(result)), out)
    except Exception as exc:
        with open(out + ".error", "w") as file:
            file.write(f"{type(exc).__name__}: {exc}")
print(json.dumps("done"))
"""


@dataclass
class CorpusResult:
    engines: str
    outputs: list[torch.Tensor] | None
    error: str | None


def engines_text(lowered: aotstack.LoweredProgram) -> str:
    """``onnxruntime x3 (40 ops), aoti_cpu x4 (200 ops), 2 plain ATen op(s)``, read from the report."""
    report = lowered.report()
    errors = schema_errors(report.to_json(), REPORT_SCHEMA)
    assert not errors, errors
    method = report.method("forward")
    parts = [
        f"{share.engine} x{share.delegates} ({share.ops} ops)" for share in method.engines if share.engine != "aten"
    ]
    plain = sum(len(group.nodes) for group in method.unclaimed)
    return ", ".join(parts + ([f"{plain} plain ATen op(s)"] if plain else []))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, CorpusResult]]:
    """``corpus(lowering)``: every corpus model lowered that way, saved, then run in one fresh process."""
    done: dict[str, dict[str, CorpusResult]] = {}

    def run(lowering: str) -> dict[str, CorpusResult]:
        if lowering in done:
            return done[lowering]
        directory = tmp_path_factory.mktemp(f"corpus-{lowering.replace('+', '-')}")
        results: dict[str, CorpusResult] = {}
        jobs = []
        for name in filter(lambda name: lowered_in_suite(name, lowering), hf_models.CORPUS):
            try:
                program = aotstack.export(hf_models.build(name), {"forward": hf_models.example_inputs(name)})
                lowered = aotstack.lower(program, LOWERINGS[lowering]())
                path = directory / f"{name}.pt2"
                lowered.save(path)
            except aotstack.AotstackError as exc:
                results[name] = CorpusResult("", None, f"{type(exc).__name__}: {exc}")
                continue
            results[name] = CorpusResult(engines_text(lowered), None, None)
            jobs.append(json.dumps([name, str(path), str(directory / f"{name}.out")]))
        run_child(RUN_CORPUS, stdin="\n".join(jobs))
        for name, result in results.items():
            out = directory / f"{name}.out"
            if result.error is None and Path(f"{out}.error").exists():
                result.error = Path(f"{out}.error").read_text()
            elif result.error is None:
                result.outputs = torch.load(out, weights_only=True)
        done[lowering] = results
        return results

    return run


def lowered_in_suite(name: str, lowering: str) -> bool:
    return os.environ.get("AOTSTACK_FULL_CORPUS") == "1" or name in PARTIAL_LOWERINGS.get(lowering, (name,))


@pytest.mark.parametrize("lowering", list(LOWERINGS))
@pytest.mark.parametrize("name", list(hf_models.CORPUS))
def test_corpus_model_matches_eager_from_a_fresh_process(corpus, name, lowering, request):
    if lowering == "xnnpack+aoti" and executorch_problem() is not None:
        pytest.skip(executorch_problem())
    if not lowered_in_suite(name, lowering):
        pytest.skip(f"{lowering} runs on {', '.join(PARTIAL_LOWERINGS[lowering])} (AOTSTACK_FULL_CORPUS=1: all)")
    result = corpus(lowering)[name]
    report_corpus_line(
        request.node,
        f"{name:<10} {hf_models.CORPUS[name].kind:<26} {lowering:<9} "
        + (f"FAILED: {result.error.splitlines()[0][:80]}" if result.error else result.engines)
    )
    assert result.error is None, result.error

    with torch.no_grad():
        expected = torch.utils._pytree.tree_leaves(hf_models.build(name)(*hf_models.example_inputs(name)))
    assert len(result.outputs) == len(expected)
    for got, want in zip(result.outputs, expected, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if lowering == "aoti":
        assert re.fullmatch(r"aoti_cpu x1 \(\d+ ops\)", result.engines), "AOTInductor alone takes the whole model"
    else:
        assert FIRST_ENGINE[lowering] in result.engines


# torch 2.11's export cannot keep a mixture of experts' length dynamic: the experts' routing leaves a guard it cannot
# prove for every length (min(8*length, 16*length) == 8*length: "Constraints violated"), for plain torch.export too.
DYNAMIC_MOE_EXPORT = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
NO_DYNAMIC_MOE_EXPORT = "torch.export before 2.13 cannot keep a mixture of experts' length dynamic"


@pytest.mark.parametrize("first", ["ort+aoti", "ov+aoti"])
def test_a_mixture_of_experts_with_dynamic_batch_and_length_matches_eager_at_other_sizes(tmp_path, first):
    if not DYNAMIC_MOE_EXPORT:
        pytest.skip(NO_DYNAMIC_MOE_EXPORT)
    # The experts' linears read tokens flattened (batch * length) by the engine first; AOTInductor takes the
    # grouped matmul that engine declines, with no input sized by batch or length alone.
    model = hf_models.build("mixtral")
    batch, length = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("length", min=2, max=16)
    program = aotstack.export(model, {"forward": hf_models.example_inputs("mixtral")},
                              dynamic_shapes={"forward": (({0: batch, 1: length},),)})
    lowered = aotstack.lower(program, LOWERINGS[first]())
    assert FIRST_ENGINE[first] in engines_text(lowered) and "aoti_cpu" in engines_text(lowered)
    lowered.save(tmp_path / "moe.pt2")

    loaded = aotstack.load(tmp_path / "moe.pt2")
    with torch.no_grad():
        for rows, tokens in ((1, 2), (3, 11), (4, 16)):
            ids = hf_models.tokens(rows, tokens)
            for got, want in zip(loaded.forward(ids), model(ids), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def mixtral_base_model() -> torch.nn.Module:
    import transformers

    from tests import hf_folders

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**hf_folders.TEXT, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralModel(config).eval()


def test_a_decoder_base_model_exported_for_its_features_returns_them_alone(tmp_path):
    if not DYNAMIC_MOE_EXPORT:
        pytest.skip(NO_DYNAMIC_MOE_EXPORT)
    from tests import hf_folders

    model = mixtral_base_model()
    assert model.config.use_cache, "the model's own forward returns its cache"
    folder = hf_folders.saved(model, tmp_path / "mixtral")
    hf_folders.export_hf(str(folder), "-o", str(tmp_path / "out"), "--task", "feature-extraction",
                         "--engines", "ov,aoti")

    loaded = aotstack.load(tmp_path / "out" / "model.pt2")
    with torch.no_grad():
        for rows, tokens in ((2, 8), (1, 3), (3, 13)):
            ids = hf_models.tokens(rows, tokens, vocab=hf_folders.VOCAB)
            got = loaded.forward(ids, torch.ones_like(ids))
            assert list(got.keys()) == ["last_hidden_state"], "no layer's keys and values beside the features"
            torch.testing.assert_close(got.last_hidden_state, model(ids, torch.ones_like(ids)).last_hidden_state,
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("engines", ["ov,aoti", "xnnpack,aoti"])
def test_a_decoder_base_models_forward_with_its_cache_on_matches_eager(tmp_path, engines):
    # Its DynamicCache's keys start from torch.tensor([]) (OpenVINO refused the concatenation), and views left to
    # plain ATen read delegates' outputs laid out otherwise than eager's (XNNPACK first: the file failed at its
    # first call).
    if engines.startswith("xnnpack") and executorch_problem() is not None:
        pytest.skip(executorch_problem())
    if not DYNAMIC_MOE_EXPORT:
        pytest.skip(NO_DYNAMIC_MOE_EXPORT)
    from transformers.exporters.auto import get_exporter_class

    from aotstack.integrations.transformers import AotstackConfig
    from tests import hf_folders

    model = mixtral_base_model()
    ids = hf_models.tokens(2, 8, vocab=hf_folders.VOCAB)
    batch, length = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("length", min=2, max=32)
    exporter = get_exporter_class("aotstack")(progress=False)
    exported = exporter.export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, AotstackConfig(
        engines=engines, dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}))
    exported.save_pretrained(tmp_path / "out")

    loaded = aotstack.load(tmp_path / "out" / "model.pt2")
    with torch.no_grad():
        for rows, tokens in ((2, 8), (1, 3), (3, 13)):
            ids = hf_models.tokens(rows, tokens, vocab=hf_folders.VOCAB)
            got = torch.utils._pytree.tree_leaves(loaded.forward(ids, torch.ones_like(ids)))
            want = torch.utils._pytree.tree_leaves(model(ids, torch.ones_like(ids)))
            assert len(got) == len(want) > 1, "the features and every layer's keys and values"
            for got_leaf, want_leaf in zip(got, want, strict=True):
                torch.testing.assert_close(got_leaf, want_leaf, rtol=1e-4, atol=1e-5)
