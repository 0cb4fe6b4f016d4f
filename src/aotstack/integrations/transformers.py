"""aotstack as a ``transformers.exporters`` backend: ``export_format="aotstack"``, registered on import.

Example::

    import aotstack.integrations.transformers  # registers the "aotstack" format
    from transformers.exporters import ExportedModel
    from transformers.exporters.auto import get_exporter_class

    exporter = get_exporter_class("aotstack")()
    exported = exporter.export(model, {"input_ids": ids}, AotstackConfig(engines="aoti"))
    exported.save_pretrained("out")                      # out/model.pt2, export.json, config.json
    outputs = ExportedModel.from_pretrained("out")(input_ids=ids)

``export`` lowers one graph (the model's ``forward``) into the component ``model``.
``export_for_generation`` lowers a decoder-only LM as ``prefill`` and ``decode``, or an
encoder-decoder LM as ``encode`` and ``decode``: methods of one ``.pt2``, still the one
component ``model``, sharing weights and a static KV cache (``aotstack.integrations.generation``);
``generate(exported, input_ids)`` and ``stream(...)`` run it, greedy or sampled as its generation config says.
A speech transducer (Parakeet's RNN-T and TDT) becomes ``encode``, ``predict`` and ``joint``
(``aotstack.integrations.transducer``); ``generate(exported, **feature_extractor(samples))`` transcribes a clip.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
from transformers.exporters.auto import register_backend
from transformers.exporters.base import ExportedComponent, ExportedModel, HfExporter
from transformers.exporters.configs import DynamoConfig
from transformers.exporters.metadata import ExportMetadata, build_export_metadata
from transformers.exporters.runners.base import ModelRunner

import aotstack

from ..compile.auto import Auto
from ..compile.check import Check
from ..compile.engines import partitioners_for
from ..compile.export import Program
from ..compile.guards import waive_guards_eager_agrees_past
from ..compile.lower import LoweredProgram, check_on_compile_error
from ..compile.measure import CallInputs
from ..compile.progress import Progress
from ..compile.quantize import Quantization
from ..errors import AotstackError, ExportError, GenerationError, UnsupportedModelError
from .audio_text import audio_token_id, export_audio_text_lm
from .decoding import (
    PromptAudio,
    PromptImages,
    collected,
    decoder_start_id,
    generation_settings,
    new_token_limit,
    stream_decoder,
    stream_encoder_decoder,
)
from .generation import (
    export_decoder_lm,
    export_image_text_lm,
    image_grid,
    image_prompt_inputs,
    image_token_id,
    reads_image_sizes,
    sample_image_size,
    typical_step_inputs,
)
from .seq2seq import export_encoder_decoder_lm
from .transducer import export_transducer, is_transducer, stream_transducer, transducer_settings

EXPORT_FORMAT = "aotstack"
# The one component every aotstack export holds: several methods live in its one file.
COMPONENT = "model"
DEFAULT_MAX_CACHE_LEN = 1024
# New tokens generate and stream choose when not told, as transformers' generate does (its max_length of 20).
UNASKED_NEW_TOKENS = 20


# What an encoder-decoder's ``encode`` reads, by the name its processor gives it.
ENCODER_SOURCES = ("input_features", "pixel_values")


class PromptInputs(TypedDict, total=False):
    """What a processor gives beside a prompt's ``input_ids`` and ``attention_mask``, passed on by name.

    A vision-language prompt's images: ``pixel_values``, with ``token_type_ids`` where the model reads them,
    ``image_grid_thw`` where its processor cuts images into patches and ``image_sizes`` where it keeps each image's
    size (both checked against the export's); ``mm_token_type_ids`` is taken and not needed, the prompt's image tokens
    saying the same. An audio-text prompt's audio: ``input_features``, and ``input_features_mask``.
    """

    pixel_values: torch.Tensor | None
    token_type_ids: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor | None
    image_sizes: torch.Tensor | None
    input_features: torch.Tensor | None
    input_features_mask: torch.Tensor | None


class GenerationInputs(PromptInputs, total=False):
    """A prompt's inputs and the settings :func:`~aotstack.integrations.decoding.generation_settings` takes."""

    do_sample: bool | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    eos: int | Sequence[int] | None


@dataclass
class AotstackConfig(DynamoConfig):
    """How aotstack exports: ``torch.export``'s options (``DynamoConfig``), then which engines and device.

    Args:
        engines: ``"auto"`` (default: every installed engine's plan is lowered and timed, the
            fastest kept per method, as ``aotstack.lower`` does) or engines in claiming order, as
            ``aotstack compile --engines`` takes them: ``"aoti"``, ``"ort,aoti"``, ``"ov,aoti"``.
        device: where AOTInductor's parts run: ``"cpu"`` (default), ``"cuda[:N]"`` or ``"mps"``.
        max_cache_len: generation exports only: the static KV cache's length, the longest prompt
            plus generated tokens (default: the model's ``max_position_embeddings``, at most 1024).
        qlinear, qembedding, qgroup_size: quantize a copy of the model before export, as
            ``aotstack.quantize(model, linear=qlinear, embedding=qembedding, group_size=qgroup_size)``
            does: ``"8w"``, ``"8da8w"``, ``"4w"``, ``"8da4w"`` for linears, ``"8w"``, ``"4w"`` for
            embeddings (default: None, float). transformers' ``quantizer`` is not taken.
        check: after lowering, run each method on its example inputs eagerly and from the saved
            file, and raise ``LoweringError`` where they are further apart than ``aotstack.Check``'s
            tolerance (``aotstack.lower(..., check=True)``), or ``check_atol`` and ``check_rtol``
            where given (a quantized model's engines round its activations each their own way).
        on_compile_error: ``"raise"`` (default) or ``"fallback"``: a part an engine fails to compile is left to
            the next engine or plain ATen, as ``aotstack.lower(..., on_compile_error=)`` does.
    """

    export_format: str = EXPORT_FORMAT

    engines: str = "auto"
    device: str = "cpu"
    max_cache_len: int | None = None
    qlinear: str | None = None
    qembedding: str | None = None
    qgroup_size: int = 32
    check: bool = False
    check_atol: float | None = None
    check_rtol: float | None = None
    on_compile_error: str = "raise"

    def __post_init__(self) -> None:
        # An unknown scheme, a bad group size or a bad compile-error choice fails here, before any export.
        Quantization(self.qlinear, self.qembedding, self.qgroup_size)
        check_on_compile_error(self.on_compile_error, "AotstackConfig.on_compile_error")

    @property
    def quantization(self) -> Quantization:
        return Quantization(self.qlinear, self.qembedding, self.qgroup_size)


class AotstackExporter(HfExporter):
    """Exports a ``PreTrainedModel`` with ``torch.export`` and lowers it with aotstack into one ``.pt2``.

    ``progress`` and ``jobs`` go to ``aotstack.lower``; ``lower_seconds`` is what the last export
    spent lowering.
    """

    export_format = EXPORT_FORMAT
    config_class = AotstackConfig
    program_suffix = ".pt2"
    required_packages = ["torch"]

    def __init__(self, progress: bool | Progress | None = None, jobs: int | None = None) -> None:
        super().__init__()
        self.progress = progress
        self.jobs = jobs
        self.lower_seconds = 0.0
        self.export_seconds = 0.0
        # What the last lowering's check measured (``AotstackConfig.check``); None where nothing was checked.
        self.check_result: Any = None

    def lower(
        self, program: Program, config: AotstackConfig, timing_inputs: Mapping[str, CallInputs] | None = None
    ) -> LoweredProgram:
        """``program`` lowered as ``config.engines`` says; where that is auto, each method named in
        ``timing_inputs`` is timed on those inputs (``Auto.inputs``) rather than its example's."""
        plan = partitioners_for(config.engines, config.device, option="AotstackConfig.engines")
        if isinstance(plan, Auto) and timing_inputs:
            plan = replace(plan, inputs=timing_inputs)
        started = time.perf_counter()
        try:
            lowered = aotstack.lower(program, plan, progress=self.progress, jobs=self.jobs, check=check_of(config),
                                     on_compile_error=config.on_compile_error)  # type: ignore[arg-type]
        finally:
            self.lower_seconds += time.perf_counter() - started
        self.check_result = lowered.check_result
        return lowered

    def export_program(
        self, model: Any, sample_inputs: MutableMapping[str, Any], config: AotstackConfig
    ) -> tuple[LoweredProgram, ExportMetadata]:
        """Trace ``model.forward`` as transformers' torch.export exporter does, then lower it."""
        from transformers.exporters.exporter_dynamo import DynamoExporter

        refuse_quantizer(config)
        model = quantized_copy(model, config.quantization)
        dynamo = DynamoConfig(dynamic=config.dynamic, strict=config.strict, dynamic_shapes=config.dynamic_shapes,
                              prefer_deferred_runtime_asserts_over_guards=config.prefer_deferred_runtime_asserts_over_guards)
        started = time.perf_counter()
        try:
            exported, metadata = DynamoExporter().export_program(model, sample_inputs, dynamo)
        except Exception as exc:
            raise ExportError(f"torch.export failed for {type(model).__name__}.forward: {exc}") from exc
        waive_guards_eager_agrees_past("forward", model, exported)
        self.export_seconds += time.perf_counter() - started
        metadata.packages["aotstack"] = aotstack.__version__
        return self.lower(Program({"forward": exported}), config), metadata

    def export_for_generation(
        self,
        model: Any,
        sample_inputs: MutableMapping[str, Any],
        config: AotstackConfig | dict[str, Any],
        *,
        generation_config: Any = None,
        multi_token_decode: bool = False,
    ) -> ExportedModel:
        """A decoder-only or encoder-decoder LM as one component whose file holds every generation stage.

        ``sample_inputs`` are ``generate`` kwargs; only their ``input_ids`` (batch 1) matter: the
        stages take any prompt up to the cache's length. ``multi_token_decode`` is not taken: ``prefill``
        already takes any number of tokens. A vision-language model given ``pixel_values`` (as its
        processor makes them) also gets ``encode_images`` and ``prefill_images``, for images of that
        size, and takes ``token_type_ids`` where its forward reads them (Gemma 3). An audio-text model given
        ``input_features`` (and ``input_features_mask``, as its processor makes them) gets ``encode_audio`` and
        ``prefill_audio`` (see ``aotstack.integrations.audio_text``).
        """
        if isinstance(config, dict):
            config = AotstackConfig(**config)
        if not isinstance(config, AotstackConfig):
            raise ExportError(f"expected an AotstackConfig, got {type(config).__name__}")
        if multi_token_decode:
            raise ExportError("aotstack's generation export has no multi_token_decode: its prefill method "
                              "takes any number of tokens from an empty cache")
        refuse_quantizer(config)
        model = quantized_copy(model, config.quantization)
        ids = sample_inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.shape[0] != 1:
            raise ExportError(f"a generation export runs batch 1; input_ids has batch {ids.shape[0]}")
        text_config = model.config.get_text_config()
        # Whisper names its decoder's positions max_target_positions.
        max_position = (getattr(text_config, "max_position_embeddings", None)
                        or getattr(text_config, "max_target_positions", None) or DEFAULT_MAX_CACHE_LEN)
        max_cache_len = config.max_cache_len or min(max_position, DEFAULT_MAX_CACHE_LEN)
        started = time.perf_counter()
        try:
            pixel_values = sample_inputs.get("pixel_values")
            if is_transducer(model):
                program = export_transducer(model, sample_inputs.get("input_features"))
            elif model.config.is_encoder_decoder:
                program = export_encoder_decoder_lm(model, max_cache_len, max_position, pixel_values)
            elif isinstance(sample_inputs.get("input_features"), torch.Tensor):
                program = export_audio_text_lm(model, max_cache_len, dict(sample_inputs))
            elif isinstance(pixel_values, torch.Tensor):
                image_size = sample_image_size(model, pixel_values, sample_inputs.get("image_grid_thw"),
                                               sample_inputs.get("image_sizes"))
                program = export_image_text_lm(model, max_cache_len, image_size, image_prompt_inputs(model),
                                               tuple(pixel_values.shape))
            else:
                program = export_decoder_lm(model, max_cache_len)
        except ExportError as exc:
            raise UnsupportedModelError(
                f"{type(model).__name__} cannot be exported for generation with a static cache: {exc}"
            ) from exc
        self.export_seconds += time.perf_counter() - started
        lowered = self.lower(program, config, typical_step_inputs(program, max_cache_len))
        first = next(iter(program.methods))
        example = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
        metadata = build_export_metadata(model, example, program.methods[first], self.required_packages)
        metadata.packages["aotstack"] = aotstack.__version__
        metadata.export_config = {**json.loads(config.to_json_string()), "max_cache_len": max_cache_len}
        if "prefill_audio" in program.methods:
            metadata.export_config["audio_token_id"] = audio_token_id(model)
        if "joint" in program.methods:
            metadata.export_config["transducer"] = transducer_settings(model)
        if "prefill_images" in program.methods:
            metadata.export_config["image_token_id"] = image_token_id(model)
            metadata.export_config["image_size"] = list(image_size)
            grid = image_grid(model, image_size)
            if grid is not None:
                metadata.export_config["image_grid_thw"] = list(grid.patches)
            elif reads_image_sizes(model):
                # Its processor keeps each image's size: an image is resized to the export's before it.
                metadata.export_config["image_size_kept"] = True
        return ExportedModel(
            {COMPONENT: ExportedComponent(lowered, metadata)},
            self.export_format,
            config=getattr(model, "config", None),
            generation_config=generation_config if generation_config is not None else model.generation_config,
        )

    @classmethod
    def save_program(cls, program: LoweredProgram | aotstack.LoadedProgram, path: str | Path) -> None:
        if isinstance(program, LoweredProgram):
            program.save(str(path))
        else:  # loaded from a file: that file is the program
            shutil.copyfile(program.path, path)

    @classmethod
    def load_program(cls, path: str | Path) -> aotstack.LoadedProgram:
        return aotstack.load(path, cuda_graphs=RUNNER_CUDA_GRAPHS)


def check_of(config: AotstackConfig) -> Check | bool:
    """What ``aotstack.lower(..., check=)`` takes for ``config``: False, or a ``Check`` at its tolerances."""
    if not config.check:
        return False
    return Check(atol=config.check_atol, rtol=config.check_rtol)


def refuse_quantizer(config: AotstackConfig) -> None:
    if config.quantizer is not None:
        raise ExportError(
            "AotstackConfig takes no transformers quantizer; quantize with qlinear= and qembedding= instead "
            "(torchao's configs under ExecuTorch's names: 8w, 8da8w, 4w, 8da4w)"
        )


def quantized_copy(model: Any, quantization: Quantization) -> Any:
    """``model`` itself when nothing is quantized; else a quantized copy, so the caller's model stays float."""
    return quantization.apply(copy.deepcopy(model)) if quantization else model


# A runner calls its methods over and over with the same shapes (a decode step above all), so each
# method that runs wholly on one GPU with static shapes is replayed as a CUDA graph; the others
# (a prefill's prompt length changes) and every method of a host file run as without.
RUNNER_CUDA_GRAPHS = True


class AotstackModelRunner(ModelRunner):
    """Runs a loaded aotstack file: ``forward`` for an ``export``, ``generate`` for an ``export_for_generation``."""

    def __init__(self, program: aotstack.LoadedProgram, metadata: ExportMetadata, keep: Any = None) -> None:
        super().__init__(metadata)
        self.program = program
        self._keep = keep  # the temporary directory of a program saved only to be loaded

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # inputs and outputs are host tensors; delegates copy where they run

    @property
    def methods(self) -> list[str]:
        return self.program.method_names

    @classmethod
    def from_program(
        cls, program: LoweredProgram | aotstack.LoadedProgram, metadata: ExportMetadata, device: Any = None
    ) -> AotstackModelRunner:
        if device is not None and torch.device(device).type != "cpu":
            raise AotstackError(
                f"an aotstack file runs where it was compiled for (inputs on the host); got device {device}: "
                "export with AotstackConfig(device=...) instead"
            )
        keep = None
        if isinstance(program, LoweredProgram):
            keep = tempfile.TemporaryDirectory(prefix="aotstack-hf-")
            path = os.path.join(keep.name, f"{COMPONENT}.pt2")
            program.save(path)
            program = aotstack.load(path, cuda_graphs=RUNNER_CUDA_GRAPHS)
        return cls(program, metadata, keep)

    def __call__(self, share_inputs: bool = True, share_outputs: bool = False, **kwargs: Any) -> Any:
        if "forward" not in self.methods:
            raise AotstackError(
                f"this export holds the generation stages {self.methods}, not a forward: run it with "
                "aotstack.integrations.transformers.generate(exported, input_ids), or call runner.program.<method>"
            )
        with torch.no_grad():
            return self.program.forward(**{**self.metadata.in_constants, **kwargs})

    def stream(
        self,
        source: torch.Tensor | Sequence[int] | None,
        config: Any,
        *,
        decoder_prompt: Sequence[int] | None = None,
        seed: int | None = None,
        attention_mask: torch.Tensor | None = None,
        **inputs: Unpack[PromptInputs],
    ) -> Iterator[int]:
        """The new tokens of one prompt, each as it is chosen, under ``config`` (a ``GenerationConfig``).

        ``source`` is a decoder-only model's prompt, or what an encoder-decoder's ``encode`` takes
        (token ids, audio features or an image's pixels; None takes them from ``inputs`` by name, as
        ``model.generate(**processor(audio))`` does); ``decoder_prompt`` is the decoder's first tokens (default:
        the config's decoder start token). ``inputs`` are a vision-language prompt's images or an
        audio-text prompt's audio, as its processor made them with the prompt (:class:`PromptInputs`).
        A speech transducer's ``source`` is a clip's ``input_features``, ``attention_mask`` its frames' mask as the
        feature extractor gives it; it emits its transcript's tokens, greedily (``config.max_new_tokens`` bounds
        its choices, blanks included, as in transformers). See ``aotstack.integrations.decoding``.
        """
        if source is None:
            source, inputs = self.encoder_source(inputs)
        if "joint" in self.methods:
            return self.transcript(source, attention_mask, config, inputs)
        if attention_mask is not None:
            raise GenerationError("stream takes an attention_mask for a speech transducer's frames only; a "
                                  "prompt's mask goes to generate")
        limit = self.metadata.export_config.get("max_cache_len")
        if "prefill" in self.methods or "decode" in self.methods and "encode" not in self.methods:
            prompt = token_list(source)
            needed = len(prompt) + new_token_limit(config, len(prompt))
            if limit is not None and needed > limit:
                raise GenerationError(
                    f"a prompt of {len(prompt)} tokens plus {needed - len(prompt)} new ones needs {needed} cache "
                    f"slots; this export has {limit} (export again with a larger max_cache_len)"
                )
            return stream_decoder(self.program, prompt, config, seed, self.prompt_media(inputs))
        if "encode" in self.methods:
            if decoder_prompt is None:
                start = decoder_start_id(config)
                if start is None:
                    raise GenerationError("an encoder-decoder export needs a decoder start token to generate: "
                                          "set decoder_start_token_id or bos_token_id in its generation config, or "
                                          "pass decoder_prompt")
                decoder_prompt = [start]
            needed = len(decoder_prompt) + new_token_limit(config, len(decoder_prompt))
            if limit is not None and needed > limit:
                raise GenerationError(f"{needed} decoder tokens need as many cache slots; this export has {limit}")
            given = sorted(name for name, value in inputs.items() if value is not None)
            if given:
                raise GenerationError(f"an encoder-decoder export takes its source alone (input_ids, or audio features "
                                      f"or pixels in their place), not {', '.join(given)} beside it")
            if not (isinstance(source, torch.Tensor) and source.is_floating_point()):
                source = torch.tensor([token_list(source)], dtype=torch.long)
            return stream_encoder_decoder(self.program, source, decoder_prompt, config, seed)
        raise GenerationError(f"this export has no generation stages, only {self.methods}")

    def transcript(
        self, features: Any, attention_mask: torch.Tensor | None, config: Any, inputs: PromptInputs
    ) -> Iterator[int]:
        """A speech transducer's tokens for one clip (see :meth:`stream`)."""
        given = sorted(name for name, value in inputs.items() if value is not None)
        if given or not (isinstance(features, torch.Tensor) and features.is_floating_point()):
            raise GenerationError("a speech transducer export takes one clip's input_features (and its "
                                  f"attention_mask), not {', '.join(given) or 'token ids'}")
        settings = self.metadata.export_config["transducer"]
        return stream_transducer(self.program, features, attention_mask, settings, config.max_new_tokens)

    def encoder_source(self, inputs: PromptInputs) -> tuple[torch.Tensor, PromptInputs]:
        """An encoder-decoder's source given by name, as transformers' ``generate`` takes it (a speech recogniser's
        ``input_features``, an image encoder's ``pixel_values``), and the other inputs."""
        given = [name for name in ENCODER_SOURCES if inputs.get(name) is not None]
        if "encode" not in self.methods or len(given) != 1:
            raise GenerationError("generation needs input_ids: a prompt's token ids, or an encoder-decoder's source "
                                  f"(as input_ids, or by name: one of {', '.join(ENCODER_SOURCES)})")
        return inputs[given[0]], PromptInputs(**{name: value for name, value in inputs.items() if name != given[0]})

    def prompt_media(self, inputs: PromptInputs) -> PromptImages | PromptAudio | None:
        """A prompt's images or audio for ``stream_decoder``; None for a prompt of text alone."""
        unknown = sorted(set(inputs) - set(PromptInputs.__annotations__))
        if unknown:
            raise GenerationError(f"unknown input(s) {', '.join(unknown)}: a prompt takes "
                                  f"{', '.join(PromptInputs.__annotations__)} beside its input_ids")
        images = self.prompt_images(inputs.get("pixel_values"), inputs.get("token_type_ids"),
                                    inputs.get("image_grid_thw"), inputs.get("image_sizes"))
        audio = self.prompt_audio(inputs.get("input_features"), inputs.get("input_features_mask"))
        if images is not None and audio is not None:
            raise GenerationError("aotstack exports a prompt with images or with audio, not both in one prompt")
        return images or audio

    def prompt_images(
        self,
        pixel_values: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
    ) -> PromptImages | None:
        """A prompt's images for ``stream_decoder``; None for a prompt of text alone."""
        if pixel_values is None:
            if token_type_ids is not None or image_grid_thw is not None or image_sizes is not None:
                raise GenerationError("token_type_ids, image_grid_thw or image_sizes were given without the images "
                                      "(pixel_values) they describe")
            return None
        image_token = self.metadata.export_config.get("image_token_id")
        if image_token is None:
            raise GenerationError(f"this export takes no images: it holds the generation stages {self.methods}")
        refuse_other_grids(image_grid_thw, self.metadata.export_config)
        refuse_other_sizes(image_sizes, self.metadata.export_config)
        return PromptImages(pixel_values, int(image_token), () if token_type_ids is None else (token_type_ids,))

    def prompt_audio(
        self, input_features: torch.Tensor | None, input_features_mask: torch.Tensor | None
    ) -> PromptAudio | None:
        """A prompt's audio for ``stream_decoder``; None for a prompt without."""
        if input_features is None:
            if input_features_mask is not None:
                raise GenerationError("input_features_mask was given without the audio (input_features) it describes")
            return None
        audio_token = self.metadata.export_config.get("audio_token_id")
        if audio_token is None:
            raise GenerationError(f"this export takes no audio in its prompt: it holds the generation stages "
                                  f"{self.methods}")
        return PromptAudio(input_features, int(audio_token), input_features_mask)

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None,
        config: Any,
        *,
        attention_mask: torch.Tensor | None = None,
        decoder_prompt: Sequence[int] | None = None,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        **inputs: Unpack[PromptInputs],
    ) -> list[int] | list[list[int]]:
        """The new tokens of one prompt (a list), or of each row of a batch (a list per row).

        One row is one prompt, with or without its ``attention_mask`` (a processor's output, passed
        whole). A batch is ``input_ids`` of several rows, left-padded where ``attention_mask`` is 0, as a
        tokenizer with ``padding_side="left"`` gives it; each row stops at its own eos and gets its
        own tokens, without padding. The file runs batch 1, so rows run one after another; with a
        ``seed``, row ``i`` samples from ``seed + i``. ``inputs``: one prompt's images or audio, as
        :meth:`stream` takes them, and ``input_ids`` too where it takes None.
        """
        if input_ids is None:
            input_ids, inputs = self.encoder_source(inputs)
        if "joint" in self.methods:
            return collected(self.stream(input_ids, config, attention_mask=attention_mask, **inputs), on_token)
        rows = prompt_rows(input_ids, attention_mask)
        if rows is None or len(rows) == 1:
            # One prompt, its mask as its processor gives it (all ones, or left padding to drop).
            tokens = self.stream(input_ids if rows is None else rows[0], config, decoder_prompt=decoder_prompt,
                                 seed=seed, **inputs)
            return collected(tokens, on_token)
        if any(value is not None for value in inputs.values()):
            raise GenerationError(f"images and audio are taken with one prompt at a time; input_ids has {len(rows)} "
                                  "rows")
        return [collected(self.stream(row, config, decoder_prompt=decoder_prompt,
                                      seed=None if seed is None else seed + index), on_token)
                for index, row in enumerate(rows)]


def refuse_other_grids(image_grid_thw: torch.Tensor | None, export_config: dict[str, Any]) -> None:
    """Refuse images that the processor cut into another grid of patches than the one the export was made for."""
    if image_grid_thw is None:
        return
    wanted = export_config.get("image_grid_thw")
    if wanted is None:
        raise GenerationError("image_grid_thw was given, but this export takes whole images, not a grid of patches")
    grids = [list(map(int, row)) for row in image_grid_thw.reshape(-1, 3).tolist()]
    if any(grid != wanted for grid in grids):
        height, width = export_config.get("image_size", ["?", "?"])
        raise GenerationError(
            f"the processor cut the images into grids of patches {grids}; this export takes images of {height}x"
            f"{width} pixels only (grid {wanted}): resize each image to {width}x{height} before the processor"
        )


def refuse_other_sizes(image_sizes: torch.Tensor | None, export_config: dict[str, Any]) -> None:
    """Refuse images whose sizes, as the processor gives them (``image_sizes``: height and width of each), are not
    the size the export was made for: its features are split by that size."""
    if image_sizes is None:
        return
    wanted = export_config.get("image_size")
    sizes = [list(map(int, row)) for row in torch.as_tensor(image_sizes).reshape(-1, 2).tolist()]
    if wanted is None or any(size != list(wanted) for size in sizes):
        height, width = wanted or ("?", "?")
        raise GenerationError(f"the images are of sizes {sizes} (image_sizes); this export takes images of "
                              f"{height}x{width} pixels only: resize each image to {width}x{height} before the "
                              "processor")


def token_list(ids: torch.Tensor | Sequence[int]) -> list[int]:
    """One prompt's token ids from a list, a 1-D tensor or a ``[1, length]`` tensor."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point():
            raise GenerationError(f"expected a prompt's token ids; got {ids.dtype} values of shape {tuple(ids.shape)}")
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise GenerationError(f"expected one prompt; input_ids has batch {ids.shape[0]}")
        return [int(token) for token in ids.flatten().tolist()]
    return [int(token) for token in ids]


def prompt_rows(
    input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], attention_mask: torch.Tensor | None
) -> list[list[int]] | None:
    """Each row's prompt without its left padding, for a batch (several rows, or a mask); None for one prompt."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point():  # audio features: one source
            return None
        rows = (input_ids if input_ids.dim() == 2 else input_ids[None]).tolist()
    elif len(input_ids) and not isinstance(input_ids[0], int):
        rows = [list(row) for row in input_ids]  # type: ignore[arg-type]
    else:
        rows = [list(input_ids)]
    if attention_mask is None:
        return rows if len(rows) > 1 else None
    mask = (attention_mask if attention_mask.dim() == 2 else attention_mask[None]).tolist()
    if [len(keeps) for keeps in mask] != [len(row) for row in rows]:
        raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids has "
                              f"{len(rows)} rows of {len(rows[0])} tokens")
    kept = []
    for index, (row, keeps) in enumerate(zip(rows, mask)):
        first = keeps.index(1) if 1 in keeps else len(keeps)
        if first == len(keeps) or not all(keeps[first:]):
            raise GenerationError(f"row {index} of attention_mask is not left padding (zeros, then ones): {keeps}")
        kept.append([int(token) for token in row[first:]])
    return kept


def prompt_inputs_and_settings(inputs: GenerationInputs) -> tuple[PromptInputs, dict[str, Any]]:
    """``inputs`` parted into the prompt's (:class:`PromptInputs`) and the rest, the settings."""
    prompt = {name: value for name, value in inputs.items() if name in PromptInputs.__annotations__}
    return PromptInputs(**prompt), {name: value for name, value in inputs.items() if name not in prompt}


def generation_config_of(exported: ExportedModel, base: Any = None, **settings: Any) -> Any:
    """The export's generation config (or ``base``) with ``settings`` applied; eos and start ids filled from its config.

    ``settings`` are :func:`~aotstack.integrations.decoding.generation_settings`'s: ``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos``.
    """
    accepted = [name for name in inspect.signature(generation_settings).parameters if name != "base"]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise GenerationError(f"unknown argument(s) {', '.join(unknown)}: generation takes a prompt's input_ids, "
                              f"attention_mask, {', '.join(PromptInputs.__annotations__)}, and the settings "
                              f"{', '.join(accepted)}")
    config = generation_settings(base if base is not None else exported.generation_config, **settings)
    for name in ("eos_token_id", "decoder_start_token_id", "pad_token_id", "bos_token_id"):
        if getattr(config, name, None) is None and getattr(exported.config, name, None) is not None:
            setattr(config, name, getattr(exported.config, name))
    return config


def runner_of(exported: ExportedModel) -> AotstackModelRunner:
    runner = exported.runners.get(COMPONENT)
    if not isinstance(runner, AotstackModelRunner):
        raise AotstackError(f"expected an aotstack export, got format {exported.export_format!r}")
    return runner


def generate(
    exported: ExportedModel,
    input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    decoder_prompt: Sequence[int] | None = None,
    generation_config: Any = None,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
    **inputs: Unpack[GenerationInputs],
) -> list[int] | list[list[int]]:
    """Generation from an aotstack ``export_for_generation``, following its generation config.

    Greedy or sampled as the config says, overridden by the settings among ``inputs`` (``temperature``,
    ``top_k``, ``top_p``, ``repetition_penalty``, ``do_sample``, ``eos``); ``max_new_tokens`` defaults to
    ``UNASKED_NEW_TOKENS`` (a speech transducer's to its whole clip: see below). Returns the new tokens, as
    ``torch.manual_seed(seed); model.generate(input_ids, max_new_tokens=...)[0, len(prompt):]``
    would (an encoder-decoder's without its decoder prompt); for a left-padded batch of several rows
    with its ``attention_mask``, a list of new tokens per row. An encoder-decoder's ``input_ids`` may be
    audio features (Whisper's ``input_features``, which may go by that name too); ``decoder_prompt`` is the
    decoder's first tokens (default: its start token; for Whisper see ``aotstack.integrations.audio``). A
    vision-language export takes a prompt's images, and an audio-text one its audio (``input_features``,
    ``input_features_mask``), as its processor made them with the prompt. A speech transducer (Parakeet's RNN-T and
    TDT) takes a clip's ``input_features`` and ``attention_mask`` as its feature extractor makes them, and returns
    the tokens of its transcript: ``model.generate(...).sequences`` without its start token and blanks.

    Example::

        tokens = generate(exported, ids, 32, temperature=0.7, top_p=0.9, seed=0)
        inputs = processor(images=image, text=prompt, return_tensors="pt")
        tokens = generate(exported, **inputs, max_new_tokens=32)    # input_ids, pixel_values, token_type_ids, ...
        tokens = generate(exported, **feature_extractor(samples, return_tensors="pt"))   # Whisper: input_features
    """
    prompt, settings = prompt_inputs_and_settings(inputs)
    runner = runner_of(exported)
    config = generation_config_of(exported, generation_config, max_new_tokens=new_tokens_asked(runner, max_new_tokens),
                                  **settings)
    return runner.generate(input_ids, config, attention_mask=attention_mask,
                                        decoder_prompt=decoder_prompt, seed=seed, on_token=on_token, **prompt)


def stream(
    exported: ExportedModel,
    input_ids: torch.Tensor | Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    decoder_prompt: Sequence[int] | None = None,
    generation_config: Any = None,
    seed: int | None = None,
    **inputs: Unpack[GenerationInputs],
) -> Iterator[int]:
    """The new tokens of one prompt, each as soon as it is chosen: the tokens :func:`generate` returns.

    ``attention_mask`` is a speech transducer's frames mask, as its feature extractor gives it with the clip.

    Example::

        for token in stream(exported, ids, 32):
            print(tokenizer.decode([token]), end="", flush=True)
    """
    prompt, settings = prompt_inputs_and_settings(inputs)
    runner = runner_of(exported)
    config = generation_config_of(exported, generation_config, max_new_tokens=new_tokens_asked(runner, max_new_tokens),
                                  **settings)
    return runner.stream(input_ids, config, attention_mask=attention_mask, decoder_prompt=decoder_prompt, seed=seed,
                         **prompt)


def new_tokens_asked(runner: AotstackModelRunner, max_new_tokens: int | None) -> int | None:
    """``max_new_tokens``, else ``UNASKED_NEW_TOKENS``; None for a speech transducer, whose clip bounds it."""
    if max_new_tokens is not None or "joint" in runner.methods:
        return max_new_tokens
    return UNASKED_NEW_TOKENS


register_backend(AotstackExporter, AotstackModelRunner)
