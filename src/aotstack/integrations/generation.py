"""Generative ``transformers`` models as one program of several methods sharing weights and a static KV cache.

- A decoder-only LM becomes ``prefill(tokens)`` (a prompt of 1 to ``max_cache_len`` tokens, from
  cache slot 0) and ``decode(token, position)`` (one token at cache slot ``position``).
- A hybrid decoder whose prompt path cannot be exported for any length becomes ``decode`` and,
  where its model continues a sequence from its states over several tokens,
  ``prefill_chunk(tokens, position)`` (a fixed number of tokens, ``PREFILL_CHUNK``, at cache slots
  from ``position`` on): a prompt goes through it in chunks, its remainder through ``decode``.
(An encoder-decoder LM becomes ``encode`` and ``decode``: see ``seq2seq``.)

Both methods are exported from one module, so they read the same weights and update the same
cache buffers; a saved file holds each once. The loops of ``decoding`` run an eager module and a
loaded file alike.

A hybrid decoder whose cache holds convolution or recurrent states beside attention's keys and
values (LFM2's short convolutions) gets a wrapper of its own (``StateCacheLM``): transformers'
export wrapper knows only keys and values.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim

from ..compile.export import Program, export
from ..compile.measure import CallInputs
from ..errors import ExportError, caused_by
from .decoding import image_prompt_input, single_images

logger = logging.getLogger("aotstack")

# Tokens a hybrid decoder's ``prefill_chunk`` takes: a prompt's remainder (fewer) goes through ``decode``.
PREFILL_CHUNK = 64


@contextmanager
def static_cache_generation(model: torch.nn.Module) -> Iterator[None]:
    """``model.generation_config`` asks for a static cache while transformers' export wrappers are built.

    The wrappers read it once, when built; the model's own config is put back after.
    """
    from transformers import GenerationConfig

    original = getattr(model, "generation_config", None)
    config = copy.deepcopy(original) if original is not None else GenerationConfig()
    config.use_cache = True
    config.cache_implementation = "static"
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = original


def static_cache(config: Any, max_cache_len: int) -> Any:
    """transformers' ``StaticCache`` of ``max_cache_len`` slots for a model of ``config``.

    A layer type it has no static layer for (DeepSeek-V4's compressed attention, which only its
    own dynamic cache holds) is an ``ExportError`` naming it: generation is exported over a static cache.
    """
    from transformers import StaticCache

    try:
        return StaticCache(max_cache_len=max_cache_len, config=config)
    except KeyError as error:
        kinds = sorted(set(getattr(config, "layer_types", None) or ()))
        if not error.args or error.args[0] not in kinds:
            raise
        raise ExportError(
            f"transformers' StaticCache has no static layer for layer type {error.args[0]!r} (the config's layer "
            f"types: {', '.join(map(repr, kinds)) or 'none listed'}); aotstack exports generation over a static cache"
        ) from error


class PrefillDecode(torch.nn.Module):
    """A causal LM behind two methods that update one static KV cache held in buffers."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        self.max_cache_len = max_cache_len
        self.lm: torch.nn.Module
        if holds_states(model, max_cache_len):
            self.lm = StateCacheLM(model, max_cache_len)
        else:
            with static_cache_generation(model):
                self.lm = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_cache_len)
            reshape_cache_as_written(self.lm, cache_shapes_written(model, max_cache_len))
        # As model.generate does, a forward that takes positions is given them: derived inside from how full the
        # cache is, they are a size read from data (OPT slices its learned positions at the cache's length), on which
        # torch.export cannot guard.
        self.positions_given = (not isinstance(self.lm, StateCacheLM)
                                and "position_ids" in inspect.signature(model.forward).parameters)
        # Set where the model, given no mask, makes one as long as the cache's fill (BioGPT): a size read from data
        # again. A mask of ones over the whole cache masks nothing the causal mask does not.
        self.mask_given = False

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (shape ``[1, length]``), filling the cache from 0."""
        positions = torch.arange(tokens.shape[1], dtype=torch.long)
        if isinstance(self.lm, StateCacheLM):
            self.lm.starting(True)
        return self.next_logits(tokens, positions)

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``token`` (shape ``[1, 1]``) at cache slot ``position`` (shape ``[1]``)."""
        if isinstance(self.lm, StateCacheLM):
            self.lm.starting(False)
        return self.next_logits(token, position)

    def prefill_chunk(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (shape ``[1, length]``) at cache slots from ``position``
        (shape ``[1]``) on, continuing the sequence the cache holds (from slot 0: starting one)."""
        if isinstance(self.lm, StateCacheLM):
            self.lm.starting(False)
        positions = position + torch.arange(tokens.shape[1], dtype=torch.long, device=position.device)
        return self.next_logits(tokens, positions)

    def next_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits after ``tokens`` (``[1, length]``), written to the cache at ``positions`` (``[length]``)."""
        if isinstance(self.lm, StateCacheLM):
            return self.lm(input_ids=tokens, cache_position=positions)[:, -1, :]
        given = {"position_ids": positions.unsqueeze(0)} if self.positions_given else {}
        return self.cached_logits(positions[0], input_ids=tokens, **given)

    def cached_logits(self, start: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The model's logits after ``inputs`` (its ``input_ids`` or ``inputs_embeds``, ``[1, length, ...]``),
        written to the cache from slot ``start`` on."""
        self.start_cache_at(start)
        outputs = self.lm.model(attention_mask=self.attention_mask(start), past_key_values=self.lm.static_cache,
                                use_cache=True, **inputs)
        return outputs.logits[:, -1, :]

    def clear_cache(self) -> None:
        """Empty the static cache a check before export wrote: the export keeps its buffers' values."""
        for layer in self.lm.static_cache.layers:
            layer.keys.zero_()
            layer.values.zero_()

    def attention_mask(self, start: torch.Tensor) -> torch.Tensor | None:
        """None, as transformers' export wrapper passes; ones over the whole cache where ``mask_given``."""
        if not self.mask_given:
            return None
        return torch.ones(1, self.max_cache_len, dtype=torch.long, device=start.device)

    def start_cache_at(self, start: torch.Tensor) -> None:
        """Set the static cache to write the next tokens from slot ``start`` on.

        A layer with no slots is left alone: Gemma 3n's layers that reuse another layer's keys and
        values write none, so their fill would stay ``start`` itself, and torch.export cannot give
        one value back as the new value of several buffers.
        """
        for layer in self.lm.static_cache.layers:
            if layer.keys is None or layer.keys.numel():
                layer.cumulative_length.copy_(start)


@dataclass(frozen=True)
class ImageGrid:
    """How a model whose processor cuts an image into a grid of patches (Qwen2-VL's, with ``image_grid_thw``)
    sees one image of the export's size: ``patches`` is its ``image_grid_thw`` row (temporal, height, width),
    ``merge`` the patches per side of one image token, ``patch_values`` the values of one patch."""

    patches: tuple[int, int, int]
    merge: int
    patch_values: int

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The image's tokens as a grid: temporal, height and width."""
        time, height, width = self.patches
        return time, height // self.merge, width // self.merge


class ImagePrefillDecode(PrefillDecode):
    """A vision-language model: ``PrefillDecode``'s methods for text alone, plus ``encode_images`` and
    ``prefill_images``, which reads a prompt whose image tokens stand for the features ``encode_images`` gave.

    The features take the image tokens' places in the embedded prompt, as the model's own merge
    puts them; the rest is the model's forward on those embeddings, so any attention the image's
    tokens get besides the causal one (Gemma 3's) stays the model's. ``prompt_inputs`` are the
    processor's outputs beside the token ids that the model's forward reads (``token_type_ids``).

    A model whose processor cuts images into a grid of patches (``ImageGrid``) takes images of one
    size, ``image_size``: what its vision tower derives from the grid (rotary positions, attention
    windows) is computed here once and kept as constants. Where its language model places an image's
    tokens by their row and column (multimodal rotary positions: Qwen2-VL's), ``prefill_images``
    computes the positions from the prompt, and the shift they leave on the positions after the
    prompt is kept in the buffer ``rope_shift``, which ``decode`` adds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_cache_len: int,
        prompt_inputs: tuple[str, ...] = (),
        image_size: tuple[int, int] | None = None,
    ) -> None:
        if holds_states(model, max_cache_len):
            raise ExportError(f"{type(model).__name__}'s decoder keeps recurrent or convolution states beside its "
                              "keys and values (linear attention); aotstack exports a prompt with images only for a "
                              "decoder whose cache holds keys and values alone")
        needs = images_required_by_forward(model)
        if needs:
            raise ExportError(f"{type(model).__name__}'s forward requires {', '.join(needs)} on every call; aotstack "
                              "exports a vision-language model whose forward also runs on text alone, as decode does")
        super().__init__(model, max_cache_len)
        self.prompt_inputs = prompt_inputs
        self.image_token = image_token_id(model)
        self.grid = image_grid(model, image_size) if image_size is not None else None
        self.image_size = image_size
        self.sizes_read = reads_image_sizes(model)
        # Kept in a tuple, not as an attribute: the tower is a submodule of the model already.
        self.grid_tower = vision_tower(model, self.grid) if self.grid is not None else None
        self.positions_by_grid = self.grid is not None and places_tokens_by_grid(model)
        # Qwen3-VL's: features of the vision tower's inner layers, added to the first decoder layers' outputs at
        # the image tokens. encode_images gives them beside the features, on each row.
        self.deepstack = "deepstack_visual_embeds" in inspect.signature(model.get_decoder().forward).parameters
        if self.positions_by_grid:
            self.register_buffer("rope_shift", torch.zeros(1, dtype=torch.long))
            # Its text positions are three rows (multimodal rotary ones) the model derives from the prompt itself.
            self.positions_given = False

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.positions_by_grid:
            self.rope_shift.zero_()
        return super().prefill(tokens)

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if not self.positions_by_grid:
            return super().decode(token, position)
        positions = (position + self.rope_shift).view(1, 1, 1).expand(3, 1, 1)
        return self.cached_logits(position[0], inputs_embeds=self.lm.model.get_input_embeddings()(token),
                                  position_ids=positions)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The features of the images in ``pixel_values``, one row per image token, in the prompt's order."""
        if self.grid_tower is not None:
            # The tower itself: get_image_features splits its output per image by sizes read from the grid
            # (.tolist()), sizes a trace cannot know, which broke engines' parts around the split; one image needs
            # no split. The check against the model's own forward covers a model whose get_image_features does more.
            tower, inputs = self.grid_tower
            features = tower(pixel_values.to(next(tower.parameters()).dtype), return_dict=True, **inputs)
        else:
            features = self.lm.model.get_image_features(pixel_values, return_dict=True, **self.sizes_of(pixel_values))
        rows = [rows_of(features.pooler_output)]
        if self.deepstack:
            rows += [rows_of(layer) for layer in features.deepstack_features]
        return torch.cat(rows, dim=-1)

    def prefill_images(
        self, tokens: torch.Tensor, image_features: torch.Tensor, *prompt_inputs: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (``[1, length]``), filling the cache from 0; its image
        tokens take the rows of ``image_features`` (``encode_images``' rows, image after image) in order.

        The rows are put in place here rather than by the model's forward: its check that they match
        the image tokens formats their count into a message, which would fix it when traced. The
        caller checks the count.
        """
        is_image = tokens == self.image_token
        inputs: dict[str, Any] = dict(zip(self.prompt_inputs, prompt_inputs))
        if self.deepstack:
            hidden = self.lm.model.get_input_embeddings().embedding_dim
            image_features, *inner = image_features.split(hidden, dim=-1)
            inputs.update(visual_pos_masks=is_image, deepstack_visual_embeds=inner)
        merged = embedded_with_features(self.lm.model, tokens, is_image, image_features)
        if self.grid is not None and self.positions_by_grid:
            positions = grid_positions(is_image[0], self.grid.token_grid)
            # Shaped as the buffer: OpenVINO writes a 0-d value to it as 0-d.
            self.rope_shift.copy_((positions.max() + 1 - tokens.shape[1]).reshape(1))
            inputs["position_ids"] = positions
        return self.cached_logits(torch.zeros((), dtype=torch.long), inputs_embeds=merged, **inputs)

    def cached_logits(self, start: torch.Tensor, **inputs: Any) -> torch.Tensor:
        if "deepstack_visual_embeds" not in inputs:
            return super().cached_logits(start, **inputs)
        model = self.lm.model
        # The model's own forward makes these from pixel values, and takes no others: its decoder does.
        self.start_cache_at(start)
        hidden = model.get_decoder()(attention_mask=self.attention_mask(start), past_key_values=self.lm.static_cache,
                                     use_cache=True, **inputs).last_hidden_state
        return model.get_output_embeddings()(hidden[:, -1, :])

    def sizes_of(self, pixel_values: torch.Tensor) -> dict[str, list[tuple[int, int]]]:
        """The ``image_sizes`` a model that reads them takes beside ``pixel_values`` (``[images, ...]``): the
        export's image size for each, Python numbers, which the model splits its features by. For Pixtral's tower
        that is the pixel values' own; for LLaVA-OneVision's, the size of the image its tiles were cut from."""
        if not self.sizes_read:
            return {}
        height, width = self.image_size or pixel_values.shape[-2:]
        return {"image_sizes": [(int(height), int(width))] * pixel_values.shape[0]}

    def reference_inputs(self, tokens: torch.Tensor, images: int) -> dict[str, torch.Tensor]:
        """What the model's own forward takes beside ``tokens`` and the pixel values of ``images`` images, as its
        processor gives them."""
        inputs = {name: image_prompt_input(tokens, self.image_token) for name in self.prompt_inputs}
        if self.sizes_read and self.image_size is not None:
            inputs["image_sizes"] = torch.tensor([self.image_size] * images)
        if self.grid is not None:
            inputs["image_grid_thw"] = torch.tensor([self.grid.patches] * images)
            if "mm_token_type_ids" in inspect.signature(self.lm.model.forward).parameters:
                inputs["mm_token_type_ids"] = image_prompt_input(tokens, self.image_token).int()
        return inputs


def embedded_with_features(model: torch.nn.Module, tokens: torch.Tensor, slots: torch.Tensor,
                           features: torch.Tensor) -> torch.Tensor:
    """``tokens`` (``[1, length]``) embedded by ``model``, with the rows of ``features`` in order in place of the
    tokens where ``slots`` is true (an image's or a clip's tokens), as the models' own merges put them."""
    # A placeholder token may lie outside the embedding table (Gemma 3's image token); its row is replaced anyway.
    embedded = model.get_input_embeddings()(tokens.masked_fill(slots, 0))
    return embedded.masked_scatter(slots.unsqueeze(-1), features.to(embedded.dtype))


def rows_of(features: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Image features (a tensor, or one per image) as rows, image after image."""
    parts = features if isinstance(features, (list, tuple)) else [features]
    return torch.cat([part.reshape(-1, part.shape[-1]) for part in parts])


def cuts_images_into_grids(model: torch.nn.Module) -> bool:
    """Whether a vision-language model takes an image as a grid of patches: its ``get_image_features`` takes
    ``image_grid_thw`` (Qwen2-VL's), not pixels as an image."""
    features = getattr(model, "get_image_features", None)
    return callable(features) and "image_grid_thw" in inspect.signature(features).parameters


def image_grid(model: torch.nn.Module, image_size: tuple[int, int]) -> ImageGrid | None:
    """The grid an image of ``image_size`` (height, width) makes for a model that cuts images into grids; None for
    one that takes pixels as an image."""
    if not cuts_images_into_grids(model):
        return None
    vision = model.config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    height, width = image_size
    if height % (patch * merge) or width % (patch * merge):
        raise ExportError(f"{type(model).__name__} takes images whose sides are multiples of {patch * merge} "
                          f"pixels (patches of {patch}, {merge}x{merge} patches a token); got {height}x{width}")
    channels = getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
    frames = getattr(vision, "temporal_patch_size", 1)
    return ImageGrid((1, height // patch, width // patch), merge, channels * frames * patch * patch)


def vision_tower(model: torch.nn.Module, grid: ImageGrid) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The vision tower of a model whose images are cut into ``grid``, and its inputs for one image besides its
    pixel values: ``grid_thw``, and what the tower derives from it in Python loops (rotary positions, attention
    windows), computed now by transformers' own export preparation; the tower reads them instead of computing
    them."""
    from transformers.exporters.utils import precompute_export_inputs

    grid_thw = torch.tensor([grid.patches])
    towers = [module for module in model.modules() if "grid_thw" in inspect.signature(module.forward).parameters]
    if not towers:
        raise ExportError(f"{type(model).__name__}: no module of its vision tower takes grid_thw")
    derived: dict[str, Any] = {"hidden_states": torch.zeros(math.prod(grid.patches), grid.patch_values),
                               "grid_thw": grid_thw}
    precompute_export_inputs(towers[0], derived)
    return towers[0], {name: value for name, value in derived.items()
                       if name != "hidden_states" and value is not None}


def images_required_by_forward(model: torch.nn.Module) -> list[str]:
    """The inputs besides the prompt that the model's forward cannot go without (BLIP-2's ``pixel_values``)."""
    parameters = inspect.signature(model.forward).parameters.values()
    return [parameter.name for parameter in parameters if parameter.default is inspect.Parameter.empty
            and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and parameter.name != "input_ids"]


def image_sizes_read_by_tower(model: torch.nn.Module) -> bool:
    """Whether the model's vision tower reads each image's height and width beside its pixels (Pixtral's, in Mistral
    3): the processor keeps an image's size, and says it in ``image_sizes``. A model that reads them only to place
    tiles of a larger image (LLaVA-NeXT's) is not one: its sizes are not those of the pixel values."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "vision_tower", None) or getattr(model, "vision_tower", None)
    return isinstance(tower, torch.nn.Module) and "image_sizes" in inspect.signature(tower.forward).parameters


def image_sizes_required(model: torch.nn.Module) -> bool:
    """Whether the model's ``get_image_features`` needs each image's size beside its pixels (LLaVA-NeXT's and
    LLaVA-OneVision's: the image its tiles were cut from, which decides how many tiles and tokens it has)."""
    features = getattr(model, "get_image_features", None)
    if not callable(features):
        return False
    parameter = inspect.signature(features).parameters.get("image_sizes")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def reads_image_sizes(model: torch.nn.Module) -> bool:
    """Whether the model takes each image's size beside its pixels (``image_sizes``), in its tower or to cut tiles:
    the export then takes images of one size, and ``generate`` refuses others."""
    return image_sizes_read_by_tower(model) or image_sizes_required(model)


def places_tokens_by_grid(model: torch.nn.Module) -> bool:
    """Whether a model's language model places an image's tokens by their row and column (multimodal rotary
    positions, ``get_rope_index``), not one after another."""
    return any(callable(getattr(module, "get_rope_index", None)) for module in (model, getattr(model, "model", None)))


# The name of segment_attention among transformers' attention functions: "flash" in it makes a vision tower hand it
# all its segments at once (cu_seqlens), as it hands flash attention's varlen kernel.
SEGMENT_ATTENTION = "aotstack_flash_segments"


@contextmanager
def segments_attended_at_once(model: torch.nn.Module) -> Iterator[None]:
    """A vision tower that attends within segments of its patches (one per image, or Qwen2.5-VL's windows) runs
    :func:`segment_attention` meanwhile.

    Its own loop splits the patches by the segments' lengths, read from a tensor (``.tolist()``):
    torch.export cannot know them, and guards on them (Qwen2.5-VL's windows, at 224 pixels and up).
    """
    vision = getattr(model.config, "vision_config", None)
    if vision is None or not cuts_images_into_grids(model) or "flash" in str(vision._attn_implementation):
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    original = vision._attn_implementation
    vision._attn_implementation = SEGMENT_ATTENTION
    try:
        yield
    finally:
        vision._attn_implementation = original


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` (``[1, heads, length, dim]``) within the segments ``cu_seq_lens_q`` bounds, in one
    call: a mask keeps each position to its own segment. Returns ``[1, length, heads, dim]``, as transformers'
    attention functions do."""
    mask = attention_mask
    if cu_seq_lens_q is not None:
        positions = torch.arange(query.shape[2], device=query.device)
        segment = torch.bucketize(positions, cu_seq_lens_q[1:].to(positions.dtype), right=True)
        mask = segment[:, None] == segment[None, :]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2).contiguous(), None


def grid_positions(is_image: torch.Tensor, token_grid: tuple[int, int, int]) -> torch.Tensor:
    """Multimodal rotary positions (``[3, 1, length]``: temporal, height, width) of a prompt whose tokens are
    images where ``is_image`` (``[length]``), each image a ``token_grid`` of tokens.

    A text token's three positions are its place in a sequence where each image counts as long as its
    longer side; an image's tokens start where the image does, plus their frame, row and column.
    """
    frames, rows, columns = token_grid
    per_image = frames * rows * columns
    image = is_image.long()
    images_seen = image.cumsum(0)
    texts_before = (1 - image).cumsum(0) - (1 - image)
    index = torch.where(is_image, images_seen - 1, 0) % per_image
    images_before = torch.where(is_image, (images_seen - 1) // per_image, images_seen // per_image)
    start = texts_before + max(rows, columns) * images_before
    temporal = start + torch.where(is_image, index // (rows * columns), 0)
    height = start + torch.where(is_image, index // columns % rows, 0)
    width = start + torch.where(is_image, index % columns, 0)
    return torch.stack([temporal, height, width]).unsqueeze(1)


def linear_attention_layer_class() -> type | None:
    """transformers' base of cache layers holding convolution and recurrent states; None where it has none."""
    from transformers import cache_utils

    return getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)


def holds_states(model: torch.nn.Module, max_cache_len: int) -> bool:
    """Whether ``model``'s static cache has a layer of convolution or recurrent states (a hybrid decoder)."""
    cache = static_cache(model.config.get_text_config(), max_cache_len)
    layer_class = linear_attention_layer_class()
    return layer_class is not None and any(isinstance(layer, layer_class) for layer in cache.layers)


class StateCacheLM(torch.nn.Module):
    """A causal LM over a static cache of keys and values and of convolution and recurrent states, held in buffers.

    One token run eagerly through a fresh cache sizes every layer's state as the model writes it;
    then every state is zeroed and registered as a buffer, so both methods update the same ones.
    Whether a call starts a sequence or continues one is a Python flag of each state layer
    (``has_previous_state``), which the model branches on; each method is exported with its own
    (``starting``).
    """

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.cache_utils import StaticSlidingWindowLayer

        self.model = model
        # Mamba's models take their cache as ``cache_params``.
        self.cache_argument = cache_argument(model)
        self.static_cache = static_cache(model.config.get_text_config(), max_cache_len)
        layers = self.static_cache.layers
        for index, layer in enumerate(layers):
            # A sliding window's wrap-around branches on the position: a layer over the whole cache, as transformers'
            # own export wrapper does (a sequence past the window is not supported).
            if isinstance(layer, StaticSlidingWindowLayer):
                layers[index] = over_whole_cache(layer, max_cache_len)
        first = torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device)
        with torch.no_grad():
            model(input_ids=first.reshape(1, 1), cache_position=first, use_cache=True,
                  **{self.cache_argument: self.static_cache})
        self.state_layers: list[Any] = []
        state_class = linear_attention_layer_class()
        for index, layer in enumerate(layers):
            if state_class is not None and isinstance(layer, state_class):
                if all(state is None for kind in ("conv_states", "recurrent_states")
                       for state in getattr(layer, kind).values()):
                    raise ExportError(f"{type(model).__name__} keeps its recurrent states outside its cache (layer "
                                      f"{index}'s stay empty after a call: in its modules' attributes, which an "
                                      "export would freeze); aotstack exports states that transformers' cache holds")
                self.state_layers.append(layer)
                for slot in range(layer.number_of_states):
                    for kind in ("conv_states", "recurrent_states"):
                        state = getattr(layer, kind)[slot]
                        if state is not None:
                            self.register_buffer(f"{kind}_{index}_{slot}", state.zero_(), persistent=False)
                layer.update_conv_state = conv_state_update_for_any_length(layer)
            # Falcon-H1's layers hold both states and keys.
            if getattr(layer, "keys", None) is not None:
                self.register_buffer(f"key_cache_{index}", layer.keys.zero_(), persistent=False)
                self.register_buffer(f"value_cache_{index}", layer.values.zero_(), persistent=False)
                if getattr(layer, "cumulative_length", None) is not None:
                    self.register_buffer(f"cumulative_length_{index}", layer.cumulative_length.zero_(),
                                         persistent=False)
        self.check_against_transformers_cache()

    def check_against_transformers_cache(self) -> None:
        """Raise unless a prompt then two tokens through this cache give the logits transformers' own cache gives
        (or, where that cannot run, the model's without a cache); then clear it.

        The model's branches on its cache are its own: one this wrapper does not drive as the
        model expects would give wrong tokens from the first decoded one, silently. The reference is
        transformers' own cache because a model's cached steps may round differently from its whole
        sequence (Bamba's differ by 7e-3 of the largest logit), and generation runs the former.
        """
        parameter = next(self.model.parameters())
        tokens = torch.tensor([[1, 2, 3, 1]], device=parameter.device)
        with torch.no_grad():
            want = self.reference_logits(tokens)
            self.starting(True)
            self(tokens[:, :2], torch.arange(2, device=tokens.device))
            self.starting(False)
            for position in (2, 3):
                got = self(tokens[:, position:position + 1], torch.tensor([position], device=tokens.device))[0, -1]
        self.clear()
        difference = logits_difference(got, want)
        if not difference <= logits_tolerance(parameter.dtype):
            raise ExportError(
                f"{type(self.model).__name__}: a prompt then two tokens through its cache of states differ from "
                f"transformers' own by {difference:.2g} (relative to its largest logit); aotstack cannot drive "
                "this model's cache for export"
            )

    def continuation_differences(self, length: int) -> tuple[float, float]:
        """How far ``length`` tokens then two more, each call continuing the cache, are from the same tokens as one
        prompt: in the cache they leave (the largest difference of a buffer, relative to its largest value) and
        in the last logits (relative to the largest logit). The cache is cleared after.

        A model whose prompt path starts from zero whatever its cache holds (Mamba's selective scan)
        does not continue a sequence over several tokens. Two tokens are the call after: its missed
        states had one step to decay, where at the end of a longer one they may have faded below
        rounding, with random weights.
        """
        parameter = next(self.model.parameters())
        generator = torch.Generator().manual_seed(0)
        vocabulary = self.model.get_input_embeddings().num_embeddings
        tokens = torch.randint(0, vocabulary, (1, length + 2), generator=generator).to(parameter.device)
        cache = dict(self.named_buffers(recurse=False))
        with torch.no_grad():
            self.starting(True)
            want = self(tokens, torch.arange(length + 2, device=tokens.device))[0, -1]
            whole = {name: buffer.clone() for name, buffer in cache.items()}
            self.clear()
            self.starting(False)
            self(tokens[:, :length], torch.arange(length, device=tokens.device))
            got = self(tokens[:, length:], torch.arange(length, length + 2, device=tokens.device))[0, -1]
        states = max(relative_difference(buffer, whole[name]) for name, buffer in cache.items())
        self.clear()
        return states, logits_difference(got, want)

    def clear(self) -> None:
        """Zero the cache (its buffers, not the model's own, such as rotary frequencies); the next call starts."""
        for state in self.buffers(recurse=False):
            state.zero_()
        self.starting(True)

    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last logits of ``tokens``: its first two as a prompt, then one at a time, through transformers' own
        cache; or, where the model does not run so, in one call without a cache."""
        try:
            output = self.model(input_ids=tokens[:, :2], use_cache=True)
            cache = getattr(output, "past_key_values", None) or getattr(output, "cache_params", None)
            if cache is None:
                raise ValueError("no cache returned")
            for position in range(2, tokens.shape[1]):
                output = self.model(input_ids=tokens[:, position:position + 1], use_cache=True,
                                    cache_position=torch.tensor([position], device=tokens.device),
                                    **{self.cache_argument: cache})
        except Exception:  # noqa: BLE001 - a model whose own cached steps fail: its whole sequence stands
            output = self.model(input_ids=tokens, use_cache=False)
        return output.logits[0, -1]

    def starting(self, starts: bool) -> None:
        """Tell every state layer whether the next call starts a sequence (a prompt) or continues one."""
        for layer in self.state_layers:
            for slot in range(layer.number_of_states):
                layer.has_previous_state[slot] = not starts

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for layer in self.static_cache.layers:
            if getattr(layer, "cumulative_length", None) is not None:
                layer.cumulative_length.copy_(cache_position[0])
        outputs = self.model(input_ids=input_ids, cache_position=cache_position, attention_mask=None,
                             use_cache=True, **{self.cache_argument: self.static_cache})
        return outputs.logits


def over_whole_cache(layer: Any, max_cache_len: int) -> Any:
    """A cache layer of ``layer``'s kind over the whole cache, in place of its sliding window: with its states too
    where it holds convolution or recurrent states beside its keys (Inkling's ``hybrid_sliding`` layers)."""
    from transformers.cache_utils import LinearAttentionAndStaticFullAttentionLayer, StaticLayer

    state_class = linear_attention_layer_class()
    if state_class is not None and isinstance(layer, state_class):
        return LinearAttentionAndStaticFullAttentionLayer(max_cache_len, number_of_states=layer.number_of_states)
    return StaticLayer(max_cache_len)


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference between ``got`` and ``want``, relative to ``want``'s largest value (at least 1e-6)."""
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


def logits_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference between two sets of logits, relative to the largest of ``want`` (at least 1)."""
    return (got.float() - want.float()).abs().max().item() / max(1.0, want.float().abs().max().item())


def logits_tolerance(dtype: torch.dtype) -> float:
    """How far, relative to the largest logit, a wrapper's logits may be from the model's own at ``dtype``."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its cache by: ``past_key_values``, or Mamba's ``cache_params``."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params"):
        if name in parameters:
            return name
    raise ExportError(f"{type(model).__name__}.forward takes no cache (neither past_key_values nor cache_params)")


def conv_state_update_for_any_length(layer: Any) -> Callable[..., torch.Tensor]:
    """``layer.update_conv_state``, but for a prompt of any length without a branch on it.

    transformers pads a prompt shorter than the convolution's kernel before keeping its last
    ``kernel`` columns: a branch on the prompt's length, which export cannot keep dynamic. Padding
    by the whole kernel always keeps the same columns. The prompt itself is returned unpadded: the
    causal convolution that reads it pads with zeros anyway.
    """
    update = layer.update_conv_state

    def kept_for_any_length(conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        if layer.has_previous_state[state_idx]:
            return update(conv_states, state_idx, **kwargs)
        kernel = layer.conv_kernel_size[state_idx]
        layer.conv_states[state_idx].copy_(torch.nn.functional.pad(conv_states, (kernel, 0))[..., -kernel:])
        layer.has_previous_state[state_idx] = True
        return conv_states

    return kept_for_any_length


CacheShape = tuple[int, int, int]  # heads, key width, value width


def cache_shapes_written(model: torch.nn.Module, max_cache_len: int) -> list[CacheShape | None]:
    """What each layer of ``model`` writes to its cache, per token: seen by running one token eagerly.

    transformers' export wrapper sizes every layer's cache from the config's heads and head width.
    A layer that caches something else (DeepSeek's latent attention stores one compressed
    head of ``kv_lora_rank`` values and its rotary key) would fail its first update. None: a
    layer that caches nothing this way.
    """
    first = torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device)
    try:
        cache = static_cache(model.config, max_cache_len)
        with torch.no_grad():
            model(input_ids=first.reshape(1, 1), cache_position=first, past_key_values=cache, use_cache=True)
    except Exception:  # a model whose cache is not transformers' StaticCache: the wrapper's sizes stand
        return []
    return [
        (layer.num_heads, layer.k_head_dim, layer.v_head_dim) if getattr(layer, "is_initialized", False)
        and hasattr(layer, "k_head_dim") else None
        for layer in cache.layers
    ]


def reshape_cache_as_written(wrapper: torch.nn.Module, written: list[CacheShape | None]) -> None:
    """Size, in place, each cache layer of transformers' export ``wrapper`` as its model writes it (``written``)."""
    for index, (layer, shape) in enumerate(zip(wrapper.static_cache.layers, written)):
        keys = getattr(layer, "keys", None)
        if shape is None or keys is None or keys.dim() != 4:
            continue
        heads, key_width, value_width = shape
        if (keys.shape[1], keys.shape[3], layer.values.shape[3]) == shape:
            continue
        empty = keys.new_zeros(keys.shape[0], heads, 0, key_width)
        layer.is_initialized = False
        layer.lazy_initialization(empty, empty.new_zeros(*empty.shape[:3], value_width))
        wrapper.register_buffer(f"key_cache_{index}", layer.keys, persistent=False)
        wrapper.register_buffer(f"value_cache_{index}", layer.values, persistent=False)


def export_decoder_lm(model: torch.nn.Module, max_cache_len: int) -> Program:
    """``prefill`` and ``decode`` exported from one :class:`PrefillDecode`, sharing weights and cache buffers.

    A hybrid decoder whose prompt path cannot be exported for any prompt length gets ``decode``
    and, where chunks of ``PREFILL_CHUNK`` tokens continuing its states match its whole sequence,
    ``prefill_chunk`` (a warning says which): the generation loops feed it the prompt in chunks,
    and the rest one token at a time.
    """
    module = PrefillDecode(model, max_cache_len).eval()
    decode_inputs = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))

    def prefill_and_decode(shortest: int = 1, longest: int = max_cache_len) -> Program:
        return export(
            module,
            {"prefill": (torch.zeros(1, min(4, max_cache_len), dtype=torch.long),), "decode": decode_inputs},
            dynamic_shapes={"prefill": {"tokens": {1: Dim("length", min=shortest, max=longest)}}},
            strict=True,  # the static cache updates tensors it holds outside the module's buffers
        )

    # A failed export only traced the module: its cache is as it was.
    try:
        return prefill_and_decode()
    except ExportError as error:
        if not isinstance(module.lm, StateCacheLM) and guards_on_data(error):
            logger.info("%s guards on a size read from data without a mask; exporting it with one over the whole "
                        "cache", type(model).__name__)
            module.mask_given = True
            return prefill_and_decode()
        if not isinstance(module.lm, StateCacheLM) and constrains_length(error):
            # Mllama's text decoder branches on a prompt of one token, and its mask on one that fills the cache: its
            # prefill takes the prompts between, and a prompt of one token goes through decode
            # (``decoding.prompt_logits``); one that fills the cache leaves no room to answer.
            logger.info("%s guards the prompt's length; exporting prefill for 2 to %d tokens", type(model).__name__,
                        max_cache_len - 1)
            return prefill_and_decode(2, max_cache_len - 1)
        if not (isinstance(module.lm, StateCacheLM) and constrains_length(error)):
            raise
    # A prompt path that loops in Python over the prompt's length or its chunks (Mamba's selective scan, a chunked
    # delta rule) does not export with the length dynamic. Decode alone does: from zeroed states it starts a
    # sequence as a prompt would, so the prompt goes through it (``decoding.prompt_logits``): in chunks of a fixed
    # length where the model continues its states over several tokens, the rest one token at a time.
    # The failed export only traced the module: its cache is still the zeroed state a sequence starts from.
    loops = (f"{type(model).__name__}: its prompt path loops in Python over the prompt's length, which torch.export "
             "cannot keep dynamic")
    # At most half the cache: a prompt leaves room for its answer.
    chunk = min(PREFILL_CHUNK, max_cache_len // 2)
    why_not = chunks_refused(module.lm, chunk)
    if why_not is None:
        try:
            program = export(
                module,
                {"decode": decode_inputs, "prefill_chunk": (torch.zeros(1, chunk, dtype=torch.long), decode_inputs[1])},
                strict=True,
            )
        except ExportError as error:
            why_not = f"prefill_chunk did not export ({str(error).splitlines()[0][:200]})"
        else:
            logger.warning("%s; exporting decode and prefill_chunk, which takes a prompt %d tokens at a time (the "
                           "rest one at a time)", loops, chunk)
            return program
    logger.warning("%s; exporting decode alone, which takes a prompt one token at a time (%s)", loops, why_not)
    return export(module, {"decode": decode_inputs}, strict=True)


def constrains_length(error: BaseException) -> bool:
    """Whether torch.export refused a method for guarding its ``length`` (the prompt's) to a narrower range than
    the one asked for."""
    return "Constraints violated (length)" in str(error)


def guards_on_data(error: BaseException) -> bool:
    """Whether torch.export refused a method, in ``error`` or what it came from, for guarding on a size it read from
    a tensor's data."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return caused_by(error, GuardOnDataDependentSymNode)


def export_image_text_lm(
    model: torch.nn.Module,
    max_cache_len: int,
    image_size: tuple[int, int],
    prompt_inputs: tuple[str, ...] = (),
    image_layout: tuple[int, ...] | None = None,
) -> Program:
    """``prefill`` and ``decode`` of :func:`export_decoder_lm`, plus ``encode_images`` (one image) and
    ``prefill_images`` (a prompt whose image tokens take the features of its images, in order), from one
    :class:`ImagePrefillDecode`: one set of weights and one cache.

    Images are ``image_size`` (height, width), as the model's processor makes them. One image a
    call: several models' features are a Python list per image, which fixes their count when traced.
    ``prompt_inputs`` name the processor's other outputs the model's forward reads (Gemma 3's
    ``token_type_ids``); ``prefill_images`` takes them after the features, each shaped as the token ids.
    Before export, ``prefill_images`` is checked against the model's own forward over the same
    prompt and images (two where they fit in the cache): a model that treats a prompt with images in
    a way this cannot follow (PaliGemma's attention over its prefix, which it gives only a first
    call) is refused. ``image_layout`` is the shape of one image's pixel values in the sample, which a
    model that cuts an image into tiles of its own (LLaVA-OneVision's) takes as they are.
    """
    with segments_attended_at_once(model):
        module = ImagePrefillDecode(model, max_cache_len, prompt_inputs, image_size).eval()
        image, features = example_image(module, image_size, image_layout)
        rows = features.shape[0]
        # Two images where they fit with room to answer (their order is checked too), else one: LLaVA 1.5's two take
        # 1,152 tokens, more than the default cache. Text before, between and after them checks where their tokens
        # are placed (a processor separates images: Qwen2-VL's own forward takes adjacent ones for one).
        count = 2 if 2 * rows + 5 < max_cache_len else 1
        image_tokens = [module.image_token] * rows
        tokens = torch.tensor([[1, 2] + (image_tokens + [1]) * count + [2]], dtype=torch.long)
        refuse_without_room(model, "an image", rows, tokens.shape[1], max_cache_len)
        check_images_prompt(module, tokens, image, count)
        length = Dim("length", min=1, max=max_cache_len)
        # Qwen3-VL's decoder adds its inner image features at the rows a mask picks, a count torch cannot tell from 1
        # (which would broadcast): it guards on two rows at least.
        image_rows = Dim("image_rows", min=2 if module.deepstack else 1, max=max_cache_len - 1)
        # A prompt leaves at least one slot for its answer (Gemma 3's image mask guards on it).
        prompt_length = Dim("prompt_length", min=2, max=max_cache_len - 1)
        decode_inputs = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        return export(
            module,
            {
                "prefill": (torch.zeros(1, min(4, max_cache_len), dtype=torch.long),),
                "decode": decode_inputs,
                "encode_images": (image,),
                "prefill_images": (tokens, features.repeat(count, 1),
                                   *(image_prompt_input(tokens, module.image_token) for _ in prompt_inputs)),
            },
            dynamic_shapes={
                "prefill": {"tokens": {1: length}},
                # The prompt inputs are one more element (a tuple, as *args) only where there are any.
                "prefill_images": ({1: prompt_length}, {0: image_rows},
                                   *([tuple({1: prompt_length} for _ in prompt_inputs)] if prompt_inputs else [])),
            },
            # The methods that update the static cache are traced strictly; encode_images holds none, and TorchDynamo
            # reads numpy on a shape there as a branch on data (LLaVA-NeXT's np.prod over an image's features).
            strict={"prefill": True, "decode": True, "encode_images": False, "prefill_images": True},
        )


def refuse_without_room(model: torch.nn.Module, what: str, rows: int, sample_length: int, max_cache_len: int) -> None:
    """Refuse, before anything is traced, an image or clip (``what``) of ``rows`` tokens whose sample prompt of
    ``sample_length`` tokens leaves no room for an answer in the cache."""
    if sample_length >= max_cache_len:
        raise ExportError(f"{type(model).__name__}: {what} takes {rows} tokens, which leave no room for a prompt and "
                          f"its answer in the cache's {max_cache_len} slots; export with a larger max_cache_len")


def example_image(
    module: ImagePrefillDecode, image_size: tuple[int, int], image_layout: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random image of ``image_size`` as the model's ``get_image_features`` takes it (``[1, channels, height,
    width]``; ``[1, 1, channels, height, width]`` for a model whose processor tiles an image, SmolVLM's; its
    patches' rows for one that cuts it into a grid, ``ImageGrid``), and the features ``module.encode_images``
    gives it; for a model that takes each image's size beside its tiles (LLaVA-OneVision's), ``image_layout``, the
    sample's own."""
    model = module.lm.model
    if not callable(getattr(model, "get_image_features", None)):
        raise ExportError(f"{type(model).__name__} has no get_image_features: aotstack exports a vision-language "
                          "model's images through it")
    generator = torch.Generator().manual_seed(0)
    if module.grid is not None:
        layouts = [torch.randn(math.prod(module.grid.patches), module.grid.patch_values, generator=generator)]
    elif image_sizes_required(model) and image_layout is not None:
        layouts = [torch.randn(1, *image_layout[1:], generator=generator)]
    else:
        vision = getattr(model.config, "vision_config", None)
        flat = torch.randn(1, getattr(vision, "num_channels", 3), *image_size, generator=generator)
        layouts = [flat, flat.unsqueeze(0)]
    failures = []
    for image in layouts:
        image = image.to(model.dtype)
        try:
            with torch.no_grad():
                features = module.encode_images(image)
        # The model's own code, probed with each layout; whatever it raises says the layout is not its.
        except Exception as error:
            failures.append(f"{tuple(image.shape)}: {str(error).splitlines()[0][:200]}")
        else:
            return image, features
    raise ExportError(f"{type(model).__name__}.get_image_features takes no image of pixel values alone ("
                      + "; ".join(failures) + "): it needs more of its processor's outputs than aotstack exports")


def check_images_prompt(module: ImagePrefillDecode, tokens: torch.Tensor, image: torch.Tensor, count: int) -> None:
    """Refuse a model whose own forward, given ``tokens`` and ``count`` (1 or 2) images made from ``image``, is not
    what ``module.prefill_images`` gives."""
    model = module.lm.model
    # SmolVLM's tiles count as images, a prompt's along its second dimension; LLaVA-OneVision's make one image.
    axis = 1 if image.dim() == 5 and not image_sizes_required(model) else 0
    images = torch.cat([image, image.flip(-1)][:count], dim=axis)
    reference_inputs = module.reference_inputs(tokens, count)
    with torch.no_grad():
        try:
            want = model(input_ids=tokens, pixel_values=images, **reference_inputs).logits[:, -1, :]
        except Exception as error:  # the model's own forward, on a prompt its processor could have made
            raise ExportError(f"{type(model).__name__}'s own forward fails on a prompt with {count} image(s) of "
                              f"{tuple(image.shape)}: {str(error).splitlines()[0][:300]}") from error
        finally:
            forget_rope_shifts(model)
        features = torch.cat([module.encode_images(one) for one in single_images(images, image.shape)])
        got = module.prefill_images(tokens, features, *(reference_inputs[name] for name in module.prompt_inputs))
        module.clear_cache()
        if module.positions_by_grid:
            module.rope_shift.zero_()
    refuse_unfollowed_prompt(model, got, want, "images", "its features put in place of its image tokens")


def refuse_unfollowed_prompt(
    model: torch.nn.Module, got: torch.Tensor, want: torch.Tensor, media: str, placed: str
) -> None:
    """Refuse a model whose own forward over a prompt with ``media`` gives logits (``want``) other than the export's
    merge (``got``: ``placed`` says how it puts the features in)."""
    difference = logits_difference(got, want)
    if difference > logits_tolerance(model.dtype):
        raise ExportError(
            f"{type(model).__name__}: a prompt with {media}, {placed}, gives logits {difference:.2g} off (relative "
            f"to the largest) from the model's own forward: it reads a prompt with {media} in a way aotstack's "
            "export does not follow"
        )


def forget_rope_shifts(model: torch.nn.Module) -> None:
    """Drop the rotary position shift that a forward over a prompt with images leaves on a model with
    multimodal positions (``rope_deltas``): its later calls would apply it, and tracing one would read it."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def image_prompt_inputs(model: torch.nn.Module) -> tuple[str, ...]:
    """The processor outputs besides token ids and images that a vision-language model's forward reads: Gemma 3's
    ``token_type_ids``, which mark its images' tokens for the attention they get among themselves."""
    return ("token_type_ids",) if "token_type_ids" in inspect.signature(model.forward).parameters else ()


def image_token_id(model: torch.nn.Module) -> int:
    """The token id a vision-language model's prompt holds where an image's features go."""
    config = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ExportError(f"{type(model).__name__}'s config names no image token (image_token_id)")


def typical_step_inputs(program: Program, max_cache_len: int) -> dict[str, CallInputs]:
    """The inputs ``lower(..., "auto")`` times a generation export's ``decode`` on: its example inputs with the
    position (its last argument, in ``export_decoder_lm``'s and ``export_encoder_decoder_lm``'s) halfway into the
    cache.

    ``decode`` is exported at position 0, where an attention that reads only the keys filled so
    far reads one; a reply's tokens fall halfway into the cache on average, and there such an
    engine reads as many keys as half the cache, against one that reads the whole cache either way.
    """
    exported = program.methods.get("decode")
    if exported is None or exported.example_inputs is None:
        return {}
    args, kwargs = exported.example_inputs
    return {"decode": ((*args[:-1], torch.tensor([max_cache_len // 2])), dict(kwargs))}


def chunks_refused(wrapper: StateCacheLM, chunk: int) -> str | None:
    """Why ``wrapper`` cannot take a prompt in chunks of ``chunk`` tokens; None where it can."""
    if chunk < 2:
        return "the cache is too short for chunks of two tokens or more"
    states, logits = wrapper.continuation_differences(chunk)
    tolerance = logits_tolerance(next(wrapper.model.parameters()).dtype)
    if not (states <= tolerance and logits <= tolerance):
        return (f"a prompt in two calls leaves a cache {states:.2g} off (relative to its largest value), and logits "
                f"{logits:.2g} off (relative to the largest logit), from the same prompt in one call: its prompt "
                "path does not continue from its states")
    return None


def sample_image_size(
    model: torch.nn.Module,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    image_sizes: torch.Tensor | None = None,
) -> tuple[int, int]:
    """The height and width of the images in a sample's ``pixel_values``: their last two sides, or for a model
    whose processor cuts images into a grid of patches, the first image's grid (``image_grid_thw``) in pixels, or
    where the processor gives each image's size (``image_sizes``), the first's."""
    if image_sizes is not None and reads_image_sizes(model):
        height, width = (int(side) for side in torch.as_tensor(image_sizes).reshape(-1, 2)[0])
        return height, width
    if image_grid_thw is not None:
        _, height, width = (int(side) for side in image_grid_thw.reshape(-1, 3)[0])
        patch = model.config.vision_config.patch_size
        return height * patch, width * patch
    if pixel_values.dim() < 3:
        raise ExportError(f"pixel values of shape {tuple(pixel_values.shape)} are rows of patches: give the "
                          "processor's image_grid_thw beside them, or pixel values of [1, channels, height, width]")
    return int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
