"""Audio-text LMs (GLM-ASR, Voxtral, Audio Flamingo 3, Fun-ASR-Nano, Granite Speech): a decoder whose prompt holds
audio.

Such a model's processor turns a clip into log-mel frames (``input_features``) and puts as many
audio tokens in the prompt as the clip's features have rows; its forward runs ``get_audio_features``
on the frames and puts the rows in place of the audio tokens. The export is
:func:`~aotstack.integrations.generation.export_decoder_lm`'s ``prefill`` and ``decode``, plus
``encode_audio`` (one clip's frames, as the processor made them, to rows of features) and
``prefill_audio`` (a prompt whose audio tokens take those rows), from one module: one set of
weights and one cache, as for images.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.export import Dim

from ..compile.export import Program, export
from ..errors import ExportError
from .generation import (
    PrefillDecode,
    embedded_with_features,
    holds_states,
    refuse_unfollowed_prompt,
    refuse_without_room,
    rows_of,
)

# The processor's output beside the frames that a model's get_audio_features reads: which of them are real frames.
FRAMES_MASK = "input_features_mask"
# Where an audio-text model's config keeps the id of the token its prompt holds for each row of a clip's features.
AUDIO_TOKEN_NAMES = ("audio_token_id", "audio_token_index")


def takes_audio(model: torch.nn.Module) -> bool:
    """Whether a decoder-only model reads audio in its prompt through ``get_audio_features``."""
    return callable(getattr(model, "get_audio_features", None))


def is_audio_text_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a decoder whose prompt holds audio (Voxtral's: it reads clips, or its config names an
    audio token), not an encoder-decoder (Whisper's)."""
    config = model.config
    names_token = any(isinstance(getattr(config, name, None), int) for name in AUDIO_TOKEN_NAMES)
    return (takes_audio(model) or names_token) and not getattr(config, "is_encoder_decoder", False)


def audio_token_id(model: torch.nn.Module) -> int:
    """The token id an audio-text model's prompt holds where a clip's features go."""
    for name in AUDIO_TOKEN_NAMES:
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    raise ExportError(f"{type(model).__name__}'s config names no audio token (audio_token_id)")


def reads_frames_mask(model: torch.nn.Module) -> bool:
    """Whether ``get_audio_features`` takes the processor's mask of real frames beside them (GLM-ASR's, Audio
    Flamingo 3's), which decides how many rows a clip gives; Granite Speech's mask is over rows, applied after."""
    for owner in (model, getattr(model, "model", None)):
        features = getattr(owner, "get_audio_features", None)
        if callable(features) and FRAMES_MASK in inspect.signature(features).parameters:
            return True
    return False


class AudioPrefillDecode(PrefillDecode):
    """An audio-text model: ``PrefillDecode``'s methods for text alone, plus ``encode_audio`` and
    ``prefill_audio``, which reads a prompt whose audio tokens stand for the rows ``encode_audio`` gave."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        if not takes_audio(model):
            raise ExportError(f"{type(model).__name__} has no get_audio_features: aotstack exports an audio-text "
                              "model's clips through it (Qwen2-Audio merges its audio inside its forward)")
        if holds_states(model, max_cache_len):
            raise ExportError(f"{type(model).__name__}'s decoder keeps recurrent or convolution states beside its "
                              "keys and values; aotstack exports a prompt with audio only for a decoder whose cache "
                              "holds keys and values alone")
        super().__init__(model, max_cache_len)
        self.audio_token = audio_token_id(model)
        self.frames_masked = reads_frames_mask(model)

    def encode_audio(self, input_features: torch.Tensor, *frames_mask: torch.Tensor) -> torch.Tensor:
        """The rows of features of one clip's frames (``[1, ...]``, as the processor made them), and of its mask of
        real frames where the model reads one."""
        model = self.lm.model
        given = {FRAMES_MASK: frames_mask[0]} if self.frames_masked else {}
        features = model.get_audio_features(input_features.to(model.dtype), return_dict=True, **given)
        return rows_of(features.pooler_output)

    def prefill_audio(self, tokens: torch.Tensor, audio_features: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (``[1, length]``), filling the cache from 0; its audio tokens
        take the rows of ``audio_features`` (``encode_audio``'s rows, clip after clip) in order. The caller checks
        their count, as for images."""
        merged = embedded_with_features(self.lm.model, tokens, tokens == self.audio_token, audio_features)
        return self.cached_logits(torch.zeros((), dtype=torch.long), inputs_embeds=merged)


def one_clip(sample: dict[str, Any], frames_masked: bool) -> tuple[torch.Tensor, ...]:
    """``encode_audio``'s inputs for the first clip of a sample (``input_features``, and its frames mask where the
    model reads one: ``frames_masked``), as the processor made them."""
    features = sample.get("input_features")
    if not isinstance(features, torch.Tensor) or features.dim() < 3:
        raise ExportError("an audio-text export needs input_features as its processor makes them, [clips, ...]; got "
                          f"{None if features is None else tuple(getattr(features, 'shape', ()))}")
    clip = (features[:1],)
    if not frames_masked:
        return clip
    mask = sample.get(FRAMES_MASK)
    if mask is None:
        mask = torch.ones(features.shape[0], features.shape[-1], dtype=torch.long)
    return (*clip, torch.as_tensor(mask)[:1])


def export_audio_text_lm(model: torch.nn.Module, max_cache_len: int, sample: dict[str, Any]) -> Program:
    """``prefill`` and ``decode`` of :func:`export_decoder_lm`, plus ``encode_audio`` (one clip, its frames shaped
    as the first clip of ``sample``'s ``input_features``; where the model's encoder takes any number of frames, any
    number) and ``prefill_audio`` (a prompt whose audio tokens take the clips' rows, in order).

    Before export, ``prefill_audio`` is checked against the model's own forward over the same
    prompt and clip: a model that reads a prompt with audio another way is refused.
    """
    module = AudioPrefillDecode(model, max_cache_len).eval()
    clip = one_clip(sample, module.frames_masked)
    with torch.no_grad():
        rows = module.encode_audio(*clip)
    tokens = torch.tensor([[1, 2] + [module.audio_token] * rows.shape[0] + [1, 2]], dtype=torch.long)
    refuse_without_room(model, f"a clip of {tuple(clip[0].shape)}", rows.shape[0], tokens.shape[1], max_cache_len)
    check_audio_prompt(module, tokens, clip, rows)
    length = Dim("length", min=1, max=max_cache_len)
    prompt_length = Dim("prompt_length", min=2, max=max_cache_len - 1)
    # torch.export keeps a side the encoder fixes (its mel bins, Whisper-style encoders' frames) and lets the others
    # vary: GLM-ASR's and Fun-ASR-Nano's frames, the rows following from them (Granite Speech's encoder branches on
    # its frames, which fixes them).
    clip_shapes = tuple({axis: Dim.AUTO for axis in range(1, part.dim())} for part in clip)
    return export(
        module,
        {
            "prefill": (torch.zeros(1, min(4, max_cache_len), dtype=torch.long),),
            "decode": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)),
            "encode_audio": clip,
            "prefill_audio": (tokens, rows),
        },
        dynamic_shapes={
            "prefill": {"tokens": {1: length}},
            # The frames mask is one more element (a tuple, as *args) only where the model reads one.
            "encode_audio": (clip_shapes[0], *([clip_shapes[1:]] if len(clip) > 1 else [])),
            "prefill_audio": ({1: prompt_length}, {0: Dim("audio_rows", min=1, max=max_cache_len - 1)}),
        },
        # encode_audio holds no cache: traced without TorchDynamo, as encode_images is.
        strict={"prefill": True, "decode": True, "encode_audio": False, "prefill_audio": True},
    )


def check_audio_prompt(
    module: AudioPrefillDecode, tokens: torch.Tensor, clip: tuple[torch.Tensor, ...], rows: torch.Tensor
) -> None:
    """Refuse a model whose own forward over ``tokens`` and ``clip`` is not what ``module.prefill_audio`` gives."""
    model = module.lm.model
    reference = {"input_features": clip[0], **({FRAMES_MASK: clip[1]} if module.frames_masked else {})}
    with torch.no_grad():
        try:
            want = model(input_ids=tokens, **reference).logits[:, -1, :]
        except Exception as error:  # the model's own forward, on a prompt its processor could have made
            raise ExportError(f"{type(model).__name__}'s own forward fails on a prompt with a clip of "
                              f"{tuple(clip[0].shape)}: {str(error).splitlines()[0][:300]}") from error
        got = module.prefill_audio(tokens, rows)
        module.clear_cache()
    refuse_unfollowed_prompt(model, got, want, "audio", "its clip's features put in place of its audio tokens")
