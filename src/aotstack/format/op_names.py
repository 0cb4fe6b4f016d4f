"""Names for ATen ops, as users write them in ``exclude_ops=[...]`` and ``ops=[...]``."""

from __future__ import annotations

import torch

OpName = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator


def op_name(op: torch._ops.OperatorBase) -> str:
    """``aten.relu.default``; ``higher_order.cond`` for a control-flow op."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order.{op.__name__}"
    return f"{op.namespace}.{op._opname}.{op._overloadname}"


def packet_name(op: torch._ops.OperatorBase) -> str:
    """``aten.relu``; ``higher_order.cond`` for a control-flow op."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return op_name(op)
    return f"{op.namespace}.{op._opname}"


def matches_any(op: torch._ops.OperatorBase, names: frozenset[str]) -> bool:
    """Whether ``op`` is named in ``names``, by overload or by every overload of its packet."""
    return op_name(op) in names or packet_name(op) in names


def normalized_op_name(op: OpName, argument: str = "ops") -> str:
    """The name an op is matched by; an unknown name raises ``ValueError`` naming ``argument``.

    ``"relu"``, ``"aten.relu"`` (every overload), ``"aten.relu.default"``, ``"higher_order.cond"``
    or the op object.
    """
    if isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return op_name(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}"
    if not isinstance(op, str):
        raise TypeError(f"{argument} takes op names or op objects, got {op!r}")
    name = op.removeprefix("torch.ops.")
    if "." not in name:
        name = f"aten.{name}"
    parts = name.split(".")
    if len(parts) not in (2, 3) or not resolves_to_op(parts):
        raise ValueError(
            f"unknown op {op!r} in {argument}; expected a name like 'aten.relu' or 'aten.relu.default'"
        )
    return name


def resolves_to_op(parts: list[str]) -> bool:
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 3:
            getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        return False
    return True
