"""The contract between the pipeline and an engine: a compile side and a run side.

A backend's run side (``BackendRuntime``: ``init`` then ``execute``) runs in the process that
loads a package; its compile side (``Backend``: ``preprocess``) runs once, ahead of time. A
built-in backend keeps the two in separate modules, and loading imports the module of a run side
only when a package names its backend, so a process that only loads imports no compiler. A
user's backend may be one ``Backend`` subclass that does both. Defining a subclass with a
``backend_id`` registers it (``register``; ``registry.py`` looks it up); import its module before
lowering or loading.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..format.boundary import ProvenInput
from ..format.custom_ops import is_custom_op_name
from ..format.specs import CompileSpec, PreprocessResult
from ..format.tensor_data import BytesLike

if TYPE_CHECKING:
    from torch.export import ExportedProgram


# Every backend class defined, by id and side; ``registry.py`` looks them up.
REGISTERED_BACKENDS: dict[str, type[Backend]] = {}
REGISTERED_RUNTIMES: dict[str, type[BackendRuntime]] = {}


def register_backend(backend_id: str, cls: type[Backend]) -> None:
    register(REGISTERED_BACKENDS, backend_id, cls)


def register_runtime(backend_id: str, cls: type[BackendRuntime]) -> None:
    register(REGISTERED_RUNTIMES, backend_id, cls)


def register(table: dict[str, type], backend_id: str, cls: type) -> None:
    existing = table.get(backend_id)
    # Re-running the same definition (a reloaded module, a notebook cell) replaces it; a second,
    # different class claiming the id is a mistake worth stopping.
    if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(
            f"backend id {backend_id!r} is already registered by {existing.__module__}.{existing.__qualname__}"
        )
    table[backend_id] = cls


class BackendRuntime:
    """The run side of a backend: what ``aotstack.load`` calls for each of its delegates."""

    backend_id: ClassVar[str]
    # Whether ``execute`` on a device only launches work on the device's current stream, with no
    # wait for the host and no allocation it cannot repeat, so a CUDA graph can capture and replay
    # it (``runtime/graphs.py``). An engine that runs on the host, or syncs, leaves it False.
    captures_in_graph: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend_id = cls.__dict__.get("backend_id")
        if backend_id is None:
            return
        if not isinstance(backend_id, str) or not backend_id:
            raise TypeError(f"{cls.__qualname__}.backend_id must be a non-empty str")
        if issubclass(cls, Backend):
            register_backend(backend_id, cls)
        # A compile side that inherits the base's run side leaves running to its runtime class.
        if cls.init is not BackendRuntime.init:
            register_runtime(backend_id, cls)

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> Any:
        """Turn what ``preprocess`` produced into a handle that ``execute`` can run.

        ``named_data`` holds read-only views into the loaded file, verified against their hashes;
        ``bytes(view)`` copies one where an engine needs ``bytes``.
        """
        raise NotImplementedError

    def execute(self, handle: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run one delegate call."""
        raise NotImplementedError

    def init_keeping_state(
        self,
        processed_bytes: bytes,
        named_data: Mapping[str, BytesLike],
        compile_specs: list[CompileSpec],
        keepable: frozenset[str],
    ) -> tuple[Any, frozenset[str]]:
        """``init``, told which buffers the delegate may keep inside its engine; the handle, and the buffers it keeps.

        ``keepable`` names (by FQN) the buffers the delegate updates that nothing else in its
        method reads or updates: no other delegate, no step of the plan. An engine that holds
        state of its own (OpenVINO's state variables) may keep such a buffer there rather than
        read and write its shared memory each call; the buffer's value then never crosses the
        delegate's boundary. Loading hands a kept buffer's value over through its shared memory
        only when another method needs it, or after ``reset()``: ``store_state`` before anything
        else reads that memory, ``load_state`` before the delegate's next call after it changed.
        The default keeps nothing: ``init``, with every buffer updated in place.
        """
        return self.init(processed_bytes, named_data, compile_specs), frozenset()

    def trust_inputs(self, handle: Any, proven: Mapping[int, ProvenInput]) -> None:
        """Told, once, after the method's first call, what the loaded plan guarantees some inputs are at every call.

        ``proven`` maps an input's index to its dtype, device type and static sizes, where the
        plan knows them without looking: the output of a compiled part on the host, a weight, or
        an argument the method's own check has read. An engine that checks its inputs at each
        call (``format/boundary.py``) may leave those out: ``BoundaryCheck.trusting``. Where
        ``ProvenInput.strides`` is set, the input is also a plain tensor laid out so at every
        call, and an engine need not test whether to copy it into the layout it reads. The
        default checks and lays out everything, as before.
        """

    def load_state(self, handle: Any, buffers: Collection[str]) -> None:
        """Set each of ``buffers`` (kept by ``handle``) inside the engine from its shared memory.

        Loading calls it before the delegate's first call, and again after another method or
        ``reset()`` wrote that memory; never while a call of the delegate runs.
        """

    def store_state(self, handle: Any, buffers: Collection[str]) -> None:
        """Write the value of each of ``buffers`` that ``handle`` keeps inside the engine into its shared memory.

        Loading calls it before another method reads or updates the buffer there.
        """

    def released_named_data(self, handle: Any, named_data: Collection[str], called: bool) -> Collection[str]:
        """Of ``named_data`` (the names ``init`` was given), those the engine no longer reads where the file holds them.

        Loading asks once after ``init`` (``called=False``) and once after the delegate's first
        call (``called=True``), and each time drops from memory the file's pages that hold only
        the data named then and data nothing else reads (``format/archive.MappedPages``): name
        what the engine copied or packed into memory of its own by then. A dropped page that is
        read after all is read back from the file, so a name given too eagerly costs a page
        fault, never a wrong result. The default names nothing: an engine that reads its
        weights in place keeps the file's pages (AOTInductor on the CPU does, but for the
        embedding tables it gathers a few rows of, which it names after the first call).
        """
        return ()


class Backend(BackendRuntime):
    """Base of every backend's compile side; a subclass may be its own run side too.

    Example::

        class Doubler(aotstack.Backend):
            backend_id = "doubler"

            def preprocess(self, exported_program, compile_specs):
                return aotstack.PreprocessResult(b"")

            def init(self, processed_bytes, named_data, compile_specs):
                return None

            def execute(self, handle, inputs):
                return [inputs[0] * 2]
    """

    # The packages whose versions, with a partition's program and compile specs, key a cache of
    # ``preprocess``'s results that lowering keeps for this backend (``compile/cache.py``), so an
    # unchanged partition is not compiled twice; None: no such cache (or the backend keeps its own).
    cached_by_packages: ClassVar[tuple[str, ...] | None] = None
    # Compile specs that only the run side reads (a session's thread count): that cache's key leaves them out, so a
    # plan differing from a compiled one only in them compiles nothing again.
    run_side_specs: ClassVar[tuple[str, ...]] = ()
    # Raised when ``preprocess`` writes something else for the same partition for a reason its source does not show
    # (a change to its own source already keys its results apart: ``engine.source.code_version``): results kept
    # under an earlier revision, and auto's measurements of them, are not read.
    compile_revision: ClassVar[int] = 1
    # True where partitions of the same structure (the same ops on the same shapes, other weights,
    # other names: a model's repeated layers) compile to code that ``cached_preprocess`` answers
    # for each once one has compiled. Lowering then compiles one of them, not all at once.
    shares_code_across_weights: ClassVar[bool] = False
    # True where ``warm_up`` keeps its work in a cache on disk (AOTInductor's probe of the CPU):
    # lowering then first runs it in a forked child, beside its other work, and this process's
    # own warm-up reads what the child left.
    warm_up_fills_disk_cache: ClassVar[bool] = False
    # True where the engine's own compile happens when a file is opened (``init``), ``preprocess``
    # only converting: lowering then opens each part once in a forked child, as loading will, so
    # that an engine crashing or failing there fails the partition while lowering (and falls back
    # with ``on_compile_error="fallback"``) rather than ending the process that loads the file.
    compiles_when_opened: ClassVar[bool] = False
    # About how long one partition takes to compile, in seconds, until one has here. With more parts queued than
    # workers, lowering starts the part expected to take longest first, so that a slow compile queued last does not
    # run alone at the end while the other workers wait.
    expected_compile_seconds: ClassVar[float] = 1.0

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        """Compile one partition ahead of time."""
        raise NotImplementedError

    def check_specs(self, compile_specs: list[CompileSpec]) -> None:
        """Raise ``CompileSpecError`` for a spec this backend cannot take (the default takes any).

        ``lower`` asks before it reads a compile cache, whose key leaves ``run_side_specs`` out: a
        bad one is then refused even where the partition's compile is cached.
        """

    def cached_preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult | None:
        """What ``preprocess`` would return, if the backend kept it from an earlier compile; never compiles.

        ``lower`` asks before it starts compile workers, so a partition compiled before costs
        no process; None (the default) means "compile it".
        """
        return None

    def warm_up(self) -> None:
        """Do, once, the work every compile in a fresh process repeats (imports, probes of this machine).

        ``lower`` calls it once in its own process before it forks compile workers, which
        inherit the result instead of each paying for it. The default does nothing.
        """

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        """The custom ops (``ns.op.overload``) of ``claimed`` that the compiled partition calls back through torch.

        A process loading the package must register these first. The default assumes every
        claimed custom op is called; an engine that translates ops into its own returns none, and
        one whose compiled code lists its calls returns exactly those.
        """
        return [name for name in claimed if is_custom_op_name(name)]

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        """Whether a partition may own ``buffer``, which it updates, changing it in place at run time.

        Such a buffer is stored as the partition's named data ``weight:<fqn>``
        (``tensor_data.weights_as_named_data``); at load, ``init`` gets the buffer's one shared
        state in its place, which it must update without copying: a writable memoryview on the
        host, or, for a delegate on a device, a one-dimensional uint8 tensor on that device
        (``tensor_data.tensor_from_bytes`` views either as the buffer). A buffer lives on a
        device only where delegates on that device alone use it (``format/state.py``).
        """
        return False
