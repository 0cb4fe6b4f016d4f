"""Size arithmetic as a file writes it, read by one closed grammar and never evaluated as code.

A delegate's boundary states a dimension as a term of its size symbols (``2*s0``, ``Max(1, s0 - 4)``,
``format/boundary.py``); a method's guard compares such terms (``3*s0 == 12*(s0 // 4)``, ``format/guards.py``).
Both are read here: the text is parsed with ``ast`` and each node the grammar takes becomes a closure; any other
node raises :class:`OutsideGrammar` naming it.

The terms: int literals, size symbols, ``+ - * // %``, unary ``-`` and ``+``, ``**`` by a literal power in
[0, ``MAX_POWER``], ``Max``/``Min`` of two or more terms and ``Mod`` of two, spelt as torch's sympy functions
print. ``max``/``min`` are read as ``Max``/``Min``: the first files with guards spelt them so.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

# A size to a small power is a size; a larger power is not one worth computing.
MAX_POWER = 8

Sizes = Mapping[str, int]
Term = Callable[[Sizes], Any]

ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
# Each function with the least and the most terms it takes (None: no most).
FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "Max": (max, 2, None),
    "Min": (min, 2, None),
    "Mod": (operator.mod, 2, 2),
    "max": (max, 2, None),
    "min": (min, 2, None),
}


class OutsideGrammar(Exception):
    """A node the grammar does not take: ``node`` is it, the message what the grammar found or wanted."""

    def __init__(self, node: ast.AST, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason

    @property
    def term(self) -> str:
        """The refused node's text, cut to a line."""
        return ast.unparse(self.node)[:80]


def size_term(node: ast.AST, is_size: Callable[[str], bool], read: set[str],
              operand: Callable[[ast.AST], Term] | None = None) -> Term:
    """The closure computing ``node`` over sizes (symbol -> int); each symbol it reads is added to ``read``.

    ``is_size`` says which names are size symbols. ``operand`` compiles the node's sub-terms, for a grammar built on
    this one (a guard's comparisons); by default they are size terms too.

    Example: ``size_term(ast.parse("2*s0 + 1", mode="eval").body, str.isidentifier, set())({"s0": 3})`` is 7.
    """
    def inner(child: ast.AST) -> Term:
        return operand(child) if operand is not None else size_term(child, is_size, read)

    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is not int:
            raise OutsideGrammar(node, "a size term's constants are ints")
        return lambda sizes: value
    if isinstance(node, ast.Name):
        name = node.id
        if name in FUNCTIONS or not is_size(name):
            raise OutsideGrammar(node, f"{name!r} is none of the size symbols")
        read.add(name)
        return lambda sizes: sizes[name]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value_of = inner(node.operand)
        return value_of if isinstance(node.op, ast.UAdd) else lambda sizes: -value_of(sizes)
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        apply, left, right = ARITHMETIC[type(node.op)], inner(node.left), inner(node.right)
        return lambda sizes: apply(left(sizes), right(sizes))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        if not (isinstance(node.right, ast.Constant) and type(node.right.value) is int
                and 0 <= node.right.value <= MAX_POWER):
            raise OutsideGrammar(node, f"a power must be a literal int in [0, {MAX_POWER}]")
        base, exponent = inner(node.left), node.right.value
        return lambda sizes: base(sizes) ** exponent
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        function, least, most = FUNCTIONS[node.func.id]
        if (node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args) or len(node.args) < least
                or (most is not None and len(node.args) > most)):
            raise OutsideGrammar(node, f"{node.func.id} takes {least}{' or more' if most is None else ''} "
                                       f"terms, found Call")
        terms = [inner(arg) for arg in node.args]
        return lambda sizes: function(*[term(sizes) for term in terms])
    raise OutsideGrammar(node, f"found {type(node).__name__}")
