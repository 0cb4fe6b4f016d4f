"""A picture of a lowered program: each method's run plan drawn as one standalone SVG document.

Delegates are single boxes coloured by engine, with their op count and a tooltip listing their ops;
ops left to plain ATen are small neutral boxes; host-device copies are dashed; method inputs and
outputs are pills. Weights are only counted: a real model reads hundreds of them, and drawn as nodes
they would bury everything else. ``getitem`` steps are folded into the step whose output they take.

The layout is layered, top to bottom (after Sugiyama): a node's rank is its longest path from the
inputs; the edges from one source that span several ranks share one chain of small dummy slots, a
trunk, and branch off it; barycenter sweeps order each rank to cut crossings (the best of the sweeps
is kept, then neighbours are swapped where that crosses less); and each rank's x positions are a
least-squares fit to its neighbours' under the no-overlap constraint (isotonic regression, linear
time). Every pass is linear in nodes plus dummies, and sharing trunks keeps the dummies near the
node count for real models, where a mask or a position table feeds every layer. ``bench/draw.py``
measures a 500- and a 2000-node method.

Each element carries a class and ``data-`` attributes naming what it is, so that tests and tools can
read the picture back: ``<g class="node delegate" data-delegate="forward.0" data-engine="aoti_cpu"
data-device="cpu">``, ``<g class="node op" data-op="aten.gelu.default" data-step="gelu">``, ``<g
class="node copy" data-step=... data-to="cuda:0">`` (``cpu`` for a copy to the host), ``node input``
(``data-input``), ``node output`` (``data-output``, or ``data-update`` for a buffer the method
updates), ``node subgraph`` (``data-step``), and ``<path class="edge" data-from=... data-to=...>``
between them, naming boxes by step, delegate or input name, ``output N`` or ``update FQN``. A
``<path class="trunk">`` is the shared stretch of long edges, drawn once.
"""

from __future__ import annotations

import bisect
import colorsys
import hashlib
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from ..format.manifest import DelegateRecord, Dim, InputRecord, MethodRecord
from ..format.op_names import op_name
from ..format.ops import d2h_copy, h2d_copy
from ..format.plan import DelegateStep, InputStep, OpStep, Step, SubgraphStep, WeightStep, refs
from ..format.records import TensorSpec

# What a run plan calls aotstack's copies and getitem (compile/plan.py writes ``operator.<name>``).
H2D_COPY = op_name(h2d_copy)
D2H_COPY = op_name(d2h_copy)
GETITEM = "operator.getitem"

# Fixed colours for the engines aotstack ships; any other engine gets one derived from its id.
ENGINE_COLOURS = {
    "aoti_cpu": "#3b6fb6",
    "aoti_cuda": "#3d8f47",
    "aoti_metal": "#8557b3",
    "onnxruntime": "#c96f1c",
}

# Geometry, in px. Labels are monospace, so a label's width follows from its length.
CHAR_WIDTH = 7.2  # 12 px monospace
LINE_HEIGHT = 15.0
PAD_X, PAD_Y = 10.0, 5.0
MIN_WIDTH = 48.0
MAX_LABEL = 40  # longer labels are cut; the tooltip has the whole text
DUMMY_WIDTH = 4.0
NODE_GAP = 14.0
RANK_GAP = 34.0
MARGIN = 20.0
HEADING_HEIGHT = 48.0
SECTION_GAP = 30.0
SWEEPS = 4
MAX_PAIRS = 256  # past this many pairs of lines, two slots are not weighed for a swap

STYLE = """
text{font:12px monospace;fill:#222;text-anchor:middle}
.doc-title{font:bold 18px sans-serif;text-anchor:start}
.heading text{text-anchor:start}
.heading .name{font:bold 16px sans-serif}
.heading .summary{font:12px sans-serif;fill:#555}
.legend text{font:12px sans-serif;text-anchor:start}
.background{fill:#fff}
.node rect,.legend-item rect{stroke-width:1.2}
.delegate>rect{stroke:#222}
.node.delegate text{fill:#fff}
.node.delegate .engine{font-weight:bold}
.op>rect{fill:#f3f3f3;stroke:#9a9a9a}
.copy>rect{fill:#fff3d1;stroke:#b07800;stroke-dasharray:4 2}
.input>rect,.output>rect{fill:#e6eef8;stroke:#3b6fb6}
.subgraph>rect{fill:#ececec;stroke:#555;stroke-dasharray:6 2}
.edge,.trunk{fill:none;stroke:#7a7a7a;stroke-width:1.1}
.edge{marker-end:url(#arrow)}
"""


@dataclass
class Node:
    """One box: what edges call it by, its kind, its label lines, tooltip and ``data-`` attributes."""

    key: str
    kind: str
    lines: list[str]
    tooltip: str
    data: dict[str, str] = field(default_factory=dict)
    engine: str | None = None

    @property
    def width(self) -> float:
        return max(MIN_WIDTH, max(len(line) for line in self.lines) * CHAR_WIDTH + 2 * PAD_X)

    @property
    def height(self) -> float:
        return len(self.lines) * LINE_HEIGHT + 2 * PAD_Y


@dataclass
class MethodGraph:
    """A method's boxes and edges; an edge ``(u, v)`` always has ``u < v`` (steps read only earlier steps)."""

    nodes: list[Node]
    edges: list[tuple[int, int]]
    weights: int


@dataclass
class Layout:
    """Where everything goes. Slots are the nodes, then one dummy per rank an edge passes through."""

    rank: list[int]
    width: list[float]
    x: list[float]  # centre of each slot
    rank_top: list[float]
    rank_height: list[float]
    hops: list[tuple[int, int, int]]  # per edge: its source, the slot it enters its target from, its target
    trunks: dict[int, list[int]]  # per source of long edges, the dummies they share, in rank order
    size: tuple[float, float]


# Public entry --------------------------------------------------------------------------------------


def program_svg(
    methods: Mapping[str, MethodRecord],
    *,
    delegate_op_counts: Mapping[str, int] | None = None,
    title: str = "",
) -> str:
    """One standalone SVG document drawing every method of a program, stacked, with a legend of engines.

    ``delegate_op_counts`` maps a delegate id to the number of ops it replaced, where known; a delegate
    missing from it is labelled with the number of distinct ops it holds.
    """
    counts = delegate_op_counts or {}
    graphs = {name: method_graph(record, counts) for name, record in methods.items()}
    layouts = {name: layout(graph) for name, graph in graphs.items()}
    engines = engines_in(graphs.values())

    body: list[str] = []
    y = MARGIN
    if title:
        body.append(f'<text class="doc-title" x="{MARGIN}" y="{num(y + 16)}">{text(title)}</text>')
        y += 30
    legend, legend_width = legend_svg(engines)
    body.append(f'<g class="legend" transform="translate({num(MARGIN)},{num(y)})">{legend}</g>')
    y += 34
    width = legend_width
    for name, graph in graphs.items():
        placed = layouts[name]
        body.append(section_svg(name, graph, placed, y))
        y += HEADING_HEIGHT + placed.size[1] + SECTION_GAP
        width = max(width, placed.size[0], len(heading_summary(graph)) * 6.5)
    total_width, total_height = width + 2 * MARGIN, y
    return "".join(
        [
            '<svg xmlns="http://www.w3.org/2000/svg" ',
            f'width="{num(total_width)}" height="{num(total_height)}" ',
            f'viewBox="0 0 {num(total_width)} {num(total_height)}">',
            f"<title>{text(title or 'aotstack program')}</title>",
            f"<style>{escape(STYLE + engine_css(engines))}</style>",
            '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
            'orient="auto"><path d="M0,0L8,4L0,8z" fill="#7a7a7a"/></marker></defs>',
            '<rect class="background" width="100%" height="100%"/>',
            *body,
            "</svg>\n",
        ]
    )


# The graph of one method --------------------------------------------------------------------------


def method_graph(record: MethodRecord, op_counts: Mapping[str, int]) -> MethodGraph:
    """The boxes and edges of ``record``'s run plan; weights and getitems are not boxes of their own."""
    delegates = {delegate.id: delegate for delegate in record.delegates}
    inputs = {item.name: item for item in record.inputs}
    nodes: list[Node] = []
    edges: set[tuple[int, int]] = set()
    # Name a step computes -> the box that stands for it (a getitem stands for its source's box).
    made: dict[str, int] = {}
    weight_names: set[str] = set()
    for step in record.plan.steps:
        if isinstance(step, WeightStep):
            weight_names.add(step.name)
            continue
        if isinstance(step, OpStep) and step.target == GETITEM:
            source = refs(step.args[:1])
            if source and source[0] in made:
                made[step.name] = made[source[0]]
            continue
        reads = step_inputs(step)
        node = step_node(step, delegates, inputs, op_counts, sum(name in weight_names for name in reads))
        index = len(nodes)
        nodes.append(node)
        edges.update((made[name], index) for name in reads if name in made)
        for name in step_outputs(step):
            made[name] = index
    for position, value in enumerate(record.plan.outputs):
        label = f"output {position}"
        nodes.append(Node(label, "output", [label], output_tooltip(value), {"data-output": str(position)}))
        edges.update((made[name], len(nodes) - 1) for name in refs(value) if name in made)
    for fqn, name in record.plan.mutations:
        nodes.append(
            Node(
                f"update {fqn}",
                "output",
                [cut(f"update {fqn}")],
                f"updates buffer {fqn} from {name}",
                {"data-update": fqn},
            )
        )
        if name in made:
            edges.add((made[name], len(nodes) - 1))
    return MethodGraph(nodes, sorted(edges), len(weight_names))


def step_inputs(step: Step) -> list[str]:
    if isinstance(step, DelegateStep):
        return list(step.inputs)
    if isinstance(step, OpStep):
        return refs([step.args, step.kwargs])
    return []


def step_outputs(step: Step) -> list[str]:
    if isinstance(step, DelegateStep):
        return [name for _, name in step.outputs]
    return [step.name]


def step_node(
    step: Step,
    delegates: Mapping[str, DelegateRecord],
    inputs: Mapping[str, InputRecord],
    op_counts: Mapping[str, int],
    weights_read: int,
) -> Node:
    if isinstance(step, InputStep):
        record = inputs.get(step.name)
        label = f"{step.name}: {input_type(record)}" if record else step.name
        return Node(step.name, "input", [cut(label)], f"input {label}", {"data-input": step.name})
    if isinstance(step, DelegateStep):
        return delegate_node(step, delegates.get(step.delegate), op_counts.get(step.delegate), weights_read)
    if isinstance(step, SubgraphStep):
        lines = [cut(f"subgraph {step.name}"), f"{len(step.plan.steps)} steps"]
        tooltip = f"subgraph {step.name}: a control-flow branch left to plain ATen, {len(step.plan.steps)} steps"
        return Node(step.name, "subgraph", lines, tooltip, {"data-step": step.name})
    if isinstance(step, OpStep) and step.target == H2D_COPY:
        device = str(step.args[1]) if len(step.args) > 1 else "device"
        return Node(
            step.name,
            "copy",
            [cut(f"copy to {device}")],
            f"{step.name}: host to {device}",
            {"data-step": step.name, "data-to": device},
        )
    if isinstance(step, OpStep) and step.target == D2H_COPY:
        return Node(
            step.name,
            "copy",
            ["copy to host"],
            f"{step.name}: device to host",
            {"data-step": step.name, "data-to": "cpu"},
        )
    assert isinstance(step, OpStep)
    tooltip = f"{step.name} = {step.target}" + (f", reads {plural(weights_read, 'weight')}" if weights_read else "")
    data = {"data-op": step.target, "data-step": step.name}
    return Node(step.name, "op", [cut(short_op_name(step.target))], tooltip, data)


def delegate_node(step: DelegateStep, record: DelegateRecord | None, replaced: int | None, weights_read: int) -> Node:
    engine = record.backend_id if record else "unknown engine"
    kinds = len(record.ops) if record else 0
    count = plural(replaced, "op") if replaced is not None else f"{kinds} {'kind' if kinds == 1 else 'kinds'} of op"
    device = record.target_device if record else "?"
    lines = [cut(engine), cut(step.delegate), count + ("" if device == "cpu" else f" · {device}")]
    tooltip = [f"{step.delegate}: {engine} on {device}, {count}"]
    if record:
        tooltip.append(f"in: {specs_text(record.inputs)}; out: {specs_text(record.outputs)}")
    if weights_read:
        tooltip.append(f"reads {plural(weights_read, 'weight')} from the method")
    if record and record.ops:
        tooltip += ["ops:", *record.ops]
    data = {"data-delegate": step.delegate, "data-engine": engine, "data-device": device}
    return Node(step.delegate, "delegate", lines, "\n".join(tooltip), data, engine)


def output_tooltip(value: object) -> str:
    names = refs(value)
    return f"method output, from {', '.join(names)}" if names else f"method output, the constant {value!r}"


def input_type(record: InputRecord) -> str:
    """``float32[4, s0]``; ``int``; ``none``."""
    if record.kind != "tensor":
        return record.kind
    sizes = ", ".join(d.symbol if isinstance(d, Dim) else "?" if d is None else str(d) for d in record.shape or [])
    return f"{record.dtype}[{sizes}]"


def specs_text(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{s.dtype}[{', '.join('?' if d is None else str(d) for d in s.shape)}]" for s in specs) or "-"


def short_op_name(target: str) -> str:
    """``aten.gelu`` for ``aten.gelu.default``; names without an overload stay whole."""
    parts = target.split(".")
    return ".".join(parts[:2]) if len(parts) == 3 else target


def plural(count: int, noun: str, nouns: str = "") -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def cut(label: str) -> str:
    return label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…"


def engines_in(graphs: Iterable[MethodGraph]) -> list[str]:
    """Every engine the delegates use, in order of first appearance."""
    seen: dict[str, None] = {}
    for graph in graphs:
        for node in graph.nodes:
            if node.engine is not None:
                seen.setdefault(node.engine, None)
    return list(seen)


# Layout -------------------------------------------------------------------------------------------


def layout(graph: MethodGraph) -> Layout:
    ranks = node_ranks(graph)
    rank, hops, trunks = slots_with_dummies(ranks, graph.edges)
    width = [node.width for node in graph.nodes] + [DUMMY_WIDTH] * (len(rank) - len(graph.nodes))
    above, below = neighbours(len(rank), hops, trunks, len(graph.nodes))
    signature = {index for index, node in enumerate(graph.nodes) if node.kind in ("input", "output")}
    order = crossing_order(rank, trunks, above, below, signature)
    x = x_positions(order, width, above + below)
    heights = [0.0] * (max(rank, default=-1) + 1)
    for index, node in enumerate(graph.nodes):
        heights[rank[index]] = max(heights[rank[index]], node.height)
    tops = [0.0] * len(heights)
    for r in range(1, len(heights)):
        tops[r] = tops[r - 1] + heights[r - 1] + RANK_GAP
    right = max((x[i] + width[i] / 2 for i in range(len(x))), default=0.0)
    bottom = tops[-1] + heights[-1] if heights else 0.0
    return Layout(rank, width, x, tops, heights, hops, trunks, (right, bottom))


def node_ranks(graph: MethodGraph) -> list[int]:
    """Each node's rank: its longest path from the inputs.

    Outputs share the last rank; a step that reads no drawn node (only weights, or nothing) sits just
    above its first reader rather than up among the inputs.
    """
    count = len(graph.nodes)
    rank = [0] * count
    has_above = [False] * count
    below: list[list[int]] = [[] for _ in range(count)]
    for u, v in graph.edges:  # sorted by source, and every source comes before its target
        has_above[v] = True
        below[u].append(v)
    for u, v in sorted(graph.edges, key=lambda edge: edge[1]):
        rank[v] = max(rank[v], rank[u] + 1)
    outputs = [i for i, node in enumerate(graph.nodes) if node.kind == "output"]
    last = max((rank[i] for i, node in enumerate(graph.nodes) if node.kind != "output"), default=-1) + 1
    for i in outputs:
        rank[i] = last
    for i, node in enumerate(graph.nodes):
        if not has_above[i] and below[i] and node.kind != "input":
            rank[i] = min(rank[v] for v in below[i]) - 1
    return rank


def slots_with_dummies(
    ranks: list[int], edges: Sequence[tuple[int, int]]
) -> tuple[list[int], list[list[int]], dict[int, list[int]]]:
    """The rank of every slot (nodes, then dummies), each edge's hop into its target, and each source's trunk.

    The long edges from one source share one chain of dummies, its trunk, and branch off it one rank
    above their targets. A mask or position table read by every layer is then one line down the side
    with a branch per layer, and the dummies number at most the ranks per source, not the ranks per edge.
    """
    rank = list(ranks)
    hops = []
    trunks: dict[int, list[int]] = {}
    for u, v in edges:  # sorted by source, then target
        trunk = trunks.setdefault(u, [])
        dummies = rank[v] - rank[u] - 1
        while len(trunk) < dummies:
            trunk.append(len(rank))
            rank.append(rank[u] + len(trunk))
        hops.append((u, trunk[dummies - 1] if dummies else u, v))
    return rank, hops, {u: trunk for u, trunk in trunks.items() if trunk}


@dataclass
class Lines:
    """Each slot's neighbours on one side (the rank above, the rank below, or both), and how hard each pulls."""

    slots: list[list[int]]
    weights: list[list[float]]

    def __post_init__(self) -> None:
        self.totals = [sum(weights) for weights in self.weights]

    def mean(self, slot: int, position: list[float]) -> float:
        """The weighted mean position of ``slot``'s neighbours; with none, its own."""
        near = self.slots[slot]
        if len(near) == 1:  # most dummies: worth skipping the arithmetic
            return position[near[0]]
        if not near:
            return position[slot]
        return sum(map(operator.mul, map(position.__getitem__, near), self.weights[slot])) / self.totals[slot]

    def __add__(self, other: Lines) -> Lines:
        return Lines(
            [a + b for a, b in zip(self.slots, other.slots)], [a + b for a, b in zip(self.weights, other.weights)]
        )


def neighbours(
    count: int, hops: list[tuple[int, int, int]], trunks: dict[int, list[int]], real: int
) -> tuple[Lines, Lines]:
    """Each slot's neighbours on the rank above, and on the rank below.

    A line between dummies pulls hardest, so that long edges run straight and the boxes move instead.
    """
    up: list[list[int]] = [[] for _ in range(count)]
    up_weights: list[list[float]] = [[] for _ in range(count)]
    down: list[list[int]] = [[] for _ in range(count)]
    down_weights: list[list[float]] = [[] for _ in range(count)]
    pairs = {(previous, target) for _, previous, target in hops}
    for source, trunk in trunks.items():
        pairs.update(zip([source, *trunk], trunk))
    for a, b in sorted(pairs):
        weight = 1.0 + 2.0 * (a >= real) + 2.0 * (b >= real)
        up[b].append(a)
        up_weights[b].append(weight)
        down[a].append(b)
        down_weights[a].append(weight)
    return Lines(up, up_weights), Lines(down, down_weights)


def crossing_order(
    rank: list[int],
    trunks: dict[int, list[int]],
    above: Lines,
    below: Lines,
    signature: set[int],
) -> list[list[int]]:
    """Each rank's slots left to right: the fewest crossings of a few barycenter sweeps, then neighbours swapped.

    The method's inputs and outputs (``signature``) stay in the method's order among themselves.
    """
    # Start from plan order; a dummy starts beside its edge's source.
    start = list(range(len(rank)))
    for source, trunk in trunks.items():
        for slot in trunk:
            start[slot] = source
    order: list[list[int]] = [[] for _ in range(max(rank, default=-1) + 1)]
    for slot in sorted(range(len(rank)), key=lambda s: (start[s], s)):
        order[rank[slot]].append(slot)
    position = [0.0] * len(rank)
    for row in order:
        for index, slot in enumerate(row):
            position[slot] = index
    best, fewest = [list(row) for row in order], crossings(order, below, position)
    for _ in range(SWEEPS):
        for r in range(1, len(order)):
            order[r] = sorted_by_barycenter(order[r], above, below, position, signature)
        for r in range(len(order) - 2, -1, -1):
            order[r] = sorted_by_barycenter(order[r], below, above, position, signature)
        count = crossings(order, below, position)
        if count < fewest:
            best, fewest = [list(row) for row in order], count
    for row in best:
        for index, slot in enumerate(row):
            position[slot] = index
    for row in best:
        swap_neighbours(row, above, below, position)
        in_signature_order(row, signature, position)
    return best


def in_signature_order(row: list[int], signature: set[int], position: list[float]) -> None:
    """Put the method's inputs (or outputs) in ``row`` back in the order the method takes (or returns) them.

    They keep the places the sweeps gave them, only shuffled among themselves: a reader looks for
    ``x`` left of ``y``, and that is worth the odd crossing.
    """
    places = [index for index, slot in enumerate(row) if slot in signature]
    for index, slot in zip(places, sorted(row[index] for index in places)):
        row[index] = slot
        position[slot] = index


def sorted_by_barycenter(
    row: list[int],
    near: Lines,
    far: Lines,
    position: list[float],
    signature: set[int],
) -> list[int]:
    """``row`` sorted by the mean position of each slot's neighbours in ``near``, ties by those in ``far``.

    A slot with no neighbours keeps its place. Breaking ties by the other side keeps a sweep from
    undoing, for nothing, the order the sweep before chose.
    """
    if len(row) == 1:
        return row
    keys = {slot: (near.mean(slot, position), far.mean(slot, position)) for slot in row}
    ordered = sorted(row, key=keys.__getitem__)
    for index, slot in enumerate(ordered):
        position[slot] = index
    in_signature_order(ordered, signature, position)
    return ordered


def swap_neighbours(row: list[int], above: Lines, below: Lines, position: list[float]) -> None:
    """Swap slots side by side in ``row`` wherever that crosses fewer lines; barycenters are blind to ties."""
    for index in range(len(row) - 1):
        left, right = row[index], row[index + 1]
        if pair_crossings(right, left, above, below, position) < pair_crossings(left, right, above, below, position):
            row[index], row[index + 1] = right, left
            position[left], position[right] = index + 1, index


def pair_crossings(
    left: int,
    right: int,
    above: Lines,
    below: Lines,
    position: list[float],
) -> int:
    """How many of ``left``'s lines cross ``right``'s, with ``left`` placed first."""
    count = 0
    for near in (above.slots, below.slots):
        if len(near[left]) * len(near[right]) > MAX_PAIRS:
            return 0  # a hub: counting would cost more than the swap can gain
        count += sum(position[a] > position[b] for a in near[left] for b in near[right])
    return count


def crossings(order: list[list[int]], below: Lines, position: list[float]) -> int:
    """How many pairs of lines cross between adjacent ranks: inversions among the lines' lower ends."""
    total = 0
    for upper in order[:-1]:
        ends = sorted((position[a], position[b]) for a in upper for b in below.slots[a])
        seen: list[float] = []
        for _, end in ends:
            total += len(seen) - bisect.bisect_right(seen, end)
            bisect.insort(seen, end)
    return total


def x_positions(order: list[list[int]], width: list[float], near: Lines) -> list[float]:
    """Slot centres: each rank fitted to the weighted mean of its neighbours' centres, without overlap.

    Sweeps go down and up, each rank pulled by both neighbouring ranks (``near``): pulled by one side
    only, a long chain drifts sideways rank after rank.
    """
    x = [0.0] * len(width)
    offsets = [row_offsets(row, width) for row in order]
    for row, spaced in zip(order, offsets):
        shift = spaced[-1] / 2 if spaced else 0.0
        for slot, offset in zip(row, spaced):
            x[slot] = offset - shift
    ranks = range(len(order))
    for _ in range(SWEEPS):
        for sweep in (ranks, ranks[::-1]):
            for r in sweep:
                row = order[r]
                wanted = [near.mean(slot, x) for slot in row]
                for slot, centre in zip(row, packed_row(wanted, offsets[r])):
                    x[slot] = centre
    left = min((x[i] - width[i] / 2 for i in range(len(x))), default=0.0)
    return [centre - left for centre in x]


def row_offsets(row: list[int], width: list[float]) -> list[float]:
    """How far each slot's centre must at least be from the first's, for gaps between the boxes."""
    offsets = [0.0]
    for a, b in zip(row, row[1:]):
        offsets.append(offsets[-1] + (width[a] + width[b]) / 2 + NODE_GAP)
    return offsets


def packed_row(wanted: list[float], offsets: list[float]) -> list[float]:
    """Centres closest (least squares) to ``wanted`` that keep a row in order, at least ``offsets`` apart."""
    if len(wanted) == 1:
        return wanted
    fitted = nondecreasing_fit([w - o for w, o in zip(wanted, offsets)])
    return [f + o for f, o in zip(fitted, offsets)]


def nondecreasing_fit(values: list[float]) -> list[float]:
    """The nondecreasing sequence closest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        total, count = value, 1.0
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            previous_total, previous_count = blocks.pop()
            total, count = total + previous_total, count + previous_count
        blocks.append([total, count])
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return fitted


# SVG ----------------------------------------------------------------------------------------------


def section_svg(name: str, graph: MethodGraph, placed: Layout, top: float) -> str:
    heading = (
        f'<g class="heading"><text class="name" x="0" y="18">{text(name)}</text>'
        f'<text class="summary" x="0" y="36">{text(heading_summary(graph))}</text></g>'
    )
    parts = [
        f'<g class="method" data-method={attribute(name)} transform="translate({num(MARGIN)},{num(top)})">',
        heading,
        f'<g transform="translate(0,{num(HEADING_HEIGHT)})">',
    ]
    parts += edges_svg(graph, placed)
    parts += [node_svg(node, placed, index) for index, node in enumerate(graph.nodes)]
    parts.append("</g></g>")
    return "".join(parts)


def heading_summary(graph: MethodGraph) -> str:
    kinds = [node.kind for node in graph.nodes]
    return " · ".join(
        [
            plural(kinds.count("delegate"), "delegate"),
            f"{plural(kinds.count('op'), 'op')} left to ATen",
            plural(kinds.count("copy"), "host-device copy", "host-device copies"),
            f"{plural(graph.weights, 'weight')} (not drawn)",
        ]
    )


def node_svg(node: Node, placed: Layout, index: int) -> str:
    width, height = placed.width[index], node.height
    left = placed.x[index] - width / 2
    top = placed.rank_top[placed.rank[index]] + (placed.rank_height[placed.rank[index]] - height) / 2
    attributes = "".join(f" {key}={attribute(value)}" for key, value in node.data.items())
    rounding = height / 2 if node.kind in ("input", "output") else 4
    lines = []
    for number, line in enumerate(node.lines):
        css = ' class="engine"' if node.kind == "delegate" and number == 0 else ""
        baseline = PAD_Y + LINE_HEIGHT * number + 11.5
        lines.append(f'<text{css} x="{num(width / 2)}" y="{num(baseline)}">{text(line)}</text>')
    return (
        f'<g class="node {node.kind}"{attributes} transform="translate({num(left)},{num(top)})">'
        f"<title>{text(node.tooltip)}</title>"
        f'<rect width="{num(width)}" height="{num(height)}" rx="{num(rounding)}"/>{"".join(lines)}</g>'
    )


def edges_svg(graph: MethodGraph, placed: Layout) -> list[str]:
    """Each trunk once, without an arrow; then one bézier per edge, from its source or its trunk to its target."""
    direct = {(source, target) for source, previous, target in placed.hops if previous == source}
    exits = ports(placed, direct | {(source, trunk[0]) for source, trunk in placed.trunks.items()})
    entries = ports(placed, {(target, previous) for _, previous, target in placed.hops})
    paths = []
    for source, trunk in placed.trunks.items():
        points = [(exits[source, trunk[0]], node_bottom(graph, placed, source))]
        for dummy in trunk:
            top = placed.rank_top[placed.rank[dummy]]
            points += [(placed.x[dummy], top), (placed.x[dummy], top + placed.rank_height[placed.rank[dummy]])]
        paths.append(f'<path class="trunk" data-from={attribute(graph.nodes[source].key)} d="{bezier_path(points)}"/>')
    for source, last, target in placed.hops:
        if last == source:
            start = (exits[source, target], node_bottom(graph, placed, source))
        else:
            start = (placed.x[last], placed.rank_top[placed.rank[last]] + placed.rank_height[placed.rank[last]])
        points = [start, (entries[target, last], node_top(graph, placed, target))]
        ends = f"data-from={attribute(graph.nodes[source].key)} data-to={attribute(graph.nodes[target].key)}"
        paths.append(f'<path class="edge" {ends} d="{bezier_path(points)}"/>')
    return paths


def ports(placed: Layout, ends: set[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """(node, neighbour slot) -> x where that line leaves or enters the node: spread along its box, in order."""
    by_node: dict[int, list[tuple[float, int]]] = {}
    for node, other in ends:
        by_node.setdefault(node, []).append((placed.x[other], other))
    spread = {}
    for node, here in by_node.items():
        here.sort()
        usable = placed.width[node] * 0.7
        left = placed.x[node] - usable / 2
        for number, (_, other) in enumerate(here):
            spread[node, other] = left + usable * (number + 1) / (len(here) + 1)
    return spread


def node_top(graph: MethodGraph, placed: Layout, index: int) -> float:
    band = placed.rank[index]
    return placed.rank_top[band] + (placed.rank_height[band] - graph.nodes[index].height) / 2


def node_bottom(graph: MethodGraph, placed: Layout, index: int) -> float:
    return node_top(graph, placed, index) + graph.nodes[index].height


def bezier_path(points: list[tuple[float, float]]) -> str:
    """A path through ``points``: curves from a rank's bottom to the next one's top, straight down through a dummy."""
    path = [f"M{num(points[0][0])},{num(points[0][1])}"]
    for index in range(1, len(points)):
        (x0, y0), (x1, y1) = points[index - 1], points[index]
        if index % 2:
            middle = num((y0 + y1) / 2)
            path.append(f"C{num(x0)},{middle} {num(x1)},{middle} {num(x1)},{num(y1)}")
        else:
            path.append(f"L{num(x1)},{num(y1)}")
    return "".join(path)


def legend_svg(engines: list[str]) -> tuple[str, float]:
    """Swatches for each engine in the program and for the other kinds of box; and the legend's width."""
    items = [(f"data-engine={attribute(engine)}", "legend-item delegate", engine) for engine in engines]
    items += [
        ("", "legend-item op", "ATen op (runtime)"),
        ("", "legend-item copy", "host-device copy"),
        ("", "legend-item input", "input / output"),
        ("", "legend-item subgraph", "subgraph"),
    ]
    parts, x = [], 0.0
    for attributes, css, label in items:
        shown = cut(label)
        parts.append(
            f'<g class="{css}" {attributes} transform="translate({num(x)},0)">'
            f'<rect width="14" height="14" rx="3"/><text x="20" y="12">{text(shown)}</text></g>'
        )
        x += 20 + len(shown) * 7.0 + 18
    return "".join(parts), x


def engine_css(engines: list[str]) -> str:
    return "".join(f'[data-engine="{css_string(engine)}"]>rect{{fill:{engine_colour(engine)}}}\n' for engine in engines)


def engine_colour(engine: str) -> str:
    """The engine's fixed colour, or one derived from a hash of its id: the same in every run and picture."""
    if engine in ENGINE_COLOURS:
        return ENGINE_COLOURS[engine]
    digest = hashlib.sha256(engine.encode("utf-8", "replace")).digest()
    hue = int.from_bytes(digest[:2], "big") / 65536
    red, green, blue = colorsys.hls_to_rgb(hue, 0.40, 0.50)
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"


def css_string(value: str) -> str:
    """``value`` inside a double-quoted CSS string."""
    return "".join(f"\\{ord(c):x} " if c in '"\\' or ord(c) < 0x20 else c for c in clean(value))


# Characters XML 1.0 cannot hold at all, even escaped; a hostile manifest's names may contain them.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def clean(value: str) -> str:
    return _NOT_XML.sub("\ufffd", value)


def text(value: str) -> str:
    return escape(clean(value))


def attribute(value: str) -> str:
    return quoteattr(clean(value))


def num(value: float) -> str:
    """A coordinate, to a tenth of a pixel."""
    return f"{value:.1f}".removesuffix(".0")
