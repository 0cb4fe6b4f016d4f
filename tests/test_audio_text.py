"""Audio-text LMs: a decoder whose prompt holds a clip's features in place of its audio tokens (GLM-ASR, Voxtral).

Small configs, weights drawn so that greedy tokens depend on the audio; transformers' own ``generate`` on the
same prompt and features is the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.exporters import ExportedModel  # noqa: E402

import aotstack.integrations.transformers as aotstack_hf  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import GenerationError, UnsupportedModelError  # noqa: E402
from aotstack.integrations.audio import read_wav, resampled  # noqa: E402
from aotstack.integrations.hf_folder import DEFAULT_NEW_TOKENS, export_folder, generate_text  # noqa: E402
from tests.hf_folders import TEXT, VOCAB, speech, tokenizer, write_wav  # noqa: E402

AUDIO_TOKEN = "<|pad|>"
MEL_BINS = 32
NEW_TOKENS = 10


def drawn_again(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its matrices drawn at the scale that keeps activations near 1: at the configs' small
    initialisation, every prompt decodes to the same few tokens and a wrong clip would go unseen."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return model.eval()


def glm_asr() -> torch.nn.Module:
    encoder = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_mel_bins": MEL_BINS}
    text = {**TEXT, "model_type": "llama", "max_position_embeddings": 256, "num_hidden_layers": 1}
    config = transformers.GlmAsrConfig(audio_config=encoder, text_config=text,
                                       audio_token_id=VOCAB - 1)
    return drawn_again(transformers.GlmAsrForConditionalGeneration(config))


def glm_asr_processor() -> transformers.ProcessorMixin:
    # Chunks of 4 s, each padded to 400 frames with its mask: a longer clip is cut into several.
    features = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=4)
    # A chat template as GLM-ASR's puts a clip and a request in a user turn: its transcription request goes through it.
    template = ("{% for m in messages %}{{ m['role'] }}{% for c in m['content'] %}{% if c['type'] == 'audio' %}"
                f"{AUDIO_TOKEN}" "{% else %} {{ c['text'] }}{% endif %}{% endfor %}{% endfor %} assistant")
    return transformers.GlmAsrProcessor(feature_extractor=features, tokenizer=tokenizer(AUDIO_TOKEN),
                                        audio_token=AUDIO_TOKEN, chat_template=template,
                                        default_transcription_prompt="the cat sat")


def test_a_folder_of_an_audio_text_model_answers_a_prompt_about_a_clip_through_the_cli_as_transformers_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GLM-ASR: its processor cuts a clip into chunks of frames, each with a mask of its real frames, which decides
    how many rows of features (and audio tokens) the chunk gives; ``encode_audio`` takes chunks of any frames."""
    model, processor = glm_asr(), glm_asr_processor()
    folder = tmp_path / "glm-asr"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    result = export_folder(folder, tmp_path / "out", engines="aoti", max_cache_len=128)
    assert {"encode_audio", "prefill_audio", "prefill", "decode"} <= set(result.methods)
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    answers = []
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 8000 * 6)
    for seconds, clip in ((1.3, speech(8000, 1.3)), (5.5, noise[:44000])):  # one chunk; two, the second part padding
        wav = write_wav(tmp_path / f"{seconds}.wav", clip, 8000)
        samples = resampled(*read_wav(wav), 16000)  # the WAV is 8 kHz; the extractor takes 16 kHz
        inputs = processor(text=f"{AUDIO_TOKEN}the cat", audio=samples, return_tensors="pt")
        assert inputs["input_features"].shape[0] == (1 if seconds < 4 else 2)
        prompt = inputs["input_ids"].shape[1]
        with torch.no_grad():
            want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt:].tolist()
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "out"), "--audio", str(wav), "--prompt", "the cat",
                     "--max-new-tokens", str(NEW_TOKENS)]) == 0
        assert capsys.readouterr().out.strip() == processor.tokenizer.decode(want, skip_special_tokens=True)
        # In Python, everything the processor gives (its attention_mask too), as model.generate takes it.
        assert aotstack_hf.generate(exported, **inputs, max_new_tokens=NEW_TOKENS) == want
        answers.append(want)
    assert answers[0] != answers[1], "the clip decides the answer, so the comparison can fail"

    # No prompt: the processor's own transcription request, and a transcript as long as the cache leaves room for.
    inputs = processor.apply_transcription_request(samples)
    prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=128 - prompt, do_sample=False)[0, prompt:].tolist()
    assert len(want) > DEFAULT_NEW_TOKENS, "past the default for a text prompt, so the comparison can fail"
    assert generate_text(tmp_path / "out", audio=wav).tokens == want


def voxtral() -> torch.nn.Module:
    encoder = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
               "num_mel_bins": MEL_BINS, "max_source_positions": 48}
    # Voxtral's text config defaults to 8 key-value heads, more than the 4 query heads of TEXT.
    text = {**TEXT, "model_type": "llama", "max_position_embeddings": 256, "num_key_value_heads": 2,
            "num_hidden_layers": 1}
    config = transformers.VoxtralConfig(audio_config=encoder, text_config=text,
                                        audio_token_id=VOCAB - 1)
    return drawn_again(transformers.VoxtralForConditionalGeneration(config))


def test_an_audio_text_model_with_a_fixed_number_of_frames_generates_from_several_chunks_as_transformers_does() -> None:
    """Voxtral: its encoder takes chunks of exactly ``2 * max_source_positions`` frames, so ``encode_audio`` does;
    a prompt of two chunks takes both chunks' rows. ONNX Runtime first: the audio path through another engine."""
    model = voxtral()
    generator = torch.Generator().manual_seed(1)
    chunks = torch.randn(2, MEL_BINS, 96, generator=generator)
    exported = aotstack_hf.AotstackExporter().export_for_generation(
        model, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "input_features": chunks[:1]},
        aotstack_hf.AotstackConfig(engines="ort,aoti", max_cache_len=96))
    rows = 96 // 2 // 4  # the encoder halves the frames, the projector stacks four
    answers = []
    for features in (chunks[:1], chunks, chunks.flip(0)):
        ids = torch.tensor([[1, 5, *[VOCAB - 1] * rows * features.shape[0], 9, 11]])
        with torch.no_grad():
            want = model.generate(input_ids=ids, input_features=features, max_new_tokens=NEW_TOKENS,
                                  do_sample=False)[0, ids.shape[1]:].tolist()
        assert aotstack_hf.generate(exported, ids, NEW_TOKENS, input_features=features) == want
        answers.append(want)
    assert answers[1] != answers[2], "the chunks' order decides the answer, so the comparison can fail"
    with pytest.raises(GenerationError, match=r"clips of \[32, 96\] \(side 2: 60 against 96"):
        aotstack_hf.generate(exported, ids, NEW_TOKENS, input_features=chunks[:1, :, :60])
    with pytest.raises(GenerationError, match=r"holds 12 audio tokens \(id 95\) and its audio gives 24 rows"):
        aotstack_hf.generate(exported, ids[:, :2 + rows], NEW_TOKENS, input_features=chunks)


def test_an_audio_text_model_that_merges_its_audio_inside_its_forward_is_refused_by_name() -> None:
    """Qwen2-Audio has no ``get_audio_features``: its forward expands its audio tokens itself."""
    config = transformers.Qwen2AudioConfig(
        audio_config={"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "num_mel_bins": MEL_BINS, "max_source_positions": 50},
        text_config={**TEXT, "model_type": "qwen2"}, audio_token_index=VOCAB - 1)
    model = transformers.Qwen2AudioForConditionalGeneration(config).eval()
    with pytest.raises(UnsupportedModelError, match="Qwen2AudioForConditionalGeneration has no get_audio_features"):
        aotstack_hf.AotstackExporter().export_for_generation(
            model, {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                    "input_features": torch.zeros(1, MEL_BINS, 100)},
            aotstack_hf.AotstackConfig(engines="aoti", max_cache_len=64))
