"""Time from load to first result in a fresh process: aotstack beside the plain AOTI package, demo model.

The parent compiles both packages once: aotstack's with ``aten.gelu`` excluded (two delegates), and
``aoti_compile_and_package`` of the same ``forward``. Each child imports what its load needs, untimed
(aotstack's runtime on one side, ``torch._inductor`` on the other), reads its input, then times only
``load`` plus the first ``forward`` call. Children alternate between the two. Nothing is asserted.

    .venv/bin/python bench/load.py [--quick] [--threads 1]
"""

from __future__ import annotations

import os
import time

from aotstack.demo import DEMO_EXCLUDED_OPS, describe_method
from common import (
    Figure,
    Figures,
    Settings,
    build_aotstack,
    build_raw_aoti,
    median,
    print_table,
    progress,
    run_child,
    run_standalone,
    save_inputs,
)
from workloads import demo

TARGET_MS = 100.0
VARIANTS = {"aotstack": "aotstack.load", "aoti": "aoti_load_package"}


def load_times(settings: Settings) -> Figures:
    model, args = demo()
    # The latency benchmark's file names: in a suite run, its packages of the same model are reused.
    packages = {"aotstack": settings.path("demo-split.pt2"), "aoti": settings.path("demo-raw.pt2")}
    started = time.perf_counter()
    if not os.path.exists(packages["aotstack"]):
        build_aotstack(model, args, packages["aotstack"], DEMO_EXCLUDED_OPS)
    if not os.path.exists(packages["aoti"]):
        build_raw_aoti(model, args, packages["aoti"])
    progress(f"compiled (or reused) both packages in {time.perf_counter() - started:.1f} s")
    delegates = len(describe_method(packages["aotstack"], "forward"))
    inputs = save_inputs(settings.path("load-demo-inputs.pt"), args)
    runs = settings.pick(5, 3)
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in packages}
    for _ in range(runs):
        for kind, path in packages.items():
            samples[kind].append(run_child(["load", kind, path, inputs, str(settings.threads)]))
    load_ms = {kind: [s["load_first_s"] * 1e3 for s in values] for kind, values in samples.items()}
    rows = [
        [
            VARIANTS[kind],
            str(runs),
            f"{median([s['import_s'] for s in samples[kind]]) * 1e3:.0f}",
            f"{median(load_ms[kind]):.1f}",
            f"{min(load_ms[kind]):.1f}",
            f"{max(load_ms[kind]):.1f}",
        ]
        for kind in packages
    ]
    print_table(["variant", "runs", "import ms (untimed)", "load+1st call ms", "min", "max"], rows)
    ours = median(load_ms["aotstack"])
    note = f"demo forward, {delegates} delegates ({', '.join(DEMO_EXCLUDED_OPS)} in plain ATen); median of {runs}"
    return {
        "demo load + first call, fresh process": Figure(ours, "ms", target=TARGET_MS, note=note),
        "demo load + first call: aotstack / aoti_load_package": Figure(ours, "ms", median(load_ms["aoti"])),
    }


if __name__ == "__main__":
    run_standalone(__doc__, load_times)
