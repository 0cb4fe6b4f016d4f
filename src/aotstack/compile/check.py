"""The numerical check: a lowered program's answers against eager PyTorch's, per output and per delegate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.export import ExportedProgram

from ..format.records import Delegate

if TYPE_CHECKING:
    from .export import Program


@dataclass(frozen=True)
class Check:
    """What ``lower(..., check=...)`` compares, and how far apart two answers may be.

    An element passes when ``|lowered - eager| <= atol + rtol * |eager|``. With ``partition``,
    each delegate's outputs are also compared with the eager ops it replaced, run on the
    inputs the delegate got, so a wrong answer is traced to the delegate that produced it.
    """

    partition: bool = False
    atol: float = 1e-4
    rtol: float = 1e-4


def check_option(value: object) -> Check | None:
    """``lower``'s ``check`` argument as a Check: False/None -> None, True or "outputs" -> Check(), "partition"."""
    if value is None or value is False:
        return None
    if value is True or value == "outputs":
        return Check()
    if value == "partition":
        return Check(partition=True)
    if isinstance(value, Check):
        return value
    raise ValueError(f"check must be True, False, 'outputs', 'partition' or an aotstack.Check, got {value!r}")


@dataclass(frozen=True)
class Difference:
    """How far one lowered output is from eager: ``output`` names it (``output``, ``[0]``, ``['logits']``)."""

    method: str
    output: str
    max_abs: float
    max_rel: float
    passed: bool
    # The delegate whose output this is, in a partition check; None for a method output.
    delegate: str | None = None


@dataclass(frozen=True)
class CheckResult:
    check: Check
    outputs: list[Difference] = field(default_factory=list)
    delegates: list[Difference] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(d.passed for d in (*self.outputs, *self.delegates))

    def failure_message(self) -> str:
        """Which outputs (and, in a partition check, which delegates) are past the tolerance, and by how much."""
        raise NotImplementedError


def check_lowered(
    program: Program,
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    references: Mapping[str, Mapping[str, ExportedProgram]],
    check: Check,
) -> CheckResult:
    """Save the lowered ``methods`` to a temporary file, load it as a user would, and compare (see check_package)."""
    raise NotImplementedError


def check_package(
    program: Program, path: str, check: Check, references: Mapping[str, Mapping[str, ExportedProgram]]
) -> CheckResult:
    raise NotImplementedError
