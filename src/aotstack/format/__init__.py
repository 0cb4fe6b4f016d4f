"""The file format: the records of a lowered program and a package, the run plan, the manifest and the archive.

Nothing here imports the compiler, the runtime or any backend."""
