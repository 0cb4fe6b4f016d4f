"""The guards a method's export holds under, beyond its sizes' ranges, written in the package's grammar.

``format/guards.py`` says why a package stores them and how a reader checks them. They come from the method's shape
environment, where torch.export (and any retrace or compile after it that shares the environment) recorded what it
assumed of the sizes. A guard is kept where it reads the inputs' size symbols alone and their ranges do not already
settle it; one the grammar cannot say (a true division, a float) is left out, which checks less but never refuses a
size the program holds for.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree
from torch.utils._sympy.functions import CleanDiv, FloorDiv, Max, Min, Mod, ModularIndexing, PowByNatural, PythonMod
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from ..errors import PackageError
from ..format.guards import MAX_GUARD_TEXT, size_guard
from ..format.manifest import InputRecord, symbolic_sizes
from ..format.size_terms import MAX_POWER
from .program_parts import user_input_placeholders, without_outer_guards

logger = logging.getLogger(__name__)

COMPARISONS = {
    sympy.Eq: "==",
    sympy.Ne: "!=",
    sympy.Lt: "<",
    sympy.Le: "<=",
    sympy.Gt: ">",
    sympy.Ge: ">=",
}


class Unsayable(Exception):
    """A guard the package's grammar has no words for."""


def size_guards(program: ExportedProgram, inputs: Sequence[InputRecord]) -> list[str]:
    """The text of each guard of ``program``'s shape environment over the sizes ``inputs`` bind, in order.

    Example: a method reshaping its rows into fours, exported with a dynamic count ``s0``, gives
    ``["3*s0 == 12*(s0 // 4)", ...]``.
    """
    ranges = symbol_ranges(inputs)
    shape_env = shape_env_of(program)
    if shape_env is None or not ranges:
        return []
    texts: list[str] = []
    for guard in shape_env.guards:
        expr = guard.expr
        if not expr.free_symbols or {symbol.name for symbol in expr.free_symbols} - set(ranges):
            continue
        if settled_by(expr, ranges):
            continue
        try:
            text = said(expr)
        except Unsayable as reason:
            logger.debug("size guard %s left out: %s", expr, reason)
            continue
        if len(text) <= MAX_GUARD_TEXT and text not in texts:
            texts.append(text)
    return texts


def symbol_ranges(inputs: Sequence[InputRecord]) -> dict[str, ValueRanges]:
    """Each size symbol ``inputs`` bind, with the range the package checks it against."""
    return {dim.symbol: ValueRanges(dim.min, sympy.oo if dim.max is None else dim.max)
            for _, _, dim in symbolic_sizes(inputs)}


def settled_by(expr: Any, ranges: dict[str, ValueRanges]) -> bool:
    """Whether ``expr`` holds for every size in ``ranges``: the range check already enforces it."""
    try:
        bound = bound_sympy(expr, {symbol: ranges[symbol.name] for symbol in expr.free_symbols})
    except Exception:  # noqa: BLE001 - bound_sympy does not bound every function; such a guard is kept
        return False
    return bool(bound.lower == sympy.true and bound.upper == sympy.true)


# Python's binding strengths, weakest first: an operand binding more weakly than its operator is bracketed.
OR, AND, NOT, COMPARISON, SUM, PRODUCT, NEGATION, POWER, ATOM = range(9)


def said(expr: Any) -> str:
    """``expr`` as the package's grammar writes it; ``Unsayable`` where it cannot."""
    return worded(expr)[0]


def worded(expr: Any) -> tuple[str, int]:
    """``expr``'s text and how strongly it binds."""
    if isinstance(expr, sympy.Integer):
        value = int(expr)
        return str(value), ATOM if value >= 0 else NEGATION
    if isinstance(expr, sympy.Symbol):
        return expr.name, ATOM
    if isinstance(expr, sympy.Add):
        # Terms with a negative coefficient last, read as subtractions: ``s0 - 5``, not ``-5 + s0``.
        first, *rest = sorted(expr.args, key=lambda arg: bool(arg.as_coeff_Mul()[0] < 0))
        text = operand(first, SUM)
        for arg in rest:
            if arg.as_coeff_Mul()[0] < 0:
                text += f" - {operand(-arg, SUM + 1)}"
            else:
                text += f" + {operand(arg, SUM)}"
        return text, SUM
    if isinstance(expr, sympy.Mul):
        return "*".join(operand(arg, PRODUCT + 1) for arg in expr.args), PRODUCT
    if isinstance(expr, (sympy.Pow, PowByNatural)):
        base, exponent = expr.args
        if not (isinstance(exponent, sympy.Integer) and 0 <= int(exponent) <= MAX_POWER):
            raise Unsayable(f"a power by {exponent}")
        return f"{operand(base, ATOM)}**{int(exponent)}", POWER
    # torch's Mod is C's remainder, which is Python's where both sides are sizes (torch writes it only there).
    binary = {FloorDiv: "//", CleanDiv: "//", PythonMod: "%", Mod: "%", sympy.Mod: "%"}
    for kind, symbol in binary.items():
        if isinstance(expr, kind):
            return f"{operand(expr.args[0], PRODUCT)} {symbol} {operand(expr.args[1], PRODUCT + 1)}", PRODUCT
    if isinstance(expr, ModularIndexing):
        base, divisor, modulus = expr.args
        return f"({operand(base, PRODUCT)} // {operand(divisor, PRODUCT + 1)}) % {operand(modulus, PRODUCT + 1)}", \
            PRODUCT
    if isinstance(expr, (Max, Min)):
        return f"{'Max' if isinstance(expr, Max) else 'Min'}({', '.join(said(arg) for arg in expr.args)})", ATOM
    if type(expr) in COMPARISONS:
        return (f"{operand(expr.lhs, COMPARISON + 1)} {COMPARISONS[type(expr)]} "
                f"{operand(expr.rhs, COMPARISON + 1)}"), COMPARISON
    if isinstance(expr, sympy.And):
        return " and ".join(operand(arg, AND + 1) for arg in expr.args), AND
    if isinstance(expr, sympy.Or):
        return " or ".join(operand(arg, OR + 1) for arg in expr.args), OR
    if isinstance(expr, sympy.Not):
        return f"not {operand(expr.args[0], NOT)}", NOT
    raise Unsayable(f"{type(expr).__name__} has no word in the grammar")


def operand(expr: Any, strength: int) -> str:
    """``expr``'s text as an operand that must bind at least ``strength``: bracketed where it binds less."""
    text, binds = worded(expr)
    return text if binds >= strength else f"({text})"


# Guards eager PyTorch shows to be needless -------------------------------------------------------------------------

# How far from the traced size, and from the smallest, a probe looks for one that breaks a guard.
PROBE_REACH = 1 << 14


def waive_guards_eager_agrees_past(method: str, call: Callable[..., Any], exported: ExportedProgram) -> None:
    """Drop from ``exported``'s shape environment each guard past which the program still computes what ``call``
    (the model's method, eagerly) does.

    torch.export guards the branch a model's Python took at the traced size, whether or not the other branch differs:
    VITS pads its relative embeddings ``if pad_length > 0``, where ``pad_length = max(length - 5, 0)``, so a program
    traced at 8 tokens guards ``Max(0, s - 5) > 0``, yet padding by 0 is no padding and the program is right at 3
    tokens too. For each such guard the program and the model run at the size past it nearest the traced one and at
    the smallest past it (one size changed, the others as traced; the example inputs tiled or cut along it, the same
    random seed): where both give the same outputs at each, the guard goes; where the model raises, or the two
    differ, or the probe cannot be made, the file keeps it and refuses such sizes. A method that updates its buffers
    is left alone (a probe would change its state).
    """
    if exported.graph_signature.buffers_to_mutate or exported.example_inputs is None:
        return
    shape_env = shape_env_of(exported)
    if shape_env is None:
        return
    values = [node.meta.get("val") for node in user_input_placeholders(exported)]
    ranges = {str(symbol): bounds for symbol, bounds in exported.range_constraints.items()}
    traced = {symbol: int(hint) for symbol, hint in shape_env.backed_var_to_val.items() if str(symbol) in ranges}
    agreed: dict[tuple[str, int], bool] = {}
    for guard in list(shape_env.guards):
        expr = guard.expr
        if not expr.free_symbols or not expr.free_symbols <= set(traced) or settled_by(expr, ranges):
            continue
        try:
            found = points_past(expr, traced, ranges)
            for symbol, size in found:
                if (symbol.name, size) not in agreed:
                    agreed[symbol.name, size] = eager_agrees(call, exported, values, symbol, size)
        except Exception as reason:  # noqa: BLE001 - a guard that cannot be tried is kept, never an export's failure
            logger.debug("method %r: guard %s kept, not tried: %s", method, expr, reason)
            continue
        if found and all(agreed[symbol.name, size] for symbol, size in found):
            shape_env.guards.remove(guard)
            logger.info("method %r: guard %s dropped: at %s the program computes what the model does", method, expr,
                        ", ".join(f"{symbol} = {size}" for symbol, size in found))


def shape_env_of(exported: ExportedProgram) -> Any:
    """The shape environment ``exported``'s fake inputs share; None for a program without one."""
    fake_mode = detect_fake_mode([node.meta.get("val") for node in exported.graph.find_nodes(op="placeholder")])
    return getattr(fake_mode, "shape_env", None)


def points_past(expr: Any, traced: dict[Any, int], ranges: dict[str, Any]) -> list[tuple[Any, int]]:
    """The sizes at which to try the program past ``expr``, each as (symbol, size) with every other size as traced:
    of the one size whose change nearest its traced value breaks ``expr``, that nearest value and the smallest that
    breaks it (a branch may agree near the traced size and not at the small ones); empty where none, near or small,
    breaks it."""
    found = []
    for symbol in sorted(expr.free_symbols, key=str):
        fixed = expr.subs({other: traced[other] for other in expr.free_symbols if other != symbol})
        broken = sizes_past(fixed, symbol, traced[symbol], ranges[symbol.name])
        if broken:
            nearest = min(broken, key=lambda size: (abs(size - traced[symbol]), size))
            found.append((abs(nearest - traced[symbol]), symbol.name, symbol, sorted({nearest, min(broken)})))
    if not found:
        return []
    _, _, symbol, sizes = min(found)
    return [(symbol, size) for size in sizes]


def sizes_past(expr: Any, symbol: Any, traced: int, bounds: Any) -> list[int]:
    """The sizes within ``bounds`` at which ``expr`` (reading ``symbol`` alone) is false, among those within
    ``PROBE_REACH`` of the ``traced`` one, of the range's low end, and twice and four times it (a probe runs the model
    at such a size: no further). A guard that holds but at one size in thousands (a convolution stack's frames
    ``!= 1``) is found: each candidate is checked by the file's own evaluator."""
    low = int(bounds.lower) if getattr(bounds.lower, "is_Integer", False) else 0
    high = int(bounds.upper) if getattr(bounds.upper, "is_Integer", False) else traced << 2
    candidates = {*range(max(low, traced - PROBE_REACH), min(high, traced + PROBE_REACH) + 1),
                  *range(low, min(high, low + PROBE_REACH) + 1), *(size for size in (traced << 1, traced << 2)
                                                                    if size <= high)}
    try:
        guard = size_guard(said(expr), {symbol.name})
        return [size for size in candidates if not guard.holds({symbol.name: size})]
    except (Unsayable, PackageError):
        return [size for size in candidates if holds_at(expr, symbol, size) is False]


def holds_at(expr: Any, symbol: Any, size: int) -> bool | None:
    """Whether ``expr`` holds where ``symbol`` is ``size``; None where sympy cannot say (a division by zero)."""
    try:
        value = expr.subs(symbol, size)
    except (ZeroDivisionError, TypeError, ValueError):
        return None
    return bool(value) if value in (sympy.true, sympy.false) else None


def eager_agrees(call: Callable[..., Any], exported: ExportedProgram, values: Sequence[Any], symbol: Any,
                 size: int) -> bool:
    """Whether ``exported``, its guards unchecked, computes what ``call`` does with its example inputs resized so
    that ``symbol`` is ``size``."""
    args, kwargs = exported.example_inputs
    flat, spec = pytree.tree_flatten((args, kwargs))
    if len(flat) != len(values):
        return False
    try:
        probe = [resized(value, traced, symbol, size) for value, traced in zip(flat, values)]
    except Unsayable:
        return False
    probe_args, probe_kwargs = pytree.tree_unflatten(probe, spec)
    unguarded = without_outer_guards(copy.copy(exported)).module()
    outputs = []
    for run in (call, unguarded):
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(0)
            try:
                outputs.append(pytree.tree_leaves(run(*probe_args, **probe_kwargs)))
            except Exception:  # noqa: BLE001 - a model that raises past the guard needs it; so does a program
                return False
    return same_outputs(*outputs)


def resized(value: Any, traced: Any, symbol: Any, size: int) -> Any:
    """``value`` (an example input whose traced form is ``traced``) with every dimension that is ``symbol`` made
    ``size``: tiled or cut along it. ``Unsayable`` where a dimension depends on ``symbol`` otherwise."""
    if isinstance(traced, torch.SymInt):
        expr = traced.node.expr
        return size if expr == symbol else refuse_if_reads(expr, symbol, value)
    if not isinstance(traced, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    for axis, dim in enumerate(traced.shape):
        expr = dim.node.expr if isinstance(dim, torch.SymInt) else None
        if expr == symbol:
            value = value.index_select(axis, torch.arange(size, device=value.device) % value.shape[axis])
        elif expr is not None:
            refuse_if_reads(expr, symbol, value)
    return value


def refuse_if_reads(expr: Any, symbol: Any, value: Any) -> Any:
    if symbol in expr.free_symbols:
        raise Unsayable(f"an input size {expr} reads {symbol}")
    return value


def same_outputs(eager: list[Any], program: list[Any]) -> bool:
    if len(eager) != len(program):
        return False
    for want, have in zip(eager, program):
        if isinstance(want, torch.Tensor) != isinstance(have, torch.Tensor):
            return False
        if isinstance(want, torch.Tensor):
            if want.shape != have.shape or want.dtype != have.dtype or not torch.allclose(
                    want, have, rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
        elif want != have:
            return False
    return True
