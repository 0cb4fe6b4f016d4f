"""Custom ops a package calls: ops from ``torch.library`` outside ATen, registered by the user's code.

A lowered method may call one in two places: inside a compiled library (AOTInductor's proxy
executor calls it by name), or as a step of its run plan where no engine claimed it. Either
way the op's code is not in the file: the loading process must have registered it, by
importing the module that defines it. The manifest lists every such op with its schema and,
where the compiling process knew it, that module, so a load can refuse a file before any
library opens and say what to import. Nothing here imports anything: importing is the user's act.

A plan step calling a custom op runs only where the loader allows it by name
(``aotstack.load(path, allow_ops=["mylib.op"])``); ops inside a library need no such opt-in, as
the library's code is what the file's seal or signature vouches for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CustomOpError, PackageError

# Namespaces that are not custom: ATen, prims, control flow, export's operator and size (``torch.sym_*``)
# functions, ours.
BUILT_IN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "operator", "torch", "aotstack"})
# ``ns.op.overload`` as a step names it: identifiers only, so a name cannot reach past ``torch.ops``.
OP_NAME_PATTERN = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*", re.ASCII)
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
# Where a plan step of the file runs a custom op, rather than a library.
PLAN = "plan"
MAX_SCHEMA = 4096


def is_custom_op_name(name: str) -> bool:
    """Whether ``name`` (``ns.op.overload``) names an op outside ATen, prims and aotstack's own."""
    return name.partition(".")[0] not in BUILT_IN_NAMESPACES


def qualified_name(name: str) -> str:
    """``ns::op`` for ``ns.op.overload``, as torch.library writes it; the overload too where not ``default``."""
    namespace, op, overload = name.split(".")
    return f"{namespace}::{op}" + ("" if overload == "default" else f".{overload}")


@dataclass(frozen=True)
class CustomOpRecord:
    """One custom op a package calls.

    ``name`` is ``ns.op.overload``; ``schema`` its schema where the file was compiled, which the
    loading process's registration must match; ``module`` the Python module that registered it,
    None where unknown (a C++ library); ``used_by`` where it runs: delegate ids, and ``"plan"``
    where a plan step calls it; ``devices`` the device types it runs on.
    """

    name: str
    schema: str
    module: str | None = None
    used_by: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)

    @property
    def in_plan(self) -> bool:
        return PLAN in self.used_by


def custom_op_to_json(record: CustomOpRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "schema": record.schema,
        "module": record.module,
        "used_by": list(record.used_by),
        "devices": list(record.devices),
    }


def custom_op_from_json(data: Any) -> CustomOpRecord:
    if not isinstance(data, dict):
        raise PackageError(f"a custom op must be a JSON object, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not OP_NAME_PATTERN.fullmatch(name) or not is_custom_op_name(name):
        raise PackageError(f"custom op name {str(name)[:80]!r} is not a name like 'mylib.op.default' outside ATen")
    schema, module = data.get("schema"), data.get("module")
    if not isinstance(schema, str) or len(schema) > MAX_SCHEMA:
        raise PackageError(f"custom op {name!r}: its schema must be a string of at most {MAX_SCHEMA} characters")
    if module is not None and (not isinstance(module, str) or len(module) > 256 or not _MODULE_NAME.fullmatch(module)):
        raise PackageError(f"custom op {name!r}: module {str(module)[:80]!r} is not a dotted module name")
    used_by, devices = strings(data, "used_by", name), strings(data, "devices", name)
    return CustomOpRecord(name=name, schema=schema, module=module, used_by=used_by, devices=devices)


def strings(data: dict[str, Any], key: str, name: str) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list) or len(value) > 4096 or not all(isinstance(item, str) for item in value):
        raise PackageError(f"custom op {name!r}: {key!r} must be a list of strings")
    return value


# The loading process --------------------------------------------------------------------------


def registered_op(name: str) -> torch._ops.OpOverload | None:
    """The op ``name`` (``ns.op.overload``) as this process registered it; None where it has not.

    Only the dispatcher is asked (``torch.ops`` looks an op up; it imports nothing).
    """
    if not OP_NAME_PATTERN.fullmatch(name):
        return None
    namespace, op, overload = name.split(".")
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


# Dispatch keys under which a kernel runs for a device type (a composite kernel runs for every one).
_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")
_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}


def has_kernel(op: torch._ops.OpOverload, device_type: str) -> bool:
    """Whether ``op`` has a kernel, Python or C++, that runs on ``device_type`` (``cpu``, ``cuda``, ``mps``)."""
    keys = (*_COMPOSITE_KEYS, *([_DEVICE_KEYS[device_type]] if device_type in _DEVICE_KEYS else []))
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) for key in keys)


def allowed_op_names(ops: Iterable[str | torch._ops.OpOverload | torch._ops.OpOverloadPacket]) -> frozenset[str]:
    """``allow_ops`` as names: ``"mylib.op"`` (every overload), ``"mylib.op.default"``, ``"mylib::op"`` or the op.

    >>> sorted(allowed_op_names(["mylib::op", "other.op.out"]))
    ['mylib.op', 'other.op.out']
    """
    if isinstance(ops, str):
        raise TypeError(f"allow_ops takes a list of op names, got the string {ops!r}; write [{ops!r}]")
    names = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            names.add(f"{op.namespace}.{op._opname}.{op._overloadname}")
        elif isinstance(op, torch._ops.OpOverloadPacket):
            names.add(op._qualified_op_name.replace("::", "."))
        elif isinstance(op, str) and re.fullmatch(r"[A-Za-z_]\w*(::|\.)[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", op, re.ASCII):
            names.add(op.replace("::", "."))
        else:
            raise ValueError(f"allow_ops takes op names like 'mylib.op' or 'mylib::op', got {op!r}")
    return frozenset(names)


def is_allowed(name: str, allowed: frozenset[str]) -> bool:
    """Whether op ``name`` (``ns.op.overload``) is in ``allowed``, by overload or by every overload of its op."""
    return name in allowed or name.rsplit(".", 1)[0] in allowed


def check_custom_ops(records: Iterable[CustomOpRecord], allowed: frozenset[str]) -> None:
    """Refuse, before any library opens, a file whose custom ops this process cannot run.

    An op must be registered here with the schema it was compiled against, with a kernel for
    each device it runs on; one a plan step calls must be in ``allowed``. Every problem is named
    in one ``CustomOpError``.
    """
    missing, mismatched, not_allowed = [], [], []
    for record in records:
        op = registered_op(record.name)
        if op is None or not all(has_kernel(op, device) for device in record.devices):
            missing.append(record)
        elif str(op._schema) != record.schema:
            mismatched.append((record, str(op._schema)))
        if record.in_plan and not is_allowed(record.name, allowed):
            not_allowed.append(record)
    problems = missing_texts(missing)
    problems += [
        f"{qualified_name(record.name)} is registered as '{found}', but the file was compiled against "
        f"'{record.schema}'" for record, found in mismatched
    ]
    if not_allowed:
        names = [record.name.rsplit(".", 1)[0] for record in not_allowed]
        problems.append(
            f"the run plan calls {', '.join(map(qualified_name, (r.name for r in not_allowed)))} outside any "
            f"engine, which a load allows only by name: aotstack.load(path, allow_ops={names!r})"
        )
    if problems:
        raise CustomOpError("; ".join(problems), [r.name for r in missing], [r.name for r in not_allowed])


def missing_texts(records: list[CustomOpRecord]) -> list[str]:
    """One sentence per module to import: ``import mylib before loading: this file needs mylib::op, …``."""
    by_module: dict[str | None, list[CustomOpRecord]] = {}
    for record in records:
        by_module.setdefault(record.module, []).append(record)
    texts = []
    for module, group in by_module.items():
        ops = ", ".join(qualified_name(record.name) for record in group)
        devices = sorted({device for record in group for device in record.devices})
        kernels = f" with a kernel for {', '.join(devices)}" if devices else ""
        needs = f"this file needs {ops}, which this process has not registered{kernels}"
        texts.append(f"import {module} before loading: {needs}" if module else f"{needs} (load what defines it first)")
    return texts
