"""Where each buffer a file's methods update (a KV cache) lives while it runs: the host, or one device.

A buffer has one state, shared by every method and delegate that reads or updates it. It lives
with what updates it: on the host where a method's plan updates it or reads it there, or where a
host delegate owns it; on a device where delegates on that device alone own it and update it in
place there, or where the plan holds it on that device for such delegates (``WeightStep.device``:
a cache's one-element length), so a decode step on a GPU never moves its state. Lowering checks a file before writing it
and loading checks it again, with this one rule.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import PackageError
from .devices import HOST, Device
from .manifest import MethodRecord
from .plan import WeightStep


def state_devices(methods: Mapping[str, MethodRecord]) -> dict[str, Device]:
    """Each buffer some method or delegate updates -> where its one state lives.

    Example: a ``decode`` whose CUDA delegate updates ``cache.k`` in place gives
    ``{"cache.k": Device(DeviceType.CUDA, 0)}``. A buffer updated on one device and read or
    updated elsewhere (a plan step on the host, a delegate on another device) raises
    ``PackageError`` naming both: its state cannot be in two places.
    """
    updated = {fqn for method in methods.values() for fqn, _ in method.plan.mutations}
    updated |= {fqn for method in methods.values() for delegate in method.delegates for fqn in delegate.updates}
    where: dict[str, dict[Device, str]] = {fqn: {} for fqn in sorted(updated)}
    for name, method in methods.items():
        # Where the plan holds a buffer it updates: the host, or the device its weight step names.
        held = {step.fqn: plan_device(step.device) for step in method.plan.steps if isinstance(step, WeightStep)}
        for fqn, _ in method.plan.mutations:
            where[fqn].setdefault(held.get(fqn, HOST), f"method {name!r}'s plan, which updates it")
        for step in method.plan.steps:
            if isinstance(step, WeightStep) and step.fqn in where:
                where[step.fqn].setdefault(held[step.fqn], f"method {name!r}'s plan, which reads it")
        for delegate in method.delegates:
            for fqn in delegate.updates:
                where[fqn].setdefault(delegate_device(delegate.target_device), f"delegate {delegate.id} of {name!r}")
    devices = {}
    for fqn, places in where.items():
        if len(places) > 1:
            (first, by), (second, other) = list(places.items())[:2]
            raise PackageError(
                f"buffer {fqn!r} is used on {first} by {by}, and on {second} by {other}; "
                "a buffer's state lives in one place: let one engine on one device hold every use of it"
            )
        devices[fqn] = next(iter(places))
    return devices


def plan_device(text: str | None) -> Device:
    return HOST if text is None else delegate_device(text)


def delegate_device(text: str) -> Device:
    try:
        return Device.parse(text)
    except ValueError as exc:
        raise PackageError(f"a delegate's target device: {exc}") from None
