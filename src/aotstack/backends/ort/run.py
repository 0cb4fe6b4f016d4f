"""ONNX Runtime run side: one session per delegate, tensors passed as views, not copies.

Every call is checked against the boundary the compile side recorded (``format/boundary.py``)
before ONNX Runtime sees it, and each tensor is made one numpy can share: detached, its negation
or conjugation applied, contiguous. An argument ONNX Runtime still refuses is an ``InputError``.

After ``os.fork`` a session keeps working in the child (ONNX Runtime's parallel loops do not
wait on the threads fork leaves behind), but its own exit-time teardown waits forever on them:
a forked child that used it should end with ``os._exit``, as multiprocessing's children do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ...engine.session import DelegateFiles, SessionRuntime, engine_inputs, session_threads
from ...errors import DelegateInitError, InputError, LoweringError, PackageError
from ...format import processed as processed_json
from ...format.boundary import BoundaryCheck
from ...format.processed import OwnedBuffer
from ...format.specs import CompileSpec, SpecKey, compile_spec_value
from .packages import require_packages

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
# Providers whose kernels read weights in host memory, where the session can use the package's own.
HOST_PROVIDERS = frozenset(DEFAULT_PROVIDERS)
# The named data holding a partition's ONNX model.
MODEL_NAME = "model.onnx"
# The processed JSON the compile side writes; version 2 added the boundary, 3 the buffers a delegate owns
# (``state``), which a version-2 reader would not update. The run side reads both; older files are refused by name.
PROCESSED_VERSION = 3
READABLE_VERSIONS = (2, 3)


class OrtRuntime(SessionRuntime):
    """ONNX Runtime's run side: one ``InferenceSession`` per delegate."""

    backend_id = "onnxruntime"
    # The model is asked for by name (``delegate.blob``) once the fields that describe it are checked.
    readable_versions = READABLE_VERSIONS

    def open(self, delegate: DelegateFiles) -> OrtHandle:
        label, processed, boundary = delegate.label, delegate.processed, delegate.boundary
        input_names = processed_json.string_list(processed, "inputs", label)
        output_names = processed_json.string_list(processed, "outputs", label)
        if len(input_names) != len(boundary.inputs):
            raise PackageError(
                f"{label}: processed data names {len(input_names)} inputs, its boundary {len(boundary.inputs)}"
            )
        weights = processed_json.weights(processed, delegate.named_data, label)
        # Written since compile revision 5; every weight was shared before.
        owned = processed_json.string_list(processed, "session_owned", label) if "session_owned" in processed else []
        return open_session(
            bytes(delegate.blob(MODEL_NAME)), weights, providers(delegate.compile_specs), input_names, output_names,
            label, check=boundary.checker(label), state=delegate.state, threads=session_threads(delegate.compile_specs),
            session_owned=frozenset(owned),
        )

    def execute(self, handle: OrtHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


def providers(compile_specs: list[CompileSpec]) -> list[str]:
    """The execution providers named by the ``providers`` compile spec."""
    value = compile_spec_value(compile_specs, SpecKey.PROVIDERS)
    if value is None:
        return list(DEFAULT_PROVIDERS)
    names = [name.strip() for name in value.decode().split(",") if name.strip()]
    if not names or not all(name.endswith("ExecutionProvider") for name in names):
        raise LoweringError(
            f"compile spec 'providers' must list ONNX Runtime execution providers, such as "
            f"'CUDAExecutionProvider,CPUExecutionProvider'; got {value!r}"
        )
    return names


@dataclass
class OrtHandle:
    session: Any
    input_names: list[str]
    output_names: list[str]
    # ONNX Runtime documents that the buffers behind external initializers must outlive the session:
    # [the weights by name (views of the mapped package), the OrtValues over them in the same order].
    keep_alive: list[Any]
    # The inputs a call makes plain and contiguous (``engine_inputs``): every one, until the plan vouches for some.
    unsettled: list[int]
    label: str = "an onnxruntime partition"
    # Every call's inputs against what the model was exported for; None checks nothing (a bare session, or
    # every input proven by the plan: trust_inputs).
    check: BoundaryCheck | None = None
    # The exceptions ONNX Runtime raises for arguments it refuses.
    argument_errors: tuple[type[BaseException], ...] = ()
    # The buffers the delegate owns, bound once as inputs and outputs of ``binding``; none: plain runs.
    state: list[OwnedBuffer] = field(default_factory=list)
    binding: Any = None
    # The outputs ``binding.get_outputs()`` gives, in its order: ONNX Runtime keeps each name where it was first bound.
    bound_outputs: list[str] = field(default_factory=list)


def open_session(
    model: bytes,
    weights: Mapping[str, torch.Tensor],
    providers: list[str],
    input_names: list[str],
    output_names: list[str],
    label: str,
    check: BoundaryCheck | None = None,
    state: list[OwnedBuffer] | None = None,
    threads: int | None = None,
    session_owned: frozenset[str] = frozenset(),
) -> OrtHandle:
    """An ``InferenceSession`` for ``model``, its external initializers taken from ``weights``.

    Each buffer of ``state`` (one the delegate updates) is bound as its input and its output, over
    the buffer's own memory, for every call (``bound_state``).

    On the CPU provider the session reads the weights where they are (views of the mapped
    package), not copies: each is both an external initializer, which the model's placeholders
    ask for, and a shared initializer (``add_initializer``), which ONNX Runtime uses in place
    instead of copying it into memory of its own; ``session_owned`` ones (which ONNX Runtime's optimizers may
    rewrite) are external initializers alone, copied. Two copies remain ONNX Runtime's own doing:
    while the session starts it holds a transient copy of each external initializer (ONNX
    Runtime 1.31; the model cannot name the weights' memory itself, as ONNX Runtime refuses
    in-memory addresses in a model), and a kernel that prepacks its weights (MatMul, Gemm,
    convolutions) keeps its packed copy. ``session.disable_prepacking`` would drop the latter,
    but measured it about halves a Gemm's speed, so prepacking stays on.
    """
    require_packages(("onnxruntime",), f"{label} needs {{missing}} to run", DelegateInitError)
    import onnxruntime

    available = onnxruntime.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise DelegateInitError(
            f"{label} asks for ONNX Runtime providers {missing}, which this onnxruntime lacks "
            f"(available: {', '.join(available)})"
        )
    options = onnxruntime.SessionOptions()
    # Warnings about graph optimisations it skips are not the user's to act on; errors still show.
    options.log_severity_level = 3
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    # Its threads spin between the ops of one run, which is fast, but also for a while after the
    # run, on the cores the next engine (OpenMP's pool, another session) then needs: on 2 cores a
    # stacked decode ran 13x slower than either engine alone. They sleep once a run ends.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    names = list(weights)
    # ortvalue_from_numpy shares a CPU array's memory (and keeps the array); numpy() shares the tensor's.
    values = [onnxruntime.OrtValue.ortvalue_from_numpy(weights[name].numpy()) for name in names]
    if names:
        options.add_external_initializers(names, values)
        if set(providers) <= HOST_PROVIDERS:
            # A provider with memory of its own copies weights there anyway; host memory is shared.
            for name, value in zip(names, values):
                if name not in session_owned:
                    options.add_initializer(name, value)
    try:
        session = onnxruntime.InferenceSession(model, options, providers=providers)
    except Exception as error:
        raise DelegateInitError(f"{label}: ONNX Runtime could not open the model: {error}") from error
    return OrtHandle(
        session, input_names, output_names, keep_alive=[weights, values], label=label, check=check,
        unsettled=list(range(len(input_names))),
        argument_errors=argument_errors(), state=state or [],
        binding=bound_state(session, state, output_names) if state else None,
        bound_outputs=bound_output_order(state or [], output_names),
    )


def bound_state(session: Any, state: list[OwnedBuffer], output_names: list[str]) -> Any:
    """An ``IOBinding`` with each owned buffer's memory bound as its input, and as its output where the model
    writes it in place; every other output is bound at each call (a buffer's then copied into it)."""
    binding = session.io_binding()
    for buffer in state:
        tensor = buffer.tensor
        array_type = tensor.numpy().dtype.type
        binding.bind_input(buffer.input, "cpu", 0, array_type, list(tensor.shape), tensor.data_ptr())
        if buffer.in_place:
            binding.bind_output(buffer.output, "cpu", 0, array_type, list(tensor.shape), tensor.data_ptr())
    for name in bound_output_order(state, output_names)[sum(buffer.in_place for buffer in state):]:
        binding.bind_output(name, "cpu")
    return binding


def bound_output_order(state: list[OwnedBuffer], output_names: list[str]) -> list[str]:
    """The outputs ``bound_state`` binds, in its order: buffers updated in place, the delegate's, buffers copied."""
    in_place = [buffer.output for buffer in state if buffer.in_place]
    return in_place + output_names + [buffer.output for buffer in state if not buffer.in_place]


def argument_errors() -> tuple[type[BaseException], ...]:
    """ONNX Runtime's exception classes for a refused argument (its module moves between releases)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return tuple(getattr(state, name) for name in ("InvalidArgument",) if hasattr(state, name))


def run(handle: OrtHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run one call. Contiguous inputs and every output are shared with ONNX Runtime, not copied."""
    if handle.check is not None:
        handle.check(inputs)
    # numpy() refuses a tensor that asks for gradients or carries a negation or conjugation bit; a
    # view ONNX Runtime would read as laid out (strided, expanded) is copied to contiguous memory.
    feeds = {
        name: value.numpy() for name, value in zip(handle.input_names, engine_inputs(inputs, handle.unsettled))
    }
    if handle.binding is not None:
        return run_bound(handle, feeds)
    try:
        outputs = handle.session.run(handle.output_names, feeds)
    except handle.argument_errors as error:
        raise_argument_error(handle, error)
    return [torch.from_numpy(array) for array in outputs]


def raise_argument_error(handle: OrtHandle, error: BaseException) -> NoReturn:
    """``error`` (ONNX Runtime's invalid argument) as the caller's ``InputError``, unless the inputs were checked
    against the sizes the model was exported for: then the fault is the engine's, in a size it should take, and
    ``error`` goes on to the step that ran the delegate, which names it."""
    if handle.check is not None:
        raise error
    raise InputError(f"{handle.label}: ONNX Runtime refused the inputs: {error}") from None


def run_bound(handle: OrtHandle, feeds: dict[str, Any]) -> list[torch.Tensor]:
    """One call of a delegate that owns buffers: they stay bound; the other inputs and outputs are bound anew.

    Calls of a method that reads a buffer never overlap (the program's state lock), so one
    binding serves every call.
    """
    binding = handle.binding
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    # Bound to a device alone, an output is memory ONNX Runtime allocates for this call: the
    # tensors an earlier call returned are not written over.
    for name in handle.output_names:
        binding.bind_output(name, "cpu")
    copied = [buffer for buffer in handle.state if not buffer.in_place]
    for buffer in copied:
        binding.bind_output(buffer.output, "cpu")
    try:
        handle.session.run_with_iobinding(binding)
    except handle.argument_errors as error:
        raise_argument_error(handle, error)
    values = dict(zip(handle.bound_outputs, binding.get_outputs(), strict=True))
    for buffer in copied:
        buffer.tensor.copy_(torch.from_numpy(values[buffer.output].numpy()))
    return [torch.from_numpy(values[name].numpy()) for name in handle.output_names]

