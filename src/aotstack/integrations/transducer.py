"""Speech transducers (Parakeet's RNN-T and TDT heads) as one program of ``encode``, ``predict`` and ``joint``.

- ``encode(input_features)`` runs the encoder once per clip, its frames cut to those its feature extractor's mask
  keeps: the frames projected for the joint network ``[1, frames, joint size]``. (A masked encoder gives the same
  frames, but its mask's index arithmetic over a symbolic count of frames keeps Inductor simplifying for minutes.)
- ``predict(token, hidden, cell)`` runs the prediction network (an LSTM) on the last token emitted ``[1, 1]`` from
  its state ``[layers, 1, size]`` twice: its output ``[1, 1, joint size]`` and its state after the token.
- ``joint(frame, prediction)`` gives the logits ``[1, vocab]`` of one frame ``[1, 1, joint size]`` beside the
  prediction; a TDT's also hold its durations' logits after the vocabulary's.

The walk over the frames runs between the calls (:func:`stream_transducer`), greedy as transformers' ``generate``
for these models: a blank moves to the next frame (RNN-T) or by the duration the joint chose (TDT, at least one
frame for a blank); any other token is emitted and fed to ``predict``; an RNN-T moves on after
``max_symbols_per_step`` tokens at one frame.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import GenerationError, UnsupportedModelError
from .audio import audio_frames, head_architectures

# The prediction network's parts the program runs one token at a time (transformers' ParakeetRNNTDecoder).
PREDICTION_PARTS = ("embedding", "lstm", "decoder_projector")


def transducer_architectures() -> set[str]:
    """The architecture names transformers loads as speech transducers (``ForRNNT``, ``ForTDT`` heads)."""
    return head_architectures("rnnt") | head_architectures("tdt")


def is_transducer(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a speech transducer: an encoder, a prediction network and a joint network."""
    return type(model).__name__ in transducer_architectures()


class TransducerSteps(torch.nn.Module):
    """A transducer's three stages as methods, each exported on its own (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        missing = [part for part in PREDICTION_PARTS if not hasattr(getattr(model, "decoder", None), part)]
        if missing or not hasattr(model, "joint") or not hasattr(model, "get_audio_features"):
            raise UnsupportedModelError(
                f"{type(model).__name__} is a transducer aotstack cannot split into encode, predict and joint: it "
                f"lacks {', '.join(f'decoder.{part}' for part in missing) or 'joint or get_audio_features'}"
            )
        self.model = model

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.model.get_audio_features(input_features=input_features).pooler_output

    def predict(
        self, token: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        decoder = self.model.decoder
        output, (hidden, cell) = decoder.lstm(decoder.embedding(token), (hidden, cell))
        return decoder.decoder_projector(output), hidden, cell

    def joint(self, frame: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        return self.model.joint(decoder_hidden_states=prediction, encoder_hidden_states=frame)[:, 0]


def transducer_settings(model: torch.nn.Module) -> dict[str, Any]:
    """What the walk over the frames needs from the model's config, kept in the export's config."""
    config = model.config
    durations = getattr(config, "durations", None)
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    return {
        "blank_token_id": int(config.blank_token_id),
        "vocab_size": int(config.vocab_size),
        "durations": [int(duration) for duration in durations] if durations else None,
        "max_symbols_per_step": int(getattr(config, "max_symbols_per_step", None) or 10),
        "start_token_id": int(start) if isinstance(start, int) else int(config.blank_token_id),
        "state_shape": [int(config.num_decoder_layers), 1, int(config.decoder_hidden_size)],
    }


def example_features(model: torch.nn.Module, seconds: float = 2.0) -> torch.Tensor:
    """Log-mel features ``[1, frames, mel bins]`` of a clip of ``seconds`` (10 ms frames), to trace ``encode`` with."""
    encoder_config = getattr(model.config, "encoder_config", model.config)
    return torch.randn(1, int(seconds * 100), int(encoder_config.num_mel_bins),
                       generator=torch.Generator().manual_seed(0))


def export_transducer(model: torch.nn.Module, input_features: torch.Tensor | None = None) -> Any:
    """``model`` (a transducer in eval mode) as a program of ``encode`` (clips of any length), ``predict`` and
    ``joint``; ``input_features`` (as its feature extractor makes them) trace ``encode``, else made-up ones."""
    from torch.export import Dim

    from ..compile.export import export

    steps = TransducerSteps(model)
    features = example_features(model) if input_features is None else input_features[:1]
    settings = transducer_settings(model)
    # Two tensors, not one twice: torch.export would take them for one input and read the hidden state as the cell.
    hidden, cell = torch.zeros(settings["state_shape"]), torch.zeros(settings["state_shape"])
    token = torch.tensor([[settings["start_token_id"]]])
    with torch.no_grad():
        frames = steps.encode(features)
        prediction, _, _ = steps.predict(token, hidden, cell)
    # A hint rather than a named Dim: the subsampling convolutions' strides leave guards on the frames' count
    # that hold for every clip but that torch cannot prove.
    methods = {"encode": (features,), "predict": (token, hidden, cell), "joint": (frames[:, :1], prediction)}
    return export(steps, methods, dynamic_shapes={"encode": {"input_features": {1: Dim.DYNAMIC}}})


def stream_transducer(
    program: Any, input_features: torch.Tensor, attention_mask: torch.Tensor | None, settings: dict[str, Any],
    max_steps: int | None = None,
) -> Iterator[int]:
    """The tokens a transducer emits for one clip (its blanks left out), each as it is chosen.

    ``max_steps`` bounds the joint's choices, blanks included, as ``max_new_tokens`` bounds transformers' ``generate``
    for these models; without it, the walk stops past the clip's last frame or after ``max_symbols_per_step``
    choices per frame (transformers' own bound).
    """
    if input_features.dim() != 3 or input_features.shape[0] != 1:
        raise GenerationError(f"a transducer export transcribes one clip at a time: input_features [1, frames, mel "
                              f"bins], got {list(input_features.shape)}")
    frames = program.encode(input_features[:, :audio_frames(input_features, attention_mask)])
    blank, vocab, durations = settings["blank_token_id"], settings["vocab_size"], settings["durations"]
    # transformers' generate sizes its output to max_symbols_per_step a frame, its start token included.
    limit = settings["max_symbols_per_step"] * frames.shape[1] - 1
    if max_steps is not None:
        limit = min(limit, max_steps)
    state = torch.zeros(settings["state_shape"])
    prediction, hidden, cell = program.predict(torch.tensor([[settings["start_token_id"]]]), state, state)
    frame, last, symbols = 0, frames.shape[1], 0
    for _ in range(limit):
        if frame >= last:
            return
        logits = program.joint(frames[:, frame:frame + 1], prediction)[0]
        token = int(logits[:vocab].argmax())
        if durations is not None:
            duration = durations[int(logits[vocab:].argmax())]
            frame += 1 if token == blank and duration == 0 else duration
        else:
            symbols = 0 if token == blank else symbols + 1
            if token == blank or symbols >= settings["max_symbols_per_step"]:
                frame, symbols = frame + 1, 0
        if token != blank:
            yield token
            prediction, hidden, cell = program.predict(torch.tensor([[token]]), hidden, cell)
