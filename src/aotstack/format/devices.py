"""Devices: aotstack's own names for where a tensor lives, parsed from ``type[:index]``."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DeviceType(enum.Enum):
    """Where a tensor lives; aotstack's own, so the pipeline need not ask torch about hardware."""

    CPU = "cpu"
    CUDA = "cuda"
    MPS = "mps"


@dataclass(frozen=True)
class Device:
    type: DeviceType
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.type is DeviceType.CPU else f"{self.type.value}:{self.index}"

    @classmethod
    def parse(cls, spec: str) -> Device:
        return cls(*parse_device_spec(spec))


HOST = Device(DeviceType.CPU)


def parse_device_spec(spec: str) -> tuple[DeviceType, int]:
    """``"cuda:1"`` -> ``(DeviceType.CUDA, 1)``; case-insensitive, index 0 when absent.

    Example::

        >>> parse_device_spec("Cuda")
        (<DeviceType.CUDA: 'cuda'>, 0)
    """
    kind, _, index = spec.strip().lower().partition(":")
    try:
        device_type = DeviceType(kind)
    except ValueError:
        valid = ", ".join(t.value for t in DeviceType)
        raise ValueError(f"unknown device type {kind!r} in {spec!r}; valid types: {valid}") from None
    if not index:
        return device_type, 0
    if not index.isdigit():
        raise ValueError(f"device index in {spec!r} must be a non-negative integer")
    return device_type, int(index)
