"""aotstack against the CPU runtimes a user would pick instead, on three models, fp32 and bf16, 1 and 2 threads.

Workloads (``bench/workloads.py``; random weights, batch 1):

- bert:   a BERT encoder (28.8 M parameters: hidden 512, 4 layers, 8 heads), 128 tokens; ms per forward
- resnet: ResNet-50 (transformers' default ResNetConfig), one 224 x 224 image; ms per forward
- llama:  a Llama-style LM (99.5 M parameters: hidden 768, 8 layers, 12 heads, 4 KV heads) behind transformers'
          ``TorchExportableModuleForDecoderOnlyLM`` (static KV cache of 256); an 8-token prompt fed token by
          token, then 64 greedy tokens; tokens/s over the generated ones. An engine whose tokens differ from
          eager's gets no figure: "wrong" when, fed eager's tokens, its logits differ beyond the tolerance
          too; "differs" when they are within it (a near-tie: random weights leave the top logits close, and
          bf16 rounding in another order swaps two), its speed then in the note.

Engines (columns), every one given the same thread count (``torch.set_num_threads`` and its own setting):

- eager:             the module itself under ``torch.no_grad``
- plain AOTI:        ``aoti_compile_and_package`` of the exported program, ``aoti_load_package``
- ONNX Runtime:      ``torch.onnx.export(ep, dynamo=True)``, an ``InferenceSession`` with intra_op_num_threads
- OpenVINO:          ``openvino.convert_model(ep)``, static shapes, INFERENCE_PRECISION_HINT f32 or bf16 (this
                     kind of CPU would otherwise run fp32 in bf16), INFERENCE_NUM_THREADS, PERFORMANCE_HINT LATENCY
- ExecuTorch:        ``to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()``, run by
                     ``executorch.runtime`` from bytes (``pip install -e '.[bench]'``; the column says so without it)
- aotstack:          ``lower(Program({"forward": ep}), [AotiCpuPartitioner()])``, saved, ``aotstack.load``
- aotstack ORT+AOTI: ``[OrtPartitioner(), AotiCpuPartitioner()]``
- aotstack OV+AOTI:  ``[OpenVinoPartitioner(), AotiCpuPartitioner()]``, where aotstack has it
- aotstack auto:     ``lower(program, "auto")``, where aotstack takes it

A column the environment lacks (executorch not installed, a partitioner aotstack does not have yet)
says "unavailable" with the reason under the table. OpenVINO compiles in a child process first
(its CPU plugin has died of SIGFPE compiling a model here), and so does an aotstack file holding
OpenVINO delegates (``bench/child.py load``). Under ``bench/run.py`` (``make bench``) the benchmark
runs at 1 and 2 threads whatever ``--threads`` says.

ONNX Runtime and OpenVINO have no in-place buffers, so for the decoder the exported program's cache updates
become inputs and outputs (``CacheInOut``): ONNX Runtime's session is handed the cache and returns the new
one each step; OpenVINO's model is made stateful on those pairs (its own ReadValue/Assign state).

Inductor specialises its CPU kernels on the thread count at compile time (``#pragma omp parallel
num_threads(N)``), so whatever holds AOTInductor code (plain AOTI, every aotstack file) is compiled once
per thread count; the ONNX file, OpenVINO's converted model and ExecuTorch's program are made once per
workload and dtype and opened again for each thread count.

Every engine's output is compared with eager's first (max |difference| over max(1, max |eager|), within
1e-3 for fp32, 5e-2 for bf16); an engine that fails, or is wrong, shows that in its cell and the
benchmark goes on. Then rounds: each round times every engine once, in an order rotated by one per
round (a forward workload: a block of calls lasting about half a second, per call; the decoder: one
whole generation); the figure is the median over the rounds. An engine whose rounds so far took 90 s
sits out the rest (ExecuTorch's bf16 decode on portable kernels); its note says in how many it was
timed. One table per (threads, dtype); an aotstack cell has its ratio to the fastest single engine
(plain AOTI, ONNX Runtime, OpenVINO, ExecuTorch). The stacking table compares aotstack ORT+AOTI at 2
threads with the slower of ONNX Runtime alone and plain AOTI alone: two thread pools fighting over the
cores would show there.

    .venv/bin/python bench/peers.py [--workloads bert,resnet,llama] [--threads 1,2] [--dtypes fp32,bf16]
                                    [--rounds 5] [--quick]

``--quick``: much smaller models of the same architectures, fewer tokens and shorter blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind

import aotstack
from common import (
    Figure,
    Figures,
    Settings,
    median,
    print_figures,
    print_table,
    progress,
    quantity,
    quiet_known_warnings,
    run_child,
    save_inputs,
    use_private_caches,
)
from decode import PROMPT, decode
from stacked import engines as delegate_engines
from workloads import peer_bert, peer_llama, peer_resnet

WORKLOADS = ("bert", "resnet", "llama")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}  # max |engine - eager| over max(1, max |eager|)
THREADS = (1, 2)
QUICK_THREADS, QUICK_DTYPES = (2,), ("fp32",)  # --quick, unless given: one table, the stacking row included
ROUNDS = 5
TOKENS = {"full": 64, "quick": 16}
CACHE = {"full": 256, "quick": 64}
BLOCK_SECONDS = {"full": 0.5, "quick": 0.05}  # a forward workload's timed block, per engine and round
ENGINE_SECONDS = 90  # an engine whose rounds so far took this long sits out the rest (ExecuTorch's bf16 decode)
SETTLE_SECONDS = 0.02  # untimed, before each block: the previous engine's spinning threads go idle
STACKING_TARGET = 1.1  # ORT+AOTI at 2 threads / the slower of ORT alone and AOTI alone

EAGER, AOTI, ORT, OV, ET = "eager", "plain AOTI", "ONNX Runtime", "OpenVINO", "ExecuTorch"
STACK, STACK_ORT, STACK_OV, STACK_AUTO = "aotstack", "aotstack ORT+AOTI", "aotstack OV+AOTI", "aotstack auto"
ENGINES = (EAGER, AOTI, ORT, OV, ET, STACK, STACK_ORT, STACK_OV, STACK_AUTO)
SINGLE = (AOTI, ORT, OV, ET)  # one engine on the whole model: what an aotstack file is compared with
AOTSTACK_ENGINES = (STACK, STACK_ORT, STACK_OV, STACK_AUTO)


# Edge ops that only reshape or alias: not counted as work left to ExecuTorch's portable kernels.
VIEW_OPS = ("view", "squeeze", "unsqueeze", "expand", "permute", "transpose", "select", "slice", "alias", "t_copy",
            "clone", "_to_copy", "sym_size", "scalar_tensor")
MATMUL_OPS = ("mm", "bmm", "addmm", "baddbmm", "linear", "convolution", "matmul")


class Unavailable(Exception):
    """The engine is not there to run (not installed, not written yet): no figure, and not a failure."""


class Wrong(Exception):
    """The engine ran and its output differs from eager's."""


class NearTie(Exception):
    """The decoder's tokens differ from eager's, its logits do not: timed, reported without a figure."""

    def __init__(self, message: str, tokens: list[int]) -> None:
        super().__init__(message)
        self.tokens = tokens


@dataclass
class Runner:
    """One engine, ready at one thread count. ``call()`` for a forward; ``call(ids, position)`` for the decoder."""

    call: Callable[..., torch.Tensor]
    reset: Callable[[], None] = lambda: None
    detail: str = ""  # e.g. an aotstack file's delegates per engine


@dataclass
class Cell:
    """One engine's outcome at one (workload, dtype, threads): a median, or why there is none."""

    value: float | None = None
    kind: str = ""  # "" (measured), "unavailable", "failed", "wrong", "differs" (a near-tie; timed, no figure)
    reason: str = ""
    samples: list[float] = field(default_factory=list)
    difference: float | None = None  # max |engine - eager|, forward workloads
    detail: str = ""  # what the engine made of the model, e.g. an aotstack file's delegates
    tokens: list[int] | None = None  # the decoder's tokens every round must repeat: eager's, or its own near-tie
    rounds: int = 0  # rounds it was timed in

    def text(self) -> str:
        return self.kind if self.kind else quantity(self.value, "")


@dataclass
class Case:
    """One workload at one dtype: the model, its exported program, eager's answer, the shared artifacts."""

    workload: str
    dtype: str
    size: str
    model: torch.nn.Module  # forward workloads: the module; the decoder: the export wrapper's module
    args: tuple[torch.Tensor, ...]  # forward workloads only
    exported: torch.export.ExportedProgram
    reference: Any  # eager's output tensor, or its tokens, at the thread count being run
    artifacts: dict[str, Any] = field(default_factory=dict)  # engine -> its artifact, or the exception making it

    @property
    def decoder(self) -> bool:
        return self.workload == "llama"

    @property
    def unit(self) -> str:
        return "tokens/s" if self.decoder else "ms"

    @property
    def name(self) -> str:
        return f"{self.workload}-{self.dtype}"

    def artifact(self, engine: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per case, its result or its exception kept for every thread count."""
        if engine not in self.artifacts:
            started = time.perf_counter()
            try:
                self.artifacts[engine] = make()
                progress(f"{self.name}: {engine} artifact made in {time.perf_counter() - started:.1f} s")
            except Exception as exc:  # kept: each thread count reports the same reason
                self.artifacts[engine] = exc
        made = self.artifacts[engine]
        if isinstance(made, Exception):
            raise made
        return made


# The decoder's cache as inputs and outputs, for the engines without in-place buffers.


class CacheInOut(torch.nn.Module):
    """An exported program whose buffer updates become inputs and outputs.

    ``forward(*user_inputs, *state)`` returns ``(*user_outputs, *new_state)``, with ``state`` the
    buffers the program updates, in ``state_names`` order and starting from ``initial``. It calls the
    program's functional graph, so re-exporting it gives a program with no mutation at all.
    """

    def __init__(self, exported: torch.export.ExportedProgram) -> None:
        super().__init__()
        functional = exported.run_decompositions({})  # functionalized: updates become outputs
        signature = functional.graph_signature
        self.graph = functional.graph_module
        self.state_names = [s.target for s in signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
        self.user_inputs = len(signature.user_inputs)
        tensors = {**functional.state_dict, **functional.constants}
        self.initial = [tensors[name].clone() for name in self.state_names]
        # Each placeholder of the graph: ("user", i), ("state", i), or ("held", the attribute holding it).
        self.sources: list[tuple[str, Any]] = []
        for spec in signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                self.sources.append(("user", signature.user_inputs.index(spec.arg.name)))
            elif spec.target in self.state_names:
                self.sources.append(("state", self.state_names.index(spec.target)))
            else:
                attribute = f"held_{len(self.sources)}"
                self.register_buffer(attribute, tensors[spec.target])
                self.sources.append(("held", attribute))
        self.outputs = [
            self.state_names.index(s.target) if s.kind == OutputKind.BUFFER_MUTATION else None
            for s in signature.output_specs
        ]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        user, state = args[: self.user_inputs], args[self.user_inputs :]
        placeholders = [
            user[ref] if kind == "user" else state[ref] if kind == "state" else getattr(self, ref)
            for kind, ref in self.sources
        ]
        results = self.graph(*placeholders)
        new_state: list[torch.Tensor | None] = [None] * len(state)
        outputs = []
        for value, index in zip(results, self.outputs):
            if index is None:
                outputs.append(value)
            else:
                new_state[index] = value
        return (*outputs, *new_state)


def decoder_inputs(position: int = 0, token: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([[token]]), torch.tensor([position])


def cache_in_out(case: Case) -> tuple[torch.export.ExportedProgram, CacheInOut]:
    """The decoder with its cache as inputs and outputs, exported; made once for ONNX Runtime and OpenVINO."""

    def make() -> tuple[torch.export.ExportedProgram, CacheInOut]:
        wrapper = CacheInOut(case.exported)
        return torch.export.export(wrapper, (*decoder_inputs(), *wrapper.initial)), wrapper

    return case.artifact("cache in/out", make)


# Building the cases.


def build_case(workload: str, dtype: str, size: str) -> Case:
    torch_dtype = DTYPES[dtype]
    if workload == "llama":
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        model = peer_llama(size, CACHE[size]).to(torch_dtype)

        def wrapped() -> TorchExportableModuleForDecoderOnlyLM:
            return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE[size])

        exported = wrapped().export(input_ids=decoder_inputs()[0], cache_position=decoder_inputs()[1])
        # Eager runs a cache of its own: the exported program's buffers stay as exported (zeros).
        return Case(workload, dtype, size, wrapped().model, (), exported, None)
    model, args = {"bert": peer_bert, "resnet": peer_resnet}[workload](size)
    model = model.to(torch_dtype)
    args = tuple(a.to(torch_dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        exported = torch.export.export(model, args)
    return Case(workload, dtype, size, model, args, exported, None)


# The engines. Each builder returns a Runner at the current thread count, or raises.


def eager_runner(case: Case, threads: int, settings: Settings) -> Runner:
    model = case.model
    if case.decoder:
        return Runner(lambda ids, pos: model(input_ids=ids, cache_position=pos))
    args = case.args

    def call() -> torch.Tensor:
        with torch.no_grad():
            return model(*args)

    return Runner(call)


def aoti_runner(case: Case, threads: int, settings: Settings) -> Runner:
    path = settings.path(f"peers-{case.name}-{threads}t-aoti.pt2")
    started = time.perf_counter()
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(case.exported, package_path=path)
    progress(f"{case.name}: plain AOTI compiled for {threads} thread(s) in {time.perf_counter() - started:.1f} s")
    package = torch._inductor.aoti_load_package(path)
    if case.decoder:
        return Runner(lambda ids, pos: package(input_ids=ids, cache_position=pos))
    args = case.args
    return Runner(lambda: package(*args))


def numpy_of(tensor: torch.Tensor) -> Any:
    if tensor.dtype == torch.bfloat16:
        raise Unavailable("numpy, which ONNX Runtime's Python API takes, has no bfloat16")
    return tensor.numpy()


def ort_runner(case: Case, threads: int, settings: Settings) -> Runner:
    import onnxruntime

    def export() -> str:
        path = settings.path(f"peers-{case.name}.onnx")
        program, args = (cache_in_out(case)[0], None) if case.decoder else (case.exported, case.args)
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
            torch.onnx.export(program, args, dynamo=True).save(path)
        return path

    path = case.artifact(ORT, export)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if not case.decoder:
        feeds = dict(zip(names, (numpy_of(a) for a in case.args)))
        return Runner(lambda: torch.from_numpy(session.run(None, feeds)[0]))
    initial = [numpy_of(t) for t in cache_in_out(case)[1].initial]  # ONNX Runtime never writes its inputs
    cache = list(initial)

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        results = session.run(None, dict(zip(names, [ids.numpy(), pos.numpy(), *cache])))
        cache[:] = results[1:]
        return torch.from_numpy(results[0])

    def reset() -> None:
        cache[:] = initial

    return Runner(step, reset)


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


# compile_model and one call on zeros in a child process first: OpenVINO 2026.4's CPU plugin dies of
# SIGFPE compiling some models (the bf16 Llama at one thread), which would end the whole benchmark.
OPENVINO_PROBE = """
import json, sys
import openvino
compiled = openvino.Core().compile_model(sys.argv[1], "CPU", json.loads(sys.argv[2]))
request = compiled.create_infer_request()
for port in compiled.inputs:
    tensor = openvino.Tensor(port.get_element_type(), port.get_shape())
    tensor.data[...] = 0
    request.set_tensor(port, tensor)
request.infer()
"""


def probe_openvino(path: str, config: dict[str, Any]) -> None:
    done = subprocess.run([sys.executable, "-c", OPENVINO_PROBE, path, json.dumps(config)],
                          capture_output=True, text=True, check=False)
    if done.returncode < 0:
        raise RuntimeError(f"compile_model killed the process with {signal.Signals(-done.returncode).name} "
                           "(seen in a child process)")
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(f"compile_model or a first call failed in a child process: {' '.join(lines[-3:])}")


def probe_aotstack(case: Case, path: str, threads: int, settings: Settings) -> None:
    """``aotstack.load`` and one call in a fresh process (bench/child.py), for a file OpenVINO compiles in."""
    if case.decoder:
        inputs = save_inputs(settings.path(f"peers-{case.name}-inputs.pt"),
                             kwargs=dict(zip(("input_ids", "cache_position"), decoder_inputs())))
    else:
        inputs = save_inputs(settings.path(f"peers-{case.name}-inputs.pt"), case.args)
    try:
        run_child(["load", "aotstack", path, inputs, str(threads)])
    except RuntimeError as exc:
        status = re.search(r"failed \((-\d+)\)", str(exc))
        if status:
            raise RuntimeError(f"load + first call killed the process with {signal.Signals(-int(status[1])).name} "
                               "(seen in a child process)") from None
        raise RuntimeError(f"load + first call failed in a child process: {str(exc).splitlines()[-1]}") from None


def ov_runner(case: Case, threads: int, settings: Settings) -> Runner:
    import openvino

    def convert() -> str:
        if not case.decoder:
            model = openvino.convert_model(case.exported)
            model.reshape({port: openvino.PartialShape(list(a.shape)) for port, a in zip(model.inputs, case.args)})
        else:
            from openvino._offline_transformations import apply_make_stateful_transformation

            program, wrapper = cache_in_out(case)
            model = openvino.convert_model(program)
            example = [*decoder_inputs(), *wrapper.initial]
            model.reshape({port: openvino.PartialShape(list(t.shape)) for port, t in zip(model.inputs, example)})
            cache = range(len(wrapper.initial))
            for port, name in zip(model.inputs, ["input_ids", "cache_position", *(f"cache_in_{i}" for i in cache)]):
                port.get_tensor().set_names({name})
            for port, name in zip(model.outputs, ["logits", *(f"cache_out_{i}" for i in cache)]):
                port.get_tensor().set_names({name})
            # The cache tensors become OpenVINO's own state (zeros after reset_state). Integer ones (the
            # cache's one-element position counters) stay inputs and outputs: the CPU plugin refuses an
            # i64 state under a bf16 precision hint.
            apply_make_stateful_transformation(model, {
                f"cache_in_{i}": f"cache_out_{i}" for i, t in enumerate(wrapper.initial) if t.is_floating_point()
            })
        path = settings.path(f"peers-{case.name}.xml")
        openvino.save_model(model, path, compress_to_fp16=False)
        return path

    path = case.artifact(OV, convert)
    config = {
        "INFERENCE_PRECISION_HINT": "bf16" if case.dtype == "bf16" else "f32",
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
    }
    probe_openvino(path, config)
    request = openvino.Core().compile_model(path, "CPU", config).create_infer_request()
    if not case.decoder:
        inputs = [ov_tensor(a) for a in case.args]

        def call() -> torch.Tensor:
            request.infer(inputs)
            return from_ov(request.get_output_tensor(0))

        return Runner(call)

    initial = cache_in_out(case)[1].initial
    outside = {i: initial[i] for i, t in enumerate(initial) if not t.is_floating_point()}  # passed in and out

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        feeds = {f"cache_in_{i}": ov_tensor(t) for i, t in outside.items()}
        request.infer({"input_ids": ov_tensor(ids), "cache_position": ov_tensor(pos), **feeds})
        for i in outside:
            outside[i] = from_ov(request.get_tensor(f"cache_out_{i}"))
        return from_ov(request.get_tensor("logits"))

    def reset() -> None:
        request.reset_state()
        outside.update({i: initial[i] for i in outside})

    return Runner(step, reset)


def executorch_runner(case: Case, threads: int, settings: Settings) -> Runner:
    if importlib.util.find_spec("executorch") is None:
        raise Unavailable("executorch is not installed: pip install -e '.[bench]' (make bench does)")

    def lower() -> tuple[bytes, str]:
        with contextlib.redirect_stdout(io.StringIO()):  # torchao prints its missing CUDA libraries
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            from executorch.exir import to_edge_transform_and_lower
        edge = to_edge_transform_and_lower(case.exported, partitioner=[XnnpackPartitioner()])
        graph = edge.exported_program().graph
        names = [getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"]
        delegates = names.count("executorch_call_delegate")
        if not delegates:
            raise Unavailable(f"XNNPACK takes no part of the {case.dtype} model (portable kernels only)")
        left = [name for name in names if name.startswith("aten.") and not any(v in name for v in VIEW_OPS)]
        heavy = sum(name.split(".")[1] in MATMUL_OPS for name in left)
        detail = (f"{delegates} XNNPACK delegates; on portable kernels {heavy} matmul/conv ops, "
                  f"{len(left) - heavy} others")
        progress(f"{case.name}: ExecuTorch: {detail}")
        return edge.to_executorch().buffer, detail

    program_bytes, detail = case.artifact(ET, lower)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    _unsafe_reset_threadpool(threads)  # XNNPACK's pool; no method is running now
    program = Runtime.get().load_program(program_bytes)
    method = [program.load_method("forward")]
    if not case.decoder:
        args = list(case.args)
        return Runner(lambda: method[0].execute(args)[0], detail=detail)

    def reset() -> None:  # the cache lives in the method's planned memory
        method[0] = program.load_method("forward")

    return Runner(lambda ids, pos: method[0].execute([ids, pos])[0], reset, detail)


def aotstack_partitioners(engine: str) -> list[aotstack.Partitioner] | str:
    if engine == STACK:
        return [aotstack.AotiCpuPartitioner()]
    if engine == STACK_ORT:
        return [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()]
    if engine == STACK_OV:
        try:
            openvino_partitioner = aotstack.OpenVinoPartitioner
        except (AttributeError, ImportError) as exc:
            raise Unavailable(f"aotstack has no OpenVinoPartitioner yet ({type(exc).__name__})") from exc
        return [openvino_partitioner(), aotstack.AotiCpuPartitioner()]
    return "auto"


def aotstack_runner(engine: str) -> Callable[[Case, int, Settings], Runner]:
    def build(case: Case, threads: int, settings: Settings) -> Runner:
        tag = engine.removeprefix("aotstack").strip().replace("+", "-").lower() or "aoti"
        path = settings.path(f"peers-{case.name}-{threads}t-aotstack-{tag}.pt2")
        program = aotstack.Program({"forward": case.exported})
        partitioners = aotstack_partitioners(engine)
        started = time.perf_counter()
        try:
            lowered = aotstack.lower(program, partitioners)
        except (TypeError, aotstack.LoweringError) as exc:
            if partitioners == "auto" and (isinstance(exc, TypeError) or "Partitioner" in str(exc)):
                raise Unavailable(f"lower(program, 'auto') not taken yet: {exc}") from exc
            raise
        lowered.save(path)
        detail = delegate_engines(lowered.delegates("forward")) or "no delegate"
        progress(f"{case.name}: {engine} lowered for {threads} thread(s) in {time.perf_counter() - started:.1f} s "
                 f"({detail})")
        if any(d.backend_id == "openvino" for d in lowered.delegates("forward")):
            probe_aotstack(case, path, threads, settings)  # OpenVINO's compile can kill the process
        loaded = aotstack.load(path)  # after torch.set_num_threads: its ONNX Runtime sessions read it here
        if case.decoder:
            return Runner(lambda ids, pos: loaded.forward(input_ids=ids, cache_position=pos), loaded.reset, detail)
        args = case.args
        return Runner(lambda: loaded.forward(*args), detail=detail)

    return build


BUILDERS: dict[str, Callable[[Case, int, Settings], Runner]] = {
    EAGER: eager_runner,
    AOTI: aoti_runner,
    ORT: ort_runner,
    OV: ov_runner,
    ET: executorch_runner,
    **{engine: aotstack_runner(engine) for engine in AOTSTACK_ENGINES},
}


# Checking and timing.


def short(exc: BaseException, limit: int = 200) -> str:
    """The exception's type and message on one line, without OpenVINO's source locations."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(("Exception from src/", "Check '"))] or lines
    text = re.sub(r"Load model from \S+ failed:", "", f"{type(exc).__name__}: {' / '.join(lines)}")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def outcome(exc: BaseException) -> Cell:
    kinds = {Unavailable: "unavailable", Wrong: "wrong", NearTie: "differs"}
    kind = next((name for cls, name in kinds.items() if isinstance(exc, cls)), "failed")
    return Cell(kind=kind, reason=str(exc) if kind != "failed" else short(exc))


def check_forward(case: Case, runner: Runner) -> float:
    """Max |engine - eager|; raises Wrong beyond the dtype's tolerance."""
    output, expected = runner.call(), case.reference
    if tuple(output.shape) != tuple(expected.shape):
        raise Wrong(f"output shape {tuple(output.shape)}, eager's {tuple(expected.shape)}")
    difference = (output.float() - expected.float()).abs().max().item()
    allowed = TOLERANCE[case.dtype] * max(1.0, expected.float().abs().max().item())
    if not difference <= allowed:  # NaN included
        raise Wrong(f"max |difference from eager| {difference:.3g}, allowed {allowed:.3g}")
    return difference


def first_difference(tokens: list[int], expected: list[int]) -> int:
    return next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)


def forced_logits(step: Callable[..., torch.Tensor], case: Case) -> torch.Tensor:
    """Last-position logits of every step, fed the prompt and then eager's tokens (teacher forcing)."""
    with torch.no_grad():
        sequence = [*PROMPT, *case.reference]
        return torch.stack([step(*decoder_inputs(p, t))[0, -1].float() for p, t in enumerate(sequence)])


def check_decoder(case: Case, runner: Runner, eager_logits: Callable[[], torch.Tensor]) -> list[int]:
    """The engine's greedy tokens, when they are eager's; otherwise raise Wrong or NearTie.

    With random weights the top logits are close, and in bf16 summing in another order can swap
    two of them. So where the tokens differ the engine is fed eager's tokens, and its logits at
    every step are compared with eager's: within the dtype's tolerance, a near-tie (no figure all
    the same); beyond it, wrong.
    """
    runner.reset()
    tokens = decode(runner.call, TOKENS[case.size])[0]
    if tokens == case.reference:
        return tokens
    first = first_difference(tokens, case.reference)
    runner.reset()
    expected = eager_logits()
    difference = (forced_logits(runner.call, case) - expected).abs().max().item()
    allowed = TOLERANCE[case.dtype] * max(1.0, expected.abs().max().item())
    differ = f"generated tokens differ from eager's from token {first} on"
    if not difference <= allowed:
        raise Wrong(f"{differ}; fed eager's tokens, max |logits - eager's| {difference:.3g}, allowed {allowed:.3g}")
    raise NearTie(f"{differ}, a near-tie: fed eager's tokens, its logits are within {difference:.2g} of "
                  f"eager's (allowed {allowed:.2g})", tokens)


def timed_block(runner: Runner, calls: int) -> float:
    """Milliseconds per call over ``calls`` back-to-back calls."""
    started = time.perf_counter_ns()
    for _ in range(calls):
        runner.call()
    return (time.perf_counter_ns() - started) / calls / 1e6


def measure_rounds(case: Case, runners: dict[str, Runner], cells: dict[str, Cell], rounds: int) -> None:
    """Each round times every engine once, the order rotated by one per round; medians into ``cells``.

    An engine whose rounds so far took ENGINE_SECONDS sits out the rest.
    """
    tokens = TOKENS[case.size]
    calls: dict[str, int] = {}
    spent = dict.fromkeys(runners, 0.0)
    if not case.decoder:  # a block lasts about BLOCK_SECONDS
        for name, runner in list(runners.items()):
            try:
                per_call = timed_block(runner, 1) / 1e3
            except Exception as exc:
                cells[name], _ = outcome(exc), runners.pop(name)
                continue
            calls[name] = max(1, math.ceil(BLOCK_SECONDS[case.size] / max(per_call, 1e-6)))
    order = list(runners)
    gc.collect()
    gc.disable()
    try:
        for index in range(rounds):
            shift = index % max(1, len(order))
            for name in order[shift:] + order[:shift]:
                if name not in runners or spent[name] >= ENGINE_SECONDS:
                    continue
                time.sleep(SETTLE_SECONDS)
                runner = runners[name]
                started = time.perf_counter()
                try:
                    if case.decoder:
                        runner.reset()
                        generated, seconds = decode(runner.call, tokens)
                        if generated != cells[name].tokens:
                            first = first_difference(generated, cells[name].tokens)
                            raise Wrong(f"round {index + 1}: tokens differ from its first run's from token {first} on")
                        cells[name].samples.append(tokens / seconds)
                    else:
                        cells[name].samples.append(timed_block(runner, calls[name]))
                except Exception as exc:
                    cells[name], _ = outcome(exc), runners.pop(name)
                spent[name] += time.perf_counter() - started
    finally:
        gc.enable()
    for name in runners:
        cells[name].rounds = len(cells[name].samples)
        slow = f"timed in {cells[name].rounds} of {rounds} rounds (slow)" if cells[name].rounds < rounds else ""
        if slow:
            cells[name].detail = f"{cells[name].detail}; {slow}" if cells[name].detail else slow
        if cells[name].kind:  # a near-tie: the figure goes in the note, not in the table
            measured = quantity(median(cells[name].samples), case.unit)
            cells[name].reason += f"; measured {measured}" + (f", {slow}" if slow else "")
        else:
            cells[name].value = median(cells[name].samples)
    spread = ", ".join(f"{name} {quantity(min(c.samples), '')}-{quantity(max(c.samples), '')}"
                       for name, c in cells.items() if name in runners)
    progress(f"{case.name}: range over the rounds: {spread}")


def run_threads(case: Case, threads: int, settings: Settings, rounds: int) -> dict[str, Cell]:
    """Every engine on ``case`` at ``threads``: built, checked against eager, timed."""
    torch.set_num_threads(threads)
    eager = eager_runner(case, threads, settings)
    with torch.no_grad():  # the reference, at this thread count: summing in another order may change a token
        case.reference = decode(eager.call, TOKENS[case.size])[0] if case.decoder else eager.call()
    logits: list[torch.Tensor] = []

    def eager_logits() -> torch.Tensor:  # eager's, fed its own tokens; once, where an engine's tokens differ
        if not logits:
            logits.append(forced_logits(eager.call, case))
        return logits[0]

    cells: dict[str, Cell] = {}
    runners: dict[str, Runner] = {}
    for engine in ENGINES:
        runner = None
        try:
            runner = BUILDERS[engine](case, threads, settings)
            if case.decoder:  # also the warm-up
                cells[engine] = Cell(detail=runner.detail, tokens=check_decoder(case, runner, eager_logits))
            else:
                runner.call()  # the first call may set up
                cells[engine] = Cell(difference=check_forward(case, runner), detail=runner.detail)
            runners[engine] = runner
        except NearTie as tie:  # timed all the same; the figure goes in its note
            cells[engine] = Cell(kind="differs", reason=str(tie), detail=runner.detail, tokens=tie.tokens)
            runners[engine] = runner
            progress(f"{case.name} {threads}t: {engine}: differs: {tie}")
        except Exception as exc:  # one engine failing must not stop the others
            cells[engine] = outcome(exc)
            progress(f"{case.name} {threads}t: {engine}: {cells[engine].kind}: {cells[engine].reason}")
    if not case.decoder:
        differences = ", ".join(f"{n} {c.difference:.1e}" for n, c in cells.items() if c.difference is not None)
        progress(f"{case.name} {threads}t: max |engine - eager|: {differences}")
    progress(f"{case.name} {threads}t: timing {len(runners)} engines, {rounds} rounds ...")
    measure_rounds(case, runners, cells, rounds)
    return cells


# Reporting.


def fastest_single(cells: dict[str, Cell], unit: str) -> tuple[str, float] | None:
    measured = [(name, cells[name].value) for name in SINGLE if cells[name].value is not None]
    if not measured:
        return None
    pick = max if unit == "tokens/s" else min
    return pick(measured, key=lambda item: item[1])


Results = dict[tuple[str, str, int], dict[str, Cell]]  # (workload, dtype, threads) -> engine -> cell


def print_tables(results: Results, units: dict[str, str]) -> None:
    configurations = sorted({(threads, dtype) for _, dtype, threads in results}, key=lambda c: (c[0], c[1]))
    for threads, dtype in configurations:
        notes: dict[str, int] = {}
        rows = []
        for workload in WORKLOADS:
            cells = results.get((workload, dtype, threads))
            if cells is None:
                continue
            best = fastest_single(cells, units[workload])
            row = [workload, units[workload]]
            for engine in ENGINES:
                cell = cells[engine]
                text = cell.text()
                if cell.kind:
                    text += f" [{notes.setdefault(f'{engine}: {cell.reason}', len(notes) + 1)}]"
                elif engine in AOTSTACK_ENGINES and best is not None:
                    text += f" ({cell.value / best[1]:.2f}x)"
                row.append(text)
            row.append("-" if best is None else f"{best[0]} {quantity(best[1], '')}")
            rows.append(row)
        print(f"\n  {threads} thread(s), {dtype}: median of the rounds; ms per forward (lower is better), "
              "tokens/s (higher is better);\n  (x): aotstack's figure / the fastest single engine's")
        print_table(["workload", "unit", *ENGINES, "fastest single"], rows)
        for text, number in notes.items():
            print(f"  [{number}] {text}")


def stacking_threads(threads: Sequence[int]) -> int | None:
    return 2 if 2 in threads else max((t for t in threads if t > 1), default=None)


def time_of(cell: Cell, decoder: bool) -> float | None:
    """Milliseconds per forward, or per token for the decoder."""
    if cell.value is None:
        return None
    return 1e3 / cell.value if decoder else cell.value


def stacking_figures(results: Results, units: dict[str, str], threads: int) -> Figures:
    """ORT+AOTI stacked vs the slower of ORT alone and AOTI alone, as time per forward or per token."""
    figures: Figures = {}
    rows = []
    for (workload, dtype, count), cells in results.items():
        if count != threads:
            continue
        decoder = units[workload] == "tokens/s"
        stacked = time_of(cells[STACK_ORT], decoder)
        alone = [time_of(cells[ORT], decoder), time_of(cells[AOTI], decoder)]
        slower = None if None in alone else max(alone)
        missing = [n for n, v in zip((STACK_ORT, ORT, AOTI), (stacked, *alone)) if v is None]
        unit = "ms/token" if decoder else "ms"
        figure = Figure(stacked, unit, slower, None if slower is None else STACKING_TARGET,
                        note=f"not measured: {', '.join(missing)}" if missing else "")
        figures[f"{workload} {dtype} {threads}t: {STACK_ORT} / slower of {ORT}, {AOTI} alone"] = figure
        rows.append([workload, dtype, unit, quantity(stacked, ""), quantity(alone[0], ""), quantity(alone[1], ""),
                     "" if figure.ratio is None else f"{figure.ratio:.2f}x", figure.result or "n/a"])
    if rows:
        print(f"\n  stacking at {threads} threads: {STACK_ORT} / the slower of {ORT} alone and {AOTI} alone "
              f"(target <= {STACKING_TARGET}x)")
        print_table(["workload", "dtype", "unit", STACK_ORT, ORT, AOTI, "ratio", "result"], rows)
    return figures


def engine_figures(results: Results, units: dict[str, str]) -> Figures:
    figures: Figures = {}
    for (workload, dtype, threads), cells in results.items():
        unit = units[workload]
        best = fastest_single(cells, unit)
        for engine, cell in cells.items():
            note = f"{cell.kind}: {cell.reason}" if cell.kind else cell.detail
            figure = Figure(cell.value, unit, higher_is_better=unit == "tokens/s", note=note)
            if engine in AOTSTACK_ENGINES and best is not None:
                figure.baseline = best[1]
                figure.note = f"{note}; " if note else ""
                figure.note += f"baseline: the fastest single engine, {best[0]}"
            figures[f"{workload} {dtype} {threads}t: {engine}"] = figure
    return figures


def versions() -> str:
    names = ("torch", "onnxruntime", "openvino", "executorch", "transformers")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def peers(
    settings: Settings,
    workloads: Sequence[str] = WORKLOADS,
    threads: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    rounds: int = ROUNDS,
) -> Figures:
    size = settings.pick("full", "quick")
    threads = threads or settings.pick(THREADS, QUICK_THREADS)
    dtypes = dtypes or settings.pick(tuple(DTYPES), QUICK_DTYPES)
    print(f"  {versions()}")
    print(f"  workloads {', '.join(workloads)}; threads {', '.join(map(str, threads))}; dtypes {', '.join(dtypes)}; "
          f"{rounds} rounds; {size} models")
    results: Results = {}
    units = {w: "tokens/s" if w == "llama" else "ms" for w in WORKLOADS}
    before = torch.get_num_threads()
    started = time.perf_counter()
    try:
        for workload in workloads:
            for dtype in dtypes:
                progress(f"{workload}-{dtype}: building the model, exporting, eager's reference ...")
                case = build_case(workload, dtype, size)
                for count in threads:
                    results[(workload, dtype, count)] = run_threads(case, count, settings, rounds)
                del case
                gc.collect()
    finally:
        torch.set_num_threads(before)
    progress(f"all cases done in {time.perf_counter() - started:.0f} s")
    print_tables(results, units)
    figures = engine_figures(results, units)
    stacking = stacking_threads(threads)
    if stacking is not None:
        figures.update(stacking_figures(results, units, stacking))
    return figures


def comma_list(kind: Callable[[str], Any], allowed: Sequence[Any] | None = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(part) for part in text.split(",") if part.strip()]
        if not values or (allowed is not None and any(v not in allowed for v in values)):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(map(str, allowed or ['N']))}")
        return values

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=comma_list(str, WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--threads", type=comma_list(int), default=None,
                        help=f"default {','.join(map(str, THREADS))}; --quick: {','.join(map(str, QUICK_THREADS))}")
    parser.add_argument("--dtypes", type=comma_list(str, tuple(DTYPES)), default=None,
                        help=f"default {','.join(DTYPES)}; --quick: {','.join(QUICK_DTYPES)}")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--quick", action="store_true",
                        help="much smaller models, fewer tokens, shorter blocks, one configuration")
    options = parser.parse_args()
    quiet_known_warnings()
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, {os.cpu_count()} CPUs")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_caches(directory)
        settings = Settings(directory, quick=options.quick)
        figures = peers(settings, options.workloads, options.threads, options.dtypes, options.rounds)
    print_figures(figures)
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
