"""What a loaded method accepts: keywords, scalars and dynamic sizes, checked before compiled code runs.

These packages hold no compiled code (no partitioner claims anything), so they build in
milliseconds; the checks are the same for any package.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import aotstack
from tests import models


class KeywordModel(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, steps: int = 2) -> torch.Tensor:
        return x * scale * steps


class TwoInputs(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def saved(tmp_path, program: aotstack.Program) -> aotstack.LoadedProgram:
    path = tmp_path / "plain.pt2"
    aotstack.lower(program, []).save(path)
    return aotstack.load(path)


@pytest.fixture
def keyword_program(tmp_path) -> aotstack.LoadedProgram:
    exported = torch.export.export(KeywordModel(), (torch.ones(2, 3),), {"scale": torch.ones(3), "steps": 3})
    return saved(tmp_path, aotstack.Program({"forward": exported}))


def test_keyword_arguments_in_any_order_or_by_position(keyword_program):
    x, scale = torch.randn(2, 3), torch.randn(3)
    expected = x * scale * 3
    torch.testing.assert_close(keyword_program.forward(x, scale=scale, steps=3), expected)
    torch.testing.assert_close(keyword_program.forward(x, steps=3, scale=scale), expected)
    torch.testing.assert_close(keyword_program.forward(x, scale, 3), expected)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda f, x, s: f(x, scale=s, steps=3, extra=1), "unknown keyword(s) ['extra']"),
        (lambda f, x, s: f(x, scale=s), "missing keyword(s) ['steps']"),
        (lambda f, x, s: f(x, s, scale=s, steps=3), "got argument 'scale' twice"),
        (lambda f, x, s: f(x, scale=s, steps=4), "argument 'steps' is 4, but the method was exported for 3"),
        (lambda f, x, s: f(x, scale=s, steps=True), "argument 'steps' must be int, got bool"),
        (lambda f, x, s: f(x, scale=s.double(), steps=3), "argument 'scale' has dtype torch.float64"),
        (lambda f, x, s: f(scale=s, steps=3), "missing positional argument(s) 'x'"),
        (lambda f, x, s: f(x, scale=(s,), steps=3), "argument 'scale' must be a tensor, got tuple"),
    ],
)
def test_bad_calls_raise_input_error_naming_the_argument(keyword_program, call, message):
    with pytest.raises(aotstack.InputError) as raised:
        call(keyword_program.forward, torch.randn(2, 3), torch.randn(3))
    assert message in str(raised.value)


@pytest.fixture
def dynamic_program(tmp_path) -> aotstack.LoadedProgram:
    batch = Dim("batch", min=2, max=8)
    program = aotstack.export(
        TwoInputs(), {"forward": (torch.randn(4, 3), torch.randn(4, 3))},
        dynamic_shapes={"forward": {"x": {0: batch}, "y": {0: batch}}},
    )
    return saved(tmp_path, program)


def test_a_size_inside_its_range_runs(dynamic_program):
    for batch in (2, 5, 8):
        x, y = torch.randn(batch, 3), torch.randn(batch, 3)
        torch.testing.assert_close(dynamic_program.forward(x, y), x + y)


@pytest.mark.parametrize("batch", [1, 9])
def test_a_size_outside_its_range_names_argument_dimension_and_range(dynamic_program, batch):
    with pytest.raises(aotstack.InputError) as raised:
        dynamic_program.forward(torch.randn(batch, 3), torch.randn(batch, 3))
    assert f"argument 'x' dimension 0 is {batch}, outside the range [2, 8]" in str(raised.value)


def test_one_symbol_means_one_size_across_arguments(dynamic_program):
    with pytest.raises(aotstack.InputError, match="argument 'y' dimension 0 is 3.*size 4; they must be equal"):
        dynamic_program.forward(torch.randn(4, 3), torch.randn(3, 3))


def test_a_static_dimension_is_checked_too(dynamic_program):
    with pytest.raises(aotstack.InputError, match=r"argument 'x' has shape \[4, 5\], expected \[s\d+ in \[2, 8\], 3\]"):
        dynamic_program.forward(torch.randn(4, 5), torch.randn(4, 3))


class PairsAcross(torch.nn.Module):
    """Pairs up the rows of two inputs together: a guard over both counts."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, y]).reshape(-1, 2, x.shape[1]).sum(1)


def rows_of_four(tmp_path) -> aotstack.LoadedProgram:
    program = aotstack.export(models.RowsOfFour(), {"forward": (torch.randn(8, 3),)},
                              dynamic_shapes={"forward": ({0: Dim.DYNAMIC},)})
    return saved(tmp_path, program)


def test_sizes_inside_the_guards_of_the_export_run(tmp_path):
    loaded = rows_of_four(tmp_path)
    for rows in (8, 12, 20):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(loaded.forward(x), models.RowsOfFour()(x))


@pytest.mark.parametrize("rows", [6, 5, 2])
def test_a_size_its_range_allows_but_a_guard_of_the_export_does_not_is_refused_naming_the_condition(tmp_path, rows):
    loaded = rows_of_four(tmp_path)
    with pytest.raises(aotstack.InputError) as raised:
        loaded.forward(torch.randn(rows, 3))
    message = str(raised.value)
    assert message.startswith(f"forward(): argument 'x' dimension 0 is {rows} (s")
    assert "but the method was exported for sizes where " in message and "// 4" in message


def test_a_guard_over_two_arguments_names_both(tmp_path):
    program = aotstack.export(PairsAcross(), {"forward": (torch.randn(4, 3), torch.randn(6, 3))},
                              dynamic_shapes={"forward": ({0: Dim.DYNAMIC}, {0: Dim.DYNAMIC})})
    loaded = saved(tmp_path, program)
    x, y = torch.randn(3, 3), torch.randn(5, 3)
    torch.testing.assert_close(loaded.forward(x, y), PairsAcross()(x, y))
    with pytest.raises(aotstack.InputError, match=r"argument 'x' dimension 0 is 3 \(s\d+\), argument 'y' dimension 0 "
                                                  r"is 4 \(s\d+\), but the method was exported for sizes where .*%"):
        loaded.forward(torch.randn(3, 3), torch.randn(4, 3))


class PaddedPastFive(torch.nn.Module):
    """Pads its rows out by however many they are past five, in a branch as VITS writes it: torch.export guards the
    branch it traced, ``max(0, n - 5) > 0``, though padding by 0 is no padding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = max(x.shape[0] - 5, 0)
        if pad > 0:
            x = torch.nn.functional.pad(x, [0, 0, pad, 0])
        return x.cumsum(0)


class PaddedToTheLonger(torch.nn.Module):
    """Pads ``y`` to ``x``'s rows where ``x`` has more: a guarded branch over two sizes, ``max(0, n - m) > 0``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pad = max(x.shape[0] - y.shape[0], 0)
        if pad > 0:
            y = torch.nn.functional.pad(y, [0, 0, 0, pad])
        return y.cumsum(0)


class ScaledPastFour(torch.nn.Module):
    """Doubles its rows where they are past four, triples fewer: the branch torch.export guards matters (and it is
    written over a ``max``, which torch cannot make a range of)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if max(x.shape[0] - 4, 0) > 0 else x * 3


class TripledBelowThree(torch.nn.Module):
    """Doubles its rows past five, as the branch traced at eight does, and below five doubles three or more and
    triples fewer: the program agrees with eager at five rows, the nearest past its guard, and not at two."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if max(x.shape[0] - 5, 0) > 0:
            return x * 2
        return x * 2 if x.shape[0] >= 3 else x * 3


def traced_at_eight(tmp_path, model: torch.nn.Module) -> aotstack.LoadedProgram:
    program = aotstack.export(model, {"forward": (torch.randn(8, 3),)}, dynamic_shapes={"forward": ({0: Dim.DYNAMIC},)})
    return saved(tmp_path, program)


def test_a_guarded_branch_whose_other_side_eager_shows_to_agree_does_not_refuse_its_sizes(tmp_path):
    loaded = traced_at_eight(tmp_path, PaddedPastFive())
    assert loaded.method("forward").check.guards == []
    for rows in (8, 5, 3, 2):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(loaded.forward(x), PaddedPastFive()(x))


def test_a_guarded_branch_that_agrees_past_its_guard_near_the_traced_size_but_not_at_small_ones_is_kept(tmp_path):
    loaded = traced_at_eight(tmp_path, TripledBelowThree())
    [guard] = loaded.method("forward").check.guards
    assert "Max(0, s" in guard.text
    torch.testing.assert_close(loaded.forward(torch.ones(6, 3)), torch.full((6, 3), 2.0))
    with pytest.raises(aotstack.InputError, match=r"dimension 0 is 2 \(s\d+\), but the method was exported"):
        loaded.forward(torch.ones(2, 3))


def test_a_guarded_branch_over_two_sizes_is_tried_past_one_of_them(tmp_path):
    program = aotstack.export(PaddedToTheLonger(), {"forward": (torch.randn(8, 3), torch.randn(5, 3))},
                              dynamic_shapes={"forward": ({0: Dim.DYNAMIC}, {0: Dim.DYNAMIC})})
    loaded = saved(tmp_path, program)
    assert loaded.method("forward").check.guards == []
    for rows, other in ((8, 5), (4, 4), (3, 6)):
        x, y = torch.randn(rows, 3), torch.randn(other, 3)
        torch.testing.assert_close(loaded.forward(x, y), PaddedToTheLonger()(x, y))


def test_a_guarded_branch_whose_other_side_differs_refuses_its_sizes_rather_than_computing_them_wrongly(tmp_path):
    loaded = traced_at_eight(tmp_path, ScaledPastFour())
    x = torch.randn(6, 3)
    torch.testing.assert_close(loaded.forward(x), x * 2)
    with pytest.raises(aotstack.InputError, match=r"dimension 0 is 3 \(s\d+\), but the method was exported for sizes "
                                                  r"where Max\(0, s\d+ - 4\) > 0 only"):
        loaded.forward(torch.randn(3, 3))
