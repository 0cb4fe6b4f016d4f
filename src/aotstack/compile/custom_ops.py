"""The custom ops a package lists (``format/custom_ops.py``), as the compiling process registered them."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Mapping

import torch

from ..errors import LoweringError
from ..format.custom_ops import PLAN, CustomOpRecord, qualified_name, registered_op
from ..format.devices import Device
from ..format.manifest import MethodRecord
from ..format.plan import custom_op_names


def custom_op_records(methods: Mapping[str, MethodRecord]) -> list[CustomOpRecord]:
    """Every custom op the methods' plans and delegates call, with where each runs, sorted by name."""
    used_by: dict[str, set[str]] = defaultdict(set)
    devices: dict[str, set[str]] = defaultdict(set)
    for method in methods.values():
        for name in custom_op_names(method.plan.steps):
            used_by[name].add(PLAN)
        for delegate in method.delegates:
            for name in delegate.calls:
                used_by[name].add(delegate.id)
                devices[name].add(Device.parse(delegate.target_device).type.value)
    return [custom_op_record(name, used_by[name], devices[name]) for name in sorted(used_by)]


def custom_op_record(name: str, used_by: set[str], devices: set[str]) -> CustomOpRecord:
    op = registered_op(name)
    if op is None:
        raise LoweringError(
            f"the program calls custom op {qualified_name(name)}, which this process has not registered"
        )
    return CustomOpRecord(
        name=name,
        schema=str(op._schema),
        module=defining_module(op),
        used_by=sorted(used_by, key=lambda use: (use != PLAN, use)),
        devices=sorted(devices),
    )


def defining_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers ``op``, for the loader's message; None where Python did not define it.

    ``torch.library.custom_op`` keeps the function it wraps; an op defined with
    ``torch.library.Library`` is found by the file of its Python fake kernel.
    """
    from torch._library.custom_ops import OPDEFS
    from torch._library.simple_registry import singleton

    qualname = op._schema.name
    if qualname in OPDEFS:
        module = OPDEFS[qualname]._init_fn.__module__
    else:
        source = getattr(singleton.find(qualname).fake_impl.kernel, "source", "") or ""
        module = module_of_file(source.rsplit(":", 1)[0]) if source else None
    # A script's own ops: the loading script defines them again, there is no module to name.
    return None if module == "__main__" else module


def module_of_file(path: str) -> str | None:
    """The imported module loaded from ``path``, if any."""
    if not os.path.isfile(path):
        return None
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.isfile(file) and os.path.samefile(file, path):
            return name
    return None
