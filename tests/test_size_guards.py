"""A method's guards on its sizes: written from torch's expressions, read back by a closed grammar, never evaluated
as code."""

from __future__ import annotations

import itertools

import pytest
import sympy
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod

from aotstack.compile.guards import said
from aotstack.errors import PackageError
from aotstack.format.boundary import compile_expression
from aotstack.format.guards import size_guard

s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)

EXPRESSIONS = [
    sympy.Eq(3 * s0, 12 * FloorDiv(s0, 4)),
    sympy.Ne(FloorDiv(s0 - 1, 2) + 1, 1),
    sympy.Eq(PythonMod(s0 + s1, 3), 0),
    sympy.Eq(Mod(s0, FloorDiv(s1, 2) + 1), 0),
    sympy.Ge(2 * s1 - 1 + Max(0, 5 - s0), s0),
    sympy.Lt(Min(s0, s1) * 2, s1 + 3),
    sympy.Le(s0**2 - 3 * s1, 20),
    sympy.Gt(-s0 + FloorDiv(s1 * 3, s0), -4),
    sympy.Ge(3 - 2 * s0 - 3 * FloorDiv(s1, 2), -s1**2),
    sympy.And(sympy.Ge(s0, 3), sympy.Or(sympy.Eq(s1, 4), sympy.Ne(PythonMod(s1, 2), 0))),
    sympy.Not(sympy.Eq(FloorDiv(s0, FloorDiv(s1, 3) + 1), 2)),
]


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=str)
def test_a_guard_as_written_holds_exactly_where_torch_s_expression_does(expr):
    guard = size_guard(said(expr), {"s0", "s1"})
    for a, b in itertools.product(range(1, 13), repeat=2):
        assert guard.holds({"s0": a, "s1": b}) == bool(expr.subs({s0: a, s1: b})), (said(expr), a, b)


def test_a_division_by_zero_breaks_the_guard_rather_than_raising():
    guard = size_guard("s0 % (s0 // 4) == 0", {"s0"})
    assert not guard.holds({"s0": 3}) and guard.holds({"s0": 8})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').getcwd() == 0", "found Call"),
        ("s0.real > 1", "found Attribute"),
        ("'a' == s0", "constants are ints"),
        ("s0 > 1.5", "constants are ints"),
        ("s0 ** 100 > 1", r"power must be a literal int in \[0, 8\]"),
        ("s0 ** s0 > 1", "power must be a literal int"),
        ("s9 > 1", r"'s9' is none of the method's size symbols \['s0'\]"),
        ("(lambda: 1)() == 1", "found Call"),
        ("[s0] == [1]", "found List"),
        ("max(s0) > 1", "found Call"),
        ("Max(s0) > 1", "Max takes 2 or more terms"),
        ("Mod(s0, 2, 3) == 1", "Mod takes 2 terms"),
        ("Max > 1", r"'Max' is none of the method's size symbols"),
        ("max(*[s0, s0]) > 1", "found Call"),
        ("s0 @ s0 > 1", "found BinOp"),
        ("s0 > 1; s0 < 1", "is not an expression"),
        ("s0 > " + "(" * 300 + "1" + ")" * 300, "not an expression|nests too deeply"),
        ("s0 > 1" + " " * 5000, "text of 1 to 4000 characters"),
        ("", "text of 1 to 4000 characters"),
    ],
)
def test_a_guard_outside_the_grammar_is_refused_by_name(text, message):
    with pytest.raises(PackageError, match=message):
        size_guard(text, {"s0"})


def test_a_guard_spelt_with_lowercase_max_as_the_first_files_wrote_it_still_reads():
    guard = size_guard("max(0, s0 - 4) > 0 and min(s0, 6) == 6", {"s0"})
    assert [n for n in range(1, 10) if guard.holds({"s0": n})] == [6, 7, 8, 9]


@pytest.mark.parametrize(
    ("text", "values"),
    [("Max(1, s0 - 4)", [1, 1, 1, 1, 1, 2, 3]), ("Mod(s0 + 1, 3)", [2, 0, 1, 2, 0, 1, 2]),
     ("-s0**2 // 3 + 7", [6, 5, 4, 1, -2, -5, -10]), ("+s0 - Min(s0, 2, 3)", [0, 0, 1, 2, 3, 4, 5])],
)
def test_a_boundary_size_and_a_guard_read_one_term_alike(text, values):
    """A delegate's boundary and a method's guards share one grammar of size terms: the same text, the same size."""
    expression = compile_expression(text)
    assert expression is not None and expression.names == {"s0"}
    assert [expression.evaluate({"s0": n}) for n in range(1, 8)] == values
    for n, value in zip(range(1, 8), values):
        assert size_guard(f"{text} == {value}", {"s0"}).holds({"s0": n})
        assert not size_guard(f"{text} == {value + 1}", {"s0"}).holds({"s0": n})


@pytest.mark.parametrize("text", ["Max(s0)", "s0 ** 9", "sqrt(s0)", "s0.real", "1.5*s0", "s0 > 1"])
def test_a_boundary_size_outside_the_grammar_is_left_unevaluated(text):
    assert compile_expression(text) is None
