"""Choosing tokens from a compiled generation program's logits: greedy or sampled, streamed, one prompt or several.

The compiled methods (``prefill``/``decode``, or ``encode``/``decode``) give one step's logits;
everything after them runs here, in torch, so a new temperature or top-p needs no recompile. The
logits processors are transformers' own, built from a ``GenerationConfig`` in the order
``generate`` applies them, and a seeded sample makes the draw ``torch.manual_seed(seed);
model.generate(...)`` makes, so both pick the same tokens.

Example::

    config = generation_settings(model.generation_config, temperature=0.7, top_p=0.9)
    for token in stream_decoder(loaded, prompt_ids, config, seed=0):
        print(token)
"""

from __future__ import annotations

import bisect
import copy
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from ..errors import GenerationError

logger = logging.getLogger("aotstack")

# What transformers' generate fills in for settings a model's generation config leaves unset.
UNSET_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
}
# Settings generate honours that these loops do not; each is named once when a config sets it.
IGNORED_SETTINGS: dict[str, Callable[[Any], bool]] = {
    "num_beams": lambda value: value is not None and value > 1,
    "guidance_scale": lambda value: value is not None and value != 1,
    "sequence_bias": lambda value: value is not None,
    "encoder_repetition_penalty": lambda value: value is not None and value != 1.0,
    "encoder_no_repeat_ngram_size": lambda value: value is not None and value > 0,
    "exponential_decay_length_penalty": lambda value: value is not None,
    "epsilon_cutoff": lambda value: value is not None and 0.0 < value < 1.0,
    "eta_cutoff": lambda value: value is not None and 0.0 < value < 1.0,
    "watermarking_config": lambda value: value is not None,
    "top_h": lambda value: value is not None,
}


def generation_settings(
    base: Any = None,
    *,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    eos: int | Sequence[int] | None = None,
) -> Any:
    """A copy of ``base`` (a ``GenerationConfig``; None: transformers' defaults) with the given settings changed.

    Asking for a ``temperature`` above 0, a ``top_k`` or a ``top_p`` samples, whatever ``base`` says;
    ``temperature=0`` or ``do_sample=False`` decodes greedily. Unset fields take the values
    transformers' ``generate`` gives them (``top_k`` 50 when sampling, ...). Bad values raise
    :class:`GenerationError` naming the setting.
    """
    from transformers import GenerationConfig

    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    for name, value in UNSET_DEFAULTS.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    checked_settings(max_new_tokens, temperature, top_k, top_p, repetition_penalty, eos)
    if temperature is not None:
        config.do_sample = temperature > 0
        if temperature > 0:
            config.temperature = temperature
    if top_k is not None:
        config.top_k, config.do_sample = top_k, config.do_sample or temperature is None
    if top_p is not None:
        config.top_p, config.do_sample = top_p, config.do_sample or temperature is None
    if do_sample is not None:
        config.do_sample = do_sample
    if repetition_penalty is not None:
        config.repetition_penalty = repetition_penalty
    if max_new_tokens is not None:
        config.max_new_tokens = max_new_tokens
    if eos is not None:
        config.eos_token_id = [eos] if isinstance(eos, int) else list(eos)
    return config


def checked_settings(
    max_new_tokens: int | None, temperature: float | None, top_k: int | None, top_p: float | None,
    repetition_penalty: float | None, eos: int | Sequence[int] | None,
) -> None:
    problems = []
    if max_new_tokens is not None and max_new_tokens < 1:
        problems.append(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature is not None and temperature < 0:
        problems.append(f"temperature must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 0:
        problems.append(f"top_k must be 0 (off) or more, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        problems.append(f"repetition_penalty must be above 0, got {repetition_penalty}")
    if eos is not None and any(token < 0 for token in ([eos] if isinstance(eos, int) else eos)):
        problems.append(f"eos token ids must be 0 or more, got {eos}")
    if problems:
        raise GenerationError("; ".join(problems))


def eos_ids(config: Any) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(token) for token in eos}


def new_token_limit(config: Any, prompt_length: int) -> int:
    """How many tokens generate may add: ``max_new_tokens``, else what ``max_length`` leaves after the prompt."""
    if getattr(config, "max_new_tokens", None) is not None:
        return int(config.max_new_tokens)
    return max(int(config.max_length) - prompt_length, 0)


def ignored_settings(config: Any) -> list[str]:
    """The settings of ``config`` that change ``generate``'s output but that these loops do not apply."""
    return [f"{name}={getattr(config, name)!r}" for name, is_set in IGNORED_SETTINGS.items()
            if is_set(getattr(config, name, None))]


def logits_processors(config: Any, prompt_length: int) -> Any:
    """transformers' logits processors for ``config``, in ``generate``'s order, for a prompt of ``prompt_length``.

    ``prompt_length`` counts what the processors see before the first new token: the prompt of a
    decoder-only model, the decoder's start tokens of an encoder-decoder.
    """
    from transformers import generation as gen

    eos = sorted(eos_ids(config))
    max_length = prompt_length + new_token_limit(config, prompt_length)
    processors = gen.LogitsProcessorList()
    if config.repetition_penalty not in (None, 1.0):
        processors.append(gen.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(gen.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        processors.append(gen.NoBadWordsLogitsProcessor(config.bad_words_ids, eos or None))
    if config.min_length and eos:
        processors.append(gen.MinLengthLogitsProcessor(config.min_length, eos))
    if config.min_new_tokens and eos:
        processors.append(gen.MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos))
    if config.forced_bos_token_id is not None:
        processors.append(gen.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        processors.append(gen.ForcedEOSTokenLogitsProcessor(max_length, config.forced_eos_token_id))
    if config.remove_invalid_values:
        processors.append(gen.InfNanRemoveLogitsProcessor())
    if config.suppress_tokens is not None:
        processors.append(gen.SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        begin = prompt_length + (1 if prompt_length == 1 and config.forced_bos_token_id is not None else 0)
        processors.append(gen.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin))
    if config.do_sample:
        if config.temperature not in (None, 1.0):
            processors.append(gen.TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(gen.TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(OnKeptTokens(gen.TopPLogitsWarper(config.top_p)))
        if config.min_p is not None:
            processors.append(OnKeptTokens(gen.MinPLogitsWarper(config.min_p)))
        if config.typical_p is not None and config.typical_p < 1.0:
            processors.append(OnKeptTokens(gen.TypicalLogitsWarper(config.typical_p)))
    if config.renormalize_logits:
        processors.append(gen.LogitNormalization())
    return processors


class OnKeptTokens:
    """A warper that sorts the whole vocabulary, run on the tokens an earlier warper (top-k) left instead.

    Top-p, min-p and typical-p give a removed token (score -inf, probability 0) no weight and
    remove it again, so running them on the rest gives the same scores; after a top-k of 50
    that sorts 50 scores rather than the vocabulary (4 ms a token for 32,000 at one thread).
    """

    def __init__(self, warper: Any) -> None:
        self.warper = warper

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 1:
            return self.warper(input_ids, scores)
        columns = (scores[0] > -torch.inf).nonzero().squeeze(1)
        if len(columns) == scores.shape[1]:
            return self.warper(input_ids, scores)
        warped = torch.full_like(scores, -torch.inf)
        warped[:, columns] = self.warper(input_ids, scores[:, columns])
        return warped


@dataclass(frozen=True)
class KeptTokenSampler:
    """The usual sampling settings (repetition penalty, temperature, top-k, top-p) on top-k's tokens only.

    The same distribution as transformers' warpers in ``generate``'s order, in one torch call on the
    vocabulary (a top-k of the raw scores) and plain Python on the few it keeps: the penalty only
    changes seen tokens' scores, temperature keeps their order, so top-k may come first, and top-k's
    scores come sorted, as top-p needs them. A torch call right after a step costs several times
    what it costs in a loop (``TokenChooser``), so the dozen a vocabulary-wide penalty, softmax and
    cumulative sum took made sampling 0.5 ms a token.
    """

    top_k: int
    penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def for_processors(cls, processors: Sequence[Any]) -> KeptTokenSampler | None:
        """The sampler doing what ``processors`` do, or None if they do anything else (or no top-k)."""
        from transformers import generation as gen

        settings: dict[str, Any] = {}
        for processor in processors:
            warper = processor.warper if isinstance(processor, OnKeptTokens) else processor
            if type(processor) is gen.RepetitionPenaltyLogitsProcessor and processor.prompt_ignore_length is None:
                settings["penalty"] = processor.penalty
            elif type(processor) is gen.TemperatureLogitsWarper:
                settings["temperature"] = processor.temperature
            elif type(processor) is gen.TopKLogitsWarper:
                settings["top_k"] = processor.top_k
            elif type(warper) is gen.TopPLogitsWarper and "top_k" in settings and warper.min_tokens_to_keep == 1:
                settings["top_p"] = warper.top_p
            else:
                return None
        return cls(**settings) if "top_k" in settings else None

    def distribution(self, history: Iterable[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """The tokens that may be drawn after ``history`` given ``logits`` (``[1, vocabulary]``), likeliest first,
        and their probabilities."""
        # Near sorted already (top-k's order, where the penalty moved few): a sort is quicker than a heap here.
        seen = set(history) if self.penalty != 1.0 else set()  # the history only matters to the penalty
        ranked = sorted(self.candidates(seen, logits).items(), key=itemgetter(1), reverse=True)[:self.top_k]
        highest = ranked[0][1]
        weights = [math.exp((score - highest) / self.temperature) for _, score in ranked]
        if self.top_p < 1.0:
            # A token stays while the likelier ones hold less than top_p; the likeliest always stays.
            total, held = sum(weights), 0.0
            for kept, weight in enumerate(weights):
                if held >= self.top_p * total:
                    weights = weights[:kept]
                    break
                held += weight
        total = sum(weights)
        return [token for token, _ in ranked[:len(weights)]], [weight / total for weight in weights]

    def candidates(self, seen: set[int], logits: torch.Tensor) -> dict[int, float]:
        """Scores after the repetition penalty, by token, of tokens among which are the ``top_k`` highest.

        A penalty above 1 only lowers a seen token's score, so the highest raw scores hold them once
        they hold ``top_k`` unseen tokens; one below 1 may raise any seen token into them.
        """
        vocabulary = logits.shape[-1]
        wanted = min(self.top_k if self.penalty == 1.0 else 2 * self.top_k, vocabulary)
        while True:
            values, tokens = logits.topk(wanted)
            found = dict(zip(tokens.tolist()[0], values.tolist()[0], strict=True))
            if self.penalty == 1.0:
                return found
            if wanted == vocabulary or len(found.keys() - seen) >= self.top_k:
                break
            wanted = min(2 * wanted, vocabulary)
        outside = sorted(seen - found.keys()) if self.penalty < 1.0 else []
        if outside:
            found.update(zip(outside, logits[0, outside].tolist(), strict=True))
        for token in seen & found.keys():
            found[token] = found[token] * self.penalty if found[token] < 0 else found[token] / self.penalty
        return found

    def next_token(self, history: Iterable[int], logits: torch.Tensor, draw: float) -> int:
        """The token ``draw`` (uniform in [0, 1)) picks from ``distribution``."""
        tokens, probabilities = self.distribution(history, logits)
        chosen = bisect.bisect_right(list(itertools.accumulate(probabilities)), draw * sum(probabilities))
        return tokens[min(chosen, len(tokens) - 1)]


class TokenChooser:
    """Picks each next token from a step's logits as ``generate`` would, given the tokens so far.

    Greedy with no processors is a plain argmax; otherwise the processors see the whole history
    (prompt included). With a ``seed``, a sample is drawn over the whole vocabulary from a
    generator seeded with it, the draw ``torch.manual_seed(seed); model.generate(...)`` makes, so
    both pick the same tokens. Without one, it is drawn from torch's global generator over the
    tokens the warpers kept (top-k's 50, say): the same distribution, without one random number
    per vocabulary entry (1 ms a token for 32,000 at one thread); the usual settings take
    :class:`KeptTokenSampler`'s shorter way there, drawing ``DRAWS`` numbers from that generator at a time.

    A token costs as few torch calls as it can: right after a step each costs several times what it
    costs in a tight loop (the step pushed torch's own code out of the caches; 40-50 µs a call
    against 8-30 µs, measured on a 2-core machine).
    """

    DRAWS = 64

    def __init__(self, config: Any, prompt_length: int, seed: int | None = None) -> None:
        ignored = ignored_settings(config)
        if ignored:
            logger.warning("aotstack generation does not apply %s; decoding without them", ", ".join(ignored))
        self.processors = logits_processors(config, prompt_length)
        self.sample = bool(config.do_sample)
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.kept_token_sampler = (KeptTokenSampler.for_processors(self.processors)
                                   if self.sample and seed is None else None)
        self.draws: list[float] = []

    def next_token(self, history: Sequence[int], logits: torch.Tensor) -> int:
        """The token after ``history`` (the prompt and the tokens so far), given their ``logits``
        (``[1, vocabulary]``)."""
        if self.kept_token_sampler is not None:
            return self.kept_token_sampler.next_token(history, logits, self.uniform())
        if not self.processors and not self.sample:
            return int(logits.argmax())
        scores = logits.to(dtype=torch.float32)
        ids = torch.tensor([history], dtype=torch.long)
        # Called one by one: LogitsProcessorList inspects each one's signature at every call.
        for processor in self.processors:
            scores = processor(ids, scores)
        if not self.sample:
            return int(scores.argmax())
        if self.generator is None:
            kept = (scores[0] > -torch.inf).nonzero().squeeze(1)
            probabilities = torch.nn.functional.softmax(scores[:, kept], dim=-1)
            return int(kept[torch.multinomial(probabilities, num_samples=1)[0, 0]])
        probabilities = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, num_samples=1, generator=self.generator))

    def uniform(self) -> float:
        """The next number in [0, 1) from torch's global generator, drawn ``DRAWS`` at a time."""
        if not self.draws:
            self.draws = torch.rand(self.DRAWS, dtype=torch.float64).tolist()[::-1]
        return self.draws.pop()


@dataclass
class PromptImages:
    """The images of a prompt for a vision-language export (``encode_images``, ``prefill_images``).

    ``pixel_values`` are as the model's processor made them (``[images, channels, height, width]``,
    or with a leading batch of 1); the prompt holds ``image_token`` once per row of their features.
    ``prompt_inputs`` are the processor's other outputs ``prefill_images`` reads (Gemma 3's
    ``token_type_ids``), in its order; where the caller has none, they are made from the prompt.
    """

    pixel_values: torch.Tensor
    image_token: int
    prompt_inputs: tuple[torch.Tensor, ...] = ()


@dataclass
class PromptAudio:
    """The audio of a prompt for an audio-text export (``encode_audio``, ``prefill_audio``).

    ``input_features`` are as the model's processor made them, a clip (a chunk of a long one) per
    row of their first dimension; ``frames_mask`` is the processor's ``input_features_mask`` where it
    made one, a row per clip. The prompt holds ``audio_token`` once per row of their features.
    """

    input_features: torch.Tensor
    audio_token: int
    frames_mask: torch.Tensor | None = None


def single_images(pixel_values: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    """Each image of ``pixel_values``, shaped ``shape`` as ``encode_images`` takes one.

    ``pixel_values`` are ``[channels, height, width]``, ``[images, ...]``, or with a leading batch of
    1 (a processor's tiles count as images, but for LLaVA-OneVision's, which make one image); or, for a
    model whose processor cuts an image into a grid of patches (Qwen2-VL's; ``shape`` is ``[patches,
    patch_values]``), the rows of all images' patches.
    """
    if len(shape) == 2:
        patches = int(shape[0])
        rows = pixel_values.reshape(-1, pixel_values.shape[-1])
        if rows.shape[1] != shape[1] or rows.shape[0] % patches:
            raise GenerationError(
                f"pixel values of shape {tuple(pixel_values.shape)} are not whole images of {patches} patches of "
                f"{shape[1]} values, which this export takes: make them with the model's processor from images "
                "of the size the export was made for (its export_config's image_size)"
            )
        return list(rows.split(patches))
    # One image is shape[1:]: its channels, a tile of one (SmolVLM's), or the tiles it was cut into (LLaVA-OneVision's).
    per_image = tuple(int(side) for side in shape[1:])
    if pixel_values.numel() % math.prod(per_image) or tuple(pixel_values.shape[-2:]) != per_image[-2:]:
        raise GenerationError(
            f"pixel values of shape {tuple(pixel_values.shape)} are not whole images of {list(per_image)}, which "
            "this export takes: make them with the model's processor from images of the size the export was made "
            "for (its export_config's image_size)"
        )
    return list(pixel_values.reshape(-1, *per_image).split(1))


def image_prompt_input(tokens: torch.Tensor, image_token: int) -> torch.Tensor:
    """``token_type_ids`` as Gemma 3's processor makes them: 1 on an image's tokens, 0 elsewhere."""
    return (tokens == image_token).long()


def stream_decoder(
    program: Any,
    prompt: Sequence[int],
    config: Any,
    seed: int | None = None,
    media: PromptImages | PromptAudio | None = None,
) -> Iterator[int]:
    """The tokens a decoder-only program (``prefill``, ``decode``) appends to ``prompt``, each as it is chosen.

    It stops after an eos token of ``config`` or after its new-token limit. ``prefill`` writes the
    cache from slot 0 and the causal mask hides the slots after it, so an earlier prompt's cache is harmless.
    ``media``, the prompt's images or audio, go through ``encode_images`` and ``prefill_images`` (or
    ``encode_audio`` and ``prefill_audio``) in place of ``prefill``.
    """
    if new_token_limit(config, len(prompt)) < 1:
        return iter(())
    if not prompt:
        raise GenerationError("the prompt is empty: a decoder-only model needs at least one token to start from")
    history = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        if isinstance(media, PromptImages):
            logits = images_prompt_logits(program, history, media)
        elif isinstance(media, PromptAudio):
            logits = audio_prompt_logits(program, history, media)
        else:
            logits = prompt_logits(program, history)
    return continued(logits, history, program.decode, config, seed)


def images_prompt_logits(program: Any, history: torch.Tensor, images: PromptImages) -> torch.Tensor:
    """The logits after ``history`` (``[1, length]``), whose image tokens take the features of ``images``."""
    if "prefill_images" not in program_methods(program):
        raise GenerationError(f"this export takes no images: it has methods {program_methods(program)}")
    per_image = single_images(images.pixel_values, program.method("encode_images").inputs[0].shape)
    features = torch.cat([program.encode_images(image) for image in per_image])
    slots = int((history == images.image_token).sum())
    if slots != features.shape[0]:
        raise GenerationError(
            f"the prompt holds {slots} image tokens (id {images.image_token}) and its {len(per_image)} image(s) "
            f"give {features.shape[0]} rows of features: make the prompt and the images with the model's processor "
            "in one call, which puts as many image tokens in the prompt as its images need"
        )
    wanted = len(program.method("prefill_images").inputs) - 2
    prompt_inputs = images.prompt_inputs or tuple(image_prompt_input(history, images.image_token)
                                                  for _ in range(wanted))
    if len(prompt_inputs) != wanted:
        raise GenerationError(f"this export's prefill_images reads {wanted} of the processor's outputs beside the "
                              f"token ids and images; got {len(prompt_inputs)}")
    return program.prefill_images(history, features, *(value.reshape(history.shape) for value in prompt_inputs))


def audio_prompt_logits(program: Any, history: torch.Tensor, audio: PromptAudio) -> torch.Tensor:
    """The logits after ``history`` (``[1, length]``), whose audio tokens take the features of ``audio``'s clips."""
    if "prefill_audio" not in program_methods(program):
        raise GenerationError(f"this export takes no audio: it has methods {program_methods(program)}")
    rows = []
    for clip, kept in single_clips(program, audio):
        features = program.encode_audio(*clip)
        if kept is not None:
            # Granite Speech's mask is over a clip's rows, not its frames: padding's rows are dropped after encoding.
            if kept.numel() != features.shape[0]:
                raise GenerationError(f"input_features_mask has rows of {kept.numel()}; a clip gives "
                                      f"{features.shape[0]} rows of features")
            features = features[kept.reshape(-1).bool()]
        rows.append(features)
    features = torch.cat(rows)
    slots = int((history == audio.audio_token).sum())
    if slots != features.shape[0]:
        raise GenerationError(
            f"the prompt holds {slots} audio tokens (id {audio.audio_token}) and its audio gives {features.shape[0]} "
            "rows of features: make the prompt and the audio with the model's processor in one call, which puts as "
            "many audio tokens in the prompt as its clips need"
        )
    return program.prefill_audio(history, features)


def single_clips(program: Any, audio: PromptAudio) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]:
    """``encode_audio``'s inputs for each clip of ``audio`` (its frames, and its row of the frames mask where the
    export reads one), each checked against the frames the export takes, and the clip's row of a mask the export
    does not read, which picks the rows of its features to keep."""
    taken = program.method("encode_audio").inputs
    features = audio.input_features
    sides = len(taken[0].shape)
    if features.dim() != sides:
        features = features.reshape(-1, *features.shape[1 - sides:])
    for axis, (got, wanted) in enumerate(zip(features.shape[1:], taken[0].shape[1:]), start=1):
        if isinstance(wanted, int) and got != wanted:
            raise GenerationError(
                f"input_features of shape {tuple(audio.input_features.shape)} do not fit this export, which takes "
                f"clips of {list(taken[0].shape[1:])} (side {axis}: {got} against {wanted}; the model's encoder "
                "fixed it when exported): make them with the processor the export was made with"
            )
    clips = [(clip,) for clip in features.split(1)]
    mask = audio.frames_mask
    if mask is None and len(taken) == 1:
        return [(clip, None) for clip in clips]
    if mask is None:
        mask = torch.ones(features.shape[0], features.shape[-1], dtype=torch.long)
    mask = mask.reshape(-1, mask.shape[-1])
    if mask.shape[0] != len(clips):
        raise GenerationError(f"input_features_mask of shape {tuple(mask.shape)} has a row per clip; input_features "
                              f"hold {len(clips)} clips")
    if len(taken) == 1:
        return list(zip(clips, mask.split(1)))
    return [((*clip, row), None) for clip, row in zip(clips, mask.split(1))]


def prompt_logits(program: Any, history: torch.Tensor) -> torch.Tensor:
    """The logits after ``history`` (``[1, length]``): ``prefill``'s, or, for a program exported without one
    (a hybrid decoder whose prompt path loops over its length) or a prompt shorter than its prefill takes, from the
    state in its file (``reset``) through ``prefill_chunk`` a chunk at a time where it has one, and the rest through
    ``decode`` one token at a time."""
    methods = program_methods(program)
    if "prefill" in methods and history.shape[1] >= shortest_prompt(program):
        return program.prefill(history)
    program.reset()
    chunk = chunk_length(program) if "prefill_chunk" in methods else None
    chunked = 0
    while chunk is not None and history.shape[1] - chunked >= chunk:
        logits = program.prefill_chunk(history[:, chunked:chunked + chunk], torch.tensor([chunked]))
        chunked += chunk
    for position in range(chunked, history.shape[1]):
        logits = program.decode(history[:, position:position + 1], torch.tensor([position]))
    return logits


def shortest_prompt(program: Any) -> int:
    """The fewest tokens a program's ``prefill`` takes: its length's least value in a loaded file, 1 for an eager
    module."""
    if not callable(getattr(program, "method", None)):
        return 1
    length = program.method("prefill").inputs[0].shape[1]
    return length if isinstance(length, int) else length.min


def chunk_length(program: Any) -> int | None:
    """The tokens a loaded program's ``prefill_chunk`` takes at a call; None where its length is not fixed."""
    length = program.method("prefill_chunk").inputs[0].shape[1]
    return length if isinstance(length, int) else None


def program_methods(program: Any) -> list[str]:
    """The methods of a loaded program, or the generation methods an eager module has."""
    if hasattr(program, "method_names"):  # a loaded file's property
        return list(program.method_names)
    return [name for name in ("prefill", "decode", "encode") if callable(getattr(program, name, None))]


def decoder_start_id(*configs: Any) -> int | None:
    """The token an encoder-decoder's ``generate`` starts its decoder from: the first of ``configs`` (a
    generation config, then the model's) that names a decoder start token, else one that names a bos token (mBART's
    decoder starts from bos); None where none does."""
    for name in ("decoder_start_token_id", "bos_token_id"):
        for config in configs:
            token = getattr(config, name, None)
            if isinstance(token, int):
                return token
    return None


def stream_encoder_decoder(
    program: Any, source: torch.Tensor, decoder_prompt: Sequence[int], config: Any, seed: int | None = None
) -> Iterator[int]:
    """The decoder tokens an encoder-decoder program (``encode``, ``decode``) gives after ``decoder_prompt``.

    ``source`` is what ``encode`` takes (token ids ``[1, length]``, or audio features);
    ``decode(token, *state, position)`` gets everything ``encode`` returned. The decoder prompt (the
    start token, and any forced tokens after it) is fed one token per step.
    """
    if not decoder_prompt:
        raise GenerationError("the decoder prompt is empty: pass the decoder start token")
    state = encoder_state(program, source)
    with torch.no_grad():
        for position, token in enumerate(decoder_prompt):
            logits = program.decode(torch.tensor([[token]]), *state, torch.tensor([position]))

    def step(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return program.decode(token, *state, position)

    history = torch.tensor([list(decoder_prompt)], dtype=torch.long)
    return continued(logits, history, step, config, seed)


def encoder_state(program: Any, source: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What ``program.encode(source)`` returns, as the tuple ``decode(token, *state, position)`` takes."""
    with torch.no_grad():
        encoded = program.encode(source)
    return (encoded,) if isinstance(encoded, torch.Tensor) else tuple(encoded)


def continued(
    logits: torch.Tensor,
    history: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: Any,
    seed: int | None,
) -> Iterator[int]:
    """The tokens chosen from ``logits`` on, each fed back through ``step(token, position)`` for the next logits.

    ``history`` (``[1, length]``) is what came before: the prompt, or the decoder's start tokens;
    the first new token sits at position ``length``. It stops after an eos token of ``config``
    or at its new-token limit.
    """
    tokens = history[0].tolist()
    chooser, eos = TokenChooser(config, len(tokens), seed), eos_ids(config)
    start = len(tokens)
    end = start + new_token_limit(config, start)
    for position in range(start, end):
        token = chooser.next_token(tokens, logits)
        tokens.append(token)
        yield token
        if token in eos or position + 1 == end:
            return
        with torch.no_grad():  # only around the call: grad mode is the caller's between tokens
            logits = step(torch.tensor([[token]]), torch.tensor([position]))


def greedy_decoder(
    program: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The tokens greedy decoding appends to ``prompt``, stopping after an ``eos`` token, as ``generate`` does.

    ``program`` is a :class:`~aotstack.integrations.generation.PrefillDecode` or a file loaded from one;
    ``on_token`` is told each token as it is chosen.
    """
    if max_new_tokens < 1:
        return []
    config = generation_settings(max_new_tokens=max_new_tokens, do_sample=False, eos=list(eos))
    return collected(stream_decoder(program, prompt, config), on_token)


def collected(tokens: Iterable[int], on_token: Callable[[int], None] | None = None) -> list[int]:
    """``tokens`` as a list, telling ``on_token`` each one as it arrives."""
    result = []
    for token in tokens:
        result.append(token)
        if on_token is not None:
            on_token(token)
    return result


def text_pieces(tokens: Iterable[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """The text of ``tokens`` as it grows: each piece is what the latest token added to ``decode``'s text.

    A piece is held back while the text ends in an unfinished character (a byte-level tokenizer's
    partial UTF-8), and whatever the final text adds beyond what was given comes last.
    """
    seen: list[int] = []
    given = ""
    for token in tokens:
        seen.append(token)
        text = decode(seen)
        if text.endswith("\ufffd") or not text.startswith(given):
            continue
        if len(text) > len(given):
            yield text[len(given):]
            given = text
    final = decode(seen) if seen else ""
    if final.startswith(given) and len(final) > len(given):
        yield final[len(given):]
