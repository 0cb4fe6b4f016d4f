"""Each engine's file opened for calls, in the process that times it (``child.py serve``, ``common.Worker``).

``open_engine(kind, path, threads, args, state, precision)`` gives an ``Opened``: ``forward()`` for a forward
workload (its arguments, ``args``, converted once here, outside any timing), ``step(ids, position)`` for the
decoder, and ``reset()``, which puts the decoder's cache back. ``block_ms`` and ``forced_logits`` are what the
benchmark asks of them, wherever the engine runs. Kinds:

- aotstack:     ``aotstack.load``; the decoder's cache is the file's own state
- executorch:   ExecuTorch's runtime; the cache lives in the method's planned memory (reset: the method again)
- aoti:         ``torch._inductor.aoti_load_package``
- onnxruntime:  an ``InferenceSession`` (intra_op_num_threads); the decoder's cache goes in and out each step,
                from ``state`` (the initial cache tensors)
- openvino:     ``compile_model`` (INFERENCE_NUM_THREADS, PERFORMANCE_HINT LATENCY, ``precision``); the decoder's
                floating cache is OpenVINO's own state, its integer tensors (``state``'s) go in and out

Only the process that opens an engine imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Opened:
    forward: Callable[[], torch.Tensor] | None = None
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    reset: Callable[[], None] = lambda: None


def block_ms(forward: Callable[[], torch.Tensor], calls: int) -> float:
    """Milliseconds per call over ``calls`` back-to-back calls of ``forward``."""
    started = time.perf_counter_ns()
    for _ in range(calls):
        forward()
    return (time.perf_counter_ns() - started) / calls / 1e6


def forced_logits(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sequence: Sequence[int]) -> torch.Tensor:
    """One ``step`` per token of ``sequence`` from position 0 (teacher forcing): the last position's logits, stacked."""
    with torch.no_grad():
        return torch.stack([step(torch.tensor([[token]]), torch.tensor([position]))[0, -1].float()
                            for position, token in enumerate(sequence)])


class NoBfloat16(Exception):
    """An engine's Python API cannot take a bfloat16 tensor."""


def open_engine(kind: str, path: str, threads: int, args: Sequence[torch.Tensor] | None,
                state: Sequence[torch.Tensor] | None, precision: str) -> Opened:
    """``path`` open in ``kind``'s engine at ``threads``; a forward with ``args``, else the decoder."""
    torch.set_num_threads(threads)  # before the load: aotstack's ONNX Runtime sessions read it there
    openers = {"aotstack": open_aotstack, "executorch": open_executorch, "aoti": open_aoti,
               "onnxruntime": open_onnxruntime, "openvino": open_openvino}
    return openers[kind](path, threads, args, state, precision)


def open_aotstack(path: str, threads: int, args: Any, state: Any, precision: str) -> Opened:
    import aotstack

    loaded = aotstack.load(path)
    if args is not None:
        return Opened(forward=lambda: loaded.forward(*args))
    return Opened(step=lambda ids, position: loaded.forward(input_ids=ids, cache_position=position),
                  reset=loaded.reset)


def open_executorch(path: str, threads: int, args: Any, state: Any, precision: str) -> Opened:
    import executorch.kernels.quantized  # noqa: F401  (a quantized embedding's kernels)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    _unsafe_reset_threadpool(threads)  # XNNPACK's pool, one per process; nothing has started on it
    program = Runtime.get().load_program(path)
    method = [program.load_method("forward")]

    # ``reset`` holds ``program``: executorch 1.5 frees a program no Python object holds, and its method crashes
    # (SIGSEGV in Method::inputs_size) on its next call.
    def reset() -> None:
        method[0] = program.load_method("forward")

    if args is not None:
        listed = list(args)
        return Opened(forward=lambda: method[0].execute(listed)[0], reset=reset)
    return Opened(step=lambda ids, position: method[0].execute([ids, position])[0], reset=reset)


def open_aoti(path: str, threads: int, args: Any, state: Any, precision: str) -> Opened:
    import torch._inductor

    package = torch._inductor.aoti_load_package(path)
    if args is not None:
        return Opened(forward=lambda: package(*args))
    return Opened(step=lambda ids, position: package(input_ids=ids, cache_position=position))


def numpy_of(tensor: torch.Tensor) -> Any:
    if tensor.dtype == torch.bfloat16:
        raise NoBfloat16("numpy, which ONNX Runtime's Python API takes, has no bfloat16")
    return tensor.numpy()


def open_onnxruntime(path: str, threads: int, args: Any, state: Any, precision: str) -> Opened:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if args is not None:
        feeds = dict(zip(names, (numpy_of(a) for a in args)))
        return Opened(forward=lambda: torch.from_numpy(session.run(None, feeds)[0]))
    initial = [numpy_of(t) for t in state]  # ONNX Runtime never writes its inputs
    cache = list(initial)

    def step(ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        results = session.run(None, dict(zip(names, [ids.numpy(), position.numpy(), *cache])))
        cache[:] = results[1:]
        return torch.from_numpy(results[0])

    def reset() -> None:
        cache[:] = initial

    return Opened(step=step, reset=reset)


def ov_tensor(tensor: torch.Tensor) -> Any:
    import openvino

    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: the bits, typed by OpenVINO
        return openvino.Tensor(tensor.view(torch.int16).numpy(), list(tensor.shape), openvino.Type.bf16)
    return openvino.Tensor(tensor.numpy())


def from_ov(tensor: Any) -> torch.Tensor:
    import numpy
    import openvino

    copied = torch.from_numpy(numpy.array(tensor.data))  # the request reuses its output memory
    return copied.view(torch.bfloat16) if tensor.element_type == openvino.Type.bf16 else copied


def open_openvino(path: str, threads: int, args: Any, state: Any, precision: str) -> Opened:
    import openvino

    config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    request = openvino.Core().compile_model(path, "CPU", config).create_infer_request()
    if args is not None:
        inputs = [ov_tensor(a) for a in args]

        def forward() -> torch.Tensor:
            request.infer(inputs)
            return from_ov(request.get_output_tensor(0))

        return Opened(forward=forward)

    # The floating cache tensors are the model's own state; the integer ones go in and out (``peers.ov_runner``).
    outside = {i: t for i, t in enumerate(state) if not t.is_floating_point()}
    initial = dict(outside)

    def step(ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        feeds = {f"cache_in_{i}": ov_tensor(t) for i, t in outside.items()}
        request.infer({"input_ids": ov_tensor(ids), "cache_position": ov_tensor(position), **feeds})
        for i in outside:
            outside[i] = from_ov(request.get_tensor(f"cache_out_{i}"))
        return from_ov(request.get_tensor("logits"))

    def reset() -> None:
        request.reset_state()
        outside.update(initial)

    return Opened(step=step, reset=reset)
