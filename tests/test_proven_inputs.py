"""Inputs the plan vouches for: checked at the first call, left out of each delegate's check after it."""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack.format.archive import read_manifest
from aotstack.format.boundary import Boundary, BoundaryInput, ProvenInput
from aotstack.runtime.load import loaded_program
from aotstack.runtime.proven import Vouched, vouched_inputs
from tests import models
from tests.test_stacked_end_to_end import ORT_THEN_AOTI

STATIC = BoundaryInput("float32", "cpu", [2, 3])
DYNAMIC = BoundaryInput("float32", "cpu", ["s0", 3])
COUNTER = BoundaryInput("int64", "cpu", [1])


def boundary_check():
    return Boundary([STATIC, DYNAMIC, COUNTER], {"s0": (1, 8)}).checker("part")


def test_a_check_leaves_out_only_static_inputs_proven_exactly():
    proven = {0: STATIC, 1: BoundaryInput("float32", "cpu", [4, 3]), 2: BoundaryInput("int32", "cpu", [1])}
    check = boundary_check().trusting({index: ProvenInput(spec) for index, spec in proven.items()})
    wrong_first = [torch.zeros(5, 5), torch.zeros(4, 3), torch.zeros(1, dtype=torch.int64)]
    check(wrong_first)  # input 0 is proven: no longer read
    with pytest.raises(aotstack.InputError, match="input 1 dimension 0 is 9"):
        check([torch.zeros(2, 3), torch.zeros(9, 3), torch.zeros(1, dtype=torch.int64)])
    with pytest.raises(aotstack.InputError, match="input 2 has dtype torch.int32"):
        check([torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(1, dtype=torch.int32)])
    with pytest.raises(aotstack.InputError, match="input 0 has shape"):
        boundary_check()(wrong_first)  # the check it came from still reads every input


def test_a_check_with_every_input_proven_is_none():
    check = Boundary([STATIC, COUNTER], {}).checker("part")
    assert check.trusting({0: ProvenInput(STATIC), 1: ProvenInput(COUNTER)}) is None
    assert check.trusting({0: ProvenInput(STATIC)}) is not None


@pytest.fixture(scope="module")
def stacked(lowered_with):
    return lowered_with("stacked", *ORT_THEN_AOTI)


def test_the_plan_vouches_for_arguments_and_host_outputs_but_not_plain_ops(stacked):
    _, path = stacked
    record = read_manifest(path).methods["forward"]
    feeds = {step.delegate: step.inputs for step in record.plan.steps if hasattr(step, "delegate")}
    # forward.0 takes the argument x; forward.1 the plain layer_norm's result; forward.2 forward.1's output and x.
    assert feeds == {"forward.0": ["x"], "forward.1": ["layer_norm"], "forward.2": ["getitem_1", "x"]}
    x = BoundaryInput("float32", "cpu", list(models.example_inputs("stacked")[0].shape))
    argument = ("x", Vouched(x, fixed_layout=False))
    output = ("getitem_1", Vouched(BoundaryInput("float32", "cpu", [4, 8]), fixed_layout=True))
    assert vouched_inputs(record, {}) == {"forward.0": {0: argument}, "forward.2": {0: output, 1: argument}}


def test_after_the_first_call_only_what_the_plan_cannot_prove_is_checked_or_laid_out(stacked):
    _, path = stacked
    handles = {}

    def keep(delegate_id, loaded):
        handles[delegate_id] = loaded
        return loaded

    program = loaded_program(path, wrap_delegate=keep)
    assert all(loaded.handle.check is not None for loaded in handles.values())
    assert handles["forward.2"].handle.unsettled == [0, 1]
    x = models.example_inputs("stacked")[0]
    first = program.forward(x)
    assert handles["forward.0"].handle.check is None and handles["forward.2"].handle.check is None
    # forward.1's output reaches forward.2 laid out as its code reads it at every call; the argument x is the caller's.
    assert handles["forward.0"].handle.unsettled == [0] and handles["forward.2"].handle.unsettled == [1]
    unproven = handles["forward.1"]
    with pytest.raises(aotstack.InputError, match="forward.1|input 0"):
        unproven.runtime.execute(unproven.handle, [torch.zeros(3, 3)])
    torch.testing.assert_close(program.forward(x), first)
    torch.testing.assert_close(first, models.build("stacked")(x))
    # An argument laid out otherwise, or asking for gradients, is still made plain memory for each engine.
    strided = x.t().contiguous().t().requires_grad_()
    torch.testing.assert_close(program.forward(strided), first)
