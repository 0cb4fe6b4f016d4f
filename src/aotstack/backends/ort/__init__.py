"""ONNX Runtime backend: partitions exported to ONNX, run in an InferenceSession."""

from .backend import OrtBackend
from .partitioner import OrtPartitioner

__all__ = ["OrtBackend", "OrtPartitioner"]
