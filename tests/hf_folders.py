"""Model folders as ``save_pretrained`` writes them, for ``aotstack export-hf`` / ``generate`` tests.

A word-level tokenizer built offline (no downloads), a tiny text config, and the helpers that save a
model beside that tokenizer, run transformers' own greedy ``generate``, and call ``aotstack export-hf``.
"""

from __future__ import annotations

import json
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import transformers

from aotstack.cli import main

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "then", "it", "slept"]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB = 96
PROMPT = "the cat sat on the mat and then"
NEW_TOKENS = 12
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}


def tokenizer(image_token: str | None = None, words: Sequence[str] = ()) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``VOCAB`` entries, made here, not downloaded; with ``image_token``, that special
    token is its last entry (``VOCAB - 1``); ``words`` (a processor's prompt tokens) come before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = [*words, *([image_token] if image_token else [])]
    names = SPECIAL + WORDS + [f"w{i}" for i in range(VOCAB - len(SPECIAL) - len(WORDS) - len(specials))] + specials
    model = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    extra = {"extra_special_tokens": {"image_token": image_token}} if image_token else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>", **extra)


def saved(model: torch.nn.Module, folder: Path, processor: dict | None = None) -> Path:
    """``model`` saved in ``folder`` with the tokenizer, or with ``processor`` as its preprocessor_config.json."""
    model.eval().save_pretrained(folder)
    if processor is None:
        tokenizer().save_pretrained(folder)
    else:  # written as JSON: building an image processor needs Pillow or torchvision, which tests lack
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


def greedy_reference(model: torch.nn.Module, ids: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' own greedy ``generate``: the new tokens (an encoder-decoder's after its start token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
    return out[1:] if model.config.is_encoder_decoder else out[len(ids):]


def export_hf(*args: str) -> None:
    """``aotstack export-hf ARGS``, which must succeed."""
    assert main(["export-hf", *args, "--progress", "log"]) == 0


def write_wav(path: Path, samples: np.ndarray, rate: int, width: int = 2, channels: int = 1) -> Path:
    """``samples`` (floats in [-1, 1], one row per channel or one row for all) as integer PCM."""
    frames = np.repeat(samples[:, None], channels, axis=1) if samples.ndim == 1 else samples.T
    scale = 2 ** (8 * width - 1) - 1
    ints = np.round(frames * scale).astype(np.int64).reshape(-1)
    if width == 1:
        data = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        data = b"".join(int(value).to_bytes(3, "little", signed=True) for value in ints)
    else:
        data = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(data)
    return path


def speech(rate: int, seconds: float = 1.0) -> np.ndarray:
    """A vowel-like tone: a 220 Hz fundamental and two harmonics, fading in."""
    time = np.arange(int(rate * seconds)) / rate
    tone = sum(amplitude * np.sin(2 * np.pi * 220 * harmonic * time)
               for harmonic, amplitude in ((1, 0.5), (3, 0.2), (7, 0.1)))
    return tone * np.minimum(1.0, time * 4)
