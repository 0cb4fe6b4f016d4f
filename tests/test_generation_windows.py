"""Sliding-window and hybrid (sliding + global) caches through ``aotstack export-hf`` and ``generate``.

The window (4) is shorter than the prompt (10 tokens) and the generation (14 more), so every
logit after the fourth position depends on the window hiding older tokens. Each folder is exported
once per module with AOTInductor alone and a 32-slot cache; the tests compare it with eager
transformers loaded from the same folder: the greedy text ``generate`` prints, and the file's
``prefill`` and ``decode`` logits at every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402

import aotstack  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.integrations.hf_folder import generate_text  # noqa: E402
from tests.hf_folders import TEXT, export_hf, greedy_reference, saved, tokenizer  # noqa: E402

WINDOW = 4
PROMPT = "then the dog sat on a mat and it slept"  # 10 tokens; neither model ends it early
SHORTER = "a dog sat on it"  # 5 tokens, run after PROMPT on the same loaded file
NEW_TOKENS = 14
CACHE = 32
ATOL = 1e-4


def windowed_lm(name: str) -> torch.nn.Module:
    """A tiny random decoder LM whose attention (all layers, or every other one) sees ``WINDOW`` tokens."""
    torch.manual_seed(0)
    if name == "mistral":  # every layer sliding
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            **TEXT, num_key_value_heads=2, sliding_window=WINDOW))
    if name == "gemma2":  # layer_types: sliding, then global
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TEXT, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW))
    if name == "gemma3":  # layer_types named in the config, global first; sliding layers with their own rope
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **TEXT, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention"]))
    raise ValueError(name)


@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3"])
def windowed_export(request, tmp_path_factory) -> tuple[Path, Path]:
    """The saved model folder and its ``export-hf`` output."""
    root = tmp_path_factory.mktemp(request.param)
    folder = saved(windowed_lm(request.param), root / "model")
    export_hf(str(folder), "-o", str(root / "out"), "--engines", "aoti", "--max-cache-len", str(CACHE))
    return folder, root / "out"


def eager(folder: Path, **config: object) -> torch.nn.Module:
    """The model as a user loads it from ``folder`` to compare with, ``config`` overriding its config."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **config).eval()


def file_logits(program: aotstack.LoadedProgram, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The file's logits after each prefix of ``prompt + tokens`` from the prompt's on: prefill, then decode steps."""
    with torch.no_grad():
        steps = [program.prefill(torch.tensor([prompt]))]
        for position, token in enumerate(tokens[:-1], start=len(prompt)):
            steps.append(program.decode(torch.tensor([[token]]), torch.tensor([position])))
    return torch.cat(steps)


def eager_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Eager logits of the whole sequence, at the same positions as :func:`file_logits`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1: len(prompt) + len(tokens) - 1]


def test_generate_past_the_window_gives_transformers_greedy_text(windowed_export, capsys):
    """``aotstack generate`` prints, token for token, what transformers' greedy ``generate`` gives."""
    folder, out = windowed_export
    ids = tokenizer()(PROMPT)["input_ids"]
    assert len(ids) > 2 * WINDOW
    expected = greedy_reference(eager(folder), ids, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS, "no early end of sequence: generation runs well past the window"

    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    assert generate_text(out, PROMPT, NEW_TOKENS).tokens == expected


def test_prefill_and_decode_logits_past_the_window_equal_eager(windowed_export):
    """The file's logits at every step equal eager logits of the whole sequence, which the window changes."""
    folder, out = windowed_export
    model = eager(folder)
    program = aotstack.load(out / "model.pt2")
    # Continuations drawn at random, not greedy ones, which could stop at an end of sequence. Two prompts on
    # one loaded file: the second, shorter, runs over the first one's cache slots.
    draw = torch.Generator().manual_seed(0)
    checked = {}
    for prompt in (PROMPT, SHORTER):
        ids = tokenizer()(prompt)["input_ids"]
        tokens = torch.randint(3, len(tokenizer()), (NEW_TOKENS,), generator=draw).tolist()
        want = eager_logits(model, ids, tokens)
        checked[prompt] = ids, tokens, want
        assert want.shape[0] == NEW_TOKENS
        torch.testing.assert_close(file_logits(program, ids, tokens), want, rtol=0, atol=ATOL)

    # The check can tell: without the window (one as wide as the cache) the same weights give other logits
    # at every position checked, the prompt's last included.
    ids, tokens, want = checked[PROMPT]
    unwindowed = eager_logits(eager(folder, sliding_window=CACHE), ids, tokens)
    assert (unwindowed - want).abs().amax(dim=-1).min() > 100 * ATOL
