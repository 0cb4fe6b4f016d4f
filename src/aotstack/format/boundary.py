"""What a compiled part takes: each input's dtype, device type and sizes, checked before its code runs.

Compiled code trusts its inputs. AOTInductor's generated code indexes with the sizes it reads
and the strides it was compiled for, so a tensor of the wrong size, or two inputs that should
share a dynamic size and do not, make it read out of bounds. The method's own input checks
(``runtime/inputs.py``) come from the manifest; a delegate does not rely on them. Its compile
side records a :class:`Boundary` in its processed JSON, and its run side builds a
:class:`BoundaryCheck` once at init and calls it on every call, whatever the manifest says.

A size is an int, a symbol name (``s0``), or an expression of symbols as ``str()`` of a sympy
expression prints it (``2*s0``, ``s0 + 1``, ``((s0 + 1)//2)``). Symbols are bound first: from
the dimensions that are a plain symbol or, for a symbol no plain dimension gives, from the first
linear expression of it alone (``2*s0`` must be even and gives s0 half of it); each is checked
against its range, and the same symbol must mean the same size everywhere. Then every other
expression is evaluated and compared, by the closed grammar of ``format/size_terms.py`` (ints, symbol
names, ``+ - * // % **``, unary minus, ``Max``, ``Min`` and ``Mod``). A dimension whose
expression uses anything else, or a symbol nothing binds, is not evaluated; it must still equal
every other dimension written the same way. Nothing here calls ``eval`` or imports sympy.

In JSON::

    {"inputs": [{"dtype": "float32", "device": "cpu", "sizes": [4, "s0", "2*s0"]}],
     "symbols": {"s0": [2, 64]}}

a symbol's range being ``[min, max]`` with ``max`` null where it is unbounded.
"""

from __future__ import annotations

import ast
import copy
import keyword
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError, PackageError
from .plan import expect
from .size_terms import OutsideGrammar, size_term
from .tensor_data import dtype_from_name

Size = int | str
# An expression compiled to a function of the bound symbols.
Evaluator = Callable[[Mapping[str, int]], int]

# Tensors a compiled part may be handed: plain ones. A subclass may carry no storage of its own.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# A cheap flag per device type, so the hot path does not build a torch.device per input.
DEVICE_FLAGS = {"cpu": "is_cpu", "cuda": "is_cuda", "mps": "is_mps", "meta": "is_meta", "xpu": "is_xpu"}
# Longer expressions are not parsed: the parser recurses, and no real size is this long.
MAX_EXPRESSION_LENGTH = 400


@dataclass(frozen=True)
class BoundaryInput:
    """One input of a compiled part: its dtype name, device type and sizes."""

    dtype: str
    device: str
    sizes: list[Size]


@dataclass(frozen=True)
class ProvenInput:
    """What a method's plan guarantees one delegate input is at every call (``runtime/proven.py``)."""

    spec: BoundaryInput
    # Its strides at every call, where it is also a plain tensor (no subclass, no gradient, no negation or
    # conjugation bit) laid out the same way each time: a weight, or a host part's output. None: not vouched for.
    strides: tuple[int, ...] | None = None

    @property
    def contiguous(self) -> bool:
        """Whether ``strides`` are vouched for and lay the sizes out contiguously (a size-1 axis's stride aside)."""
        sizes = self.spec.sizes
        if self.strides is None or len(self.strides) != len(sizes) or not all(isinstance(s, int) for s in sizes):
            return False
        expected = 1
        for size, stride in zip(reversed(sizes), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= int(size)
        return True


@dataclass(frozen=True)
class Boundary:
    """The inputs a compiled part takes, and the range of each symbol their sizes use."""

    inputs: list[BoundaryInput]
    # Symbol -> (min, max); max None where unbounded.
    symbols: dict[str, tuple[int, int | None]]

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [{"dtype": i.dtype, "device": i.device, "sizes": list(i.sizes)} for i in self.inputs],
            "symbols": {name: [low, high] for name, (low, high) in self.symbols.items()},
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "boundary") -> Boundary:
        """Read a boundary; anything malformed is a ``PackageError`` naming the field."""
        data = expect(data, dict, where)
        symbols = {}
        for name, bounds in expect(data.get("symbols"), dict, f"{where}.symbols").items():
            symbols[name] = symbol_range(name, bounds, f"{where}.symbols[{name!r}]")
        inputs = [
            boundary_input(item, symbols, f"{where}.inputs[{index}]")
            for index, item in enumerate(expect(data.get("inputs"), list, f"{where}.inputs"))
        ]
        return cls(inputs, symbols)

    def checker(self, label: str) -> BoundaryCheck:
        """The check a run side builds once and calls on every call."""
        return BoundaryCheck(self, label)

    def check(self, inputs: Sequence[Any], label: str) -> None:
        """Raise ``InputError`` naming ``label``, the input and what it must be, unless ``inputs`` fit."""
        BoundaryCheck(self, label)(inputs)


def symbol_range(name: Any, bounds: Any, where: str) -> tuple[int, int | None]:
    if not is_symbol(name):
        raise PackageError(f"{where}: {name!r} is not a symbol name")
    bounds = expect(bounds, list, where)
    if len(bounds) != 2:
        raise PackageError(f"{where} must be [min, max], got {bounds!r}")
    low, high = expect(bounds[0], int, f"{where} min"), bounds[1]
    if high is not None:
        high = expect(high, int, f"{where} max")
    if low < 0 or (high is not None and high < low):
        raise PackageError(f"{where} is not a range of sizes: {bounds!r}")
    return low, high


def boundary_input(data: Any, symbols: Mapping[str, Any], where: str) -> BoundaryInput:
    data = expect(data, dict, where)
    dtype = expect(data.get("dtype"), str, f"{where}.dtype")
    try:
        dtype_from_name(dtype)
    except ValueError:
        raise PackageError(f"{where}.dtype: {dtype!r} is not a torch dtype") from None
    device = expect(data.get("device"), str, f"{where}.device")
    sizes = expect(data.get("sizes"), list, f"{where}.sizes")
    for axis, size in enumerate(sizes):
        if isinstance(size, str) and size:
            if is_symbol(size) and size not in symbols:
                raise PackageError(f"{where}.sizes[{axis}]: symbol {size!r} has no range in the boundary's symbols")
        elif not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PackageError(f"{where}.sizes[{axis}] must be a size, a symbol or an expression, got {size!r}")
    return BoundaryInput(dtype, device, sizes)


def is_symbol(text: Any) -> bool:
    return isinstance(text, str) and text.isidentifier() and not keyword.iskeyword(text)


# Checking -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    """One input, precomputed for the hot path."""

    dtype: torch.dtype
    device: str
    # The attribute that says a tensor is on ``device`` (``is_cpu``), None for a device without one.
    device_flag: str | None
    rank: int
    # The whole shape where every size is an int: one comparison checks it.
    static_shape: torch.Size | None
    statics: tuple[tuple[int, int], ...]
    # (axis, symbol, scale, offset, min, max, text) for each dimension that binds a symbol: a plain
    # symbol (scale 1, offset 0), or a linear expression of one symbol no plain dimension binds
    # (``2*s0``: the size must be even, and binds s0 to half of it).
    binders: tuple[tuple[int, str, int, int, int, int | None, str], ...]
    # (axis, text) for each expression that cannot be evaluated: equal text, equal size.
    opaque: tuple[tuple[int, str], ...]
    text: str


class BoundaryCheck:
    """A boundary compiled into per-input tuples once; calling it checks a call's inputs.

    Plain static inputs cost a type, dtype, layout and device test and one shape comparison.
    """

    def __init__(self, boundary: Boundary, label: str) -> None:
        self.label = label
        self.boundary = boundary
        plans = dimension_plans(boundary)
        self.specs = [
            input_spec(item, boundary.symbols, plan[0], plan[1]) for item, plan in zip(boundary.inputs, plans)
        ]
        # (index, spec) of each input a call checks: all of them, but those ``trusting`` leaves out.
        self.checked = list(enumerate(self.specs))
        # (input, axis, text, evaluator): expressions of bound symbols, checked once every input bound them.
        self.expressions = [entry for plan in plans for entry in plan[2]]

    def trusting(self, proven: Mapping[int, ProvenInput]) -> BoundaryCheck | None:
        """This check without the inputs ``proven`` vouches for; None where nothing is left to check.

        ``proven`` maps an input's index to what its caller guarantees it is at every call. An
        input is left out only where that is exactly this boundary's input and every size of it
        is an int: a static input binds no symbol another input's check needs.

        Example: ``check.trusting({0: ProvenInput(BoundaryInput("float32", "cpu", [1, 768]))})``.
        """
        inputs = self.boundary.inputs
        kept = [
            (index, spec)
            for index, spec in self.checked
            if not (spec.static_shape is not None and index in proven and proven[index].spec == inputs[index])
        ]
        if not kept and not self.expressions:
            return None
        trusting = copy.copy(self)
        trusting.checked = kept
        return trusting

    def __call__(self, inputs: Sequence[Any]) -> None:
        specs = self.specs
        if len(inputs) != len(specs):
            raise InputError(f"{self.label}: takes {len(specs)} input(s), got {len(inputs)}")
        sizes: dict[str, int] = {}
        for index, spec in self.checked:
            value = inputs[index]
            if (
                type(value) not in PLAIN_TENSOR_TYPES
                or value.dtype != spec.dtype
                or value.layout != torch.strided
                or not (getattr(value, spec.device_flag) if spec.device_flag else value.device.type == spec.device)
            ):
                self.refuse_kind(index, value, spec)
            try:
                shape = value.shape
            except RuntimeError as exc:
                # A nested tensor is strided and plain, but has no one shape to read.
                raise InputError(f"{self.label}: input {index} has no shape a compiled part can take ({exc})") from None
            if spec.static_shape is not None:
                if shape != spec.static_shape:
                    self.refuse_shape(index, shape, spec)
                continue
            if len(shape) != spec.rank or any(shape[axis] != size for axis, size in spec.statics):
                self.refuse_shape(index, shape, spec)
            for axis, name, scale, offset, low, high, text in spec.binders:
                size = shape[axis]
                symbol, rest = (size, 0) if scale == 1 and offset == 0 else divmod(size - offset, scale)
                if rest or symbol < low or (high is not None and symbol > high):
                    self.refuse_range(index, axis, size, name, text, low, high)
                if sizes.setdefault(name, symbol) != symbol:
                    self.refuse_shared(index, axis, size, name, sizes[name], text)
            for axis, text in spec.opaque:
                if sizes.setdefault(text, shape[axis]) != shape[axis]:
                    self.refuse_shared(index, axis, shape[axis], text, sizes[text], text)
        for index, axis, text, evaluate in self.expressions:
            try:
                want = evaluate(sizes)
            except (ArithmeticError, KeyError, ValueError):
                continue  # e.g. a division by a size that is zero: left to the compiled code
            have = inputs[index].shape[axis]
            if have != want:
                raise InputError(
                    f"{self.label}: input {index} dimension {axis} is {have}, but it was compiled as {text}, "
                    f"which is {want} given {bound_text(sizes)}; expected {specs[index].text}"
                )

    def refuse_kind(self, index: int, value: Any, spec: InputSpec) -> None:
        where = f"{self.label}: input {index}"
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{where} must be a tensor, got {type(value).__name__}")
        if type(value) not in PLAIN_TENSOR_TYPES:
            raise InputError(f"{where} is a {type(value).__name__}; a compiled part takes plain tensors only")
        if value.layout != torch.strided:
            raise InputError(f"{where} has layout {value.layout}; it was compiled for strided tensors")
        if value.dtype != spec.dtype:
            raise InputError(f"{where} has dtype {value.dtype}; expected {spec.text}")
        raise InputError(f"{where} is on {value.device}; it was compiled for {spec.device} tensors ({spec.text})")

    def refuse_shape(self, index: int, shape: torch.Size, spec: InputSpec) -> None:
        raise InputError(f"{self.label}: input {index} has shape {list(shape)}; expected {spec.text}")

    def refuse_range(
        self, index: int, axis: int, size: int, name: str, text: str, low: int, high: int | None
    ) -> None:
        span = f"[{low}, {'∞' if high is None else high}]"
        if text == name:
            reason = f"outside the range {span} of {name}"
        else:
            reason = f"but it was compiled as {text}, and no {name} in {span} makes that"
        raise InputError(f"{self.label}: input {index} dimension {axis} is {size}, {reason}")

    def refuse_shared(self, index: int, axis: int, size: int, name: str, earlier: int, text: str) -> None:
        how = "" if text == name else f" (compiled as {text})"
        raise InputError(
            f"{self.label}: input {index} dimension {axis} is {size}{how}, but an earlier dimension gave "
            f"{name} the size {earlier}; they must agree"
        )


# Per input: its binders, its opaque dimensions, and its expressions evaluated after the loop.
DimensionPlan = tuple[
    list[tuple[int, str, int, int, int, int | None, str]], list[tuple[int, str]], list[tuple[int, int, str, Evaluator]]
]


def dimension_plans(boundary: Boundary) -> list[DimensionPlan]:
    """How each dynamic dimension is checked: binding a symbol, evaluated once all are bound, or by text."""
    plain = {size for item in boundary.inputs for size in item.sizes if is_symbol(size)}
    compiled = {
        size: compile_expression(size)
        for item in boundary.inputs
        for size in item.sizes
        if isinstance(size, str) and not is_symbol(size)
    }
    # A symbol no plain dimension binds is bound by the first linear expression of it alone.
    solvers: dict[str, tuple[int, int, int, int]] = {}
    for index, item in enumerate(boundary.inputs):
        for axis, size in enumerate(item.sizes):
            expression = compiled.get(size) if isinstance(size, str) else None
            if expression is None or not expression.linear or len(expression.names) != 1:
                continue
            [name] = expression.names
            offset = expression.evaluate({name: 0})
            scale = expression.evaluate({name: 1}) - offset
            if name not in plain and name not in solvers and scale > 0:
                solvers[name] = (index, axis, scale, offset)
    bound = plain | set(solvers)
    plans: list[DimensionPlan] = []
    for index, item in enumerate(boundary.inputs):
        binders, opaque, evaluated = [], [], []
        for axis, size in enumerate(item.sizes):
            if isinstance(size, int):
                continue
            low, high = boundary.symbols.get(size, (0, None))
            if is_symbol(size):
                binders.append((axis, size, 1, 0, low, high, size))
                continue
            expression = compiled[size]
            solver = next((name for name, where in solvers.items() if where[:2] == (index, axis)), None)
            if solver is not None:
                low, high = boundary.symbols.get(solver, (0, None))
                binders.append((axis, solver, solvers[solver][2], solvers[solver][3], low, high, size))
            elif expression is not None and expression.names <= bound:
                evaluated.append((index, axis, size, expression.evaluate))
            else:
                opaque.append((axis, size))
        plans.append((binders, opaque, evaluated))
    return plans


def input_spec(
    item: BoundaryInput,
    ranges: Mapping[str, tuple[int, int | None]],
    binders: list[tuple[int, str, int, int, int, int | None, str]],
    opaque: list[tuple[int, str]],
) -> InputSpec:
    statics = tuple((axis, size) for axis, size in enumerate(item.sizes) if isinstance(size, int))
    parts = [
        f"{size} in [{ranges[size][0]}, {'∞' if ranges[size][1] is None else ranges[size][1]}]"
        if isinstance(size, str) and size in ranges
        else str(size)
        for size in item.sizes
    ]
    return InputSpec(
        dtype=dtype_from_name(item.dtype),
        device=item.device,
        device_flag=DEVICE_FLAGS.get(item.device),
        rank=len(item.sizes),
        static_shape=torch.Size(item.sizes) if len(statics) == len(item.sizes) else None,
        statics=statics,
        binders=tuple(binders),
        opaque=tuple(opaque),
        text=f"{item.dtype}[{', '.join(parts)}] on {item.device}",
    )


def bound_text(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{name} = {size}" for name, size in sizes.items() if is_symbol(name)) or "no symbols"


# Expressions --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Expression:
    """A size expression compiled to a function of the symbols it reads."""

    evaluate: Evaluator
    names: frozenset[str]
    # Built from symbols and ints by +, - and multiplication by constants only: a*s + b in one symbol.
    linear: bool


def compile_expression(text: str) -> Expression | None:
    """``text`` compiled; None where it is not a size term (``format/size_terms.py``)."""
    if len(text) > MAX_EXPRESSION_LENGTH:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
        names: set[str] = set()
        evaluate = size_term(tree.body, is_symbol, names)
        return Expression(evaluate, frozenset(names), is_linear(tree.body))
    except (SyntaxError, ValueError, RecursionError, OutsideGrammar):
        return None


def is_linear(node: ast.AST) -> bool:
    if isinstance(node, (ast.Constant, ast.Name)):
        return True
    if isinstance(node, ast.UnaryOp):
        return is_linear(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return is_linear(node.left) and is_linear(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        constant = [side for side in (node.left, node.right) if not any(map(is_name, ast.walk(side)))]
        return bool(constant) and is_linear(node.left) and is_linear(node.right)
    return False


def is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name)
