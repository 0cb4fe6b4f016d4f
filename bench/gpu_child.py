"""What ``bench/gpu.py`` runs in fresh processes: the probe, the builds, the corpus, one speed row.

    gpu_child.py probe-build plain|aotstack DIR DEVICE  a tiny model's plain AOTI package, or its aotstack file
    gpu_child.py probe-open plain|aotstack DIR DEVICE   open one of them and call it once
    gpu_child.py build aoti|aotstack|warm ROW DTYPE DIR DEVICE SIZE
    gpu_child.py corpus-build DIR DEVICE NAME ...       lower, save, and keep eager's outputs
    gpu_child.py corpus-run DIR DEVICE NAME ...         load each file, run it, compare with eager
    gpu_child.py measure ROW DTYPE DIR DEVICE SIZE [--rounds N] [--tokens N] [--block S] [--skip VARIANT ...]

Each writes one JSON object to ``--result PATH`` when it ends normally; one that dies of a signal
writes none, and the parent says so. ``@@ stage`` lines on stdout say what a child was doing, so a
parent can name the step a crash happened in. ``bench/`` and the repository root (with ``src``)
are on the path, as ``bench/gpu.py`` starts it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import aotstack
from common import median
from decode import PROMPT
from gpu import AOTI, COMPILE, EAGER, GRAPHS, ROW_LABELS, STACK, VARIANTS, build_record, package_path
from workloads import peer_bert, peer_llama, peer_resnet

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |variant - eager| over max(1, max |eager|): GPU kernels sum in another order than eager's, and a
# bf16 intermediate rounded elsewhere moves a result by a few units of its last place.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}
# The corpus runs as a user runs it (fp32, inputs and outputs on the host): eager on the host is the reference.
CORPUS_RTOL = CORPUS_ATOL = 2e-3
PROBE_WIDTH = 16
# Calls before a forward column's output is checked: torch.compile compiles, warms up and records its
# graph in its first three; aotstack's graphs capture after three plain calls (runtime/graphs.py).
WARM_UP = 5

# A decoder of about half a billion parameters, built as ``workloads.peer_llama`` builds its 99.5 M one:
# Qwen2.5-0.5B's proportions (24 layers, GQA with 4 KV heads, a wide MLP) on a Llama config, hidden 1024.
# 487 M parameters: 1.95 GB in fp32, kept below 2 GiB (plain AOTI embeds the weights in its library).
DECODER_500M = {"full": {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                         "num_key_value_heads": 4, "intermediate_size": 4864},
                "quick": {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 384}}


@dataclass(frozen=True)
class Row:
    """One row of the speed table: a forward workload (ms per call) or a decoder at a cache length (tokens/s)."""

    name: str
    label: str
    cache: int = 0  # a decoder's static KV cache; 0: a forward workload

    @property
    def decoder(self) -> bool:
        return self.cache > 0

    @property
    def method(self) -> str:
        """The aotstack method: a decoder's is ``decode``, so ``cuda_graphs=["decode"]`` names it."""
        return "decode" if self.decoder else "forward"


ROWS = {
    row.name: row
    for row in (
        Row("bert", ROW_LABELS["bert"]),
        Row("resnet", ROW_LABELS["resnet"]),
        Row("llama-256", ROW_LABELS["llama-256"], 256),
        Row("llama-2048", ROW_LABELS["llama-2048"], 2048),
        Row("0.5b-1024", ROW_LABELS["0.5b-1024"], 1024),
    )
}


def stage(text: str) -> None:
    """Say what this process starts now; the parent reads the last such line after a crash."""
    print(f"@@ {text}", flush=True)


def write_result(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as file:
        json.dump(result, file)


def error_text(exc: BaseException, limit: int = 300) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {' / '.join(lines[:3])}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def exact_float32() -> None:
    """TF32 off for matmuls and convolutions, here and in what Inductor compiles in this process.

    The legacy flags only: torch refuses a mix of them with the newer ``fp32_precision`` ones.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cuda_partitioner(device: str) -> aotstack.Partitioner:
    """``CudaPartitioner`` with autotuning off (compiles in seconds, not minutes); on ``cpu``, the smoke mode's."""
    if device.startswith("cuda"):
        return aotstack.CudaPartitioner(compile_specs=[aotstack.CompileSpec("autotune", b"OFF")])
    return aotstack.AotiCpuPartitioner()


def delegates_text(lowered: aotstack.LoweredProgram, method: str) -> str:
    """``aoti_cuda x1 (412 ops), 2 plain ATen op(s), 3 host-device copies``, read from the report."""
    try:
        summary = lowered.report().method(method)
        parts = [f"{s.engine} x{s.delegates} ({s.ops} ops)" for s in summary.engines if s.engine != "aten"]
        plain = sum(len(group.nodes) for group in summary.unclaimed)
        parts += [f"{plain} plain ATen op(s)"] if plain else []
        parts += [f"{len(summary.copies)} host-device copies"] if summary.copies else []
        return ", ".join(parts) or "no delegate"
    except Exception:  # the report is a detail; the delegates themselves are enough
        counts: dict[str, int] = {}
        for delegate in lowered.delegates(method):
            counts[delegate.backend_id] = counts.get(delegate.backend_id, 0) + 1
        return ", ".join(f"{name} x{count}" for name, count in counts.items()) or "no delegate"


def parameters_text(model: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters"


# The models, seeded: a parent and every child build the same weights.


def decoder_500m(size: str, cache: int) -> torch.nn.Module:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DECODER_500M[size], max_position_embeddings=cache)).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def decoder_model(row: Row, dtype: str, size: str) -> torch.nn.Module:
    """The row's causal LM at ``dtype``, on the host, set up for a static KV cache of the row's length."""
    build = decoder_500m if row.name.startswith("0.5b") else peer_llama
    return build(size, row.cache).to(DTYPES[dtype])


def forward_workload(row: Row, dtype: str, size: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The row's model at ``dtype`` and its example inputs, on the host."""
    model, args = {"bert": peer_bert, "resnet": peer_resnet}[row.name](size)
    return model.to(DTYPES[dtype]), tuple(a.to(DTYPES[dtype]) if a.is_floating_point() else a for a in args)


def step_module(model: torch.nn.Module, cache: int) -> torch.nn.Module:
    """transformers' export wrapper around ``model``: ``(input_ids, cache_position) -> logits``, its own cache.

    The cache is made on the model's device in its dtype; each wrapper has a cache of its own, the weights
    are shared.
    """
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=cache).model


def exported_decoder(model: torch.nn.Module, cache: int, device: str) -> torch.export.ExportedProgram:
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=cache)
    ids, position = torch.tensor([[1]], device=device), torch.tensor([0], device=device)
    return wrapper.export(input_ids=ids, cache_position=position)


# The probe: can this python open an AOTInductor library without LD_PRELOAD?


class ProbeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(PROBE_WIDTH, 2 * PROBE_WIDTH)
        self.second = torch.nn.Linear(2 * PROBE_WIDTH, PROBE_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def probe_workload() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ProbeModel().eval(), torch.randn(4, PROBE_WIDTH, generator=torch.Generator().manual_seed(1))


def probe_build(kind: str, directory: str, device: str, result: str) -> None:
    """One tiny package compiled, not opened: the opens are the probe, each in a process of its own."""
    exact_float32()
    model, x = probe_workload()
    started = time.perf_counter()
    if kind == "plain":
        stage("compiling the plain AOTI package")
        with torch.no_grad():
            program = torch.export.export(model.to(device), (x.to(device),))
            torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(directory, "plain.pt2"))
    else:
        stage("lowering the aotstack package")
        lowered = aotstack.lower(aotstack.export(model, {"forward": (x,)}), [cuda_partitioner(device)])
        lowered.save(os.path.join(directory, "aotstack.pt2"))
    write_result(result, {"seconds": time.perf_counter() - started})


def probe_open(kind: str, directory: str, device: str, result: str) -> None:
    exact_float32()
    model, x = probe_workload()
    with torch.no_grad():
        expected = model(x)
    stage(f"opening the {kind} package")
    started = time.perf_counter()
    if kind == "plain":
        package = torch._inductor.aoti_load_package(os.path.join(directory, "plain.pt2"))
        opened = time.perf_counter() - started
        stage("calling it")
        got = package(x.to(device)).cpu()
    else:
        loaded = aotstack.load(os.path.join(directory, "aotstack.pt2"))
        opened = time.perf_counter() - started
        stage("calling it")
        got = loaded.forward(x)
    write_result(result, {"open_s": opened, "max_abs": (got - expected).abs().max().item()})


# The speed rows' builds, one per process so that they compile side by side.


def build(kind: str, row: Row, dtype: str, directory: str, device: str, size: str, result: str) -> None:
    """``aoti``: the plain AOTI package; ``aotstack``: the aotstack file; ``warm``: torch.compile's caches filled.

    The plain package is compiled as users compile one for a GPU: the model and its example inputs on
    the device, exported, ``aoti_compile_and_package``. aotstack's program is exported on the host, as
    ``aotstack.export`` takes it; the partitioner puts its delegates and their weights on the device.
    """
    exact_float32()
    started = time.perf_counter()
    try:
        detail = {"aoti": build_aoti, "aotstack": build_aotstack, "warm": warm_compile}[kind](
            row, dtype, directory, device, size
        )
    except Exception as exc:  # the row's cell says why; the other builds go on
        write_result(result, {"error": error_text(exc), "seconds": time.perf_counter() - started})
        return
    write_result(result, {"detail": detail, "seconds": time.perf_counter() - started})


def build_aoti(row: Row, dtype: str, directory: str, device: str, size: str) -> str:
    stage(f"exporting {row.name} {dtype} on {device}")
    with torch.no_grad():
        if row.decoder:
            program = exported_decoder(decoder_model(row, dtype, size).to(device), row.cache, device)
        else:
            model, args = forward_workload(row, dtype, size)
            program = torch.export.export(model.to(device), tuple(a.to(device) for a in args))
        stage("aoti_compile_and_package")
        torch._inductor.aoti_compile_and_package(program, package_path=package_path(directory, "aoti", row.name, dtype))
    return ""


def build_aotstack(row: Row, dtype: str, directory: str, device: str, size: str) -> str:
    stage(f"exporting {row.name} {dtype} on the host")
    if row.decoder:
        program = aotstack.Program({row.method: exported_decoder(decoder_model(row, dtype, size), row.cache, "cpu")})
    else:
        model, args = forward_workload(row, dtype, size)
        program = aotstack.export(model, {row.method: args})
    stage("aotstack.lower")
    lowered = aotstack.lower(program, [cuda_partitioner(device)], skip_h2d_for_method_inputs=True,
                             skip_d2h_for_method_outputs=True)
    lowered.save(package_path(directory, "aotstack", row.name, dtype))
    return delegates_text(lowered, row.method)


def warm_compile(row: Row, dtype: str, directory: str, device: str, size: str) -> str:
    """Compile and run the row's torch.compile variant once, so the measuring process finds Inductor's caches warm.

    Its compile (dynamo, then a cache hit) still happens there, in the same process as the other columns.
    """
    stage(f"torch.compile {row.name} {dtype}")
    variant = compiled_variant(row, dtype, device, size)
    with torch.no_grad():
        for _ in range(3):
            variant()
    synchronize(device)
    return ""


def compiled_variant(row: Row, dtype: str, device: str, size: str) -> Callable[[], Any]:
    """One call of the row's model through torch.compile; a decoder's at position 0."""
    if row.decoder:
        step = compiled_step(step_module(decoder_model(row, dtype, size).to(device), row.cache))
        ids, position = torch.tensor([[1]], device=device), torch.tensor([0], device=device)
        return lambda: step(ids, position)
    model, args = forward_workload(row, dtype, size)
    call = compiled_call(model.to(device))
    on_device = tuple(a.to(device) for a in args)
    return lambda: call(*on_device)


def compiled_call(model: torch.nn.Module) -> Callable[..., Any]:
    """``torch.compile(mode="reduce-overhead")``: Inductor's kernels replayed as CUDA graphs.

    Each call starts a new step of its graph trees, so the previous call's outputs may be overwritten:
    every caller here is done with them by then.
    """
    compiled = torch.compile(model, mode="reduce-overhead")

    def call(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return call


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compiled_step(module: torch.nn.Module) -> Step:
    call = compiled_call(module)
    return lambda ids, position: call(input_ids=ids, cache_position=position)


# The corpus: tests/hf_models.py, lowered for the GPU as a user would, run from a fresh process.


def corpus_build(directory: str, device: str, names: Sequence[str], result: str) -> None:
    """Each model lowered with the CUDA partitioner and saved; eager's outputs (on the host) kept beside it."""
    from tests import hf_models

    exact_float32()
    outcome: dict[str, dict[str, Any]] = {}
    for name in names:
        stage(f"corpus {name}")
        started = time.perf_counter()
        try:
            model, inputs = hf_models.build(name), hf_models.example_inputs(name)
            with torch.no_grad():
                expected = list(torch.utils._pytree.tree_leaves(model(*inputs)))
            torch.save(expected, os.path.join(directory, f"{name}.eager.pt"))
            lowered = aotstack.lower(aotstack.export(model, {"forward": inputs}), [cuda_partitioner(device)])
            lowered.save(os.path.join(directory, f"{name}.pt2"))
            outcome[name] = {"delegates": delegates_text(lowered, "forward")}
        except Exception as exc:
            outcome[name] = {"error": error_text(exc)}
        outcome[name]["seconds"] = time.perf_counter() - started
    write_result(result, outcome)


def corpus_run(directory: str, device: str, names: Sequence[str], result: str) -> None:
    """Each saved file loaded here, run on its example inputs (host tensors in and out), compared with eager."""
    from tests import hf_models

    try:  # registers transformers' grouped_mm_fallback, which the mixtures of experts call
        import transformers.integrations.moe  # noqa: F401
    except ImportError:
        pass
    exact_float32()
    outcome: dict[str, dict[str, Any]] = {}
    for name in names:
        stage(f"corpus run {name}")
        try:
            got = torch.utils._pytree.tree_leaves(aotstack.load(os.path.join(directory, f"{name}.pt2")).forward(
                *hf_models.example_inputs(name)))
            expected = torch.load(os.path.join(directory, f"{name}.eager.pt"), weights_only=True)
            outcome[name] = corpus_comparison(got, expected)
        except Exception as exc:
            outcome[name] = {"error": error_text(exc)}
    write_result(result, outcome)


def corpus_comparison(got: Sequence[Any], expected: Sequence[Any]) -> dict[str, Any]:
    """Shapes and dtypes equal and every value within ``CORPUS_ATOL + CORPUS_RTOL * |eager|``; the largest gap."""
    if len(got) != len(expected):
        return {"match": False, "max_abs": None, "why": f"{len(got)} outputs, eager has {len(expected)}"}
    gaps, problems = [], []
    for index, (a, b) in enumerate(zip(got, expected)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            problems += [] if a == b else [f"output {index}: {a!r}, eager {b!r}"]
            continue
        a = a.cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"output {index}: {a.dtype} {list(a.shape)}, eager {b.dtype} {list(b.shape)}")
        elif not a.is_floating_point():
            problems += [] if torch.equal(a, b) else [f"output {index} differs"]
        elif a.numel():
            difference = (a.double() - b.double()).abs()
            gaps.append(difference.max().item())
            if not torch.all(difference <= CORPUS_ATOL + CORPUS_RTOL * b.double().abs()):  # NaN included
                problems.append(f"output {index} beyond atol {CORPUS_ATOL:g} + rtol {CORPUS_RTOL:g}")
    largest = math.nan if any(math.isnan(gap) for gap in gaps) else max(gaps, default=0.0)
    return {"match": not problems, "max_abs": largest, "why": "; ".join(problems)}


# One speed row: every column built, checked against eager and timed side by side in this process.


@dataclass
class Cell:
    """One column of a row: its median, or why there is none (``status`` says which)."""

    status: str = "ok"  # ok, tie (tokens differ from eager's, logits within tolerance), WRONG, failed, n/a
    value: float | None = None
    reason: str = ""
    detail: str = ""
    difference: float | None = None  # max |column - eager| over max(1, max |eager|): outputs, or forced logits
    note: str = ""  # a measured figure's caveat, e.g. graphs asked for but not captured
    samples: list[float] = field(default_factory=list)


@dataclass
class Variant:
    """A column ready to run: ``call()`` for a forward row, ``call(ids, position)`` for a decoder."""

    name: str
    call: Callable[..., Any]
    detail: str = ""
    graphs: Callable[[], str] | None = None  # loaded with cuda_graphs: its method's status ("captured on cuda:0")


class Wrong(Exception):
    """The column ran and its answer is not eager's."""


class Unavailable(Exception):
    """The column cannot run here (aotstack's load has no cuda_graphs yet; the host's smoke mode)."""


@dataclass(frozen=True)
class Timing:
    rounds: int
    tokens: int  # a decoder's greedy tokens a round
    block_seconds: float  # a forward row's timed block, per column and round


class DecoderInputs:
    """Every tensor a decode feeds, made on the device before the clock starts: no host copy while timing."""

    def __init__(self, device: str, total: int) -> None:
        self.prompt = [torch.tensor([[token]], device=device) for token in PROMPT]
        self.positions = [torch.tensor([position], device=device) for position in range(total)]


def greedy(step: Step, inputs: DecoderInputs, tokens: int, device: str) -> tuple[list[int], float]:
    """The prompt token by token, then ``tokens`` greedy steps; the tokens and the seconds those steps took.

    Each next token stays on the device (an argmax of the last logits): the host waits only at the end.
    """
    with torch.no_grad():
        for position, ids in enumerate(inputs.prompt):
            logits = step(ids, inputs.positions[position])
        chosen = []
        synchronize(device)
        started = time.perf_counter()
        for position in range(len(PROMPT), len(PROMPT) + tokens):
            ids = logits[:, -1:].argmax(-1)
            chosen.append(ids)
            logits = step(ids, inputs.positions[position])
        synchronize(device)
        seconds = time.perf_counter() - started
        return torch.cat(chosen).flatten().tolist(), seconds


def forced_logits(step: Step, inputs: DecoderInputs, reference: list[int], device: str) -> torch.Tensor:
    """Last-position logits of every step, fed the prompt and then eager's tokens (teacher forcing)."""
    rows = []
    with torch.no_grad():
        for position, token in enumerate([*PROMPT, *reference]):
            logits = step(torch.tensor([[token]], device=device), inputs.positions[position])
            rows.append(logits[0, -1].float().clone())  # a graph's output is overwritten by its next replay
    return torch.stack(rows)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| over max(1, max |expected|); NaN where a value is NaN."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        raise Wrong(f"output {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, eager's {tuple(expected.shape)}")
    difference = (got.float() - expected.float()).abs().max().item()
    return difference / max(1.0, expected.float().abs().max().item())


def has_cuda_graphs() -> bool:
    """Whether this aotstack's ``load`` takes ``cuda_graphs=`` (being added; without it the column says n/a)."""
    return "cuda_graphs" in inspect.signature(aotstack.load).parameters


def graphs_option(row: Row) -> bool | list[str]:
    """A decoder names its method (the list form); a forward workload takes every method (``True``)."""
    return [row.method] if row.decoder else True


def variant_makers(row: Row, dtype: str, directory: str, device: str, size: str) -> dict[str, Callable[[], Variant]]:
    """How to make each column; eager's model and inputs are built here, each column made when asked."""
    builds = read_builds(directory, row.name, dtype)
    if row.decoder:
        model = decoder_model(row, dtype, size).to(device)
        eager = step_module(model, row.cache)
        args: tuple[torch.Tensor, ...] = ()
        makers: dict[str, Callable[[], Variant]] = {
            EAGER: lambda: Variant(EAGER, lambda ids, pos: eager(input_ids=ids, cache_position=pos),
                                   parameters_text(model)),
            COMPILE: lambda: Variant(COMPILE, compiled_step(step_module(model, row.cache))),
        }
    else:
        model, args = forward_workload(row, dtype, size)
        model, args = model.to(device), tuple(a.to(device) for a in args)
        makers = {
            EAGER: lambda: Variant(EAGER, bound(model, args), parameters_text(model)),
            COMPILE: lambda: Variant(COMPILE, bound(compiled_call(model), args)),
        }
    makers[AOTI] = lambda: aoti_variant(row, dtype, directory, builds.get("aoti", {}), args)
    makers[STACK] = lambda: aotstack_variant(row, dtype, directory, builds.get("aotstack", {}), args, device, False)
    makers[GRAPHS] = lambda: aotstack_variant(row, dtype, directory, builds.get("aotstack", {}), args, device, True)
    return makers


def bound(call: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
    return lambda: call(*args)


def read_builds(directory: str, row: str, dtype: str) -> dict[str, dict[str, Any]]:
    """What the build processes recorded for this row: per kind, its detail or its error."""
    found = {}
    for kind in ("aoti", "aotstack"):
        path = build_record(directory, kind, row, dtype)
        if os.path.exists(path):
            with open(path) as file:
                found[kind] = json.load(file)
    return found


def not_built(built: dict[str, Any]) -> Exception:
    """Why a column's file is missing: its build's error, or no time left to build it (not a failure)."""
    error = built.get("error", "its build left no record")
    return Unavailable(f"not built: {error}") if built.get("out_of_time") else RuntimeError(error)


def aoti_variant(row: Row, dtype: str, directory: str, built: dict[str, Any], args: tuple[Any, ...]) -> Variant:
    path = package_path(directory, "aoti", row.name, dtype)
    if not os.path.exists(path):
        raise not_built(built)
    package = torch._inductor.aoti_load_package(path)
    if row.decoder:
        return Variant(AOTI, lambda ids, pos: package(input_ids=ids, cache_position=pos))
    return Variant(AOTI, bound(package, args))


def aotstack_variant(
    row: Row, dtype: str, directory: str, built: dict[str, Any], args: tuple[Any, ...], device: str, graphs: bool
) -> Variant:
    """The aotstack file loaded plain, or with CUDA graphs (``cuda_graphs=``, where this aotstack has it)."""
    name = GRAPHS if graphs else STACK
    if graphs and not device.startswith("cuda"):
        raise Unavailable("n/a (no CUDA graphs on the host)")
    if graphs and not has_cuda_graphs():
        raise Unavailable("n/a (load has no cuda_graphs)")
    path = package_path(directory, "aotstack", row.name, dtype)
    if not os.path.exists(path):
        raise not_built(built)
    loaded = aotstack.load(path, cuda_graphs=graphs_option(row)) if graphs else aotstack.load(path)
    method = loaded.method(row.method)
    detail = f"load(path, cuda_graphs={graphs_option(row)!r})" if graphs else built.get("detail", "")
    status = (lambda: loaded.cuda_graphs.get(row.method, "no status")) if graphs else None
    if row.decoder:
        return Variant(name, lambda ids, pos: method(input_ids=ids, cache_position=pos), detail, status)
    return Variant(name, bound(method, args), detail, status)


def made_variants(makers: dict[str, Callable[[], Variant]], skip: Sequence[str]) -> tuple[dict[str, Variant],
                                                                                         dict[str, Cell]]:
    """Each column made, or its cell saying why not; one failing leaves the others."""
    variants: dict[str, Variant] = {}
    cells: dict[str, Cell] = {}
    for name in VARIANTS:
        if name in skip:
            cells[name] = Cell("n/a", reason="left out: it crashed the row's process")
            continue
        stage(f"building {name}")
        try:
            variants[name] = makers[name]()
            cells[name] = Cell(detail=variants[name].detail)
        except Unavailable as exc:
            cells[name] = Cell("n/a", reason=str(exc))
        except Exception as exc:
            cells[name] = Cell("failed", reason=error_text(exc))
    return variants, cells


def drop(name: str, exc: Exception, variants: dict[str, Variant], cells: dict[str, Cell]) -> None:
    """The column is not timed: WRONG where its answer differs from eager's, failed where it raised."""
    status = "WRONG" if isinstance(exc, Wrong) else "failed"
    cells[name] = Cell(status, reason=str(exc) if status == "WRONG" else error_text(exc), detail=cells[name].detail)
    variants.pop(name)


def check_forward(variants: dict[str, Variant], cells: dict[str, Cell], dtype: str, device: str) -> None:
    """Eager's output first; every column's against it after ``WARM_UP`` calls, so a graph's replay is checked."""
    with torch.no_grad():
        expected = variants[EAGER].call().clone()
        for name, variant in list(variants.items()):
            stage(f"checking {name}")
            started = time.perf_counter()
            try:
                for _ in range(WARM_UP):
                    variant.call()
                difference = relative_difference(variant.call(), expected)
                synchronize(device)
            except Exception as exc:
                drop(name, exc, variants, cells)
                continue
            cells[name].difference = difference
            if not difference <= TOLERANCE[dtype]:  # NaN included
                drop(name, Wrong(f"max |difference from eager| {difference:.3g} of its largest value, allowed "
                                 f"{TOLERANCE[dtype]:g}"), variants, cells)
            elif name == COMPILE:
                cells[name].detail = f"first calls {time.perf_counter() - started:.1f} s (compile, capture)"


def check_decoder(variants: dict[str, Variant], cells: dict[str, Cell], dtype: str, timing: Timing,
                  inputs: DecoderInputs, device: str) -> None:
    """Eager's greedy tokens; a column whose tokens differ is fed eager's and its logits compared.

    With random weights the top logits are close, and summing in another order can swap two: within
    the tolerance that is a near-tie (timed, marked), beyond it the column is WRONG (not timed).
    """
    stage(f"checking {EAGER}")
    reference, _ = greedy(variants[EAGER].call, inputs, timing.tokens, device)
    eager_logits: list[torch.Tensor] = []
    for name, variant in list(variants.items()):
        if name == EAGER:
            continue
        stage(f"checking {name}")
        started = time.perf_counter()
        try:
            tokens, _ = greedy(variant.call, inputs, timing.tokens, device)
            if name == COMPILE:
                cells[name].detail = f"first decode {time.perf_counter() - started:.1f} s (compile, capture)"
            if tokens == reference:
                continue
            first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
            if not eager_logits:
                eager_logits.append(forced_logits(variants[EAGER].call, inputs, reference, device))
            difference = relative_difference(forced_logits(variant.call, inputs, reference, device), eager_logits[0])
        except Exception as exc:
            drop(name, exc, variants, cells)
            continue
        cells[name].difference = difference
        differ = f"greedy tokens differ from eager's from token {first} on"
        if not difference <= TOLERANCE[dtype]:
            drop(name, Wrong(f"{differ}; fed eager's tokens, max |logits - eager's| {difference:.3g} of the largest, "
                             f"allowed {TOLERANCE[dtype]:g}"), variants, cells)
        else:
            cells[name].status = "tie"
            cells[name].reason = f"{differ}: a near-tie (fed eager's tokens, its logits are within {difference:.2g})"


def time_forward(variants: dict[str, Variant], cells: dict[str, Cell], timing: Timing, device: str) -> None:
    """Each round times a block of calls per column (about ``block_seconds``), the order rotated by one a round."""
    calls = {}
    with torch.no_grad():
        for name, variant in variants.items():
            synchronize(device)
            started = time.perf_counter()
            variant.call()
            synchronize(device)
            calls[name] = max(3, min(5000, round(timing.block_seconds / max(time.perf_counter() - started, 1e-6))))
        order = list(variants)
        for index in range(timing.rounds):
            shift = index % len(order)
            for name in order[shift:] + order[:shift]:
                stage(f"timing {name}")
                synchronize(device)
                started = time.perf_counter()
                for _ in range(calls[name]):
                    variants[name].call()
                synchronize(device)
                cells[name].samples.append((time.perf_counter() - started) / calls[name] * 1e3)


def time_decoder(variants: dict[str, Variant], cells: dict[str, Cell], timing: Timing, inputs: DecoderInputs,
                 device: str) -> None:
    """Each round decodes ``tokens`` greedy tokens per column, the order rotated by one a round; tokens/s."""
    order = list(variants)
    first: dict[str, list[int]] = {}
    for index in range(timing.rounds):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            if name not in variants:
                continue
            stage(f"timing {name}")
            tokens, seconds = greedy(variants[name].call, inputs, timing.tokens, device)
            if first.setdefault(name, tokens) != tokens:
                drop(name, Wrong(f"round {index + 1}: its tokens changed from its first round's"), variants, cells)
                continue
            cells[name].samples.append(timing.tokens / seconds)


def measure(row: Row, dtype: str, directory: str, device: str, size: str, timing: Timing, skip: Sequence[str],
            result: str) -> None:
    """Every column of one row made, checked against eager, timed side by side; eager is needed for the rest."""
    exact_float32()
    variants, cells = made_variants(variant_makers(row, dtype, directory, device, size), skip)
    if EAGER in variants:
        if row.decoder:
            inputs = DecoderInputs(device, len(PROMPT) + timing.tokens)
            check_decoder(variants, cells, dtype, timing, inputs, device)
            time_decoder(variants, cells, timing, inputs, device)
        else:
            check_forward(variants, cells, dtype, device)
            time_forward(variants, cells, timing, device)
    for name, variant in variants.items():
        if cells[name].samples:
            cells[name].value = median(cells[name].samples)
        if variant.graphs is not None:
            status = variant.graphs()
            cells[name].detail += f": {status}"
            if not status.startswith("captured"):
                cells[name].note = f"cuda_graphs asked for, not in use ({status}): timed as plain calls"
    write_result(result, {"cells": {name: asdict(cell) for name, cell in cells.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True, help="where this process writes its JSON object")
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("probe-build")
    probe.add_argument("kind", choices=["plain", "aotstack"])
    probe.add_argument("directory")
    probe.add_argument("device")
    opening = commands.add_parser("probe-open")
    opening.add_argument("kind", choices=["plain", "aotstack"])
    opening.add_argument("directory")
    opening.add_argument("device")
    building = commands.add_parser("build")
    building.add_argument("kind", choices=["aoti", "aotstack", "warm"])
    for sub in (building, measuring := commands.add_parser("measure")):
        sub.add_argument("row", choices=list(ROWS))
        sub.add_argument("dtype", choices=list(DTYPES))
        sub.add_argument("directory")
        sub.add_argument("device")
        sub.add_argument("size", choices=["full", "quick"])
    measuring.add_argument("--rounds", type=int, default=5)
    measuring.add_argument("--tokens", type=int, default=64)
    measuring.add_argument("--block", type=float, default=0.2, help="seconds a forward row's timed block lasts")
    measuring.add_argument("--skip", nargs="*", default=[], choices=VARIANTS)
    for name in ("corpus-build", "corpus-run"):
        corpus = commands.add_parser(name)
        corpus.add_argument("directory")
        corpus.add_argument("device")
        corpus.add_argument("names", nargs="+")
    args = parser.parse_args()
    if args.command == "probe-build":
        probe_build(args.kind, args.directory, args.device, args.result)
    elif args.command == "probe-open":
        probe_open(args.kind, args.directory, args.device, args.result)
    elif args.command == "build":
        build(args.kind, ROWS[args.row], args.dtype, args.directory, args.device, args.size, args.result)
    elif args.command == "corpus-build":
        corpus_build(args.directory, args.device, args.names, args.result)
    elif args.command == "corpus-run":
        corpus_run(args.directory, args.device, args.names, args.result)
    else:
        timing = Timing(args.rounds, args.tokens, args.block)
        measure(ROWS[args.row], args.dtype, args.directory, args.device, args.size, timing, args.skip, args.result)


if __name__ == "__main__":
    main()
