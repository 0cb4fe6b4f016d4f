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

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (shape ``[1, length]``), filling the cache from 0."""
        positions = torch.arange(tokens.shape[1], dtype=torch.long)
        return self.lm(input_ids=tokens, cache_position=positions)[:, -1, :]

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``token`` (shape ``[1, 1]``) at cache slot ``position`` (shape ``[1]``)."""
        return self.lm(input_ids=token, cache_position=position)[:, -1, :]


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
