"""A method's conditions on its sizes beyond their ranges, as a package stores them and a reader checks them.

torch.export proves a program for the sizes where its guards hold: a reshape into rows of four holds where
``3*s0 == 12*(s0 // 4)``, a strided convolution's output where ``(s0 - 1) // 2 + 1 != 1``. Compiled code does not
check them; a size that breaks one is computed wrongly, silently (AOTInductor reshapes 6 rows into one row of four
and returns it). So the manifest lists each as text in a closed grammar, and the runtime checks them before any
compiled code runs.

The grammar is Python's syntax for: integer literals, the size symbols of the method's inputs, ``+ - * // %``,
``**`` by a small literal power, comparisons, ``and``/``or``/``not`` and ``max``/``min`` of two or more terms. A
reader parses the text with ``ast`` and builds a closure from those nodes alone; nothing is evaluated as code, and
any other node is refused by name.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PackageError

MAX_GUARDS = 4096
MAX_GUARD_TEXT = 4000
MAX_POWER = 8

Sizes = Mapping[str, int]
Term = Callable[[Sizes], Any]

ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}

COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}

EXTREMES: dict[str, Callable[..., Any]] = {"max": max, "min": min}


@dataclass(frozen=True)
class SizeGuard:
    """One condition: its text as stored, the symbols it reads, and the check built from it."""

    text: str
    symbols: tuple[str, ...]
    check: Callable[[Sizes], bool]

    def holds(self, sizes: Sizes) -> bool:
        """Whether ``sizes`` (symbol -> size) meet the condition; a division by zero in it breaks it."""
        try:
            return bool(self.check(sizes))
        except ZeroDivisionError:
            return False


def size_guard(text: Any, symbols: set[str] | frozenset[str]) -> SizeGuard:
    """The guard ``text`` states over ``symbols`` (the method's size symbols); ``PackageError`` for anything else.

    Example: ``size_guard("s0 % 4 == 0", {"s0"}).holds({"s0": 6})`` is False.
    """
    if not isinstance(text, str) or not text or len(text) > MAX_GUARD_TEXT:
        raise PackageError(f"a size guard must be text of 1 to {MAX_GUARD_TEXT} characters, got {str(text)[:80]!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise PackageError(f"size guard {text[:80]!r} is not an expression") from None
    read: set[str] = set()
    try:
        check = term(tree.body, symbols, read)
    except RecursionError:
        raise PackageError(f"size guard {text[:80]!r} nests too deeply") from None
    return SizeGuard(text, tuple(sorted(read)), check)


def is_small_power(node: ast.expr) -> bool:
    """Whether ``node`` is a literal int a guard may raise to: no power of a size grows past a few words."""
    return isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= MAX_POWER


def term(node: ast.expr, symbols: set[str] | frozenset[str], read: set[str]) -> Term:
    """The closure computing ``node``, from the grammar's nodes alone."""
    where = f"size guard term {ast.unparse(node)[:80]!r}"
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is not int:
            raise PackageError(f"{where}: a size guard's constants are ints")
        return lambda sizes: value
    if isinstance(node, ast.Name):
        name = node.id
        if name not in symbols:
            raise PackageError(f"{where}: {name!r} is none of the method's size symbols {sorted(symbols)}")
        read.add(name)
        return lambda sizes: sizes[name]
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        if isinstance(node.op, ast.Pow) and not is_small_power(node.right):
            raise PackageError(f"{where}: a power must be a literal int in [0, {MAX_POWER}]")
        apply = ARITHMETIC[type(node.op)]
        left, right = term(node.left, symbols, read), term(node.right, symbols, read)
        return lambda sizes: apply(left(sizes), right(sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        operand = term(node.operand, symbols, read)
        if isinstance(node.op, ast.Not):
            return lambda sizes: not operand(sizes)
        return lambda sizes: -operand(sizes)
    if isinstance(node, ast.BoolOp):
        operands = [term(value, symbols, read) for value in node.values]
        if isinstance(node.op, ast.And):
            return lambda sizes: all(operand(sizes) for operand in operands)
        return lambda sizes: any(operand(sizes) for operand in operands)
    if isinstance(node, ast.Compare) and all(type(op) in COMPARISONS for op in node.ops):
        terms = [term(value, symbols, read) for value in (node.left, *node.comparators)]
        compares = [COMPARISONS[type(op)] for op in node.ops]

        def chained(sizes: Sizes) -> bool:
            values = [operand(sizes) for operand in terms]
            return all(compare(a, b) for compare, a, b in zip(compares, values, values[1:]))

        return chained
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in EXTREMES
            and not node.keywords and len(node.args) >= 2):
        pick = EXTREMES[node.func.id]
        operands = [term(value, symbols, read) for value in node.args]
        return lambda sizes: pick(operand(sizes) for operand in operands)
    raise PackageError(f"{where}: a size guard holds ints, size symbols, + - * // % **, comparisons, "
                       f"and/or/not and max/min; found {type(node).__name__}")
