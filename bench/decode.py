"""Greedy decoding, tokens per second: aotstack's loaded file beside eager, torch.compile and plain AOTInductor.

One Llama-style model (random weights) behind transformers' own export wrapper, a static KV cache
in buffers, exported once; every variant runs that same program's model:

- eager:           the wrapper's module, called token by token
- torch.compile:   the same module through ``torch.compile``
- plain AOTI:      ``aoti_compile_and_package`` of the exported program, ``aoti_load_package``
- aotstack:        ``lower(Program({"forward": ep}), [AotiCpuPartitioner()])``, saved, ``load``
- aotstack, generate: the same file through ``aotstack generate``'s own loop (``decoding.continued``), greedy
- aotstack, sampled: the same loop, each token sampled as ``aotstack generate --temperature 0.8 --top-k 50
                   --top-p 0.9 --repetition-penalty 1.1`` samples it (the sampling's cost per token, against
                   the greedy loop), with and without ``--seed``

Rounds alternate between the variants; each round decodes ``--tokens`` tokens after resetting the
cache. Then a fresh process measures resident memory added by ``aotstack.load`` and one call
against the weights' size. Nothing is asserted; targets are printed as met or not.

``--memory aoti,ort,xnnpack,openvino`` measures resident memory instead of speed: the same model
in each ``--dtypes`` (``fp32``, and the quantization schemes of ``bench/peers.py``: ``8da4w`` is
linear 8da4w, embedding 4w, groups of 32) lowered with each engine first and AOTInductor taking
the rest (``aoti``: AOTInductor alone), each file loaded in a fresh process (``bench/child.py
load``): what it adds to resident memory over ``import torch, aotstack`` after the load, the
first call and a second one, against the weights (quantized ones at their bit width), and what
that memory is: pages of the ``.pt2`` mapping, private memory, other files (the engines'
libraries). ``--baseline SRC`` loads each file with the aotstack at ``SRC`` too (a ``src``
folder, say of a worktree of an earlier commit), in the same run; ``--packages DIR`` keeps the
files there and reuses them.

    .venv/bin/python bench/decode.py [--tokens 64] [--rounds 5] [--threads 1] [--quick]
    .venv/bin/python bench/decode.py --memory aoti,ort,xnnpack,openvino [--dtypes fp32,8da4w]
                                     [--baseline /tmp/base/src] [--packages DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import aotstack
from aotstack.integrations.decoding import continued, generation_settings
from common import (
    Figure,
    Figures,
    Settings,
    median,
    print_table,
    progress,
    run_child,
    run_standalone,
    save_inputs,
)
from workloads import weights_bytes

CACHE = 128
PROMPT = [1, 5, 9, 2, 7, 3, 8, 4]


# The decoder architectures the benchmark builds; the mixtures of experts call transformers'
# grouped_mm_fallback custom op once per expert projection.
ARCHITECTURES = ("llama", "mixtral", "qwen3_moe")


def language_model(vocab: int, hidden: int, layers: int, arch: str = "llama") -> torch.nn.Module:
    import transformers
    from transformers import GenerationConfig

    torch.manual_seed(0)
    shared = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": CACHE}
    if arch == "mixtral":
        config = transformers.MixtralConfig(**shared, intermediate_size=hidden * 11 // 4, num_local_experts=8,
                                            num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**shared, intermediate_size=hidden * 11 // 4, head_dim=hidden // 8,
                                             moe_intermediate_size=hidden // 2, num_experts=16, num_experts_per_tok=4)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**shared, intermediate_size=hidden * 11 // 4)
        model = transformers.LlamaForCausalLM(config)
    model.eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Generation:
    """How ``aotstack generate`` chooses tokens: its settings, and a seed or none."""

    config: Any
    seed: int | None = None


def decode(step: Step, tokens: int, generation: Generation | None = None) -> tuple[list[int], float]:
    """Prompt token by token, then ``tokens`` steps; the tokens and the seconds the steps took.

    Greedy (an argmax) in a bare loop without ``generation``; with it, through ``aotstack generate``'s
    own loop, each token chosen as it chooses them (its logits processors seeing the whole history).
    """
    with torch.no_grad():
        for position, token in enumerate(PROMPT):
            logits = step(torch.tensor([[token]]), torch.tensor([position]))
        started = time.perf_counter()
        if generation is not None:
            # One token more than steps: the loop chooses the last token and stops, as the bare loop steps.
            config = generation_settings(generation.config, max_new_tokens=tokens + 1)
            last = lambda ids, pos: step(ids, pos)[:, -1]  # noqa: E731 - generate's methods give [1, vocabulary]
            generated = list(continued(logits[:, -1], torch.tensor([PROMPT]), last, config, generation.seed))
            return generated[:tokens], time.perf_counter() - started
        generated = []
        for position in range(len(PROMPT), len(PROMPT) + tokens):
            generated.append(int(logits[0, -1].argmax()))
            logits = step(torch.tensor([[generated[-1]]]), torch.tensor([position]))
        return generated, time.perf_counter() - started


# Sampling as a chat model's generation config often asks: temperature, top-k, top-p, repetition penalty. With a
# seed, each draw is over the whole vocabulary, as transformers' seeded ``generate`` draws.
SAMPLED = generation_settings(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)
GENERATIONS = {
    "aotstack, generate": Generation(generation_settings(do_sample=False)),
    "aotstack, sampled": Generation(SAMPLED),
    "aotstack, sampled, seeded": Generation(SAMPLED, seed=0),
}


def decode_rates(
    settings: Settings,
    tokens: int | None = None,
    rounds: int | None = None,
    hidden: int = 512,
    layers: int = 4,
    vocab: int = 8192,
    arch: str = "llama",
    memory: str | None = None,
    dtypes: str = "fp32,8da4w",
    baseline: str | None = None,
    packages: str | None = None,
) -> Figures:
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    if memory is not None:
        return decode_memory(settings, MemoryRun(hidden, layers, vocab, dtypes.split(","), memory.split(","),
                                                 baseline, packages or settings.workdir))
    tokens, rounds = tokens or settings.pick(64, 32), rounds or settings.pick(5, 2)
    model = language_model(vocab, hidden, layers, arch)
    size = weights_bytes(model)
    print(f"  {arch} model: {size / 1e6:.1f} MB of float32 weights, KV cache {CACHE}, {tokens} tokens a round")
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    exported = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))

    raw_path, path = settings.path("decode-raw.pt2"), settings.path("decode-lm.pt2")
    started = time.perf_counter()
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(exported, package_path=raw_path)
    progress(f"plain AOTI package compiled in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    lowered = aotstack.lower(aotstack.Program({"forward": exported}), [aotstack.AotiCpuPartitioner()])
    lowered.save(path)
    progress(f"aotstack package compiled in {time.perf_counter() - started:.1f} s "
             f"({len(lowered.delegates('forward'))} delegate(s))")

    def fresh_module() -> torch.nn.Module:
        return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model

    eager_module, compiled_module = fresh_module(), torch.compile(fresh_module())
    raw = torch._inductor.aoti_load_package(raw_path)
    loaded = aotstack.load(path)
    variants: dict[str, Step] = {
        "eager": lambda ids, pos: eager_module(input_ids=ids, cache_position=pos),
        "torch.compile": lambda ids, pos: compiled_module(input_ids=ids, cache_position=pos),
        "plain AOTI": lambda ids, pos: raw(input_ids=ids, cache_position=pos),
        "aotstack": lambda ids, pos: loaded.forward(input_ids=ids, cache_position=pos),
    }
    variants.update(dict.fromkeys(GENERATIONS, variants["aotstack"]))
    resets = dict.fromkeys(["aotstack", *GENERATIONS], loaded.reset)
    started = time.perf_counter()
    reference, _ = decode(variants["eager"], tokens)
    decode(variants["torch.compile"], 2)  # compiles, untimed
    progress(f"torch.compile warmed up in {time.perf_counter() - started:.1f} s; decoding {rounds} rounds ...")

    seconds: dict[str, list[float]] = {name: [] for name in variants}
    agrees: dict[str, bool] = {}
    for _ in range(rounds):
        for name, step in variants.items():
            resets.get(name, lambda: None)()
            generated, elapsed = decode(step, tokens, GENERATIONS.get(name))
            seconds[name].append(elapsed)
            agrees[name] = agrees.get(name, True) and generated == reference

    inputs = save_inputs(settings.path("decode-inputs.pt"),
                         kwargs={"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])})
    registers_ops = ["--import", "transformers.integrations.moe"] if arch != "llama" else []
    memory = run_child(["load", "aotstack", path, inputs, str(settings.threads), *registers_ops])
    added = memory["rss"] - memory["import_rss"]

    rate = {name: tokens / median(values) for name, values in seconds.items()}
    rows = [
        [name, f"{rate[name]:.1f}", f"{rate[name] / rate['plain AOTI']:.3f}x",
         "sampled" if name in GENERATIONS and GENERATIONS[name].config.do_sample else "yes" if agrees[name] else "NO"]
        for name in variants
    ]
    print_table(["variant", "tokens/s (median)", "vs plain AOTI", "same tokens as eager"], rows)
    return {
        "aotstack / plain AOTI, tokens/s": Figure(
            rate["aotstack"], "tokens/s", rate["plain AOTI"], 1.0, higher_is_better=True,
            note="" if agrees["aotstack"] else "aotstack's tokens differ from eager's",
        ),
        "aotstack / eager, tokens/s": Figure(rate["aotstack"], "tokens/s", rate["eager"], higher_is_better=True),
        "aotstack / torch.compile, tokens/s": Figure(
            rate["aotstack"], "tokens/s", rate["torch.compile"], higher_is_better=True
        ),
        "aotstack generate's loop / a bare loop, greedy, time per token": Figure(
            rate["aotstack"], "tokens/s", rate["aotstack, generate"],
            note="" if agrees["aotstack, generate"] else "generate's loop chose other tokens than eager's",
        ),
        "aotstack sampled / greedy, time per token": Figure(
            rate["aotstack, generate"], "tokens/s", rate["aotstack, sampled"], 1.05,
            note="temperature 0.8, top-k 50, top-p 0.9, repetition penalty 1.1; both in generate's loop",
        ),
        "aotstack sampled with a seed / greedy, time per token": Figure(
            rate["aotstack, generate"], "tokens/s", rate["aotstack, sampled, seeded"],
            note="a seeded draw is over the whole vocabulary, as transformers' generate draws",
        ),
        "RSS added by load + one call / weights": Figure(
            added / 1e6, "MB", size / 1e6, 1.2, note="fresh process, over its RSS after import torch, aotstack"
        ),
    }


# ``--memory``: each engine first, AOTInductor taking what it leaves; ``aoti``: AOTInductor alone.
MEMORY_ORDERS: dict[str, Callable[[], list[aotstack.Partitioner]]] = {
    "aoti": lambda: [aotstack.AotiCpuPartitioner()],
    "ort": lambda: [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()],
    "xnnpack": lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()],
    "openvino": lambda: [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()],
}
MEMORY_TARGET = 1.15  # RSS added by load + one call / the weights (the quantization issue's target)


@dataclass(frozen=True)
class MemoryRun:
    """What ``--memory`` measures: the model's size, the dtypes and engine orders, where files go, what to compare."""

    hidden: int
    layers: int
    vocab: int
    dtypes: list[str]
    engines: list[str]
    baseline: str | None
    packages: str


def decode_memory(settings: Settings, run: MemoryRun) -> Figures:
    """Resident memory a fresh process adds by load + one call, per dtype and engine order, against the weights."""
    from workloads import quantized, weights_at_bits

    inputs = save_inputs(settings.path("decode-memory-inputs.pt"),
                         kwargs={"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])})
    figures: Figures = {}
    rows = []
    for dtype in run.dtypes:
        model = quantized(language_model(run.vocab, run.hidden, run.layers), dtype)
        weights = weights_at_bits(model, dtype)
        for engine in run.engines:
            path = os.path.join(run.packages, f"decode-{run.hidden}x{run.layers}x{run.vocab}-{dtype}-{engine}.pt2")
            try:
                made = lowered_file(model, path, MEMORY_ORDERS[engine])
                after = run_child(["load", "aotstack", path, inputs, str(settings.threads)])
                before = None if run.baseline is None else run_child(
                    ["load", "aotstack", path, inputs, str(settings.threads)], env={"PYTHONPATH": run.baseline})
            except Exception as exc:  # the row says so; the other engines go on
                rows.append([dtype, engine, megabytes(weights), "-", f"failed: {str(exc).strip()[-80:]}"])
                continue
            progress(f"{dtype} {engine}: {made}")
            rows.append(memory_row(dtype, engine, weights, os.path.getsize(path), after, before))
            added = after["resident"]["call"]["rss"] - after["resident"]["import"]["rss"]
            note = "" if before is None else (
                f"before: {megabytes(before['resident']['call']['rss'] - before['resident']['import']['rss'])} MB")
            figures[f"{dtype} {engine} first: RSS added by load + one call / weights"] = Figure(
                added / 1e6, "MB", weights / 1e6, MEMORY_TARGET, note=note)
    stages = ["load", "call", "second call"]
    headers = ["dtype", "engine", "weights", "file", *(f"+{stage}" for stage in stages),
               "call: .pt2", "private", "libraries", "(.pt2 + private)"]
    if run.baseline is not None:
        headers += ["before: +call", "before: .pt2"]
    print(f"\n  llama {run.hidden}x{run.layers}, vocab {run.vocab}: resident memory a fresh process adds over "
          "import torch, aotstack, MB (x: / the weights);\n  after the call: the .pt2's mapped pages, private "
          "memory, other files (libraries the load imports)")
    print_table(headers, [row + [""] * (len(headers) - len(row)) for row in rows])
    return figures


def lowered_file(model: torch.nn.Module, path: str, partitioners: Callable[[], list[aotstack.Partitioner]]) -> str:
    """``model``'s decode step lowered with ``partitioners`` and saved at ``path``, unless a file is there already."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    if os.path.exists(path):
        return "file reused"
    started = time.perf_counter()
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    exported = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    lowered = aotstack.lower(aotstack.Program({"forward": exported}), partitioners())
    lowered.save(path)
    engines = sorted({delegate.backend_id for delegate in lowered.delegates("forward")})
    return f"lowered in {time.perf_counter() - started:.0f} s ({', '.join(engines)})"


def memory_row(
    dtype: str, engine: str, weights: int, size: int, after: dict[str, Any], before: dict[str, Any] | None
) -> list[str]:
    """One row of the memory table: RSS added at each stage, and what it is after the call."""
    resident = after["resident"]
    start = resident["import"]

    def added(stage: str, sample: dict[str, Any] = after) -> str:
        grown = sample["resident"][stage]["rss"] - sample["resident"]["import"]["rss"]
        return f"{megabytes(grown)} ({grown / weights:.2f}x)"

    call = resident["call"]
    private = call["anon"] - start["anon"]
    libraries = call["file"] - start["file"] - (call["package"] - start["package"])
    row = [dtype, engine, megabytes(weights), megabytes(size), *(added(s) for s in ("load", "call", "second call")),
           megabytes(call["package"]), megabytes(private), megabytes(libraries),
           f"{(call['package'] + private) / weights:.2f}x"]
    if before is not None:
        row += [added("call", before), megabytes(before["resident"]["call"]["package"])]
    return row


def megabytes(count: int) -> str:
    return f"{count / 1e6:.1f}"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=None, help="tokens a round (default 64; --quick: 32)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick: 2)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--memory", default=None, metavar="ENGINES",
                        help=f"measure resident memory instead, per engine order ({','.join(MEMORY_ORDERS)})")
    parser.add_argument("--dtypes", default="fp32,8da4w", help="with --memory: fp32 and/or quantization schemes")
    parser.add_argument("--baseline", default=None, metavar="SRC",
                        help="with --memory: also load each file with the aotstack in SRC (an earlier commit's src)")
    parser.add_argument("--packages", default=None, metavar="DIR",
                        help="with --memory: write the lowered files here, and reuse those already there")


if __name__ == "__main__":
    run_standalone(__doc__, decode_rates, extra=options)
