"""A bound on the sympy work Inductor's CPU code generation spends on one index.

To choose how to vectorize a loop, Inductor finds each index's stride within a vector, simplifying the index with
``sympy.simplify`` (``simplify_index_in_vec_range`` and ``stride_at``). Over a symbolic size that a model's views fold
and unfold (a conformer's relative shift, over any number of frames) such an index runs to a thousand operations or
two, and one simplification to most of a minute: a Parakeet encoder of one layer took 268 s to compile, 250 of them
in sympy. An index larger than ``SIMPLIFIED_INDEX_OPS`` is left as it stands; its stride is then worked out from it
unsimplified or taken as unknown, and the loop vectorized accordingly. On that encoder: 48 s, and the library as fast
at 60 to 3,000 frames (its outputs equal).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

# Indices of models with static sizes, and of LLMs over a symbolic sequence, stay far below this: their
# simplifications are kept as they were.
SIMPLIFIED_INDEX_OPS = 256
# Where each torch keeps its stride analysis: torch 2.13 in sizevars, torch 2.11 in the CPU code generator.
STRIDE_ANALYSIS_MODULES = ("torch._inductor.sizevars", "torch._inductor.codegen.cpp")


class BoundedSympy:
    """``sympy`` as the stride analysis reaches it, whose ``simplify`` leaves a large expression as it stands."""

    def __init__(self, sympy: ModuleType) -> None:
        self.sympy = sympy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sympy, name)

    def simplify(self, expr: Any, *args: Any, **kwargs: Any) -> Any:
        if self.sympy.count_ops(expr) > SIMPLIFIED_INDEX_OPS:
            return expr
        return self.sympy.simplify(expr, *args, **kwargs)


def stride_analysis_module() -> ModuleType | None:
    """The Inductor module that defines ``simplify_index_in_vec_range``; None in a torch that has none."""
    for name in STRIDE_ANALYSIS_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "simplify_index_in_vec_range") and isinstance(getattr(module, "sympy", None), ModuleType):
            return module
    return None


@contextlib.contextmanager
def bounded_index_simplification() -> Iterator[None]:
    """Inductor's stride analysis, within the block, bounded by ``SIMPLIFIED_INDEX_OPS`` (see the module's
    docstring). A block inside another, or beside one in another thread, leaves the bound to the first."""
    module = stride_analysis_module()
    if module is None:
        yield
        return
    real = module.sympy
    module.sympy = BoundedSympy(real)
    try:
        yield
    finally:
        module.sympy = real
