"""ExecuTorch's XNNPACK delegate as an engine: partitioner (asks ExecuTorch's own, ``claims.py``), compile side (a
``.pte`` whose weights are kept outside it, ``compile.py``), run side (ExecuTorch's runtime, ``run.py``)."""
