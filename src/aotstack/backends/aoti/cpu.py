"""The AOTInductor CPU backend: partitions compiled to a shared library run in this process."""

from __future__ import annotations

from typing import Any, ClassVar

from ...format.specs import CompileSpec, SpecKey, count_spec
from .backend import AotiBackend
from .compile import ProgramPass
from .few_queries import FewQueriesAttentionPass
from .few_rows import FewRowsProductAsReductionPass, IntMmRowMajorPass
from .filled_keys import FilledKeysAttentionPass
from .packed_weights import with_packed_weights
from .partitioner import AotiPartitioner
from .passes import GraphPass


class AotiCpuBackend(AotiBackend):
    backend_id = "aoti_cpu"
    device_name = "cpu"
    # 2: int4 weights stored two a byte; 3: embedding tables named for release ("gathered"); 4: int4 and
    # int8 weights packed into float32-typed words (packed_weights.py); 6: grouped expert matmuls compiled (experts.py);
    # 7: float linears of few rows as reductions (few_rows.py); 8: attention over a cache's filled keys
    # (filled_keys.py); 9-11: attention of few query rows as a reduction and a product (few_queries.py).
    compile_revision = 11

    def inductor_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        threads = count_spec(compile_specs, SpecKey.THREADS)
        return {} if threads is None else {"cpp.threads": threads}

    def program_passes(self) -> list[ProgramPass]:
        return [with_packed_weights]

    def custom_passes(self) -> list[GraphPass]:
        # The keys are cut before the attention is rewritten, when it no longer reads as an attention.
        return [FewRowsProductAsReductionPass(), IntMmRowMajorPass(), FilledKeysAttentionPass(),
                FewQueriesAttentionPass()]


class AotiCpuPartitioner(AotiPartitioner):
    """Claims every ATen op AOTInductor can compile for the CPU, except ``exclude_ops``.

    The package runs under libtorch, which has every fallback kernel; for a runtime without
    Python, list the kernels it has in the ``fallback_kernels`` compile spec.

    Example::

        lowered = aotstack.lower(program, [AotiCpuPartitioner(exclude_ops=["aten.relu"])])
    """

    backend: ClassVar[type[AotiBackend]] = AotiCpuBackend
    # The plan runs plain ATen on the host between delegates already; on a GPU, unmeasured.
    lone_ops_to_aten: ClassVar[bool] = True
