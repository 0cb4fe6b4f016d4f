"""Dropping the weights that delegates took from the method that no longer reads them."""

from __future__ import annotations

import dataclasses

from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, OutputKind, OutputSpec, TensorArgument
from torch.fx import Graph, Node

from .program_parts import constant_placeholders, with_guards_of


def without_unused_constants(exported: ExportedProgram, read_before: set[str]) -> ExportedProgram:
    """The program minus the weights that delegates took and nothing else reads.

    Weights unused from the start are kept: they are part of the model's state.
    """
    graph = exported.graph
    gone = {
        node.name
        for node in constant_placeholders(exported)
        if not node.users and node.name in read_before
    }
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in gone:
            graph.erase_node(node)
    exported.graph_module.recompile()
    signature = ExportGraphSignature(
        input_specs=[s for s in exported.graph_signature.input_specs if s.arg.name not in gone],
        output_specs=renamed_output_specs(exported.graph_signature, graph),
    )
    kept_targets = {s.target for s in signature.input_specs}
    program = ExportedProgram(
        root=exported.graph_module,
        graph=graph,
        graph_signature=signature,
        state_dict={k: v for k, v in exported.state_dict.items() if k in kept_targets},
        range_constraints=exported.range_constraints,
        module_call_graph=exported.module_call_graph,
        example_inputs=exported.example_inputs,
        constants={k: v for k, v in exported.constants.items() if k in kept_targets},
    )
    return with_guards_of(program, exported)


def renamed_signature(signature: ExportGraphSignature, graph: Graph) -> ExportGraphSignature:
    """``signature`` naming ``graph``'s nodes, a copy of its program's graph: placeholders in order, then outputs.

    A copy may rename a placeholder (``input``, a builtin's name, becomes ``input_1``), and a rewrite
    may put another node in an output's place.
    """
    placeholders = list(graph.find_nodes(op="placeholder"))
    renamed = {spec.arg.name: node.name for spec, node in zip(signature.input_specs, placeholders, strict=True)
               if hasattr(spec.arg, "name")}
    inputs = [dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=renamed[spec.arg.name]))
              if hasattr(spec.arg, "name") else spec for spec in signature.input_specs]
    outputs = [dataclasses.replace(spec, target=renamed[spec.target])
               if spec.kind is OutputKind.USER_INPUT_MUTATION and spec.target in renamed else spec
               for spec in renamed_output_specs(signature, graph)]
    return ExportGraphSignature(input_specs=inputs, output_specs=outputs)


def renamed_output_specs(signature: ExportGraphSignature, graph: Graph) -> list[OutputSpec]:
    """``signature``'s output specs naming the nodes ``graph``'s output now reads (a getitem where a delegate took
    over, a node put in another's place)."""
    specs = []
    for spec, value in zip(signature.output_specs, graph.output_node().args[0]):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, Node):
            spec = OutputSpec(spec.kind, TensorArgument(value.name), spec.target)
        specs.append(spec)
    return specs
