"""AOTInductor backends: the shared base, its partitioner, and the CPU backend."""

from .backend import AotiBackend
from .cpu import AotiCpuBackend, AotiCpuPartitioner
from .partitioner import AotiPartitioner

__all__ = ["AotiBackend", "AotiCpuBackend", "AotiCpuPartitioner", "AotiPartitioner"]
