"""Vision-language models (``image-text-to-text``): a prompt about an image, exported, generated as transformers does.

The export holds ``prefill`` and ``decode`` for text alone, plus ``encode_images`` (one image a
call) and ``prefill_images`` (a prompt whose image tokens take those features), over one set of
weights and one cache. Tiny LLaVA and Gemma 3 models with random weights; the LLaVA folder has a
real processor (CLIP's image processor, Pillow) so ``aotstack generate --image`` runs the user's path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.exporters")
PIL = pytest.importorskip("PIL.Image")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402

import aotstack.integrations.transformers as aot_hf  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import GenerationError, UnsupportedModelError  # noqa: E402
from aotstack.integrations.hf_folder import generate_text, infer_task  # noqa: E402
from tests.hf_folders import TEXT, VOCAB, export_hf, tokenizer  # noqa: E402

IMAGE_TOKEN = VOCAB - 1
SIDE, PATCH = 32, 8
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "image_size": SIDE, "patch_size": PATCH}
TEXT_CONFIG = {**TEXT, "num_key_value_heads": 2, "head_dim": 8}
NEW_TOKENS = 8


def llava() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**VISION),
                                      text_config=transformers.LlamaConfig(**TEXT_CONFIG),
                                      image_token_id=IMAGE_TOKEN, vision_feature_layer=-2)
    return transformers.LlavaForConditionalGeneration(config).eval()


def gemma3() -> torch.nn.Module:
    torch.manual_seed(1)
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(**VISION),
        text_config=transformers.Gemma3TextConfig(**TEXT_CONFIG, sliding_window=16),
        mm_tokens_per_image=4, image_token_id=IMAGE_TOKEN, boi_token_id=VOCAB - 2, eoi_token_id=VOCAB - 3,
    )
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def llava_processor() -> transformers.ProcessorMixin:
    images = transformers.CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer("<image>"), patch_size=PATCH,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                       image_token="<image>")


def picture(path: Path, seed: int, size: tuple[int, int] = (40, 52)) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    PIL.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def llava_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A LLaVA folder as ``save_pretrained`` writes it, with its processor, exported by ``aotstack export-hf``."""
    root = tmp_path_factory.mktemp("llava")
    model = llava()
    model.save_pretrained(root / "model")
    llava_processor().save_pretrained(root / "model")
    export_hf(str(root / "model"), "-o", str(root / "out"), "--engines", "aoti", "--max-cache-len", "48")
    return model, root / "out"


def test_the_task_of_a_vision_language_checkpoint_is_read_from_its_config() -> None:
    for model in (llava(), gemma3()):
        model.config.architectures = [type(model).__name__]  # as save_pretrained writes it
        # Gemma 3's class is a causal LM to transformers too; its checkpoint ships a vision tower, exported with it.
        assert infer_task(model.config) == "image-text-to-text"


def test_a_prompt_about_an_image_generates_through_the_cli_as_transformers_does(
    llava_export: tuple[torch.nn.Module, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, out = llava_export
    processor = llava_processor()
    image = picture(tmp_path / "cat.png", seed=0)
    inputs = processor(images=PIL.open(image).convert("RGB"), text="<image>the cat sat", return_tensors="pt")
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs.input_ids.shape[1]:]
    expected = processor.tokenizer.decode(want.tolist(), skip_special_tokens=True)
    assert expected.strip()

    assert main(["generate", str(out), "--image", str(image), "--prompt", "the cat sat", "--greedy",
                 "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()

    # Text alone still goes through prefill, as before.
    result = generate_text(out, "the cat sat", NEW_TOKENS, do_sample=False)
    ids = processor.tokenizer("the cat sat", return_tensors="pt").input_ids
    with torch.no_grad():
        text_only = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result.tokens == text_only


def test_the_files_image_prompt_logits_match_eager_for_one_and_two_images(
    llava_export: tuple[torch.nn.Module, Path],
) -> None:
    model, out = llava_export
    runner = aot_hf.runner_of(ExportedModel.from_pretrained(out))
    assert set(runner.methods) == {"prefill", "decode", "encode_images", "prefill_images"}
    for count in (1, 2):
        pixels = torch.randn(count, 3, SIDE, SIDE)
        ids = torch.tensor([[1, 4] + [IMAGE_TOKEN] * (16 * count) + [5, 6]])
        with torch.no_grad():
            want = model(input_ids=ids, pixel_values=pixels).logits[0, -1]
            features = torch.cat([runner.program.encode_images(pixels[i:i + 1]) for i in range(count)])
            got = runner.program.prefill_images(ids, features)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_prompt_whose_image_tokens_do_not_match_its_images_is_refused(
    llava_export: tuple[torch.nn.Module, Path],
) -> None:
    _, out = llava_export
    loaded = ExportedModel.from_pretrained(out)
    ids = torch.tensor([[1, 4] + [IMAGE_TOKEN] * 16 + [5]])
    with pytest.raises(GenerationError, match="holds 16 image tokens .* give 32 rows"):
        aot_hf.generate(loaded, ids, 4, pixel_values=torch.randn(2, 3, SIDE, SIDE))


def test_gemma3s_attention_among_an_images_tokens_is_kept_with_an_engine_first(tmp_path: Path) -> None:
    """Gemma 3 lets an image's tokens attend to each other both ways (its processor's ``token_type_ids``);
    ``prefill_images`` takes them, made from the prompt when the caller has none. OpenVINO first."""
    model = gemma3()
    exporter = aot_hf.AotstackExporter()
    exported = exporter.export_for_generation(
        model, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 3, SIDE, SIDE)},
        aot_hf.AotstackConfig(engines="ov,aoti", max_cache_len=32, check=True),
    )
    # export-hf --check: every method was run from the file against eager, on its example inputs.
    assert exporter.check_result.passed
    assert {output.method for output in exporter.check_result.outputs} == {
        "prefill", "decode", "encode_images", "prefill_images"}
    exported.save_pretrained(tmp_path / "gemma3")
    loaded = ExportedModel.from_pretrained(tmp_path / "gemma3")
    program = aot_hf.runner_of(loaded).program
    for count in (1, 2):
        pixels = torch.randn(count, 3, SIDE, SIDE)
        ids = torch.tensor([[1, 4, VOCAB - 2] + [IMAGE_TOKEN] * (4 * count) + [VOCAB - 3, 5, 6]])
        types = (ids == IMAGE_TOKEN).long()
        with torch.no_grad():
            want = model(input_ids=ids, pixel_values=pixels, token_type_ids=types).logits[0, -1]
            causal = model(input_ids=ids, pixel_values=pixels).logits[0, -1]
            features = torch.cat([program.encode_images(pixels[i:i + 1]) for i in range(count)])
            got = program.prefill_images(ids, features, types)[0]
        assert (want - causal).abs().max() > 1e-4  # the two attentions differ here, so the check can fail
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            tokens = model.generate(ids, pixel_values=pixels, token_type_ids=types, max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        assert aot_hf.generate(loaded, ids, NEW_TOKENS, pixel_values=pixels, token_type_ids=types,
                               do_sample=False) == tokens
        assert aot_hf.generate(loaded, ids, NEW_TOKENS, pixel_values=pixels, do_sample=False) == tokens


@pytest.mark.parametrize("kind", ["paligemma", "blip_2"])
def test_a_vision_language_model_this_export_cannot_follow_is_refused_with_why(kind: str) -> None:
    """PaliGemma attends both ways over its prompt only on a call without a cache; BLIP-2's forward cannot run on
    text alone, as decode does. Each is refused before anything is compiled, naming why."""
    torch.manual_seed(0)
    sample = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 3, SIDE, SIDE)}
    if kind == "paligemma":
        config = transformers.PaliGemmaConfig(
            vision_config=transformers.SiglipVisionConfig(**VISION, projection_dim=32),
            text_config=transformers.GemmaConfig(**TEXT_CONFIG), image_token_id=IMAGE_TOKEN, projection_dim=32)
        model, why = transformers.PaliGemmaForConditionalGeneration(config), "does not follow"
    else:
        config = transformers.Blip2Config(
            vision_config=VISION, text_config={**TEXT_CONFIG, "model_type": "opt", "ffn_dim": 64},
            qformer_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                            "intermediate_size": 64, "encoder_hidden_size": 32},
            num_query_tokens=4, image_token_index=IMAGE_TOKEN)
        model, why = transformers.Blip2ForConditionalGeneration(config), "forward requires pixel_values on every call"
    with pytest.raises(UnsupportedModelError, match=why):
        aot_hf.AotstackExporter().export_for_generation(
            model.eval(), sample, aot_hf.AotstackConfig(engines="aoti", max_cache_len=64))


def test_a_folder_of_a_model_that_cuts_images_into_tiles_generates_through_the_cli_as_transformers_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LLaVA-NeXT: its processor cuts an image into tiles as the image's size decides, and the model packs their
    features by that size, branching on numpy's product of a shape (which the export of encode_images must trace).
    The folder export takes square images of one tile's side by default; ``generate --image`` resizes a picture to
    it, and the text is transformers' own for the resized picture."""
    torch.manual_seed(0)
    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION), text_config=transformers.LlamaConfig(**TEXT_CONFIG),
        image_token_id=IMAGE_TOKEN, image_grid_pinpoints=[[SIDE, SIDE], [SIDE, 2 * SIDE]], vision_feature_layer=-2)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    images = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE},
        image_grid_pinpoints=[[SIDE, SIDE], [SIDE, 2 * SIDE]])
    processor = transformers.LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer("<image>"), patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token="<image>")
    processor.save_pretrained(folder)
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "aoti", "--max-cache-len", "64")
    settings = json.loads((tmp_path / "out" / "export.json").read_text())["components"]["model"]["metadata"]
    assert settings["export_config"]["image_size"] == [SIDE, SIDE]
    capsys.readouterr()  # what export-hf printed

    image = picture(tmp_path / "cat.png", seed=0)
    resized = PIL.open(image).convert("RGB").resize((SIDE, SIDE), PIL.Resampling.BICUBIC)
    inputs = processor(images=resized, text="<image>the cat sat", return_tensors="pt")
    assert inputs.pixel_values.shape[1] == 2  # the whole image and one tile
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs.input_ids.shape[1]:]
        other = model.generate(**{**inputs, "pixel_values": inputs.pixel_values.flip(-1)}, max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, inputs.input_ids.shape[1]:]
    assert want.tolist() != other.tolist()  # the image decides the answer, so the comparison can fail
    assert main(["generate", str(tmp_path / "out"), "--image", str(image), "--prompt", "the cat sat", "--greedy",
                 "--max-new-tokens", str(NEW_TOKENS)]) == 0
    expected = processor.tokenizer.decode(want.tolist(), skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()
    loaded = ExportedModel.from_pretrained(tmp_path / "out")
    program = aot_hf.runner_of(loaded).program
    with torch.no_grad():
        features = program.encode_images(inputs.pixel_values)
        torch.testing.assert_close(program.prefill_images(inputs.input_ids, features)[0],
                                   model(**inputs).logits[0, -1], atol=1e-5, rtol=1e-4)


def llava_onevision() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlavaOnevisionConfig(
        vision_config=transformers.SiglipVisionConfig(**VISION), text_config=transformers.Qwen2Config(**TEXT_CONFIG),
        image_token_id=IMAGE_TOKEN, image_grid_pinpoints=[[SIDE, SIDE]], vision_feature_layer=-1)
    return transformers.LlavaOnevisionForConditionalGeneration(config).eval()


def test_a_model_that_cuts_an_image_into_tiles_by_its_size_generates_as_transformers_does(tmp_path: Path) -> None:
    """LLaVA-OneVision: its processor cuts an image into tiles as its size (``image_sizes``) decides, and the model
    packs their features into one image's rows by that size. The export takes images of the sample's size."""
    model = llava_onevision()
    # An image of 32x32: the whole image and one tile of 32, each 4x4 patches; 36 tokens with the rows' ends.
    pixels, sizes = torch.randn(1, 2, 3, SIDE, SIDE), torch.tensor([[SIDE, SIDE]])
    exported = aot_hf.AotstackExporter().export_for_generation(
        model, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": pixels, "image_sizes": sizes},
        aot_hf.AotstackConfig(engines="aoti", max_cache_len=96))
    exported.save_pretrained(tmp_path / "onevision")
    loaded = ExportedModel.from_pretrained(tmp_path / "onevision")
    assert aot_hf.runner_of(loaded).metadata.export_config["image_size"] == [SIDE, SIDE]

    ids = torch.tensor([[1, 4] + [IMAGE_TOKEN] * 36 + [5, 6]])
    with torch.no_grad():
        want = model.generate(ids, pixel_values=pixels, image_sizes=sizes, max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, ids.shape[1]:].tolist()
    assert aot_hf.generate(loaded, ids, NEW_TOKENS, pixel_values=pixels, image_sizes=sizes, do_sample=False) == want
    program = aot_hf.runner_of(loaded).program
    with torch.no_grad():
        torch.testing.assert_close(program.prefill_images(ids, program.encode_images(pixels))[0],
                                   model(input_ids=ids, pixel_values=pixels, image_sizes=sizes).logits[0, -1],
                                   atol=1e-5, rtol=1e-4)


def test_a_model_whose_vision_tower_reads_each_images_size_generates_as_transformers_does(tmp_path: Path) -> None:
    """Mistral 3 (Pixtral's tower): its processor keeps an image's size and says it in ``image_sizes``, which the
    tower and the projector split features by. The export takes square images of ``--image-size`` (rounded to
    whole tokens, within the processor's longest edge), and refuses others."""
    torch.manual_seed(0)
    config = transformers.Mistral3Config(
        vision_config=transformers.PixtralVisionConfig(**VISION, head_dim=8),
        text_config=transformers.MistralConfig(**TEXT_CONFIG), image_token_id=IMAGE_TOKEN, spatial_merge_size=2)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer("[IMG]").save_pretrained(folder)
    # Its processor needs torchvision, which these tests lack; its settings are what the export reads.
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 48}, "patch_size": PATCH}))
    # 40 pixels: 2.5 tokens of 16 (patches of 8 merged 2x2) a side, rounded to 2.
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "aoti", "--max-cache-len", "48",
              "--image-size", "40")
    settings = json.loads((tmp_path / "out" / "export.json").read_text())["components"]["model"]["metadata"]
    assert settings["export_config"]["image_size"] == [SIDE, SIDE] and settings["export_config"]["image_size_kept"]
    loaded = ExportedModel.from_pretrained(tmp_path / "out")

    sizes = torch.tensor([[SIDE, SIDE]])
    pixels, ids = torch.randn(1, 3, SIDE, SIDE), torch.tensor([[1, 4] + [IMAGE_TOKEN] * 4 + [5, 6]])
    program = aot_hf.runner_of(loaded).program
    with torch.no_grad():
        for image in (pixels, pixels.flip(-1)):
            logits = model(input_ids=ids, pixel_values=image, image_sizes=sizes).logits[0, -1]
            torch.testing.assert_close(program.prefill_images(ids, program.encode_images(image))[0], logits,
                                       atol=1e-5, rtol=1e-4)
        assert (logits - model(input_ids=ids, pixel_values=pixels, image_sizes=sizes).logits[0, -1]).abs().max() > 1e-4
        want = model.generate(ids, pixel_values=pixels, image_sizes=sizes, max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, ids.shape[1]:].tolist()
    assert aot_hf.generate(loaded, ids, NEW_TOKENS, pixel_values=pixels, image_sizes=sizes, do_sample=False) == want
    with pytest.raises(GenerationError, match=r"sizes \[\[32, 24\]\].*32x32 pixels only"):
        aot_hf.generate(loaded, ids, NEW_TOKENS, pixel_values=pixels, image_sizes=torch.tensor([[SIDE, 24]]))


def test_an_image_that_leaves_no_room_in_the_cache_is_refused_before_compiling() -> None:
    with pytest.raises(UnsupportedModelError, match="an image takes 16 tokens.*larger max_cache_len"):
        aot_hf.AotstackExporter().export_for_generation(
            llava(), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 3, SIDE, SIDE)},
            aot_hf.AotstackConfig(engines="aoti", max_cache_len=18),
        )


def test_export_checks_tolerance_is_the_one_given() -> None:
    """A quantized model's engines round its activations each their own way: ``--atol`` and ``--rtol`` of
    ``export-hf --check`` reach the check."""
    from aotstack.integrations.transformers import check_of

    assert check_of(aot_hf.AotstackConfig()) is False
    given = check_of(aot_hf.AotstackConfig(check=True, check_atol=5e-3))
    assert (given.atol, given.rtol) == (5e-3, None)
    assert given.tolerance(torch.float32) == (5e-3, 1e-4)
