"""``aotstack generate`` and ``aotstack.integrations.transformers.generate`` beyond greedy text.

Sampling follows the export's generation config and takes overrides; with a seed it picks the
tokens transformers' own ``generate`` picks on the same model, seed and settings. Streaming gives
the same tokens one at a time; chat prompts go through the tokenizer's chat template; a left-padded
batch gives each row what that row alone gives. One tiny Llama export (AOTInductor) serves every test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402

import aotstack  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import ModelFolderError  # noqa: E402
from aotstack.integrations import transformers as aotstack_hf  # noqa: E402
from aotstack.integrations.hf_folder import generate_text  # noqa: E402
from tests.hf_folders import PROMPT, TEXT, export_hf, greedy_reference, saved, tokenizer  # noqa: E402

NEW_TOKENS = 12
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}the {% endif %}")


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT, num_key_value_heads=2)).eval()
    root = tmp_path_factory.mktemp("llama")
    export_hf(str(saved(model, root / "model")), "-o", str(root / "out"), "--engines", "aoti", "--max-cache-len", "40")
    return model, root / "out"


@pytest.fixture(scope="module")
def exported(llama_export) -> ExportedModel:
    return ExportedModel.from_pretrained(llama_export[1])


def sampled_reference(model: torch.nn.Module, ids: list[int], seed: int, **settings) -> list[int]:
    """transformers' own sampling ``generate`` after ``torch.manual_seed(seed)``: the new tokens."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=True, **settings)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("settings", [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 20},
    {"top_p": 0.8, "repetition_penalty": 1.3},
], ids=["temperature", "top-k", "top-p+repetition"])
def test_a_seeded_sample_is_transformers_sample(llama_export, exported, settings):
    model, _ = llama_export
    ids = tokenizer()(PROMPT)["input_ids"]
    samples = {seed: aotstack_hf.generate(exported, ids, NEW_TOKENS, seed=seed, **settings) for seed in (0, 1)}
    for seed, tokens in samples.items():
        assert tokens == sampled_reference(model, ids, seed, **settings)
    assert samples[0] != samples[1], "another seed samples other tokens"
    assert samples[0] != greedy_reference(model, ids, NEW_TOKENS)


def test_the_command_line_samples_with_a_seed_and_streams(llama_export, capsys):
    model, out = llama_export
    ids = tokenizer()(PROMPT)["input_ids"]
    expected = tokenizer().decode(sampled_reference(model, ids, 5, temperature=0.9, top_k=30),
                                  skip_special_tokens=True)
    flags = ["--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0.9", "--top-k", "30",
             "--seed", "5"]
    capsys.readouterr()
    assert main(["generate", str(out), *flags]) == 0
    assert capsys.readouterr().out.strip() == expected
    assert main(["generate", str(out), *flags, "--no-stream"]) == 0
    assert capsys.readouterr().out.strip() == expected
    # --temperature 0 and --greedy are greedy, whatever the other flags say.
    greedy = tokenizer().decode(greedy_reference(model, ids, NEW_TOKENS), skip_special_tokens=True)
    for flag in (["--temperature", "0"], ["--greedy", "--repetition-penalty", "1.0"]):
        assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), *flag]) == 0
        assert capsys.readouterr().out.strip() == greedy


def test_generate_follows_the_exports_generation_config(llama_export, tmp_path, capsys):
    """A folder whose generation_config.json asks for sampling samples without a flag, and stops at its eos."""
    model, out = llama_export
    folder = tmp_path / "sampling"
    shutil.copytree(out, folder)
    settings = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **settings, "max_new_tokens": NEW_TOKENS}))
    ids = tokenizer()(PROMPT)["input_ids"]
    expected = sampled_reference(model, ids, 3, temperature=0.8, top_p=0.9)

    result = generate_text(folder, PROMPT, seed=3)
    assert result.tokens == expected, "max_new_tokens and sampling come from the folder's generation config"
    # An eos token given by id ends the text after it, as transformers' eos_token_id does.
    stop = expected[3]
    result = generate_text(folder, PROMPT, seed=3, eos=[stop])
    assert result.tokens == expected[:expected.index(stop) + 1]
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", PROMPT, "--seed", "3", "--eos", f"{stop},2"]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(result.tokens, skip_special_tokens=True)


def test_streaming_gives_each_token_as_it_comes(llama_export, exported):
    model, out = llama_export
    ids = tokenizer()(PROMPT)["input_ids"]
    stream = aotstack_hf.stream(exported, ids, NEW_TOKENS, seed=2, temperature=0.9)
    first = next(stream)  # a token is there before the rest is generated
    assert [first, *stream] == aotstack_hf.generate(exported, ids, NEW_TOKENS, seed=2, temperature=0.9)

    pieces: list[str] = []
    result = generate_text(out, PROMPT, NEW_TOKENS, on_text=pieces.append)
    words = [token for token in result.tokens if token not in tokenizer().all_special_ids]
    assert len(pieces) == len(words), "a word-level tokenizer adds text with every word"
    assert "".join(pieces) == result.text == tokenizer().decode(greedy_reference(model, ids, NEW_TOKENS),
                                                                skip_special_tokens=True)


def with_chat_template(out: Path, folder: Path) -> Path:
    shutil.copytree(out, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def test_chat_prompts_go_through_the_chat_template(llama_export, tmp_path, capsys):
    model, out = llama_export
    folder = with_chat_template(out, tmp_path / "chat")
    chat_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "cat", "content": "the dog ran"}, {"role": "dog", "content": "to the park"}]
    ids = chat_tokenizer(chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert ids[-1] == chat_tokenizer.convert_tokens_to_ids("the"), "the template's generation prompt is there"
    expected = tokenizer().decode(greedy_reference(model, ids, NEW_TOKENS), skip_special_tokens=True)

    (tmp_path / "messages.json").write_text(json.dumps(messages))
    capsys.readouterr()
    assert main(["generate", str(folder), "--messages", str(tmp_path / "messages.json"), "--greedy",
                 "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == expected
    # --chat makes the prompt one user message.
    one = [{"role": "user", "content": "the dog ran"}]
    ids = chat_tokenizer(chat_tokenizer.apply_chat_template(one, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    result = generate_text(folder, "the dog ran", NEW_TOKENS, chat=True, do_sample=False)
    assert result.tokens == greedy_reference(model, ids, NEW_TOKENS)


def test_chat_errors_name_what_is_wrong(llama_export, tmp_path, capsys):
    _, out = llama_export
    with pytest.raises(ModelFolderError, match="has no chat template"):
        generate_text(out, "the dog", 4, chat=True)
    folder = with_chat_template(out, tmp_path / "chat")
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "user", "text": "hi"}]))
    assert main(["generate", str(folder), "--messages", str(tmp_path / "bad.json")]) == 1
    assert "bad.json[0] must be an object with a string role and a string content" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["generate", str(folder), "--messages", str(tmp_path / "bad.json")]) == 1
    assert "cannot read messages from" in capsys.readouterr().err


def test_a_left_padded_batch_gives_each_row_its_own_tokens(llama_export, exported):
    model, _ = llama_export
    rows = [tokenizer()(PROMPT)["input_ids"], tokenizer()("a dog ran to the park")["input_ids"]]
    alone = [greedy_reference(model, row, NEW_TOKENS) for row in rows]
    stop = alone[0][3]  # row 0 ends early at this token; row 1 goes on unless it meets it too
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])

    got = aotstack_hf.generate(exported, ids, NEW_TOKENS, attention_mask=mask, eos=[stop])
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=stop, pad_token_id=0)[:, width:].tolist()
    want = [row[:row.index(stop) + 1] if stop in row else row for row in batched]
    assert got == want
    assert len(got[0]) == 4 and len(got[1]) > 4, "each row stops at its own eos"


@pytest.mark.parametrize(("settings", "message"), [
    ({"temperature": -1.0}, "temperature must be 0 .greedy. or more, got -1.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -3, "repetition_penalty": 0.0}, "top_k must be 0 .off. or more, got -3; repetition_penalty must be"),
    # A processor's output the export does not take (Aria's pixel_mask), or a misspelt setting.
    ({"pixel_mask": torch.ones(1, 8, 8), "temprature": 0.5}, "unknown argument.s. pixel_mask, temprature: generation "
     "takes a prompt's input_ids"),
])
def test_bad_settings_are_refused_by_name(exported, settings, message):
    with pytest.raises(aotstack.GenerationError, match=message):
        aotstack_hf.generate(exported, [4, 5, 6], 4, **settings)


def test_the_runner_refuses_a_prompt_input_it_does_not_know_or_whose_export_takes_none(exported):
    """The runner's own ``stream`` and ``generate`` name what they refuse, as the module's functions do."""
    runner = aotstack_hf.runner_of(exported)
    config = aotstack_hf.generation_config_of(exported, max_new_tokens=2)
    with pytest.raises(aotstack.GenerationError, match="unknown input.s. pixel_mask: a prompt takes pixel_values, "):
        list(runner.stream([4, 5, 6], config, pixel_mask=torch.ones(1, 8, 8)))
    with pytest.raises(aotstack.GenerationError, match="this export takes no images"):
        runner.generate([4, 5, 6], config, pixel_values=torch.zeros(1, 3, 8, 8))
    with pytest.raises(aotstack.GenerationError, match="images and audio are taken with one prompt at a time"):
        runner.generate([[4, 5], [6, 7]], config, input_features=torch.zeros(1, 8, 4))
    with pytest.raises(aotstack.GenerationError, match=r"expected a prompt's token ids; got torch.float32 values"):
        runner.generate(torch.tensor([[4.0, 5.0]]), config)
    with pytest.raises(aotstack.GenerationError, match="generation needs input_ids"):
        aotstack_hf.generate(exported, max_new_tokens=2)
    assert runner.generate([4, 5, 6], config, pixel_values=None) == aotstack_hf.generate(exported, [4, 5, 6], 2)


def test_bad_batches_and_flags_are_refused(llama_export, exported, capsys):
    ids = torch.tensor([[4, 5, 6], [7, 8, 9]])
    with pytest.raises(aotstack.GenerationError, match="row 1 of attention_mask is not left padding"):
        aotstack_hf.generate(exported, ids, 4, attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]))
    with pytest.raises(aotstack.GenerationError, match=r"attention_mask has shape \(2, 2\)"):
        aotstack_hf.generate(exported, ids, 4, attention_mask=torch.ones(2, 2, dtype=torch.long))
    out = str(llama_export[1])
    assert main(["generate", out, "--prompt", "the", "--greedy", "--temperature", "0.5"]) == 1
    assert "--greedy picks the likeliest token" in capsys.readouterr().err
    assert main(["generate", out]) == 1
    needs = "generate needs --prompt TEXT, --messages FILE.json, --audio FILE.wav or --image FILE"
    assert needs in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", out, "--prompt", "the", "--eos", "x"])
    assert "expected token ids like 2 or 2,32000" in capsys.readouterr().err


def test_warpers_on_the_kept_tokens_give_the_scores_of_the_whole_vocabulary():
    """Top-p, min-p and typical-p after top-k, run on the kept tokens only: the scores transformers' give."""
    from transformers import generation as gen

    from aotstack.integrations.decoding import OnKeptTokens

    generator = torch.Generator().manual_seed(0)
    for vocabulary, kept, spread in ((100, 1, 1.0), (5000, 50, 3.0), (32000, 40, 0.2)):
        scores = gen.TopKLogitsWarper(kept)(None, torch.randn(1, vocabulary, generator=generator) * spread)
        for warper in (gen.TopPLogitsWarper(0.9), gen.MinPLogitsWarper(0.1), gen.TypicalLogitsWarper(0.8)):
            assert torch.equal(OnKeptTokens(warper)(None, scores.clone()), warper(None, scores.clone()))


def test_an_unseeded_sample_draws_from_the_kept_tokens_distribution():
    from aotstack.integrations.decoding import TokenChooser, generation_settings

    scores = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-4.0] * 11])
    chooser = TokenChooser(generation_settings(temperature=1.0, top_k=5), prompt_length=1)
    torch.manual_seed(0)
    drawn = torch.tensor([chooser.next_token([1], scores) for _ in range(20000)])
    assert int(drawn.max()) < 5, "only the top 5 tokens are drawn"
    frequencies = torch.bincount(drawn, minlength=5).float() / len(drawn)
    torch.testing.assert_close(frequencies, torch.softmax(scores[0, :5], -1), atol=0.015, rtol=0)


@pytest.mark.parametrize("settings", [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1},
    {"top_k": 20},
    {"temperature": 1.7, "top_k": 400, "top_p": 0.5},
    {"top_p": 0.95, "repetition_penalty": 1.4},  # top-k 50 by default
    {"temperature": 0.6, "top_k": 30, "repetition_penalty": 0.7},  # raises the seen tokens' scores
])
def test_the_short_way_draws_from_the_distribution_transformers_warpers_give(settings):
    """:class:`KeptTokenSampler`'s tokens and probabilities equal those left by transformers' own processors,
    also where the history holds the highest-scoring tokens (the penalty then reorders the top)."""
    from aotstack.integrations.decoding import KeptTokenSampler, generation_settings, logits_processors

    processors = logits_processors(generation_settings(**settings), prompt_length=6)
    sampler = KeptTokenSampler.for_processors(processors)
    assert sampler is not None
    generator = torch.Generator().manual_seed(3)
    for vocabulary, repeated in ((64, "random"), (5000, "random"), (5000, "top"), (5000, "below the top")):
        logits = torch.randn(1, vocabulary, generator=generator) * 3
        history = torch.randint(0, vocabulary, (1, 6), generator=generator)
        ranked = logits.topk(min(sampler.top_k * 6, vocabulary)).indices
        if repeated == "top":  # three in four of the top 4k: more than the top 2k holds
            history = torch.cat([history, ranked[:, :sampler.top_k * 4].reshape(-1, 4)[:, 1:].reshape(1, -1)], 1)
        elif repeated == "below the top":  # ranked 4k to 6k: a penalty under 1 raises them into the top k
            history = torch.cat([history, ranked[:, sampler.top_k * 4:]], dim=1)
        scores = logits
        for processor in processors:
            scores = processor(history, scores)
        expected = torch.softmax(scores[0], dim=-1)
        tokens, probabilities = sampler.distribution(history[0].tolist(), logits)
        assert probabilities == sorted(probabilities, reverse=True)
        got = torch.zeros(vocabulary).index_put_((torch.tensor(tokens),), torch.tensor(probabilities))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # Settings it does not cover take the general way.
    assert KeptTokenSampler.for_processors(logits_processors(generation_settings(top_k=0, temperature=0.7), 6)) is None
    assert KeptTokenSampler.for_processors(logits_processors(
        generation_settings(generation_settings(temperature=0.7), max_new_tokens=4), 6)) is not None
