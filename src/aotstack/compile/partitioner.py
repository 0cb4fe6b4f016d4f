"""The partitioner interface and the tagging helpers every partitioner shares.

A partitioner marks the nodes its backend will run with ``node.meta["delegation_tag"]``
and says, per tag, which backend and options take it. It never changes the ops themselves.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from ..format.op_names import op_name
from ..format.ops import is_delegate_call, is_delegate_output
from ..format.placement import Reason
from ..format.specs import CompileSpec, DelegationSpec, SpecKey
from .program_parts import (
    constant_placeholders,
    functionalized_call,
    is_size_computation,
    mutated_buffer_names,
    subgraph_modules,
    subgraph_nodes,
)
from .work import Largest, known_work, largest_sizes

DELEGATION_TAG = "delegation_tag"

# Higher-order ops whose operands include subgraphs (get_attr nodes): the subgraphs go
# wherever the op goes.
CONTROL_FLOW_OPS = ("cond", "while_loop", "scan", "map_impl")

# A part beside ops another engine (or plain ATen) runs, doing less arithmetic than this (``work.node_work``,
# multiply-adds roughly), costs more at its boundaries than its engine saves: a delegate called and returned
# from took 30-80 µs on this project's CPUs at 1 thread, a 512x512 linear at one row about 30. Left to the next
# engine, it joins that engine's parts beside it (a small Llama, XNNPACK taking the norms between AOTInductor's
# int4 linears: 35 delegates, 1.2x float32's time).
MIN_ISLAND_WORK = 1 << 18
# ... and less than this share of the method's work: the whole of a small model is light, and there the parts an
# engine order makes are the user's to ask for.
ISLAND_SHARE = 0.01

# Ops that only reinterpret memory; they do not count towards ``min_block_size``.
_NON_COMPUTE_OPS = frozenset({"aten._unsafe_view.default"})


@dataclass
class PartitionResult:
    """What a partitioner returns: the program with ``delegation_tag`` set on claimed nodes."""

    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec]
    # Node name -> why the partitioner left that node untagged; shown in the report.
    refusals: dict[str, Reason] = field(default_factory=dict)


class Partitioner(ABC):
    """Base of every partitioner: claims parts of one method's graph for a backend."""

    @abstractmethod
    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag the nodes this partitioner's backend takes; return the tags and their backends."""

    def compiled_calls_aten_kernel(self, node: Node) -> bool:
        """Whether this engine's code for ``node`` would still hand its work to an ATen kernel (a matmul, an
        attention), so that compiling ``node`` saves about nothing over running it as plain ATen.

        Auto asks a plan's closing engine before compiling parts that would gain too little
        (``auto.closing_gain_refusal``). The default, False, counts all of a node's plain time as what compiling
        it could save.
        """
        return False


class SupportedOpsPartitioner(Partitioner):
    """Claims, for one backend, the maximal convex parts of a graph whose ops it supports.

    A subclass names its backend and answers ``supports_op`` (and, to say why it refuses an op,
    ``op_refusal``); everything else is shared:
    nothing lowered earlier is offered again, control-flow ops go with their subgraphs
    (when the backend lists them in ``control_flow``), parts with fewer than
    ``min_block_size`` compute nodes are left to the next partitioner or to plain ATen, as are
    parts beside ops left to others that do less than ``min_island_work`` and ``ISLAND_SHARE`` of
    the method (``island_work``; 0, the default, claims them all; the engines that open a session
    per delegate ask for ``MIN_ISLAND_WORK``), and the weights and mutated buffers a part reads
    take its tag.
    """

    backend_id: ClassVar[str]
    control_flow: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        min_block_size: int = 1,
        min_island_work: int = 0,
        compile_specs: Iterable[CompileSpec] = (),
    ) -> None:
        if isinstance(min_block_size, bool) or not isinstance(min_block_size, int) or min_block_size < 1:
            raise ValueError(f"min_block_size must be an int >= 1, got {min_block_size!r}")
        if isinstance(min_island_work, bool) or not isinstance(min_island_work, int) or min_island_work < 0:
            raise ValueError(f"min_island_work must be an int >= 0, got {min_island_work!r}")
        self.min_block_size = min_block_size
        self.min_island_work = min_island_work
        self.compile_specs = list(compile_specs)

    @abstractmethod
    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        """Whether the backend can run ``op`` (for a control-flow op: the op itself, not its subgraphs)."""

    def op_refusal(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> Reason | None:
        """Why the backend does not take ``op``; None where it does. A subclass says more than this."""
        return None if self.supports_op(op) else self.refusal("unsupported", f"{self.backend_id} does not take it")

    def refusal(self, kind: str, detail: str) -> Reason:
        return Reason(self.backend_id, kind, detail)

    def default_target_device(self) -> str:
        return "cpu"

    def delegation_spec(self) -> DelegationSpec:
        specs = list(self.compile_specs)
        if not any(spec.key == SpecKey.TARGET_DEVICE for spec in specs):
            specs.insert(0, CompileSpec(SpecKey.TARGET_DEVICE, self.default_target_device().encode()))
        return DelegationSpec(self.backend_id, specs)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        graph_module = exported_program.graph_module
        answers: dict[Node, bool] = {}

        def supported(node: Node) -> bool:
            if node not in answers:
                answers[node] = self.supports_node(node, graph_module)
            return answers[node]

        for_others = computations_for_others(weight_computations(exported_program), supported)
        proposed = CapabilityBasedPartitioner(
            graph_module, NodeSupport(lambda node: node not in for_others and supported(node)),
            allows_single_node_partition=True,
        ).propose_partitions()
        judged = [(partition, self.part_refusal(partition, exported_program)) for partition in proposed]
        kept = [partition for partition, refused in judged if refused is None]
        refusals = self.refusals(graph_module, [(p, refused) for p, refused in judged if refused is not None], answers)
        for node in for_others:
            refusals[node.name] = self.refusal(
                "not_claimed",
                f"it computes from weights alone, for ops {self.backend_id} leaves: the engine that runs them computes "
                "it from the weights it holds, rather than receiving it at every call",
            )
        tags: dict[str, DelegationSpec] = {}
        for index, partition in enumerate(sorted(kept, key=first_node_position(exported_program.graph))):
            tag = f"{self.backend_id}_{index}"
            for node in partition.nodes:
                node.meta[DELEGATION_TAG] = tag
                for subgraph in subgraph_nodes(node):
                    subgraph.meta[DELEGATION_TAG] = tag
            tags[tag] = self.part_delegation_spec(partition, exported_program)
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, tags, refusals)

    def part_delegation_spec(self, partition: Partition, exported_program: ExportedProgram) -> DelegationSpec:
        """The delegation spec of a claimed part: ``delegation_spec()``; a subclass may compile some parts otherwise."""
        return self.delegation_spec()

    def part_refusal(self, partition: Partition, exported_program: ExportedProgram) -> Reason | None:
        """Why a proposed part is left unclaimed as a whole; None where it is claimed.

        Here: it has fewer than ``min_block_size`` compute ops, or it is an island doing less than
        ``min_island_work`` and ``ISLAND_SHARE`` of the method (``island_work``). A subclass may leave more.
        """
        count = compute_node_count(partition.nodes)
        if count < self.min_block_size:
            detail = f"its part has {plural(count, 'compute op')}, fewer than min_block_size={self.min_block_size}"
            return self.refusal("min_block_size", detail)
        largest = largest_sizes(exported_program)
        work = island_work(partition.nodes, largest) if self.min_island_work else None
        if work is None or work >= self.min_island_work:
            return None
        method_work = known_work((node for node in exported_program.graph.nodes
                                  if node.op == "call_function" and is_compute_node(node)), largest)
        if method_work is None or work >= ISLAND_SHARE * method_work:
            return None
        detail = (f"its part, beside ops left to others, does at most about {work:,.0f} multiply-adds, fewer than "
                  f"min_island_work={self.min_island_work:,} and {ISLAND_SHARE:.0%} of the method's: its boundaries "
                  "would cost more than it saves")
        return self.refusal("min_block_size", detail)

    def supports_node(self, node: Node, owner: GraphModule) -> bool:
        """Whether ``node``, a node of ``owner``'s graph, can go to this backend."""
        return self.node_refusal(node, owner) is None

    def node_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        """Why ``node``, a node of ``owner``'s graph, cannot go to this backend; None where it can."""
        if node.op != "call_function" or is_delegate_call(node) or is_delegate_output(node):
            return self.refusal("unsupported", "it is not an op this partitioner is offered")
        if is_size_computation(node):
            # Sizes stay in the method; each partition recomputes the ones it reads (see lower).
            return self.refusal("unsupported", "size computations stay in the method")
        if node.target is operator.getitem:
            source = node.args[0]
            if not isinstance(source, Node):
                return self.refusal("unsupported", "it takes an item of a value no op computed")
            return self.node_refusal(source, owner)
        if functionalized_call(node):
            # An op that writes into its arguments, called on copies: the engine takes it or not.
            return self.op_refusal(node.args[0])
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return self.control_flow_refusal(node, owner)
        if not isinstance(node.target, torch._ops.OpOverload):
            return self.refusal("unsupported", f"it calls the Python function {getattr(node.target, '__name__', '?')}")
        return self.op_refusal(node.target)

    def control_flow_refusal(self, node: Node, owner: GraphModule) -> Reason | None:
        """Why a control-flow node cannot go here: the op itself, or the first op of its subgraphs that cannot."""
        name = node.target.__name__
        if name not in self.control_flow:
            return self.refusal("unsupported", f"{self.backend_id} does not compile {name} with its subgraphs")
        refused = self.op_refusal(node.target)
        if refused is not None:
            return refused
        for body in subgraph_modules(node, owner):
            for inner in body.graph.nodes:
                if inner.op != "call_function":
                    continue
                refused = self.node_refusal(inner, body)
                if refused is not None:
                    inner_op = op_name(inner.target) if isinstance(inner.target, torch._ops.OperatorBase) else "?"
                    return Reason(refused.engine, refused.kind, f"its subgraph calls {inner_op}: {refused.detail}")
        return None

    def refusals(
        self, graph_module: GraphModule, left_parts: list[tuple[Partition, Reason]], answers: Mapping[Node, bool]
    ) -> dict[str, Reason]:
        """Why each node offered (see get_non_lowered_nodes) is left untagged, by node name.

        ``left_parts`` are the parts left whole, with why (``part_refusal``); ``answers`` holds
        what ``supports_node`` said of each node while partitioning; a reason is worked out only
        for the nodes it refused.
        """
        left = {node.name: reason for partition, reason in left_parts for node in partition.nodes}
        for node in get_non_lowered_nodes(graph_module.graph):
            if node.name in left or is_size_computation(node):
                continue
            supported = answers[node] if node in answers else self.supports_node(node, graph_module)
            if not supported:
                left[node.name] = self.node_refusal(node, graph_module) or self.refusal(
                    "not_claimed", f"{type(self).__name__}.supports_node refused it"
                )
        return left


class NodeSupport(OperatorSupportBase):
    """``CapabilityBasedPartitioner``'s view of a support predicate."""

    def __init__(self, supported: Callable[[Node], bool]) -> None:
        self.supported = supported

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: Node) -> bool:
        return self.supported(node)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def island_work(nodes: Collection[Node], largest: Largest | None = None) -> float | None:
    """The work of a part that reads or feeds ops outside it, at the largest sizes ``largest`` allows; None for one of
    unbounded sizes, or that only reads the method's inputs and weights and only feeds its outputs (nothing beside it
    to join).

    Such a part left to the engine beside it saves a boundary or two: a value that would have
    crossed into the part and out again stays in that engine. A part of symbolic sizes light even
    at its largest (a prefill's ``pow`` between a linear and the norm's ``mean``) is light at
    every size.
    """
    def computed_outside(node: Node) -> bool:
        return node not in nodes and node.op == "call_function" and not is_size_computation(node)

    reads = any(computed_outside(source) for node in nodes for source in node.all_input_nodes)
    feeds = any(computed_outside(user) for node in nodes for user in node.users)
    return known_work((node for node in nodes if is_compute_node(node)), largest) if reads or feeds else None


def weight_computations(exported_program: ExportedProgram) -> list[Node]:
    """The offered ops that compute from the method's weights alone, or from nothing (an ``arange`` of fixed size),
    in graph order: no input of the method and no buffer it (or another method of its program) updates reaches them."""
    updated = mutated_buffer_names(exported_program)
    derived = {node for node in constant_placeholders(exported_program) if node.name not in updated}
    found = []
    for node in get_non_lowered_nodes(exported_program.graph):
        if not is_size_computation(node) and all(source in derived for source in node.all_input_nodes):
            derived.add(node)
            found.append(node)
    return found


def computations_for_others(computations: list[Node], supported: Callable[[Node], bool]) -> set[Node]:
    """The weight computations (``weight_computations``) the partitioner supports whose every result goes to ops it
    refuses.

    Claimed, such an op would run in this engine at every call and hand its result, a transposed
    or sliced copy of weights, over a boundary to the engine that runs its readers (an experts
    layer's weights, transposed by ONNX Runtime for transformers' grouped matmul that AOTInductor
    runs: a copy of every expert's weights each token). Left, it goes with its readers. A result
    that a delegate or the method's output reads keeps the op where it is.
    """
    left: set[Node] = set()
    for node in reversed(computations):
        readers = list(node.users)
        if readers and supported(node) and all(
            reader in left or (reader.op == "call_function" and not is_delegate_call(reader) and not supported(reader))
            for reader in readers
        ):
            left.add(node)
    return left


def compute_node_count(nodes: Iterable[Node]) -> int:
    """Nodes that compute something: not getitems, not views."""
    return sum(1 for node in nodes if is_compute_node(node))


def is_compute_node(node: Node) -> bool:
    if node.target is operator.getitem:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return not node.target.is_view and str(node.target) not in _NON_COMPUTE_OPS
    return True


def first_node_position(graph: Graph) -> Callable[[Partition], int]:
    position = {node: index for index, node in enumerate(graph.nodes)}
    return lambda partition: min(position[node] for node in partition.nodes)


def get_non_lowered_nodes(graph: Graph) -> list[Node]:
    """The call_function nodes no earlier partitioner has lowered.

    A delegate call and the getitems that take its outputs are never offered again, so no
    delegate is ever nested inside another.
    """
    return [
        node
        for node in graph.nodes
        if node.op == "call_function" and not is_delegate_call(node) and not is_delegate_output(node)
    ]


def tag_constant_data(exported_program: ExportedProgram) -> None:
    """Give each parameter, buffer and constant the tag of the partition that uses it.

    A constant whose users are all tagged goes with the first partition that reads it;
    lowering copies it into every partition that reads it, and the package stores it once.
    One read by an untagged node (plain ATen, or a delegate lowered earlier) stays untagged.
    One nobody uses takes the first tag, so no constant is left dangling when everything
    else is claimed.
    """
    tags_in_graph = [
        node.meta[DELEGATION_TAG] for node in exported_program.graph.nodes if DELEGATION_TAG in node.meta
    ]
    mutated = mutated_buffer_names(exported_program)
    for node in constant_placeholders(exported_program):
        if node.name in mutated:
            continue
        user_tags = [user.meta.get(DELEGATION_TAG) for user in node.users]
        if not user_tags:
            if tags_in_graph:
                node.meta[DELEGATION_TAG] = tags_in_graph[0]
        elif None not in user_tags:
            node.meta[DELEGATION_TAG] = min(user_tags, key=tags_in_graph.index)


def tag_mutated_buffer(exported_program: ExportedProgram) -> None:
    """Tag a mutated buffer with the partition that computes its new value.

    The mutation itself stays in the method, so the buffer's state lives in one place.
    """
    signature = exported_program.graph_signature
    producers = {node.name: node for node in exported_program.graph.nodes}
    buffer_placeholders = {
        spec.target: spec.arg.name
        for spec in signature.input_specs
        if spec.kind == InputKind.BUFFER
    }
    for output_name, buffer_fqn in signature.buffers_to_mutate.items():
        producer = producers.get(output_name)
        placeholder = producers.get(buffer_placeholders.get(buffer_fqn, ""))
        if producer is not None and placeholder is not None and DELEGATION_TAG in producer.meta:
            placeholder.meta[DELEGATION_TAG] = producer.meta[DELEGATION_TAG]
