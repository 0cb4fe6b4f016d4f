"""The run side shared by engines that open one session per delegate, on the host: ONNX Runtime, OpenVINO, XNNPACK.

Each reads the same things before it opens its session: its processed JSON (refused unless a
version it reads), the boundary every call is checked against, the named data it cannot start
without, and the buffers the delegate owns (state it updates in place, ``OwnedBuffer``). ``init``
reads and checks them once, here, and hands them to the engine's ``open`` as one
``DelegateFiles``; the engine only opens its session, and the weights it packs while it does go
on huge pages (``pages.py``). Their compile sides share
``check_host_target``: these engines run on the CPU only. ``session_threads``: the threads a session runs on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import CompileSpecError, PackageError
from ..format import processed as processed_json
from ..format.boundary import Boundary, ProvenInput
from ..format.processed import OwnedBuffer
from ..format.specs import CompileSpec, SpecKey, compile_spec_value, count_spec, partition_label
from ..format.tensor_data import BytesLike
from .interface import BackendRuntime
from .pages import on_huge_pages


@dataclass(frozen=True)
class DelegateFiles:
    """What the package holds for one delegate, read and checked: what a session engine opens its session from."""

    label: str
    processed: dict[str, Any]
    boundary: Boundary
    named_data: Mapping[str, BytesLike]
    compile_specs: list[CompileSpec]
    # The buffers the delegate updates, each over the program's one writable state.
    state: list[OwnedBuffer]
    # Of those, the FQNs nothing else in the package reads or updates: the engine may keep them
    # inside itself (``BackendRuntime.init_keeping_state``).
    keepable: frozenset[str] = frozenset()

    def blob(self, name: str) -> BytesLike:
        """Named data ``name``, which the package must hold."""
        if name not in self.named_data:
            raise PackageError(f"{self.label}: the package holds no named data {name!r}")
        return self.named_data[name]


class SessionRuntime(BackendRuntime):
    """A run side that opens one engine session per delegate from its checked files.

    A subclass names the processed versions it reads and the named data every delegate of it
    holds, and implements ``open``; ``execute`` stays its own.
    """

    readable_versions: ClassVar[tuple[int, ...]]
    required_named_data: ClassVar[tuple[str, ...]] = ()

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> Any:
        with on_huge_pages():
            return self.open(self.delegate_files(processed_bytes, named_data, compile_specs))

    def init_keeping_state(
        self,
        processed_bytes: bytes,
        named_data: Mapping[str, BytesLike],
        compile_specs: list[CompileSpec],
        keepable: frozenset[str],
    ) -> tuple[Any, frozenset[str]]:
        with on_huge_pages():
            handle = self.open(self.delegate_files(processed_bytes, named_data, compile_specs, keepable))
        return handle, self.kept_state(handle)

    def kept_state(self, handle: Any) -> frozenset[str]:
        """The buffers ``handle``'s session keeps inside itself, of those ``open`` was offered; none by default."""
        return frozenset()

    def delegate_files(
        self,
        processed_bytes: bytes,
        named_data: Mapping[str, BytesLike],
        compile_specs: list[CompileSpec],
        keepable: frozenset[str] = frozenset(),
    ) -> DelegateFiles:
        label = partition_label(self.backend_id, compile_specs)
        processed = processed_json.read_processed(processed_bytes, label, self.readable_versions)
        missing = [name for name in self.required_named_data if name not in named_data]
        if missing:
            raise PackageError(f"{label}: the package holds no named data {', '.join(map(repr, missing))}")
        return DelegateFiles(
            label=label,
            processed=processed,
            boundary=processed_json.boundary(processed, label),
            named_data=named_data,
            compile_specs=compile_specs,
            state=processed_json.owned_state(processed, named_data, label),
            keepable=keepable,
        )

    def open(self, delegate: DelegateFiles) -> Any:
        """The handle ``execute`` runs: the engine's session over ``delegate``'s files."""
        raise NotImplementedError

    def trust_inputs(self, handle: Any, proven: Mapping[int, ProvenInput]) -> None:
        # Every session handle keeps its boundary's check as ``check`` (None: checks nothing), and the inputs it
        # makes plain and contiguous at each call as ``unsettled`` (``engine_inputs``).
        if handle.check is not None:
            handle.check = handle.check.trusting(proven)
        handle.unsettled = [index for index in handle.unsettled if not (index in proven and proven[index].contiguous)]

    def released_named_data(self, handle: Any, named_data: Collection[str], called: bool) -> Collection[str]:
        # Opening a session copies the model it reads and packs the weights its kernels repack into
        # the engine's own memory; a weight still read in place (a gather's table) is read back from
        # the file at the first call, and stays.
        return () if called else named_data


def engine_inputs(inputs: list[torch.Tensor], unsettled: list[int]) -> list[torch.Tensor]:
    """``inputs`` as a session engine reads them: each of ``unsettled`` made plain memory (``plain_contiguous``).

    The others are so already at every call, as the plan vouches (``SessionRuntime.trust_inputs``):
    a decode step's inputs are mostly other parts' outputs and weights, and testing each at each
    call costs five attribute reads.
    """
    if not unsettled:
        return inputs
    feeds = list(inputs)
    for index in unsettled:
        feeds[index] = plain_contiguous(feeds[index])
    return feeds


def plain_contiguous(value: torch.Tensor) -> torch.Tensor:
    """``value`` as an engine reads a tensor, as plain memory: a ``torch.Tensor`` (not a subclass such as a
    ``Parameter``), detached, contiguous, its negation or conjugation applied. ``value`` itself where it is one
    already, as a method's tensors between engines are: checking costs a third of making a new view of it.

    An empty tensor is a new one, with the strides an empty tensor is made with: torch takes an empty tensor
    for contiguous whatever its strides (a slice of none of a head's dimensions keeps the head's), and
    ExecuTorch's runtime aborts the process on strides other than those.
    """
    if (type(value) is torch.Tensor and not value.requires_grad and value.is_contiguous() and not value.is_neg()
            and not value.is_conj() and value.numel()):
        return value
    if not value.numel():
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return value.detach().resolve_neg().resolve_conj().contiguous()


def check_host_target(compile_specs: list[CompileSpec], engine: str) -> None:
    """A host session engine runs on the CPU only: another ``target_device`` is a bad spec; so is a ``threads`` spec
    that is not a positive integer."""
    session_threads(compile_specs)
    device = compile_spec_value(compile_specs, SpecKey.TARGET_DEVICE)
    if device is not None and device.decode().split(":")[0] != "cpu":
        raise CompileSpecError(f"compile spec 'target_device': {engine} runs on the CPU, got {device!r}")


def session_threads(compile_specs: list[CompileSpec]) -> int:
    """The threads a delegate's session runs on: its ``threads`` compile spec, else torch's thread count now.

    A spec that is not a positive integer raises ``CompileSpecError``, at compile (each session engine's
    ``preprocess`` asks) as well as at load.
    """
    return count_spec(compile_specs, SpecKey.THREADS) or torch.get_num_threads()
