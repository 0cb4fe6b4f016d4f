"""The compiler: export, partitioning, building each partition's program, splicing, device copies,
lowering, and writing the package."""
