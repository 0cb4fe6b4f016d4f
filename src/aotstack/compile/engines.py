"""Engines named by text (``"auto"``, ``"ort,aoti"``): what ``aotstack compile --engines`` and integrations take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import LoweringError

if TYPE_CHECKING:
    from .auto import Auto
    from .partitioner import Partitioner

# Short names beside backend ids.
ENGINE_ALIASES = {"ort": "onnxruntime", "ov": "openvino"}


def partitioners_for(
    engines: str,
    device: str = "cpu",
    *,
    exclude_ops: Sequence[str] = (),
    ort_ops: Sequence[str] = (),
    min_block_size: int | None = None,
    option: str = "engines",
) -> list[Partitioner] | Auto:
    """The plan ``engines`` names: ``"auto"`` (measure every installed engine), or engines in claiming order.

    Names are ``aoti`` (AOTInductor for ``device``), ``ort``, ``ov`` or backend ids, comma separated:
    ``partitioners_for("ort,aoti")``. ``exclude_ops`` goes to AOTInductor, ``ort_ops`` narrows ONNX
    Runtime to those ops; ``min_block_size`` to every engine (None: each engine's default). ``option`` is how
    errors name the setting.
    """
    from .auto import Auto

    if not isinstance(engines, str) or not engines.strip():
        raise LoweringError(f"{option} must be 'auto' or engine names like 'ort,aoti', got {engines!r}")
    if engines.strip() == "auto":
        return Auto(device=device)
    names = [ENGINE_ALIASES.get(name.strip(), name.strip()) for name in engines.split(",") if name.strip()]
    return [engine_partitioner(name, device, exclude_ops, ort_ops, min_block_size, option) for name in names]


def named_plan(partitioners: Any) -> Any:
    """``partitioners`` as ``lower`` takes them, with engine names (``"ort,aoti"``, ``"auto"``) made into their plan."""
    return partitioners_for(partitioners, option="partitioners") if isinstance(partitioners, str) else partitioners


def engine_partitioner(
    name: str,
    device: str,
    exclude_ops: Sequence[str] = (),
    ort_ops: Sequence[str] = (),
    min_block_size: int | None = None,
    option: str = "engines",
) -> Partitioner:
    """The partitioner of engine ``name`` (``aoti`` is AOTInductor for ``device``), with the options it takes."""
    from ..engine.registry import BUILT_IN
    from ..format.devices import parse_device_spec
    from ..format.specs import CompileSpec, SpecKey

    device_type, _ = parse_device_spec(device)
    if name == "aoti":
        name = next(n for n, e in BUILT_IN.items() if e.takes_every_op and device_type.value in e.devices)
    engine = BUILT_IN.get(name)
    if engine is None:
        raise LoweringError(f"{option} names {name!r}; engines: auto, aoti, ort, ov, {', '.join(BUILT_IN)}")
    if not engine.installed():
        raise LoweringError(f"engine {name!r} is not installed here; pip install 'aotstack[{engine.extra}]'")
    cls = engine.partitioner_class()
    if engine.takes_every_op:
        return cls(
            exclude_ops=list(exclude_ops),
            compile_specs=[CompileSpec(SpecKey.TARGET_DEVICE, device.encode())],
            min_block_size=min_block_size,
        )
    smallest = 1 if min_block_size is None else min_block_size
    if name == "onnxruntime":
        return cls(ops=list(ort_ops) or None, min_block_size=smallest)
    return cls(min_block_size=smallest)
