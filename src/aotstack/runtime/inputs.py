"""What a loaded method accepts: its arguments checked against the package's input records
(``format/manifest.py``) before any compiled code sees them.

A dimension is an int, a ``Dim`` (a symbol with its range: the same symbol means the same size
wherever it appears), or None where it is an expression of symbols that is not checked here
(each delegate checks its own inputs' sizes, expressions included: ``format/boundary.py``).

A tensor must also be dense (strided: not sparse, MKL-DNN or nested), hold data (not meta), be
on the device type it was exported on, and be a plain ``torch.Tensor`` or ``nn.Parameter``; a
subclass that only adds Python methods or ``__torch_function__`` is unwrapped to the plain
tensor it holds, one with its own ``__torch_dispatch__`` (a fake, distributed or jagged tensor)
is refused. A view with the negation or conjugation bit set is materialised, not refused.

Each argument's check is a closure built once at load: a plain tensor costs a few attribute
reads, and a plain positional call no pytree walk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import InputError, PackageError
from ..format.boundary import DEVICE_FLAGS, PLAIN_TENSOR_TYPES
from ..format.guards import SizeGuard, size_guard
from ..format.manifest import Dim, InputRecord, range_text, shape_text, size_symbols, symbolic_sizes
from ..format.tensor_data import dtype_from_name

# How many sets of sizes that met a method's guards it remembers.
MAX_SIZES_REMEMBERED = 4096

SCALAR_KINDS: dict[str, type] = {"bool": bool, "int": int, "float": float}

# Reads one argument, given the sizes bound to symbols so far; raises InputError, or returns the
# value to run with (the argument itself, or a plain, materialised tensor in its place).
Check = Callable[[Any, dict[str, int]], Any]

# What to say of a tensor whose layout is not strided.
LAYOUT_NAMES = {
    torch.sparse_coo: "a sparse COO tensor",
    torch.sparse_csr: "a sparse CSR tensor",
    torch.sparse_csc: "a sparse CSC tensor",
    torch.sparse_bsr: "a sparse BSR tensor",
    torch.sparse_bsc: "a sparse BSC tensor",
    torch._mkldnn: "an MKL-DNN tensor",  # type: ignore[attr-defined]
}


class InputCheck:
    """The arguments a method takes, positional and keyword, checked against what was exported."""

    def __init__(
        self, method: str, inputs: list[InputRecord], in_spec: pytree.TreeSpec, guards: Sequence[str] = ()
    ) -> None:
        self.method = method
        self.records = inputs
        self.names = [record.name for record in inputs]
        self.in_spec = in_spec
        self.positional_count, self.keywords = call_shape(in_spec)
        # Plain positional arguments, the usual case, need no pytree walk.
        self.flat_positional = in_spec == pytree.tree_flatten((tuple(range(len(inputs))), {}))[1]
        # Nor do keyword arguments where every argument is one tensor or scalar (a decoder's step:
        # ``input_ids=..., cache_position=...``): bound in order, they are the flat list.
        self.flat_keywords = in_spec == pytree.tree_flatten(
            (tuple(range(self.positional_count)), dict.fromkeys(self.keywords, 0))
        )[1]
        self.keyword_order = tuple(self.keywords)
        self.checks = [argument_check(method, record) for record in inputs]
        symbols = size_symbols(inputs)
        self.guards = [size_guard(text, symbols) for text in guards]
        self.bound_where = symbol_sources(inputs)
        # Sizes that met every guard: a loop calling with the same sizes checks them once (a guard costs microseconds).
        self.guarded_symbols = tuple(sorted({symbol for guard in self.guards for symbol in guard.symbols}))
        self.sizes_that_held: set[tuple[int, ...]] = set()

    def flat_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
        """The arguments as the flat list the method's graph takes, every one checked."""
        if self.flat_positional and not kwargs:
            flat: Sequence[Any] = args
            if len(flat) != len(self.names):
                raise InputError(
                    f"{self.method}() takes {len(self.names)} argument(s) ({', '.join(self.names)}), got {len(flat)}"
                )
        else:
            flat = self.structured_arguments(args, kwargs)
        sizes: dict[str, int] = {}
        checked = [check(value, sizes) for check, value in zip(self.checks, flat)]
        if self.guards:
            self.check_guards(sizes)
        return checked

    def check_guards(self, sizes: dict[str, int]) -> None:
        key = tuple(sizes[symbol] for symbol in self.guarded_symbols)
        if key in self.sizes_that_held:
            return
        for guard in self.guards:
            if not guard.holds(sizes):
                self.refuse(guard, sizes)
        if len(self.sizes_that_held) >= MAX_SIZES_REMEMBERED:
            self.sizes_that_held.clear()
        self.sizes_that_held.add(key)

    def refuse(self, guard: SizeGuard, sizes: dict[str, int]) -> None:
        read = [symbol for symbol in self.bound_where if symbol in guard.symbols]
        given = ", ".join(f"{self.bound_where[symbol]} is {sizes[symbol]} ({symbol})" for symbol in read)
        raise InputError(f"{self.method}(): {given}, but the method was exported for sizes where {guard.text} only")

    def structured_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if self.flat_keywords and len(args) == self.positional_count and tuple(kwargs) == self.keyword_order:
            # Every keyword given, in the order exported: a decoder's step, called as generate calls it.
            return [*args, *kwargs.values()]
        args, kwargs = self.bound(args, kwargs)
        if self.flat_keywords:
            if len(args) != self.positional_count:
                missing = self.names[len(args):self.positional_count]
                raise InputError(f"{self.method}(): missing positional argument(s) {', '.join(map(repr, missing))}")
            # A nested value where an argument is one leaf is refused by that argument's check.
            return [*args, *kwargs.values()]
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(f"{self.method}(): arguments structured as {spec}, expected {self.in_spec}")
        return flat

    def bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments in the order the method was exported with.

        Arguments exported as keywords may also be passed by position, after the positional ones.
        """
        extra = args[self.positional_count:]
        if len(extra) > len(self.keywords):
            raise InputError(
                f"{self.method}() takes {self.positional_count + len(self.keywords)} argument(s) "
                f"({', '.join(self.names)}), got {len(args) + len(kwargs)}"
            )
        given = dict(zip(self.keywords, extra))
        for name, value in kwargs.items():
            if name in given:
                raise InputError(f"{self.method}() got argument {name!r} twice")
            given[name] = value
        unknown = sorted(set(given) - set(self.keywords))
        missing = [name for name in self.keywords if name not in given]
        if unknown or missing:
            parts = [f"unknown keyword(s) {unknown}"] if unknown else []
            parts += [f"missing keyword(s) {missing}"] if missing else []
            by_position = [name for name in unknown if name in self.names]
            if by_position:
                parts.append(f"pass {', '.join(map(repr, by_position))} by position, as it was exported")
            takes = f"it takes keywords {self.keywords}" if self.keywords else "it takes no keyword arguments"
            raise InputError(f"{self.method}(): {'; '.join(parts)}; {takes}")
        return tuple(args[: self.positional_count]), {name: given[name] for name in self.keywords}


def symbol_sources(inputs: Sequence[InputRecord]) -> dict[str, str]:
    """Where each size symbol is first bound: ``argument 'x' dimension 0``."""
    where: dict[str, str] = {}
    for record, axis, dim in symbolic_sizes(inputs):
        where.setdefault(dim.symbol, f"argument {record.name!r}" + ("" if axis is None else f" dimension {axis}"))
    return where


def call_shape(in_spec: pytree.TreeSpec) -> tuple[int, list[str]]:
    """How many positional arguments a method takes, and its keyword arguments in order."""
    if in_spec.num_children != 2:
        return 0, []
    # torch 2.13 deprecates ``children_specs`` for ``children()``, which older releases lack.
    children = in_spec.children() if callable(getattr(in_spec, "children", None)) else in_spec.children_specs
    positional, keywords = children
    names = list(keywords.context) if keywords.type is dict else []
    return positional.num_children, names


def argument_check(method: str, record: InputRecord) -> Check:
    if record.kind == "tensor":
        try:
            dtype = dtype_from_name(record.dtype or "")
        except ValueError:
            raise PackageError(f"input {record.name!r} has dtype {record.dtype!r}, not a torch dtype") from None
        return tensor_check(method, record.name, dtype, record.shape or [], record.device)
    if record.kind == "none":
        return none_check(method, record.name)
    if record.kind not in SCALAR_KINDS:
        raise PackageError(f"input {record.name!r} has kind {record.kind!r}")
    return scalar_check(method, record.name, SCALAR_KINDS[record.kind], record)


def tensor_check(
    method: str, name: str, dtype: torch.dtype, shape: list[int | Dim | None], device: str | None = None
) -> Check:
    """The check of one tensor argument; ``device`` its device type, None where the record has none."""
    static = [d if isinstance(d, int) else None for d in shape]
    # Where every size is static, one comparison checks the shape.
    static_shape = torch.Size(static) if None not in static else None
    symbols = [(axis, d) for axis, d in enumerate(shape) if isinstance(d, Dim)]
    where = f"{method}(): argument {name!r}"
    # A cheap flag (``is_cpu``) where there is one: building value.device costs more than the rest.
    device_flag = DEVICE_FLAGS.get(device) if device is not None else "is_meta"
    flag_means_right = device is not None
    # Only a complex tensor can carry the conjugation bit.
    conjugable = dtype.is_complex

    def check(value: Any, sizes: dict[str, int]) -> Any:
        if type(value) not in PLAIN_TENSOR_TYPES:
            value = plain_tensor(where, value)
        if value.dtype != dtype:
            raise InputError(f"{where} has dtype {value.dtype}, expected {dtype}")
        if value.layout != torch.strided:
            refuse_layout(where, value)
        if device_flag is None:
            if value.device.type != device:
                refuse_device(where, value, device)
        elif getattr(value, device_flag) != flag_means_right:
            refuse_device(where, value, device)
        try:
            have = value.shape
        except RuntimeError:
            # A nested tensor is strided and plain, but has no one shape.
            raise InputError(f"{where} is a nested tensor; the method takes dense tensors") from None
        if have != static_shape and (
            static_shape is not None
            or len(have) != len(static)
            or any(want is not None and d != want for d, want in zip(have, static))
        ):
            raise InputError(f"{where} has shape {list(have)}, expected {shape_text(shape)}")
        for axis, dim in symbols:
            check_size(method, f"argument {name!r} dimension {axis}", have[axis], dim, sizes)
        # Compiled code reads memory, not the view: a negated or conjugated view is materialised.
        if value.is_neg() or (conjugable and value.is_conj()):
            value = value.resolve_neg().resolve_conj()
        return value

    return check


def plain_tensor(where: str, value: Any) -> torch.Tensor:
    """``value`` as the plain tensor it holds; ``InputError`` for a non-tensor or one that may hold no data."""
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{where} must be a tensor, got {type(value).__name__}")
    kind = type(value)
    if kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise InputError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass with its own "
            "__torch_dispatch__ whose data compiled code cannot read; pass a plain torch.Tensor"
        )
    # A subclass adding Python methods or __torch_function__ holds an ordinary tensor; the base
    # class's as_subclass unwraps it without calling the subclass's overrides.
    return torch._C.TensorBase.as_subclass(value, torch.Tensor)


def refuse_layout(where: str, value: torch.Tensor) -> None:
    what = LAYOUT_NAMES.get(value.layout, f"a tensor with layout {value.layout}")
    raise InputError(f"{where} is {what}; the method takes dense (strided) tensors, e.g. its .to_dense()")


def refuse_device(where: str, value: torch.Tensor, device: str | None) -> None:
    if value.is_meta:
        raise InputError(f"{where} is a meta tensor, which holds no data; pass one on {device or 'a real device'}")
    raise InputError(f"{where} is on {value.device}, but the method was exported for {device} tensors")


def check_size(method: str, what: str, size: int, dim: Dim, sizes: dict[str, int]) -> None:
    if size < dim.min or (dim.max is not None and size > dim.max):
        raise InputError(f"{method}(): {what} is {size}, outside the range {range_text(dim)} it was exported for")
    bound = sizes.setdefault(dim.symbol, size)
    if bound != size:
        raise InputError(
            f"{method}(): {what} is {size}, but an earlier argument gave the same dimension "
            f"({dim.symbol}) the size {bound}; they must be equal"
        )


def scalar_check(method: str, name: str, kind: type, record: InputRecord) -> Check:
    value_wanted, dim = record.value, record.dim

    def check(value: Any, sizes: dict[str, int]) -> Any:
        # bool is an int in Python; an int argument must not take one, nor a bool an int.
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise InputError(f"{method}(): argument {name!r} must be {kind.__name__}, got {type(value).__name__}")
        if value_wanted is not None and value != value_wanted:
            raise InputError(
                f"{method}(): argument {name!r} is {value!r}, but the method was exported for {value_wanted!r} "
                "only; export it with a dynamic value to vary it"
            )
        if value_wanted is None and dim is not None:
            check_size(method, f"argument {name!r}", value, dim, sizes)
        return value

    return check


def none_check(method: str, name: str) -> Check:
    def check(value: Any, sizes: dict[str, int]) -> Any:
        if value is not None:
            raise InputError(f"{method}(): argument {name!r} was exported as None, got {type(value).__name__}")
        return value

    return check
