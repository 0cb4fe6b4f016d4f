"""What a method's plan guarantees about each delegate input before any call: the inputs whose check it can skip.

A delegate checks every input at every call (``format/boundary.py``), whatever produced it. In a
decoder's step most inputs come from another compiled part, a weight, or an argument the
method's own check has read; each of those is known at load to have one dtype, device type and
static shape at every call. Checking them again costs about a microsecond an input: on a
quantized decode step whose linears run on XNNPACK and the rest on AOTInductor, 65 inputs and
over 2% of the step. The run side leaves out what the plan proves (``BackendRuntime.trust_inputs``).

What counts as proof, per value the plan holds:

- a method argument recorded as a tensor with every size an int and its device type: the
  method's ``InputCheck`` refuses anything else before the plan runs;
- a weight or buffer: the tensor itself, loaded once, the same object at every call;
- an output of a delegate that runs on the host, recorded with every size an int: compiled code
  with static shapes returns the same dtype and shape at every call.

Anything else (a plain op's result, an output of a part on a device, a dynamic size) proves
nothing, and the delegate checks it as before. Engines are told only after the method's first
call has passed every check (``load.after_first_call``): a part whose outputs do not match its
record is refused then, before any check is left out.

The first call also shows each weight's and host part's output's layout, which is the same at
every call (the same tensor; compiled code with static shapes): where it is a plain tensor, its
strides go with the proof, so an engine need not test at each call whether to copy it into the
layout it reads (``ProvenInput.strides``). An argument's layout is the caller's, and is not
vouched for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format.boundary import BoundaryInput, ProvenInput
from ..format.devices import HOST
from ..format.manifest import DelegateRecord, InputRecord, MethodRecord
from ..format.plan import DelegateStep, InputStep, WeightStep
from ..format.state import delegate_device
from ..format.tensor_data import dtype_name


@dataclass(frozen=True)
class Vouched:
    """A value of the plan known at load to have one dtype, device type and static shape at every call."""

    spec: BoundaryInput
    # A weight or a host part's output: one layout at every call too. False for an argument.
    fixed_layout: bool


# Per delegate id: each input index the plan vouches for, with the name of the value fed to it.
VouchedInputs = dict[str, dict[int, tuple[str, Vouched]]]


def vouched_inputs(record: MethodRecord, weights: Mapping[str, torch.Tensor]) -> VouchedInputs:
    """Per delegate id, each input index the plan vouches for, and the value feeding it."""
    known = known_values(record, weights)
    vouched: VouchedInputs = {}
    for step in record.plan.steps:
        if isinstance(step, DelegateStep):
            fed = {index: (name, known[name]) for index, name in enumerate(step.inputs) if name in known}
            if fed:
                vouched[step.delegate] = fed
    return vouched


def proven_inputs(vouched: VouchedInputs, value_of: Callable[[str], Any]) -> dict[str, dict[int, ProvenInput]]:
    """What each engine is told after the first call: ``vouched``, with the layout the first call showed where
    it is fixed; ``value_of`` reads a value of that call by name."""
    return {
        delegate: {
            index: ProvenInput(entry.spec, fixed_strides(entry, value_of(name))) for index, (name, entry) in fed.items()
        }
        for delegate, fed in vouched.items()
    }


def fixed_strides(entry: Vouched, value: Any) -> tuple[int, ...] | None:
    """``value``'s strides, where its layout is fixed and it is a plain tensor an engine reads as it is."""
    if not entry.fixed_layout or type(value) is not torch.Tensor:
        return None
    if value.requires_grad or value.is_neg() or value.is_conj():
        return None
    return tuple(value.stride())


def known_values(record: MethodRecord, weights: Mapping[str, torch.Tensor]) -> dict[str, Vouched]:
    """Each value of the plan (by name) whose dtype, device type and static sizes hold at every call."""
    delegates = {delegate.id: delegate for delegate in record.delegates}
    arguments = iter(record.inputs)
    known: dict[str, Vouched] = {}
    for step in record.plan.steps:
        if isinstance(step, InputStep):
            argument = next(arguments, None)
            checked = argument is not None and checked_argument(argument)
            if checked:
                known[step.name] = Vouched(checked, fixed_layout=False)
        elif isinstance(step, WeightStep):
            tensor = weights.get(step.fqn)
            if isinstance(tensor, torch.Tensor):
                spec = BoundaryInput(dtype_name(tensor.dtype), tensor.device.type, list(tensor.shape))
                known[step.name] = Vouched(spec, fixed_layout=True)
        elif isinstance(step, DelegateStep) and step.delegate in delegates:
            known.update(host_outputs(step, delegates[step.delegate]))
    return known


def checked_argument(argument: InputRecord) -> BoundaryInput | None:
    """What ``InputCheck`` lets through for this argument, where that is one static tensor."""
    shape = argument.shape or []
    if argument.kind != "tensor" or argument.dtype is None or argument.device is None:
        return None
    if not all(isinstance(size, int) for size in shape):
        return None
    return BoundaryInput(argument.dtype, argument.device, list(shape))


def host_outputs(step: DelegateStep, delegate: DelegateRecord) -> dict[str, Vouched]:
    """The outputs ``step`` names that its delegate returns on the host with static shapes."""
    if delegate_device(delegate.target_device) != HOST:
        return {}
    outputs = {}
    for index, name in step.outputs:
        spec = delegate.outputs[index] if 0 <= index < len(delegate.outputs) else None
        if spec is not None and all(isinstance(size, int) for size in spec.shape):
            outputs[name] = Vouched(BoundaryInput(spec.dtype, HOST.type.value, list(spec.shape)), fixed_layout=True)
    return outputs
