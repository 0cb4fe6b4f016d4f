"""The ``aotstack`` command: demo, compile, run, inspect, keygen, sign, verify, and export-hf, generate, speak."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import AotstackError, CheckError
from .integrations.tasks import TASKS

if TYPE_CHECKING:
    from .compile.auto import Auto
    from .compile.check import Check
    from .compile.lower import PartitionerPlan
    from .compile.quantize import Quantization
    from .format.manifest import InputRecord
    from .report.model import Report


# Loggers whose warnings are notes on importing an engine's library, nothing the command's user can act on: torchao's
# on the CUDA kernels a CPU machine cannot load and on Triton's absence, and torch's on how torchao registers its
# enums (torchao comes in with ExecuTorch, on every lowering auto times XNNPACK in).
IMPORT_NOTES = ("torchao", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    # aotstack's own progress at INFO; the engines' libraries only where they warn (their INFO notes, ExecuTorch's
    # per-weight lines and onnxscript's optimizer passes, are many and not the user's business).
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("aotstack").setLevel(logging.INFO)
    for name in IMPORT_NOTES:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return args.command(args)
    except (AotstackError, ValueError) as exc:  # ValueError: a bad op name or option value
        print(f"aotstack: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader stopped early (``| head``): not an error, and no traceback at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aotstack", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="compile the bundled demo model, load it in a fresh process, run it")
    demo.add_argument("--keep", metavar="DIR", help="keep demo.pt2 in DIR")
    demo.set_defaults(command=demo_command)

    compile_ = commands.add_parser("compile", help="export, partition and compile a model into one .pt2")
    compile_.add_argument("target", metavar="MODULE:FUNCTION", help="returns (model, {method: example args})")
    compile_.add_argument("-o", "--output", required=True, metavar="FILE.pt2")
    add_partitioner_options(compile_)
    add_quantize_options(compile_)
    add_compile_error_option(compile_)
    add_compile_run_options(compile_)
    compile_.add_argument("--check", nargs="?", const="outputs", choices=("outputs", "partition"), default=None,
                          help="run each method on its example inputs, eagerly and from the package, and fail past "
                               "the tolerance; =partition also compares each delegate with the eager ops it replaced")
    add_tolerance_options(compile_)
    compile_.set_defaults(command=compile_command)

    explain = commands.add_parser(
        "explain", help="dry run: partition a model as compile would and report it, compiling nothing"
    )
    explain.add_argument("target", metavar="MODULE:FUNCTION", help="returns (model, {method: example args})")
    add_partitioner_options(explain)
    add_quantize_options(explain)
    add_report_options(explain)
    explain.set_defaults(command=explain_command)

    export_hf = commands.add_parser(
        "export-hf", help="export a Hugging Face model folder into a folder holding one .pt2, its configs and tokenizer"
    )
    export_hf.add_argument("model_dir", metavar="MODEL_DIR", help="a folder saved with save_pretrained (safetensors)")
    export_hf.add_argument("-o", "--output", required=True, metavar="OUT_DIR",
                           help="the folder to write; written beside it first and renamed when complete")
    export_hf.add_argument("--task", default=None, metavar="TASK",
                           help=f"{', '.join(TASKS[:-1])} or {TASKS[-1]} (default: from the model's config)")
    export_hf.add_argument("--engines", default="auto", metavar="auto|ENGINE,...",
                           help="auto (default: time each installed engine's plan, keep the fastest per method), "
                                "or engines in claiming order, e.g. aoti, ort,aoti or ov,aoti")
    export_hf.add_argument("--device", default="cpu", metavar="DEVICE",
                           help="where AOTInductor's parts run: cpu (default), cuda[:N] or mps")
    add_quantize_options(export_hf)
    export_hf.add_argument("--max-cache-len", type=positive_int, default=None, metavar="N",
                           help="generation: the KV cache's length, the longest prompt plus new tokens "
                                "(default: the model's max_position_embeddings, at most 1024)")
    export_hf.add_argument("--image-size", type=positive_int, default=None, metavar="PIXELS",
                           help="image-text-to-text: the side of the square images a model whose processor keeps "
                                "an image's size (Qwen2-VL's; default 448) or cuts it into tiles by its size "
                                "(LLaVA-NeXT's; default one tile) takes; each image is resized to it")
    export_hf.add_argument("--check", action="store_true",
                           help="run each method of the file on its example inputs, eagerly and from the file, "
                                "and fail past aotstack.Check's tolerance (or --atol, --rtol)")
    add_tolerance_options(export_hf)
    add_compile_error_option(export_hf)
    add_compile_run_options(export_hf)
    export_hf.set_defaults(command=export_hf_command)

    generate = commands.add_parser(
        "generate", help="generate text from an export-hf folder, as its generation config says (greedy or sampled); "
                         "--audio transcribes speech (or is heard with the prompt), --image reads a picture with the "
                         "prompt"
    )
    generate.add_argument("folder", metavar="OUT_DIR", help="a folder aotstack export-hf wrote")
    generate.add_argument("--prompt", default=None, metavar="TEXT", help="the text to continue (or, with --chat, "
                                                                          "the user's message)")
    generate.add_argument("--chat", action="store_true",
                          help="wrap --prompt as a user message in the tokenizer's chat template")
    generate.add_argument("--messages", default=None, metavar="FILE.json",
                          help='a conversation through the chat template: [{"role": "user", "content": "..."}, ...]')
    generate.add_argument("--audio", default=None, metavar="FILE.wav",
                          help="transcribe a WAV file (an automatic-speech-recognition export, e.g. Whisper), or, "
                               "for an audio-text model (e.g. GLM-ASR, Voxtral), the clip the prompt is about")
    generate.add_argument("--language", default=None, metavar="CODE",
                          help="with --audio, the language spoken (en, fr, ...): Whisper's language token, or the "
                               "language a recogniser's processor builds its decoder prompt for (Cohere's, Canary's)")
    generate.add_argument("--image", default=None, metavar="FILE",
                          help="an image the prompt is about (an image-text-to-text export, e.g. LLaVA or Gemma 3), "
                               "or to read text from (an image encoder-decoder, e.g. TrOCR or Donut, --prompt "
                               "starting its text); read with Pillow through the model's processor")
    generate.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                          help="generate at most N tokens (default: the generation config's, else 32); fewer when "
                               "the model ends its text")
    generate.add_argument("--temperature", type=float, default=None, metavar="T",
                          help="sample at temperature T (0: greedy); default: the generation config's")
    generate.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K likeliest tokens")
    generate.add_argument("--top-p", type=float, default=None, metavar="P",
                          help="sample from the likeliest tokens holding probability P")
    generate.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                          help="divide the scores of tokens already seen by R (above 1: repeat less)")
    generate.add_argument("--greedy", action="store_true", help="pick the likeliest token at every step")
    generate.add_argument("--seed", type=int, default=None, metavar="S",
                          help="seed of the sampling: the same seed gives the same text")
    generate.add_argument("--eos", type=token_ids, default=None, metavar="ID[,ID...]",
                          help="token ids that end the text (default: the generation config's)")
    generate.add_argument("--no-stream", dest="stream", action="store_false",
                          help="print the text once it is complete, not token by token")
    generate.set_defaults(command=generate_command)

    speak = commands.add_parser(
        "speak", help="say a text with a text-to-speech export-hf folder (VITS, MMS-TTS) into a WAV file"
    )
    speak.add_argument("folder", metavar="OUT_DIR", help="a folder aotstack export-hf wrote for text-to-speech")
    speak.add_argument("--text", required=True, metavar="TEXT", help="what to say")
    speak.add_argument("--out", required=True, metavar="FILE.wav", help="the WAV file to write (16-bit PCM)")
    speak.set_defaults(command=speak_command)

    run = commands.add_parser("run", help="run a method on random inputs of the recorded shapes")
    run.add_argument("package", metavar="FILE.pt2")
    run.add_argument("--method", help="method to run (default: every method)")
    run.add_argument("--calls", type=int, default=100, help="timed calls per method (default 100)")
    run.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                     help="run methods on a GPU step by step, not replayed as CUDA graphs")
    run.add_argument("--public-key", action="append", metavar="PUB",
                     help="refuse the file unless a key in PUB (PEM) signed it; repeatable")
    run.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                     help="import MODULE first, to register the custom ops the file calls; repeatable")
    run.add_argument("--allow-op", dest="allow_ops", action="append", default=[], metavar="NS.OP",
                     help="let the run plan call custom op NS.OP, which no engine claimed; repeatable")
    run.set_defaults(command=run_command)

    inspect = commands.add_parser(
        "inspect", help="report a package: what each engine took, why ops were left, sizes, compile times"
    )
    inspect.add_argument("package", metavar="FILE.pt2", nargs="?")
    add_report_options(inspect)
    inspect.add_argument("--schema", action="store_true", help="print the JSON Schema of --json's output and exit")
    inspect.set_defaults(command=inspect_command)

    keygen = commands.add_parser("keygen", help="make an Ed25519 key pair for signing packages")
    keygen.add_argument("key", metavar="KEY", help="write the private key to KEY and the public key to KEY.pub")
    keygen.set_defaults(command=keygen_command)

    sign = commands.add_parser("sign", help="sign a package in place with a private key")
    sign.add_argument("package", metavar="FILE.pt2")
    sign.add_argument("--key", required=True, metavar="KEY", help="the private key (PEM) from aotstack keygen")
    sign.set_defaults(command=sign_command)

    verify = commands.add_parser("verify", help="check a package is intact and signed by a trusted key")
    verify.add_argument("package", metavar="FILE.pt2")
    verify.add_argument("--public-key", required=True, action="append", metavar="PUB",
                        help="a trusted public key (PEM); repeatable")
    verify.set_defaults(command=verify_command)
    return parser


def add_partitioner_options(parser: argparse.ArgumentParser) -> None:
    """The options that choose the partitioners: the same for compile and its dry run, explain."""
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="where AOTInductor's parts run: cpu (default), cuda[:N] or mps")
    parser.add_argument("--engines", default=None, metavar="auto|ENGINE,...",
                        help="auto: time each installed engine's plan and keep the fastest per method (compile's "
                             "default); or engines in the order they claim, e.g. ort,aoti or openvino,aoti")
    parser.add_argument("--exclude-op", action="append", default=[], metavar="OP",
                        help="leave OP (e.g. aten.gelu) out of AOTInductor's parts; repeatable")
    parser.add_argument("--ort", action="store_true",
                        help="let ONNX Runtime claim what it can first; AOTInductor takes the rest")
    parser.add_argument("--ort-op", action="append", default=[], metavar="OP",
                        help="like --ort, but ONNX Runtime claims only OP; repeatable")
    parser.add_argument("--min-block-size", type=int, default=None, metavar="N",
                        help="leave parts with fewer than N compute ops to the next engine (default 1; AOTInductor "
                             "on the CPU also leaves a lone op between other engines' parts to plain ATen)")


def add_quantize_options(parser: argparse.ArgumentParser) -> None:
    """Quantization before export, under ExecuTorch's names (``aotstack.quantize``)."""
    from .compile.quantize import EMBEDDING_SCHEMES, LINEAR_SCHEMES

    parser.add_argument("--qlinear", choices=list(LINEAR_SCHEMES), default=None,
                        help="quantize every nn.Linear: int8 (8w) or int4 (4w) weights, with activations "
                             "quantized to int8 as it runs (8da8w, 8da4w)")
    parser.add_argument("--qembedding", choices=list(EMBEDDING_SCHEMES), default=None,
                        help="quantize every nn.Embedding to int8 (8w) or int4 (4w) weights")
    parser.add_argument("--qgroup-size", type=int, default=32, metavar="N",
                        help="weights share a scale in groups of N inputs (default 32); 0: one per output channel")


def cli_quantization(args: argparse.Namespace) -> Quantization:
    from .compile.quantize import Quantization

    return Quantization(args.qlinear, args.qembedding, args.qgroup_size)


def add_tolerance_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--atol", type=float, default=None, metavar="A",
                        help="absolute tolerance of --check (default: aotstack.Check's, 1e-4)")
    parser.add_argument("--rtol", type=float, default=None, metavar="R",
                        help="relative tolerance of --check (default: aotstack.Check's, 1e-4)")


def add_compile_error_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--on-compile-error", choices=("raise", "fallback"), default="raise",
                        help="when an engine fails to compile a part: stop with an error (raise, the default), "
                             "or warn and leave the part to the next engine or plain ATen (fallback)")


def add_compile_run_options(parser: argparse.ArgumentParser) -> None:
    """How a long compile runs: parts at once, and how its progress shows."""
    parser.add_argument("-j", "--jobs", type=positive_int, default=None, metavar="N",
                        help="compile up to N parts at once, in worker processes (default: one per core)")
    parser.add_argument("--progress", choices=("auto", "live", "log"), default="auto",
                        help="a live table (live), log lines (log), or the table only in a terminal (auto)")


def add_report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (see --schema) instead")
    parser.add_argument("--graph", metavar="OUT.svg", help="also draw each method's graph into OUT.svg")


def keygen_command(args: argparse.Namespace) -> int:
    from .format.seal import new_key_pair

    public_path = args.key + ".pub"
    for path in (args.key, public_path):
        if os.path.exists(path):
            raise AotstackError(f"{path} exists; aotstack keygen does not overwrite a key")
    private_pem, public_pem = new_key_pair()
    # The private key is readable by its owner only, from the moment it exists.
    fd = os.open(args.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(private_pem)
    with open(public_path, "wb") as file:
        file.write(public_pem)
    print(f"wrote {args.key} (private: keep it secret) and {public_path} (public: give it to loaders)")
    return 0


def sign_command(args: argparse.Namespace) -> int:
    from .format.archive import sign

    key = sign(args.package, args.key)
    print(f"signed {args.package} with key {key}")
    return 0


def verify_command(args: argparse.Namespace) -> int:
    from .format.archive import verify

    key = verify(args.package, args.public_key)
    print(f"{args.package}: intact, signed by trusted key {key}")
    return 0


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected token ids like 2 or 2,32000, got {text!r}")
    return ids


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def demo_command(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.keep)


def compile_command(args: argparse.Namespace) -> int:
    import aotstack

    model, methods = model_from_target(args.target)
    started = time.perf_counter()
    program = aotstack.export(cli_quantization(args).apply(model), methods)
    check = None if args.check is None else cli_check(args)
    try:
        lowered = aotstack.lower(
            program, cli_partitioners(args, default="auto"), on_compile_error=args.on_compile_error, jobs=args.jobs,
            progress={"auto": None, "live": True, "log": False}[args.progress], check=check,
        )
    except CheckError as exc:
        print(exc.result.text(), file=sys.stderr)
        raise CheckError(f"{exc}\nnothing was written to {args.output}; compile without --check to write it anyway",
                         exc.result, exc.lowered) from None
    lowered.save(args.output)
    for name, placement in lowered.placements.items():
        if placement.selection is not None:
            print(f"{name}: kept {placement.selection.reason}")
    if lowered.check_result is not None:
        print(lowered.check_result.text())
    count = sum(len(lowered.delegates(name)) for name in lowered.methods)
    print(f"wrote {args.output}: {len(lowered.methods)} method(s), {count} delegate(s), "
          f"{os.path.getsize(args.output) / 1e6:.2f} MB, in {time.perf_counter() - started:.1f} s")
    return 0


def cli_check(args: argparse.Namespace) -> Check:
    from .compile.check import Check

    tolerance = {name: getattr(args, name) for name in ("atol", "rtol") if getattr(args, name) is not None}
    return Check(partition=args.check == "partition", **tolerance)


def explain_command(args: argparse.Namespace) -> int:
    import aotstack

    model, methods = model_from_target(args.target)
    program = aotstack.export(cli_quantization(args).apply(model), methods)
    report = aotstack.explain(program, cli_partitioners(args))
    show_report(report, args)
    return 0


def cli_partitioners(args: argparse.Namespace, default: str = "aoti") -> PartitionerPlan | Auto:
    """The engines ``--engines`` names, in order; without it, ``default`` unless an engine's own option is given.

    ``--ort``, ``--ort-op``, ``--exclude-op`` and ``--min-block-size`` keep their meaning: ONNX
    Runtime first when asked for, then AOTInductor for ``--device``.
    """
    from .compile.engines import partitioners_for

    engines = args.engines
    if engines is None:
        explicit = args.exclude_op or args.min_block_size is not None
        engines = "ort,aoti" if args.ort or args.ort_op else "aoti" if explicit else default
    return partitioners_for(engines, args.device, exclude_ops=args.exclude_op, ort_ops=args.ort_op,
                            min_block_size=args.min_block_size, option="--engines")


def model_from_target(target: str) -> tuple[torch.nn.Module, dict[str, tuple[Any, ...]]]:
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise AotstackError(f"expected MODULE:FUNCTION, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function: Callable[[], Any] = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise AotstackError(f"cannot find {target}: {exc}") from exc
    result = function()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise AotstackError(f"{target} must return (model, {{method: example args}}), got {type(result).__name__}")
    return result


def export_hf_command(args: argparse.Namespace) -> int:
    from .integrations.hf_folder import export_folder

    done = export_folder(
        args.model_dir, args.output, task=args.task, engines=args.engines, device=args.device,
        quantization=cli_quantization(args),
        max_cache_len=args.max_cache_len, progress={"auto": None, "live": True, "log": False}[args.progress],
        jobs=args.jobs, step=lambda text: print(f"aotstack: {text}", file=sys.stderr), check=args.check,
        check_tolerance=(args.atol, args.rtol), image_size=args.image_size, on_compile_error=args.on_compile_error,
    )
    seconds = done.seconds
    print(f"wrote {done.output} ({done.task}: {', '.join(done.methods)}; {done.bytes / 1e6:.2f} MB) in "
          f"{seconds['total']:.1f} s: loading {seconds['load']:.1f} s, torch.export {seconds['export']:.1f} s, "
          f"lowering {seconds['lower']:.1f} s, saving {seconds['save']:.1f} s")
    return 0


def generate_command(args: argparse.Namespace) -> int:
    from .integrations.hf_folder import generate_text, read_messages

    if args.prompt is None and args.messages is None and args.audio is None and args.image is None:
        raise AotstackError("generate needs --prompt TEXT, --messages FILE.json, --audio FILE.wav or --image FILE")
    if args.greedy and (args.temperature or args.top_k is not None or args.top_p is not None):
        raise AotstackError("--greedy picks the likeliest token; it takes no --temperature, --top-k or --top-p")

    def printed(piece: str) -> None:
        print(piece, end="", flush=True)

    result = generate_text(
        args.folder, args.prompt, args.max_new_tokens, chat=args.chat,
        messages=read_messages(args.messages) if args.messages else None, audio=args.audio, image=args.image,
        language=args.language, seed=args.seed,
        on_text=printed if args.stream else None, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, eos=args.eos, do_sample=False if args.greedy else None,
    )
    print(("" if args.stream else result.text), flush=True)
    source = f"from {args.audio}" if args.audio else f"after a {result.prompt_tokens}-token prompt"
    count = len(result.tokens)
    # A rate needs two tokens at least: the first one's time is the prompt's, given on its own. A frame-labelling
    # recogniser's transcript comes whole, from one call.
    timing = f"first token {result.first_token_seconds * 1e3:.1f} ms"
    if count > 1 and result.decode_seconds:
        timing += f", then {result.decode_tokens_per_second:.1f} tokens/s"
    elif count > 1:
        timing = f"all in {result.first_token_seconds * 1e3:.1f} ms"
    print(f"{count} token{'s' if count != 1 else ''} {source}; loaded in {result.load_seconds * 1e3:.0f} ms, "
          f"{timing}", file=sys.stderr)
    return 0


def speak_command(args: argparse.Namespace) -> int:
    from .integrations.audio import write_wav
    from .integrations.speech import speak

    speech = speak(args.folder, args.text)
    path = write_wav(args.out, speech.samples, speech.rate)
    print(f"wrote {path}: {speech.seconds:.2f} s of speech at {speech.rate} Hz; loaded in "
          f"{speech.load_seconds * 1e3:.0f} ms, spoken in {speech.speak_seconds * 1e3:.0f} ms "
          f"({speech.seconds / max(speech.speak_seconds, 1e-9):.1f}x real time)", file=sys.stderr)
    return 0


def run_command(args: argparse.Namespace) -> int:
    import aotstack

    from .format.archive import read_manifest

    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"--import {module}: {exc}") from None
    started = time.perf_counter()
    loaded = aotstack.load(
        args.package, public_key=args.public_key, allow_ops=args.allow_ops, cuda_graphs=args.cuda_graphs
    )
    manifest = read_manifest(args.package)
    print(f"loaded {args.package} in {(time.perf_counter() - started) * 1e3:.1f} ms")
    names = [args.method] if args.method else loaded.method_names
    for name in names:
        method = loaded.method(name)
        record = manifest.methods[name]
        inputs = [random_argument(argument) for argument in record.inputs]
        in_spec = torch.utils._pytree.treespec_loads(record.in_spec)
        positional, keywords = torch.utils._pytree.tree_unflatten(inputs, in_spec)
        with torch.no_grad():
            result = method(*positional, **keywords)
            times = []
            for _ in range(args.calls):
                started = time.perf_counter()
                method(*positional, **keywords)
                times.append(time.perf_counter() - started)
        print(f"{name}({', '.join(describe_tensor(t) for t in inputs)})")
        for path, value in torch.utils._pytree.tree_flatten_with_path(result)[0]:
            label = "".join(str(key) for key in path) or "output"
            print(f"  {label}: {describe_tensor(value)} {summary(value)}")
        print(f"  median {statistics.median(times) * 1e6:.1f} µs per call over {args.calls} calls")
        if any(delegate.target_device != "cpu" for delegate in record.delegates):
            print(f"  CUDA graph: {loaded.cuda_graphs.get(name, 'off (--no-cuda-graphs)')}")
    return 0


def random_argument(record: InputRecord) -> Any:
    """A random value the input ``record`` accepts; each symbolic size at its smallest."""
    from .format.manifest import Dim
    from .format.tensor_data import dtype_from_name

    if record.kind == "none":
        return None
    if record.kind != "tensor":
        return record.value if record.value is not None else record.dim.min if record.dim else 1
    dtype = dtype_from_name(record.dtype or "")
    shape = [d if isinstance(d, int) else max(1, d.min) if isinstance(d, Dim) else 1 for d in record.shape or []]
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(0, 10, shape, dtype=dtype)


def describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return repr(value)


def summary(value: Any) -> str:
    if not isinstance(value, torch.Tensor) or value.numel() == 0 or not value.dtype.is_floating_point:
        return ""
    return f"min {value.min().item():.4g} mean {value.mean().item():.4g} max {value.max().item():.4g}"


def inspect_command(args: argparse.Namespace) -> int:
    if args.schema:
        from .report.schema import REPORT_SCHEMA

        print(json.dumps(REPORT_SCHEMA, indent=2))
        return 0
    if args.package is None:
        raise AotstackError("inspect needs a package: aotstack inspect FILE.pt2 (or --schema)")
    from .report.model import file_report

    show_report(file_report(args.package), args)
    return 0


def show_report(report: Report, args: argparse.Namespace) -> None:
    """Print ``report`` as tables or JSON; draw its graph where ``--graph`` asks."""
    if args.graph:
        with open(args.graph, "w", encoding="utf-8") as file:
            file.write(report.svg())
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        report.print()
    if args.graph:
        print(f"drew {args.graph}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
