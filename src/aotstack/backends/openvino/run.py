"""OpenVINO run side: a delegate's IR read from the package, its weights made constants in place, compiled for the CPU.

``init`` reads the IR's XML and its small constants file from the package's named data (no file
is written or opened), puts each weight in where the IR has a parameter for it, as a constant
over the package's own mapped bytes (no copy; the CPU plugin keeps its own packed copy only of
the weights its kernels repack), and compiles the model for OpenVINO's CPU plugin:

- ``INFERENCE_PRECISION_HINT`` from the part (``f32`` unless every floating tensor in it is
  bfloat16): on a CPU with bf16 units the plugin otherwise runs float32 models in bfloat16. One
  exception (``precision_to_compile``): on a CPU with AMX, the plugin (2026.4) fuses each gated
  MLP of a bfloat16 model into one kernel that shares the down projection among half its
  threads, and dies of SIGFPE compiling it for one thread. There a part with a gated MLP loaded
  on one thread (or one core) computes in float32, with a warning, rather than end the process.
- ``INFERENCE_NUM_THREADS`` is ``torch.get_num_threads()`` at load, ``PERFORMANCE_HINT`` is
  ``LATENCY`` (one stream), and ``ENABLE_CPU_PINNING`` is off: the process shares its cores with
  torch and the other engines, so OpenVINO does not pin its threads to them. OpenVINO has no
  property for how its idle threads wait; its TBB workers spin about a millisecond after a call,
  then sleep.

Every call is checked against the boundary the compile side recorded before OpenVINO sees it.
Inputs are handed over as ``openvino.Tensor`` views of the torch tensors' memory (a strided,
negated or conjugated view is made contiguous first), and an input whose memory and shape are
those of the last call on that request is not set again. An output whose shape is static is
written by OpenVINO straight into a new torch tensor; a dynamic one is OpenVINO's own tensor,
handed to torch as it is, and the request gets a fresh one for its next call. A static tensor of
at most ``COPY_LIMIT`` bytes is copied instead, into or out of the request's own memory: for
small tensors a copy costs less than wrapping memory. An output the plugin makes an input's own
(see ``passed_through``) is a copy of that input. A call from another thread while one runs gets
its own request, so concurrent calls are safe.

A buffer the delegate updates (a KV cache) that nothing else in its method reads is kept as a
state variable of the model (``made_stateful``), as OpenVINO runs a model converted with its
caches stateful: the request reads and writes it in its own memory, and it crosses no call; its
value goes through the buffer's shared memory only when loading hands it to or from another
method. Such a delegate has one request, since state is a request's; loading serialises its calls.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.processor import cpu_features
from ...engine.session import DelegateFiles, SessionRuntime, engine_inputs, session_threads
from ...errors import DelegateInitError, PackageError, RunError
from ...format import processed as processed_json
from ...format.archive import usable_cores
from ...format.boundary import Boundary, BoundaryCheck
from ...format.processed import OwnedBuffer
from ...format.tensor_data import BytesLike, dtype_from_name
from .packages import require_openvino

logger = logging.getLogger("aotstack")

# Named data of a delegate: the IR's XML, and its .bin, which holds the constants the frontend
# made (shapes, scalars); the weights are named data of their own, ``weight:<fqn>``.
MODEL_NAME = "openvino.xml"
CONSTANTS_NAME = "openvino.bin"
# The processed JSON the compile side writes; version 2 added the buffers a delegate owns (``state``), which a
# version-1 reader would not update; version 3, weights the IR declares ``i4``, stored two values a byte, which
# an earlier reader would hand OpenVINO as bytes. The run side reads all three.
PROCESSED_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
# The torch dtypes a delegate's boundary may carry -> their OpenVINO element type.
ELEMENT_TYPES = {
    torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "boolean",
}
# Up to this many bytes, a static input or output is copied between torch's memory and the request's
# own instead of shared: wrapping memory in an ``openvino.Tensor`` and setting it costs about 3 µs,
# copying 16 KiB less than that.
COPY_LIMIT = 16 * 1024
# Precisions the compile side may ask the CPU plugin to compute in.
PRECISIONS = ("f32", "bf16")
# The CPU features under which OpenVINO's CPU plugin fuses a bfloat16 gated MLP into its ``LLMMLP`` kernel.
FUSED_MLP_FEATURES = frozenset({"amx_tile", "amx_bf16"})
# A parameter of the IR is ``input:<index>`` (the partition's user input) or ``weight:<fqn>``.
INPUT_ROLE, WEIGHT_ROLE = "input:", "weight:"
# The friendly name the compile side gives the IR's result ``i``: ``output:<i>``.
OUTPUT_ROLE = "output:"


class OpenVinoRuntime(SessionRuntime):
    """OpenVINO's run side: one compiled model per delegate, run by a small pool of infer requests."""

    backend_id = "openvino"
    readable_versions = READABLE_VERSIONS
    required_named_data = (MODEL_NAME, CONSTANTS_NAME)

    def open(self, delegate: DelegateFiles) -> OpenVinoHandle:
        label = delegate.label
        require_openvino(f"{label} needs openvino to run", DelegateInitError)
        import numpy

        part = read_part(delegate)
        compiled, kept = compiled_keeping(part, delegate.keepable, session_threads(delegate.compile_specs), label)
        kept_results = {result for result, _ in kept}
        returned = part.outputs[len(part.state):]
        handle = OpenVinoHandle(
            compiled,
            feeds=feeds(compiled, part, {buffer.input for _, buffer in kept}, label),
            outputs=output_plans(compiled, part, kept_results, label),
            # None where the part returns each result once, in order.
            returned=None if returned == list(range(len(part.outputs))) else returned,
            state=[
                (result, buffer.tensor, buffer.in_place)
                for result, buffer in zip(part.outputs, part.state) if result not in kept_results
            ],
            kept={variable_id(buffer, result): buffer for result, buffer in kept},
            state_inputs=[buffer.tensor for buffer in part.state],
            label=label,
            check=part.boundary.checker(label),
            unsettled=list(range(len(part.boundary.inputs))),
            keep_alive=[part.weights, part.constants],
            copyto=numpy.copyto,
            infer=base_infer(),
        )
        if kept:
            # State is per request: a handle keeping buffers has one, from the start.
            handle.idle.append(handle.new_request())
        return handle

    def kept_state(self, handle: OpenVinoHandle) -> frozenset[str]:
        return frozenset(buffer.fqn for buffer in handle.kept.values())

    def load_state(self, handle: OpenVinoHandle, buffers: Collection[str]) -> None:
        for variable, buffer in handle.state_variables(buffers):
            # OpenVINO copies the value into the request's own memory.
            variable.state = ov_tensor(buffer.tensor)

    def store_state(self, handle: OpenVinoHandle, buffers: Collection[str]) -> None:
        for variable, buffer in handle.state_variables(buffers):
            handle.copyto(numpy_view(buffer.tensor), host_array(variable.state, buffer.tensor.dtype))

    def execute(self, handle: OpenVinoHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)

    def released_named_data(self, handle: OpenVinoHandle, named_data: Collection[str], called: bool) -> Collection[str]:
        # The CPU plugin repacks a matmul's weights when it compiles a static shape, and a dynamic
        # one's at the first call with each new shape (measured: the weights' pages come back then).
        return named_data


@dataclass(frozen=True)
class Part:
    """What the compile side stored for one delegate, read and checked."""

    xml: bytes
    constants: BytesLike
    weights: dict[str, torch.Tensor]
    parameters: list[str]
    # For each output of the part, the IR result that holds it.
    outputs: list[int]
    precision: str
    boundary: Boundary
    # The buffers the delegate owns: its trailing inputs, and the results of its leading outputs.
    state: list[OwnedBuffer] = field(default_factory=list)

    def input_dtypes(self) -> list[torch.dtype]:
        """The dtype of each input the model takes: the delegate's, then its buffers'."""
        return [dtype_from_name(item.dtype) for item in self.boundary.inputs] + [b.tensor.dtype for b in self.state]


def base_infer() -> Callable[..., Any]:
    """The compiled ``infer`` that ``openvino.InferRequest.infer`` wraps: ``infer(request, {}, True, False)``."""
    import openvino

    return next(vars(cls)["infer"] for cls in openvino.InferRequest.__mro__[1:] if "infer" in vars(cls))


def read_part(delegate: DelegateFiles) -> Part:
    """The delegate's processed JSON and named data, every field checked: a bad one is a ``PackageError``."""
    label, processed, boundary, named_data = delegate.label, delegate.processed, delegate.boundary, delegate.named_data
    parameters = processed_json.string_list(processed, "parameters", label)
    state = delegate.state
    inputs = [role.removeprefix(INPUT_ROLE) for role in parameters if role.startswith(INPUT_ROLE)]
    known = {str(index) for index in range(len(boundary.inputs) + len(state))}
    if len(set(inputs)) != len(inputs) or not set(inputs) <= known:
        raise PackageError(f"{label}: its parameters {parameters} are not among its {len(boundary.inputs)} input(s)")
    weights = processed_json.weights(processed, named_data, label)
    if sorted(role for role in parameters if role.startswith(WEIGHT_ROLE)) != sorted(WEIGHT_ROLE + w for w in weights):
        raise PackageError(f"{label}: its parameters do not name the weights it stores")
    precision = processed_json.field(processed, "precision", str, label)
    if precision not in PRECISIONS:
        raise PackageError(f"{label}: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return Part(
        xml=bytes(named_data[MODEL_NAME]),
        constants=named_data[CONSTANTS_NAME],
        weights=weights,
        parameters=parameters,
        outputs=result_indices(processed, label),
        precision=precision,
        boundary=boundary,
        state=checked_state(state, len(boundary.inputs), label),
    )


def checked_state(state: list[OwnedBuffer], inputs: int, label: str) -> list[OwnedBuffer]:
    """``state`` if buffer ``k`` is input ``inputs + k`` and output ``k`` of the part, as the compile side makes it."""
    for index, buffer in enumerate(state):
        if (buffer.input, buffer.output) != (f"{INPUT_ROLE}{inputs + index}", f"{OUTPUT_ROLE}{index}"):
            raise PackageError(f"{label}: state {buffer.fqn!r} is not the part's input {inputs + index} and output "
                               f"{index}")
    return state


def result_indices(processed: Mapping[str, Any], label: str) -> list[int]:
    indices = processed_json.field(processed, "outputs", list, label)
    if not all(type(index) is int for index in indices) or sorted(set(indices)) != list(range(len(set(indices)))):
        raise PackageError(f"{label}: processed field 'outputs' must map each output to a result, got {indices!r}")
    return indices


@functools.cache
def core() -> Any:
    """One OpenVINO ``Core`` per process: it loads the CPU plugin once."""
    import openvino

    return openvino.Core()


def read_model(part: Part, label: str) -> Any:
    """The part's IR read from memory, its weights made constants over the package's bytes."""
    try:
        model = core().read_model(part.xml, byte_tensor(part.constants))
    except Exception as error:
        raise DelegateInitError(f"{label}: OpenVINO could not read the model: {error}") from error
    with_weights_as_constants(model, part.weights, label)
    return model


def compiled_keeping(
    part: Part, keepable: Collection[str], threads: int, label: str
) -> tuple[Any, list[tuple[int, OwnedBuffer]]]:
    """The part compiled with the buffers of ``keepable`` it can keep as state variables, and those buffers.

    Where OpenVINO cannot make or compile the stateful model, the part is compiled as stored,
    its buffers bound in place as before: keeping state is a speed-up, never a reason not to load.
    """
    model = read_model(part, label)
    # Decided once: where the stateful model fails to compile, the part as stored compiles in the same precision.
    precision = precision_to_compile(model, part.precision, threads, label)
    kept = kept_buffers(model, part, keepable)
    if not kept:
        return compiled_model(model, precision, threads, label), []
    try:
        made_stateful(model, kept, label)
        return compiled_model(model, precision, threads, label), kept
    except DelegateInitError as error:
        logger.warning("%s: its buffers stay bound in place, not kept in OpenVINO: %s", label, error)
        return compiled_model(read_model(part, label), precision, threads, label), []


def kept_buffers(model: Any, part: Part, keepable: Collection[str]) -> list[tuple[int, OwnedBuffer]]:
    """The buffers of ``part`` that become state variables of ``model``, each with the IR result that updates it.

    A buffer is kept where loading offers it (nothing else in its method reads it), its values are floating
    (the CPU plugin refuses integer state under a bf16 precision hint), and the IR reads it as a
    parameter and updates it by a result of its own, which no output of the part shares.
    """
    parameters = {parameter.get_friendly_name() for parameter in model.get_parameters()}
    results = {result.get_friendly_name() for result in model.get_results()}
    kept = []
    for buffer, result in zip(part.state, part.outputs):
        if (
            buffer.fqn in keepable
            and buffer.tensor.is_floating_point()
            and buffer.input in parameters
            and f"{OUTPUT_ROLE}{result}" in results
            and part.outputs.count(result) == 1
        ):
            kept.append((result, buffer))
    return kept


def made_stateful(model: Any, kept: list[tuple[int, OwnedBuffer]], label: str) -> None:
    """Turn each kept buffer's parameter and result into one state variable of ``model``, in place.

    OpenVINO then reads and writes the buffer in the infer request's own memory, as it runs a
    model converted with its caches stateful: no cache crosses a call's boundary.
    """
    from openvino._offline_transformations import apply_make_stateful_transformation

    parameters = {parameter.get_friendly_name(): parameter for parameter in model.get_parameters()}
    results = {result.get_friendly_name(): result for result in model.get_results()}
    pairs = [(parameters[buffer.input], results[f"{OUTPUT_ROLE}{result}"]) for result, buffer in kept]
    try:
        apply_make_stateful_transformation(model, pairs)
    except Exception as error:
        raise DelegateInitError(f"{label}: OpenVINO could not keep its buffers as state: {error}") from error
    made = {variable.get_info().variable_id for variable in model.get_variables()}
    missing = sorted(buffer.fqn for result, buffer in kept if variable_id(buffer, result) not in made)
    if missing:
        raise DelegateInitError(f"{label}: OpenVINO made no state variable for buffers {missing}")


def variable_id(buffer: OwnedBuffer, result: int) -> str:
    """The id OpenVINO's stateful transformation gives ``buffer``'s variable: its parameter's, then result's name."""
    return f"{buffer.input}{OUTPUT_ROLE}{result}"


def compiled_model(model: Any, precision: str, threads: int, label: str) -> Any:
    """``model`` compiled for the CPU plugin, in ``precision`` (``precision_to_compile``), on ``threads`` threads."""
    try:
        return core().compile_model(model, "CPU", {
            "INFERENCE_PRECISION_HINT": precision,
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
            "ENABLE_CPU_PINNING": False,
            # Left on, OpenVINO quantizes the activations of a compressed-weight matmul by itself,
            # so a weight-only model would no longer compute what the eager model does.
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
        })
    except Exception as error:
        raise DelegateInitError(f"{label}: OpenVINO could not compile the model: {error}") from error


def precision_to_compile(model: Any, precision: str, threads: int, label: str) -> str:
    """``precision``, unless the CPU plugin would die compiling ``model`` in it on ``threads`` threads: then ``f32``.

    On a CPU with AMX, the plugin fuses each gated MLP of a bfloat16 model (``down(act(gate(x)) *
    up(x))``) into one ``LLMMLP`` kernel, which gives the down projection to half its threads and
    divides by their number: zero, on one thread (SIGFPE, OpenVINO 2026.4). No property turns the
    fusion off, so such a model computes in float32 there, which the plugin runs unfused.
    """
    # The plugin runs on no more threads than the process has cores: two threads on one core are one.
    alone = min(threads, usable_cores()) < 2
    if precision == "f32" or not alone or not FUSED_MLP_FEATURES <= cpu_features() or not has_gated_mlp(model):
        return precision
    logger.warning(
        "%s: computes in float32, not %s: OpenVINO's CPU plugin dies compiling a %s gated MLP for one thread on a "
        "CPU with AMX; load it with 2 or more threads, on 2 or more cores, to compute in %s",
        label, precision, precision, precision,
    )
    return "f32"


def has_gated_mlp(model: Any) -> bool:
    """Whether ``model`` multiplies an activated projection (``Swish``, ``Gelu``) by another, then projects that.

    Only over tokens of rank 3 (batch, sequence, features), or of a rank not known: the only ones the plugin fuses.
    """
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Multiply":
            continue
        rank = op.get_output_partial_shape(0).rank
        if rank.is_static and rank.get_length() != 3:
            continue
        factors = [producer_type(op.input_value(index)) for index in range(op.get_input_size())]
        consumers = {target.get_node().get_type_name() for target in op.output(0).get_target_inputs()}
        if {"Swish", "Gelu"} & set(factors) and "MatMul" in consumers:
            return True
    return False


def producer_type(value: Any) -> str:
    """The type of the op that computes ``value``, looking through conversions between element types."""
    node = value.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node.get_type_name()


def byte_tensor(data: BytesLike) -> Any:
    """``data`` as an OpenVINO ``u8`` tensor over the same memory."""
    import numpy
    import openvino

    array = numpy.frombuffer(data, dtype=numpy.uint8) if len(data) else numpy.zeros(0, dtype=numpy.uint8)
    # This constructor wraps read-only memory as it is; OpenVINO only reads it.
    return openvino.Tensor(array, [array.size], openvino.Type.u8)


def with_weights_as_constants(model: Any, weights: Mapping[str, torch.Tensor], label: str) -> None:
    """Replace each ``weight:<fqn>`` parameter of ``model`` by a constant over the weight's own memory, in place.

    A parameter the IR declares ``i4`` takes its weight's bytes as they are, two values a byte.
    """
    import openvino

    for parameter in list(model.get_parameters()):
        role = parameter.get_friendly_name()
        if not role.startswith(WEIGHT_ROLE):
            continue
        weight = weights[role.removeprefix(WEIGHT_ROLE)]
        if parameter.get_element_type() == openvino.Type.i4:
            tensor = int4_tensor(weight, parameter.get_partial_shape(), f"{label}: weight {role!r}")
        else:
            tensor = ov_tensor(weight)
        try:
            constant = openvino.op.Constant(tensor, shared_memory=True)
            parameter.output(0).replace(constant.output(0))
        except Exception as error:
            raise DelegateInitError(f"{label}: OpenVINO could not take weight {role!r}: {error}") from error
        model.remove_parameter(parameter)
    try:
        model.validate_nodes_and_infer_types()
    except Exception as error:
        raise DelegateInitError(f"{label}: OpenVINO could not take the weights: {error}") from error


def int4_tensor(weight: torch.Tensor, shape: Any, where: str) -> Any:
    """An ``i4`` ``openvino.Tensor`` of ``shape`` over ``weight``'s bytes, which must hold exactly its values."""
    import openvino

    if not shape.is_static:
        raise PackageError(f"{where}: an i4 weight needs a static shape, the IR gives {shape}")
    dims = list(shape.to_shape())
    needed = (math.prod(dims) + 1) // 2
    if weight.dtype != torch.uint8 or weight.numel() != needed:
        raise PackageError(f"{where}: i4{dims} takes {needed} bytes of uint8, its data is "
                           f"{weight.numel()} of {weight.dtype}")
    return openvino.Tensor(weight.numpy(), dims, openvino.Type.i4)


def ov_tensor(tensor: torch.Tensor) -> Any:
    """An ``openvino.Tensor`` over ``tensor``'s memory, which must be contiguous host memory."""
    import openvino

    return tensor_wrapper(tensor.dtype, openvino)(tensor)


def tensor_wrapper(dtype: torch.dtype, openvino: Any) -> Callable[[torch.Tensor], Any]:
    """The fastest way to view a contiguous CPU tensor of ``dtype`` as an ``openvino.Tensor``, sharing its memory."""
    if dtype is torch.bfloat16:
        bf16 = openvino.Type.bf16
        return lambda tensor: openvino.Tensor(numpy_view(tensor), list(tensor.shape), bf16)
    return lambda tensor: openvino.Tensor(tensor.numpy(), shared_memory=True)


def numpy_view(tensor: torch.Tensor) -> Any:
    """``tensor``'s memory as a numpy array; numpy has no bfloat16, so its bits show as int16."""
    return numpy_view_of(tensor.dtype)(tensor)


def numpy_view_of(dtype: torch.dtype) -> Callable[[torch.Tensor], Any]:
    if dtype is torch.bfloat16:
        return lambda tensor: tensor.view(torch.int16).numpy()
    return torch.Tensor.numpy


def host_array(tensor: Any, dtype: torch.dtype) -> Any:
    """The memory of an ``openvino.Tensor`` of ``dtype`` as numpy sees a torch tensor of it (see ``numpy_view``)."""
    return tensor.data.view(numpy_view(torch.empty(0, dtype=dtype)).dtype)


def copied(shape: torch.Size | None, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``shape`` crosses by a copy into (or out of) the request's own memory, not as a view."""
    return shape is not None and shape.numel() * dtype.itemsize <= COPY_LIMIT


def static_shape(shape: Any) -> torch.Size | None:
    return torch.Size(shape.to_shape()) if shape.is_static else None


@dataclass(frozen=True)
class Feed:
    """One input of the compiled model: which of the delegate's inputs it takes, and how it crosses."""

    index: int
    dtype: torch.dtype
    element_type: Any
    shape: torch.Size | None
    # Small and static: copied into the request's own tensor rather than wrapped.
    copied: bool


def feeds(compiled: Any, part: Part, kept_inputs: Collection[str], label: str) -> list[Feed]:
    """For each input of the compiled model, in its order, the delegate input it takes (``kept_inputs`` are state)."""
    feeds = []
    for port in compiled.inputs:
        role = port.get_node().get_friendly_name()
        if not role.startswith(INPUT_ROLE):
            raise PackageError(f"{label}: the compiled model has an input {role!r} that is not one of the part's")
        index = int(role.removeprefix(INPUT_ROLE))
        dtype = part.input_dtypes()[index]
        shape = static_shape(port.get_partial_shape())
        feeds.append(Feed(index, dtype, port.get_element_type(), shape, copied(shape, dtype)))
    expected = sorted(
        int(role.removeprefix(INPUT_ROLE))
        for role in part.parameters if role.startswith(INPUT_ROLE) and role not in kept_inputs
    )
    if sorted(feed.index for feed in feeds) != expected:
        raise PackageError(f"{label}: the compiled model's inputs are not the ones its parameters name")
    return feeds


@dataclass(frozen=True)
class OutputPlan:
    """One output of the compiled model: its types, its shape where static, and how it crosses."""

    port: int
    dtype: torch.dtype
    element_type: Any
    shape: torch.Size | None
    # Small and static: copied out of the request's own tensor rather than written into torch's.
    copied: bool
    # The delegate input the CPU plugin hands out as this output, untouched; None for a computed one.
    source: int | None


def output_plans(compiled: Any, part: Part, kept_results: Collection[int], label: str) -> list[OutputPlan | None]:
    """The compiled model's outputs in the order of the IR's results (found by the names the compile side gave them).

    A result that updates a buffer kept as state (``kept_results``) is no output: None.
    """
    import openvino

    torch_types = {getattr(openvino.Type, name): dtype for dtype, name in ELEMENT_TYPES.items()}
    ports = {output.get_node().get_friendly_name(): port for port, output in enumerate(compiled.outputs)}
    count = len(set(part.outputs))
    names = [f"{OUTPUT_ROLE}{index}" for index in range(count)]
    if sorted(ports) != sorted(name for index, name in enumerate(names) if index not in kept_results):
        raise PackageError(f"{label}: the compiled model's outputs are not the part's {count}")
    sources = passed_through(compiled)
    plans: list[OutputPlan | None] = []
    for name in names:
        if name not in ports:
            plans.append(None)
            continue
        output = compiled.outputs[ports[name]]
        dtype = torch_types.get(output.get_element_type())
        if dtype is None:
            raise PackageError(f"{label}: output {name!r} has OpenVINO type {output.get_element_type()}, "
                               "which no torch dtype here matches")
        shape = static_shape(output.get_partial_shape())
        source = sources.get(name)
        plans.append(OutputPlan(
            ports[name], dtype, output.get_element_type(), shape, copied(shape, dtype),
            None if source is None else int(source.removeprefix(INPUT_ROLE)),
        ))
    return plans


def passed_through(compiled: Any) -> dict[str, str]:
    """Output name -> input name, for each output the CPU plugin hands straight from an input.

    The plugin compiles an output that only copies an input (``clone``, a cast to the same type)
    into the input's own memory. Given memory of the caller's for both, it writes the output's
    into the input's, so such an output is never given memory: the run side copies the input.
    """
    found = {}
    for result in compiled.get_runtime_model().get_results():
        source = result.input_value(0).get_node()
        if source.get_type_name() == "Parameter":
            found[result.get_friendly_name()] = source.get_friendly_name()
    return found


@dataclass
class Request:
    """An infer request and what a call needs of it at hand."""

    request: Any
    # Per input port, the (address, shape) of the tensor set on it last; None where unknown or copied.
    held: list[tuple[int, torch.Size] | None]
    # Per port where tensors are copied, a numpy view of the tensor this request was given for
    # good (and keeps); None elsewhere.
    inputs: list[Any]
    outputs: list[Any]


@dataclass
class OpenVinoHandle:
    compiled: Any
    feeds: list[Feed]
    # Per result of the IR; None for one that updates a buffer kept as state.
    outputs: list[OutputPlan | None]
    returned: list[int] | None
    # Per buffer the delegate owns and the model does not keep: its result, its shared memory,
    # and whether the request writes it there.
    state: list[tuple[int, torch.Tensor, bool]]
    # The buffers kept as the request's state variables, by variable id; their shared memory is
    # read or written only when loading hands the value over (``load_state``, ``store_state``).
    kept: dict[str, OwnedBuffer]
    # Every buffer's shared memory, kept or not: the part's trailing inputs, after the delegate's
    # own (a feed takes input ``inputs + k`` for buffer ``k``; a kept buffer has no feed).
    state_inputs: list[torch.Tensor]
    label: str
    check: BoundaryCheck | None
    # The inputs a call makes plain and contiguous (``engine_inputs``): every one, until the plan vouches for some.
    unsettled: list[int]
    # The package's views that the model's constants point into: they must outlive it.
    keep_alive: list[Any]
    # ``numpy.copyto``, imported with OpenVINO rather than with this module.
    copyto: Callable[..., None]
    # The infer request's own ``infer(inputs, share_outputs, decode_strings)``, without the Python
    # wrapper's dispatch of its arguments, which costs about a microsecond a call and is not needed.
    infer: Callable[..., Any]
    # Requests no call is using; a call takes one (or makes one) and puts it back.
    idle: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        import openvino

        # What a call walks, laid out once: (port, input index, copied, numpy view, wrap) per input,
        # and the outputs by how they cross.
        self.feed_steps = [
            (port, feed.index, feed.copied, numpy_view_of(feed.dtype), tensor_wrapper(feed.dtype, openvino))
            for port, feed in enumerate(self.feeds)
        ]
        # A buffer's result written in place is the request's for good (``new_request``); one that is not
        # crosses like any output, then is copied into the buffer.
        self.written_state = written = {result for result, _, in_place in self.state if in_place}
        self.copied_state = [(result, tensor) for result, tensor, in_place in self.state if not in_place]
        crossing = [
            (i, plan) for i, plan in enumerate(self.outputs)
            if plan is not None and plan.source is None and i not in written
        ]
        self.written_outputs = [
            (i, plan.port, plan.shape, plan.dtype, tensor_wrapper(plan.dtype, openvino))
            for i, plan in crossing if plan.shape is not None and not plan.copied
        ]
        self.copied_outputs = [(i, bfloat16_or_none(plan.dtype)) for i, plan in crossing if plan.copied]
        self.dynamic_outputs = [(i, plan) for i, plan in crossing if plan.shape is None]
        self.passed_outputs = [
            (i, plan.source) for i, plan in enumerate(self.outputs) if plan is not None and plan.source is not None
        ]
        self.requests_made = 0

    def new_request(self) -> Request:
        import openvino

        if self.kept and self.requests_made:
            # Loading serialises a method's calls where it updates state, so only a caller of the
            # run side itself, from two threads, gets here.
            raise RunError(f"{self.label}: called while another call runs; the buffers it keeps live in one "
                           "infer request, which runs one call at a time")
        self.requests_made += 1
        request = self.compiled.create_infer_request()
        inputs: list[Any] = [None] * len(self.feeds)
        for port, feed in enumerate(self.feeds):
            if feed.copied:
                # A tensor of the request's for good: calls copy into it, and it is never replaced.
                tensor = openvino.Tensor(feed.element_type, list(feed.shape))
                request.set_input_tensor(port, tensor)
                inputs[port] = host_array(tensor, feed.dtype)
        outputs: list[Any] = [None] * len(self.outputs)
        for result, tensor, in_place in self.state:
            if in_place:
                request.set_output_tensor(self.outputs[result].port, ov_tensor(tensor))
        for index, plan in enumerate(self.outputs):
            if plan is not None and plan.copied and plan.source is None and index not in self.written_state:
                tensor = openvino.Tensor(plan.element_type, list(plan.shape))
                request.set_output_tensor(plan.port, tensor)
                outputs[index] = host_array(tensor, plan.dtype)
        return Request(request, [None] * len(self.feeds), inputs, outputs)

    def state_variables(self, buffers: Collection[str]) -> list[tuple[Any, OwnedBuffer]]:
        """The request's state variable of each kept buffer among ``buffers``, with the buffer."""
        variables = {variable.name: variable for variable in self.idle[0].request.query_state()}
        return [(variables[name], buffer) for name, buffer in self.kept.items() if buffer.fqn in buffers]


def bfloat16_or_none(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a copied output is viewed as after it crosses: bfloat16's bits cross as int16."""
    return torch.bfloat16 if dtype is torch.bfloat16 else None


def run(handle: OpenVinoHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call: inputs checked, then handed over; outputs in new torch tensors."""
    if handle.check is not None:
        handle.check(inputs)
    inputs = engine_inputs(inputs, handle.unsettled)
    if handle.state_inputs:
        inputs = [*inputs, *handle.state_inputs]
    try:
        slot = handle.idle.pop()
    except IndexError:
        slot = handle.new_request()
    request = slot.request
    # Tensors the request reads in place, which this call may have made (a contiguous copy): the
    # request holds their address only, so they must live until it has run.
    shared = []
    try:
        for port, index, copied, to_numpy, wrap in handle.feed_steps:
            value = inputs[index]
            if copied:
                handle.copyto(slot.inputs[port], to_numpy(value))
                continue
            shared.append(value)
            # The same memory and shape as last time: the request already points at it.
            key = (value.data_ptr(), value.shape)
            if slot.held[port] != key:
                request.set_input_tensor(port, wrap(value))
                slot.held[port] = key
        results: list[Any] = [None] * len(handle.outputs)
        for index, port, shape, dtype, wrap in handle.written_outputs:
            results[index] = result = torch.empty(shape, dtype=dtype)
            request.set_output_tensor(port, wrap(result))
        handle.infer(request, {}, True, False)
        for index, view in handle.copied_outputs:
            result = torch.from_numpy(slot.outputs[index].copy())
            results[index] = result if view is None else result.view(view)
        for index, plan in handle.dynamic_outputs:
            results[index] = taken_output(request, plan)
        for index, source in handle.passed_outputs:
            results[index] = inputs[source].detach().resolve_neg().resolve_conj().clone()
        for index, tensor in handle.copied_state:
            tensor.copy_(results[index])
        return results if handle.returned is None else [results[index] for index in handle.returned]
    except BaseException:
        # Whatever the request holds now is unknown: the next call sets every input again.
        slot.held = [None] * len(slot.held)
        raise
    finally:
        handle.idle.append(slot)


def taken_output(request: Any, plan: OutputPlan) -> torch.Tensor:
    """A dynamic output as a torch tensor over OpenVINO's own memory; the request gets a new tensor for next time."""
    import openvino

    tensor = request.get_output_tensor(plan.port)
    # The array keeps ``tensor`` (and so its memory) alive; torch keeps the array.
    result = torch.from_numpy(tensor.data)
    request.set_output_tensor(plan.port, openvino.Tensor(tensor.element_type, tensor.get_shape()))
    return result if result.dtype == plan.dtype else result.view(plan.dtype)
