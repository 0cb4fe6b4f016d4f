"""Encoder-decoder decoding, tokens per second: cross-attention keys and values cached by ``encode`` vs recomputed.

T5 and BART (random weights, d_model 512, 6 + 6 layers, vocabulary 32128), each exported two ways
and lowered with AOTInductor alone (``AotiCpuPartitioner``), saved and loaded:

- recomputed: what aotstack exported before: ``encode`` gives the encoder's hidden states and
  ``decode(token, hidden_states, position)`` projects them to every decoder layer's
  cross-attention keys and values at each token (transformers' ``Seq2SeqLM*ExportableModule``
  wrappers);
- cached:     ``aotstack.integrations.seq2seq.export_encoder_decoder_lm``: ``encode`` returns
  those keys and values once per source, ``decode(token, *state, position)`` reads them.

Each file decodes ``--tokens`` greedy tokens after the decoder start token, batch 1, for sources
of 16 and 256 tokens; only the ``decode`` calls are timed. Rounds alternate between the two files.
Nothing is asserted; the target (T5 at 256 source tokens at least 1.5x faster cached) is printed
as met or not.

    .venv/bin/python bench/seq2seq.py [--tokens 32] [--rounds 5] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.export import Dim

import aotstack
from common import Figure, Figures, Settings, median, print_table, progress, run_standalone
from workloads import weights_bytes

ARCHITECTURES = ("t5", "bart")
SOURCE_LENGTHS = (16, 256)
CACHE = 64
MAX_SOURCE = 512
VOCAB = 32128


def seq2seq_model(arch: str, hidden: int, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=hidden, d_ff=4 * hidden, d_kv=hidden // 8,
                                       num_layers=layers, num_heads=8, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config).eval()
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                                     encoder_attention_heads=8, decoder_attention_heads=8,
                                     encoder_ffn_dim=4 * hidden, decoder_ffn_dim=4 * hidden,
                                     max_position_embeddings=MAX_SOURCE)
    return transformers.BartForConditionalGeneration(config).eval()


def recomputing_program(model: torch.nn.Module) -> aotstack.Program:
    """The export before cross-attention was cached: ``decode`` takes the encoder's hidden states."""
    from transformers.integrations.executorch import (
        Seq2SeqLMDecoderExportableModuleWithStaticCache,
        Seq2SeqLMEncoderExportableModule,
    )

    source = Dim("source", min=2, max=MAX_SOURCE)
    encoder = Seq2SeqLMEncoderExportableModule(model.get_encoder()).eval()
    decoder = Seq2SeqLMDecoderExportableModuleWithStaticCache(model, CACHE, batch_size=1).eval()
    encode = aotstack.export(encoder, {"forward": (torch.zeros(1, 4, dtype=torch.long),)},
                             dynamic_shapes={"forward": {"input_ids": {1: source}}}, strict=True)
    decode = aotstack.export(
        decoder,
        {"forward": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4, model.config.d_model),
                     torch.zeros(1, dtype=torch.long))},
        dynamic_shapes={"forward": {"decoder_input_ids": None, "encoder_hidden_states": {1: source},
                                    "cache_position": None}},
        strict=True,
    )
    return aotstack.Program({"encode": encode.methods["forward"], "decode": decode.methods["forward"]})


def caching_program(model: torch.nn.Module) -> aotstack.Program:
    from aotstack.integrations.seq2seq import export_encoder_decoder_lm

    return export_encoder_decoder_lm(model, CACHE, max_source_len=MAX_SOURCE)


def compiled(program: aotstack.Program, path: str, what: str) -> aotstack.LoadedProgram:
    started = time.perf_counter()
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()]).save(path)
    progress(f"{what}: compiled in {time.perf_counter() - started:.1f} s")
    return aotstack.load(path)


def decode_tokens(program: Any, source: torch.Tensor, start: int, tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``start``, and the seconds the ``decode`` calls took (``encode`` untimed)."""
    with torch.no_grad():
        encoded = program.encode(source)
        state = (encoded,) if isinstance(encoded, torch.Tensor) else tuple(encoded)
        generated, previous, seconds = [], start, 0.0
        for position in range(tokens):
            began = time.perf_counter()
            logits = program.decode(torch.tensor([[previous]]), *state, torch.tensor([position]))
            seconds += time.perf_counter() - began
            previous = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            generated.append(previous)
    return generated, seconds


def architecture_rates(
    settings: Settings, arch: str, tokens: int, rounds: int, hidden: int, layers: int
) -> dict[int, dict[str, float]]:
    """Per source length, tokens/s of each variant (medians over rounds); tokens must agree."""
    model = seq2seq_model(arch, hidden, layers)
    progress(f"{arch}: {weights_bytes(model) / 1e6:.1f} MB of float32 weights, {tokens} tokens a round")
    files = {
        "recomputed": compiled(recomputing_program(model), settings.path(f"{arch}-recomputed.pt2"),
                               f"{arch} recomputed"),
        "cached": compiled(caching_program(model), settings.path(f"{arch}-cached.pt2"), f"{arch} cached"),
    }
    start = model.config.decoder_start_token_id
    rates: dict[int, dict[str, float]] = {}
    for length in SOURCE_LENGTHS:
        source = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        seconds: dict[str, list[float]] = {name: [] for name in files}
        outputs: dict[str, list[int]] = {}
        for name, program in files.items():  # warm-up round, untimed
            outputs[name] = decode_tokens(program, source, start, tokens)[0]
        if outputs["cached"] != outputs["recomputed"]:
            progress(f"{arch} at {length}: the two files' tokens differ")
        for _ in range(rounds):
            for name, program in files.items():
                seconds[name].append(decode_tokens(program, source, start, tokens)[1])
        rates[length] = {name: tokens / median(values) for name, values in seconds.items()}
    return rates


def seq2seq_rates(
    settings: Settings,
    tokens: int | None = None,
    rounds: int | None = None,
    hidden: int = 512,
    layers: int = 6,
    arch: str | None = None,
) -> Figures:
    tokens, rounds = tokens or settings.pick(32, 16), rounds or settings.pick(5, 2)
    figures: Figures = {}
    rows = []
    for name in [arch] if arch else ARCHITECTURES:
        rates = architecture_rates(settings, name, tokens, rounds, hidden, layers)
        for length, rate in rates.items():
            speedup = rate["cached"] / rate["recomputed"]
            rows.append([name, str(length), f"{rate['recomputed']:.1f}", f"{rate['cached']:.1f}", f"{speedup:.2f}x"])
            target = 1.5 if (name, length) == ("t5", 256) else None
            figures[f"{name} decode, source {length}: cached / recomputed, tokens/s"] = Figure(
                rate["cached"], "tokens/s", rate["recomputed"], target, higher_is_better=True
            )
    print_table(["model", "source tokens", "recomputed tokens/s", "cached tokens/s", "speed-up"], rows)
    return figures


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=None, help="tokens a round (default 32; --quick: 16)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick: 2)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6, help="encoder layers, and as many decoder layers")
    parser.add_argument("--arch", choices=ARCHITECTURES, default=None, help="one architecture (default: both)")


if __name__ == "__main__":
    run_standalone(__doc__, seq2seq_rates, extra=options)
