"""aotstack against the CPU runtimes a user would pick instead, on three models, fp32 and bf16, 1 and 2 threads;
and the Llama decode quantized.

Workloads (``bench/workloads.py``; random weights, batch 1):

- bert:   a BERT encoder (28.8 M parameters: hidden 512, 4 layers, 8 heads), 128 tokens; ms per forward
- resnet: ResNet-50 (transformers' default ResNetConfig), one 224 x 224 image; ms per forward
- llama:  a Llama-style LM (99.5 M parameters: hidden 768, 8 layers, 12 heads, 4 KV heads) behind transformers'
          ``TorchExportableModuleForDecoderOnlyLM`` (static KV cache of 256); an 8-token prompt fed token by
          token, then 64 greedy tokens; tokens/s over the generated ones. An engine whose tokens differ from
          eager's gets no figure when, fed eager's tokens, its logits differ beyond the tolerance too ("wrong").
          Within it, a near-tie (random weights leave the top logits close, and bf16 rounding in another
          order swaps two): in float32 "differs", its speed in the note; in bf16 and the quantized dtypes,
          its figure, with a note.

Quantized "dtypes" (``--dtypes fp32,8w,8da8w,4w,8da4w``; bert and llama, resnet skipped): the float32 model
through ``aotstack.quantize`` (torchao, ExecuTorch's scheme names), linears and embeddings alike:

- 8w:    linear 8w (int8 weights),                       embedding 8w; one scale per output channel
- 8da8w: linear 8da8w (int8 weights, int8 activations),  embedding 8w; one scale per output channel
- 4w:    linear 4w (int4 weights),                       embedding 4w; groups of 32
- 8da4w: linear 8da4w (int4 weights, int8 activations),  embedding 4w; groups of 32

(int8 per channel, int4 in groups of 32: what ExecuTorch's LLM export uses; XNNPACK takes group-wise
scales for int4 only.) Every engine gets the same program: the one ``aotstack.Program`` makes of the
export (decomposed, torchao's tensor-subclass weights unwrapped into the int8 values, scales and zero
points they hold, with torchao's quantize/dequantize ops between). Eager runs the quantized module, and
is every engine's reference; the tolerance is 5e-2 (engines quantize activations and accumulate
integers in their own order and rounding), and a near-tie keeps its figure (the note says so): eager's
own dynamic activation quantization rounds differently from every engine's. ExecuTorch's program is made with
``do_quant_fusion_and_const_prop`` (what XNNPACK leaves of torchao's patterns, the quantized embedding,
becomes ExecuTorch's quantized kernels' ops, as its LLM export does). For the decoder, quantized or not,
three more tables: tokens/s by scheme (rows) and engine; each engine's file size against the weights
(quantized values counted at their bit width, with their scales and zero points) and the exported
program's tensors (torchao holds an int4 value in an int8); and the resident memory a fresh process
adds by load + one call (``bench/child.py load``, over its RSS after ``import torch, aotstack``; what
the load imports counts) for plain AOTI, ExecuTorch and each aotstack file, against the weights. Then
the quantization issue's targets, met or not: 8da4w aotstack (its fastest order, and auto) >= 3x the
tokens/s of fp32 aotstack (AOTI alone; its file, saved by the fp32 case, timed again in the scheme's own
rounds, since the machine's speed drifts between cases) and >= 1.2x ExecuTorch XNNPACK alone; each aotstack order's
8da4w file <= 0.3x the fp32 aotstack file; its RSS after load <= 1.15x the quantized weights.
``bench/run.py --only quantized`` runs llama at fp32 and the four schemes at ``--threads``.

Engines (columns), every one given the same thread count (``torch.set_num_threads`` and its own setting):

- eager:             the module itself under ``torch.no_grad``
- plain AOTI:        ``aoti_compile_and_package`` of the exported program, ``aoti_load_package``
- ONNX Runtime:      ``torch.onnx.export(ep, dynamo=True)``, an ``InferenceSession`` with intra_op_num_threads
- OpenVINO:          ``openvino.convert_model(ep)``, static shapes, INFERENCE_PRECISION_HINT f32 or bf16 (this
                     kind of CPU would otherwise run fp32 in bf16), INFERENCE_NUM_THREADS, PERFORMANCE_HINT LATENCY
- ExecuTorch:        ``to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()``, run by
                     ``executorch.runtime`` from bytes (``pip install -e '.[bench]'``; the column says so without it)
- aotstack:          ``lower(Program({"forward": ep}), [AotiCpuPartitioner()])``, saved, ``aotstack.load``
- aotstack XNNPACK+AOTI: ``[XnnpackPartitioner(), AotiCpuPartitioner()]``
- aotstack ORT+AOTI: ``[OrtPartitioner(), AotiCpuPartitioner()]``
- aotstack OV+AOTI:  ``[OpenVinoPartitioner(), AotiCpuPartitioner()]``, where aotstack has it
- aotstack auto:     ``lower(program, "auto")``, where aotstack takes it; the decoder's step timed halfway through
                     the reply (``Auto(inputs=...)`` at position 40), as ``export-hf`` times one

Every engine but eager runs its file in a process of its own (``bench/child.py serve``, ``common.Worker``,
opened by ``engine_calls``), as a user's process runs one, and times its own calls and steps there. Engines
keep thread pools per process: ExecuTorch's XNNPACK pool is one per process, so files side by side would all
run on the pool the first one started, at its thread count (an auto plan that keeps XNNPACK on 1 thread beside
AOTI on 2 would run it on 2), and the benchmark's own process holds every other engine's threads. An engine
that dies there (OpenVINO 2026.4's CPU plugin, of SIGFPE compiling the bf16 Llama at 1 thread) takes only that
process; its cell says so.

A column the environment lacks (executorch not installed, a partitioner aotstack does not have yet)
says "unavailable" with the reason under the table. Under ``bench/run.py`` (``make bench``) the benchmark
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

    .venv/bin/python bench/peers.py [--workloads bert,resnet,llama] [--threads 1,2]
                                    [--dtypes fp32,bf16,8w,8da8w,4w,8da4w] [--rounds 5] [--quick]

``--quick``: much smaller models of the same architectures, fewer tokens and shorter blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import importlib.util
import io
import math
import multiprocessing
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind

import aotstack
from aotstack.forking import pause_openmp
from common import (
    FIGURE_HEADERS,
    Figure,
    Figures,
    Settings,
    Worker,
    figure_rows,
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
from engine_calls import block_ms, forced_logits
from stacked import engines as delegate_engines
from workloads import QUANTIZED, peer_bert, peer_llama, peer_resnet, quantized, weights_at_bits

WORKLOADS = ("bert", "resnet", "llama")
# A quantization scheme is one more "dtype": a float32 model whose linears and embeddings ``aotstack.quantize``
# turns to torchao's int8/int4 weights, named after its linear scheme: (linear, embedding, group size). As in
# ExecuTorch's LLM export: int4 in groups of 32, int8 one scale per output channel (group 0; XNNPACK takes
# group-wise scales for int4 only).
QUANTIZED_WORKLOADS = ("bert", "llama")  # the ones with linears and embeddings to quantize; resnet is skipped
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, **dict.fromkeys(QUANTIZED, torch.float32)}
DEFAULT_DTYPES = ("fp32", "bf16")
# max |engine - eager| over max(1, max |eager|). A quantized model's engines quantize activations (8da*) and
# accumulate integers in their own order and rounding: the eager quantized model is the reference.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, **dict.fromkeys(QUANTIZED, 5e-2)}
# Dtypes whose engines round in their own order: a near-tie there keeps its figure, with a note. In bf16 on random
# weights every engine's tokens left eager's at the same step while agreeing with each other (an AVX-512 EPYC).
ROUNDED = ("bf16", *QUANTIZED)
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
STACK_XNN = "aotstack XNNPACK+AOTI"
# The fp32 aotstack (AOTI) file again, timed in a quantized decode's rounds: the speed-up target is a ratio, and the
# fp32 case's own rounds ran minutes earlier on a machine whose memory bandwidth drifts between them.
FP32_BESIDE = "aotstack fp32, same rounds"
ENGINES = (EAGER, AOTI, ORT, OV, ET, STACK, STACK_XNN, STACK_ORT, STACK_OV, STACK_AUTO)
SINGLE = (AOTI, ORT, OV, ET)  # one engine on the whole model: what an aotstack file is compared with
AOTSTACK_ENGINES = (STACK, STACK_XNN, STACK_ORT, STACK_OV, STACK_AUTO)
MEMORY_ENGINES = (AOTI, ET, *AOTSTACK_ENGINES)  # the decoder's resident memory, measured in a fresh process
# The quantized decode's targets (the quantization issue).
SPEEDUP_TARGET = 3.0  # 8da4w aotstack tokens/s / fp32 aotstack (AOTI) tokens/s
VS_EXECUTORCH_TARGET = 1.2  # 8da4w aotstack tokens/s / ExecuTorch XNNPACK alone (issue 31; 1.0 before)
FILE_TARGET = 0.3  # 8da4w aotstack file / fp32 aotstack (AOTI) file
RSS_TARGET = 1.15  # RSS added by load + one call / the quantized weights' bytes


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
    """One engine, ready at one thread count. ``call()`` for a forward; ``call(ids, position)`` for the decoder.

    A file held by a ``worker`` (a process of its own) has no ``call``: ``output``, ``block``, ``generate`` and
    ``forced`` go there.
    """

    call: Callable[..., torch.Tensor] | None = None
    reset: Callable[[], None] = lambda: None
    detail: str = ""  # e.g. an aotstack file's delegates per engine
    files: Sequence[str] = ()  # what the engine runs from: its size is the cell's file size
    memory: tuple[str, str] | None = None  # (bench/child.py load kind, file): resident memory, the decoder only
    worker: Worker | None = None

    def output(self) -> torch.Tensor:
        """A forward's output."""
        return self.worker.output() if self.worker is not None else self.call()

    def block(self, calls: int) -> float:
        """A forward's milliseconds per call over ``calls`` back-to-back calls."""
        return self.worker.block(calls) if self.worker is not None else block_ms(self.call, calls)

    def generate(self, tokens: int) -> tuple[list[int], float]:
        """From a reset: the prompt, then ``tokens`` greedy tokens; the tokens and the seconds their steps took."""
        if self.worker is not None:
            return self.worker.generate(tokens)
        self.reset()
        return decode(self.call, tokens)

    def forced(self, sequence: Sequence[int]) -> torch.Tensor:
        """From a reset, one step per token of ``sequence`` (teacher forcing): the last position's logits, stacked."""
        if self.worker is not None:
            return self.worker.forced(sequence)
        self.reset()
        return forced_logits(self.call, sequence)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


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
    file_bytes: int | None = None  # the file(s) the engine runs from
    rss_bytes: int | None = None  # the decoder: RSS a fresh process adds by load + one call
    rss_note: str = ""  # why there is no rss_bytes where one was measured for

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
    weights: int = 0  # the model's weights in bytes; quantized ones at their bit width, with scales and zero points
    program_weights: int = 0  # the exported program's weights and constants (int4 held one value per int8)

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


def program_bytes(exported: torch.export.ExportedProgram) -> int:
    tensors = {**exported.state_dict, **exported.constants}
    return sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))


def build_case(workload: str, dtype: str, size: str) -> Case:
    """The workload at ``dtype``. A quantized one: every engine gets the program ``aotstack.Program`` makes
    of it (decomposed, torchao's tensor-subclass weights unwrapped into the plain tensors they pack), the
    form ExecuTorch's and AOTInductor's own flows also take; eager runs the quantized module itself."""
    torch_dtype = DTYPES[dtype]
    if workload == "llama":
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        model = quantized(peer_llama(size, CACHE[size]).to(torch_dtype), dtype)

        def wrapped() -> TorchExportableModuleForDecoderOnlyLM:
            return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE[size])

        exported = wrapped().export(input_ids=decoder_inputs()[0], cache_position=decoder_inputs()[1])
        if dtype in QUANTIZED:
            exported = aotstack.Program({"forward": exported}).methods["forward"]
        # Eager runs a cache of its own: the exported program's buffers stay as exported (zeros).
        case = Case(workload, dtype, size, wrapped().model, (), exported, None)
    else:
        model, args = {"bert": peer_bert, "resnet": peer_resnet}[workload](size)
        model = quantized(model.to(torch_dtype), dtype)
        args = tuple(a.to(torch_dtype) if a.is_floating_point() else a for a in args)
        with torch.no_grad():
            exported = torch.export.export(model, args)
        if dtype in QUANTIZED:
            exported = aotstack.Program({"forward": exported}).methods["forward"]
        case = Case(workload, dtype, size, model, args, exported, None)
    case.weights, case.program_weights = weights_at_bits(model, dtype), program_bytes(case.exported)
    return case


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
    return file_runner(case, "aoti", path, threads, settings)


def ort_runner(case: Case, threads: int, settings: Settings) -> Runner:
    def export() -> str:
        path = settings.path(f"peers-{case.name}.onnx")
        program, args = (cache_in_out(case)[0], None) if case.decoder else (case.exported, case.args)
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
            torch.onnx.export(program, args, dynamo=True).save(path)
        return path

    path = case.artifact(ORT, export)
    runner = file_runner(case, "onnxruntime", path, threads, settings, files=onnx_files(path))
    if case.dtype == "bf16":  # after the session opened: where it cannot, that is the cell's reason
        runner.close()
        raise Unavailable("numpy, which ONNX Runtime's Python API takes, has no bfloat16")
    return runner


def onnx_files(path: str) -> list[str]:
    """The ONNX file and its external data files, if the exporter wrote any beside it."""
    directory, stem = os.path.dirname(path), os.path.basename(path)
    return [os.path.join(directory, name) for name in sorted(os.listdir(directory)) if name.startswith(stem)]


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

    path = case.artifact(OV, lambda: made_in_fork(convert))
    return file_runner(case, "openvino", path, threads, settings, files=[path, path.removesuffix(".xml") + ".bin"],
                       precision="bf16" if case.dtype == "bf16" else "f32")


def made_in_fork(make: Callable[[], str]) -> str:
    """``make()``'s result, made in a forked child of this process; what it raises is raised here as a RuntimeError.

    For OpenVINO's conversion: once ``openvino.save_model`` (or ``serialize``) ran in a process, every
    child forked from it later runs OpenVINO's CPU plugin on one thread, whatever its thread count
    (OpenVINO 2026.4; ``openvino.convert_model`` alone does not do it). aotstack's auto lowering, run
    in this process after, times each plan in such a child: it would time its OpenVINO plans at one
    thread's speed. A user's process that lowers does not convert the peer first.
    """
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)

    def run() -> None:
        try:
            sending.send((True, make()))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
            sending.send((False, f"{type(exc).__name__}: {exc}"))

    pause_openmp()  # the child runs torch (the decoder's re-export): a pool its parent used would hang it
    process = context.Process(target=run, daemon=True)
    process.start()
    sending.close()
    try:
        made, result = receiving.recv()
    except EOFError:
        made, result = False, "the process converting it ended without a word"
    process.join()
    if not made or process.exitcode != 0:
        raise RuntimeError(f"{result} (exit code {process.exitcode})")
    return result


def executorch_runner(case: Case, threads: int, settings: Settings) -> Runner:
    if importlib.util.find_spec("executorch") is None:
        raise Unavailable("executorch is not installed: pip install -e '.[bench]' (make bench does)")

    def lower() -> tuple[bytes, str]:
        with contextlib.redirect_stdout(io.StringIO()):  # torchao prints its missing CUDA libraries
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
        # A copy: ExecuTorch's lowering rewrites the program it is given (its constant propagation replaces the
        # constants, even where the lowering then fails), and every engine after it lowers the same program.
        edge = to_edge_transform_and_lower(copy.deepcopy(case.exported), partitioner=[XnnpackPartitioner()])
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
        path = settings.path(f"peers-{case.name}.pte")
        # What XNNPACK leaves of torchao's patterns (a quantized embedding) becomes ExecuTorch's quantized
        # kernels' ops, as its LLM export does (do_quant_fusion_and_const_prop).
        config = ExecutorchBackendConfig(do_quant_fusion_and_const_prop=case.dtype in QUANTIZED)
        with open(path, "wb") as file:
            file.write(edge.to_executorch(config).buffer)
        return path, detail

    path, detail = case.artifact(ET, lower)
    return file_runner(case, "executorch", path, threads, settings, detail=detail)


def aotstack_partitioners(engine: str, case: Case) -> list[aotstack.Partitioner] | aotstack.Auto:
    if engine == STACK:
        return [aotstack.AotiCpuPartitioner()]
    if engine == STACK_ORT:
        return [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()]
    if engine == STACK_XNN:
        try:
            xnnpack_partitioner = aotstack.XnnpackPartitioner
        except (AttributeError, ImportError) as exc:
            raise Unavailable(f"aotstack has no XnnpackPartitioner here ({type(exc).__name__}: {exc})") from exc
        return [xnnpack_partitioner(), aotstack.AotiCpuPartitioner()]
    if engine == STACK_OV:
        try:
            openvino_partitioner = aotstack.OpenVinoPartitioner
        except (AttributeError, ImportError) as exc:
            raise Unavailable(f"aotstack has no OpenVinoPartitioner yet ({type(exc).__name__})") from exc
        return [openvino_partitioner(), aotstack.AotiCpuPartitioner()]
    if not case.decoder:
        return aotstack.Auto()
    # A decoder's step timed where the benchmark's generation spends it, halfway through the reply (as export-hf
    # times one): at position 0 an attention that reads only the keys filled so far reads one.
    halfway = decoder_inputs(position=len(PROMPT) + TOKENS[case.size] // 2)
    return aotstack.Auto(inputs={"forward": ((), dict(zip(("input_ids", "cache_position"), halfway)))})


def aotstack_path(settings: Settings, case_name: str, threads: int, engine: str) -> str:
    tag = engine.removeprefix("aotstack").strip().replace("+", "-").lower() or "aoti"
    return settings.path(f"peers-{case_name}-{threads}t-aotstack-{tag}.pt2")


def file_runner(case: Case, kind: str, path: str, threads: int, settings: Settings, detail: str = "",
                files: Sequence[str] = (), precision: str = "f32") -> Runner:
    """``path`` open in ``kind``'s engine in a process of its own (``Worker``, ``engine_calls``), as a user's runs one.

    The decoder's cache, for the engines without buffers (ONNX Runtime, OpenVINO), starts from ``CacheInOut``'s.
    """
    inputs = state = None
    if not case.decoder:
        inputs = save_inputs(settings.path(f"peers-{case.name}-args.pt"), case.args)
    elif kind in ("onnxruntime", "openvino"):
        state = save_inputs(settings.path(f"peers-{case.name}-cache.pt"), tuple(cache_in_out(case)[1].initial))
    memory = (kind, path) if case.decoder and kind in ("aotstack", "aoti", "executorch") else None
    return Runner(detail=detail, files=files or [path], memory=memory,
                  worker=Worker(kind, path, threads, inputs, state, precision))


def aotstack_runner(engine: str) -> Callable[[Case, int, Settings], Runner]:
    def build(case: Case, threads: int, settings: Settings) -> Runner:
        path = aotstack_path(settings, case.name, threads, engine)
        program = aotstack.Program({"forward": case.exported})
        partitioners = aotstack_partitioners(engine, case)
        started = time.perf_counter()
        fell_back = ""
        try:
            lowered = aotstack.lower(program, partitioners)
        except (TypeError, aotstack.LoweringError) as exc:
            if isinstance(partitioners, aotstack.Auto) and (isinstance(exc, TypeError) or "Partitioner" in str(exc)):
                raise Unavailable(f"lower(program, 'auto') not taken yet: {exc}") from exc
            if "failed to compile" not in str(exc):
                raise
            # A partition its backend could not compile: timed as a user would get it with
            # on_compile_error="fallback" (those nodes go to the next partitioner), and said so.
            progress(f"{case.name}: {engine}: {short(exc, 400)}; again with on_compile_error='fallback'")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lowered = aotstack.lower(aotstack.Program({"forward": case.exported}), partitioners,
                                         on_compile_error="fallback")
            failures = lowered.compile_failures.get("forward", [])
            fell_back = (f"; on_compile_error='fallback': {len(failures)} partition(s) failed to compile "
                         f"({failures[0].backend_id}: {failures[0].error[:160]})" if failures else "")
        lowered.save(path)
        detail = (delegate_engines(lowered.delegates("forward")) or "no delegate") + fell_back
        progress(f"{case.name}: {engine} lowered for {threads} thread(s) in {time.perf_counter() - started:.1f} s "
                 f"({detail})")
        selection = lowered.placements["forward"].selection
        if selection is not None:
            measured = ", ".join(
                f"{' > '.join(c.engines)} " + ("failed" if c.seconds is None else f"{c.seconds * 1e3:.3g} ms")
                for c in selection.candidates
            )
            progress(f"{case.name}: {engine} measured {measured}; kept: {selection.reason}")
        return file_runner(case, "aotstack", path, threads, settings, detail=detail)

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
    output, expected = runner.output(), case.reference
    if tuple(output.shape) != tuple(expected.shape):
        raise Wrong(f"output shape {tuple(output.shape)}, eager's {tuple(expected.shape)}")
    difference = (output.float() - expected.float()).abs().max().item()
    allowed = TOLERANCE[case.dtype] * max(1.0, expected.float().abs().max().item())
    if not difference <= allowed:  # NaN included
        raise Wrong(f"max |difference from eager| {difference:.3g}, allowed {allowed:.3g}")
    return difference


def first_difference(tokens: list[int], expected: list[int]) -> int:
    return next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)


def teacher_forced(runner: Runner, case: Case) -> torch.Tensor:
    """Last-position logits of every step, fed the prompt and then eager's tokens."""
    return runner.forced([*PROMPT, *case.reference])


def check_decoder(case: Case, runner: Runner, eager_logits: Callable[[], torch.Tensor]) -> list[int]:
    """The engine's greedy tokens, when they are eager's; otherwise raise Wrong or NearTie.

    With random weights the top logits are close, and in bf16 summing in another order can swap
    two of them. So where the tokens differ the engine is fed eager's tokens, and its logits at
    every step are compared with eager's: within the dtype's tolerance, a near-tie (no figure all
    the same); beyond it, wrong.
    """
    tokens = runner.generate(TOKENS[case.size])[0]
    if tokens == case.reference:
        return tokens
    first = first_difference(tokens, case.reference)
    expected = eager_logits()
    difference = (teacher_forced(runner, case) - expected).abs().max().item()
    allowed = TOLERANCE[case.dtype] * max(1.0, expected.abs().max().item())
    differ = f"generated tokens differ from eager's from token {first} on"
    if not difference <= allowed:
        raise Wrong(f"{differ}; fed eager's tokens, max |logits - eager's| {difference:.3g}, allowed {allowed:.3g}")
    raise NearTie(f"{differ}, a near-tie: fed eager's tokens, its logits are within {difference:.2g} of "
                  f"eager's (allowed {allowed:.2g})", tokens)


def file_and_memory(case: Case, engine: str, runner: Runner, cell: Cell, settings: Settings, threads: int) -> None:
    """The cell's file size, and for the decoder the RSS a fresh process adds by load + one call.

    Memory is measured once per case and engine, at the first thread count (OpenVINO 2026.4 dies of
    SIGFPE compiling the bf16 Llama at 1 thread, not at 2): ``bench/child.py load``, its RSS after the
    call over its RSS after the imports the load needs.
    """
    cell.file_bytes = sum(os.path.getsize(f) for f in runner.files if os.path.exists(f)) or None
    if not case.decoder or runner.memory is None or engine not in MEMORY_ENGINES:
        return

    def measure() -> int:
        kind, path = runner.memory
        inputs = save_inputs(settings.path(f"peers-{case.name}-inputs.pt"),
                             kwargs=dict(zip(("input_ids", "cache_position"), decoder_inputs())))
        sample = run_child(["load", kind, path, inputs, str(threads)])
        return sample["rss"] - sample["import_rss"]

    try:
        cell.rss_bytes = case.artifact(f"{engine} memory", measure)
    except Exception as exc:
        cell.rss_note = short(exc)
        progress(f"{case.name}: {engine}: resident memory not measured: {cell.rss_note}")


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
                per_call = runner.block(1) / 1e3
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
                        generated, seconds = runner.generate(tokens)
                        if generated != cells[name].tokens:
                            first = first_difference(generated, cells[name].tokens)
                            raise Wrong(f"round {index + 1}: tokens differ from its first run's from token {first} on")
                        cells[name].samples.append(tokens / seconds)
                    else:
                        cells[name].samples.append(runner.block(calls[name]))
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


def fp32_beside(results: Results, settings: Settings, case: Case, threads: int) -> dict[str, tuple[str, Cell]]:
    """For a quantized decode, the fp32 aotstack file its fp32 case saved and timed here: to time in the same rounds."""
    if not case.decoder or case.dtype not in QUANTIZED:
        return {}
    fp32 = results.get((case.workload, "fp32", threads), {}).get(STACK)
    path = aotstack_path(settings, f"{case.workload}-fp32", threads, STACK)
    if fp32 is None or fp32.value is None or not os.path.exists(path):
        return {}
    return {FP32_BESIDE: (path, fp32)}


def run_threads(case: Case, threads: int, settings: Settings, rounds: int,
                beside: dict[str, tuple[str, Cell]] | None = None) -> dict[str, Cell]:
    """Every engine on ``case`` at ``threads``: built, checked against eager, timed.

    ``beside``: more aotstack decoder files, by name, timed in the same rounds; each repeats the tokens of the cell
    given with it, and its cell holds the figure (no column shows it).
    """
    torch.set_num_threads(threads)
    eager = eager_runner(case, threads, settings)
    with torch.no_grad():  # the reference, at this thread count: summing in another order may change a token
        case.reference = eager.generate(TOKENS[case.size])[0] if case.decoder else eager.call()
    logits: list[torch.Tensor] = []

    def eager_logits() -> torch.Tensor:  # eager's, fed its own tokens; once, where an engine's tokens differ
        if not logits:
            logits.append(teacher_forced(eager, case))
        return logits[0]

    cells: dict[str, Cell] = {}
    runners: dict[str, Runner] = {}
    built: list[Runner] = []  # closed at the end (a worker's process), failed or not
    try:
        time_engines(case, threads, settings, rounds, beside or {}, eager_logits, cells, runners, built)
    finally:
        for runner in built:
            runner.close()
    return cells


def time_engines(case: Case, threads: int, settings: Settings, rounds: int, beside: dict[str, tuple[str, Cell]],
                 eager_logits: Callable[[], torch.Tensor], cells: dict[str, Cell], runners: dict[str, Runner],
                 built: list[Runner]) -> None:
    """``run_threads``'s work: every engine built into ``built``, checked into ``cells``, then timed in rounds."""
    for engine in ENGINES:
        runner = None
        try:
            runner = BUILDERS[engine](case, threads, settings)
            built.append(runner)
            if case.decoder:  # also the warm-up
                cells[engine] = Cell(detail=runner.detail, tokens=check_decoder(case, runner, eager_logits))
            else:
                runner.output()  # the first call may set up
                cells[engine] = Cell(difference=check_forward(case, runner), detail=runner.detail)
            runners[engine] = runner
        except NearTie as tie:  # timed all the same; the figure goes in its note
            cells[engine] = Cell(kind="differs", reason=str(tie), detail=runner.detail, tokens=tie.tokens)
            if case.dtype in ROUNDED:  # rounding in another order shifts near-ties by right: the figure stays
                cells[engine] = Cell(detail="; ".join(filter(None, [runner.detail, f"near-tie: {tie}"])),
                                     tokens=tie.tokens)
            runners[engine] = runner
            progress(f"{case.name} {threads}t: {engine}: differs: {tie}")
        except Exception as exc:  # one engine failing must not stop the others
            cells[engine] = outcome(exc)
            progress(f"{case.name} {threads}t: {engine}: {cells[engine].kind}: {cells[engine].reason}")
        if runner is not None and engine in cells:
            file_and_memory(case, engine, runner, cells[engine], settings, threads)
    if not case.decoder:
        differences = ", ".join(f"{n} {c.difference:.1e}" for n, c in cells.items() if c.difference is not None)
        progress(f"{case.name} {threads}t: max |engine - eager|: {differences}")
    for name, (path, source) in beside.items():
        runners[name] = file_runner(case, "aotstack", path, threads, settings, detail=source.detail)
        built.append(runners[name])
        cells[name] = Cell(detail=source.detail, tokens=source.tokens)
    progress(f"{case.name} {threads}t: timing {len(runners)} engines, {rounds} rounds ...")
    measure_rounds(case, runners, cells, rounds)


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
    quantized_decode_ran = any(workload == "llama" and dtype in QUANTIZED for workload, dtype, _ in results)
    for threads, dtype in configurations:
        notes: dict[str, int] = {}
        rows = []
        for workload in WORKLOADS:
            cells = results.get((workload, dtype, threads))
            if cells is None or (workload == "llama" and quantized_decode_ran):  # in the quantized decode's table
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
        if not rows:
            continue
        print(f"\n  {threads} thread(s), {dtype}: median of the rounds; ms per forward (lower is better), "
              "tokens/s (higher is better);\n  (x): aotstack's figure / the fastest single engine's")
        print_table(["workload", "unit", *ENGINES, "fastest single"], rows)
        for text, number in notes.items():
            print(f"  [{number}] {text}")


def decoder_rows(results: Results, threads: int) -> list[str]:
    """The llama dtypes measured at ``threads``: fp32 and bf16 first, then the schemes in QUANTIZED's order."""
    order = [*DEFAULT_DTYPES, *QUANTIZED]
    return sorted({d for w, d, t in results if w == "llama" and t == threads}, key=order.index)


def megabytes(count: int | None) -> str:
    return "-" if count is None else f"{count / 1e6:.1f}"


def quantized_report(results: Results, weights: dict[tuple[str, str], tuple[int, int]]) -> Figures:
    """The quantized decode: per thread count, tokens/s by scheme and engine; file sizes, resident memory; targets."""
    figures: Figures = {}
    threads_run = sorted({t for w, _, t in results if w == "llama"})
    for threads in threads_run:
        dtypes = decoder_rows(results, threads)
        notes: dict[str, int] = {}
        rows = []
        for dtype in dtypes:
            cells = results[("llama", dtype, threads)]
            best = fastest_single(cells, "tokens/s")
            row = [dtype]
            for engine in ENGINES:
                cell = cells[engine]
                text = cell.text()
                if cell.kind:
                    text += f" [{notes.setdefault(f'{dtype} {engine}: {cell.reason}', len(notes) + 1)}]"
                elif engine in AOTSTACK_ENGINES and best is not None:
                    text += f" ({cell.value / best[1]:.2f}x)"
                row.append(text)
            row.append("-" if best is None else f"{best[0]} {quantity(best[1], '')}")
            rows.append(row)
        schemes = ", ".join(f"{k}: embedding {v[1]}, {f'group {v[2]}' if v[2] else 'per channel'}"
                            for k, v in QUANTIZED.items())
        print(f"\n  llama decode, {threads} thread(s), by quantization (the linear scheme; {schemes}): tokens/s, "
              "median of the rounds;\n  (x): aotstack's figure / the fastest single engine's")
        print_table(["dtype", *ENGINES, "fastest single"], rows)
        for text, number in notes.items():
            print(f"  [{number}] {text}")
        again = [f"{d} {results[('llama', d, threads)][FP32_BESIDE].text()}" for d in dtypes
                 if FP32_BESIDE in results[("llama", d, threads)]]
        if again:
            print(f"  fp32 {STACK} (AOTI) timed again in each scheme's rounds, tokens/s: {', '.join(again)}")
        figures.update(quantized_targets(results, threads))
    # Files and memory: the same at every thread count; the first one's.
    threads = threads_run[0]
    dtypes = decoder_rows(results, threads)
    sized = [e for e in ENGINES if any(results[("llama", d, threads)][e].file_bytes for d in dtypes)]
    rows = [[d, megabytes(weights[("llama", d)][0]), megabytes(weights[("llama", d)][1]),
             *(megabytes(results[("llama", d, threads)][e].file_bytes) for e in sized)] for d in dtypes]
    print("\n  llama decode: weights (quantized ones at their bit width, with scales), the exported program's "
          "tensors,\n  and each engine's file(s), MB")
    print_table(["dtype", "weights", "program", *sized], rows)
    rows = []
    for dtype in dtypes:
        weight = weights[("llama", dtype)][0]
        row = [dtype, megabytes(weight)]
        for engine in MEMORY_ENGINES:
            cell = results[("llama", dtype, threads)][engine]
            ratio = "" if cell.rss_bytes is None else f" ({cell.rss_bytes / weight:.2f}x)"
            row.append(megabytes(cell.rss_bytes) + ratio)
        rows.append(row)
    print(f"\n  llama decode: RSS a fresh process adds by load + one call (bench/child.py load), MB "
          f"(x: / the weights; target <= {RSS_TARGET}x)")
    print_table(["dtype", "weights", *MEMORY_ENGINES], rows)
    figures.update(size_targets(results, weights, threads))
    return figures


def best_aotstack(cells: dict[str, Cell], engines: Sequence[str] = AOTSTACK_ENGINES) -> tuple[str, float] | None:
    measured = [(name, cells[name].value) for name in engines if cells[name].value is not None]
    return max(measured, key=lambda item: item[1]) if measured else None


def fp32_baseline(scheme: dict[str, Cell], fp32: dict[str, Cell] | None) -> tuple[float | None, str]:
    """The fp32 aotstack figure a scheme is compared with, and where it was timed: in the scheme's own rounds where
    it could be, else in the fp32 case's."""
    own = None if fp32 is None else fp32[STACK].value
    in_fp32_case = "fp32 not run" if own is None else f"its own case's rounds {quantity(own, 'tokens/s')}"
    beside = scheme.get(FP32_BESIDE)
    if beside is not None and beside.value is not None:
        return beside.value, f"timed in the same rounds ({in_fp32_case})"
    reason = f": {beside.reason}" if beside is not None and beside.kind else ""
    return own, f"timed in the fp32 case's rounds, not in these{reason}" if own is not None else in_fp32_case


def quantized_targets(results: Results, threads: int) -> Figures:
    """8da4w aotstack (its fastest order, and auto) >= 3x fp32 aotstack, and >= ExecuTorch XNNPACK alone."""
    figures: Figures = {}
    scheme = results.get(("llama", "8da4w", threads))
    if scheme is None:
        return figures
    fp32 = results.get(("llama", "fp32", threads))
    baseline, source = fp32_baseline(scheme, fp32)
    best = best_aotstack(scheme)
    picks = {"fastest order": best, "auto": (STACK_AUTO, scheme[STACK_AUTO].value)}
    for label, pick in picks.items():
        name, value = pick if pick is not None else ("-", None)
        what = f"{name}" if label == "auto" else f"{label}: {name}"
        figures[f"llama 8da4w {threads}t: aotstack {label} / fp32 aotstack, tokens/s"] = Figure(
            value, "tokens/s", baseline, None if baseline is None else SPEEDUP_TARGET, higher_is_better=True,
            note=f"{what}; baseline fp32 {STACK} (AOTI), {source}")
        executorch = scheme[ET].value
        figures[f"llama 8da4w {threads}t: aotstack {label} / {ET} XNNPACK alone, tokens/s"] = Figure(
            value, "tokens/s", executorch, None if executorch is None else VS_EXECUTORCH_TARGET, higher_is_better=True,
            note=what + (f"; {ET}: {scheme[ET].kind}: {scheme[ET].reason}" if scheme[ET].kind else ""))
    print(f"\n  llama decode targets, {threads} thread(s)")
    print_table(FIGURE_HEADERS, figure_rows(figures))
    return figures


def size_targets(results: Results, weights: dict[tuple[str, str], tuple[int, int]], threads: int) -> Figures:
    """The 8da4w file <= 0.3x the fp32 file; RSS after load <= 1.15x the quantized weights (each aotstack order)."""
    figures: Figures = {}
    scheme = results.get(("llama", "8da4w", threads))
    if scheme is None:
        return figures
    fp32 = results.get(("llama", "fp32", threads))
    best = best_aotstack(scheme)
    fp32_file = None if fp32 is None else fp32[STACK].file_bytes
    for engine in AOTSTACK_ENGINES:
        cell = scheme[engine]
        tag = f"{engine}{' (fastest)' if best and best[0] == engine else ''}"
        figures[f"llama 8da4w: {tag} file / fp32 aotstack file"] = Figure(
            None if cell.file_bytes is None else cell.file_bytes / 1e6, "MB",
            None if fp32_file is None else fp32_file / 1e6, None if fp32_file is None else FILE_TARGET,
            note=cell.reason if cell.kind and cell.file_bytes is None else "")
        figures[f"llama 8da4w: {tag} RSS after load / quantized weights"] = Figure(
            None if cell.rss_bytes is None else cell.rss_bytes / 1e6, "MB", weights[("llama", "8da4w")][0] / 1e6,
            RSS_TARGET, note=cell.rss_note or "fresh process: RSS after load + one call over RSS after the imports")
    print("\n  llama decode targets: file size and resident memory")
    print_table(FIGURE_HEADERS, figure_rows(figures))
    return figures


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
    dtypes = dtypes or settings.pick(DEFAULT_DTYPES, QUICK_DTYPES)
    print(f"  {versions()}")
    print(f"  workloads {', '.join(workloads)}; threads {', '.join(map(str, threads))}; dtypes {', '.join(dtypes)}; "
          f"{rounds} rounds; {size} models")
    results: Results = {}
    weights: dict[tuple[str, str], tuple[int, int]] = {}  # (workload, dtype) -> (weights at bit width, program's)
    units = {w: "tokens/s" if w == "llama" else "ms" for w in WORKLOADS}
    before = torch.get_num_threads()
    started = time.perf_counter()
    try:
        for workload in workloads:
            for dtype in dtypes:
                if dtype in QUANTIZED and workload not in QUANTIZED_WORKLOADS:
                    progress(f"{workload}-{dtype}: skipped: quantization applies to {', '.join(QUANTIZED_WORKLOADS)}")
                    continue
                progress(f"{workload}-{dtype}: building the model, exporting, eager's reference ...")
                case = build_case(workload, dtype, size)
                weights[(workload, dtype)] = (case.weights, case.program_weights)
                for count in threads:
                    beside = fp32_beside(results, settings, case, count)
                    results[(workload, dtype, count)] = run_threads(case, count, settings, rounds, beside)
                del case
                gc.collect()
    finally:
        torch.set_num_threads(before)
    progress(f"all cases done in {time.perf_counter() - started:.0f} s")
    print_tables(results, units)
    figures = engine_figures(results, units)
    if any(workload == "llama" and dtype in QUANTIZED for workload, dtype, _ in results):
        figures.update(quantized_report(results, weights))
    stacking = stacking_threads(threads)
    if stacking is not None:
        figures.update(stacking_figures(results, units, stacking))
    return figures


def quantized_decode(settings: Settings) -> Figures:
    """The quantized decode alone (``bench/run.py --only quantized``): llama, fp32 and each scheme, one thread count."""
    return peers(settings, ("llama",), (settings.threads,), ("fp32", *QUANTIZED))


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
                        help=f"of {','.join(DTYPES)}; default {','.join(DEFAULT_DTYPES)}; "
                             f"--quick: {','.join(QUICK_DTYPES)}")
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
