"""A corpus of real ``transformers`` architectures: small configs, seeded random weights, no downloads.

Each entry builds the model a user would ship, wrapped only so that it returns plain tensors,
and the example inputs its ``forward`` takes. A child process rebuilds the same ones by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Small but real: every architectural feature (GQA, rotary, relative position buckets,
# convolutional feature extractors) is there, only the sizes shrink.
TEXT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4}


class Outputs(torch.nn.Module):
    """``model(**inputs)`` with the named fields of its output as a plain tuple."""

    def __init__(self, model: torch.nn.Module, fields: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.fields = fields

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = self.model(*args)
        return tuple(getattr(output, field) for field in self.fields)


class WhisperEncoder(torch.nn.Module):
    """Whisper's audio encoder on its own: log-mel frames in, hidden states out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features).last_hidden_state


@dataclass(frozen=True)
class Architecture:
    """One corpus entry: how to build the model and its example inputs."""

    name: str
    kind: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]


def tokens(batch: int = 2, length: int = 8, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def token_inputs() -> tuple[torch.Tensor, ...]:
    return (tokens(),)


def token_and_mask_inputs() -> tuple[torch.Tensor, ...]:
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return ids, mask


def seq2seq_inputs() -> tuple[torch.Tensor, ...]:
    return tokens(), torch.ones_like(tokens()), tokens(length=5)


def image_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)),)


def audio_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 1600, generator=torch.Generator().manual_seed(3)),)


def mel_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(1, 16, 100, generator=torch.Generator().manual_seed(4)),)


def seeded(factory: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return factory().eval()

    return build


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TEXT, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return Outputs(LlamaForCausalLM(config), ("logits",))


def qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TEXT, num_key_value_heads=1, max_position_embeddings=64, use_cache=False)
    return Outputs(Qwen2ForCausalLM(config), ("logits",))


def gemma() -> torch.nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(**TEXT, num_key_value_heads=1, head_dim=8, max_position_embeddings=64, use_cache=False)
    return Outputs(GemmaForCausalLM(config), ("logits",))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return Outputs(GPT2LMHeadModel(config), ("logits",))


def mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**TEXT, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, use_cache=False)
    return Outputs(MixtralForCausalLM(config), ("logits",))


def qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**TEXT, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64, use_cache=False)
    return Outputs(Qwen3MoeForCausalLM(config), ("logits",))


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return Outputs(BertModel(BertConfig(**TEXT, max_position_embeddings=64)), ("last_hidden_state", "pooler_output"))


def roberta() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(**TEXT, max_position_embeddings=64, num_labels=3)
    return Outputs(RobertaForSequenceClassification(config), ("logits",))


def deberta_v2() -> torch.nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    # Disentangled attention: content-to-position and position-to-content scores gathered from log buckets of the
    # relative distance.
    config = DebertaV2Config(**TEXT, max_position_embeddings=64, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=32,
                             num_labels=3)
    return Outputs(DebertaV2ForSequenceClassification(config), ("logits",))


def t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, use_cache=False)
    return Outputs(T5ForConditionalGeneration(config), ("logits",))


def bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=64, use_cache=False)
    return Outputs(BartForConditionalGeneration(config), ("logits",))


def resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
    return Outputs(ResNetForImageClassification(config), ("logits",))


def convnext() -> torch.nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
    return Outputs(ConvNextForImageClassification(config), ("logits",))


def vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, num_labels=5)
    return Outputs(ViTForImageClassification(config), ("logits",))


def efficientnet() -> torch.nn.Module:
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    # hidden_dim is the head's pooling window too (1280 in B0, over a 7x7 map), wider than its input.
    config = EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                                num_labels=5)
    return Outputs(redrawn(EfficientNetForImageClassification(config)), ("logits",))


def beit() -> torch.nn.Module:
    from transformers import BeitConfig, BeitForImageClassification

    config = BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, use_relative_position_bias=True, num_labels=5)
    return Outputs(BeitForImageClassification(config), ("logits",))


def swin() -> torch.nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    # Two blocks a stage: the second attends within windows shifted by half a window (a roll and a mask).
    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        num_labels=5)
    return Outputs(SwinForImageClassification(config), ("logits",))


def redrawn(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn anew: a head whose initial features are all zero would hide any error."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    return model


def wav2vec2() -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    return Outputs(Wav2Vec2Model(config), ("last_hidden_state",))


def whisper() -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=50, max_target_positions=32,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return WhisperEncoder(WhisperForConditionalGeneration(config))


CORPUS = {
    arch.name: arch
    for arch in (
        Architecture("llama", "decoder LM (GQA, rotary)", seeded(llama), token_inputs),
        Architecture("qwen2", "decoder LM (GQA, rotary)", seeded(qwen2), token_inputs),
        Architecture("gemma", "decoder LM (MQA, rotary)", seeded(gemma), token_inputs),
        Architecture("gpt2", "decoder LM", seeded(gpt2), token_inputs),
        Architecture("mixtral", "mixture of experts", seeded(mixtral), token_inputs),
        Architecture("qwen3_moe", "mixture of experts", seeded(qwen3_moe), token_inputs),
        Architecture("bert", "encoder", seeded(bert), token_and_mask_inputs),
        Architecture("roberta", "encoder", seeded(roberta), token_and_mask_inputs),
        Architecture("deberta_v2", "relative-position encoder", seeded(deberta_v2), token_and_mask_inputs),
        Architecture("t5", "encoder-decoder", seeded(t5), seq2seq_inputs),
        Architecture("bart", "encoder-decoder", seeded(bart), seq2seq_inputs),
        Architecture("resnet", "convolutional vision", seeded(resnet), image_inputs),
        Architecture("convnext", "convolutional vision", seeded(convnext), image_inputs),
        Architecture("efficientnet", "convolutional vision", seeded(efficientnet), image_inputs),
        Architecture("vit", "transformer vision", seeded(vit), image_inputs),
        Architecture("beit", "transformer vision", seeded(beit), image_inputs),
        Architecture("swin", "shifted-window vision", seeded(swin), image_inputs),
        Architecture("wav2vec2", "speech encoder", seeded(wav2vec2), audio_inputs),
        Architecture("whisper", "speech encoder", seeded(whisper), mel_inputs),
    )
}


def build(name: str) -> torch.nn.Module:
    return CORPUS[name].build()


def example_inputs(name: str) -> tuple[torch.Tensor, ...]:
    return CORPUS[name].inputs()
