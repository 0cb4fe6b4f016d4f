"""Speech recognisers whose head reads the encoder alone, from a folder as transformers saves them.

Parakeet's transducers (RNN-T, TDT; tiny configs, random weights) become ``encode``, ``predict`` and ``joint``; their
transcripts must be the tokens transformers' ``generate`` chooses for clips of lengths the export was not traced at,
through the Python API and ``aotstack generate``. Parakeet's CTC head reads log-mel features with a frames mask
(wav2vec2's reads samples: ``test_seq2seq_generation``), which its folder export must make from its feature
extractor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402

import aotstack.integrations.transformers as aotstack_hf  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import GenerationError  # noqa: E402
from aotstack.integrations.audio import audio_inputs  # noqa: E402
from aotstack.integrations.hf_folder import export_folder, generate_text  # noqa: E402
from tests.hf_folders import VOCAB, speech, tokenizer, write_wav  # noqa: E402

RATE = 16000
ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "subsampling_conv_channels": 8, "num_mel_bins": 80}
# The blank is the transducer's last label, after the tokenizer's vocabulary, as in Parakeet's checkpoints.
BLANK = VOCAB
TRANSDUCERS = {
    "tdt": (transformers.ParakeetTDTConfig, transformers.ParakeetForTDT),
    "rnnt": (transformers.ParakeetRNNTConfig, transformers.ParakeetForRNNT),
}


def parakeet_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The word-level test tokenizer as Parakeet's class, which merges repeated tokens unless told not to (CTC's
    decoding), as the checkpoints' tokenizers do."""
    return transformers.ParakeetTokenizer(tokenizer_object=tokenizer()._tokenizer, pad_token="<pad>",
                                          unk_token="<unk>")


def saved_recogniser(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    parakeet_tokenizer().save_pretrained(folder)
    transformers.ParakeetFeatureExtractor().save_pretrained(folder)
    return folder


def transducer(kind: str) -> torch.nn.Module:
    config_class, model_class = TRANSDUCERS[kind]
    torch.manual_seed(0)
    # Three tokens a frame at most: an RNN-T of random weights that never emits a blank reaches the bound.
    model = model_class(config_class(encoder_config=ENCODER, vocab_size=VOCAB + 1, blank_token_id=BLANK,
                                     decoder_hidden_size=32, pad_token_id=0, max_symbols_per_step=3)).eval()
    model.generation_config.decoder_start_token_id = BLANK  # Parakeet's checkpoints start from the blank
    return model


@pytest.mark.parametrize("kind", sorted(TRANSDUCERS))
def test_a_speech_transducer_transcribes_clips_of_any_length_as_transformers_generate(kind, tmp_path, capsys):
    model = transducer(kind)
    folder = saved_recogniser(model, tmp_path / kind)
    result = export_folder(folder, tmp_path / "out", engines="aoti")
    assert (result.task, result.methods) == ("automatic-speech-recognition", ["encode", "predict", "joint"])
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    transcripts = []
    for seconds in (0.6, 2.3):  # neither is the clip it was traced with
        wav = write_wav(tmp_path / f"{seconds}.wav", speech(RATE, seconds), RATE)
        clip = audio_inputs(tmp_path / "out", wav)
        assert not clip["attention_mask"].all(), "the extractor masks a frame: the mask must reach the encoder"
        with torch.no_grad():
            steps = model.generate(**clip).sequences[0, 1:].tolist()
        want = [token for token in steps if token != BLANK]
        assert len(set(want)) > 2, "a transcript of one token repeated would prove little"
        assert aotstack_hf.generate(exported, **clip) == want
        assert aotstack_hf.generate(exported, clip["input_features"], 4, attention_mask=clip["attention_mask"]) == [
            token for token in steps[:4] if token != BLANK]  # max_new_tokens counts blanks too, as in transformers
        assert main(["generate", str(tmp_path / "out"), "--audio", str(wav), "--no-stream"]) == 0
        text = parakeet_tokenizer().decode(want, skip_special_tokens=True, group_tokens=False)
        assert capsys.readouterr().out.strip() == text.strip()
        transcripts.append(want)
    assert transcripts[0] != transcripts[1]
    with pytest.raises(GenerationError, match="transcribes speech: give it a WAV file"):
        generate_text(tmp_path / "out", "the cat")
    with pytest.raises(GenerationError, match="one clip's input_features"):
        aotstack_hf.generate(exported, [5, 6, 7])


def test_a_ctc_head_on_log_mel_features_exports_from_its_feature_extractor(tmp_path, capsys):
    """Parakeet's CTC: ``input_features`` ``[batch, frames, mel bins]`` and a frames mask, as its extractor makes
    them; before, the folder export read Whisper's layout from the config and failed on ``num_mel_bins``."""
    torch.manual_seed(0)
    model = transformers.ParakeetForCTC(transformers.ParakeetCTCConfig(
        encoder_config=ENCODER, vocab_size=VOCAB, pad_token_id=0)).eval()
    folder = saved_recogniser(model, tmp_path / "ctc")
    result = export_folder(folder, tmp_path / "out", engines="ort")
    assert (result.task, result.methods) == ("automatic-speech-recognition", ["forward"])
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    for seconds in (0.6, 2.3):
        wav = write_wav(tmp_path / f"{seconds}.wav", speech(RATE, seconds), RATE)
        clip = audio_inputs(tmp_path / "out", wav)
        with torch.no_grad():
            want = model(**clip).logits
            labels = model.generate(**clip)[0].tolist()
        torch.testing.assert_close(exported(**clip).logits, want, atol=1e-4, rtol=1e-4)
        assert main(["generate", str(tmp_path / "out"), "--audio", str(wav), "--no-stream"]) == 0
        # transformers labels the masked frame its pad, which the tokenizer drops with the blanks (also its pad);
        # decoded as the speech recognition pipeline decodes a CTC head's labels, special tokens kept.
        assert capsys.readouterr().out.strip() == parakeet_tokenizer().decode(labels)
