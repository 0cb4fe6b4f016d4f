"""``AotiPartitioner``: claims what an AOTInductor backend can run, in maximal convex parts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from ...op_names import OpName, matches_any, normalized_op_name
from ...partitioner import SupportedOpsPartitioner
from ...specs import CompileSpec
from .backend import AotiBackend


class AotiPartitioner(SupportedOpsPartitioner):
    """Base of the AOTInductor partitioners; a subclass names its backend.

    ``exclude_ops`` lists ops to leave to plain ATen (or to the next partitioner), as
    ``"aten.relu"`` (every overload), ``"aten.relu.default"`` or the op object itself.
    ``min_block_size`` leaves parts with fewer compute nodes than that unclaimed.
    """

    backend: ClassVar[type[AotiBackend]]
    # AOTInductor compiles the branches and bodies of these into the same library.
    control_flow = frozenset({"cond", "while_loop"})

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "backend" in cls.__dict__:
            cls.backend_id = cls.backend.backend_id

    def __init__(
        self,
        exclude_ops: Iterable[OpName] = (),
        compile_specs: Iterable[CompileSpec] = (),
        *,
        min_block_size: int = 1,
    ) -> None:
        super().__init__(min_block_size=min_block_size, compile_specs=compile_specs)
        self.exclude_ops = frozenset(normalized_op_name(op, "exclude_ops") for op in exclude_ops)

    def default_target_device(self) -> str:
        return self.backend.device_name

    def supports_op(self, op: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> bool:
        return op.namespace in ("aten", "prims", "higher_order") and not matches_any(op, self.exclude_ops)
