"""Encoder-decoder ``transformers`` models as one program of ``encode`` and ``decode`` methods.

- ``encode(source)`` runs the encoder once per source (``input_ids`` ``[1, length]``, or a speech
  model's ``input_features`` ``[1, mel bins, frames]``) and returns every decoder layer's
  cross-attention keys and values: ``(keys_0, values_0, keys_1, values_1, ...)``, each
  ``[1, heads, source positions, head size]``.
- ``decode(token, *encode(source), position)`` gives the logits ``[1, vocab]`` of the token after
  ``token`` (``[1, 1]``) at cache slot ``position`` (``[1]``), updating a static self-attention
  cache held in buffers. It reads the cross-attention keys and values it is given instead of
  projecting the encoder's states again at every token.

Both halves run the model's own code: ``encode`` lets the decoder's cross-attention fill an
``EncoderDecoderCache`` and reads it back; ``decode`` hands the model an ``EncoderDecoderCache``
whose cross-attention part is that state, marked as already computed, so each attention layer
reuses it, and takes the logits from the model's ``forward`` (output scaling, logit biases and
all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim, ExportedProgram
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from ..compile.export import Program, export
from ..errors import ExportError, UnsupportedModelError
from .generation import static_cache


def decoder_start_token(config: Any) -> int:
    """A token to run the decoder on while its cross-attention is filled; any id in the vocabulary would do."""
    start = getattr(config, "decoder_start_token_id", None)
    return start if isinstance(start, int) else 0


def cross_attention_state(cache: Any) -> tuple[torch.Tensor, ...]:
    """The cross-attention keys and values of every decoder layer in ``cache``, interleaved per layer."""
    state: list[torch.Tensor] = []
    for layer in cache.cross_attention_cache.layers:
        state += [layer.keys, layer.values]
    return tuple(state)


def filled_cross_attention(state: tuple[torch.Tensor, ...]) -> Any:
    """A cache of the keys and values ``state`` holds, as :func:`cross_attention_state` laid them out.

    The layers take the tensors as they are, not through ``update``, which would copy them
    into a concatenation at every token.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = []
    for keys, values in zip(state[0::2], state[1::2]):
        layer = DynamicLayer()
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer.keys, layer.values = keys, values
        layers.append(layer)
    cache = DynamicCache()
    cache.layers = layers
    return cache


class SourceEncoder(torch.nn.Module):
    """``encode``: the encoder over a source, then every decoder layer's cross-attention keys and values."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder()
        self.decoder = model.get_decoder()
        self.start = decoder_start_token(model.config)
        self.input_name = getattr(model, "main_input_name", "input_ids")

    def forward(self, source: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        hidden = self.encoder(**{self.input_name: source})[0]
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        # One decoder step fills the cross-attention part of the cache; its output is not used, so
        # export keeps only the key and value projections of the encoder's states.
        start = torch.full((source.shape[0], 1), self.start, dtype=torch.long)
        self.decoder(input_ids=start, encoder_hidden_states=hidden, past_key_values=cache, use_cache=True)
        return cross_attention_state(cache)


@dataclass
class EncoderStates(BaseModelOutput):
    """The encoder's output as a model's forward reads it, by index or by name, with no mask (every source position
    is attended), which Moonshine's forward reads."""

    attention_mask: torch.Tensor | None = None


class SteppedCache(EncoderDecoderCache):
    """The cache of one decoder step. ``length_as_int``: its filled length is the step's position read as an int, as
    transformers' interface says, rather than the static cache's count tensor. A decoder that bounds a range by that
    length (TrOCR's positions, ``arange(filled, filled + tokens)``) then has sizes export can follow; from the tensor,
    each end of the range was a number of its own. Others add the tensor to their positions, which every engine
    takes, where the int would be a read of data an engine may leave to the next."""

    def __init__(
        self, self_attention: Any, cross_attention: Any, position: torch.Tensor, max_cache_len: int, length_as_int: bool
    ) -> None:
        super().__init__(self_attention, cross_attention)
        self.position = position
        self.max_cache_len = max_cache_len
        self.length_as_int = length_as_int
        self.filled: int | None = None

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        if not self.length_as_int:
            return super().get_seq_length(layer_idx)
        if self.filled is None:
            filled = self.position[0].item()
            torch._check(filled >= 0)
            torch._check(filled < self.max_cache_len)
            self.filled = filled
        return self.filled


def decoder_config(config: Any) -> Any:
    """The config of the decoder's own layers, as transformers' ``get_text_config(decoder=True)`` gives it: for a
    model whose decoder is a model of its own (a vision encoder-decoder's), asked of that model's config too. An MBart
    config (Donut's decoder) counts its encoder's layers as ``num_hidden_layers``, so a cache sized by it would hold
    too many layers, or too few for a decoder deeper than that."""
    decoder = config.get_text_config(decoder=True)
    if decoder is getattr(config, "decoder", None):
        return decoder.get_text_config(decoder=True)
    return decoder


class CachedCrossAttentionDecoder(torch.nn.Module):
    """``decode``: one token through the whole model, reading cross-attention keys and values it is given."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import get_head_shapes

        self.model = model
        self.max_cache_len = max_cache_len
        self.length_as_int = False
        # The decoder's own config, where the model keeps one (Canary's decoder_config).
        decoder = decoder_config(model.config)
        self.hidden_size = getattr(decoder, "d_model", None) or decoder.hidden_size
        self.self_attention = static_cache(decoder, max_cache_len)
        heads, head_size = get_head_shapes(decoder)
        dtype = next(model.parameters()).dtype
        self.self_attention.early_initialization(1, heads, head_size, dtype, next(model.parameters()).device)
        # Buffers, so that export sees the cache as state each call updates.
        for index, layer in enumerate(self.self_attention.layers):
            self.register_buffer(f"key_cache_{index}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{index}", layer.values, persistent=False)
            self.register_buffer(f"cumulative_length_{index}", layer.cumulative_length, persistent=False)

    def forward(self, token: torch.Tensor, *state_and_position: torch.Tensor) -> torch.Tensor:
        *state, position = state_and_position
        # The cache's length is the position written next: a new generation restarts from slot 0.
        for layer in self.self_attention.layers:
            layer.cumulative_length.copy_(position[0])
        cache = SteppedCache(self.self_attention, filled_cross_attention(tuple(state)), position, self.max_cache_len,
                             self.length_as_int)
        cache.is_updated = dict.fromkeys(range(len(state) // 2), True)
        # Attention layers read only the shape of the encoder's states once their keys and values are
        # cached; a tensor of that shape (never computed) stands in for them.
        source_length = state[0].shape[2]
        placeholder = EncoderStates(state[0].new_zeros(1, source_length, self.hidden_size))
        outputs = self.model(encoder_outputs=placeholder, decoder_input_ids=token, past_key_values=cache,
                             use_cache=True, cache_position=position)
        return outputs.logits[:, -1, :]


class EncoderDecoderLM(torch.nn.Module):
    """A sequence-to-sequence LM behind ``encode`` and ``decode`` (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.encoder = SourceEncoder(model)
        self.decoder = CachedCrossAttentionDecoder(model, max_cache_len)

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.encoder(source)

    def decode(self, token: torch.Tensor, *state_and_position: torch.Tensor) -> torch.Tensor:
        return self.decoder(token, *state_and_position)


# A second of audio at the rate speech models take, and its frames of features at a 10 ms hop: the examples an
# encoder of audio of any length is traced with.
EXAMPLE_SAMPLES = 16000
EXAMPLE_FRAMES = 100


def example_source(model: torch.nn.Module, images: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
    """A source to trace ``encode`` with, and how its length varies: ``"tokens"`` (any length, the state as long),
    ``"audio"`` (any length along its second dimension, the state's length following from it: Moonshine's samples,
    Parakeet-style encoders' frames of features ``[1, frames, bins]``), or ``"fixed"`` (Whisper's frames; an image
    encoder's pixels, shaped as ``images``, a processor's output, or else as its config says)."""
    config = model.config
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input == "input_ids":
        return torch.zeros(1, 4, dtype=torch.long), "tokens"
    if main_input == "pixel_values":
        return torch.zeros(1, *(images.shape[1:] if images is not None else config_image_shape(config))), "fixed"
    if main_input == "input_values":
        return torch.zeros(1, EXAMPLE_SAMPLES), "audio"
    mel_bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if main_input == "input_features" and mel_bins and positions:
        # Whisper-style encoders take a fixed number of frames: two per source position.
        return torch.zeros(1, mel_bins, 2 * positions), "fixed"
    encoder_bins = getattr(getattr(config, "encoder_config", None), "num_mel_bins", None)
    if main_input == "input_features" and encoder_bins:
        return torch.zeros(1, EXAMPLE_FRAMES, encoder_bins), "audio"
    raise UnsupportedModelError(
        f"{type(model).__name__}'s encoder takes {main_input!r}; generation exports take token ids, raw audio "
        "input_values, log-mel input_features of any length (config.encoder_config.num_mel_bins), Whisper-style "
        "ones (config.num_mel_bins, config.max_source_positions) or images (pixel_values)"
    )


def config_image_shape(config: Any) -> tuple[int, int, int]:
    """Channels, height and width of the images an encoder-decoder's image encoder (TrOCR's ViT) takes, by config."""
    encoder = getattr(config, "encoder", None) or getattr(config, "vision_config", None) or config
    side = getattr(encoder, "image_size", None)
    if side is None:
        raise UnsupportedModelError(f"{type(config).__name__} names no image size for its encoder; export it with "
                                    "the images its processor makes (sample pixel_values)")
    height, width = (side, side) if isinstance(side, int) else side
    return getattr(encoder, "num_channels", 3), int(height), int(width)


def source_dims(kind: str, max_source_len: int) -> tuple[Any, Any]:
    """The dynamic size of a source's length (``encode``'s input) and of the state's (``decode``'s cross-attention
    keys and values) for a source of ``kind`` (:func:`example_source`); None where fixed."""
    if kind == "tokens":
        length = Dim("source", min=2, max=max_source_len)
        return length, length
    if kind == "audio":
        # The encoder's convolutions decide how many states a length of audio gives: torch.export finds the relation.
        return Dim.DYNAMIC, Dim("frames", min=2)
    return None, None


def check_cache_fits(model: torch.nn.Module, max_cache_len: int) -> None:
    """Refuse a cache longer than the decoder has learned positions for: decoding past them would index out of range."""
    config = decoder_config(model.config)
    positions = getattr(config, "max_target_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and max_cache_len > positions:
        raise ExportError(f"max_cache_len {max_cache_len} is longer than the {positions} positions "
                          f"{type(model).__name__}'s decoder has; use at most {positions}")


def export_encoder_decoder_lm(
    model: torch.nn.Module, max_cache_len: int, max_source_len: int, images: torch.Tensor | None = None
) -> Program:
    """``encode`` and ``decode`` of one :class:`EncoderDecoderLM`; token sources of 2 to ``max_source_len``; an image
    encoder's (TrOCR's, Donut's) one image shaped as ``images``, its processor's ``pixel_values``.

    Each half is exported on its own (a strict export of ``decode`` as a method of the whole
    module trips over cross-attention tensors Dynamo lifts), so each method names its weights
    from its own half; the file stores a weight both read once all the same, by content.
    """
    check_cache_fits(model, max_cache_len)
    source, kind = example_source(model, images)
    module = EncoderDecoderLM(model, max_cache_len).eval()
    length, state_length = source_dims(kind, max_source_len)
    with torch.no_grad():
        state = module.encoder(source)
    if not state:
        raise UnsupportedModelError(f"{type(model).__name__}'s decoder filled no cross-attention cache")
    encode = export(module.encoder, {"forward": (source,)},
                    dynamic_shapes={"forward": {"source": {1: length}} if length else None}, strict=True)
    state_shapes = tuple({2: state_length} if state_length else None for _ in state)
    try:
        decode = exported_decode(module.decoder, state, state_shapes)
    except ExportError as error:
        if "unbacked" not in str(error):
            raise
        module.decoder.length_as_int = True  # the cache's length bounds a range: TrOCR's positions
        decode = exported_decode(module.decoder, state, state_shapes)
    return Program({"encode": without_dead_code(encode.methods["forward"]), "decode": decode})


def exported_decode(
    decoder: CachedCrossAttentionDecoder, state: tuple[torch.Tensor, ...], state_shapes: tuple[Any, ...]
) -> ExportedProgram:
    """``decode``: one token, the cross-attention state (its length ``state_shapes``) and the position."""
    return export(
        decoder,
        {"forward": (torch.zeros(1, 1, dtype=torch.long), *state, torch.zeros(1, dtype=torch.long))},
        dynamic_shapes={"forward": {"token": None, "state_and_position": (*state_shapes, None)}},
        strict=True,
    ).methods["forward"]


def without_dead_code(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` without the ops no output depends on: ``encode``'s decoder step past its key and value projections.

    Export keeps every op it traced; the engines would mostly drop them too, but the graph
    partitioners see and the report shows should be the work ``encode`` does.
    """
    exported.graph_module.graph.eliminate_dead_code(is_impure_node=has_effects)
    exported.graph_module.recompile()
    return exported


def has_effects(node: torch.fx.Node) -> bool:
    """Whether removing ``node`` would change what the graph does.

    fx counts a dtype check (``.to(dtype)`` leaves ``_assert_tensor_metadata``) and a random op
    (attention, which could drop out) as effects; on a dead value in an inference graph neither
    is one, and either would keep the decoder step's dead layers alive.
    """
    return node.target is not torch.ops.aten._assert_tensor_metadata.default and node.is_impure(impure_random=False)
