"""``torch.ops.aotstack.call_delegate``: the node that stands for a compiled partition.

It is a custom op, so stock ``torch.export`` serialization keeps working on a lowered graph.
It never runs eagerly: the runtime dispatches each call to its backend's run side.
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
