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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..format.boundary import BoundaryInput
from ..format.devices import HOST
from ..format.manifest import DelegateRecord, InputRecord, MethodRecord
from ..format.plan import DelegateStep, InputStep, WeightStep
from ..format.state import delegate_device
from ..format.tensor_data import dtype_name


def proven_inputs(record: MethodRecord, weights: Mapping[str, torch.Tensor]) -> dict[str, dict[int, BoundaryInput]]:
    """Per delegate id, each input index the plan vouches for and what it is at every call."""
    known = known_values(record, weights)
    proven: dict[str, dict[int, BoundaryInput]] = {}
    for step in record.plan.steps:
        if isinstance(step, DelegateStep):
            vouched = {index: known[name] for index, name in enumerate(step.inputs) if name in known}
            if vouched:
                proven[step.delegate] = vouched
    return proven


def known_values(record: MethodRecord, weights: Mapping[str, torch.Tensor]) -> dict[str, BoundaryInput]:
    """Each value of the plan (by name) whose dtype, device type and static sizes hold at every call."""
    delegates = {delegate.id: delegate for delegate in record.delegates}
    arguments = iter(record.inputs)
    known: dict[str, BoundaryInput] = {}
    for step in record.plan.steps:
        if isinstance(step, InputStep):
            argument = next(arguments, None)
            checked = argument is not None and checked_argument(argument)
            if checked:
                known[step.name] = checked
        elif isinstance(step, WeightStep):
            tensor = weights.get(step.fqn)
            if isinstance(tensor, torch.Tensor):
                known[step.name] = BoundaryInput(dtype_name(tensor.dtype), tensor.device.type, list(tensor.shape))
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


def host_outputs(step: DelegateStep, delegate: DelegateRecord) -> dict[str, BoundaryInput]:
    """The outputs ``step`` names that its delegate returns on the host with static shapes."""
    if delegate_device(delegate.target_device) != HOST:
        return {}
    outputs = {}
    for index, name in step.outputs:
        spec = delegate.outputs[index] if 0 <= index < len(delegate.outputs) else None
        if spec is not None and all(isinstance(size, int) for size in spec.shape):
            outputs[name] = BoundaryInput(spec.dtype, HOST.type.value, list(spec.shape))
    return outputs
