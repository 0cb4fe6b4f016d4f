"""One folder per backend: its partitioner, its compile side and its run side together."""
