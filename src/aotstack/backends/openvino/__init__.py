"""OpenVINO backend: partitioner, what its frontend converts (``frontend.py``), compile side (IR whose weights
are stored once), run side (a compiled model for the CPU plugin)."""
