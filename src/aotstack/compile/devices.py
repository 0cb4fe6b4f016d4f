"""Devices on every boundary tensor: where each delegate runs, and the copies that gets tensors there.

``propagate_device_pass`` runs after every partitioner. Each delegate runs on its
``target_device``; plain ATen ops, weights and (by default) the method's inputs and outputs live
on the host. Where a tensor's producer and consumer disagree, a copy goes between them; a copy to
the host that only feeds a copy back to the same device is dropped, so a tensor passed from one
delegate to another on the same device stays there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from ..engine.registry import backend_class
from ..errors import BackendNotFoundError, LoweringError
from ..format.devices import HOST, Device
from ..format.ops import d2h_copy, h2d_copy, is_delegate_call, is_delegate_output


def propagate_device_pass(
    exported_program: ExportedProgram,
    delegate_devices: Mapping[str, tuple[str, str]],
    *,
    skip_h2d_for_method_inputs: bool = False,
    skip_d2h_for_method_outputs: bool = False,
) -> None:
    """Put ``node.meta["device"]`` on every tensor-valued node and insert the copies it implies.

    ``delegate_devices`` maps each delegate id to ``(backend_id, target_device)``. With
    ``skip_h2d_for_method_inputs`` an input that a delegate reads is taken to be on that
    delegate's device already; with ``skip_d2h_for_method_outputs`` outputs are returned where
    they were computed.
    """
    graph = exported_program.graph
    user_inputs = set(exported_program.graph_signature.user_inputs)
    device_of = node_devices(graph, delegate_devices, user_inputs if skip_h2d_for_method_inputs else set())
    # New values of buffers that live on a device stay there: the plan updates the buffer in place.
    kept = state_on_device(exported_program, device_of)
    for node in list(graph.nodes):
        if node.op == "output":
            if not skip_d2h_for_method_outputs:
                move_inputs(graph, node, HOST, device_of, keep=kept)
        elif is_delegate_call(node):
            move_inputs(graph, node, device_of[node], device_of)
        elif node.op == "call_function" and not is_delegate_output(node) and node.target not in (h2d_copy, d2h_copy):
            move_inputs(graph, node, HOST, device_of)
    remove_round_trips(graph, device_of)
    for node in graph.nodes:
        if node in device_of and node.op != "output":
            node.meta["device"] = device_of[node]


def node_devices(
    graph: Graph, delegate_devices: Mapping[str, tuple[str, str]], inputs_on_device: set[str]
) -> dict[Node, Device]:
    """The device each node's value lives on, before any copy is inserted."""
    devices: dict[Node, Device] = {}
    for node in graph.nodes:
        if is_delegate_call(node):
            devices[node] = delegate_device(node, delegate_devices)
        elif is_delegate_output(node):
            devices[node] = devices[node.args[0]]
        elif node.target is h2d_copy:
            devices[node] = Device.parse(node.args[1])
        else:
            devices[node] = HOST
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in inputs_on_device:
            on_device = [devices[user] for user in node.users if is_delegate_call(user)]
            if on_device:
                devices[node] = on_device[0]
    return devices


def state_on_device(exported_program: ExportedProgram, device_of: dict[Node, Device]) -> set[Node]:
    """Put on a device each buffer the plan updates that only delegates on that device use; their new values.

    A buffer a delegate cannot own (AOTInductor folds a one-element buffer into its code, so a cache's
    length stays a plan input) would otherwise cross to the device and back on every call. Where every
    reader of the buffer is a delegate on one device, and a delegate there computes its new value, the
    buffer lives on that device: the plan hands it over and writes the new value into it there.
    """
    signature = exported_program.graph_signature
    nodes = {node.name: node for node in exported_program.graph.nodes}
    placeholder_of = {fqn: name for name, fqn in signature.inputs_to_buffers.items()}
    kept = set()
    for value_name, fqn in signature.buffers_to_mutate.items():
        buffer, value = nodes.get(placeholder_of.get(fqn, "")), nodes.get(value_name)
        if buffer is None or value is None or not is_delegate_output(value) or device_of[value] == HOST:
            continue
        readers = list(buffer.users)
        if readers and all(is_delegate_call(user) and device_of[user] == device_of[value] for user in readers):
            device_of[buffer] = device_of[value]
            kept.add(value)
    return kept


def delegate_device(node: Node, delegate_devices: Mapping[str, tuple[str, str]]) -> Device:
    delegate_id = node.args[0]
    if delegate_id not in delegate_devices:
        raise LoweringError(
            f"delegate node {node.name!r} calls {delegate_id!r}, which this lowering did not compile; "
            "lower the original program with every partitioner in one list"
        )
    backend_id, target_device = delegate_devices[delegate_id]
    try:
        backend_class(backend_id)
    except BackendNotFoundError as error:
        raise BackendNotFoundError(f"delegate node {node.name!r}: {error}") from None
    return Device.parse(target_device)


def move_inputs(
    graph: Graph, consumer: Node, device: Device, device_of: dict[Node, Device], keep: set[Node] = frozenset()
) -> None:
    """Give ``consumer`` each tensor input but ``keep``'s on ``device``, through a copy where it lives elsewhere."""
    for value in consumer.all_input_nodes:
        if value in keep or value not in device_of or device_of[value] == device or not is_tensor(value):
            continue
        consumer.replace_input_with(value, copy_of(graph, value, device, device_of, consumer))


def copy_of(graph: Graph, value: Node, device: Device, device_of: dict[Node, Device], consumer: Node) -> Node:
    """A node holding ``value`` on ``device``, placed before ``consumer``: an existing copy if one
    was made for an earlier consumer, else a new one (through the host between two devices)."""
    for user in value.users:
        if user.target in (h2d_copy, d2h_copy) and device_of.get(user) == device:
            return user
    if device_of[value] != HOST and device != HOST:
        value = copy_of(graph, value, HOST, device_of, consumer)
    with graph.inserting_before(consumer):
        if device == HOST:
            copy = graph.call_function(d2h_copy, (value,))
        else:
            copy = graph.call_function(h2d_copy, (value, str(device)))
    copy.meta["val"] = value.meta.get("val")
    device_of[copy] = device
    return copy


def remove_round_trips(graph: Graph, device_of: dict[Node, Device]) -> None:
    """``h2d(d2h(x), D)`` where ``x`` is already on ``D`` becomes ``x``; an unused d2h goes too."""
    for node in list(graph.nodes):
        if node.target is not h2d_copy or node.args[0].target is not d2h_copy:
            continue
        source = node.args[0].args[0]
        if device_of[source] == device_of[node]:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.target is d2h_copy and not node.users:
            graph.erase_node(node)


def is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
