"""Encoder-decoder generation exports: cross-attention computed once per source, Whisper speech-to-text.

T5 and BART (tiny configs, random weights) are exported and lowered with AOTInductor once each and
shared by their tests: ``decode``'s logits must equal the eager model's full logits, and ``decode``
must read the cross-attention keys and values ``encode`` gave instead of projecting the encoder's
states again. A tiny random Whisper goes through ``export_folder`` and a synthetic WAV file; its
tokens must equal transformers' ``generate`` on the same features.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402

import aotstack  # noqa: E402
import aotstack.integrations.transformers as aotstack_hf  # noqa: E402
from aotstack.backends.xnnpack.packages import executorch_problem  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import AudioFileError, ExportError, GenerationError  # noqa: E402
from aotstack.integrations.audio import (  # noqa: E402
    audio_features,
    detected_language,
    read_wav,
    resampled,
    whisper_decoder_prompt,
)
from aotstack.integrations.decoding import generation_settings, stream_encoder_decoder  # noqa: E402
from aotstack.integrations.hf_folder import export_folder, generate_text  # noqa: E402
from aotstack.integrations.seq2seq import export_encoder_decoder_lm  # noqa: E402
from tests.hf_folders import speech, tokenizer, write_wav  # noqa: E402

VOCAB = 96
CACHE = 16
MAX_SOURCE = 64
SOURCE = [5, 9, 11, 20, 7, 3, 44, 18, 30]
DECODER_TOKENS = [17, 33, 40, 8, 61, 12]
# Linear layers and matrix products: what projecting the encoder's states to keys and values takes.
PROJECTIONS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.bmm.default, torch.ops.aten.matmul.default}


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0)).eval()


def bart() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_SOURCE))
    with torch.no_grad():  # a bias the logits must carry, as BART's forward adds it
        model.final_logits_bias.normal_()
    return model.eval()


def marian() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_SOURCE,
        pad_token_id=0, decoder_start_token_id=2)).eval()


@dataclass
class Seq2SeqExport:
    model: torch.nn.Module
    loaded: Any
    decode_projections: list[str]  # ops of the exported decode that read the encoder state through a projection


def projections_of_state(exported: torch.export.ExportedProgram) -> list[str]:
    """Projection ops that read, directly or through views, a ``decode`` input other than the token and position."""
    placeholders = [node for node in exported.graph.nodes if node.op == "placeholder"]
    user_inputs = [node for node in placeholders if node.name in exported.graph_signature.user_inputs]
    reached, frontier, found = set(), list(user_inputs[1:-1]), []
    while frontier:
        node = frontier.pop()
        if node in reached:
            continue
        reached.add(node)
        if node.op == "call_function" and node.target in PROJECTIONS:
            found.append(node.name)
            continue
        if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            continue  # attention reads the keys and values; its output no longer is the state
        frontier.extend(node.users)
    return found


@pytest.fixture(scope="module", params=["t5", "bart"])
def seq2seq(request, tmp_path_factory) -> Seq2SeqExport:
    model = {"t5": t5, "bart": bart}[request.param]()
    program = export_encoder_decoder_lm(model, CACHE, max_source_len=MAX_SOURCE)
    projections = projections_of_state(program.methods["decode"])
    path = tmp_path_factory.mktemp(request.param) / "model.pt2"
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()]).save(path)
    return Seq2SeqExport(model, aotstack.load(path), projections)


def decoder_ids(model: torch.nn.Module) -> list[int]:
    return [model.config.decoder_start_token_id, *DECODER_TOKENS]


@pytest.mark.parametrize("length", [len(SOURCE), 37])
def test_decode_logits_equal_the_eager_models(seq2seq, length):
    source = torch.tensor([(SOURCE * 5)[:length]])
    ids = decoder_ids(seq2seq.model)
    with torch.no_grad():
        expected = seq2seq.model(input_ids=source, decoder_input_ids=torch.tensor([ids])).logits[0]
        for _ in range(2):  # a second generation restarts the self-attention cache at slot 0
            state = seq2seq.loaded.encode(source)
            for position, token in enumerate(ids):
                logits = seq2seq.loaded.decode(torch.tensor([[token]]), *state, torch.tensor([position]))
                torch.testing.assert_close(logits[0], expected[position], atol=1e-4, rtol=1e-4)


def test_encode_gives_each_decoder_layers_cross_attention_keys_and_values(seq2seq):
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    source = torch.tensor([SOURCE])
    state = seq2seq.loaded.encode(source)
    with torch.no_grad():  # the eager model's own cross-attention cache after one step
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        seq2seq.model(input_ids=source, decoder_input_ids=torch.tensor([decoder_ids(seq2seq.model)[:1]]),
                      past_key_values=cache, use_cache=True)
    layers = cache.cross_attention_cache.layers
    config = seq2seq.model.config
    assert len(state) == 2 * len(layers) == 2 * (getattr(config, "num_decoder_layers", None) or config.decoder_layers)
    for index, layer in enumerate(layers):
        assert state[2 * index].shape == (1, layer.keys.shape[1], len(SOURCE), layer.keys.shape[3])
        torch.testing.assert_close(state[2 * index], layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[2 * index + 1], layer.values, atol=1e-5, rtol=1e-5)


def test_decode_does_not_project_the_encoder_state_again(seq2seq):
    assert seq2seq.decode_projections == []


@pytest.mark.parametrize("first", ["ort", "ov"])
def test_an_engine_first_takes_the_decode_of_an_encoder_decoder_and_matches_eager(tmp_path, first):
    """The cross-attention inputs share the source's length, which Marian's decode guards; the engine's program (its
    cache as arguments, so other inputs) carried those guards over the method's inputs, and tracing it again failed
    ("tuple index out of range"): Marian, Pegasus, mT5 and UMT5, ONNX Runtime or OpenVINO first."""
    engine = {"ort": aotstack.OrtPartitioner, "ov": aotstack.OpenVinoPartitioner}[first]
    model = marian()
    program = export_encoder_decoder_lm(model, CACHE, max_source_len=MAX_SOURCE)
    lowered = aotstack.lower(program, [engine(), aotstack.AotiCpuPartitioner()])
    assert [delegate.backend_id for delegate in lowered.delegates("decode")] == [engine.backend_id]
    lowered.save(tmp_path / "marian.pt2")

    loaded = aotstack.load(tmp_path / "marian.pt2")
    ids = decoder_ids(model)
    for length in (len(SOURCE), 37):
        source = torch.tensor([(SOURCE * 5)[:length]])
        with torch.no_grad():
            expected = model(input_ids=source, decoder_input_ids=torch.tensor([ids])).logits[0]
        state = loaded.encode(source)
        for position, token in enumerate(ids):
            logits = loaded.decode(torch.tensor([[token]]), *state, torch.tensor([position]))
            torch.testing.assert_close(logits[0], expected[position], atol=1e-4, rtol=1e-4)


def test_a_cache_longer_than_the_decoders_positions_is_refused():
    with pytest.raises(ExportError, match="max_cache_len 100 is longer than the 64 positions"):
        export_encoder_decoder_lm(bart(), 100, max_source_len=MAX_SOURCE)


# Whisper: a tiny random model whose generation config sets no language, task or suppressed tokens.
SAMPLING_RATE = 16000
WAV_RATE = 8000  # the test file's rate: audio_features must resample it
FRAMES = 100  # 1 s of 10 ms hops: max_source_positions 50, as Whisper's encoder halves the frames
WHISPER_TOKENS = 10


def whisper() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=FRAMES // 2, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None,
        init_std=0.2)  # weights far enough from zero that greedy tokens vary
    return transformers.WhisperForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def whisper_export(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """A saved tiny Whisper (model, feature extractor, tokenizer) exported with ``export_folder``; the WAV."""
    folder = tmp_path_factory.mktemp("whisper")
    model = whisper()
    model.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE, hop_length=160,
                                         chunk_length=1, n_fft=400).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    output = folder.parent / f"{folder.name}-aot"
    result = export_folder(folder, output, engines="aoti", max_cache_len=16)
    assert result.task == "automatic-speech-recognition"  # inferred from the config
    assert set(result.methods) == {"encode", "decode"}
    return model, output, write_wav(folder.parent / f"{folder.name}.wav", speech(WAV_RATE), WAV_RATE)


def test_whisper_export_transcribes_as_transformers_generate(whisper_export):
    model, output, wav = whisper_export
    features = audio_features(output, wav)
    assert features.shape == (1, 80, FRAMES)
    loaded = aotstack.load(output / "model.pt2")
    prompt = whisper_decoder_prompt(model.generation_config, model.config)
    assert prompt == [model.config.decoder_start_token_id]
    with torch.no_grad():
        expected = model.generate(features, max_new_tokens=WHISPER_TOKENS)[0].tolist()  # without its prompt
    settings = generation_settings(model.generation_config, max_new_tokens=WHISPER_TOKENS)
    tokens = list(stream_encoder_decoder(loaded, features, prompt, settings))
    assert tokens == expected
    # As transformers takes a feature extractor's output: generate(**extractor(samples, return_tensors="pt")).
    exported = ExportedModel.from_pretrained(output)
    assert aotstack_hf.generate(exported, input_features=features, max_new_tokens=WHISPER_TOKENS) == expected
    assert len(set(tokens)) > 1  # a tiny model that says one token forever would prove little

    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]])
        eager = model(input_features=features, decoder_input_ids=ids).logits[0]
        state = loaded.encode(features)
        for position, token in enumerate(ids[0].tolist()):
            logits = loaded.decode(torch.tensor([[token]]), *state, torch.tensor([position]))
            torch.testing.assert_close(logits[0], eager[position], atol=1e-4, rtol=1e-4)


LETTERS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"etaoinshrdlucmfw"]


def small_wav2vec2(head: type, folder: Path) -> torch.nn.Module:
    """A tiny wav2vec2 with ``head``, saved with its feature extractor."""
    torch.manual_seed(0)
    model = head(transformers.Wav2Vec2Config(
        vocab_size=len(LETTERS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, pad_token_id=0, initializer_range=0.5, num_labels=3)).eval()
    model.save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=SAMPLING_RATE, do_normalize=True).save_pretrained(folder)
    return model


def ctc_recogniser(folder: Path) -> torch.nn.Module:
    """A tiny wav2vec2 with a CTC head, saved with a character tokenizer made here."""
    model = small_wav2vec2(transformers.Wav2Vec2ForCTC, folder)
    (folder / "vocab.json").write_text(json.dumps({letter: index for index, letter in enumerate(LETTERS)}))
    transformers.Wav2Vec2CTCTokenizer(str(folder / "vocab.json"), word_delimiter_token="|").save_pretrained(folder)
    return model


@pytest.mark.parametrize(("head", "task"), [
    (transformers.Wav2Vec2ForSequenceClassification, "audio-classification"),
    (transformers.Wav2Vec2ForAudioFrameClassification, "audio-frame-classification"),  # a label per frame
    (transformers.Wav2Vec2ForXVector, "audio-xvector"),  # a speaker's embedding
])
def test_an_audio_head_takes_clips_of_any_length(tmp_path, head, task):
    model = small_wav2vec2(head, tmp_path / "wav2vec2")
    assert export_folder(tmp_path / "wav2vec2", tmp_path / "out", engines="ov").task == task
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    for seconds in (0.4, 1.0, 3.1):
        values = torch.tensor(speech(SAMPLING_RATE, seconds), dtype=torch.float32)[None]
        got = exported(input_values=values)
        with torch.no_grad():
            want = model(input_values=values)
        names = [name for name, value in want.items() if isinstance(value, torch.Tensor)]
        for name in names:  # OpenVINO sums in its own order: an x-vector's embeddings run to 1e6 at these weights
            scale = want[name].abs().max().item()
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4 * max(scale, 1.0))


def test_a_ctc_recogniser_exports_for_any_length_and_transcribes_as_eager(tmp_path, capsys):
    model = ctc_recogniser(tmp_path / "wav2vec2")
    result = export_folder(tmp_path / "wav2vec2", tmp_path / "out", engines="ort")
    assert (result.task, result.methods) == ("automatic-speech-recognition", ["forward"])
    extractor = transformers.Wav2Vec2FeatureExtractor.from_pretrained(tmp_path / "out")
    texts = []
    for seconds in (0.7, 2.3):  # lengths other than the one it was traced at
        wav = write_wav(tmp_path / f"{seconds}.wav", speech(SAMPLING_RATE, seconds), SAMPLING_RATE)
        values = extractor(read_wav(wav)[0], sampling_rate=SAMPLING_RATE, return_tensors="pt").input_values
        with torch.no_grad():
            labels = model(input_values=values).logits.argmax(-1)[0].tolist()
        expected = transformers.AutoTokenizer.from_pretrained(tmp_path / "out").decode(labels)
        assert len(set(labels)) > 2, "a model that labels every frame alike would prove little"
        assert main(["generate", str(tmp_path / "out"), "--audio", str(wav), "--no-stream"]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == expected.strip()
        assert f"from {wav}; loaded in" in err and " ms, all in " in err
        texts.append(expected)
    assert texts[0] != texts[1]
    with pytest.raises(GenerationError, match="transcribes speech: give it a WAV file"):
        generate_text(tmp_path / "out", "the cat")


def test_a_recogniser_of_raw_audio_transcribes_clips_of_any_length_as_transformers_generate(tmp_path, capsys):
    """Moonshine: its encoder takes the samples themselves (``input_values``) and gives as many states as its
    convolutions make of them, so ``encode`` takes audio of any length and ``decode`` states of any length."""
    torch.manual_seed(0)
    model = transformers.MoonshineForConditionalGeneration(transformers.MoonshineConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        initializer_range=0.3)).eval()
    folder = tmp_path / "moonshine"
    model.save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=SAMPLING_RATE, do_normalize=False).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    result = export_folder(folder, tmp_path / "out", engines="aoti", max_cache_len=16)
    assert (result.task, set(result.methods)) == ("automatic-speech-recognition", {"encode", "decode"})
    loaded = aotstack.load(tmp_path / "out" / "model.pt2")
    answers = []
    for seconds in (0.6, 2.3):  # neither is the second it was traced with
        wav = write_wav(tmp_path / f"{seconds}.wav", speech(SAMPLING_RATE, seconds), SAMPLING_RATE)
        values = audio_features(tmp_path / "out", wav)
        assert values.shape == (1, int(SAMPLING_RATE * seconds))
        with torch.no_grad():
            expected = model.generate(input_values=values, max_new_tokens=WHISPER_TOKENS, do_sample=False)[0, 1:]
            ids = torch.tensor([[1, *expected[:-1].tolist()]])
            eager = model(input_values=values, decoder_input_ids=ids).logits[0]
            state = loaded.encode(values)
            for position, token in enumerate(ids[0].tolist()):
                logits = loaded.decode(torch.tensor([[token]]), *state, torch.tensor([position]))
                torch.testing.assert_close(logits[0], eager[position], atol=1e-4, rtol=1e-4)
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "out"), "--audio", str(wav), "--max-new-tokens",
                     str(WHISPER_TOKENS)]) == 0
        assert capsys.readouterr().out.strip() == tokenizer().decode(expected.tolist(), skip_special_tokens=True)
        answers.append(eager)
    assert (answers[0][0] - answers[1][0]).abs().max() > 1e-3, "the audio decides the logits, so the check can fail"


def test_an_image_encoders_decoder_reads_text_from_a_picture_as_transformers_generate(tmp_path, capsys):
    """TrOCR-style: a ViT encoder and a text decoder (``VisionEncoderDecoderModel``, which transformers maps to
    image-text-to-text): ``encode`` takes the processor's pixels; the tokens from ``generate(pixel_values=...)`` and
    from ``aotstack generate --image`` are transformers' own."""
    image = pytest.importorskip("PIL.Image")
    torch.manual_seed(0)
    encoder = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=32, patch_size=8)
    decoder = transformers.TrOCRConfig(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                       decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2, decoder_start_token_id=1)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    model = transformers.VisionEncoderDecoderModel(config).eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=1.0)  # varied tokens: the default weights repeat one token
    folder = tmp_path / "trocr"
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    result = export_folder(folder, tmp_path / "out", engines="aoti", max_cache_len=16)
    assert set(result.methods) == {"encode", "decode"}
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    pixels = np.random.default_rng(0).integers(0, 256, (40, 52, 3), dtype=np.uint8)
    image.fromarray(pixels).save(tmp_path / "text.png")
    processed = transformers.ViTImageProcessor.from_pretrained(folder)(images=image.open(tmp_path / "text.png"),
                                                                      return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**processed, max_new_tokens=8, do_sample=False)[0, 1:].tolist()
    assert len(set(expected)) > 1
    assert aotstack_hf.generate(exported, **processed, max_new_tokens=8, do_sample=False) == expected
    assert main(["generate", str(tmp_path / "out"), "--image", str(tmp_path / "text.png"), "--max-new-tokens", "8",
                 "--greedy"]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)


def test_a_recogniser_of_log_mel_frames_of_any_length_decodes_as_transformers_generate(tmp_path):
    """Cohere's recogniser (a Parakeet encoder, as Canary's): ``input_features`` ``[1, frames, bins]`` of any length,
    subsampled by its convolutions, where Whisper's are one fixed length. XNNPACK first: it leaves what has no upper
    bound on its sizes (asking ExecuTorch about the program narrowed them, and its program failed to write)."""
    torch.manual_seed(0)
    encoder = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
               "num_mel_bins": 32, "subsampling_conv_channels": 16}
    model = transformers.CohereAsrForConditionalGeneration(transformers.CohereAsrConfig(
        encoder_config=encoder, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2)).eval()
    engines = "xnnpack,aoti" if executorch_problem() is None else "aoti"
    exported = aotstack_hf.AotstackExporter().export_for_generation(
        model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
        aotstack_hf.AotstackConfig(engines=engines, max_cache_len=16))
    exported.save_pretrained(tmp_path / "asr")
    loaded = ExportedModel.from_pretrained(tmp_path / "asr")
    program = aotstack_hf.runner_of(loaded).program
    generator = torch.Generator().manual_seed(1)
    answers = []
    for frames in (57, 333):  # neither is the 100 it was traced with
        features = torch.randn(1, frames, 32, generator=generator)
        with torch.no_grad():
            full = model.generate(input_features=features, max_new_tokens=8, do_sample=False)[0].tolist()
            eager = model(input_features=features, decoder_input_ids=torch.tensor([full[:-1]])).logits[0]
            state = program.encode(features)
            for position, token in enumerate(full[:-1]):
                logits = program.decode(torch.tensor([[token]]), *state, torch.tensor([position]))
                torch.testing.assert_close(logits[0], eager[position], atol=1e-4, rtol=1e-4)
        assert aotstack_hf.generate(loaded, features, 8, decoder_prompt=full[:1], do_sample=False) == full[1:]
        answers.append(eager)
    assert (answers[0][0] - answers[1][0]).abs().max() > 1e-3, "the audio decides the logits, so the check can fail"

    # Its processor, saved beside the export, builds the decoder prompt for the language spoken: generate --language.
    prompt_words = ["▁", "<|startofcontext|>", "<|startoftranscript|>", "<|emo:undefined|>", "<|en|>", "<|fr|>",
                    "<|pnc|>", "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>"]
    processor = transformers.CohereAsrProcessor(feature_extractor=transformers.CohereAsrFeatureExtractor(
        feature_size=32), tokenizer=tokenizer(words=prompt_words))
    processor.save_pretrained(tmp_path / "asr")
    wav = write_wav(tmp_path / "speech.wav", speech(SAMPLING_RATE, 1.2), SAMPLING_RATE)
    inputs = processor(read_wav(wav)[0], language="fr", sampling_rate=SAMPLING_RATE)
    assert inputs["decoder_input_ids"][0, 4:6].tolist() == [processor.tokenizer.convert_tokens_to_ids("<|fr|>")] * 2
    with torch.no_grad():
        want = model.generate(input_features=inputs["input_features"], decoder_input_ids=inputs["decoder_input_ids"],
                              max_new_tokens=5, do_sample=False)[0].tolist()
    # generate puts the decoder's start token (its bos) before the processor's prompt; the cache of 16 holds all.
    assert want[:11] == [model.config.bos_token_id, *inputs["decoder_input_ids"][0].tolist()]
    assert generate_text(tmp_path / "asr", audio=wav, language="fr", max_new_tokens=5).tokens == want[11:]
    with pytest.raises(GenerationError, match=r"CohereAsrProcessor builds its decoder prompt for a language: give"):
        generate_text(tmp_path / "asr", audio=wav, max_new_tokens=5)
    with pytest.raises(GenerationError, match="Unsupported language: 'xx'"):
        generate_text(tmp_path / "asr", audio=wav, language="xx", max_new_tokens=5)


def test_whisper_export_folder_holds_tokenizer_and_feature_extractor(whisper_export):
    _, output, _ = whisper_export
    assert (output / "preprocessor_config.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(output).decode([4, 5]) == "the cat"


def test_audio_features_resample_to_the_extractors_rate(whisper_export, tmp_path):
    _, output, wav = whisper_export
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(output)
    at_rate = write_wav(tmp_path / "16k.wav", speech(SAMPLING_RATE), SAMPLING_RATE)
    direct = extractor(read_wav(at_rate)[0], sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    assert torch.equal(audio_features(output, at_rate), direct)
    # The same tone written at 8 kHz comes back close to it (log-mel, quantized to 16 bits at each rate),
    # but at the ends, where the resampling filter runs past the samples.
    torch.testing.assert_close(audio_features(output, wav)[..., 2:-2], direct[..., 2:-2], atol=0.1, rtol=0)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_read_wav_takes_pcm_widths_and_mixes_channels_down(tmp_path, width):
    left, right = speech(WAV_RATE, 0.1), 0.5 * speech(WAV_RATE, 0.1)
    samples, rate = read_wav(write_wav(tmp_path / "stereo.wav", np.stack([left, right]), WAV_RATE, width, 2))
    assert rate == WAV_RATE and samples.dtype == np.float32
    np.testing.assert_allclose(samples, (left + right) / 2, atol=2.0 / 2 ** (8 * width - 1))


def test_resampling_keeps_a_tone_and_removes_what_the_new_rate_cannot_hold():
    time_44k = np.arange(44100) / 44100
    tone, too_high = np.sin(2 * np.pi * 440 * time_44k), np.sin(2 * np.pi * 12000 * time_44k)
    down = resampled(tone + too_high, 44100, SAMPLING_RATE)
    assert down.shape == (SAMPLING_RATE,)
    expected = np.sin(2 * np.pi * 440 * np.arange(SAMPLING_RATE) / SAMPLING_RATE)
    np.testing.assert_allclose(down[500:-500], expected[500:-500], atol=1e-3)


def wav_header(format_tag: int, width: int = 2) -> bytes:
    """A RIFF/WAVE header of one channel at 8 kHz in format ``format_tag`` (1 PCM, 2 ADPCM, 3 float)."""
    fmt = struct.pack("<HHIIHH", format_tag, 1, WAV_RATE, WAV_RATE * width, width, 8 * width)
    data = b"\0" * 16
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(("name", "content", "message"), [
    ("notes.wav", b"not audio at all, just text", "is not a PCM WAV file"),
    ("adpcm.wav", wav_header(2), "is not a PCM WAV file"),
    ("float.wav", wav_header(3, 4), "is not a PCM WAV file"),
    ("empty.wav", b"", "is empty"),
])
def test_unreadable_audio_is_refused_by_name(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(AudioFileError, match=message) as raised:
        read_wav(path)
    assert name in str(raised.value)


def test_a_wav_without_samples_or_a_missing_file_is_refused_by_name(tmp_path):
    with pytest.raises(AudioFileError, match="silent.wav holds no samples"):
        read_wav(write_wav(tmp_path / "silent.wav", np.zeros(0), WAV_RATE))
    with pytest.raises(AudioFileError, match="missing.wav does not exist"):
        read_wav(tmp_path / "missing.wav")


def multilingual_generation_config(**settings: Any) -> transformers.GenerationConfig:
    """A generation config with Whisper's language, task and timestamp tokens (ids within a small vocabulary)."""
    settings.setdefault("return_timestamps", False)  # generate sets it before choosing the prompt
    return transformers.GenerationConfig(
        decoder_start_token_id=1, eos_token_id=2, lang_to_id={"<|en|>": 10, "<|fr|>": 11, "<|de|>": 12},
        task_to_id={"transcribe": 20, "translate": 21}, no_timestamps_token_id=30, is_multilingual=True,
        **settings)


@pytest.mark.parametrize("settings", [
    {"language": "en"},
    {"language": "french", "task": "translate"},
    {"language": "<|de|>", "return_timestamps": True},
    {"forced_decoder_ids": [[1, 11], [2, 20]]},
])
def test_whisper_decoder_prompt_is_the_prompt_generate_starts_from(settings):
    model = whisper()
    config = multilingual_generation_config(**settings)
    expected = model._retrieve_init_tokens(torch.zeros(1, 80, FRAMES), 1, config, model.config, FRAMES, {})
    assert whisper_decoder_prompt(config, model.config) == expected[0].tolist()


def test_whisper_language_detection_needs_the_detected_token():
    config = multilingual_generation_config()
    with pytest.raises(GenerationError, match="detects the language"):
        whisper_decoder_prompt(config, None)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 12] = 9.0, 3.0  # a non-language token scores higher, and is not a language
    assert detected_language(logits, config) == 12
    assert whisper_decoder_prompt(config, None, detected_language=12) == [1, 12, 30]


def test_a_seeded_sample_from_an_encoder_decoder_is_transformers_sample(seq2seq):
    """Sampling settings reach the decoder's logits as transformers' ``generate`` applies them."""
    model, loaded = seq2seq.model, seq2seq.loaded
    settings = {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "repetition_penalty": 1.2, "max_new_tokens": 8}
    config = generation_settings(model.generation_config, eos=[], **settings)
    start = model.config.decoder_start_token_id
    samples = {}
    for seed in (0, 1):
        samples[seed] = list(stream_encoder_decoder(loaded, torch.tensor([SOURCE]), [start], config, seed=seed))
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = model.generate(torch.tensor([SOURCE]), do_sample=True, eos_token_id=None, **settings)
        assert samples[seed] == expected[0, 1:].tolist()
    assert samples[0] != samples[1]


def test_generate_transcribes_a_wav_file_from_the_command_line(whisper_export, tmp_path, capsys):
    """``aotstack generate OUT --audio FILE.wav``, following the folder's suppress tokens as Whisper's generate."""
    model, output, wav = whisper_export
    features = audio_features(output, wav)
    with torch.no_grad():
        expected = model.generate(features, max_new_tokens=WHISPER_TOKENS)[0].tolist()
    capsys.readouterr()
    assert main(["generate", str(output), "--audio", str(wav), "--max-new-tokens", str(WHISPER_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)

    # A generation config that suppresses tokens always, and others at the first step only.
    suppressed = {"suppress_tokens": expected[1:3], "begin_suppress_tokens": expected[:1]}
    folder = tmp_path / "suppressing"
    shutil.copytree(output, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **suppressed}))
    with torch.no_grad():
        expected = model.generate(features, max_new_tokens=WHISPER_TOKENS, **suppressed)[0].tolist()
    result = generate_text(folder, audio=wav, max_new_tokens=WHISPER_TOKENS)
    assert result.tokens == expected
    assert not set(expected) & set(suppressed["suppress_tokens"])

    # A multilingual generation config: --language picks the language token, as generate(language=...) does.
    folder = tmp_path / "multilingual"
    shutil.copytree(output, folder)
    multilingual = multilingual_generation_config()
    multilingual.save_pretrained(folder)
    with torch.no_grad():
        expected = model.generate(features, generation_config=multilingual, language="fr",
                                  max_new_tokens=WHISPER_TOKENS)[0].tolist()
    capsys.readouterr()
    assert main(["generate", str(folder), "--audio", str(wav), "--language", "fr", "--max-new-tokens",
                 str(WHISPER_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    assert generate_text(folder, audio=wav, language="fr", max_new_tokens=WHISPER_TOKENS).tokens == expected
    assert generate_text(folder, audio=wav, language="de", max_new_tokens=WHISPER_TOKENS).tokens != expected
    with pytest.raises(GenerationError, match="takes no language"):
        generate_text(output, audio=wav, language="fr")

    with pytest.raises(GenerationError, match="transcribes speech: give it a WAV file"):
        generate_text(output, "the cat")
    with pytest.raises(GenerationError, match="from audio alone"):
        generate_text(output, "the cat", audio=wav)
