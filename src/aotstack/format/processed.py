"""Reading a built-in backend's processed JSON: every field its run side uses, checked, with clear errors.

A run side reads what its compile side wrote, but the bytes come from a file: a field that is
missing, of the wrong type, or from an older aotstack is a ``PackageError`` naming the delegate
and the field, never a ``KeyError`` or ``TypeError`` from deep inside ``init``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PackageError
from .boundary import Boundary
from .tensor_data import (
    WEIGHT_PREFIX,
    NamedDataValue,
    byte_count,
    dtype_from_name,
    dtype_name,
    tensor_from_bytes,
)


def read_processed(processed_bytes: bytes, label: str, version: int | tuple[int, ...]) -> dict[str, Any]:
    """The processed JSON of ``label`` as a dict, refused unless it is ``version`` (what this run side reads).

    A run side that still reads older versions passes them all, as a tuple.
    """
    try:
        data = json.loads(processed_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PackageError(f"{label}: its processed data is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PackageError(f"{label}: its processed data must be a JSON object, got {type(data).__name__}")
    readable = (version,) if isinstance(version, int) else version
    found = data.get("version")
    if isinstance(found, bool) or found not in readable:
        raise PackageError(
            f"{label}: its processed data is version {found!r} (none means written before versions); this "
            f"aotstack reads version {' or '.join(map(str, readable))}: lower the model again"
        )
    return data


def field(data: Mapping[str, Any], key: str, kind: type, label: str) -> Any:
    """``data[key]``, which must be a ``kind``."""
    if key not in data:
        raise PackageError(f"{label}: its processed data has no {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PackageError(f"{label}: processed field {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def string_list(data: Mapping[str, Any], key: str, label: str) -> list[str]:
    value = field(data, key, list, label)
    if not all(isinstance(item, str) for item in value):
        raise PackageError(f"{label}: processed field {key!r} must list strings")
    return value


def boundary(data: Mapping[str, Any], label: str) -> Boundary:
    """The boundary the compile side recorded: what each input of the compiled code must be."""
    try:
        return Boundary.from_json(field(data, "boundary", dict, label))
    except PackageError as exc:
        raise PackageError(f"{label}: {exc}") from None


def weights(data: Mapping[str, Any], named_data: Mapping[str, NamedDataValue], label: str) -> dict[str, torch.Tensor]:
    """The weights ``processed["weights"]`` describes, each a tensor over its named data, sizes checked."""
    tensors = {}
    for fqn, entry in field(data, "weights", dict, label).items():
        where = f"{label}: weight {fqn!r}"
        if not isinstance(entry, dict):
            raise PackageError(f"{where}: its record must be an object, got {type(entry).__name__}")
        dtype_text, shape = entry.get("dtype"), entry.get("shape")
        try:
            dtype = dtype_from_name(dtype_text) if isinstance(dtype_text, str) else None
        except ValueError:
            dtype = None
        if dtype is None:
            raise PackageError(f"{where}: dtype {dtype_text!r} is not a torch dtype")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise PackageError(f"{where}: shape must list non-negative ints, got {shape!r}")
        blob = named_data.get(WEIGHT_PREFIX + fqn)
        if blob is None:
            raise PackageError(f"{where}: the package holds no named data {WEIGHT_PREFIX + fqn!r}")
        expected = math.prod(shape) * dtype.itemsize
        size = byte_count(blob)
        if size != expected:
            raise PackageError(f"{where}: {dtype_text}{shape} takes {expected} bytes, its data holds {size}")
        tensors[fqn] = tensor_from_bytes(blob, dtype, shape)
    return tensors


def state_record(
    buffers: Mapping[str, torch.Tensor], inputs: list[str], outputs: list[str], in_place: list[bool]
) -> dict[str, Any]:
    """The processed ``state`` field: each buffer a delegate owns, the engine's input and output for it, and whether
    the engine writes the output into the input's own memory (else its run side copies the output back)."""
    return {
        fqn: {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "input": name, "output": result,
              "in_place": flag}
        for (fqn, tensor), name, result, flag in zip(buffers.items(), inputs, outputs, in_place, strict=True)
    }


@dataclass(frozen=True)
class OwnedBuffer:
    """A buffer a delegate updates: its one shared, writable memory, and the engine's input and output for it."""

    fqn: str
    tensor: torch.Tensor
    input: str
    output: str
    # Whether the engine writes the new value into the old one's memory; else the run side copies it back.
    in_place: bool


def owned_state(data: Mapping[str, Any], named_data: Mapping[str, NamedDataValue], label: str) -> list[OwnedBuffer]:
    """The buffers ``processed["state"]`` lists (none where it has no such field), each over its shared memory.

    Loading hands a delegate the buffers it updates as writable named data ``weight:<fqn>``; a
    read-only one here means the package says one thing and the loader another.
    """
    records = data.get("state", {})
    if not isinstance(records, dict):
        raise PackageError(f"{label}: processed field 'state' must be an object, got {type(records).__name__}")
    tensors = weights({"weights": records}, named_data, label)
    owned = []
    for fqn, record in records.items():
        names = [record.get("input"), record.get("output")]
        if not all(isinstance(name, str) for name in names) or not isinstance(record.get("in_place"), bool):
            raise PackageError(f"{label}: state {fqn!r} must name its input and output and say whether it is in place")
        if is_read_only(named_data[WEIGHT_PREFIX + fqn]):
            raise PackageError(f"{label}: state {fqn!r} was handed over read-only; the loader must share it writable")
        owned.append(OwnedBuffer(fqn, tensors[fqn], names[0], names[1], record["in_place"]))
    return owned


def is_read_only(data: NamedDataValue) -> bool:
    # A state on a device is a tensor the loader made for it alone: always writable.
    return not isinstance(data, torch.Tensor) and memoryview(data).readonly
