"""aotstack's own ops in a lowered graph.

``torch.ops.aotstack.call_delegate`` stands for a compiled partition. It never runs eagerly:
the runtime dispatches each call to its backend's run side. ``h2d_copy`` and ``d2h_copy`` move
a tensor between the host and a device where a delegate boundary needs it. They are custom ops,
so stock ``torch.export`` serialization keeps working on a lowered graph.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

_LIB = torch.library.Library("aotstack", "DEF")
_LIB.define("call_delegate(str delegate_id, Tensor[] inputs) -> Tensor[]")


def _refuse_eager_call(delegate_id: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(
        f"delegate {delegate_id!r} runs only inside a program loaded with aotstack.load"
    )


_LIB.impl("call_delegate", _refuse_eager_call, "CompositeExplicitAutograd")

call_delegate = torch.ops.aotstack.call_delegate.default

_LIB.define("h2d_copy(Tensor x, str device) -> Tensor")
_LIB.define("d2h_copy(Tensor x) -> Tensor")


def _host_to_device(x: torch.Tensor, device: str) -> torch.Tensor:
    return x.to(device)


def _device_to_host(x: torch.Tensor) -> torch.Tensor:
    return x.to("cpu")


_LIB.impl("h2d_copy", _host_to_device, "CompositeExplicitAutograd")
_LIB.impl("d2h_copy", _device_to_host, "CompositeExplicitAutograd")

h2d_copy = torch.ops.aotstack.h2d_copy.default
d2h_copy = torch.ops.aotstack.d2h_copy.default


def is_delegate_call(node: Node) -> bool:
    return node.op == "call_function" and node.target is call_delegate


def is_delegate_output(node: Node) -> bool:
    """A getitem taking one output of a delegate call."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], Node)
        and is_delegate_call(node.args[0])
    )
