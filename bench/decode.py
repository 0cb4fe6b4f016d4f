"""Greedy decoding, tokens per second: aotstack's loaded file beside eager, torch.compile and plain AOTInductor.

One Llama-style model (random weights) behind transformers' own export wrapper, a static KV cache
in buffers, exported once; every variant runs that same program's model:

- eager:           the wrapper's module, called token by token
- torch.compile:   the same module through ``torch.compile``
- plain AOTI:      ``aoti_compile_and_package`` of the exported program, ``aoti_load_package``
- aotstack:        ``lower(Program({"forward": ep}), [AotiCpuPartitioner()])``, saved, ``load``

Rounds alternate between the variants; each round decodes ``--tokens`` tokens after resetting the
cache. Then a fresh process measures resident memory added by ``aotstack.load`` against the
weights' size. Nothing is asserted; targets are printed as met or not.

    .venv/bin/python bench/decode.py [--tokens 64] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import aotstack
from common import median, print_table, quiet_known_warnings, use_private_aotstack_cache, verdict

CACHE = 128
PROMPT = [1, 5, 9, 2, 7, 3, 8, 4]

# argv: package path, thread count. Prints "<resident bytes before load> <after load and one call>".
MEMORY_CHILD = """
import sys
import torch
import aotstack

def resident() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024

torch.set_num_threads(int(sys.argv[2]))
before = resident()
loaded = aotstack.load(sys.argv[1])
loaded.forward(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
print(before, resident())
"""


def language_model(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=CACHE)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def decode(step: Step, tokens: int) -> tuple[list[int], float]:
    """Prompt token by token, then ``tokens`` greedy steps; the tokens and the seconds the steps took."""
    with torch.no_grad():
        for position, token in enumerate(PROMPT):
            logits = step(torch.tensor([[token]]), torch.tensor([position]))
        generated = []
        started = time.perf_counter()
        for position in range(len(PROMPT), len(PROMPT) + tokens):
            generated.append(int(logits[0, -1].argmax()))
            logits = step(torch.tensor([[generated[-1]]]), torch.tensor([position]))
        return generated, time.perf_counter() - started


def weights_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    quiet_known_warnings()
    torch.set_num_threads(args.threads)
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = language_model(args.vocab, args.hidden, args.layers)
    size = weights_bytes(model)
    print(f"Llama-style model: {size / 1e6:.1f} MB of float32 weights, KV cache {CACHE}, {args.threads} thread(s)")
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    exported = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))

    with tempfile.TemporaryDirectory() as directory:
        use_private_aotstack_cache(directory)
        raw_path, path = os.path.join(directory, "raw.pt2"), os.path.join(directory, "lm.pt2")
        started = time.perf_counter()
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(exported, package_path=raw_path)
        print(f"plain AOTI package compiled in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.AotiCpuPartitioner()])
        lowered.save(path)
        print(f"aotstack package compiled in {time.perf_counter() - started:.1f} s "
              f"({len(lowered.delegates('forward'))} delegate(s))")

        eager_module = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
        compiled_module = torch.compile(
            TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model
        )
        raw = torch._inductor.aoti_load_package(raw_path)
        loaded = aotstack.load(path)
        variants: dict[str, Step] = {
            "eager": lambda ids, pos: eager_module(input_ids=ids, cache_position=pos),
            "torch.compile": lambda ids, pos: compiled_module(input_ids=ids, cache_position=pos),
            "plain AOTI": lambda ids, pos: raw(input_ids=ids, cache_position=pos),
            "aotstack": lambda ids, pos: loaded.forward(input_ids=ids, cache_position=pos),
        }
        resets = {"aotstack": loaded.reset}
        started = time.perf_counter()
        reference, _ = decode(variants["eager"], args.tokens)
        decode(variants["torch.compile"], 2)  # compiles, untimed
        print(f"torch.compile warmed up in {time.perf_counter() - started:.1f} s")

        seconds: dict[str, list[float]] = {name: [] for name in variants}
        agrees: dict[str, bool] = {}
        for _ in range(args.rounds):
            for name, step in variants.items():
                resets.get(name, lambda: None)()
                tokens, elapsed = decode(step, args.tokens)
                seconds[name].append(elapsed)
                agrees[name] = agrees.get(name, True) and tokens == reference

        memory = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, path, str(args.threads)],
            capture_output=True, text=True, check=True,
        ).stdout.split()
        added = int(memory[1]) - int(memory[0])

    rate = {name: args.tokens / median(values) for name, values in seconds.items()}
    rows = [
        [name, f"{rate[name]:.1f}", f"{rate[name] / rate['plain AOTI']:.3f}x", "yes" if agrees[name] else "NO"]
        for name in variants
    ]
    print()
    print_table(["variant", "tokens/s (median)", "vs plain AOTI", "same tokens as eager"], rows)
    relative = rate["aotstack"] / rate["plain AOTI"]
    print(f"\naotstack at least plain AOTI's tokens/s: {verdict(1 / relative, 1.0)} ({relative:.3f}x)")
    print(f"resident memory added by load and one call: {added / 1e6:.1f} MB = {added / size:.2f}x the weights; "
          f"target at most 1.2x: {verdict(added / size, 1.2)}")


if __name__ == "__main__":
    main()
