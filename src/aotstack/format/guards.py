"""A method's conditions on its sizes beyond their ranges, as a package stores them and a reader checks them.

torch.export proves a program for the sizes where its guards hold: a reshape into rows of four holds where
``3*s0 == 12*(s0 // 4)``, a strided convolution's output where ``(s0 - 1) // 2 + 1 != 1``. Compiled code does not
check them; a size that breaks one is computed wrongly, silently (AOTInductor reshapes 6 rows into one row of four
and returns it). So the manifest lists each as text in a closed grammar, and the runtime checks them before any
compiled code runs.

The grammar is Python's syntax for the size terms of ``format/size_terms.py`` (ints, the method's size symbols,
``+ - * // % **``, ``Max``/``Min``/``Mod``), compared, and joined by ``and``/``or``/``not``. A reader parses the text
with ``ast`` and builds a closure from those nodes alone; nothing is evaluated as code, and any other node is refused
by name.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PackageError
from .size_terms import OutsideGrammar, Sizes, Term, size_term

MAX_GUARDS = 4096
MAX_GUARD_TEXT = 4000

COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


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
    except OutsideGrammar as refused:
        reason = refused.reason
        if isinstance(refused.node, ast.Name):
            reason = f"{refused.node.id!r} is none of the method's size symbols {sorted(symbols)}"
        raise PackageError(f"size guard term {refused.term!r}: {reason}; a size guard compares size "
                           f"terms (ints, the method's size symbols, + - * // % **, Max/Min/Mod) joined by "
                           f"and/or/not") from None
    return SizeGuard(text, tuple(sorted(read)), check)


def term(node: ast.AST, symbols: set[str] | frozenset[str], read: set[str]) -> Term:
    """The closure computing ``node``: comparisons and ``and``/``or``/``not`` over size terms."""
    def operand(child: ast.AST) -> Term:
        return term(child, symbols, read)

    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        negated = operand(node.operand)
        return lambda sizes: not negated(sizes)
    if isinstance(node, ast.BoolOp):
        operands = [operand(value) for value in node.values]
        if isinstance(node.op, ast.And):
            return lambda sizes: all(value(sizes) for value in operands)
        return lambda sizes: any(value(sizes) for value in operands)
    if isinstance(node, ast.Compare) and all(type(op) in COMPARISONS for op in node.ops):
        terms = [operand(value) for value in (node.left, *node.comparators)]
        compares = [COMPARISONS[type(op)] for op in node.ops]

        def chained(sizes: Sizes) -> bool:
            values = [value(sizes) for value in terms]
            return all(compare(a, b) for compare, a, b in zip(compares, values, values[1:]))

        return chained
    return size_term(node, symbols.__contains__, read, operand)
