"""Overhead per delegate boundary: one model, the same arithmetic, lowered into 1, 2 and 4 delegates.

The model is four ``Linear(64, 64)`` blocks with silu, gelu, silu between them (batch 8):

- 1 delegate:  nothing excluded
- 2 delegates: ``aten.gelu`` excluded (it runs as plain ATen between the two)
- 4 delegates: ``aten.gelu`` and ``aten.silu`` excluded

The excluded ops are also timed alone on a tensor of the same shape, in the same rounds, and subtracted;
the overhead per boundary is then the least-squares slope of the per-call time against the delegate count.
Beside it: the fixed cost of a one-delegate call over the plain AOTI package's own runner
(``loader.run`` with a flat list) of the same model. Round-robin timing as in ``latency.py``.

    .venv/bin/python bench/boundary.py [--calls 2000] [--warmup 100] [--threads 1]
"""

from __future__ import annotations

import time

import torch

import aotstack
from common import (
    EAGER,
    Figure,
    Figures,
    Settings,
    Variant,
    build_aotstack,
    eager_call,
    measure,
    progress,
    run_standalone,
)
from latency import raw_aoti_variants, report
from workloads import boundary_chain

BOUNDARY_TARGET_US = 15.0
SPLITS = {1: [], 2: ["aten.gelu"], 4: ["aten.gelu", "aten.silu"]}  # delegates -> excluded ops


def slope(points: list[tuple[float, float]]) -> float:
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def boundary(settings: Settings) -> Figures:
    model, args = boundary_chain()
    started = time.perf_counter()
    progress(f"compiling the chain as {', '.join(map(str, SPLITS))} delegates and as a plain AOTI package ...")
    variants: dict[int, Variant] = {}
    for count, excluded in SPLITS.items():
        path = settings.path(f"boundary-{count}.pt2")
        delegates = build_aotstack(model, args, path, excluded)
        if delegates != count:
            raise RuntimeError(f"excluding {excluded} gave {delegates} delegates, expected {count}")
        loaded = aotstack.load(path)
        variants[count] = Variant(f"aotstack, {count} delegate(s)", lambda loaded=loaded: loaded.forward(*args), count)
    raw, runner = raw_aoti_variants(model, args, settings.path("boundary-raw.pt2"), "cpu")
    progress(f"compiled {len(SPLITS) + 1} packages in {time.perf_counter() - started:.1f} s; timing ...")
    activation = torch.randn(*args[0].shape)
    alone = {
        op: Variant(f"aten.{op} alone", lambda op=op: getattr(torch.ops.aten, op).default(activation))
        for op in ("gelu", "silu")
    }
    with torch.no_grad():
        expected = model(*args)
    worst = max((v.call() - expected).abs().max().item() for v in variants.values())
    progress(f"worst |variant - eager| = {worst:.2e}")
    eager = Variant(EAGER, eager_call(model, args))
    timed = [*variants.values(), raw, runner, eager, *alone.values()]
    measure(timed, *settings.rounds())
    eager_ops = {1: 0.0, 2: alone["gelu"].median_us, 4: alone["gelu"].median_us + 2 * alone["silu"].median_us}
    report(timed, raw, runner, eager)
    net = {count: variants[count].median_us - eager_ops[count] for count in variants}
    per_boundary = slope(list(net.items()))
    one = variants[1].median_us
    return {
        "overhead per delegate boundary": Figure(
            per_boundary,
            "µs",
            target=BOUNDARY_TARGET_US,
            note="slope of per-call time (less the excluded ops timed alone) over 1, 2 and 4 delegates",
        ),
        "4 delegates / 1 delegate, per call": Figure(variants[4].median_us, "µs", one),
        "1 delegate / plain AOTI loader.run, per call": Figure(
            one, "µs", runner.median_us, note=f"fixed cost of a one-delegate call: {one - runner.median_us:.1f} µs"
        ),
        "1 delegate / plain AOTI, per call": Figure(one, "µs", raw.median_us),
        "excluded ops alone (gelu + 2 silu)": Figure(eager_ops[4], "µs"),
    }


if __name__ == "__main__":
    run_standalone(__doc__, boundary, round_robin=True)
