"""Each torchao config a user applies with ``quantize_``, lowered in each engine order: batch-1 call time against fp32.

A small Llama (transformers, random weights: hidden 512, 4 layers, vocabulary 4096) is quantized
straight from torchao with each config below (linears with it, the embedding with
``IntxWeightOnlyConfig``: int8 rows, or int4 in groups of 32 for the int4 configs), exported
(``forward(input_ids)`` to logits, no cache) and lowered in each order: AOTInductor alone, ONNX
Runtime, OpenVINO or XNNPACK first with AOTInductor taking the rest, and ``auto``. The float32
model goes through the same order. Each file is saved and loaded here; per order, one call of
every config's file and of the float32 file per round, in a shuffled order (``common.measure``),
batch 1, ``--threads`` threads (default 1); the median per file.

Columns: ``fp32/q`` is the float32 file's median over the quantized file's (above 1: the quantized
model is faster), ``size`` the quantized file's bytes over the float32 file's, ``held by`` the
engines whose delegates hold the quantized layers, ``diff`` the largest difference from the eager
quantized model over its largest output. Targets: no order makes a quantized model slower than its
float32 self (``fp32/q`` >= 1); an int4 file is at most 0.3x the float32 file. Nothing is asserted.

    .venv/bin/python bench/torchao_configs.py [--configs int8-dynamic,8da4w-g32] [--orders ort+aoti,auto]
                                             [--tokens 8] [--rounds 100] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import aotstack
from common import Figure, Figures, Settings, Variant, measure, print_table, progress, run_standalone

LLAMA = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}
INT4_FILE_TARGET = 0.3


def int8_rows() -> Any:
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def int4_groups(asymmetric: bool = False) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    mapping = MappingType.ASYMMETRIC if asymmetric else MappingType.SYMMETRIC
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=mapping)


def dynamic_intx(bits: int, group: int, asymmetric: bool = False) -> Callable[[], Any]:
    def config() -> Any:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.quant_primitives import MappingType

        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8 if bits == 8 else torch.int4,
            weight_granularity=PerAxis(0) if group == 0 else PerGroup(group),
            weight_mapping_type=MappingType.ASYMMETRIC if asymmetric else MappingType.SYMMETRIC,
        )

    return config


def torchao_config(name: str) -> Callable[[], Any]:
    def config() -> Any:
        import torchao.quantization

        return getattr(torchao.quantization, name)()

    return config


# name -> (the linears' config, the embedding's config, int4 weights).
CONFIGS: dict[str, tuple[Callable[[], Any], Callable[[], Any], bool]] = {
    "int8-weight-only": (torchao_config("Int8WeightOnlyConfig"), int8_rows, False),
    "int8-dynamic": (torchao_config("Int8DynamicActivationInt8WeightConfig"), int8_rows, False),
    "intx-int4-g32": (int4_groups, int4_groups, True),
    "intx-int8-channel": (int8_rows, int8_rows, False),
    "8da8w-channel": (dynamic_intx(8, 0), int8_rows, False),
    "8da8w-g32": (dynamic_intx(8, 32), int8_rows, False),
    "8da4w-channel": (dynamic_intx(4, 0), int4_groups, True),
    "8da4w-g32": (dynamic_intx(4, 32), int4_groups, True),
    # Zero points other than 0 (torchao's ``mapping_type=MappingType.ASYMMETRIC``).
    "intx-int4-g32-asymmetric": (lambda: int4_groups(asymmetric=True), lambda: int4_groups(asymmetric=True), True),
    "8da4w-g32-asymmetric": (dynamic_intx(4, 32, asymmetric=True), lambda: int4_groups(asymmetric=True), True),
}

ORDERS: dict[str, Callable[[], Any]] = {
    "aoti": lambda: [aotstack.AotiCpuPartitioner()],
    "ort+aoti": lambda: [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()],
    "ov+aoti": lambda: [aotstack.OpenVinoPartitioner(), aotstack.AotiCpuPartitioner()],
    "xnnpack+aoti": lambda: [aotstack.XnnpackPartitioner(), aotstack.AotiCpuPartitioner()],
    "auto": lambda: "auto",
}
SHORT = {"aoti_cpu": "AOTI", "onnxruntime": "ORT", "openvino": "OV", "xnnpack": "XNNPACK"}


class Logits(torch.nn.Module):
    """The model's logits for a batch of token ids, no cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return Logits(LlamaForCausalLM(LlamaConfig(**LLAMA)).eval())


def quantized(name: str) -> torch.nn.Module:
    """The Llama with ``name``'s configs applied by torchao's ``quantize_``: embedding first, then linears."""
    from torchao.quantization import quantize_

    linear, embedding, _ = CONFIGS[name]
    model = llama()
    with contextlib.redirect_stdout(io.StringIO()):  # torchao prints the CUDA libraries it lacks
        quantize_(model, embedding(), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Embedding))
        quantize_(model, linear())
    return model


@dataclass
class Built:
    """One model through one order: its file, where its quantized layers went, how far it is from eager."""

    name: str
    path: str
    seconds: float
    held: str
    difference: float
    variant: Variant


def built(name: str, model: torch.nn.Module, order: str, ids: torch.Tensor, expected: torch.Tensor,
          settings: Settings) -> Built:
    started = time.perf_counter()
    lowered = aotstack.lower(aotstack.export(model, {"forward": (ids,)}), ORDERS[order]())
    path = settings.path(f"{name}-{order}.pt2")
    lowered.save(path)
    seconds = time.perf_counter() - started
    held = Counter()
    for delegate in lowered.delegates("forward"):
        if delegate.quantized:
            held[SHORT.get(delegate.backend_id, delegate.backend_id)] += sum(delegate.quantized.values())
    loaded = aotstack.load(path)  # after torch.set_num_threads: the engines take their thread count here
    with torch.no_grad():
        difference = ((loaded.forward(ids) - expected).abs().max() / expected.abs().max()).item()
    progress(f"{order}: {name} lowered in {seconds:.0f} s")
    return Built(name, path, seconds, " ".join(f"{engine} {count}" for engine, count in held.items()) or "-",
                 difference, Variant(name, lambda: loaded.forward(ids)))


def order_figures(order: str, names: list[str], models: dict[str, tuple[torch.nn.Module, torch.Tensor]],
                  ids: torch.Tensor, settings: Settings, rounds: tuple[int, int]) -> tuple[list[list[str]], Figures]:
    """Every config and the float32 model through ``order``, timed in interleaved rounds: table rows and figures."""
    builds = [built(name, models[name][0], order, ids, models[name][1], settings) for name in ["fp32", *names]]
    measure([b.variant for b in builds], *rounds)
    float_build, rows, figures = builds[0], [], {}
    float_us, float_size = float_build.variant.median_us, os.path.getsize(float_build.path)
    for build in builds:
        size = os.path.getsize(build.path)
        speed = float_us / build.variant.median_us
        rows.append([build.name, order, build.held, f"{build.variant.median_us / 1e3:.2f}",
                     f"{float_us / 1e3:.2f}", f"{speed:.2f}x", f"{size / float_size:.2f}x", f"{build.difference:.1e}"])
        if build is float_build:
            continue
        figures[f"{build.name} {order}: call"] = Figure(build.variant.median_us, "µs", float_us, 1.0,
                                                        note=f"quantized layers held by {build.held}")
        int4 = CONFIGS[build.name][2]
        figures[f"{build.name} {order}: file"] = Figure(size / 1e6, "MB", float_size / 1e6,
                                                        INT4_FILE_TARGET if int4 else None)
    return rows, figures


def torchao_configs(settings: Settings, configs: str | None, orders: str | None, tokens: int,
                    rounds: int | None) -> Figures:
    names = configs.split(",") if configs else list(CONFIGS)
    picked = orders.split(",") if orders else list(ORDERS)
    unknown = (set(names) - set(CONFIGS)) | (set(picked) - set(ORDERS))
    if unknown:
        raise SystemExit(f"unknown configs or orders: {sorted(unknown)}; configs: {', '.join(CONFIGS)}; "
                         f"orders: {', '.join(ORDERS)}")
    ids = torch.randint(0, LLAMA["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    models = {}
    for name in ["fp32", *names]:
        model = llama() if name == "fp32" else quantized(name)
        with torch.no_grad():
            models[name] = (model, model(ids))
    timed = (rounds, max(5, rounds // 10)) if rounds else settings.pick((100, 10), (30, 5))
    rows, figures = [], {}
    for order in picked:
        order_rows, order_results = order_figures(order, names, models, ids, settings, timed)
        rows += order_rows
        figures.update(order_results)
    print(f"\n  Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']}, vocabulary {LLAMA['vocab_size']}, "
          f"batch 1 x {tokens} tokens, {torch.get_num_threads()} thread(s), median of {timed[0]} interleaved rounds")
    print_table(["config", "order", "held by", "q ms", "fp32 ms", "fp32/q", "size", "diff"], rows)
    return figures


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=None, help=f"comma-separated, of: {', '.join(CONFIGS)} (default all)")
    parser.add_argument("--orders", default=None, help=f"comma-separated, of: {', '.join(ORDERS)} (default all)")
    parser.add_argument("--tokens", type=int, default=8,
                        help="tokens in the batch-1 call (default 8; XNNPACK's delegate fails on [1, 1, K] inputs)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per order (default 100; --quick: 30)")


if __name__ == "__main__":
    run_standalone(__doc__, torchao_configs, extra=options)
