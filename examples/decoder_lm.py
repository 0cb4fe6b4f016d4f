"""A decoder language model in one file: ``prefill`` and ``decode`` sharing one set of weights and one KV cache.

Run it (random weights, no downloads)::

    python examples/decoder_lm.py --prompt 5 17 42 --new-tokens 24

It exports a small Llama as two methods, ``prefill(tokens)`` for a prompt of any length from 1
to the cache size and ``decode(token, position)`` for one token at a time (``aotstack.integrations.generation``,
which ``aotstack export-hf`` uses too), lowers them with ONNX Runtime stacked before AOTInductor, saves one
``.pt2``, loads it and generates greedily.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import aotstack
from aotstack.integrations.decoding import greedy_decoder
from aotstack.integrations.generation import export_decoder_lm


def small_llama(vocab_size: int = 256, seed: int = 0) -> torch.nn.Module:
    """A two-layer Llama with grouped-query attention and random weights."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, nargs="+", default=[5, 17, 42])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--cache", type=int, default=64, help="KV cache length (longest prompt plus output)")
    parser.add_argument("-o", "--output", help="where to keep the .pt2 (default: a temporary directory)")
    args = parser.parse_args()

    program = export_decoder_lm(small_llama(), args.cache)  # both methods share weights and the cache
    lowered = aotstack.lower(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()])
    with tempfile.TemporaryDirectory() as directory:
        path = args.output or os.path.join(directory, "decoder_lm.pt2")
        lowered.save(path)
        loaded = aotstack.load(path)
        greedy_decoder(loaded, args.prompt, 2)  # warm up
        loaded.reset()
        started = time.perf_counter()
        tokens = greedy_decoder(loaded, args.prompt, args.new_tokens)
        elapsed = time.perf_counter() - started
    print(f"prompt {args.prompt} -> {tokens}")
    print(f"{len(tokens) / elapsed:.1f} tokens/s ({args.new_tokens} tokens, prefill included)")


if __name__ == "__main__":
    main()
