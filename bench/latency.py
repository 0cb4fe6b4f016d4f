"""Per-call latency of a loaded aotstack package beside raw AOTInductor and eager PyTorch.

Every variant is timed call by call (``time.perf_counter_ns``), round-robin, in the same process, so
the ratios compare like with like; the absolute figures depend on the machine. Nothing is asserted.

    .venv/bin/python bench/latency.py [--calls 2000] [--warmup 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import aotstack
from aotstack.demo import DEMO_EXCLUDED_OPS, demo_model
from common import (
    build_aotstack,
    build_raw_aoti,
    median,
    percentile,
    print_table,
    use_private_aotstack_cache,
    verdict,
)

RATIO_TARGET = 1.05  # all-supported model: aotstack / raw AOTI
BOUNDARY_TARGET_US = 15.0  # overhead per delegate boundary


@dataclass
class Variant:
    name: str
    call: Callable[[], Any]
    delegates: int | None = None  # None: not an aotstack package
    samples_ns: list[int] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return median(self.samples_ns) / 1e3


class Mlp(torch.nn.Module):
    """Linear-ReLU-Linear-ReLU-Linear; its own class, as nn.Sequential names its argument ``input``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Mlp().eval(), (torch.randn(8, 64),)


def demo() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = demo_model()
    return model, inputs["forward"]


def eager_call(model: torch.nn.Module, args: tuple[Any, ...]) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return model(*args)

    return call


def aotstack_variant(
    name: str, model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: list[str]
) -> Variant:
    delegates = build_aotstack(model, args, path, exclude_ops)
    loaded = aotstack.load(path)
    return Variant(name, lambda: loaded.forward(*args), delegates)


def raw_aoti_variant(model: torch.nn.Module, args: tuple[Any, ...], path: str) -> Variant:
    build_raw_aoti(model, args, path)
    runner = torch._inductor.aoti_load_package(path)
    return Variant("raw AOTI", lambda: runner(*args))


def build_variants(
    label: str, model: torch.nn.Module, args: tuple[Any, ...], exclude_ops: list[str], directory: str
) -> list[Variant]:
    """aotstack as asked, aotstack unsplit (where ops are excluded), raw AOTI, eager."""
    started = time.perf_counter()
    variants = [aotstack_variant("aotstack", model, args, os.path.join(directory, f"{label}.pt2"), exclude_ops)]
    if exclude_ops:
        unsplit = os.path.join(directory, f"{label}-unsplit.pt2")
        variants.append(aotstack_variant("aotstack, nothing excluded", model, args, unsplit, []))
    variants.append(raw_aoti_variant(model, args, os.path.join(directory, f"{label}-raw.pt2")))
    variants.append(Variant("eager (no_grad)", eager_call(model, args)))
    print(f"  compiled {len(variants) - 1} packages in {time.perf_counter() - started:.1f} s", flush=True)
    return variants


def check_outputs(variants: list[Variant]) -> float:
    """The worst difference from eager over the variants that compute the model's output."""
    expected = variants[-1].call()
    return max((v.call() - expected).abs().max().item() for v in variants[:-1])


def measure(variants: list[Variant], calls: int, warmup: int) -> None:
    """One call of each variant per round, the starting variant rotating; warm-up rounds are dropped."""
    count = len(variants)
    gc.collect()
    gc.disable()
    try:
        for round_index in range(warmup + calls):
            for k in range(count):
                variant = variants[(round_index + k) % count]
                started = time.perf_counter_ns()
                variant.call()
                elapsed = time.perf_counter_ns() - started
                if round_index >= warmup:
                    variant.samples_ns.append(elapsed)
    finally:
        gc.enable()


def report(variants: list[Variant], raw: Variant, eager: Variant) -> None:
    rows = []
    for v in variants:
        rows.append(
            [
                v.name,
                "-" if v.delegates is None else str(v.delegates),
                f"{v.median_us:.1f}",
                f"{percentile(v.samples_ns, 0.1) / 1e3:.1f}",
                f"{percentile(v.samples_ns, 0.9) / 1e3:.1f}",
                f"{v.median_us / raw.median_us:.3f}x",
                f"{v.median_us / eager.median_us:.3f}x",
            ]
        )
    print_table(["variant", "delegates", "median µs", "p10 µs", "p90 µs", "/ raw AOTI", "/ eager"], rows)


def summarize_all_supported(variants: list[Variant]) -> None:
    package, raw, eager = variants
    ratio = package.median_us / raw.median_us
    boundary = (package.median_us - raw.median_us) / package.delegates
    print(f"  aotstack / raw AOTI = {ratio:.3f}x  (target <= {RATIO_TARGET}x: {verdict(ratio, RATIO_TARGET)})")
    print(f"  aotstack / eager    = {package.median_us / eager.median_us:.3f}x")
    print(
        f"  overhead per delegate boundary = (aotstack - raw AOTI) / {package.delegates} = {boundary:.1f} µs"
        f"  (target <= {BOUNDARY_TARGET_US:g} µs: {verdict(boundary, BOUNDARY_TARGET_US)})"
    )


def summarize_split(variants: list[Variant], excluded_op: Variant) -> None:
    package, unsplit, raw, eager = variants
    extra = package.delegates - unsplit.delegates
    per_delegate = (package.median_us - raw.median_us) / package.delegates
    boundary = (package.median_us - unsplit.median_us) / extra
    net = (package.median_us - unsplit.median_us - excluded_op.median_us) / extra
    single = (unsplit.median_us - raw.median_us) / unsplit.delegates
    print(f"  aotstack / raw AOTI = {package.median_us / raw.median_us:.3f}x")
    print(f"  aotstack / eager    = {package.median_us / eager.median_us:.3f}x")
    print(
        f"  (aotstack - raw AOTI) / {package.delegates} delegates = {per_delegate:.1f} µs"
        "  (raw AOTI compiles the excluded op in; aotstack runs it eagerly, so this includes it)"
    )
    print(
        f"  overhead per delegate boundary = (aotstack - unsplit) / {extra} extra = {boundary:.1f} µs"
        f"  (target <= {BOUNDARY_TARGET_US:g} µs: {verdict(boundary, BOUNDARY_TARGET_US)})"
    )
    print(
        f"    ... less the excluded op on its own ({excluded_op.median_us:.1f} µs) = {net:.1f} µs"
        f"  (target <= {BOUNDARY_TARGET_US:g} µs: {verdict(net, BOUNDARY_TARGET_US)})"
    )
    print(
        f"  unsplit aotstack - raw AOTI, per delegate = {single:.1f} µs"
        f"  (target <= {BOUNDARY_TARGET_US:g} µs: {verdict(single, BOUNDARY_TARGET_US)})"
    )


def run_mlp(directory: str, calls: int, warmup: int) -> None:
    print("\n(a) all-supported MLP 64-256-256-10, batch 8, AotiCpuPartitioner()", flush=True)
    model, args = mlp()
    variants = build_variants("mlp", model, args, [], directory)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    measure(variants, calls, warmup)
    report(variants, variants[-2], variants[-1])
    summarize_all_supported(variants)


def run_demo(directory: str, calls: int, warmup: int) -> None:
    print(f"\n(b) demo model forward, AotiCpuPartitioner(exclude_ops={DEMO_EXCLUDED_OPS})", flush=True)
    model, args = demo()
    variants = build_variants("demo", model, args, DEMO_EXCLUDED_OPS, directory)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    # What the split package runs between its delegates, timed on its own in the same rounds.
    gelu_input = torch.randn(args[0].shape[0], model.proj.out_features)
    excluded_op = Variant("aten.gelu alone (4x64)", lambda: torch.ops.aten.gelu.default(gelu_input))
    measure([*variants, excluded_op], calls, warmup)
    report([*variants, excluded_op], variants[-2], variants[-1])
    summarize_split(variants, excluded_op)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="timed rounds (one call per variant each)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, for compiling and running")
    parser.add_argument("--model", choices=["mlp", "demo", "both"], default="both")
    args = parser.parse_args()
    if args.calls < 200:
        parser.error("--calls must be at least 200")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, torch.get_num_threads() = {args.threads}")
    print(f"{args.calls} timed rounds after {args.warmup} warm-up rounds; one call per variant per round")
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_aotstack_cache(directory)
        if args.model in ("mlp", "both"):
            run_mlp(directory, args.calls, args.warmup)
        if args.model in ("demo", "both"):
            run_demo(directory, args.calls, args.warmup)


if __name__ == "__main__":
    main()
