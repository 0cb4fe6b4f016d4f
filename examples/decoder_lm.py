"""A decoder language model in one file: ``prefill`` and ``decode`` sharing one set of weights and one KV cache.

Run it (random weights, no downloads)::

    python examples/decoder_lm.py --prompt 5 17 42 --new-tokens 24

It exports a small Llama as two methods, ``prefill(tokens)`` for a prompt of any length from 1
to the cache size and ``decode(token, position)`` for one token at a time, lowers them with ONNX
Runtime stacked before AOTInductor, saves one ``.pt2``, loads it and generates greedily.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.export import Dim

import aotstack


class PrefillDecode(torch.nn.Module):
    """A causal LM behind two methods that update one static KV cache held in buffers."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        self.max_cache_len = max_cache_len
        self.lm = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_cache_len)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (shape ``[1, length]``), filling the cache from 0."""
        positions = torch.arange(tokens.shape[1], dtype=torch.long)
        return self.lm(input_ids=tokens, cache_position=positions)[:, -1, :]

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``token`` (shape ``[1, 1]``) at cache slot ``position`` (shape ``[1]``)."""
        return self.lm(input_ids=token, cache_position=position)[:, -1, :]


def small_llama(vocab_size: int = 256, seed: int = 0) -> torch.nn.Module:
    """A two-layer Llama with grouped-query attention and random weights."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def exported(model: torch.nn.Module, max_cache_len: int) -> aotstack.Program:
    """Both methods exported from one module, so they share its weights and its cache buffers."""
    module = PrefillDecode(model, max_cache_len).eval()
    length = Dim("length", min=1, max=max_cache_len)
    return aotstack.export(
        module,
        {"prefill": (torch.zeros(1, 4, dtype=torch.long),),
         "decode": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))},
        dynamic_shapes={"prefill": {"tokens": {1: length}}},
        strict=True,  # the static cache updates tensors it holds outside the module's buffers
    )


def generate(program, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation through ``program.prefill`` and ``program.decode`` (eager or loaded alike)."""
    with torch.no_grad():
        logits = program.prefill(torch.tensor([prompt]))
        tokens: list[int] = []
        for position in range(len(prompt), len(prompt) + new_tokens):
            tokens.append(int(logits.argmax(dim=-1)))
            logits = program.decode(torch.tensor([[tokens[-1]]]), torch.tensor([position]))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, nargs="+", default=[5, 17, 42])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--cache", type=int, default=64, help="KV cache length (longest prompt plus output)")
    parser.add_argument("-o", "--output", help="where to keep the .pt2 (default: a temporary directory)")
    args = parser.parse_args()

    program = exported(small_llama(), args.cache)
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()])
    with tempfile.TemporaryDirectory() as directory:
        path = args.output or os.path.join(directory, "decoder_lm.pt2")
        lowered.save(path)
        loaded = aotstack.load(path)
        generate(loaded, args.prompt, 2)  # warm up
        loaded.reset()
        started = time.perf_counter()
        tokens = generate(loaded, args.prompt, args.new_tokens)
        elapsed = time.perf_counter() - started
    print(f"prompt {args.prompt} -> {tokens}")
    print(f"{len(tokens) / elapsed:.1f} tokens/s ({args.new_tokens} tokens, prefill included)")


if __name__ == "__main__":
    main()
