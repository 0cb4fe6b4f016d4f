"""AOTInductor backends: the shared base, its partitioner, and the CPU, CUDA and Metal backends."""

from .backend import AotiBackend
from .cpu import AotiCpuBackend, AotiCpuPartitioner
from .cuda import CudaBackend, CudaPartitioner
from .metal import MetalBackend, MetalPartitioner
from .partitioner import AotiPartitioner
from .passes import ReplaceViewCopyWithViewPass

__all__ = [
    "AotiBackend",
    "AotiCpuBackend",
    "AotiCpuPartitioner",
    "AotiPartitioner",
    "CudaBackend",
    "CudaPartitioner",
    "MetalBackend",
    "MetalPartitioner",
    "ReplaceViewCopyWithViewPass",
]
