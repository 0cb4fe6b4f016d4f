"""Speech input for a speech-to-text export: a WAV file to log-mel features, and Whisper's decoder prompt.

- :func:`read_wav` reads PCM WAV files (8, 16, 24 or 32-bit integers) with the standard library's
  ``wave`` module, mixing several channels down to one; :func:`write_wav` writes one (a text-to-speech export's).
- :func:`resampled` converts samples to another rate with a windowed-sinc filter (numpy only).
- :func:`audio_features` gives the model's input (Whisper's log-mel ``input_features``, wav2vec2's
  ``input_values``) as the feature extractor saved in an export folder computes it, after resampling
  to its ``sampling_rate``.
- :func:`whisper_decoder_prompt` gives the decoder tokens Whisper's ``generate`` starts from:
  the decoder start token, then the language, task and no-timestamps tokens its generation config
  asks for.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import tempfile
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import AudioFileError, GenerationError, ModelFolderError
from .decoding import decoder_start_id, encoder_state

logger = logging.getLogger("aotstack")

# Half the resampling filter's length, in zero crossings of its sinc: longer is sharper and slower.
ZERO_CROSSINGS = 16
# Output samples resampled at once: bounds the (chunk x taps) matrices to a few megabytes.
RESAMPLE_CHUNK = 8192
# Where a feature extractor keeps its settings: its own file, or inside a processor's saved by transformers 5.
SETTINGS_FILES = ("preprocessor_config.json", "processor_config.json")
# Seconds of the clip an audio-text export is traced with: its encoder's frames vary, or are padded to its own.
SAMPLE_SECONDS = 1


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """The samples of a PCM WAV file as float32 in [-1, 1], channels averaged to one, and its sampling rate."""
    path = Path(path)
    if not path.is_file():
        raise AudioFileError(f"{path} does not exist or is not a file; expected a WAV file")
    if path.stat().st_size == 0:
        raise AudioFileError(f"{path} is empty; expected a WAV file")
    try:
        with wave.open(str(path), "rb") as reader:
            channels, width, rate = reader.getnchannels(), reader.getsampwidth(), reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except wave.Error as exc:
        raise AudioFileError(f"{path} is not a PCM WAV file ({exc}); expected uncompressed integer PCM "
                             "(8, 16, 24 or 32-bit): convert it, e.g. ffmpeg -i IN -c:a pcm_s16le OUT.wav") from exc
    except EOFError as exc:
        raise AudioFileError(f"{path} ends inside its WAV header; the file is truncated") from exc
    if width not in (1, 2, 3, 4):
        raise AudioFileError(f"{path} has {8 * width}-bit samples; expected 8, 16, 24 or 32-bit PCM")
    samples = pcm_samples(frames, width)
    if samples.size < channels or channels < 1:
        raise AudioFileError(f"{path} holds no samples")
    mono = samples[: samples.size - samples.size % channels].reshape(-1, channels).mean(axis=1)
    return mono.astype(np.float32), rate


def pcm_samples(frames: bytes, width: int) -> np.ndarray:
    """Little-endian PCM bytes as float64 in [-1, 1]; 8-bit WAV is unsigned, wider is signed."""
    if width == 1:
        return (np.frombuffer(frames, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if width == 3:
        # No numpy dtype is 3 bytes wide: widen each sample to 4 bytes, its sign in the top byte.
        raw = np.frombuffer(frames[: len(frames) - len(frames) % 3], dtype=np.uint8).reshape(-1, 3)
        padded = np.zeros((raw.shape[0], 4), dtype=np.uint8)
        padded[:, 1:] = raw
        return padded.view("<i4").reshape(-1).astype(np.float64) / 2.0**31
    dtype = {2: "<i2", 4: "<i4"}[width]
    return np.frombuffer(frames[: len(frames) - len(frames) % width], dtype=dtype).astype(np.float64) / 2.0 ** (
        8 * width - 1
    )


def write_wav(path: str | os.PathLike[str], samples: np.ndarray, rate: int) -> Path:
    """``samples`` (one channel, floats in [-1, 1]; louder ones clipped) written to ``path`` as a 16-bit PCM WAV file
    at ``rate`` Hz, through a temporary file beside it: a failed write leaves no half-written file."""
    path = Path(path)
    pcm = (np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0) * 32767).round().astype("<i2")
    try:
        # A name of its own, as the compile cache's entries get: two writers of one path do not share a partial file.
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as exc:
        raise AudioFileError(f"cannot write {path}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as file, wave.open(file, "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(2)
            writer.setframerate(rate)
            writer.writeframes(pcm.tobytes())
        os.replace(partial, path)
    except BaseException as exc:
        os.unlink(partial)
        if isinstance(exc, OSError):
            raise AudioFileError(f"cannot write {path}: {exc}") from exc
        raise
    return path


def resampled(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` at ``rate`` Hz resampled to ``target`` Hz with a Hann-windowed sinc filter.

    The filter's cutoff is the lower of the two Nyquist frequencies, so downsampling does not
    fold the frequencies the target rate cannot hold back into the ones it can.
    """
    if rate == target or samples.size == 0:
        return samples.astype(np.float32)
    ratio = target / rate
    cutoff = min(1.0, ratio)  # a fraction of the input's Nyquist frequency
    half_width = ZERO_CROSSINGS / cutoff  # in input samples
    offsets = np.arange(-math.floor(half_width), math.ceil(half_width) + 1)
    source = samples.astype(np.float64)
    length = int(round(samples.size * ratio))
    output = np.empty(length, dtype=np.float32)
    for begin in range(0, length, RESAMPLE_CHUNK):
        times = np.arange(begin, min(begin + RESAMPLE_CHUNK, length)) / ratio  # in input samples
        taps = np.floor(times)[:, None].astype(np.int64) + offsets[None, :]
        distance = times[:, None] - taps
        window = np.where(np.abs(distance) < half_width, 0.5 + 0.5 * np.cos(np.pi * distance / half_width), 0.0)
        weights = cutoff * np.sinc(cutoff * distance) * window
        inside = (taps >= 0) & (taps < source.size)
        values = np.where(inside, source[np.clip(taps, 0, source.size - 1)], 0.0)
        output[begin: begin + times.size] = (values * weights).sum(axis=1)
    return output


def head_architectures(head: str) -> set[str]:
    """The architecture names transformers loads with a speech recogniser's head on its encoder alone: ``ctc``,
    ``rnnt`` or ``tdt`` (its ``MODEL_FOR_<HEAD>_MAPPING_NAMES``; none in a transformers without that head)."""
    from transformers.models.auto import modeling_auto as auto

    return set(getattr(auto, f"MODEL_FOR_{head.upper()}_MAPPING_NAMES", {}).values())


def feature_extractor(folder: str | os.PathLike[str]) -> Any:
    """The feature extractor saved in ``folder`` (``preprocessor_config.json``, or inside a processor's
    ``processor_config.json``)."""
    from transformers import AutoFeatureExtractor

    folder = Path(folder)
    if not any((folder / name).is_file() for name in SETTINGS_FILES):
        raise ModelFolderError(f"{folder} has no {' or '.join(SETTINGS_FILES)}, the feature extractor speech input "
                               "needs")
    try:
        return AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
    except ImportError as exc:  # a library it computes with: Granite Speech's needs torchaudio
        raise ModelFolderError(f"the feature extractor of {folder} needs a library this environment lacks: "
                               f"{' '.join(str(exc).split())[:300]}") from exc
    except (ValueError, OSError, KeyError) as exc:
        raise ModelFolderError(f"cannot read the feature extractor of {folder}: {exc}") from exc


def sample_clip(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A clip of quiet noise as the feature extractor in ``folder`` makes it (``input_features``, and its frames mask
    as ``input_features_mask`` where it makes one): what an audio-text export traces ``encode_audio`` with."""
    extractor = feature_extractor(folder)
    rate = int(extractor.sampling_rate)
    samples = np.random.default_rng(0).standard_normal(rate * SAMPLE_SECONDS).astype(np.float32) * 0.01
    made = extractor(samples, sampling_rate=rate, return_tensors="pt", return_attention_mask=True)
    clip = {"input_features": made["input_features"]}
    mask = made.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape[-1] == clip["input_features"].shape[-1]:
        clip["input_features_mask"] = mask
    return clip


def audio_features(folder: str | os.PathLike[str], wav_path: str | os.PathLike[str]) -> torch.Tensor:
    """The model's input for a WAV file, as the feature extractor in ``folder`` makes it: Whisper's ``input_features``
    ``[1, mel bins, frames]``, wav2vec2's ``input_values`` ``[1, samples]`` (see :func:`audio_inputs`)."""
    return next(iter(audio_inputs(folder, wav_path).values()))


def audio_inputs(folder: str | os.PathLike[str], wav_path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Everything the feature extractor in ``folder`` makes of a WAV file, by name, its model's input first
    (``input_features`` and a frames ``attention_mask``, Parakeet's).

    The audio is resampled to the extractor's ``sampling_rate``; the extractor pads or cuts it
    to its ``chunk_length`` seconds, so a longer file is transcribed from its first chunk only.
    """
    extractor = feature_extractor(folder)
    samples, rate = read_wav(wav_path)
    target = int(extractor.sampling_rate)
    samples = resampled(samples, rate, target)
    chunk = getattr(extractor, "n_samples", None)
    if chunk and samples.size > chunk:
        logger.warning("%s lasts %.1f s; only its first %.1f s are transcribed", wav_path, samples.size / target,
                       chunk / target)
    made = extractor(samples, sampling_rate=target, return_tensors="pt")
    first = extractor.model_input_names[0]
    return {first: made[first], **{name: value for name, value in made.items()
                                   if name != first and isinstance(value, torch.Tensor)}}


def audio_frames(input_features: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """How many of one clip's frames hold audio: those its feature extractor's mask keeps, which lead (a padded tail
    is masked), else all."""
    if attention_mask is None:
        return input_features.shape[1]
    mask = attention_mask.reshape(-1).to(torch.bool)
    count = int(mask.sum())
    if mask.numel() != input_features.shape[1] or not mask[:count].all():
        raise GenerationError(f"attention_mask must mark one clip's {input_features.shape[1]} frames, those holding "
                              f"audio first, as a feature extractor makes it; got {list(attention_mask.shape)}")
    return count


def unpadded(clip: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One clip's inputs (:func:`audio_inputs`) cut to the frames holding audio, its mask all ones.

    A masked encoder gives those frames as it gives them unmasked without the tail (Parakeet's: the same bits), and
    transformers' ``generate`` labels a masked frame its pad, which is no one's text.
    """
    mask = clip.get("attention_mask")
    first = next(iter(clip))
    if mask is None or mask.dim() != 2 or clip[first].dim() < 2 or mask.shape[1] != clip[first].shape[1]:
        return clip
    count = audio_frames(clip[first], mask)
    return {name: value[:, :count] for name, value in clip.items()}


def whisper_decoder_prompt(generation_config: Any, config: Any, detected_language: int | None = None) -> list[int]:
    """The decoder tokens Whisper's ``generate`` starts from, as its generation config sets them.

    The decoder start token; then, where the config defines them, the language token
    (``language``, or the legacy ``forced_decoder_ids``), the task token (``task``, or
    ``transcribe`` once a language is set) and ``no_timestamps_token_id`` unless
    ``return_timestamps``. A multilingual config with no language has ``generate`` detect it:
    pass the token :func:`detected_language` picks from the logits after the start token.
    """
    tokens: list[int | None] = [generation_config.decoder_start_token_id]
    language = getattr(generation_config, "language", None)
    task = getattr(generation_config, "task", None)
    task_ids = dict(getattr(generation_config, "task_to_id", None) or {})
    if task is None and language is None:
        tokens += forced_prompt_tokens(generation_config, config)
    if language is not None:
        set_language(tokens, language_id(language, generation_config))
    elif getattr(generation_config, "lang_to_id", None) and (len(tokens) < 2 or tokens[1] is None):
        if detected_language is None:
            raise GenerationError(
                "this Whisper generation config detects the language (lang_to_id, no language set): run the "
                "decoder on the start token, pick the language with detected_language(logits, generation_config) "
                "and pass it, or set generation_config.language"
            )
        set_language(tokens, detected_language)
    if task is not None:
        if task not in task_ids:
            raise GenerationError(f"unknown Whisper task {task!r}; the generation config has {sorted(task_ids)}")
        tokens = [token for token in tokens if token not in task_ids.values()] + [task_ids[task]]
    elif language is not None and task_ids and not any(token in task_ids.values() for token in tokens):
        tokens.append(task_ids["transcribe"])
    no_timestamps = getattr(generation_config, "no_timestamps_token_id", None)
    if no_timestamps is not None:
        if not getattr(generation_config, "return_timestamps", False):
            if tokens[-1] != no_timestamps:
                tokens.append(no_timestamps)
        elif tokens[-1] == no_timestamps:
            tokens.pop()
    return [token for token in tokens if token is not None]


def forced_prompt_tokens(generation_config: Any, config: Any) -> list[int | None]:
    """The tokens legacy ``forced_decoder_ids`` put right after the start token (positions 1, 2, ...)."""
    forced = getattr(generation_config, "forced_decoder_ids", None) or getattr(config, "forced_decoder_ids", None)
    tokens: list[int | None] = []
    if not forced or forced[0][0] != 1:
        return tokens  # generate leaves ids forced elsewhere alone
    for expected, (position, token) in enumerate(forced, start=1):
        if position != expected:
            raise GenerationError(f"forced_decoder_ids {forced} do not follow Whisper's prompt: position {position} "
                                  f"where {expected} was expected")
        tokens.append(token)
    return tokens


def set_language(tokens: list[int | None], language: int) -> None:
    """The language token goes right after the start token, replacing one already there."""
    if len(tokens) > 1:
        tokens[1] = language
    else:
        tokens.append(language)


def language_id(language: str, generation_config: Any) -> int:
    """The token of ``language``: a token (``"<|en|>"``), a code (``"en"``) or a name (``"english"``)."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    known = dict(getattr(generation_config, "lang_to_id", None) or {})
    name = language.lower()
    code = TO_LANGUAGE_CODE.get(name, name)
    for key in (language, name, f"<|{code}|>"):
        if key in known:
            return known[key]
    raise GenerationError(f"language {language!r} is not in this Whisper generation config's lang_to_id "
                          f"({len(known)} languages, e.g. {sorted(known)[:5]})")


def detected_language(logits: torch.Tensor, generation_config: Any) -> int:
    """The language token Whisper's ``generate`` detects: the likeliest of ``lang_to_id``'s tokens.

    ``logits`` are the decoder's after its start token, ``[1, vocab]``.
    """
    languages = torch.tensor(sorted(generation_config.lang_to_id.values()))
    return int(languages[logits.reshape(-1)[languages].argmax()])


def speech_decoder_prompt(program: Any, features: torch.Tensor, generation_config: Any, config: Any) -> list[int]:
    """:func:`whisper_decoder_prompt` for ``features``, detecting the language first where the config asks for it.

    Detection runs ``encode`` and one ``decode`` step of ``program`` on the start token, as
    Whisper's ``generate`` does.
    """
    language = None
    if getattr(generation_config, "lang_to_id", None) and getattr(generation_config, "language", None) is None:
        state = encoder_state(program, features)
        start = torch.tensor([[generation_config.decoder_start_token_id]])
        with torch.no_grad():
            language = detected_language(program.decode(start, *state, torch.tensor([0])), generation_config)
    return whisper_decoder_prompt(generation_config, config, language)


def speech_source(
    folder: Path,
    wav_path: str | os.PathLike[str],
    program: Any,
    exported: Any,
    language: str | None = None,
    processor: Any = None,
) -> tuple[torch.Tensor, list[int]]:
    """What an encoder-decoder recogniser's ``encode`` takes for a WAV file, and the decoder prompt to start from.

    Where the folder's ``processor`` builds the decoder prompt for a language (Cohere's
    ``language``, Canary's transcription request), it makes both, for ``language``, after the
    decoder's start token as ``generate`` puts it; else the
    feature extractor makes the features and the prompt is Whisper's (:func:`speech_decoder_prompt`),
    with ``language``'s token where given.
    """
    made = None if processor is None else processor_prompt(processor, wav_path, language)
    if made is not None:
        features, prompt = made
        # As generate does with decoder_input_ids that do not start with the decoder's start token: it goes first.
        start = decoder_start_id(exported.generation_config, exported.config)
        return features, prompt if start is None or prompt[:1] == [start] else [start, *prompt]
    features = audio_features(folder, wav_path)
    generation_config = exported.generation_config
    if language is not None:
        if not getattr(generation_config, "lang_to_id", None):
            raise GenerationError(f"{folder}'s model takes no language: neither its generation config (lang_to_id) "
                                  "nor its processor names any")
        generation_config = copy.deepcopy(generation_config)
        generation_config.language = language
    return features, speech_decoder_prompt(program, features, generation_config, exported.config)


def processor_prompt(
    processor: Any, wav_path: str | os.PathLike[str], language: str | None
) -> tuple[torch.Tensor, list[int]] | None:
    """The features of a WAV file and the decoder prompt, both from ``processor``, where it builds a decoder prompt
    for a language (Cohere's takes ``language``; Canary's transcription request ``source_language``, English by
    default); None where it does not."""
    request = getattr(processor, "apply_transcription_request", None)
    takes_language = "language" in inspect.signature(processor.__call__).parameters
    by_request = callable(request) and "source_language" in inspect.signature(request).parameters
    if not (takes_language or by_request):
        return None
    rate = int(processor.feature_extractor.sampling_rate)
    samples = resampled(*read_wav(wav_path), rate)
    if not by_request and language is None:
        raise GenerationError(f"{type(processor).__name__} builds its decoder prompt for a language: give the one "
                              "spoken (--language, e.g. en)")
    try:
        if by_request:
            made = request(samples, **({"source_language": language} if language else {}))
        else:
            made = processor(samples, language=language, sampling_rate=rate)
    except ValueError as exc:  # a language it does not know: its message lists those it does
        raise GenerationError(f"{type(processor).__name__}: {exc}") from exc
    prompt = made.get("decoder_input_ids")
    if prompt is None:
        return None
    return made["input_features"], [int(token) for token in torch.as_tensor(prompt).reshape(-1).tolist()]
