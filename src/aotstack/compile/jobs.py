"""A compile job and its outcome: what lowering hands the compile workers, and what the progress display shows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from torch.export import ExportedProgram

from ..engine.interface import Backend
from ..format.specs import CompileSpec, PreprocessResult, SpecKey
from .program_parts import program_fingerprint, program_structure


@dataclass(eq=False)
class CompileJob:
    """One partition to compile: its program, the backend that compiles it and where it came from."""

    method: str
    # The partitioner's tag, e.g. ``aoti_cpu_0``.
    tag: str
    backend: Backend
    program: ExportedProgram
    compile_specs: list[CompileSpec]
    # Call nodes in the partition, for the display.
    nodes: int
    # The plan whose lowering claimed it, where several lower together (``xnnpack > aoti_cpu``); else empty.
    plan: str = ""

    @property
    def title(self) -> str:
        """Where the part comes from, for messages: ``forward``, or ``forward (xnnpack > aoti_cpu)`` under a plan."""
        return f"{self.method} ({self.plan})" if self.plan else self.method

    @property
    def backend_id(self) -> str:
        return self.backend.backend_id

    def identity(self) -> str:
        """A hash of what the compile depends on; two jobs with the same one compile to the same result.

        The ``method_name`` spec is left out: it names the method in messages only, so a
        partition two methods share (the same program, weights and options) compiles once.
        """
        return self.keyed(program_fingerprint(self.program))

    def structure(self) -> str:
        """Like :meth:`identity`, with the program's names and most weights' values left out (``program_structure``).

        Jobs sharing it compile to one code where their backend shares code across weights.
        """
        return self.keyed(program_structure(self.program).digest)

    def keyed(self, program_hash: str) -> str:
        """``program_hash`` with the backend and the compile specs but ``method_name``, hashed."""
        digest = hashlib.sha256(self.backend_id.encode())
        for spec in self.compile_specs:
            if spec.key != SpecKey.METHOD_NAME:
                digest.update(spec.key.encode() + b"\0" + spec.value + b"\0")
        digest.update(program_hash.encode())
        return digest.hexdigest()


@dataclass(eq=False)
class CompileOutcome:
    """How one job ended: a result, an error, or cancelled (another job failed first)."""

    job: CompileJob
    result: PreprocessResult | None = None
    error: Exception | None = None
    seconds: float = 0.0
    # The worker process's id; None where the job compiled in this process or did not compile.
    worker: int | None = None
    # The identical job whose result this one shares; None where it compiled itself.
    same_as: CompileJob | None = None

    @property
    def from_cache(self) -> bool:
        return self.result is not None and self.result.from_cache

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.result is None:
            return "cancelled"
        return "cached" if self.from_cache or self.same_as is not None else "compiled"
