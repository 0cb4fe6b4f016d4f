"""What the benchmarks measure in a fresh process; its last line of output is one JSON object (``serve``: one each).

    child.py sha256 FILE                                     read and SHA-256-hash FILE once
    child.py load aotstack|aoti|executorch PACKAGE INPUTS THREADS [--import M]   load + first call; resident memory
                                                            after import, load, the call and a second call
    child.py compile aotstack|aoti WORKLOAD PACKAGE THREADS [--exclude OP ...] [--jobs N]
    child.py serve KIND PACKAGE THREADS [--inputs F] [--state F] [--precision P]   a file kept open in an engine
                                                            (``engine_calls``; a decoder, or with --inputs a
                                                            forward): one JSON request per line on stdin, one
                                                            JSON reply per line (``common.Worker``)

Run through ``common.run_child`` (``serve``: ``common.Worker``), which puts ``bench/`` and the repository root on
the path. Imports are untimed: each side imports what its own load or compile needs before the clock starts.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any


def status(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as lines:
        line = next(line for line in lines if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def memory() -> dict[str, int]:
    return {
        "rss": status("VmRSS"),
        "peak_rss": status("VmHWM"),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def resident(package: str) -> dict[str, int]:
    """Resident memory now, in bytes: in all, private anonymous, file-backed, and the pages of ``package``'s mapping.

    ``package`` is what aotstack maps (the ``.pt2``); ``file`` also counts shared libraries.
    """
    target, mapped = os.path.realpath(package), 0
    current = False
    with open("/proc/self/smaps") as lines:
        for line in lines:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's header: address range, ..., path
                current = len(fields) >= 6 and fields[5] == target
            elif current and fields[0] == "Rss:":
                mapped += int(fields[1]) * 1024
    return {"rss": status("VmRSS"), "anon": status("RssAnon"), "file": status("RssFile"), "package": mapped}


def emit(**figures: Any) -> None:
    print(json.dumps(figures), flush=True)


def sha256(path: str) -> None:
    import hashlib

    buffer = bytearray(1 << 22)
    view = memoryview(buffer)
    digest = hashlib.sha256()
    started = time.perf_counter()
    size = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            size += count
    digest.hexdigest()
    emit(read_hash_s=time.perf_counter() - started, bytes=size, **memory())


def load(kind: str, package: str, inputs: str, threads: int, imports: list[str]) -> None:
    started = time.perf_counter()
    import importlib

    import torch

    import aotstack  # noqa: F401

    # The modules registering the package's custom ops (a mixture of experts' grouped matmul).
    for module in imports:
        importlib.import_module(module)

    import_rss = status("VmRSS")  # a fresh process after `import torch, aotstack`: what each load imports counts
    # Each opener gives the package's forward, called on ``call``'s inputs.
    if kind == "aotstack":
        from aotstack import load as open_aotstack

        def open_package(path: str) -> Callable[[], Any]:
            forward = open_aotstack(path).forward
            return lambda: forward(*call["args"], **call["kwargs"])
    elif kind == "executorch":  # a .pte file, opened as the benchmark times it; inputs passed positionally
        from engine_calls import open_executorch

        def open_package(path: str) -> Callable[[], Any]:
            positional = [*call["args"], *call["kwargs"].values()]
            forward = open_executorch(path, threads, positional, None, "f32").forward
            assert forward is not None
            return forward
    else:
        import torch._inductor

        def open_package(path: str) -> Callable[[], Any]:
            package = torch._inductor.aoti_load_package(path)
            return lambda: package(*call["args"], **call["kwargs"])
    imported = time.perf_counter()
    torch.set_num_threads(threads)
    call = torch.load(inputs, weights_only=True)
    imported_memory = resident(package)
    begin = time.perf_counter()
    run = open_package(package)
    loaded_at = time.perf_counter()
    after_load = resident(package)
    run()
    end = time.perf_counter()
    figures = memory()
    after_call = resident(package)
    # Untimed: a page an engine gave back and reads after all comes back here.
    run()
    emit(import_s=imported - started, load_first_s=end - begin, load_s=loaded_at - begin, import_rss=import_rss,
         resident={"import": imported_memory, "load": after_load, "call": after_call,
                   "second call": resident(package)}, **figures)


def compile_package(kind: str, workload: str, package: str, threads: int, exclude: list[str], jobs: int | None) -> None:
    import torch
    import torch._inductor

    import aotstack
    from workloads import WORKLOADS

    torch.set_num_threads(threads)
    model, args = WORKLOADS[workload]()
    if kind == "explain":
        export, explain = aotstack.export, aotstack.explain  # imports the compile side, untimed
        partitioner = aotstack.AotiCpuPartitioner(exclude_ops=exclude)
        started = time.perf_counter()
        program = export(model, {"forward": args})
        exported = time.perf_counter()
        report = explain(program, [partitioner])
        compiled = time.perf_counter()
        delegates, details = len(report.method("forward").delegates), {}
    elif kind in ("aotstack", "auto"):
        export, lower = aotstack.export, aotstack.lower  # imports the compile side, untimed
        partitioners = "auto" if kind == "auto" else [aotstack.AotiCpuPartitioner(exclude_ops=exclude)]
        options = {} if jobs is None else {"jobs": jobs}
        started = time.perf_counter()
        program = export(model, {"forward": args})
        exported = time.perf_counter()
        lowered = lower(program, partitioners, **options)
        compiled = time.perf_counter()
        lowered.save(package)
        delegates = len(lowered.delegates("forward"))
        # Where this aotstack records it: each partition's compile seconds, and the worker processes used.
        log = getattr(lowered, "compile_log", {}).get("forward", [])
        details = {"partition_s": [round(r.seconds, 2) for r in log], "workers": len({r.worker for r in log} - {None})}
    else:
        started = time.perf_counter()
        program = torch.export.export(model, args)
        exported = time.perf_counter()
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(program, package_path=package)
        compiled = time.perf_counter()
        delegates, details = 1, {}
    saved = time.perf_counter()
    cpu_s = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    emit(export_s=exported - started, compile_s=compiled - exported, save_s=saved - compiled,
         delegates=delegates, cpu_s=cpu_s, **details)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collected first, then no garbage collection inside: none lands in a timed stretch."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def serve(kind: str, package: str, threads: int, inputs: str | None, state: str | None, precision: str) -> None:
    """Open ``package`` in ``kind``'s engine (``engine_calls``) and answer the benchmark's requests until stdin closes.

    First, once: ``{"ready": true}``, or ``{"error"}`` and the process ends. A forward (``inputs``: its arguments,
    a ``common.save_inputs`` file): ``{"output": true, "path": P}`` saves one call's output to P; ``{"block": N}``
    replies ``{"ms"}``, per call over N back-to-back calls. A decoder (``state``: the initial cache tensors an
    engine without buffers is handed, a ``save_inputs`` file too): ``{"generate": N}`` resets, feeds the prompt,
    then N greedy tokens, and replies ``{"tokens", "seconds"}`` (the steps after the prompt); ``{"forced":
    [tokens], "path": P}`` resets, steps once per token, and saves the last position's logits, stacked, to P. A
    failed request replies ``{"error"}``. Replies go to the stdout this process started with; anything a library
    prints goes to stderr.
    """
    import sys

    import torch

    from decode import decode
    from engine_calls import block_ms, forced_logits, open_engine

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(**fields: Any) -> None:
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    def saved(path: str | None) -> list[Any] | None:
        return torch.load(path, weights_only=True)["args"] if path else None

    try:
        opened = open_engine(kind, package, threads, saved(inputs), saved(state), precision)
    except Exception as exc:
        reply(error=f"{type(exc).__name__}: {exc}")
        return
    reply(ready=True)
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict[str, Any] = {}
        try:
            if "output" in request:
                torch.save(opened.forward(), request["path"])
            elif "block" in request:
                with collector_paused():
                    answer["ms"] = block_ms(opened.forward, request["block"])
            elif "generate" in request:
                opened.reset()
                with collector_paused():
                    answer["tokens"], answer["seconds"] = decode(opened.step, request["generate"])
            else:
                opened.reset()
                torch.save(forced_logits(opened.step, request["forced"]), request["path"])
        except Exception as exc:  # the benchmark reports it in the engine's cell
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        reply(**answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    hashing = commands.add_parser("sha256")
    hashing.add_argument("path")
    loading = commands.add_parser("load")
    loading.add_argument("kind", choices=["aotstack", "aoti", "executorch"])
    loading.add_argument("package")
    loading.add_argument("inputs")
    loading.add_argument("threads", type=int)
    loading.add_argument("--import", dest="imports", action="append", default=[])
    compiling = commands.add_parser("compile")
    compiling.add_argument("kind", choices=["aotstack", "auto", "aoti", "explain"])
    compiling.add_argument("workload")
    compiling.add_argument("package")
    compiling.add_argument("threads", type=int)
    compiling.add_argument("--exclude", nargs="*", default=[])
    compiling.add_argument("--jobs", type=int, default=None)
    serving = commands.add_parser("serve")
    serving.add_argument("kind", choices=["aotstack", "executorch", "aoti", "onnxruntime", "openvino"])
    serving.add_argument("package")
    serving.add_argument("threads", type=int)
    serving.add_argument("--inputs", default=None)
    serving.add_argument("--state", default=None)
    serving.add_argument("--precision", default="f32")
    args = parser.parse_args()
    if args.command == "sha256":
        sha256(args.path)
    elif args.command == "load":
        load(args.kind, args.package, args.inputs, args.threads, args.imports)
    elif args.command == "serve":
        serve(args.kind, args.package, args.threads, args.inputs, args.state, args.precision)
    else:
        compile_package(args.kind, args.workload, args.package, args.threads, args.exclude, args.jobs)


if __name__ == "__main__":
    main()
