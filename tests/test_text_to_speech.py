"""Text to speech from a folder as transformers saves it: VITS (MMS-TTS's architecture; tiny config, random weights).

Its forward draws a duration for each character and a waveform as long as their sum: sizes read from data, which
AOTInductor's 1-D convolutions cannot be compiled over (they run as ATen's). The noise it draws is turned off here, so
the waveform must equal transformers' model's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402

from aotstack.cli import main  # noqa: E402
from aotstack.errors import UnsupportedModelError  # noqa: E402
from aotstack.integrations.audio import read_wav  # noqa: E402
from aotstack.integrations.hf_folder import Preprocessor, example_speech_texts  # noqa: E402
from aotstack.integrations.speech import speak  # noqa: E402
from tests.hf_folders import export_hf  # noqa: E402

RATE = 8000
CHARACTERS = list(" abcdefghijklmnopqrstuvwxyz'.,")


def vits_folder(folder):
    """A VITS model and its character tokenizer saved in ``folder``; its noise scales 0, so it says a text one way."""
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(["<pad>", "<unk>", *CHARACTERS])}))
    tokenizer = transformers.VitsTokenizer(str(folder / "vocab.json"), phonemize=False)
    config = transformers.VitsConfig(
        vocab_size=len(CHARACTERS) + 2, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        flow_size=16, spectrogram_bins=33, upsample_initial_channel=32, upsample_rates=[4, 4],
        upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
        prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=2, duration_predictor_num_flows=2,
        duration_predictor_filter_channels=32, depth_separable_num_layers=2, posterior_encoder_num_wavenet_layers=2,
        wavenet_kernel_size=3, sampling_rate=RATE, noise_scale=0.0, noise_scale_duration=0.0,
        architectures=["VitsModel"])
    torch.manual_seed(0)
    model = transformers.VitsModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def test_a_vits_folder_is_exported_for_text_to_speech_and_says_texts_as_transformers_model_does(tmp_path, capsys):
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        pytest.skip("torch 2.11's torch.export cannot trace VITS (\"Could not guard on data-dependent expression "
                    "u4 < 1\", its spectrogram's length); 2.13's can")
    model, tokenizer = vits_folder(tmp_path / "vits")
    # AOTInductor takes the upsampling convolutions ONNX Runtime cannot: over a length read from data, they are left to
    # ATen, not failed on.
    export_hf(str(tmp_path / "vits"), "-o", str(tmp_path / "out"), "--engines", "ort,aoti")
    assert "task text-to-speech" in capsys.readouterr().err

    lengths = set()
    for text in ("a", "hello there", "the quick brown fox jumps over the lazy dog."):
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt")).waveform[0].numpy()
        speech = speak(tmp_path / "out", text)
        assert speech.rate == RATE
        np.testing.assert_allclose(speech.samples, want, atol=1e-4, rtol=1e-4)
        lengths.add(len(want))
    assert len(lengths) == 3, "each text's durations decide its length, so a fixed length would fail"

    text = "how are you"
    with torch.no_grad():
        want = model(**tokenizer(text, return_tensors="pt")).waveform[0].numpy()
    assert main(["speak", str(tmp_path / "out"), "--text", text, "--out", str(tmp_path / "said.wav")]) == 0
    assert f"at {RATE} Hz" in capsys.readouterr().err
    said, rate = read_wav(tmp_path / "said.wav")
    assert rate == RATE and len(said) == len(want)
    np.testing.assert_allclose(said, np.clip(want, -1, 1), atol=2 / 32767)
    assert not list(tmp_path.glob(".*.partial"))

    assert main(["speak", str(tmp_path / "out"), "--text", "日本", "--out", str(tmp_path / "none.wav")]) == 1
    assert "keeps no character of '日本'" in capsys.readouterr().err
    assert not (tmp_path / "none.wav").exists()


def test_a_text_to_speech_model_that_generates_its_audio_is_refused_by_name():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel generates its audio step by step"):
        example_speech_texts(model, Preprocessor(), torch.Generator(), None)
