"""A prompt about an image: time to the first token and per decoded token, aotstack beside plain AOTInductor.

One Qwen2.5-VL-style model (random weights: a vision tower of windowed and full attention over
14-pixel patches merged 2x2, a decoder with multimodal rotary positions), exported once by
``export_image_text_lm`` as ``export-hf`` exports it: ``encode_images`` (one 224x224 image, 64
tokens), ``prefill_images`` (a prompt of 8 text tokens, the image's 64, 8 more) and ``decode``
(one token), over one static cache. Every variant runs that same program's methods:

- eager:        the export's module, its methods called directly (no_grad)
- plain AOTI:   ``aoti_compile_and_package`` of each method's exported program, ``aoti_load_package``
                (a package per method, each with its own weights and cache: a user of plain AOTI
                would hand the cache between them, which this leaves out)
- aotstack:     ``lower(program, ENGINES)`` for each ``--engines`` plan, saved, ``load``

Calls alternate between the variants in a shuffled order (``measure``). The first token's time is
``encode_images`` plus ``prefill_images``. Each variant's outputs are compared with eager's first.

    .venv/bin/python bench/vision_language.py [--engines aoti ov,aoti auto] [--threads 1] [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import aotstack
from aotstack.compile.auto import Auto
from aotstack.compile.engines import partitioners_for
from common import Figure, Figures, Settings, Variant, measure, print_table, progress, run_standalone

IMAGE_SIDE, CACHE = 224, 256
TEXT = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048}
VISION = {"depth": 4, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4, "out_hidden_size": 512,
          "patch_size": 14, "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [3]}
IMAGE_TOKEN = TEXT["vocab_size"] - 1
METHODS = ("encode_images", "prefill_images", "decode")


def qwen2_5_vl() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen2_5_vl")
    for name, value in TEXT.items():
        setattr(config.text_config, name, value)
    config.text_config.layer_types = config.text_config.layer_types[: TEXT["num_hidden_layers"]]
    head = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    # Qwen2.5-VL's split of a head's rotary halves over time, height and width, scaled to this head.
    config.text_config.rope_parameters = {**(config.text_config.rope_parameters or {}),
                                          "mrope_section": [head // 4, head // 8, head // 8]}
    for name, value in VISION.items():
        setattr(config.vision_config, name, value)
    config.image_token_id = IMAGE_TOKEN
    for name in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(config, name, IMAGE_TOKEN - 1)
    return transformers.AutoModelForImageTextToText.from_config(config).eval()


def method_inputs(module: Any) -> dict[str, tuple[torch.Tensor, ...]]:
    """One image's patches, a prompt holding its tokens between text, and one token to decode after it."""
    from aotstack.integrations.generation import example_image

    image, features = example_image(module, (IMAGE_SIDE, IMAGE_SIDE))
    prompt = torch.tensor([[1] * 8 + [IMAGE_TOKEN] * features.shape[0] + [2] * 8])
    return {
        "encode_images": (image,),
        "prefill_images": (prompt, features),
        "decode": (torch.tensor([[3]]), torch.tensor([prompt.shape[1]])),
    }


def calls_of(run: Callable[[str, tuple[torch.Tensor, ...]], Any], inputs: dict[str, tuple]) -> dict[str, Callable]:
    return {method: (lambda method=method: run(method, inputs[method])) for method in METHODS}


def first_output(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


def vision_language(settings: Settings, engines: list[str] | None = None) -> Figures:
    from aotstack.integrations.generation import ImagePrefillDecode, export_image_text_lm, typical_step_inputs

    plans = engines or ["aoti", "ov,aoti"]
    model = qwen2_5_vl()
    started = time.perf_counter()
    program = export_image_text_lm(model, CACHE, (IMAGE_SIDE, IMAGE_SIDE))
    progress(f"exported {list(program.methods)} in {time.perf_counter() - started:.1f} s")
    eager_module = ImagePrefillDecode(model, CACHE, (), (IMAGE_SIDE, IMAGE_SIDE)).eval()
    inputs = method_inputs(eager_module)

    def eager(method: str, args: tuple) -> Any:
        with torch.no_grad():
            return getattr(eager_module, method)(*args)

    runs: dict[str, Callable[[str, tuple], Any]] = {"eager": eager}
    packages = {}
    started = time.perf_counter()
    for method in METHODS:
        path = settings.path(f"plain-{method}.pt2")
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(program.methods[method], package_path=path)
        packages[method] = torch._inductor.aoti_load_package(path)
    progress(f"plain AOTI: three packages compiled in {time.perf_counter() - started:.1f} s")
    runs["plain AOTI"] = lambda method, args: packages[method](*args)
    for plan in plans:
        started = time.perf_counter()
        partitioners = partitioners_for(plan)
        if isinstance(partitioners, Auto):  # as export_for_generation times decode: at a step well into the cache
            partitioners = replace(partitioners, inputs=typical_step_inputs(program, CACHE))
        lowered = aotstack.lower(program, partitioners)
        path = settings.path(f"aotstack-{plan.replace(',', '-')}.pt2")
        lowered.save(path)
        loaded = aotstack.load(path)
        engines_used = sorted({d.backend_id for method in METHODS for d in lowered.delegates(method)})
        progress(f"aotstack {plan}: lowered in {time.perf_counter() - started:.1f} s ({', '.join(engines_used)})")
        runs[f"aotstack {plan}"] = lambda method, args, loaded=loaded: getattr(loaded, method)(*args)

    # Each variant's outputs against eager's, once, in the methods' order: decode reads the cache prefill_images
    # wrote, except in plain AOTI's packages, which each hold a cache of their own (its decode is not compared).
    want = {method: first_output(eager(method, inputs[method])) for method in METHODS}
    agrees = {}
    for name, run in runs.items():
        compared = METHODS[:2] if name == "plain AOTI" else METHODS
        agrees[name] = max(float((first_output(run(method, inputs[method])) - want[method]).abs().max())
                           for method in compared)

    calls, warmup = settings.pick((30, 5), (10, 3))
    variants = {(name, method): Variant(f"{name} {method}", call)
                for name, run in runs.items() for method, call in calls_of(run, inputs).items()}
    progress(f"timing {calls} rounds of {len(variants)} calls ...")
    measure(list(variants.values()), calls, warmup)
    ms = {key: variant.median_us / 1e3 for key, variant in variants.items()}

    def first_token(name: str) -> float:
        return ms[name, "encode_images"] + ms[name, "prefill_images"]

    rows = [[name, *(f"{ms[name, method]:.2f}" for method in METHODS), f"{first_token(name):.2f}",
             f"{first_token(name) / first_token('plain AOTI'):.3f}x",
             f"{ms[name, 'decode'] / ms['plain AOTI', 'decode']:.3f}x", f"{agrees[name]:.1e}"]
            for name in runs]
    print_table(["variant", *(f"{m} ms" for m in METHODS), "first token ms", "vs plain AOTI", "decode vs plain",
                 "max diff vs eager"], rows)
    figures: Figures = {}
    for plan in plans:
        name = f"aotstack {plan}"
        figures[f"{name} / plain AOTI, time to the first token"] = Figure(
            first_token(name), "ms", first_token("plain AOTI"), 1.0, note="encode_images + prefill_images")
        figures[f"{name} / plain AOTI, time per decoded token"] = Figure(
            ms[name, "decode"], "ms", ms["plain AOTI", "decode"], 1.0)
    return figures


def add_options(parser: Any) -> None:
    parser.add_argument("--engines", nargs="+", default=None, metavar="PLAN",
                        help="aotstack plans to time, each 'auto' or engines in claiming order (default: aoti ov,aoti)")


if __name__ == "__main__":
    run_standalone(__doc__.splitlines()[0], vision_language, extra=add_options)
