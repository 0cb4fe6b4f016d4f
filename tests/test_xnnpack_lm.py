"""XNNPACK on a language model as shipped: transformers' static-cache decoder, quantized ``8da4w``.

The program transformers' export wrapper gives updates its KV cache in place and holds torchao's
subclass weights, so ``aotstack.Program`` decomposes it once more before lowering; XNNPACK must
still take every quantized linear of it, and the file must generate the eager model's tokens.
"""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack.backends.xnnpack.packages import executorch_problem

pytestmark = pytest.mark.skipif(executorch_problem() is not None, reason=f"executorch: {executorch_problem()}")

from aotstack.backends.xnnpack.claims import xnnpack_answer  # noqa: E402
from aotstack.compile.quantize import quantized_layer_label  # noqa: E402
from tests.conftest import run_child  # noqa: E402
from tests.test_language_models import GENERATE_FROM_FILE, PROMPT, STEPS, token_by_token  # noqa: E402

CACHE = 32
LAYERS = 1
# Per decoder layer: q, k, v, o, gate, up, down; and the LM head.
LINEARS = 7 * LAYERS + 1


def tiny_llama() -> torch.nn.Module:
    """A Llama with random weights (no download), its linears quantized ``8da4w`` in groups of 32."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return aotstack.quantize(model, linear="8da4w", group_size=32)


def decode_program(model: torch.nn.Module) -> aotstack.Program:
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    return aotstack.Program({"forward": exported})


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


def test_executorch_is_asked_about_every_quantized_linear_of_the_decode_program(model):
    # The program was decomposed twice (by transformers' export, then by ``aotstack.Program``):
    # ExecuTorch's answer must map back to this program's nodes, not to the first one's names.
    program = decode_program(model).methods["forward"]
    linears = [node for node in program.graph.nodes if (quantized_layer_label(node) or "").startswith("linear")]
    assert len(linears) == LINEARS
    answer = xnnpack_answer(program)
    assert {node.name: answer.refusal(node) for node in linears} == {node.name: None for node in linears}


@pytest.fixture(scope="module")
def lowered(model, tmp_path_factory) -> tuple[aotstack.LoweredProgram, str]:
    lowered = aotstack.lower(decode_program(model), [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()])
    path = tmp_path_factory.mktemp("xnnpack-lm") / "decode.pt2"
    lowered.save(path)
    return lowered, str(path)


def test_xnnpack_runs_every_quantized_linear_of_the_decoder(lowered):
    quantized: dict[str, dict[str, int]] = {}
    for delegate in lowered[0].delegates("forward"):
        for label, count in delegate.quantized.items():
            quantized.setdefault(delegate.backend_id, {}).setdefault(label, 0)
            quantized[delegate.backend_id][label] += count
    assert quantized == {"xnnpack": {"linear 8da4w, group 32": LINEARS}}


def test_executorch_runs_the_ops_xnnpack_leaves_between_its_own_except_the_caches(lowered):
    # XNNPACK leaves the RMS norms' mean between its linears: ExecuTorch runs it in the same
    # program. The cache updates and attention over the caches stay with AOTInductor, which
    # updates the caches in place: per layer, one XNNPACK program before the cache and one after.
    delegates = lowered[0].delegates("forward")
    ops = {engine: [set(d.ops) for d in delegates if d.backend_id == engine] for engine in ("xnnpack", "aoti_cpu")}
    assert len(ops["xnnpack"]) == LAYERS + 1
    assert any("aten.mean.dim" in part for part in ops["xnnpack"])
    assert not any({"aten.index_copy.default", "aten.scaled_dot_product_attention.default"} & part
                   for part in ops["xnnpack"])
    assert any("aten.index_copy.default" in part for part in ops["aoti_cpu"])


def test_the_file_generates_the_eager_quantized_models_tokens(model, lowered):
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
    expected = token_by_token(lambda ids, pos: eager(input_ids=ids, cache_position=pos), PROMPT, STEPS)
    tokens = run_child(GENERATE_FROM_FILE, lowered[1])
    # XNNPACK quantizes activations with its own zero points and bfloat16 group scales; on this
    # model its greedy tokens are torchao's (no near-ties among the top two logits).
    assert tokens["first"] == expected
    assert tokens["again"] == expected
