"""Language models the way they are shipped: a static KV cache in buffers, token by token, from one file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.backends.aoti.filled_keys import MIN_KEYS
from aotstack.integrations.generation import PrefillDecode, export_decoder_lm
from tests.conftest import ROOT, run_child

CACHE = 32
PROMPT = [3, 7, 11]
STEPS = 16


def small_llama() -> torch.nn.Module:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def token_by_token(step, prompt: list[int], steps: int) -> list[int]:
    """Greedy generation feeding one token per call, as transformers' own export helper does."""
    logits, position, generated = None, 0, []
    with torch.no_grad():
        for token in prompt:
            logits = step(torch.tensor([[token]]), torch.tensor([position]))
            position += 1
        for _ in range(steps):
            generated.append(int(logits[0, -1].argmax()))
            logits = step(torch.tensor([[generated[-1]]]), torch.tensor([position]))
            position += 1
    return generated


GENERATE_FROM_FILE = """
import json, sys
import torch
import aotstack
from tests.test_language_models import PROMPT, STEPS, token_by_token

loaded = aotstack.load(sys.argv[1])
first = token_by_token(lambda ids, pos: loaded.forward(input_ids=ids, cache_position=pos), PROMPT, STEPS)
loaded.reset()
again = token_by_token(lambda ids, pos: loaded.forward(ids, pos), PROMPT, STEPS)
print(json.dumps({"first": first, "again": again}))
"""


def test_static_cache_lm_from_transformers_wrapper_generates_eager_tokens(tmp_path):
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = small_llama()
    # Long enough that AOTInductor's attention reads only the cache's filled keys (filled_keys.py).
    cache = MIN_KEYS
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=cache).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.AotiCpuPartitioner()])
    [delegate] = lowered.delegates("forward")
    assert delegate.backend_id == "aoti_cpu"
    # The KV cache is the delegate's own state, updated in place; the one-element lengths stay inputs.
    assert {"key_cache_0", "value_cache_1"} <= set(delegate.updated_buffers)
    assert "cumulative_length_0" not in delegate.updated_buffers
    path = tmp_path / "lm.pt2"
    lowered.save(path)

    # The same wrapper, eager: its inner module is what export traced (the outer one drops cache_position).
    eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=cache).model
    expected = token_by_token(lambda ids, pos: eager(input_ids=ids, cache_position=pos), PROMPT, STEPS)

    tokens = run_child(GENERATE_FROM_FILE, str(path))
    assert tokens["first"] == expected
    assert tokens["again"] == expected, "reset() puts the KV cache back to its saved state"


def decoder_lm_example():
    spec = importlib.util.spec_from_file_location("decoder_lm", ROOT / "examples" / "decoder_lm.py")
    module = importlib.util.module_from_spec(spec)
    # TorchDynamo (export with strict=True) looks a traced function's module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


PREFILL_AND_GENERATE = """
import json, sys
import torch
import aotstack
from tests.test_language_models import decoder_lm_example

example = decoder_lm_example()
loaded = aotstack.load(sys.argv[1])
prompts = json.loads(sys.argv[2])
logits = []
for prompt in prompts:
    loaded.reset()
    logits.append(loaded.prefill(torch.tensor([prompt])).flatten().tolist())
loaded.reset()
tokens = example.greedy_decoder(loaded, prompts[0], 16)
try:
    loaded.prefill(torch.zeros(1, int(sys.argv[3]), dtype=torch.long))
    error = None
except aotstack.InputError as exc:
    error = str(exc)
print(json.dumps({"logits": logits, "tokens": tokens, "error": error}))
"""


@pytest.fixture(scope="module")
def two_method_lm(tmp_path_factory) -> tuple[aotstack.LoweredProgram, Path]:
    example = decoder_lm_example()
    program = example.export_decoder_lm(example.small_llama(), CACHE)
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()])
    path = tmp_path_factory.mktemp("lm") / "prefill_decode.pt2"
    lowered.save(path)
    return lowered, path


def test_prefill_and_decode_share_weights_and_cache_in_one_file(two_method_lm):
    example = decoder_lm_example()
    lowered, path = two_method_lm
    prompts = [[5, 17, 42], [9, 1, 4, 4, 30, 2, 8]]
    result = run_child(PREFILL_AND_GENERATE, str(path), json.dumps(prompts), str(CACHE + 1))

    for prompt, got in zip(prompts, result["logits"], strict=True):
        with torch.no_grad():
            want = PrefillDecode(example.small_llama(), CACHE).prefill(torch.tensor([prompt]))
        torch.testing.assert_close(torch.tensor(got), want.flatten(), rtol=1e-4, atol=1e-5)
    eager = PrefillDecode(example.small_llama(), CACHE)
    assert result["tokens"] == example.greedy_decoder(eager, prompts[0], 16)
    assert "argument 'tokens' dimension 1 is 33, outside the range [1, 32]" in result["error"]
    for method in ("prefill", "decode"):
        assert any(d.backend_id == "onnxruntime" for d in lowered.delegates(method))


def test_each_weight_is_stored_once_for_both_methods(two_method_lm):
    from aotstack.format.archive import read_manifest

    manifest = read_manifest(two_method_lm[1])
    blob_of: dict[str, set[str]] = {}
    for method in manifest.methods.values():
        for fqn, weight in method.weights.items():
            blob_of.setdefault(fqn, set()).add(weight.blob)
        for delegate in method.delegates:
            for local, key in delegate.named_data.items():
                if local.startswith("weight:"):
                    blob_of.setdefault(local.removeprefix("weight:"), set()).add(key)
    assert "lm.model.lm_head.weight" in blob_of
    assert all(len(keys) == 1 for keys in blob_of.values()), "a weight read by both methods is one blob"


def small_latent_attention_lm() -> torch.nn.Module:
    """DeepSeek-V3's latent attention: each layer caches one compressed head, not the config's heads and width."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
                              max_position_embeddings=64)
    return DeepseekV3ForCausalLM(config).eval()


def test_a_cache_is_sized_as_the_model_writes_it_and_exports():
    model = small_latent_attention_lm()
    wrapped = PrefillDecode(model, CACHE).eval()
    caches = {name: tuple(buffer.shape) for name, buffer in wrapped.named_buffers() if "_cache_" in name}
    assert caches["lm.key_cache_0"] == (1, 1, CACHE, 16)  # kv_lora_rank, where the config says 4 heads of 8
    assert caches["lm.value_cache_0"] == (1, 1, CACHE, 8)  # the rotary key

    tokens = torch.tensor([[*PROMPT, 5]])
    with torch.no_grad():
        full = model(tokens).logits[:, -2:]  # no cache: the reference for the prompt and the next token
        torch.testing.assert_close(wrapped.prefill(tokens[:, :-1]), full[:, 0])
        torch.testing.assert_close(wrapped.decode(tokens[:, -1:], torch.tensor([len(PROMPT)])), full[:, 1])

    program = export_decoder_lm(model, CACHE)
    placeholder_shapes = {
        spec.target: tuple(node.meta["val"].shape)
        for spec, node in zip(program.methods["decode"].graph_signature.input_specs,
                              program.methods["decode"].graph.find_nodes(op="placeholder"))
    }
    assert placeholder_shapes["lm.key_cache_1"] == (1, 1, CACHE, 16)


def small_learned_positions_lm() -> torch.nn.Module:
    """OPT: learned positions, which its forward slices at the cache's length where it is given none."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32)
    return OPTForCausalLM(config).eval()


def small_mask_making_lm() -> torch.nn.Module:
    """BioGPT: given no attention mask, its forward makes one of ones as long as the cache's fill."""
    from transformers import BioGptConfig, BioGptForCausalLM

    torch.manual_seed(0)
    config = BioGptConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64)
    return BioGptForCausalLM(config).eval()


@pytest.mark.parametrize("make_model", [small_learned_positions_lm, small_mask_making_lm], ids=["opt", "biogpt"])
def test_a_model_that_sizes_by_its_caches_fill_is_given_what_it_would_derive_and_exports(make_model):
    # The cache's fill is a size read from data: torch.export failed on OPT's positions sliced at it (Could not guard
    # on data-dependent expression u2 > 1) and on BioGPT's mask of ones that long (32 - u0 > 0). model.generate passes
    # both; the export passes positions, and a mask over the whole cache to a model that needs one.
    model = make_model()
    tokens = torch.tensor([[*PROMPT, 5]])
    with torch.no_grad():
        full = model(tokens).logits[:, -2:]

    program = export_decoder_lm(model, CACHE)

    prefill, decode = program.methods["prefill"].module(), program.methods["decode"].module()
    with torch.no_grad():
        torch.testing.assert_close(prefill(tokens[:, :-1]), full[:, 0])
        torch.testing.assert_close(decode(tokens[:, -1:], torch.tensor([len(PROMPT)])), full[:, 1])


def test_a_model_that_guards_its_prompts_length_takes_a_one_token_prompt_through_decode(tmp_path):
    # Mllama's text decoder (Llama 3.2 Vision's) guards the prompt's length to 2..cache-1 (its masks branch on a
    # single token): prefill is exported for those, and a prompt of one token goes through decode.
    from transformers import MllamaForCausalLM, MllamaTextConfig

    from aotstack.integrations.decoding import greedy_decoder

    torch.manual_seed(0)
    model = MllamaForCausalLM(MllamaTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0)).eval()
    aotstack.lower(export_decoder_lm(model, CACHE), [aotstack.AotiCpuPartitioner()], progress=False).save(
        tmp_path / "mllama.pt2")
    loaded = aotstack.load(tmp_path / "mllama.pt2")
    length = loaded.method("prefill").inputs[0].shape[1]
    assert (length.min, length.max) == (2, CACHE - 1)
    for prompt in ([5], PROMPT):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        assert greedy_decoder(loaded, prompt, 8) == want


def test_a_decoder_whose_last_layers_reuse_earlier_layers_keys_generates_as_transformers_does(tmp_path):
    # Gemma 3n's text decoder: its last layers compute no keys or values, reading those the last layer of their kind
    # before them wrote; their cache layers have no slots. Setting those to the start left one value as the new value
    # of several buffers, which torch.export refused.
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    from aotstack.integrations.decoding import greedy_decoder

    torch.manual_seed(0)
    model = Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=[64] * 3, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_kv_shared_layers=2, altup_num_inputs=2, laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 3, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
        max_position_embeddings=64, pad_token_id=0, layer_types=["full_attention"] * 3)).eval()
    aotstack.lower(export_decoder_lm(model, CACHE), [aotstack.AotiCpuPartitioner()], progress=False).save(
        tmp_path / "gemma3n.pt2")
    loaded = aotstack.load(tmp_path / "gemma3n.pt2")
    answers = []
    for prompt in (PROMPT, [9, 2, 5, 8]):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert greedy_decoder(loaded, prompt, 12) == want
        answers.append(want)
    assert answers[0] != answers[1], "the prompt decides the tokens, so the comparison can fail"


def small_short_convolution_lm() -> torch.nn.Module:
    """LFM2: short causal convolutions (a kernel of 3, their state in the cache) between attention layers."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    config = Lfm2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        layer_types=["conv", "full_attention"])
    return Lfm2ForCausalLM(config).eval()


def test_a_hybrid_cache_of_convolution_states_and_keys_exports_and_matches_the_model_without_a_cache(tmp_path):
    model = small_short_convolution_lm()
    tokens = torch.tensor([[*PROMPT, 5, 9, 2, 8]])
    with torch.no_grad():
        full = model(tokens).logits[0]  # no cache: every position's logits, before any wrapper touched the model
    lowered = aotstack.lower(export_decoder_lm(model, CACHE), [aotstack.AotiCpuPartitioner()], progress=False)
    lowered.save(tmp_path / "hybrid.pt2")
    loaded = aotstack.load(tmp_path / "hybrid.pt2")
    wrapped = PrefillDecode(model, CACHE)
    cache = {"lm.conv_states_0_0", "lm.key_cache_1", "lm.value_cache_1"}
    assert cache <= {name for name, _ in wrapped.named_buffers()}
    assert not cache & set(wrapped.state_dict()), "the cache is state, not weights"

    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits[0], full, msg="wrapping changed the model")
        # Prompts shorter than the kernel, and longer; then each next token from the cache.
        for length in (1, 2, len(PROMPT)):
            torch.testing.assert_close(loaded.prefill(tokens[:, :length])[0], full[length - 1])
        for position in range(len(PROMPT), tokens.shape[1]):
            step = loaded.decode(tokens[:, position:position + 1], torch.tensor([position]))
            torch.testing.assert_close(step[0], full[position])


def test_a_cache_of_states_the_wrapper_cannot_drive_is_refused_not_exported_wrong():
    from transformers import StaticCache

    model = small_short_convolution_lm()
    forward = model.forward

    def forgetting_its_states(*args, past_key_values=None, **kwargs):
        # A model that writes the static cache the wrapper drives (not its own), then reads none of it back: each
        # step after the first runs as if it started a sequence.
        static = isinstance(past_key_values, StaticCache)
        outputs = forward(*args, past_key_values=past_key_values, **kwargs)
        if static and kwargs["cache_position"][0] > 0:
            kwargs["cache_position"] = torch.arange(kwargs["input_ids"].shape[1])
            outputs = forward(*args, past_key_values=StaticCache(max_cache_len=CACHE, config=model.config), **kwargs)
        return outputs

    model.forward = forgetting_its_states
    refusal = "Lfm2ForCausalLM: a prompt then two tokens through its cache of states differ from transformers' own"
    with pytest.raises(aotstack.ExportError, match=refusal):
        PrefillDecode(model, CACHE)


def test_a_model_keeping_its_states_outside_its_cache_is_refused_not_exported_wrong():
    # RecurrentGemma holds its recurrent and convolution states in its modules' attributes, which an export freezes:
    # its tokens went wrong from the sixth on, silently, where the cache's state layers it never writes were exported.
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    torch.manual_seed(0)
    model = RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=8, block_types=["recurrent", "attention"])).eval()
    with pytest.raises(aotstack.ExportError, match="RecurrentGemmaForCausalLM keeps its recurrent states outside its "
                                                   "cache .layer 0's stay empty after a call"):
        export_decoder_lm(model, CACHE)


def test_a_model_whose_cache_layers_static_caches_lack_is_refused_by_layer_type():
    # DeepSeek-V4's compressed attention has a layer only its own dynamic cache holds: export raised a bare
    # KeyError('heavily_compressed_attention') from inside transformers before.
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    import aotstack.integrations.transformers as aot_hf

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64)).eval()
    kinds = sorted(set(model.config.layer_types))
    with pytest.raises(aotstack.UnsupportedModelError, match=(
            f"DeepseekV4ForCausalLM cannot be exported for generation with a static cache: transformers' StaticCache "
            f"has no static layer for layer type '{kinds[0]}'")):
        aot_hf.AotstackExporter().export_for_generation(
            model, {"input_ids": torch.tensor([PROMPT])}, aot_hf.AotstackConfig(engines="aoti", max_cache_len=CACHE))

def test_a_hybrid_whose_prompt_loops_over_its_length_exports_decode_alone_and_generates(tmp_path, caplog):
    from transformers import MambaConfig, MambaForCausalLM

    from aotstack.integrations.decoding import greedy_decoder, prompt_logits

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    tokens = torch.tensor([[*PROMPT, 5, 9]])
    with torch.no_grad():
        full = model(tokens).logits[0, -1]  # no cache
        want = model.generate(tokens, max_new_tokens=8, do_sample=False)[0, tokens.shape[1]:].tolist()
    assert PrefillDecode(model, CACHE).lm.cache_argument == "cache_params"

    # Its selective scan loops over the prompt's length: no dynamic prefill. Nor chunks: the scan of several
    # tokens starts from zero whatever the cache holds. So decode alone.
    with caplog.at_level("WARNING", logger="aotstack"):
        program = export_decoder_lm(model, CACHE)
    assert list(program.methods) == ["decode"]
    assert "MambaForCausalLM: its prompt path loops in Python over the prompt's length" in caplog.text
    assert "its prompt path does not continue from its states" in caplog.text
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False).save(tmp_path / "mamba.pt2")
    loaded = aotstack.load(tmp_path / "mamba.pt2")

    with torch.no_grad():
        # Twice: each prompt starts from the file's zeroed states, whatever the last generation left.
        for _ in range(2):
            assert greedy_decoder(loaded, tokens[0].tolist(), 8) == want
            torch.testing.assert_close(prompt_logits(loaded, tokens)[0], full)


def test_a_hybrid_that_continues_its_states_takes_a_prompt_in_chunks(tmp_path, caplog):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from aotstack.integrations.decoding import greedy_decoder, prompt_logits
    from aotstack.integrations.generation import PREFILL_CHUNK

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1, chunk_size=16)
    model = Mamba2ForCausalLM(config).eval()
    chunk = min(PREFILL_CHUNK, CACHE // 2)
    tokens = torch.randint(0, 128, (1, chunk + 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens).logits[0, -1]  # no cache
        one_chunk = model(tokens[:, :chunk]).logits[0, -1]
        want = model.generate(tokens, max_new_tokens=8, do_sample=False)[0, tokens.shape[1]:].tolist()

    # Its chunked scan loops over the prompt's chunks: no dynamic prefill. Each call continues its states,
    # so a prompt goes through a method of a fixed length, its remainder through decode.
    with caplog.at_level("WARNING", logger="aotstack"):
        program = export_decoder_lm(model, CACHE)
    assert list(program.methods) == ["decode", "prefill_chunk"]
    assert f"exporting decode and prefill_chunk, which takes a prompt {chunk} tokens at a time" in caplog.text
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()], progress=False).save(tmp_path / "mamba2.pt2")
    loaded = aotstack.load(tmp_path / "mamba2.pt2")
    assert loaded.method("prefill_chunk").inputs[0].shape == [1, chunk]
    chunks = []
    method = loaded.prefill_chunk
    loaded.prefill_chunk = lambda ids, position: chunks.append(position.item()) or method(ids, position)

    with torch.no_grad():
        for _ in range(2):
            assert greedy_decoder(loaded, tokens[0].tolist(), 8) == want
            torch.testing.assert_close(prompt_logits(loaded, tokens)[0], full)
        # A prompt of one chunk exactly: its logits are the chunk's.
        torch.testing.assert_close(prompt_logits(loaded, tokens[:, :chunk])[0], one_chunk)
    assert chunks == [0] * 5, "each prompt went through one chunk, its remainder through decode"


def test_a_layer_holding_both_states_and_keys_has_both_in_buffers():
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    config = FalconH1Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_n_heads=4,
                            mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=1, mamba_d_ssm=64,
                            max_position_embeddings=64)
    # Falcon-H1 runs attention and a Mamba mixer side by side in every layer; building the wrapper checks its
    # cache against transformers' own.
    wrapped = PrefillDecode(FalconH1ForCausalLM(config).eval(), CACHE)
    cache = {name for name, _ in wrapped.lm.named_buffers(recurse=False)}
    assert cache == {f"{kind}_{layer}" for kind in ("conv_states", "recurrent_states") for layer in ("0_0", "1_0")} | {
        f"{kind}_{layer}" for kind in ("key_cache", "value_cache", "cumulative_length") for layer in (0, 1)}


def test_a_layer_holding_states_beside_a_sliding_windows_keys_keeps_both():
    # Inkling's "hybrid_sliding" layers hold short convolutions' states beside a sliding window's keys. The wrapper
    # put a plain static layer in place of every sliding window, so the model's first call failed ("Cannot get
    # conv state for non linear attention layer 0 of type StaticLayer").
    from transformers import InklingForCausalLM, InklingTextConfig

    torch.manual_seed(0)
    config = InklingTextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               pad_token_id=0)
    assert set(config.layer_types) == {"hybrid_sliding"}
    # Building the wrapper checks a prompt and two tokens through its cache against transformers' own.
    wrapped = PrefillDecode(InklingForCausalLM(config).eval(), CACHE)
    cache = {name for name, _ in wrapped.lm.named_buffers(recurse=False)}
    for layer in (0, 1):
        assert {f"key_cache_{layer}", f"value_cache_{layer}"} <= cache
        assert any(name.startswith(f"conv_states_{layer}_") for name in cache)

