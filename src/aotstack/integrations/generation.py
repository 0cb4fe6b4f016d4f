"""Generative ``transformers`` models as one program of several methods sharing weights and a static KV cache.

- A decoder-only LM becomes ``prefill(tokens)`` (a prompt of 1 to ``max_cache_len`` tokens, from
  cache slot 0) and ``decode(token, position)`` (one token at cache slot ``position``).
- An encoder-decoder LM becomes ``encode(input_ids)`` (the encoder's hidden states) and
  ``decode(token, encoder_hidden_states, position)``.

Both methods are exported from one module, so they read the same weights and update the same
cache buffers; a saved file holds each once. The greedy loops run an eager module and a loaded
file alike.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

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


class DecoderProgram(Protocol):
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor: ...
    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor: ...


def greedy_decoder(
    program: DecoderProgram | Any,
    prompt: list[int],
    max_new_tokens: int,
    eos: Collection[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The tokens greedy decoding appends to ``prompt``; it stops after an ``eos`` token, as ``generate`` does.

    ``program`` is a :class:`PrefillDecode` or a file loaded from one. ``prefill`` writes the cache
    from slot 0 and the causal mask hides the slots after it, so an earlier prompt's cache is harmless.
    ``on_token`` is told each token as it is chosen.
    """
    tokens: list[int] = []
    if max_new_tokens < 1:
        return tokens
    with torch.no_grad():
        logits = program.prefill(torch.tensor([prompt]))
        for position in range(len(prompt), len(prompt) + max_new_tokens):
            tokens.append(int(logits.argmax(dim=-1)))
            if on_token is not None:
                on_token(tokens[-1])
            if tokens[-1] in eos or len(tokens) == max_new_tokens:
                break
            logits = program.decode(torch.tensor([[tokens[-1]]]), torch.tensor([position]))
    return tokens


def greedy_encoder_decoder(
    program: Any,
    prompt: list[int],
    max_new_tokens: int,
    start: int,
    eos: Collection[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The decoder tokens greedy decoding gives after ``start`` for source ``prompt``; stops after ``eos``."""
    tokens: list[int] = []
    with torch.no_grad():
        encoded = program.encode(torch.tensor([prompt]))
        state = (encoded,) if isinstance(encoded, torch.Tensor) else tuple(encoded)
        previous = start
        for position in range(max_new_tokens):
            logits = program.decode(torch.tensor([[previous]]), *state, torch.tensor([position]))
            previous = int(logits.argmax(dim=-1))
            tokens.append(previous)
            if on_token is not None:
                on_token(previous)
            if previous in eos:
                break
    return tokens
