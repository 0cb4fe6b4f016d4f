"""What a loaded method accepts: its arguments checked before any compiled code sees them.

The package records, per user input of a method, one of::

    {"name": "x", "kind": "tensor", "dtype": "float32", "shape": [4, {"symbol": "s0", "min": 1, "max": 64}]}
    {"name": "n", "kind": "int", "value": 3}          # specialised when exported: must be 3
    {"name": "n", "kind": "int", "value": null, "min": 1, "max": 8}   # a symbolic int
    {"name": "mask", "kind": "none"}

A dimension is an int, a symbol with its range (the same symbol means the same size wherever it
appears), or null where it is an expression of symbols that is not checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import InputError
from .tensor_data import dtype_from_name

SCALAR_KINDS: dict[str, type] = {"bool": bool, "int": int, "float": float}

# Reads one argument, given the sizes bound to symbols so far; raises InputError.
Check = Callable[[Any, dict[str, int]], None]


class InputCheck:
    """The arguments a method takes, positional and keyword, checked against what was exported."""

    def __init__(self, method: str, inputs: list[dict[str, Any]], in_spec: pytree.TreeSpec) -> None:
        self.method = method
        self.names = [record["name"] for record in inputs]
        self.in_spec = in_spec
        self.positional_count, self.keywords = call_shape(in_spec)
        # Plain positional arguments, the usual case, need no pytree walk.
        self.flat_positional = in_spec == pytree.tree_flatten((tuple(range(len(inputs))), {}))[1]
        self.checks = [argument_check(method, record) for record in inputs]

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
        for check, value in zip(self.checks, flat):
            check(value, sizes)
        return flat

    def structured_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        args, kwargs = self.bound(args, kwargs)
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
            raise InputError(f"{self.method}(): {'; '.join(parts)}; it takes keywords {self.keywords}")
        return tuple(args[: self.positional_count]), {name: given[name] for name in self.keywords}


def call_shape(in_spec: pytree.TreeSpec) -> tuple[int, list[str]]:
    """How many positional arguments a method takes, and its keyword arguments in order."""
    if in_spec.num_children != 2:
        return 0, []
    # torch 2.13 deprecates ``children_specs`` for ``children()``, which older releases lack.
    children = in_spec.children() if callable(getattr(in_spec, "children", None)) else in_spec.children_specs
    positional, keywords = children
    names = list(keywords.context) if keywords.type is dict else []
    return positional.num_children, names


def argument_check(method: str, record: dict[str, Any]) -> Check:
    name = record["name"]
    kind = record["kind"]
    if kind == "tensor":
        return tensor_check(method, name, dtype_from_name(record["dtype"]), record["shape"])
    if kind == "none":
        return none_check(method, name)
    return scalar_check(method, name, SCALAR_KINDS[kind], record)


def tensor_check(method: str, name: str, dtype: torch.dtype, shape: list[Any]) -> Check:
    static = [d if isinstance(d, int) else None for d in shape]
    symbols = [(axis, d) for axis, d in enumerate(shape) if isinstance(d, dict)]

    def check(value: Any, sizes: dict[str, int]) -> None:
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{method}(): argument {name!r} must be a tensor, got {type(value).__name__}")
        if value.dtype != dtype:
            raise InputError(f"{method}(): argument {name!r} has dtype {value.dtype}, expected {dtype}")
        have = value.shape
        if len(have) != len(static) or any(want is not None and d != want for d, want in zip(have, static)):
            raise InputError(
                f"{method}(): argument {name!r} has shape {list(have)}, expected {shape_text(shape)}"
            )
        for axis, dim in symbols:
            check_size(method, f"argument {name!r} dimension {axis}", have[axis], dim, sizes)

    return check


def check_size(method: str, what: str, size: int, dim: dict[str, Any], sizes: dict[str, int]) -> None:
    low, high = dim["min"], dim["max"]
    if size < low or (high is not None and size > high):
        raise InputError(f"{method}(): {what} is {size}, outside the range {range_text(dim)} it was exported for")
    bound = sizes.setdefault(dim["symbol"], size)
    if bound != size:
        raise InputError(
            f"{method}(): {what} is {size}, but an earlier argument gave the same dimension "
            f"({dim['symbol']}) the size {bound}; they must be equal"
        )


def scalar_check(method: str, name: str, kind: type, record: dict[str, Any]) -> Check:
    value_wanted = record.get("value")

    def check(value: Any, sizes: dict[str, int]) -> None:
        # bool is an int in Python; an int argument must not take one, nor a bool an int.
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise InputError(f"{method}(): argument {name!r} must be {kind.__name__}, got {type(value).__name__}")
        if value_wanted is not None and value != value_wanted:
            raise InputError(
                f"{method}(): argument {name!r} is {value!r}, but the method was exported for {value_wanted!r} "
                "only; export it with a dynamic value to vary it"
            )
        if value_wanted is None and "min" in record:
            check_size(method, f"argument {name!r}", value, record, sizes)

    return check


def none_check(method: str, name: str) -> Check:
    def check(value: Any, sizes: dict[str, int]) -> None:
        if value is not None:
            raise InputError(f"{method}(): argument {name!r} was exported as None, got {type(value).__name__}")

    return check


def record_text(record: dict[str, Any]) -> str:
    """``x: float32[4, s0 in [1, 64]]``, ``n: int = 3``: one input as ``aotstack inspect`` shows it."""
    kind = record["kind"]
    if kind == "tensor":
        return f"{record['name']}: {record['dtype']}{shape_text(record['shape'])}"
    if kind == "none":
        return f"{record['name']}: None"
    if record["value"] is not None:
        return f"{record['name']}: {kind} = {record['value']!r}"
    return f"{record['name']}: {kind}" + (f" in {range_text(record)}" if "min" in record else "")


def range_text(dim: dict[str, Any]) -> str:
    return f"[{dim['min']}, {'∞' if dim['max'] is None else dim['max']}]"


def shape_text(shape: Sequence[Any]) -> str:
    """``[4, s0 in [1, 64], *]``: a symbol with its range, a star for an unchecked expression."""
    parts = []
    for d in shape:
        if isinstance(d, dict):
            parts.append(f"{d['symbol']} in {range_text(d)}")
        else:
            parts.append("*" if d is None else str(d))
    return "[" + ", ".join(parts) + "]"
