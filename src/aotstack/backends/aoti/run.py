"""The AOTInductor run side: open a verified library, hand it its weights, run it.

The generated code trusts its inputs' sizes, strides and devices, so every call is checked
against the boundary the compile side recorded (``format/boundary.py``) and every input is put in
the layout the code indexes with before the library sees its pointer.

A CPU library compiled for a thread count (``SpecKey.THREADS``) runs on that many threads, the
ATen calls inside it as well as its generated loops: torch's count is set to it for the call.
The ATen calls matter where another engine's threads share the cores. A decoder's attention
between XNNPACK's parts, compiled for one thread, still multiplied its values with MKL's batched
product on torch's two threads; GNU OpenMP's idle thread then spun through XNNPACK's next part,
on the core XNNPACK's own second thread needed (99.5 M Llama, ``8da4w``, 2 threads: 285 to 486
tokens/s from one 64-token run to the next, 410 to 475 with the call on one thread).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...engine.interface import BackendRuntime
from ...engine.processor import missing_features
from ...errors import CompileSpecError, CustomOpError, DelegateInitError, PackageError
from ...forking import pause_openmp, remove_at_exit
from ...format import processed as processed_json
from ...format.boundary import BoundaryCheck, ProvenInput
from ...format.custom_ops import registered_op
from ...format.devices import HOST, Device, DeviceType
from ...format.seal import is_hex
from ...format.specs import CompileSpec, SpecKey, compile_spec_value, count_spec, partition_label
from ...format.tensor_data import WEIGHT_PREFIX, BytesLike, NamedDataValue

# The named data holding a partition's shared library.
LIBRARY_NAME = "model.so"
# The named data listing the ops the library calls through AOTInductor's proxy executor (custom
# ops), the JSON the executor reads from beside the library; absent where it calls none.
EXTERN_NODES_NAME = "extern_nodes.json"
# The processed JSON this side writes; version 2 added the boundary, 3 the proxy executor's calls
# (a reader of 2 would open such a library without them), 4 the library's own names for weights
# (``library_fqns``; a reader of 3 would not find them), 5 a library holding its weights (``weights_in_library``;
# a reader of 4 would ask the package for them). Older files are refused by name.
PROCESSED_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)


class AotiRuntime(BackendRuntime):
    """The run side every AOTInductor backend shares; each device type registers its own."""

    device_name: ClassVar[str]
    # The generated code launches its kernels on the current stream, into memory it is given or
    # gets from torch's allocator, which a capture gives from the graph's own pool.
    captures_in_graph = True

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, NamedDataValue], compile_specs: list[CompileSpec]
    ) -> AotiHandle:
        label = partition_label(self.backend_id, compile_specs)
        device = target_device(compile_specs, self.backend_id, self.device_name)
        processed = processed_json.read_processed(processed_bytes, label, READABLE_VERSIONS)
        boundary = processed_json.boundary(processed, label)
        strides = input_strides(processed, [item.sizes for item in boundary.inputs], label)
        key = processed_json.field(processed, "library", str, label)
        if not is_hex(key, 64):
            # It names the library's file on disk, and which opened library delegates share.
            raise PackageError(f"{label}: processed field 'library' must be a SHA-256 in hex, got {key[:80]!r}")
        weights = processed_json.weights(processed, named_data, label)
        renamed = library_fqns(processed, weights, label)
        gathered = gathered_names(processed, weights, label)
        if LIBRARY_NAME not in named_data:
            raise PackageError(f"{label}: the package holds no named data {LIBRARY_NAME!r}")
        check_cpu_features(processed, label)
        extern_nodes = named_data.get(EXTERN_NODES_NAME)
        if extern_nodes is not None:
            check_proxy_calls(bytes(extern_nodes), label)
        runner = open_runner(named_data[LIBRARY_NAME], key, device, label, extern_nodes)
        if device != HOST:
            weights = {fqn: tensor.to(str(device)) for fqn, tensor in weights.items()}
        if weights_in_library(processed, label):
            # Frozen: the library loaded its own weights when it opened.
            bound, in_place = {}, set()
        else:
            bound = bind_constants(runner, weights, label, renamed)
            # On the host the runner reads the weights it asks for where they are: the file's pages.
            in_place = {
                WEIGHT_PREFIX + renamed.get(fqn, fqn) for fqn in runner.get_constant_names_to_original_fqns().values()
            }
            in_place = in_place if device == HOST else set()
        handle = AotiHandle(
            runner=runner, input_strides=strides, constants=bound, check=boundary.checker(label), label=label,
            unsettled=list(range(len(strides))), reads_in_place=frozenset(in_place), gathered=gathered & in_place,
            threads=count_spec(compile_specs, SpecKey.THREADS) if device == HOST else None,
        )
        if device != HOST:
            # The device's context does not survive os.fork; in a child, calls say so (see after_fork).
            DEVICE_HANDLES.add(handle)
        return handle

    def execute(self, handle: AotiHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)

    def trust_inputs(self, handle: AotiHandle, proven: Mapping[int, ProvenInput]) -> None:
        if handle.check is not None:
            handle.check = handle.check.trusting(proven)
        handle.unsettled = [
            index for index in handle.unsettled
            if not (index in proven and laid_out_as_compiled(proven[index], handle.input_strides[index]))
        ]

    def released_named_data(self, handle: AotiHandle, named_data: Collection[str], called: bool) -> Collection[str]:
        # The library and its extern nodes were copied into a file at init, a device's weights
        # onto the device, and a weight the runner does not ask for was folded into the code.
        if called:
            # An embedding's table: a call reads a few of its rows, which fault back in when read.
            return sorted(handle.gathered)
        return [name for name in named_data if name not in handle.reads_in_place]


class AotiCpuRuntime(AotiRuntime):
    backend_id = "aoti_cpu"
    device_name = "cpu"


class CudaRuntime(AotiRuntime):
    backend_id = "aoti_cuda"
    device_name = "cuda"


class MetalRuntime(AotiRuntime):
    backend_id = "aoti_metal"
    device_name = "mps"


def target_device(compile_specs: list[CompileSpec], backend_id: str, device_name: str) -> Device:
    """The device the ``target_device`` spec names, the backend's own type where it names none."""
    value = compile_spec_value(compile_specs, SpecKey.TARGET_DEVICE)
    if value is None:
        return Device(DeviceType(device_name))
    try:
        device = Device.parse(value.decode())
    except ValueError as exc:
        raise CompileSpecError(f"compile spec 'target_device': {exc}") from None
    if device.type.value != device_name:
        raise CompileSpecError(
            f"compile spec 'target_device' is {value.decode()!r}, but {backend_id} compiles for {device_name} devices"
        )
    return device


@dataclass(eq=False)
class AotiHandle:
    """A loaded AOTInductor model, the input strides it was compiled for, and its inputs' check."""

    # torch's AOTIModelContainerRunner for the delegate's device.
    runner: Any
    # None where a dimension is dynamic: then the compiled code expects a contiguous tensor.
    input_strides: list[tuple[int, ...] | None]
    # The runner reads user-managed weights in place; they must live as long as it does.
    constants: dict[str, torch.Tensor]
    # Every call's inputs against what the library was compiled for (format/boundary.py); None where the plan
    # proves them all (trust_inputs).
    check: BoundaryCheck | None
    label: str
    # The inputs a call lays out as the code indexes them: every one, until the plan vouches for some (trust_inputs).
    unsettled: list[int]
    # The named data the runner reads where the file holds it: its weights, on the host.
    reads_in_place: frozenset[str] = frozenset()
    # Of those, the ones it reads a few rows of a call (embedding tables).
    gathered: frozenset[str] = frozenset()
    # The thread count a CPU library was compiled for (the threads spec), which its ATen calls follow too.
    threads: int | None = None


def check_cpu_features(processed: Mapping[str, Any], label: str) -> None:
    """Refuse a library compiled for CPU features this machine lacks (absent from files written before: none)."""
    needed = processed_json.string_list(processed, "cpu_features", label) if "cpu_features" in processed else []
    missing = missing_features(needed)
    if missing:
        raise DelegateInitError(
            f"{label}: its library was compiled for CPU instructions this machine lacks ({', '.join(missing)}), and "
            "would crash the process; compile the model on a machine like this one, or for an older CPU "
            "(with torch 2.13 or newer: TORCHINDUCTOR_CPP_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 while compiling)"
        )


def weights_in_library(processed: Mapping[str, Any], label: str) -> bool:
    """Whether the library holds its weights (absent from files written before version 5: it does not)."""
    if "weights_in_library" not in processed:
        return False
    return processed_json.field(processed, "weights_in_library", bool, label)


def gathered_names(processed: Mapping[str, Any], weights: Mapping[str, torch.Tensor], label: str) -> frozenset[str]:
    """The named data of the processed ``gathered`` weights (absent from files written before it: none)."""
    if "gathered" not in processed:
        return frozenset()
    fqns = processed_json.string_list(processed, "gathered", label)
    unknown = [fqn for fqn in fqns if fqn not in weights]
    if unknown:
        raise PackageError(f"{label}: processed field 'gathered' names {unknown[0]!r}, which is not one of its weights")
    return frozenset(WEIGHT_PREFIX + fqn for fqn in fqns)


def input_strides(
    processed: Mapping[str, Any], shapes: list[list[int | str]], label: str
) -> list[tuple[int, ...] | None]:
    """The processed ``input_strides``: one per input, None or one int per dimension.

    A stride is the layout each input is copied into before the library reads it, so it must
    not overlap: a copy smaller than the compiled code's reads would be read past its end.
    """
    strides = processed_json.field(processed, "input_strides", list, label)
    if len(strides) != len(shapes):
        raise PackageError(f"{label}: processed input_strides lists {len(strides)} inputs, its boundary {len(shapes)}")
    for index, (stride, sizes) in enumerate(zip(strides, shapes)):
        if stride is not None and not (
            isinstance(stride, list)
            and len(stride) == len(sizes)
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stride)
            and non_overlapping(stride, sizes)
        ):
            raise PackageError(
                f"{label}: processed input_strides[{index}] must be null or a layout of sizes {sizes}, got {stride!r}"
            )
    return [None if stride is None else tuple(stride) for stride in strides]


def non_overlapping(stride: list[int], sizes: list[int | str]) -> bool:
    """Whether no two elements of a tensor of ``sizes`` laid out with ``stride`` share memory.

    Innermost first, each dimension's stride must reach past the dimensions inside it; a dynamic
    size can only be the outermost, as a static stride cannot step over it.
    """
    reach: int | None = 1
    for step, size in sorted(zip(stride, sizes), key=lambda pair: pair[0]):
        if size == 1 or size == 0:
            continue
        if reach is None or step < reach:
            return False
        reach = step * size if isinstance(size, int) else None
    return True


def check_proxy_calls(extern_nodes: bytes, label: str) -> None:
    """Refuse, before the library opens, one that calls an op this process has not registered.

    The proxy executor looks each op up by name when the library is opened and calls it from
    then on; an op it cannot find would fail there, without the op's name.
    """
    missing = [name for name in proxy_calls(extern_nodes, label) if registered_op(name) is None]
    if missing:
        raise CustomOpError(
            f"{label} calls {', '.join(missing)}, which this process has not registered; import the module that "
            "defines them before loading",
            missing,
        )


def proxy_calls(extern_nodes: bytes, label: str) -> list[str]:
    """The ops (``ns.op.overload``) a library calls through the proxy executor, from its list of calls."""
    try:
        nodes = json.loads(extern_nodes).get("nodes")
        targets = [entry["node"]["target"] for entry in nodes]
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
        raise PackageError(f"{label}: its {EXTERN_NODES_NAME} is not the proxy executor's list of calls") from None
    return sorted({dotted(target) for target in targets if isinstance(target, str) and "::" in target})


def dotted(target: str) -> str:
    """``ns.op.overload`` for the ``ns::op`` or ``ns::op.overload`` a proxy call names."""
    namespace, _, rest = target.partition("::")
    op, _, overload = rest.partition(".")
    return f"{namespace}.{op}.{overload or 'default'}"


def open_runner(
    library: BytesLike, key: str, device: Device, label: str, extern_nodes: BytesLike | None = None
) -> Any:
    """A runner over ``library`` (already verified, ``key`` its SHA-256) on ``device``, with its own weights slot.

    ``extern_nodes`` is written beside the library, where AOTInductor's runner looks for the
    proxy executor's calls.
    """
    open_on_device = runner_factory(device, label)
    try:
        return open_on_device(library_path(library, key, extern_nodes))
    except RuntimeError as exc:
        raise PackageError(f"cannot open the AOTInductor library of {label}: {exc}") from exc


def runner_factory(device: Device, label: str) -> Callable[[str], Any]:
    """How to open a library for ``device``; ``DelegateInitError`` where this machine cannot run it."""
    if not device_available(device):
        raise DelegateInitError(f"{label} runs on {device}, which this machine lacks ({visible_devices()})")
    runners = torch._C._aoti
    if device.type is DeviceType.CPU:
        return lambda path: runners.AOTIModelContainerRunnerCpu(path, 1)
    if device.type is DeviceType.CUDA:
        return lambda path: runners.AOTIModelContainerRunnerCuda(path, 1, str(device))
    return lambda path: runners.AOTIModelContainerRunnerMps(path, 1)


def device_available(device: Device) -> bool:
    """Whether this machine, and this build of torch, has ``device``."""
    if device.type is DeviceType.CUDA:
        return torch.cuda.is_available() and device.index < torch.cuda.device_count()
    if device.type is DeviceType.MPS:
        return torch.backends.mps.is_available() and device.index == 0
    return True


def visible_devices() -> str:
    return f"CUDA devices: {torch.cuda.device_count()}, MPS: {'yes' if torch.backends.mps.is_available() else 'no'}"


_LIBRARY_PATHS: dict[str, str] = {}
# The sealed copies' descriptors, open for the process's life: their paths name them.
_SEALED_LIBRARIES: list[int] = []


def library_path(library: BytesLike, key: str, extern_nodes: BytesLike | None = None) -> str:
    """A path the dynamic loader opens ``library`` from, made once per process for each distinct library.

    Delegates compiled to the same code share it, so the dynamic loader opens it once; each
    runner still keeps its own weights. ``key`` is the library's hash, recorded when it was
    compiled, so loading does not hash it a second time.

    The library goes into sealed anonymous memory (``sealed_library``): no file is left behind by a
    process that ends without running its exit hooks (a SIGTERM, a SIGKILL, a crash), and nothing
    can change the verified bytes before the loader reads them. Where the runner needs a file beside
    the library (``extern_nodes``, named as it looks for the proxy executor's calls) or the system
    has no sealed memory (macOS), it goes into a private directory removed at exit.
    """
    if key not in _LIBRARY_PATHS:
        sealed = sealed_library(library, key) if extern_nodes is None else None
        _LIBRARY_PATHS[key] = sealed or written_library(library, key, extern_nodes)
    return _LIBRARY_PATHS[key]


def sealed_library(library: BytesLike, key: str) -> str | None:
    """``library`` in a sealed memory file, as ``/proc/self/fd/N``; None where the system cannot make one."""
    import fcntl

    if not (hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")):
        return None
    try:
        fd = os.memfd_create(f"aotstack-{key[:16]}.so", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        with memoryview(library).cast("B") as remaining:
            while remaining:
                remaining = remaining[os.write(fd, remaining):]
        sealed = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sealed)
    except OSError:
        os.close(fd)
        return None
    _SEALED_LIBRARIES.append(fd)
    return f"/proc/self/fd/{fd}"


def written_library(library: BytesLike, key: str, extern_nodes: BytesLike | None) -> str:
    """``library`` written to a private file, ``extern_nodes`` beside it as the runner looks for them."""
    directory = private_directory()
    fd, path = tempfile.mkstemp(prefix=key[:16] + "-", suffix=".so", dir=directory)
    with os.fdopen(fd, "wb") as file:
        file.write(library)
    if extern_nodes is not None:
        with open(path.removesuffix(".so") + ".json", "xb") as file:
            file.write(extern_nodes)
    return path


@functools.cache
def private_directory() -> str:
    directory = tempfile.mkdtemp(prefix="aotstack-libraries-")
    remove_at_exit(directory)
    return directory


def library_fqns(processed: Mapping[str, Any], weights: Mapping[str, torch.Tensor], label: str) -> dict[str, str]:
    """The library's name -> the delegate's FQN, for each weight the library asks for by another name."""
    renamed = processed.get("library_fqns", {})
    if not isinstance(renamed, dict) or not all(
        isinstance(theirs, str) and isinstance(ours, str) and ours in weights for theirs, ours in renamed.items()
    ):
        raise PackageError(f"{label}: processed field 'library_fqns' must map names to the delegate's weights")
    return renamed


def bind_constants(
    runner: Any,
    constants_by_fqn: dict[str, torch.Tensor],
    label: str,
    renamed: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """Give the runner every weight it asks for (``renamed``: by the delegate's FQN); name the first one missing."""
    bound = {}
    for name, asked in runner.get_constant_names_to_original_fqns().items():
        fqn = renamed.get(asked, asked)
        if fqn not in constants_by_fqn:
            raise PackageError(f"{label}: the library asks for weight {fqn!r}, which the package lacks")
        bound[name] = constants_by_fqn[fqn]
    if bound:
        runner.update_constant_buffer(bound, False, True, True)
    return bound


def run(handle: AotiHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Check the inputs against the boundary, lay each out as the code indexes it, run the library."""
    if handle.check is not None:
        handle.check(inputs)
    strides = handle.input_strides
    for index in handle.unsettled:
        tensor = inputs[index]
        # The code reads memory, not the view: a negated view would be read unnegated.
        if tensor.is_neg() or tensor.is_conj():
            tensor = inputs[index] = tensor.resolve_neg().resolve_conj()
        expected = strides[index]
        if expected is None:
            # Overlapping memory (an expand's stride 0) is not contiguous either, so it is copied too.
            if not tensor.is_contiguous():
                inputs[index] = tensor.contiguous()
        elif tensor.stride() != expected:
            inputs[index] = restrided(tensor, expected)
    threads = handle.threads
    if threads is None or threads == torch.get_num_threads():
        return handle.runner.run(inputs)
    return run_on_threads(handle.runner, inputs, threads)


def laid_out_as_compiled(proven: ProvenInput, strides: tuple[int, ...] | None) -> bool:
    """Whether an input the plan vouches for is always laid out as the code indexes it (None: contiguously)."""
    return proven.contiguous if strides is None else proven.strides == strides


def run_on_threads(runner: Any, inputs: list[torch.Tensor], threads: int) -> list[torch.Tensor]:
    """``runner``'s call with torch's thread count at ``threads``, and back to what it was after."""
    outer = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return runner.run(inputs)
    finally:
        torch.set_num_threads(outer)


def restrided(tensor: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``tensor`` in the layout the compiled code indexes with."""
    return torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


# Handles of libraries on a device (CUDA, Metal), whose context a child made by os.fork cannot use.
DEVICE_HANDLES: weakref.WeakSet[AotiHandle] = weakref.WeakSet()


class ForkedRunner:
    """Stands in for a device runner in a child made by os.fork: every call says why it cannot run."""

    def __init__(self, runner: Any, label: str) -> None:
        # Kept, never freed here: freeing device memory from a forked child is itself unsafe.
        self.parent_runner = runner
        self.label = label

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise DelegateInitError(
            f"{self.label} was loaded before os.fork, and a device's context does not survive fork; "
            "load the package in the child, or start children with the 'spawn' method"
        )


def after_fork() -> None:
    """In a child made by os.fork: GNU OpenMP's threads are gone, device contexts are unusable.

    The generated CPU code, like torch's own ops, runs OpenMP parallel regions, and a region with
    more than one thread waits forever in a child whose parent had used them; as torch's
    DataLoader does for its workers, the child runs on one thread. Device runners are replaced
    by one that raises (no cost per call for the others).
    """
    if _LIBRARY_PATHS and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
    for handle in list(DEVICE_HANDLES):
        handle.runner = ForkedRunner(handle.runner, handle.label)


def before_fork() -> None:
    """Pause OpenMP's pool before os.fork once this process has run a library (see ``aotstack.forking``)."""
    if _LIBRARY_PATHS:
        pause_openmp()


os.register_at_fork(before=before_fork, after_in_child=after_fork)
