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
``generate(exported, input_ids)`` runs it greedily.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.exporters.auto import register_backend
from transformers.exporters.base import ExportedComponent, ExportedModel, HfExporter
from transformers.exporters.configs import DynamoConfig
from transformers.exporters.metadata import ExportMetadata, build_export_metadata
from transformers.exporters.runners.base import ModelRunner

import aotstack

from ..compile.engines import partitioners_for
from ..compile.export import Program
from ..compile.lower import LoweredProgram
from ..compile.progress import Progress
from ..compile.quantize import Quantization
from ..errors import AotstackError, ExportError, UnsupportedModelError
from .generation import (
    export_decoder_lm,
    greedy_decoder,
    greedy_encoder_decoder,
)
from .seq2seq import export_encoder_decoder_lm

EXPORT_FORMAT = "aotstack"
# The one component every aotstack export holds: several methods live in its one file.
COMPONENT = "model"
DEFAULT_MAX_CACHE_LEN = 1024


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
    """

    export_format: str = EXPORT_FORMAT

    engines: str = "auto"
    device: str = "cpu"
    max_cache_len: int | None = None
    qlinear: str | None = None
    qembedding: str | None = None
    qgroup_size: int = 32

    def __post_init__(self) -> None:
        # An unknown scheme or a bad group size fails here, before any export.
        Quantization(self.qlinear, self.qembedding, self.qgroup_size)

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

    def lower(self, program: Program, config: AotstackConfig) -> LoweredProgram:
        plan = partitioners_for(config.engines, config.device, option="AotstackConfig.engines")
        started = time.perf_counter()
        lowered = aotstack.lower(program, plan, progress=self.progress, jobs=self.jobs)
        self.lower_seconds += time.perf_counter() - started
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
        already takes any number of tokens.
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
        max_position = getattr(text_config, "max_position_embeddings", None) or DEFAULT_MAX_CACHE_LEN
        max_cache_len = config.max_cache_len or min(max_position, DEFAULT_MAX_CACHE_LEN)
        started = time.perf_counter()
        try:
            if model.config.is_encoder_decoder:
                program = export_encoder_decoder_lm(model, max_cache_len, max_source_len=max_position)
            else:
                program = export_decoder_lm(model, max_cache_len)
        except ExportError as exc:
            raise UnsupportedModelError(
                f"{type(model).__name__} cannot be exported for generation with a static cache: {exc}"
            ) from exc
        self.export_seconds += time.perf_counter() - started
        lowered = self.lower(program, config)
        first = next(iter(program.methods))
        example = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
        metadata = build_export_metadata(model, example, program.methods[first], self.required_packages)
        metadata.packages["aotstack"] = aotstack.__version__
        metadata.export_config = {**json.loads(config.to_json_string()), "max_cache_len": max_cache_len}
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
        return aotstack.load(path)


def refuse_quantizer(config: AotstackConfig) -> None:
    if config.quantizer is not None:
        raise ExportError(
            "AotstackConfig takes no transformers quantizer; quantize with qlinear= and qembedding= instead "
            "(torchao's configs under ExecuTorch's names: 8w, 8da8w, 4w, 8da4w)"
        )


def quantized_copy(model: Any, quantization: Quantization) -> Any:
    """``model`` itself when nothing is quantized; else a quantized copy, so the caller's model stays float."""
    return quantization.apply(copy.deepcopy(model)) if quantization else model


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
            program = aotstack.load(path)
        return cls(program, metadata, keep)

    def __call__(self, share_inputs: bool = True, share_outputs: bool = False, **kwargs: Any) -> Any:
        if "forward" not in self.methods:
            raise AotstackError(
                f"this export holds the generation stages {self.methods}, not a forward: run it with "
                "aotstack.integrations.transformers.generate(exported, input_ids), or call runner.program.<method>"
            )
        with torch.no_grad():
            return self.program.forward(**{**self.metadata.in_constants, **kwargs})

    def generate(
        self,
        input_ids: torch.Tensor | list[int],
        max_new_tokens: int,
        eos_token_id: int | Collection[int] | None = None,
        decoder_start_token_id: int | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Greedy decoding of one prompt; the new tokens (an encoder-decoder's after its start token)."""
        prompt = input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise AotstackError(f"generation runs batch 1; input_ids has batch {input_ids.shape[0]}")
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        limit = self.metadata.export_config.get("max_cache_len")
        if "prefill" in self.methods:
            if limit is not None and len(prompt) + max_new_tokens > limit:
                needed = len(prompt) + max_new_tokens
                raise AotstackError(
                    f"a prompt of {len(prompt)} tokens plus {max_new_tokens} new ones needs {needed} cache slots; "
                    f"this export has {limit} (export again with a larger max_cache_len)"
                )
            return greedy_decoder(self.program, prompt, max_new_tokens, eos, on_token)
        if "encode" in self.methods:
            if decoder_start_token_id is None:
                raise AotstackError("an encoder-decoder export needs decoder_start_token_id to generate")
            if limit is not None and max_new_tokens > limit:
                raise AotstackError(f"{max_new_tokens} new tokens need as many cache slots; this export has {limit}")
            return greedy_encoder_decoder(self.program, prompt, max_new_tokens, decoder_start_token_id, eos, on_token)
        raise AotstackError(f"this export has no generation stages, only {self.methods}")


def generation_ids(exported: ExportedModel) -> tuple[Any, int | None]:
    """The EOS token id(s) and decoder start token of an export, from its generation config, else its config."""
    sources = [source for source in (exported.generation_config, exported.config) if source is not None]
    eos = next((s.eos_token_id for s in sources if getattr(s, "eos_token_id", None) is not None), None)
    start = next((s.decoder_start_token_id for s in sources
                  if getattr(s, "decoder_start_token_id", None) is not None), None)
    return eos, start


def generate(exported: ExportedModel, input_ids: torch.Tensor | list[int], max_new_tokens: int = 20) -> list[int]:
    """Greedy generation from an aotstack ``export_for_generation``, stopping at the generation config's EOS.

    Returns the new tokens, as ``model.generate(input_ids, do_sample=False)[0, len(prompt):]``
    would (an encoder-decoder's without its decoder start token).
    """
    runner = exported.runners[COMPONENT]
    if not isinstance(runner, AotstackModelRunner):
        raise AotstackError(f"expected an aotstack export, got format {exported.export_format!r}")
    eos, start = generation_ids(exported)
    return runner.generate(input_ids, max_new_tokens, eos, start)


register_backend(AotstackExporter, AotstackModelRunner)
