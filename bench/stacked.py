"""Per-call latency of one block lowered with AOTInductor, with ONNX Runtime, and with both stacked.

The block is linear, activation, normalization and an elementwise tail::

    Linear(256, 512) -> GELU -> LayerNorm(512) -> Linear(512, 256) -> tanh * 2 + x

Each package is lowered by aotstack, saved to a ``.pt2`` and loaded with ``aotstack.load``:

- AOTInductor only: ``[AotiCpuPartitioner()]``
- ONNX Runtime only: ``[OrtPartitioner()]``
- stacked: ``[OrtPartitioner(ops=["aten.linear"]), AotiCpuPartitioner()]``, ONNX Runtime runs the linears
  and AOTInductor the rest
- stacked the other way: ``[AotiCpuPartitioner(exclude_ops=["aten.linear"]), OrtPartitioner()]``

beside eager PyTorch (``no_grad``). Every variant is timed call by call (``time.perf_counter_ns``),
round-robin (one call of each per round, in a shuffled order) in one process, so the ratios against
AOTInductor only compare like with like; the absolute figures depend on the machine. One table per
batch size. Nothing is asserted.

    .venv/bin/python bench/stacked.py [--calls 2000] [--warmup 100] [--threads 1] [--batch 8 64]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import aotstack
from common import (
    EAGER,
    Figure,
    Figures,
    Settings,
    Variant,
    build_lowered,
    eager_call,
    measure,
    percentile,
    print_table,
    progress,
    run_standalone,
)

AOTI = "AOTInductor only"
ORT = "ONNX Runtime only"
STACKED = "stacked: ORT linears, AOTI rest"
REVERSED = "stacked: AOTI but linears, ORT rest"

# Variant name -> the partitioners, made afresh for each lowering.
LOWERINGS: dict[str, Callable[[], list[aotstack.Partitioner]]] = {
    AOTI: lambda: [aotstack.AotiCpuPartitioner()],
    ORT: lambda: [aotstack.OrtPartitioner()],
    STACKED: lambda: [aotstack.OrtPartitioner(ops=["aten.linear"]), aotstack.AotiCpuPartitioner()],
    REVERSED: lambda: [aotstack.AotiCpuPartitioner(exclude_ops=["aten.linear"]), aotstack.OrtPartitioner()],
}

BACKEND_NAMES = {"aoti_cpu": "AOTI", "onnxruntime": "ORT"}


@dataclass
class LoweredVariant(Variant):
    engines: str = "-"  # delegates per backend, e.g. "2 ORT + 2 AOTI"


class Block(torch.nn.Module):
    def __init__(self, width: int = 256, hidden: int = 512) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.nn.functional.gelu(self.up(x)))
        return torch.tanh(self.down(y)) * 2 + x


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def engines(delegates: Sequence[aotstack.Delegate]) -> str:
    counts = Counter(BACKEND_NAMES.get(d.backend_id, d.backend_id) for d in delegates)
    return " + ".join(f"{n} {name}" for name, n in counts.items())


def lowered_variant(name: str, model: torch.nn.Module, args: tuple[torch.Tensor, ...], path: str) -> LoweredVariant:
    delegates = build_lowered(model, args, path, LOWERINGS[name]())
    loaded = aotstack.load(path)  # after torch.set_num_threads: ORT sessions take their thread count here
    return LoweredVariant(name, lambda: loaded.forward(*args), len(delegates), engines=engines(delegates))


def build_variants(model: torch.nn.Module, args: tuple[torch.Tensor, ...], settings: Settings) -> list[Variant]:
    started = time.perf_counter()
    batch = args[0].shape[0]
    variants: list[Variant] = [
        lowered_variant(name, model, args, settings.path(f"block-{batch}-{index}.pt2"))
        for index, name in enumerate(LOWERINGS)
    ]
    progress(f"lowered and loaded {len(variants)} packages in {time.perf_counter() - started:.1f} s")
    variants.append(Variant(EAGER, eager_call(model, args)))
    return variants


def worst_difference(variants: Sequence[Variant], expected: torch.Tensor) -> float:
    return max((v.call() - expected).abs().max().item() for v in variants)


def report(variants: Sequence[Variant]) -> None:
    by_name = {v.name: v for v in variants}
    aoti, eager = by_name[AOTI], by_name[EAGER]
    rows = [
        [
            v.name,
            "-" if v.delegates is None else str(v.delegates),
            getattr(v, "engines", "-"),
            f"{v.median_us:.1f}",
            f"{percentile(v.samples_ns, 0.9) / 1e3:.1f}",
            f"{v.median_us / aoti.median_us:.3f}x",
            f"{v.median_us / eager.median_us:.3f}x",
        ]
        for v in variants
    ]
    headers = ["variant", "delegates", "engines", "median µs", "p90 µs", "/ AOTI only", "/ eager"]
    print_table(headers, rows)


def run_batch(batch: int, settings: Settings) -> Figures:
    print(f"\n  block 256-512-256, batch {batch}", flush=True)
    model = block()
    args = (torch.randn(batch, 256),)
    variants = build_variants(model, args, settings)
    with torch.no_grad():
        expected = model(*args)
    progress(f"worst |variant - eager| = {worst_difference(variants, expected):.2e}; timing ...")
    measure(variants, *settings.rounds())
    report(variants)
    by_name = {v.name: v for v in variants}
    aoti = by_name[AOTI].median_us
    figures = {
        f"batch {batch}: {v.name} / {AOTI}": Figure(v.median_us, "µs", aoti)
        for v in variants
        if v.name not in (AOTI, EAGER)
    }
    figures[f"batch {batch}: {AOTI} / eager"] = Figure(aoti, "µs", by_name[EAGER].median_us)
    return figures


def stacked(settings: Settings, batch: Sequence[int] | None = None) -> Figures:
    print(f"  onnxruntime {importlib.metadata.version('onnxruntime')}")
    figures: Figures = {}
    for size in batch or [8]:
        figures.update(run_batch(size, settings))
    return figures


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes, one table each (default 8)")


if __name__ == "__main__":
    # torch.set_num_threads comes before any load: ONNX Runtime sessions read it then.
    run_standalone(__doc__, stacked, round_robin=True, extra=options)
