"""Speech from text: a ``text-to-speech`` export (VITS, MMS-TTS) run on a text, its waveform and sampling rate.

Example::

    speech = speak("./mms-tts-aot", "Hello there.")
    write_wav("hello.wav", speech.samples, speech.rate)    # aotstack.integrations.audio
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import GenerationError, UnsupportedModelError
from .hf_folder import TOKENIZER_FILES, export_folder_path, require_any, task_architectures

TASK = "text-to-speech"


@dataclass(frozen=True)
class Speech:
    """What :func:`speak` said: one channel of float32 samples at ``rate`` Hz, and how long loading and the call took
    (seconds)."""

    samples: np.ndarray
    rate: int
    load_seconds: float
    speak_seconds: float

    @property
    def seconds(self) -> float:
        """The speech's length in seconds."""
        return len(self.samples) / self.rate


def speak(folder: str | os.PathLike[str], text: str) -> Speech:
    """``text`` spoken by the text-to-speech model ``aotstack export-hf`` wrote into ``folder``.

    The folder's tokenizer makes the model's input (VITS's: characters, with a blank between each); a model that
    draws noise (VITS's) says a text a little differently at each call, as transformers' model does.
    """
    from transformers import AutoTokenizer
    from transformers.exporters import ExportedModel

    from .transformers import runner_of

    folder = export_folder_path(folder)
    require_any(folder, TOKENIZER_FILES, "tokenizer", TASK)
    if not text.strip():
        raise GenerationError("give a text to speak; this one is empty")
    started = time.perf_counter()
    exported = ExportedModel.from_pretrained(folder, local_files_only=True)
    rate = speech_rate(folder, exported.config)
    runner = runner_of(exported)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    load_seconds = time.perf_counter() - started
    inputs = dict(tokenizer(text, return_tensors="pt"))
    if inputs["input_ids"].shape[-1] == 0:
        raise GenerationError(f"the tokenizer of {folder} keeps no character of {text!r}: its vocabulary has none of "
                              "them (a model for another alphabet?)")
    began = time.perf_counter()
    output = runner(**inputs)
    samples = spoken_samples(output)
    return Speech(samples, rate, load_seconds, time.perf_counter() - began)


def speech_rate(folder: Path, config: Any) -> int:
    """The sampling rate of what the model in ``folder`` says, its config's; a folder of another task is an
    ``UnsupportedModelError``."""
    architectures = set(getattr(config, "architectures", None) or ())
    if not architectures & task_architectures()[TASK]:
        raise UnsupportedModelError(f"{folder} holds {', '.join(sorted(architectures)) or 'a model'}, not a "
                                    f"{TASK} model (VITS, MMS-TTS)")
    rate = getattr(config, "sampling_rate", None)
    if isinstance(rate, int) and rate > 0:
        return rate
    raise UnsupportedModelError(f"the config in {folder} names no sampling_rate for its waveform")


def spoken_samples(output: Any) -> np.ndarray:
    """The first waveform of a model's output, as long as its ``sequence_lengths`` says where it gives them."""
    waveform = output.get("waveform") if hasattr(output, "get") else None
    if not isinstance(waveform, torch.Tensor):
        raise UnsupportedModelError("the model's output holds no waveform")
    samples = waveform.reshape(waveform.shape[0], -1)[0] if waveform.dim() > 1 else waveform
    lengths = output.get("sequence_lengths")
    if isinstance(lengths, torch.Tensor) and lengths.numel():
        samples = samples[: int(lengths.reshape(-1)[0])]
    return samples.detach().float().numpy()
