"""Encoder-decoder ``transformers`` models as one program of ``encode`` and ``decode`` methods.

``encode(input_ids)`` gives the encoder's hidden states; ``decode(token, encoder_hidden_states, position)``
gives the next token's logits, updating a static self-attention cache held in buffers.
"""

from __future__ import annotations

import torch
from torch.export import Dim

from ..compile.export import Program, export


class EncoderDecoderLM(torch.nn.Module):
    """A sequence-to-sequence LM behind ``encode`` and ``decode``; the decoder's self-attention cache is static."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import (
            Seq2SeqLMDecoderExportableModuleWithStaticCache,
            Seq2SeqLMEncoderExportableModule,
        )

        self.max_cache_len = max_cache_len
        self.encoder = Seq2SeqLMEncoderExportableModule(model.get_encoder())
        self.decoder = Seq2SeqLMDecoderExportableModuleWithStaticCache(model, max_cache_len, batch_size=1)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's hidden states for ``input_ids`` (shape ``[1, length]``)."""
        return self.encoder(input_ids)

    def decode(self, token: torch.Tensor, encoder_hidden_states: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next decoder token after ``token`` (``[1, 1]``) at cache slot ``position`` (``[1]``)."""
        return self.decoder(token, encoder_hidden_states, position)[:, -1, :]


def export_encoder_decoder_lm(model: torch.nn.Module, max_cache_len: int, max_source_len: int) -> Program:
    """``encode`` and ``decode`` of one :class:`EncoderDecoderLM`; sources of 2 to ``max_source_len`` tokens.

    Each half is exported on its own (a strict export of ``decode`` as a method of the whole
    module trips over cross-attention tensors Dynamo lifts), so each method names its weights
    from its own half; the file stores a weight both read once all the same, by content.
    """
    module = EncoderDecoderLM(model, max_cache_len).eval()
    hidden = getattr(model.config, "d_model", None) or model.config.hidden_size
    source = Dim("source", min=2, max=max_source_len)
    encode = export(module.encoder, {"forward": (torch.zeros(1, 4, dtype=torch.long),)},
                    dynamic_shapes={"forward": {"input_ids": {1: source}}}, strict=True)
    decode = export(
        module.decoder,
        {"forward": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4, hidden), torch.zeros(1, dtype=torch.long))},
        dynamic_shapes={"forward": {"decoder_input_ids": None, "encoder_hidden_states": {1: source},
                                    "cache_position": None}},
        strict=True,
    )
    return Program({"encode": encode.methods["forward"], "decode": decode.methods["forward"]})
