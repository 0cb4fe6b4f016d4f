"""A model with 500 MB of float32 weights: load and first call, resident memory, file size.

Five ``Linear(5000, 5000)`` layers (ReLU between them, all supported: one delegate), lowered and saved
once. Then fresh processes, alternating:

- read and SHA-256-hash the ``.pt2`` once (one thread, 4 MiB reads), the baseline for time
- ``import torch, aotstack`` (untimed; resident memory noted after it), then ``aotstack.load`` and the
  first ``forward`` call, timed; peak resident memory (``VmHWM``) at the end

The file is read once before the first child, so both sides find it in the page cache. Memory target:
peak resident memory at most 1.15x (the weights + a fresh process's resident memory after
``import torch, aotstack``).

    .venv/bin/python bench/large.py [--quick] [--threads 1]
"""

from __future__ import annotations

import os
import time

from common import (
    Figure,
    Figures,
    Settings,
    build_aotstack,
    median,
    progress,
    run_child,
    run_standalone,
    save_inputs,
)
from workloads import large, weights_bytes

LOAD_TARGET = 1.5  # load + first call / read + hash once
MEMORY_TARGET = 1.15  # peak RSS / (weights + import RSS)


def warm_page_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as file:
        while file.read(1 << 24):
            pass


def large_model(settings: Settings) -> Figures:
    model, args = large()
    weights = weights_bytes(model)
    path = settings.path("large.pt2")
    progress(f"exporting, lowering and saving a model of {weights / 1e6:.1f} MB of weights ...")
    started = time.perf_counter()
    build_aotstack(model, args, path)
    progress(f"compiled and saved in {time.perf_counter() - started:.1f} s; {os.path.getsize(path) / 1e6:.1f} MB")
    inputs = save_inputs(settings.path("large-inputs.pt"), args)
    del model
    warm_page_cache(path)
    runs = settings.pick(5, 2)
    hashing, loading = [], []
    for run in range(runs):
        hashing.append(run_child(["sha256", path]))
        loading.append(run_child(["load", "aotstack", path, inputs, str(settings.threads)]))
        progress(
            f"run {run + 1}/{runs}: read+hash {hashing[-1]['read_hash_s']:.2f} s, "
            f"load+first call {loading[-1]['load_first_s']:.2f} s, peak RSS {loading[-1]['peak_rss'] / 1e6:.0f} MB"
        )
    import_rss = median([sample["import_rss"] for sample in loading])
    return {
        "load + first call / read + SHA-256 once": Figure(
            median([sample["load_first_s"] for sample in loading]),
            "s",
            median([sample["read_hash_s"] for sample in hashing]),
            LOAD_TARGET,
            note=f"fresh processes, file in the page cache for both; median of {runs}",
        ),
        "peak RSS / (weights + import RSS)": Figure(
            median([sample["peak_rss"] for sample in loading]) / 1e6,
            "MB",
            (weights + import_rss) / 1e6,
            MEMORY_TARGET,
            note="VmHWM of the loading process after its first call",
        ),
        "RSS after import torch, aotstack": Figure(import_rss / 1e6, "MB"),
        "file size / weights": Figure(os.path.getsize(path) / 1e6, "MB", weights / 1e6),
    }


if __name__ == "__main__":
    run_standalone(__doc__, large_model)
