"""Engines mixed per region: the one plan ``lower(program, "auto")`` builds from the plans it measured.

Each measured plan puts one engine first (AOTInductor takes what it leaves), and each of its
delegates is a region: the nodes it took and the seconds it took a call. For a region of one
engine, what the same nodes cost in another measured plan is estimated by sharing each of that
plan's delegates' seconds among its nodes by their arithmetic (``node_work``: a matmul of K
columns weighs K times its output, an elementwise op its output). A region is kept where its
engine measured less than every other plan's estimate for it, the regions saving the most first,
none overlapping. The kept regions make one more plan (each engine restricted to its regions,
``RegionPartitioner``, then AOTInductor), which auto measures like the others, boundaries and
all: an estimate only proposes, the measurement decides. It is measured only where its own
estimate (its regions as measured, the nodes they leave as the closing engine's own plan spent on
them) beats the fastest plan's call: building it costs an AOTInductor compile per gap between its
regions, and regions that each save a little can leave the rest to a closing engine far slower
than the plan that won (BERT's XNNPACK regions: 45.2 ms estimated, against OpenVINO's 42). The
estimate leaves out the mix's boundaries, so one that does not beat the fastest plan cannot
measure faster, but for noise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch.export import ExportedProgram
from torch.fx import Node

from ..format.placement import Reason
from ..format.records import Delegate
from .partitioner import DELEGATION_TAG, Partitioner, PartitionResult

# A region is kept only where its engine beats every other plan's estimate by this much: the estimate
# shares a delegate's time by a count of arithmetic, which a memory-bound op does not follow.
MARGIN = 0.10


@dataclass(frozen=True)
class Region:
    """One delegate of a measured plan: its engine, its nodes with their work, its seconds a call."""

    engine: str
    nodes: dict[str, float]
    seconds: float

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.nodes)


@dataclass(frozen=True)
class MeasuredPlan:
    """A plan auto measured for one method: its engines in order, and each delegate as a region."""

    engines: tuple[str, ...]
    regions: list[Region]
    # Its whole call's seconds: its delegates', and what runs between them.
    seconds: float

    def estimate(self, nodes: dict[str, float]) -> float:
        """The seconds of a call this plan spends on ``nodes``, each delegate's seconds shared by work."""
        total = 0.0
        for region in self.regions:
            shared = sum(work for name, work in nodes.items() if name in region.nodes)
            if shared:
                total += region.seconds * shared / max(sum(region.nodes.values()), 1e-30)
        return total

    @property
    def between_delegates(self) -> float:
        """The seconds of its call spent outside its delegates: plain ATen, boundaries."""
        return max(self.seconds - sum(region.seconds for region in self.regions), 0.0)


@dataclass(frozen=True)
class KeptRegion:
    """A region the mix keeps, what its engine measured, and the best estimate of the others."""

    region: Region
    alternative: float
    alternative_plan: tuple[str, ...]


@dataclass(frozen=True)
class Mix:
    """The mixed plan: engines in the order they claim, each with the regions it keeps, then ``closing``."""

    kept: list[KeptRegion]
    closing: str
    # Its call's seconds as ``mix_estimate`` puts them, and the fastest measured plan's; None where not estimated.
    estimate: float | None = None
    fastest: float | None = None

    @property
    def worth_measuring(self) -> bool:
        """Whether its estimate beats the fastest plan (or could not be made)."""
        return self.estimate is None or self.fastest is None or self.estimate < self.fastest

    @property
    def engines(self) -> list[str]:
        return list(dict.fromkeys(kept.region.engine for kept in self.kept))

    def regions(self, engine: str) -> list[frozenset[str]]:
        return [kept.region.names for kept in self.kept if kept.region.engine == engine]

    @property
    def labels(self) -> list[str]:
        """How the report names it: ``["xnnpack (2 regions)", "openvino (1 region)", "aoti_cpu"]``."""
        counts = [(engine, len(self.regions(engine))) for engine in self.engines]
        return [f"{engine} ({n} region{'s' if n != 1 else ''})" for engine, n in counts] + [self.closing]

    @property
    def digest(self) -> str:
        """What identifies the mix in the measurement cache: its engines and their regions' nodes."""
        data = [[kept.region.engine, sorted(kept.region.names)] for kept in self.kept]
        return hashlib.sha256(json.dumps([data, self.closing]).encode()).hexdigest()

    def explanation(self) -> str:
        """Each kept region's measured time beside the best estimate for its nodes elsewhere."""
        rows = [
            f"{kept.region.engine} on {len(kept.region.nodes)} nodes: {kept.region.seconds * 1e3:.3g} ms, "
            f"{kept.alternative * 1e3:.3g} ms in {' > '.join(kept.alternative_plan)}"
            for kept in self.kept
        ]
        estimated = "" if self.estimate is None or self.fastest is None else (
            f"; estimated at {self.estimate * 1e3:.3g} ms a call against {self.fastest * 1e3:.3g} ms for the "
            f"fastest plan")
        return "regions kept: " + "; ".join(rows) + estimated

    def refusal(self) -> str:
        """Why it was not measured (where it is not ``worth_measuring``)."""
        return (f"the plans' regions propose {' > '.join(self.labels)} ({self.explanation()}), no faster, "
                f"so it was not measured")


def delegate_regions(delegates: Sequence[Delegate], seconds: dict[str, float]) -> list[Region]:
    """A lowered plan's delegates as regions, each with its measured seconds a call."""
    return [Region(d.backend_id, dict(d.nodes), seconds.get(d.delegate_id, 0.0)) for d in delegates if d.nodes]


def mixed_cover(plans: Sequence[MeasuredPlan], closing: str) -> Mix | None:
    """The regions to keep from ``plans`` (the first is ``closing`` alone); None where no mix differs from them.

    Only the first engine's regions of each plan compete (the closing engine is the fallback for
    everything); a kept region beats every other plan's estimate for its nodes by ``MARGIN``. The mix
    carries its own estimate beside the fastest plan's call (``Mix.worth_measuring``).
    """
    offers = []
    for plan in plans:
        others = [other for other in plans if other is not plan]
        for region in plan.regions:
            if region.engine != plan.engines[0] or region.engine == closing or not others:
                continue
            best = min(others, key=lambda other: other.estimate(region.nodes))
            alternative = best.estimate(region.nodes)
            if region.seconds < alternative * (1 - MARGIN):
                offers.append(KeptRegion(region, alternative, best.engines))
    offers.sort(key=lambda kept: kept.region.seconds - kept.alternative)
    kept: list[KeptRegion] = []
    taken: set[str] = set()
    for offer in offers:
        if not offer.region.names & taken:
            kept.append(offer)
            taken |= offer.region.names
    if not kept or is_a_whole_plan(kept, plans):
        return None
    return Mix(kept, closing, mix_estimate(kept, plans, closing), min(plan.seconds for plan in plans))


def mix_estimate(kept: Sequence[KeptRegion], plans: Sequence[MeasuredPlan], closing: str) -> float | None:
    """The seconds of a call of the mix of ``kept``: each region as its engine measured it, the nodes they leave
    as ``closing``'s own plan spent on them, and what that plan spent between its delegates; None where no plan
    is ``closing`` alone."""
    alone = next((plan for plan in plans if plan.engines == (closing,)), None)
    if alone is None:
        return None
    taken = frozenset().union(*(k.region.names for k in kept))
    left = {name: work for region in alone.regions for name, work in region.nodes.items() if name not in taken}
    return sum(k.region.seconds for k in kept) + alone.estimate(left) + alone.between_delegates


def is_a_whole_plan(kept: list[KeptRegion], plans: Sequence[MeasuredPlan]) -> bool:
    """Whether ``kept`` is exactly the first engine's regions of one measured plan: nothing new to measure."""
    chosen = {(k.region.engine, k.region.names) for k in kept}
    for plan in plans:
        own = {(r.engine, r.names) for r in plan.regions if r.engine == plan.engines[0]}
        if own and own == chosen:
            return True
    return False


class RegionPartitioner(Partitioner):
    """``inner``, keeping only the parts whose nodes are exactly one of ``regions``; it leaves the rest."""

    def __init__(self, inner: Partitioner, backend_id: str, regions: Collection[frozenset[str]]) -> None:
        self.inner = inner
        self.backend_id = backend_id
        self.regions = set(regions)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        result = self.inner.partition(exported_program)
        graph = result.tagged_exported_program.graph
        members: dict[str, list[Node]] = {}
        for node in graph.nodes:
            tag = node.meta.get(DELEGATION_TAG)
            if tag in result.partition_tags and node.op == "call_function":
                members.setdefault(tag, []).append(node)
        kept = {}
        refusals = dict(result.refusals)
        for tag, spec in result.partition_tags.items():
            nodes = members.get(tag, [])
            if frozenset(node.name for node in nodes) in self.regions:
                kept[tag] = spec
                continue
            for node in graph.nodes:
                if node.meta.get(DELEGATION_TAG) == tag:
                    del node.meta[DELEGATION_TAG]
            for node in nodes:
                refusals[node.name] = Reason(
                    self.backend_id, "excluded", "auto mixed engines per region: another engine measured faster here"
                )
        return PartitionResult(result.tagged_exported_program, kept, refusals)
