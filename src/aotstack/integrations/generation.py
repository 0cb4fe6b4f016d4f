"""Generative ``transformers`` models as one program of several methods sharing weights and a static KV cache.

- A decoder-only LM becomes ``prefill(tokens)`` (a prompt of 1 to ``max_cache_len`` tokens, from
  cache slot 0) and ``decode(token, position)`` (one token at cache slot ``position``).
(An encoder-decoder LM becomes ``encode`` and ``decode``: see ``seq2seq``.)

Both methods are exported from one module, so they read the same weights and update the same
cache buffers; a saved file holds each once. The loops of ``decoding`` run an eager module and a
loaded file alike.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.export import Dim

from ..compile.export import Program, export


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


class PrefillDecode(torch.nn.Module):
    """A causal LM behind two methods that update one static KV cache held in buffers."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        self.max_cache_len = max_cache_len
        with static_cache_generation(model):
            self.lm = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_cache_len)
        reshape_cache_as_written(self.lm, cache_shapes_written(model, max_cache_len))

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (shape ``[1, length]``), filling the cache from 0."""
        positions = torch.arange(tokens.shape[1], dtype=torch.long)
        return self.lm(input_ids=tokens, cache_position=positions)[:, -1, :]

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``token`` (shape ``[1, 1]``) at cache slot ``position`` (shape ``[1]``)."""
        return self.lm(input_ids=token, cache_position=position)[:, -1, :]


CacheShape = tuple[int, int, int]  # heads, key width, value width


def cache_shapes_written(model: torch.nn.Module, max_cache_len: int) -> list[CacheShape | None]:
    """What each layer of ``model`` writes to its cache, per token: seen by running one token eagerly.

    transformers' export wrapper sizes every layer's cache from the config's heads and head width.
    A layer that caches something else (DeepSeek's latent attention stores one compressed
    head of ``kv_lora_rank`` values and its rotary key) would fail its first update. None: a
    layer that caches nothing this way.
    """
    from transformers import StaticCache

    first = torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device)
    try:
        cache = StaticCache(max_cache_len=max_cache_len, config=model.config)
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
    """``prefill`` and ``decode`` exported from one :class:`PrefillDecode`, sharing weights and cache buffers."""
    module = PrefillDecode(model, max_cache_len).eval()
    length = Dim("length", min=1, max=max_cache_len)
    return export(
        module,
        {"prefill": (torch.zeros(1, min(4, max_cache_len), dtype=torch.long),),
         "decode": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))},
        dynamic_shapes={"prefill": {"tokens": {1: length}}},
        strict=True,  # the static cache updates tensors it holds outside the module's buffers
    )
