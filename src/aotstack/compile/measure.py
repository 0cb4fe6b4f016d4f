"""Time a lowered program as a user runs it: saved, loaded, each method called on its example inputs.

``lower(..., "auto")`` compares engines by these figures. Like the numerical check, it runs what
was packaged the way a user loads it, so it is the other place the compiler uses the runtime.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from ..engine.interface import BackendRuntime
from ..format.archive import read_manifest
from ..format.records import Delegate
from ..runtime.interpreter import LoadedDelegate
from ..runtime.load import DelegateWrapper, loaded_program
from .check import example_inputs, placed_inputs
from .package import save
from .parallel import quiet_torch_warnings

# Calls before timing starts: first-call work (allocations, lazy initialisation) is not what a user pays per call.
WARM_UP_CALLS = 2
# Timed calls per method: at least the first, at most the second, and no more once the budget is spent.
TIMED_CALLS = (5, 15)
TIME_BUDGET_SECONDS = 2.0


@dataclass(frozen=True)
class MethodTiming:
    """A method's median seconds per call, and the median seconds each of its delegates took in a call."""

    seconds: float
    delegate_seconds: dict[str, float] = field(default_factory=dict)


def measured_methods(
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    examples: Mapping[str, ExportedProgram],
) -> dict[str, MethodTiming]:
    """Each method of a lowered program, saved to a temporary file, loaded and timed on ``examples``' inputs.

    ``examples`` holds the programs as exported, whose example inputs the calls use.
    Every call starts from the package's initial state (a KV cache is reset each time).
    """
    with tempfile.TemporaryDirectory(prefix="aotstack-measure-") as folder:
        path = os.path.join(folder, "measured.pt2")
        save(dict(methods), dict(delegates), path)
        spent: dict[str, list[float]] = defaultdict(list)
        loaded = loaded_program(path, allowed_ops=None, wrap_delegate=timing_into(spent))
        manifest = read_manifest(path)
        timings = {}
        with quiet_torch_warnings(), torch.no_grad():
            for name in methods:
                args, kwargs = placed_inputs(example_inputs(name, examples[name]), manifest.methods[name].inputs)
                method = loaded.method(name)
                timings[name] = timed_method(lambda m=method, a=args, k=kwargs: m(*a, **k), loaded.reset, spent)
        return timings


def timed_method(call: Callable[[], Any], reset: Callable[[], None], spent: dict[str, list[float]]) -> MethodTiming:
    """The median of a few timed calls of ``call``, after warm-up calls, each from the initial state.

    ``spent`` is where the delegates' wrappers add each call's seconds, by delegate id.
    """
    for _ in range(WARM_UP_CALLS):
        reset()
        call()
    lowest, highest = TIMED_CALLS
    samples: list[float] = []
    by_delegate: dict[str, list[float]] = defaultdict(list)
    budget_end = time.perf_counter() + TIME_BUDGET_SECONDS
    while len(samples) < lowest or (len(samples) < highest and time.perf_counter() < budget_end):
        reset()
        spent.clear()
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        for delegate_id, times in spent.items():
            by_delegate[delegate_id].append(sum(times))
    return MethodTiming(
        statistics.median(samples),
        {delegate_id: statistics.median(times) for delegate_id, times in by_delegate.items()},
    )


class TimingRuntime(BackendRuntime):
    """A delegate's run side that records how long each of its calls took."""

    def __init__(self, inner: BackendRuntime, delegate_id: str, spent: dict[str, list[float]]) -> None:
        self.inner, self.delegate_id, self.spent = inner, delegate_id, spent

    def execute(self, handle: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        started = time.perf_counter()
        outputs = self.inner.execute(handle, inputs)
        self.spent[self.delegate_id].append(time.perf_counter() - started)
        return outputs


def timing_into(spent: dict[str, list[float]]) -> DelegateWrapper:
    def timing(delegate_id: str, delegate: LoadedDelegate) -> LoadedDelegate:
        return LoadedDelegate(TimingRuntime(delegate.runtime, delegate_id, spent), delegate.handle)

    return timing
