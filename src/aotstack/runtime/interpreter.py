"""Running a run plan: its steps turned once into closures over one list of slots.

A method and a branch or loop body run the same way (``StepProgram.run``), so a call costs
little more than the compiled code it runs: delegate calls go to their backend's run side, the
few ops nobody claimed run as plain ATen ops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.interface import BackendRuntime
from ..errors import AotstackError, PackageError, RunError
from ..format.plan import (
    DelegateStep,
    InputStep,
    OpRef,
    OpStep,
    Ref,
    Step,
    SubgraphPlan,
    SubgraphStep,
    WeightStep,
    resolved_custom_op,
    resolved_op,
)

Slots = list[Any]
# One step: reads some slots, fills others.
Action = Callable[[Slots], None]
# Reads one value out of the slots.
Resolver = Callable[[Slots], Any]


@dataclass(frozen=True)
class LoadedDelegate:
    """A delegate's run side, initialised once; its steps call ``runtime.execute(handle, ...)``."""

    runtime: BackendRuntime
    handle: Any


class StepProgram:
    """A plan's steps as closures over one list of slots, ``template`` holding the weights and subgraphs.

    ``allowed_ops`` names the custom ops the loader lets a step call (``format/custom_ops.py``).
    """

    def __init__(
        self,
        steps: Sequence[Step],
        weights: Mapping[str, torch.Tensor],
        delegates: Mapping[str, LoadedDelegate],
        allowed_ops: frozenset[str] = frozenset(),
    ) -> None:
        self.allowed_ops = allowed_ops
        self.slots: dict[str, int] = {}
        self.template: Slots = []
        self.input_slots: list[int] = []
        self.actions: list[Action] = []
        # The step each action runs, one for one: named in the message when it fails.
        self.action_steps: list[Step] = []
        for step in steps:
            self.add(step, weights, delegates)

    def add(self, step: Step, weights: Mapping[str, torch.Tensor], delegates: Mapping[str, LoadedDelegate]) -> None:
        if isinstance(step, InputStep):
            self.input_slots.append(self.new_slot(step.name))
        elif isinstance(step, WeightStep):
            self.new_slot(step.name, weights.get(step.fqn))
        elif isinstance(step, SubgraphStep):
            self.new_slot(step.name, subgraph_function(step.plan, self.allowed_ops))
        elif isinstance(step, DelegateStep):
            inputs = [self.slot(name) for name in step.inputs]
            outputs = [(index, self.new_slot(name)) for index, name in step.outputs]
            if step.delegate not in delegates:
                raise PackageError(f"the plan calls delegate {step.delegate!r}, which the package lacks")
            action = delegate_action(delegates[step.delegate], inputs, outputs)
            self.add_action(step, action)
        else:
            args = [self.resolver(arg) for arg in step.args]
            kwargs = {key: self.resolver(value) for key, value in step.kwargs.items()}
            target = resolved_op(step.target, self.allowed_ops)
            action = op_action(target, args, kwargs, self.new_slot(step.name))
            self.add_action(step, action)

    def add_action(self, step: Step, action: Action) -> None:
        self.actions.append(action)
        self.action_steps.append(step)

    def new_slot(self, name: str, value: Any = None) -> int:
        self.slots[name] = len(self.template)
        self.template.append(value)
        return self.slots[name]

    def slot(self, name: str) -> int:
        try:
            return self.slots[name]
        except KeyError:
            raise PackageError(f"a plan step reads {name!r} before any step computes it") from None

    def resolver(self, value: Any) -> Resolver:
        """A function reading ``value`` out of the slots, built once so calls do no tree walks."""
        if isinstance(value, Ref):
            index = self.slot(value.name)
            return lambda slots: slots[index]
        if isinstance(value, OpRef):
            op = resolved_custom_op(value.name, self.allowed_ops)
            return lambda slots: op
        if isinstance(value, (list, tuple)) and has_ref(value):
            parts = [self.resolver(item) for item in value]
            kind = type(value)
            return lambda slots: kind([part(slots) for part in parts])
        return lambda slots: value

    def run(self, args: Sequence[Any]) -> Slots:
        """Every step run on ``args``; the slots afterwards."""
        slots = self.template.copy()
        for index, value in zip(self.input_slots, args):
            slots[index] = value
        try:
            for action in self.actions:
                action(slots)
        except AotstackError:
            raise
        except Exception as exc:
            # Zero-cost until raised; the error names the step rather than a line in this loop.
            text = str(exc).strip().splitlines()
            step = self.action_steps[self.actions.index(action)]
            raise RunError(f"{step_label(step)} failed: {type(exc).__name__}: {text[0] if text else ''}") from exc
        return slots


def write_back(mutations: Sequence[tuple[torch.Tensor, int]], slots: Sequence[Any]) -> None:
    """Copy each buffer's new value (its slot) into the buffer.

    One grouped copy rather than one per buffer: a decoder's step updates a small counter per layer, and on a GPU
    each separate copy is a dispatch and a launch (about 10 us on the host each, measured on an H100).
    """
    if mutations:
        torch._foreach_copy_([target for target, _ in mutations], [slots[slot] for _, slot in mutations])


def step_label(step: Step) -> str:
    """How a failing step is named: ``delegate forward.0``, ``step 'relu' (aten.relu.default)``."""
    if isinstance(step, DelegateStep):
        return f"delegate {step.delegate}"
    return f"step {step.name!r} ({step.target})" if isinstance(step, OpStep) else repr(step)


def subgraph_function(plan: SubgraphPlan, allowed_ops: frozenset[str] = frozenset()) -> Callable[..., Any]:
    """A branch or loop body, callable the way a control-flow op calls it."""
    body = StepProgram(plan.steps, {}, {}, allowed_ops)
    output = body.resolver(plan.output)
    return lambda *args: output(body.run(args))


def has_ref(value: Any) -> bool:
    if isinstance(value, Ref):
        return True
    return isinstance(value, (list, tuple)) and any(has_ref(item) for item in value)


def delegate_action(delegate: LoadedDelegate, inputs: list[int], outputs: list[tuple[int, int]]) -> Action:
    execute, handle = delegate.runtime.execute, delegate.handle

    def run_delegate(slots: Slots) -> None:
        results = execute(handle, [slots[i] for i in inputs])
        for index, out in outputs:
            slots[out] = results[index]

    return run_delegate


def op_action(target: Callable[..., Any], args: list[Resolver], kwargs: dict[str, Resolver], out: int) -> Action:
    def run_op(slots: Slots) -> None:
        slots[out] = target(*[arg(slots) for arg in args], **{key: value(slots) for key, value in kwargs.items()})

    return run_op
