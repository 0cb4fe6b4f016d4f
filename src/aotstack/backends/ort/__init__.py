"""ONNX Runtime backend: partitioner, compile side (ONNX export), run side (an InferenceSession)."""
