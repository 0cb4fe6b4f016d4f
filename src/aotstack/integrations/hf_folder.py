"""From a Hugging Face model folder to an export folder, and from that folder to generated text.

``export_folder`` is ``aotstack export-hf``: it checks the folder, infers the task from its config,
loads the model from safetensors only, exports it through the ``aotstack`` transformers backend and
writes ``model.pt2``, ``export.json``, the configs and the tokenizer or processor into a staging
folder beside the output, renamed into place only once everything is written.
``generate_text`` is ``aotstack generate``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..compile.progress import Progress
from ..compile.quantize import Quantization
from ..errors import AotstackError, GenerationError, ModelFolderError, UnsupportedModelError
from ..format.archive import first_line
from .audio import SETTINGS_FILES, head_architectures
from .tasks import GENERATION_TASKS, HEAD_TASKS, SPEECH_HEADS, TASK_ALIASES, TASKS

logger = logging.getLogger("aotstack")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROCESSOR_FILE = SETTINGS_FILES[0]
# Example sizes the non-generation exports trace with; batch and sequence stay dynamic for text.
EXAMPLE_BATCH, EXAMPLE_LENGTH = 2, 8
# Answers per question a multiple-choice head is traced with, and prompts per image and points per prompt a mask
# generator is: none of them 1, so torch keeps each dynamic.
EXAMPLE_CHOICES, EXAMPLE_PROMPTS, EXAMPLE_POINTS = 3, 3, 2
AUDIO_SECONDS = 1
# The side of the square images exported for a processor that keeps an image's size (Qwen2-VL's): 448 pixels
# make 256 image tokens at Qwen2-VL's patches of 14 merged 2x2, about what fixed-size vision-language models take.
GRID_IMAGE_SIDE = 448
# The largest height or width an export for images of their own size takes (``kept_size_multiple``).
MAX_IMAGE_SIDE = 4096


def auto_class(task: str) -> Any:
    """The ``transformers`` auto class that loads a model for ``task`` (``from_pretrained``, ``from_config``)."""
    import transformers

    if task in HEAD_TASKS:
        name, mapping = HEAD_TASKS[task]
        return getattr(transformers, name) if name is not None else MappedAutoClass(mapping)
    return getattr(transformers, {
        "ctc": "AutoModelForCTC",
        "rnnt": "AutoModelForRNNT",
        "tdt": "AutoModelForTDT",
        "image-text-to-text": "AutoModelForImageTextToText",
        "text-generation": "AutoModelForCausalLM",
        "text2text-generation": "AutoModelForSeq2SeqLM",
        "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
        "feature-extraction": "AutoModel",
    }[task])


@dataclass(frozen=True)
class MappedAutoClass:
    """An auto class transformers lacks (time series' heads): the class its ``mapping`` (``HEAD_TASKS``'s) names
    for a config's model type."""

    mapping: str | dict[str, str]

    def model_class(self, config: Any) -> type:
        import transformers

        names = mapped_names(self.mapping)
        if config.model_type not in names:
            raise ValueError(f"Unrecognized configuration class {type(config).__name__} for this head, which loads "
                             f"model types {', '.join(names)}")
        return getattr(transformers, names[config.model_type])

    def from_pretrained(self, folder: Any, *, config: Any, **options: Any) -> torch.nn.Module:
        return self.model_class(config).from_pretrained(folder, config=config, **options)

    def from_config(self, config: Any) -> torch.nn.Module:
        return self.model_class(config)(config)


def mapped_names(mapping: str | dict[str, str]) -> dict[str, Any]:
    """A ``HEAD_TASKS`` mapping of model types to head classes: itself, or the one ``modeling_auto`` names so."""
    from transformers.models.auto import modeling_auto

    return mapping if isinstance(mapping, dict) else getattr(modeling_auto, mapping)


def task_architectures() -> dict[str, set[str]]:
    """Per task, the architecture names (``config.architectures``) its auto class loads."""
    from transformers.models.auto import modeling_auto as auto

    def names(mapping: dict[str, Any]) -> set[str]:
        found: set[str] = set()
        for value in mapping.values():
            found.update([value] if isinstance(value, str) else value)
        return found

    return {
        "image-text-to-text": names(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
        "text-generation": names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "text2text-generation": names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        "automatic-speech-recognition": (names(auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
                                         | set().union(*map(head_architectures, SPEECH_HEADS))),
        **{task: names(mapped_names(mapping)) for task, (_, mapping) in HEAD_TASKS.items()},
        "feature-extraction": names(auto.MODEL_MAPPING_NAMES),
    }


def speech_head(task: str, config: Any) -> str:
    """What loads a model of ``config`` for ``task``: a speech recogniser's head on its encoder alone
    (``SPEECH_HEADS``), else ``task`` itself (:func:`auto_class`)."""
    architectures = set(getattr(config, "architectures", None) or [])
    if task == "automatic-speech-recognition":
        for head in SPEECH_HEADS:
            if architectures & head_architectures(head):
                return head
    return task


def is_ctc(task: str, config: Any) -> bool:
    """Whether ``task`` on a model of ``config`` is speech recognition by a frame-labelling (CTC) head."""
    return speech_head(task, config) == "ctc"


def infer_task(config: Any) -> str:
    """The task ``config.architectures`` names; a config naming none is a base model's, feature extraction.

    A head no task here covers (``BertForNextSentencePrediction``) is refused rather than exported without
    it: the outputs would not be the ones the checkpoint was trained to give.
    """
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    architectures = list(getattr(config, "architectures", None) or [])
    by_task = task_architectures()
    for architecture in architectures:
        for task in TASKS:
            if architecture in by_task[task]:
                return task
    if architectures:
        raise UnsupportedModelError(
            f"no task here exports the head of {', '.join(architectures)} (model type {config.model_type!r}); "
            f"pass --task feature-extraction for its base model's hidden states alone, or one of: {', '.join(TASKS)}"
        )
    if config.model_type in MODEL_MAPPING_NAMES:
        return "feature-extraction"
    raise UnsupportedModelError(
        f"cannot tell the task of model type {config.model_type!r} (its config names no architectures); "
        f"pass --task, one of: {', '.join(TASKS)}"
    )


def checked_task(task: str | None, config: Any) -> str:
    if task is None:
        return infer_task(config)
    task = TASK_ALIASES.get(task, task)
    if task not in TASKS:
        raise UnsupportedModelError(f"unknown task {task!r}; supported tasks: {', '.join(TASKS)}")
    return task


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of a model folder, refusing a folder that is missing it or asks to run its own code."""
    if not model_dir.is_dir():
        raise ModelFolderError(f"{model_dir} is not a folder; expected a model folder saved with save_pretrained")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelFolderError(f"{model_dir} has no config.json; a model folder holds config.json, "
                               f"the weights ({' or '.join(WEIGHT_FILES)}) and its tokenizer or processor files")
    raw = json_object(path)
    if "auto_map" in raw:
        raise ModelFolderError(
            f"{path} names code of its own (auto_map: {sorted(raw['auto_map'])}); aotstack runs no code from a "
            "model folder: export architectures transformers itself defines"
        )
    return raw


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a file that is not one is a ``ModelFolderError`` naming it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path} is not a JSON object: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{path} is not a JSON object")
    return raw


def check_weights(model_dir: Path) -> None:
    if any((model_dir / name).is_file() for name in WEIGHT_FILES):
        return
    pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (model_dir / name).exists()]
    why = (f" (it has {pickled[0]}, a pickle, which aotstack does not load: save the model again with "
           "save_pretrained, whose default is safetensors)") if pickled else ""
    raise ModelFolderError(f"{model_dir} has no weights: expected {' or '.join(WEIGHT_FILES)}{why}")


def require_any(model_dir: Path, names: tuple[str, ...], what: str, task: str) -> None:
    if not any((model_dir / name).is_file() for name in names):
        raise ModelFolderError(f"{model_dir} has no {what} ({' or '.join(names)}), which task {task} needs")


@dataclass
class FolderExport:
    """What ``export_folder`` did: the task, where it wrote, and how long each part took (seconds)."""

    task: str
    output: Path
    methods: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0


def export_folder(
    model_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    task: str | None = None,
    engines: str = "auto",
    device: str = "cpu",
    max_cache_len: int | None = None,
    quantization: Quantization | None = None,
    progress: bool | Progress | None = None,
    jobs: int | None = None,
    step: Callable[[str], None] | None = None,
    check: bool = False,
    check_tolerance: tuple[float | None, float | None] = (None, None),
    image_size: int | None = None,
    on_compile_error: str = "raise",
) -> FolderExport:
    """Export the model in ``model_dir`` for ``task`` (inferred when None) into the folder ``output``.

    ``quantization`` (``aotstack.Quantization``) quantizes the model before export.

    ``output`` must not exist, be empty, or hold an earlier aotstack export (replaced). ``step`` is
    told each stage as it begins. ``check`` runs each method of the lowered file against eager
    PyTorch on its example inputs and refuses the export (``LoweringError``) past the tolerance:
    ``aotstack.Check``'s, or ``check_tolerance`` (atol, rtol) where given. ``image_size`` is the side of
    the square images a vision-language model whose processor keeps an image's size (Qwen2-VL's, Mistral 3's)
    is exported for (default ``GRID_IMAGE_SIDE``); other processors make images of one size themselves.
    ``on_compile_error="fallback"`` leaves a part an engine fails to compile to the next engine or plain ATen, as
    ``aotstack.lower`` does.
    """
    lowering = {"check": check, "check_atol": check_tolerance[0], "check_rtol": check_tolerance[1],
                "on_compile_error": on_compile_error}
    started = time.perf_counter()
    say = step or (lambda text: logger.info("%s", text))
    model_dir, output = Path(model_dir), Path(output)
    check_output(output)
    raw = read_config_json(model_dir)
    check_weights(model_dir)

    from transformers import AutoConfig

    from .transformers import AotstackConfig, AotstackExporter

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(
            f"transformers cannot read {model_dir / 'config.json'} (model_type {raw.get('model_type')!r}): {exc}"
        ) from exc
    task = checked_task(task, config)
    say(f"task {task}; loading {model_dir}")
    model = load_model(model_dir, task, config)
    generation = task in GENERATION_TASKS and not is_ctc(task, config)
    if not generation:
        without_cache(model)
    preprocessor = load_preprocessor(model_dir, task, model)
    seconds = {"load": time.perf_counter() - started}

    exporter = AotstackExporter(progress=progress, jobs=jobs)
    quantization = quantization or Quantization()
    stored = stored_quantization(raw)
    say(f"exporting {type(model).__name__} with engines {engines}, quantization {quantization.describe()}"
        + (f" (its checkpoint is quantized already: {stored})" if stored else ""))
    # The model was loaded for this export alone: quantized in place, not copied.
    quantization.apply(model)
    try:
        if generation:
            exported = exporter.export_for_generation(
                model, generation_inputs(model, task, preprocessor, image_size, model_dir),
                AotstackConfig(engines=engines, device=device, max_cache_len=max_cache_len, **lowering),
            )
        else:
            inputs, dynamic_shapes = example_inputs(model, preprocessor, task)
            head = AotstackConfig(engines=engines, device=device, dynamic_shapes=dynamic_shapes, **lowering)
            try:
                exported = exporter.export(model, inputs, head)
            except AotstackError as exc:
                if exporter.lower_seconds or not specialises_batch(exc):
                    raise
                say(f"{type(model).__name__} cannot take a batch of any size (torch.export: {first_line(exc)}); "
                    "exporting it for one input at a time")
                inputs, dynamic_shapes = one_at_a_time(inputs, dynamic_shapes)
                exported = exporter.export(model, inputs, replace(head, dynamic_shapes=dynamic_shapes))
    except UnsupportedModelError:
        raise
    except AotstackError as exc:
        if exporter.lower_seconds:
            raise
        raise UnsupportedModelError(f"{type(model).__name__} ({task}) cannot be exported: {exc}") from exc
    seconds["export"], seconds["lower"] = exporter.export_seconds, exporter.lower_seconds
    if exporter.check_result is not None:
        say(exporter.check_result.text())

    saving = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        exported.save_pretrained(staging)
        preprocessor.save_pretrained(staging)
        size = sum(file.stat().st_size for file in staging.iterdir())
        install(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds["save"] = time.perf_counter() - saving
    seconds["total"] = time.perf_counter() - started
    runner_methods = exported.runners[next(iter(exported.components))].methods
    return FolderExport(task, output, runner_methods, seconds, size)


def generation_inputs(
    model: torch.nn.Module, task: str, preprocessor: Preprocessor, side: int | None = None,
    model_dir: Path | None = None,
) -> dict[str, torch.Tensor]:
    """The ``sample_inputs`` a generation export traces with: a prompt, and for a vision-language model one image
    at the size its processor makes, or, for a processor that keeps an image's size, a square of ``side``; for one
    that cuts an image into tiles as its size decides (LLaVA-NeXT's), the tiles of a square of ``side`` (default:
    one tile's side) and its ``image_sizes``. For an audio-text model or a speech transducer, a clip as the feature
    extractor in ``model_dir`` makes it."""
    from .audio_text import is_audio_text_lm
    from .generation import image_sizes_required
    from .transducer import is_transducer

    inputs = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    if (is_audio_text_lm(model) or is_transducer(model)) and model_dir is not None:
        from .audio import sample_clip

        return {**inputs, **sample_clip(model_dir)}
    if task == "image-text-to-text":
        vision = getattr(model.config, "vision_config", None) or model.config
        channels = getattr(vision, "num_channels", 3)
        settings = preprocessor.settings
        kept = kept_image_size(model, settings, side)
        if kept is None and image_sizes_required(model):
            return {**inputs, **image_tiles(model, side or vision.image_size, channels)}
        height, width = kept or grid_image_size(settings, side) or image_size(settings, vision)
        inputs["pixel_values"] = torch.zeros(1, channels, height, width)
    elif side is not None:
        raise ModelFolderError(f"--image-size is for an image-text-to-text export, not {task}")
    return inputs


def image_tiles(model: torch.nn.Module, side: int, channels: int) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_sizes`` as the processor of a model that cuts an image into tiles makes them for
    a square image of ``side``: the whole image and the tiles of the grid its ``image_grid_pinpoints`` choose, each
    the side of the vision tower's images. The count is the model's own (``image_size_to_num_patches`` in its
    module), so the sample agrees with how it splits pixel values."""
    count_tiles = getattr(sys.modules[type(model).__module__], "image_size_to_num_patches", None)
    pinpoints = getattr(model.config, "image_grid_pinpoints", None)
    if not callable(count_tiles) or not pinpoints:
        raise UnsupportedModelError(f"{type(model).__name__} cuts an image into tiles in a way the folder export "
                                    "cannot follow; export it with the Python API from its processor's pixel_values "
                                    "and image_sizes (AotstackExporter.export_for_generation)")
    tile = model.config.vision_config.image_size
    tiles = count_tiles(image_size=[side, side], grid_pinpoints=pinpoints, patch_size=tile)
    return {"pixel_values": torch.zeros(1, tiles, channels, tile, tile), "image_sizes": torch.tensor([[side, side]])}


def kept_image_size(model: torch.nn.Module, settings: dict[str, Any], side: int | None) -> tuple[int, int] | None:
    """The square images an export takes from a model whose processor keeps an image's size and whose vision tower
    reads it (Mistral 3's: ``image_sizes``): ``side`` (default ``GRID_IMAGE_SIDE``) rounded to whole image tokens
    (patches merged ``spatial_merge_size`` a side) and kept within the processor's longest edge. None for another."""
    from .generation import image_sizes_read_by_tower

    if not image_sizes_read_by_tower(model):
        return None
    unit = model.config.vision_config.patch_size * getattr(model.config, "spatial_merge_size", 1)
    bounds = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    longest = bounds.get("longest_edge") or math.inf
    square = max(unit, round((side or GRID_IMAGE_SIDE) / unit) * unit)
    while square > longest and square > unit:
        square -= unit
    return square, square


def grid_image_size(settings: dict[str, Any], side: int | None) -> tuple[int, int] | None:
    """The square images an export takes from a processor that cuts each image, at about its own size, into a
    grid of patches (Qwen2-VL's: ``patch_size``, ``merge_size``): ``side`` (default ``GRID_IMAGE_SIDE``) rounded
    to whole image tokens and kept within the processor's bounds on pixels. None for another processor, which
    makes images of one size itself (and refuses a ``side``: ``ModelFolderError``)."""
    patch, merge = settings.get("patch_size"), settings.get("merge_size")
    if not (isinstance(patch, int) and isinstance(merge, int) and "temporal_patch_size" in settings):
        if side is not None:
            raise ModelFolderError(f"--image-size is for a processor that keeps an image's size (Qwen2-VL's, "
                                   f"Mistral 3's); this one ({settings.get('image_processor_type', 'its processor')})"
                                   " makes images of one size itself")
        return None
    unit = patch * merge
    bounds = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    least = settings.get("min_pixels") or bounds.get("shortest_edge") or unit * unit
    most = settings.get("max_pixels") or bounds.get("longest_edge") or math.inf
    square = max(unit, round((side or GRID_IMAGE_SIDE) / unit) * unit)
    while square * square < least:
        square += unit
    while square * square > most and square > unit:
        square -= unit
    return square, square


def specialises_batch(error: BaseException) -> bool:
    """Whether ``error`` is torch.export's refusal of the batch as dynamic (SuperPoint's forward loops over its
    images: "Constraints violated (batch)!")."""
    return "Constraints violated (batch)" in str(error)


def one_at_a_time(
    inputs: dict[str, torch.Tensor], dynamic_shapes: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``inputs`` cut to their first row where their first axis is the batch, and that axis left static; other
    dynamic axes stay so."""
    def batched(name: str) -> bool:
        spec = dynamic_shapes.get(name)
        return isinstance(spec, dict) and getattr(spec.get(0), "__name__", None) == "batch"

    return ({name: value[:1] if batched(name) else value for name, value in inputs.items()},
            {name: {axis: dim for axis, dim in spec.items() if axis != 0} if batched(name) else spec
             for name, spec in dynamic_shapes.items()})


def check_output(output: Path) -> None:
    """Refuse an output that is a file, or a folder holding anything but an earlier aotstack export."""
    if not output.parent.is_dir():
        raise ModelFolderError(f"cannot write {output}: its parent folder {output.parent} does not exist")
    if output.exists() and not (output.is_dir() and (not any(output.iterdir()) or is_aotstack_export(output))):
        raise ModelFolderError(f"{output} exists and is not an aotstack export folder; choose another output")


def export_folder_path(folder: str | os.PathLike[str]) -> Path:
    """``folder`` as a path, refused by name (``ModelFolderError``) where it holds no aotstack export."""
    folder = Path(folder)
    if not is_aotstack_export(folder):
        raise ModelFolderError(f"{folder} holds no aotstack export (export.json); make one with aotstack export-hf")
    return folder


def is_aotstack_export(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / "export.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("export_format") == "aotstack"


def install(staging: Path, output: Path) -> None:
    """``staging`` becomes ``output``; an earlier export there is moved aside first and removed after."""
    check_output(output)
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
        os.replace(output, old / "export")
    os.replace(staging, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_model(model_dir: Path, task: str, config: Any) -> torch.nn.Module:
    """The model for ``task`` from safetensors, in eval mode; a mismatch of task and architecture is named."""
    cls = auto_class(speech_head(task, config))
    try:
        model = cls.from_pretrained(model_dir, config=config, local_files_only=True, use_safetensors=True)
    except ValueError as exc:
        architectures = getattr(config, "architectures", None)
        raise UnsupportedModelError(
            f"task {task} cannot load model type {config.model_type!r} (architectures {architectures}): "
            f"{str(exc).splitlines()[0]}; supported tasks: {', '.join(TASKS)}"
        ) from exc
    if task == "text-generation" and config.is_encoder_decoder:
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder; use --task text2text-generation")
    return model.eval()


def stored_quantization(raw_config: dict[str, Any]) -> str | None:
    """How the checkpoint's weights were quantized (``"torchao Int8WeightOnlyConfig"``), from its config.json;
    None for float weights. Only float layers are quantized again by ``--qlinear`` and ``--qembedding``."""
    stored = raw_config.get("quantization_config")
    if not isinstance(stored, dict):
        return None
    method = str(stored.get("quant_method", "unknown method"))
    kinds = stored.get("quant_type")
    if isinstance(kinds, dict):
        names = sorted({str(kind["_type"]) for kind in kinds.values() if isinstance(kind, dict) and "_type" in kind})
        return f"{method} {', '.join(names)}" if names else method
    return method


def without_cache(model: torch.nn.Module) -> None:
    """Turn off the key-value cache a decoder's forward returns by default (``config.use_cache``).

    One forward computes the features; no step follows to read a cache, so returning every layer's keys
    and values beside them would only cost each call the time and memory to make and hand them over.
    """
    configs = {id(config): config for config in (model.config, model.config.get_text_config())}
    for config in configs.values():
        if getattr(config, "use_cache", False):
            config.use_cache = False


# A vision-language model's chat template may live beside its processor rather than in its tokenizer's config.
PROCESSOR_FILES = (*SETTINGS_FILES, "chat_template.json", "chat_template.jinja")


@dataclass
class Preprocessor:
    """A tokenizer (text input), or an image or audio processor's files, kept verbatim beside the export.

    A processor is copied rather than built: building one can need packages (Pillow, torchvision)
    the export itself does not.
    """

    tokenizer: Any = None
    files: list[Path] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None  # where the processor's files are, for one that must be built (audio's)

    @property
    def model_input_names(self) -> list[str]:
        return list(getattr(self.tokenizer, "model_input_names", ()))

    def save_pretrained(self, folder: Path) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        for file in self.files:
            shutil.copyfile(file, folder / file.name)


def load_preprocessor(model_dir: Path, task: str, model: torch.nn.Module) -> Preprocessor:
    """The tokenizer (text input) or processor files (images, audio) the folder holds.

    Speech-to-text and image-text-to-text need both: the processor makes the input, the tokenizer reads the output.
    """
    from .audio_text import is_audio_text_lm

    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input == "past_values":  # a time series' model reads numbers as they are
        return Preprocessor()
    both = takes_text_and_images(model)
    if main_input == "input_ids" and not both and task != "image-text-to-text" and not is_audio_text_lm(model):
        return Preprocessor(tokenizer=load_tokenizer(model_dir, task))
    tokenizer = load_tokenizer(model_dir, task) if task in GENERATION_TASKS or both else None
    require_any(model_dir, SETTINGS_FILES, "processor", task)
    files = [model_dir / name for name in PROCESSOR_FILES if (model_dir / name).is_file()]
    return Preprocessor(tokenizer=tokenizer, files=files, settings=processor_settings(model_dir), folder=model_dir)


def processor_settings(model_dir: Path) -> dict[str, Any]:
    """The image or audio processor's settings: ``preprocessor_config.json``, or, where a processor saved by
    transformers 5 keeps them inside its own config, ``processor_config.json``'s image processor or feature
    extractor."""
    for name in SETTINGS_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        settings = json_object(path)
        if name == PROCESSOR_FILE:
            return settings
        for part in ("image_processor", "feature_extractor"):
            if isinstance(settings.get(part), dict):
                return settings[part]
    return {}


def load_tokenizer(model_dir: Path, task: str) -> Any:
    require_any(model_dir, TOKENIZER_FILES, "tokenizer", task)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelFolderError(f"cannot read the tokenizer of {model_dir}: {exc}") from exc


def takes_text_and_images(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` reads texts and images side by side (CLIP's, SigLIP's): a zero-shot classifier."""
    return {"input_ids", "pixel_values"} <= set(inspect.signature(model.forward).parameters)


def example_inputs(
    model: torch.nn.Module, preprocessor: Preprocessor, task: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inputs to trace ``model.forward`` with, and which of their sizes stay dynamic.

    A model of texts and images (CLIP's) takes a batch of each, their counts apart: each image is scored against
    each text. A zero-shot detector takes one image, and the texts naming what to find in it (:func:`queries`).
    """
    from torch.export import Dim

    config = model.config
    generator = torch.Generator().manual_seed(0)
    batch = Dim("batch", min=1, max=64)
    main_input = getattr(model, "main_input_name", "input_ids")
    if "spatial_shapes" in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(f"{type(model).__name__} reads each image as patches at about its own size "
                                    "(pixel_attention_mask, spatial_shapes), inputs the folder export does not make")
    if task == "mask-generation":
        return prompted_images(model, preprocessor, generator, batch)
    if takes_text_and_images(model):
        if task == "zero-shot-object-detection":
            return queries(model, preprocessor, generator)
        texts, text_shapes = example_texts(config.get_text_config(), preprocessor, generator, Dim("texts", max=64))
        images, image_shapes = example_images(image_config(config), preprocessor, generator, Dim("images", max=64))
        return {**texts, **images}, {**text_shapes, **image_shapes}
    if task == "text-to-speech":
        return example_speech_texts(model, preprocessor, generator, batch)
    if main_input == "input_ids":
        choices = Dim("choices", min=1, max=64) if task == "multiple-choice" else None
        return example_texts(config, preprocessor, generator, batch, choices)
    if main_input == "pixel_values":
        images, shapes = example_images(config, preprocessor, generator, batch)
        indices = dataset_indices(model, generator)
        return {**images, **indices}, {**shapes, **{name: {0: batch} for name in indices}}
    if main_input == "past_values":
        return example_series(config, generator, batch)
    if main_input == "input_values":
        rate = int(preprocessor.settings.get("sampling_rate", 16000))
        audio = torch.randn(EXAMPLE_BATCH, rate * AUDIO_SECONDS, generator=generator)
        # A hint rather than a named Dim: a convolution stack's strides leave guards on the length
        # (its frames' count divides its own multiples) that hold for every length but that torch cannot prove.
        return {"input_values": audio}, {"input_values": {0: batch, 1: Dim.DYNAMIC}}
    if main_input == "input_features":
        return example_clips(model, preprocessor, batch)
    raise UnsupportedModelError(f"{type(model).__name__} takes {main_input!r}, an input aotstack cannot make up")


def example_series(
    config: Any, generator: torch.Generator, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch of multivariate series, ``[batch, config.context_length, config.num_input_channels]`` (the window a
    PatchTST or PatchTSMixer reads); batch dynamic."""
    for name in ("context_length", "num_input_channels"):
        if not isinstance(getattr(config, name, None), int):
            raise UnsupportedModelError(f"{type(config).__name__} names no {name}, which sizes the series its model "
                                        "reads")
    series = torch.randn(EXAMPLE_BATCH, config.context_length, config.num_input_channels, generator=generator)
    return {"past_values": series}, {"past_values": {0: batch}}


def example_clips(
    model: torch.nn.Module, preprocessor: Preprocessor, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch of clips of quiet noise as the folder's feature extractor makes them, with the inputs beside the
    features it makes by default that the model reads (Parakeet's frames ``attention_mask``); batch dynamic, and the
    frames where the extractor's follow a clip's length (Parakeet's, wav2vec2-BERT's), not where it pads every clip
    to one window (Whisper's 30 s)."""
    from torch.export import Dim

    from .audio import feature_extractor

    if preprocessor.folder is None:
        raise ModelFolderError(f"{type(model).__name__} takes input_features: its folder needs the feature "
                               f"extractor's {' or '.join(SETTINGS_FILES)}")
    extractor = feature_extractor(preprocessor.folder)
    rate = int(extractor.sampling_rate)
    noise = np.random.default_rng(0)

    def made(seconds: int) -> dict[str, torch.Tensor]:
        clips = [noise.standard_normal(rate * seconds).astype(np.float32) * 0.01 for _ in range(EXAMPLE_BATCH)]
        return dict(extractor(clips, sampling_rate=rate, return_tensors="pt"))

    short, long = made(AUDIO_SECONDS), made(2 * AUDIO_SECONDS)
    read = set(inspect.signature(model.forward).parameters)
    inputs = {name: value for name, value in short.items() if name in read and isinstance(value, torch.Tensor)}
    # A hint rather than a named Dim, as for raw audio: the frames' guards hold for every clip but torch cannot
    # prove them.
    return inputs, {name: {0: batch, **{axis: Dim.DYNAMIC for axis in range(1, value.dim())
                                        if value.shape[axis] != long[name].shape[axis]}}
                    for name, value in inputs.items()}


def queries(
    model: torch.nn.Module, preprocessor: Preprocessor, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One image at the size the processor makes, and the texts naming what to find in it: any number of them where
    the model reads each apart (OWL-ViT's queries), else one, as its processor joins the names (Grounding DINO's
    "a cat. a remote."); their length dynamic, within what the model allows."""
    from torch.export import Dim

    config = model.config
    texts, _ = example_texts(config.get_text_config(), preprocessor, generator, None)
    image, _ = example_images(image_config(config), preprocessor, generator, None)
    inputs = {**texts, "pixel_values": image["pixel_values"][:1]}
    with torch.no_grad():
        try:
            model(**inputs)
            count: Any = Dim("texts", min=1, max=256)
        except (RuntimeError, ValueError, IndexError):  # one text per image: its batch
            inputs = {**{name: value[:1] for name, value in texts.items()}, "pixel_values": inputs["pixel_values"]}
            count = None
    return inputs, {**{name: {0: count, 1: Dim.DYNAMIC} for name in texts}, "pixel_values": None}


def prompted_images(
    model: torch.nn.Module, preprocessor: Preprocessor, generator: torch.Generator, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch of images at the size the processor makes, each with prompts of points in its pixels
    (``input_points`` ``[batch, prompts, points, 2]``) and their labels (1 picks, 0 leaves out, -1 pads), as SAM's
    processor makes them; batch and the counts of prompts and of points dynamic."""
    from torch.export import Dim

    images, _ = example_images(image_config(model.config), preprocessor, generator, batch)
    height, width = images["pixel_values"].shape[-2:]
    shape = (EXAMPLE_BATCH, EXAMPLE_PROMPTS, EXAMPLE_POINTS)
    points = torch.rand(*shape, 2, generator=generator) * torch.tensor([width, height])
    labels = torch.randint(0, 2, shape, generator=generator)
    sizes = {0: batch, 1: Dim("prompts", min=1, max=64), 2: Dim("points", min=1, max=64)}
    return ({**images, "input_points": points, "input_labels": labels},
            {"pixel_values": {0: batch}, "input_points": sizes, "input_labels": sizes})


def dataset_indices(model: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The dataset each image's keypoints are read for (``dataset_index``, which of its backbone's experts), where a
    model has several (ViTPose++'s, whose forward refuses to run without); else none."""
    experts = getattr(image_config(model.config), "num_experts", 1)
    if "dataset_index" not in inspect.signature(model.forward).parameters or not isinstance(experts, int) \
            or experts < 2:
        return {}
    return {"dataset_index": torch.randint(0, experts, (EXAMPLE_BATCH,), generator=generator)}


def image_config(config: Any) -> Any:
    """The part of a model of texts and images that reads the images: its vision tower's config (CLIP's), its
    backbone's (Grounding DINO's), else its own."""
    return getattr(config, "vision_config", None) or getattr(config, "backbone_config", None) or config


def example_texts(
    config: Any, preprocessor: Preprocessor, generator: torch.Generator, batch: Any, choices: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch of token ids of ``config``'s vocabulary, with the other inputs its tokenizer makes; batch and length
    dynamic. With ``choices`` (a multiple-choice head's), ``[batch, choices, length]``: each question paired with
    each of its answers, their count dynamic too."""
    from torch.export import Dim

    positions = getattr(config, "max_position_embeddings", None)
    # XLNet's config says -1: its relative positions take any length.
    length = Dim("sequence", min=2, max=positions if isinstance(positions, int) and positions >= 2 else 512)
    rows = (EXAMPLE_BATCH, EXAMPLE_CHOICES) if choices is not None else (EXAMPLE_BATCH,)
    ids = torch.randint(0, config.vocab_size, (*rows, EXAMPLE_LENGTH), generator=generator)
    inputs = {"input_ids": ids}
    for name in preprocessor.model_input_names:
        if name == "attention_mask":
            inputs[name] = torch.ones_like(ids)
        elif name == "token_type_ids":
            inputs[name] = torch.zeros_like(ids)
    sizes = (batch, choices, length) if choices is not None else (batch, length)
    return inputs, {name: dict(enumerate(sizes)) for name in inputs}


def example_speech_texts(
    model: torch.nn.Module, preprocessor: Preprocessor, generator: torch.Generator, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Token ids for a model that speaks them in one forward (VITS's), as :func:`example_texts` makes them, their
    length a hint rather than a named Dim: relative attention over windows (VITS's) leaves guards on the length that
    torch cannot make a range of, slice bounds that hold at every length and a padding branch taken past the window
    (``Max(0, s - 5) > 0``) that export drops where eager agrees past it. A model that generates its audio is
    refused."""
    from torch.export import Dim

    if model.can_generate() or getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise UnsupportedModelError(
            f"{type(model).__name__} generates its audio step by step; export-hf exports text-to-speech models that "
            "make the waveform from token ids in one forward (VITS, MMS-TTS)")
    inputs, shapes = example_texts(model.config, preprocessor, generator, batch)
    return inputs, {name: {0: batch, 1: Dim.DYNAMIC} for name in shapes}


def example_images(
    config: Any, preprocessor: Preprocessor, generator: torch.Generator, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch of images at the size the processor makes, or of videos of ``config.num_frames`` such images
    (``[batch, frames, channels, height, width]``, VideoMAE's); batch dynamic, and height and width where the
    processor keeps each image's own, rounded to a multiple (``kept_size_multiple``)."""
    from torch.export import Dim

    height, width = image_size(preprocessor.settings, config)
    multiple = kept_size_multiple(preprocessor.settings)
    sides: dict[int, Any] = {}
    if multiple is not None:
        height, width = (-(-side // multiple) * multiple for side in (height, width))
        sides = {-2: multiple * Dim("height_blocks", min=1, max=MAX_IMAGE_SIDE // multiple),
                 -1: multiple * Dim("width_blocks", min=1, max=MAX_IMAGE_SIDE // multiple)}
    # A model whose backbone reads the images keeps their channels there (ViTMatte's: RGB and the trimap).
    channels = getattr(config, "num_channels", None) or getattr(image_config(config), "num_channels", 3)
    frames = (config.num_frames,) if isinstance(getattr(config, "num_frames", None), int) else ()
    pixels = torch.randn(EXAMPLE_BATCH, *frames, channels, height, width, generator=generator)
    return {"pixel_values": pixels}, {"pixel_values": {0: batch, **{pixels.dim() + axis: dim
                                                                    for axis, dim in sides.items()}}}


def kept_size_multiple(settings: dict[str, Any]) -> int | None:
    """The multiple the processor rounds each image's own height and width to, where it makes no fixed size:
    ViTMatte's pads to 32, GLPN's resizes down to it, Swin2SR's pads to 8; None for a processor that resizes to one
    size."""
    multiple = settings["pad_size"] if divisor_spelt_pad_size(settings) else settings.get("size_divisor")
    fixed = any(settings.get(name) for name in ("size", "crop_size")) or padded_size(settings) is not None
    return multiple if isinstance(multiple, int) and multiple > 0 and not fixed else None


def divisor_spelt_pad_size(settings: dict[str, Any]) -> bool:
    """Whether the processor's ``pad_size`` is the multiple it pads each side to, as Swin2SR's saved by transformers
    4 spells its ``size_divisor`` (transformers 5 still reads it so), rather than a size it pads to (SAM's)."""
    return settings.get("image_processor_type", "").startswith("Swin2SRImageProcessor") \
        and isinstance(settings.get("pad_size"), int)


def padded_size(settings: dict[str, Any]) -> Any:
    """The size the processor pads every image to (SAM's, after resizing it), or None."""
    return settings.get("pad_size") if settings.get("do_pad") and not divisor_spelt_pad_size(settings) else None


def image_size(settings: dict[str, Any], config: Any) -> tuple[int, int]:
    """The height and width of the images the processor makes: the size it pads to, else its center crop, else the
    size it resizes to (a square of its shortest edge, for one that keeps the aspect ratio), else the config's
    ``image_size``, else 224.
    """
    crop = settings.get("crop_size") if settings.get("do_center_crop") else None
    for size in (padded_size(settings), crop, settings.get("size")):
        if isinstance(size, int):
            return size, size
        if isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
            return size["height"], size["width"]
        if isinstance(size, dict) and isinstance(size.get("shortest_edge"), int):
            return size["shortest_edge"], size["shortest_edge"]
    size = getattr(config, "image_size", 224)
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


@dataclass
class Generation:
    """What ``generate_text`` produced, and how fast."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    load_seconds: float
    first_token_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second of decoding (the prompt's prefill excluded)."""
        return (len(self.tokens) - 1) / self.decode_seconds if len(self.tokens) > 1 and self.decode_seconds else 0.0


# New tokens when neither the caller nor the model's generation config says how many.
DEFAULT_NEW_TOKENS = 32


def generate_text(
    folder: str | os.PathLike[str],
    prompt: str | None = None,
    max_new_tokens: int | None = None,
    *,
    chat: bool = False,
    messages: list[dict[str, Any]] | None = None,
    audio: str | os.PathLike[str] | None = None,
    image: str | os.PathLike[str] | None = None,
    language: str | None = None,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
    **settings: Any,
) -> Generation:
    """Text from an ``export_folder`` output of a generation task: a prompt continued, or a WAV file transcribed.

    Follows the export's generation config (greedy or sampled, its eos tokens), overridden by
    ``settings`` (``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``do_sample``,
    ``eos``); ``max_new_tokens`` defaults to the config's, else 32 (with audio, a transcript or an
    answer about it: until its end, as far as the cache holds). ``chat`` wraps ``prompt`` as a user
    message, ``messages`` is a whole conversation; either goes through the tokenizer's chat template. ``audio`` (an
    automatic-speech-recognition export) is a WAV file to transcribe, or, for an audio-text model
    (GLM-ASR's, Voxtral's), the clip the prompt is about (no prompt: the processor's own
    transcription request); ``language`` is the language spoken in ``audio``, for a recogniser:
    Whisper's language token (else its generation config's, or detected), or the language the
    processor saved with a recogniser builds its decoder prompt for (Cohere's, Canary's); ``image`` (an
    image-text-to-text export) a picture the prompt is about, read through the model's processor
    (which needs Pillow). ``on_text`` is told each piece of text as it is generated.
    """
    from transformers import AutoTokenizer
    from transformers.exporters import ExportedModel

    from .decoding import text_pieces
    from .transformers import generation_config_of, runner_of

    folder = export_folder_path(folder)
    require_any(folder, TOKENIZER_FILES, "tokenizer", "generate")
    if audio is not None and image is not None:
        raise GenerationError("give either an image or audio, not both")
    if language is not None and audio is None:
        raise GenerationError("a language is the one spoken in the audio: give it with audio (--audio FILE.wav)")
    started = time.perf_counter()
    exported = ExportedModel.from_pretrained(folder, local_files_only=True)
    runner = runner_of(exported)
    if is_ctc("automatic-speech-recognition", exported.config) or "joint" in runner.methods:
        if audio is None:
            raise GenerationError(f"{folder} transcribes speech: give it a WAV file (--audio FILE.wav)")
        if prompt is not None or messages is not None or chat or language is not None:
            raise GenerationError(f"{folder} transcribes audio alone: give no prompt, chat or language")
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if "joint" in runner.methods:
            return transducer_transcript(exported, tokenizer, folder, audio, max_new_tokens,
                                         time.perf_counter() - started, on_text)
        return transcript_of_frames(exported, tokenizer, folder, audio, time.perf_counter() - started, on_text)
    if "decode" not in runner.methods:
        raise UnsupportedModelError(f"{folder} holds methods {runner.methods}, not a text generation export")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    load_seconds = time.perf_counter() - started
    decoder_prompt = None
    media: dict[str, torch.Tensor] = {}
    if image is not None and "encode" in runner.methods and (folder / PROCESSOR_FILE).is_file():
        # An image encoder's decoder (TrOCR's) reads the picture; a prompt, if any, starts its text (Donut's task).
        if chat or messages is not None:
            raise GenerationError(f"{folder} reads text from an image: its prompt is the start of the text (--prompt),"
                                  " not a chat")
        source = picture_pixels(folder, image)
        decoder_prompt = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else None
        ids = []
    elif image is not None:
        if "prefill_images" not in runner.methods:
            raise GenerationError(f"{folder} takes no images (its methods: {runner.methods}); export an "
                                  "image-text-to-text model with aotstack export-hf")
        media = image_prompt(folder, image, prompt, chat, messages, runner.metadata.export_config)
        source = ids = media.pop("input_ids")[0].tolist()
    elif audio is not None and "prefill_audio" in runner.methods:
        if language is not None:
            raise GenerationError(f"{folder} hears audio with a prompt: say what to do with it in the prompt, not "
                                  "with a language")
        media = audio_prompt(folder, audio, prompt, chat, messages)
        source = ids = media.pop("input_ids")[0].tolist()
    elif audio is not None:
        from .audio import speech_source

        if prompt is not None or messages is not None or chat:
            raise GenerationError(f"{folder} makes a transcript from audio alone (its methods: {runner.methods}); "
                                  "give either audio or a prompt")
        # A processor of several parts (a feature extractor and a tokenizer) keeps its own settings file.
        processor = folder_processor(folder) if (folder / SETTINGS_FILES[1]).is_file() else None
        source, decoder_prompt = speech_source(folder, audio, runner.program, exported, language, processor)
        ids: list[int] = []
    else:
        if "encode" in runner.methods and (folder / PROCESSOR_FILE).is_file():
            raise GenerationError(f"{folder} transcribes speech: give it a WAV file (--audio FILE.wav)")
        source = ids = prompt_ids(tokenizer, folder, prompt, chat, messages)
    if max_new_tokens is None and getattr(exported.generation_config, "max_new_tokens", None) is None:
        # What is said in a clip is as long as it is: a transcript or an answer about audio runs to its end, as far as
        # the cache holds.
        cache = runner.metadata.export_config.get("max_cache_len")
        spent = len(decoder_prompt if decoder_prompt is not None else ids)
        max_new_tokens = max(cache - spent, 1) if audio is not None and cache else DEFAULT_NEW_TOKENS
    config = generation_config_of(exported, max_new_tokens=max_new_tokens, **settings)

    stamps: list[float] = []
    tokens: list[int] = []

    def arrived(stream: Any) -> Any:
        for token in stream:
            stamps.append(time.perf_counter())
            tokens.append(token)
            yield token

    began = time.perf_counter()
    pieces = text_pieces(arrived(runner.stream(source, config, decoder_prompt=decoder_prompt, seed=seed, **media)),
                         lambda seen: tokenizer.decode(seen, skip_special_tokens=True))
    text = ""
    for piece in pieces:
        text += piece
        if on_text is not None:
            on_text(piece)
    first = stamps[0] - began if stamps else 0.0
    return Generation(text, tokens, len(ids), load_seconds, first, stamps[-1] - stamps[0] if stamps else 0.0)


def opened_picture(image: str | os.PathLike[str], size: tuple[int, int] | None = None) -> Any:
    """``image`` read by Pillow as RGB, resized to ``size`` (height, width) where given."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise GenerationError("reading an image needs Pillow: pip install pillow (aotstack[vision])") from exc

    try:
        picture = Image.open(image).convert("RGB")
        return picture if size is None else picture.resize((size[1], size[0]), Image.Resampling.BICUBIC)
    except (OSError, ValueError) as exc:
        raise GenerationError(f"cannot read the image {image}: {exc}") from exc


def picture_pixels(folder: Path, image: str | os.PathLike[str]) -> torch.Tensor:
    """``pixel_values`` of ``image`` as the export's processor makes them, for an image encoder's source."""
    processor = folder_processor(folder, "AutoImageProcessor")
    return processor(images=opened_picture(image), return_tensors="pt")["pixel_values"]


def image_prompt(
    folder: Path,
    image: str | os.PathLike[str],
    prompt: str | None,
    chat: bool,
    messages: list[dict[str, Any]] | None,
    export_config: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``pixel_values`` (and ``token_type_ids``, ``image_grid_thw`` or ``image_sizes``, where the
    processor makes them) for a prompt about ``image``, from the export's processor: through its chat template with
    ``chat`` or ``messages`` (the image in the last user turn), else the plain prompt after the processor's image
    token.

    For an export whose processor keeps an image's size (Qwen2-VL's: ``export_config`` has its
    ``image_grid_thw``; Mistral 3's, and LLaVA-NeXT's whose tiles follow it: ``image_size_kept``), the image is first
    resized to the size the export takes."""
    resized = export_config and ("image_grid_thw" in export_config or export_config.get("image_size_kept"))
    picture = opened_picture(image, tuple(export_config["image_size"]) if resized else None)  # type: ignore[index]
    processor = folder_processor(folder)
    if messages is None and prompt is None:
        raise GenerationError("nothing to generate from: give a prompt or chat messages with the image")
    # Gemma 3's prompt names an image by its start token, which the processor expands; LLaVA's by its image token.
    marker = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None) or ""
    text = prompt_text(processor, folder, prompt, chat, messages, "image", marker)
    inputs = processor(images=picture, text=text, return_tensors="pt")
    return {name: value for name, value in inputs.items()
            if name in ("input_ids", "pixel_values", "token_type_ids", "image_grid_thw", "image_sizes")}


def audio_prompt(
    folder: Path,
    audio: str | os.PathLike[str],
    prompt: str | None,
    chat: bool,
    messages: list[dict[str, Any]] | None,
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``input_features`` (and ``input_features_mask``, where the processor makes it) for a prompt
    about a WAV file, from the export's processor: its transcription request where there is no prompt (GLM-ASR's,
    Voxtral's), through its chat template with ``chat`` or ``messages`` (the audio in the last user turn), else the
    plain prompt after the processor's audio token."""
    from .audio import read_wav, resampled

    processor = folder_processor(folder)
    extractor = getattr(processor, "feature_extractor", None)
    if extractor is None:
        raise ModelFolderError(f"the processor of {folder} ({type(processor).__name__}) has no feature extractor "
                               "to read audio with")
    rate = int(extractor.sampling_rate)
    samples = resampled(*read_wav(audio), rate)
    if prompt is None and messages is None:
        request = getattr(processor, "apply_transcription_request", None)
        if request is None or not getattr(processor, "chat_template", None):
            raise GenerationError(f"the processor of {folder} makes no transcription request of its own: give a "
                                  "prompt about the audio (--prompt)")
        inputs = request(samples)
    else:
        text = prompt_text(processor, folder, prompt, chat, messages, "audio", getattr(processor, "audio_token", ""))
        inputs = processor(text=text, audio=samples, sampling_rate=rate, return_tensors="pt")
    return {name: value for name, value in inputs.items()
            if name in ("input_ids", "input_features", "input_features_mask")}


def folder_processor(folder: Path, auto: str = "AutoProcessor") -> Any:
    """The processor saved in an export folder, built by transformers (``auto``: ``"AutoImageProcessor"`` for its
    image processor alone)."""
    import transformers

    try:
        return getattr(transformers, auto).from_pretrained(folder, local_files_only=True)
    except ImportError as exc:  # a library one of its parts needs: Qwen2-VL's video processor needs torchvision
        raise GenerationError(f"the processor of {folder} needs a library this environment lacks: "
                              f"{' '.join(str(exc).split())[:300]}") from exc
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ModelFolderError(f"cannot build the processor of {folder}: {exc}") from exc


def prompt_text(
    processor: Any,
    folder: Path,
    prompt: str | None,
    chat: bool,
    messages: list[dict[str, Any]] | None,
    kind: str,
    marker: str,
) -> str:
    """A prompt about one image or clip (``kind``) as the processor reads it: through its chat template with
    ``chat`` or ``messages`` (the image or clip first in the last user turn), else ``prompt`` after ``marker``, the
    token the processor expands into the image's or clip's tokens, unless the prompt holds it already."""
    if chat or messages is not None:
        turns = checked_messages([*(messages or []), *([{"role": "user", "content": prompt}] if prompt else [])])
        last = turns[-1]
        turns[-1] = {**last, "content": [{"type": kind}, {"type": "text", "text": last["content"]}]}
        if not getattr(processor, "chat_template", None):
            raise ModelFolderError(f"the processor in {folder} has no chat template; generate from a plain prompt")
        return str(processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
    text = prompt or ""
    return text if marker and marker in text else f"{marker}{text}"


def transcript_of_frames(
    exported: Any, tokenizer: Any, folder: Path, audio: str | os.PathLike[str], load_seconds: float,
    on_text: Callable[[str], None] | None,
) -> Generation:
    """The transcript a CTC speech recogniser gives a WAV file: each frame's likeliest label, repeats and
    blanks dropped by its tokenizer, over the frames holding audio (:func:`unpadded`). One forward over the whole
    file; its text arrives at once."""
    from .audio import audio_inputs, unpadded
    from .transformers import runner_of

    read = {record.name for record in runner_of(exported).program.method("forward").inputs}
    clip = {name: value for name, value in unpadded(audio_inputs(folder, audio)).items() if name in read}
    began = time.perf_counter()
    labels = exported(**clip).logits.argmax(dim=-1)[0].tolist()
    text = tokenizer.decode(labels)
    seconds = time.perf_counter() - began
    if on_text is not None:
        on_text(text)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    return Generation(text, list(tokens), 0, load_seconds, seconds, 0.0)


def transducer_transcript(
    exported: Any, tokenizer: Any, folder: Path, audio: str | os.PathLike[str], max_new_tokens: int | None,
    load_seconds: float, on_text: Callable[[str], None] | None,
) -> Generation:
    """The transcript a speech transducer (Parakeet's RNN-T or TDT) gives a WAV file, its text told as it comes."""
    from .audio import audio_inputs
    from .decoding import text_pieces
    from .transformers import stream

    clip = audio_inputs(folder, audio)
    stamps: list[float] = []
    tokens: list[int] = []

    def arrived(chosen: Iterator[int]) -> Iterator[int]:
        for token in chosen:
            stamps.append(time.perf_counter())
            tokens.append(token)
            yield token

    began = time.perf_counter()
    emitted = stream(exported, clip["input_features"], max_new_tokens, attention_mask=clip.get("attention_mask"))
    # Each token is its own: a tokenizer that merges repeats for CTC (Parakeet's) must not here.
    text = ""
    for piece in text_pieces(arrived(emitted), lambda seen: tokenizer.decode(seen, skip_special_tokens=True,
                                                                             group_tokens=False)):
        text += piece
        if on_text is not None:
            on_text(piece)
    first = (stamps[0] if stamps else time.perf_counter()) - began
    return Generation(text, tokens, 0, load_seconds, first, stamps[-1] - stamps[0] if stamps else 0.0)


def prompt_ids(
    tokenizer: Any, folder: Path, prompt: str | None, chat: bool, messages: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt's token ids: plain text, or a conversation through the tokenizer's chat template."""
    if messages is None and prompt is None:
        raise GenerationError("nothing to generate from: give a prompt or chat messages")
    if messages is None and not chat:
        return list(tokenizer(prompt)["input_ids"])
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        messages = [*messages, {"role": "user", "content": prompt}]
    if not getattr(tokenizer, "chat_template", None):
        raise ModelFolderError(f"the tokenizer in {folder} has no chat template (tokenizer_config.json's "
                               "chat_template, or chat_template.jinja); generate from a plain prompt instead")
    text = tokenizer.apply_chat_template(checked_messages(messages), add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens it wants (a BOS, turn markers).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def checked_messages(messages: Any, source: str = "messages") -> list[dict[str, Any]]:
    """``messages`` if it is a conversation: a non-empty list of objects with a ``role`` and a text ``content``."""
    if not isinstance(messages, list) or not messages:
        raise GenerationError(f"{source} must be a non-empty JSON list of {{\"role\": ..., \"content\": ...}} "
                              f"objects, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise GenerationError(f"{source}[{index}] must be an object with a string role and a string content, "
                                  f"got {message!r}")
    return messages


def read_messages(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A conversation from a JSON file: a list of ``{"role": ..., "content": ...}`` objects."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"cannot read messages from {path}: {exc}") from exc
    return checked_messages(raw, source=str(path))
