"""The models the benchmarks time, each a function giving ``(model, forward args)``, seeded.

Child processes rebuild a workload by its name in ``WORKLOADS`` (``bench/`` and the repository root
are on their path), so a parent and its children compile the same model.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

import aotstack
from aotstack.demo import demo_model

Workload = tuple[torch.nn.Module, tuple[Any, ...]]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The four blocks of the parallel-compile benchmark: widths differ, so every partition is its own compile.
JOBS_WIDTHS = (64, 96, 128, 160, 192)
# The boundary benchmark's chain: silu, gelu, silu between four equal blocks. Excluding gelu splits it in two,
# gelu and silu in four, while the arithmetic stays the same.
BOUNDARY_SEPARATORS = ("silu", "gelu", "silu")
LARGE_WIDTH, LARGE_LAYERS = 5000, 5  # 5 x Linear(5000, 5000): 500.1 MB of float32


def mlp() -> Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return model.eval(), (torch.randn(8, 64),)


def demo() -> Workload:
    """The bundled demo's ``forward``."""
    model, inputs = demo_model()
    return model, inputs["forward"]


def corpus(name: str) -> Workload:
    """A model of the test suite's ``transformers`` corpus (small config, random weights, no download)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests import hf_models

    return hf_models.build(name), hf_models.example_inputs(name)


class Chain(torch.nn.Module):
    """``Linear`` blocks with an activation between each two: the activations are where a package splits."""

    def __init__(self, widths: Sequence[int], separators: Sequence[str]) -> None:
        super().__init__()
        assert len(separators) == len(widths) - 2
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.separators = list(separators)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index < len(self.separators):
                x = getattr(torch.nn.functional, self.separators[index])(x)
        return x


def chain(widths: Sequence[int], separators: Sequence[str], batch: int = 8) -> Workload:
    torch.manual_seed(0)
    return Chain(widths, separators).eval(), (torch.randn(batch, widths[0]),)


def jobs_chain() -> Workload:
    """Four blocks of different widths between gelus: four distinct partitions once gelu is excluded."""
    return chain(JOBS_WIDTHS, ["gelu"] * (len(JOBS_WIDTHS) - 2))


def boundary_chain() -> Workload:
    return chain([64] * (len(BOUNDARY_SEPARATORS) + 2), BOUNDARY_SEPARATORS)


def large() -> Workload:
    """A few large ``Linear`` layers, all supported: about 500 MB of float32 weights."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index in range(LARGE_LAYERS):
        layers.append(torch.nn.Linear(LARGE_WIDTH, LARGE_WIDTH))
        if index < LARGE_LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).eval(), (torch.randn(1, LARGE_WIDTH),)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": mlp,
    "demo": demo,
    "bert": lambda: corpus("bert"),
    "llama": lambda: corpus("llama"),
    "jobs_chain": jobs_chain,
    "boundary_chain": boundary_chain,
    "large": large,
}


# The peers benchmark's models (bench/peers.py): full size, and much smaller ones for --quick.
# Seeded random weights, no downloads. BERT 28.8 M parameters, ResNet-50 23.5 M, Llama 99.5 M.
PEER_BERT = {"full": {"vocab_size": 30522, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                      "intermediate_size": 2048},
             "quick": {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 512}}
PEER_BERT_LENGTH = {"full": 128, "quick": 32}
PEER_RESNET = {"full": {},  # transformers' default ResNetConfig: ResNet-50
               "quick": {"embedding_size": 16, "hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1]}}
PEER_IMAGE = {"full": 224, "quick": 64}
PEER_LLAMA = {"full": {"vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12,
                       "num_key_value_heads": 4, "intermediate_size": 2048},
              "quick": {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "intermediate_size": 256}}


class Field(torch.nn.Module):
    """``model(x).<field>``: one plain tensor out, so every engine's output compares the same way."""

    def __init__(self, model: torch.nn.Module, field: str) -> None:
        super().__init__()
        self.model = model
        self.field = field

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(x), self.field)


def peer_bert(size: str = "full") -> Workload:
    """A BERT encoder, batch 1: token ids in, the last hidden state out."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(**PEER_BERT[size])
    ids = torch.randint(0, config.vocab_size, (1, PEER_BERT_LENGTH[size]), generator=torch.Generator().manual_seed(1))
    return Field(BertModel(config).eval(), "last_hidden_state").eval(), (ids,)


def peer_resnet(size: str = "full") -> Workload:
    """ResNet-50 (``--quick``: a narrow, one-block-per-stage one), one image in, the logits out."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(**PEER_RESNET[size])).eval()
    side = PEER_IMAGE[size]
    image = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(2))
    return Field(model, "logits").eval(), (image,)


def peer_llama(size: str = "full", cache: int = 256) -> torch.nn.Module:
    """A Llama-style causal LM with grouped-query attention, set up for a static KV cache of ``cache``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PEER_LLAMA[size], max_position_embeddings=cache)).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


WORKLOADS.update({
    "peer_bert": lambda: peer_bert("full"),
    "peer_bert_quick": lambda: peer_bert("quick"),
})


# A quantized row's scheme: (linear, embedding, group size) as ``aotstack.quantize`` takes them.
QUANTIZED = {"8w": ("8w", "8w", 0), "8da8w": ("8da8w", "8w", 0), "4w": ("4w", "4w", 32), "8da4w": ("8da4w", "4w", 32)}


def quantized(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """``model`` quantized in place with the scheme ``dtype`` names; float32 and bfloat16 models unchanged."""
    if dtype not in QUANTIZED:
        return model
    linear, embedding, group_size = QUANTIZED[dtype]
    with contextlib.redirect_stdout(io.StringIO()):  # torchao prints its missing CUDA libraries
        return aotstack.quantize(model, linear=linear, embedding=embedding, group_size=group_size)


def weights_at_bits(model: torch.nn.Module, dtype: str) -> int:
    """Bytes of ``model``'s parameters and buffers, a quantized weight's values at their bit width.

    torchao keeps an int4 value in an int8 (``qdata``): counted here as half a byte, the size a
    packed kernel reads; scales and zero points as stored.
    """
    linear, embedding, _ = QUANTIZED.get(dtype, (None, None, 0))
    bits = {torch.nn.Linear: linear, torch.nn.Embedding: embedding}
    total, seen = 0, set()
    for module in model.modules():
        scheme = next((bits[kind] for kind in bits if isinstance(module, kind)), None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if type(tensor) in (torch.Tensor, torch.nn.Parameter):
                total += tensor.numel() * tensor.element_size()
                continue
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                value_bits = 4 if name == "qdata" and scheme in ("4w", "8da4w") else 8 * inner.element_size()
                total += inner.numel() * value_bits // 8
    return total
