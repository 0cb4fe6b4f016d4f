"""AOTInductor backends: the shared compile side (``backend.py``), its partitioner, its run side
(``run.py``), the fallback-kernel probe, graph passes, and the CPU, CUDA and Metal backends."""
