"""The AOTInductor CPU backend: partitions compiled to a shared library run in this process."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import Partition

from ...compile.partitioner import MIN_ISLAND_WORK, island_work
from ...compile.work import largest_sizes
from ...format.ops import is_delegate_call, is_delegate_output
from ...format.specs import CompileSpec, DelegationSpec, SpecKey, count_spec
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

    def part_delegation_spec(self, partition: Partition, exported_program: ExportedProgram) -> DelegationSpec:
        """A light part between other engines' delegates compiles for one thread (``light_between_delegates``),
        unless the partitioner names a thread count itself.

        Its OpenMP loops gain nothing from a second thread, while that thread, spinning as it waits for the next
        loop, holds the core the next engine's own pool needs: ONNX Runtime's parts of a 4-layer Qwen3 prefill with
        AOTInductor updating the KV cache between them took 7.7 ms a call at 2 threads, 2.4 ms with those updates
        on one thread (2.0 ms of it in ONNX Runtime's delegates).
        """
        spec = super().part_delegation_spec(partition, exported_program)
        if (torch.get_num_threads() < 2 or count_spec(spec.compile_specs, SpecKey.THREADS) is not None
                or not light_between_delegates(partition, exported_program)):
            return spec
        return DelegationSpec(spec.backend_id, [*spec.compile_specs, CompileSpec(SpecKey.THREADS, b"1")])


def light_between_delegates(partition: Partition, exported_program: ExportedProgram) -> bool:
    """Whether ``partition`` reads or feeds another engine's delegate and does less than ``MIN_ISLAND_WORK`` even at
    the largest sizes the program allows (``island_work``): a KV cache's update between two engines' layers."""
    nodes = partition.nodes
    beside = {other for node in nodes for other in (*node.all_input_nodes, *node.users) if other not in nodes}
    if not any(is_delegate_call(node) or is_delegate_output(node) for node in beside):
        return False
    work = island_work(nodes, largest_sizes(exported_program))
    return work is not None and work < MIN_ISLAND_WORK
