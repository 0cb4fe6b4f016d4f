"""Vision-language models whose processor cuts an image into a grid of patches: Qwen2-VL, Qwen2.5-VL, Qwen3-VL.

An export takes images of one size (its grid is fixed; the vision tower's grid-derived inputs are
computed once), places an image's tokens by row and column inside ``prefill_images`` (multimodal
rotary positions) and keeps the shift that leaves on later positions in a buffer ``decode`` adds.
Tiny models with random weights; pixel values are rows of patches, as the processor makes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402

import aotstack.integrations.transformers as aot_hf  # noqa: E402
from aotstack.errors import ExportError, GenerationError, ModelFolderError, UnsupportedModelError  # noqa: E402
from aotstack.integrations.decoding import PromptImages, images_prompt_logits  # noqa: E402
from aotstack.integrations.generation import grid_positions, sample_image_size  # noqa: E402
from aotstack.integrations.hf_folder import grid_image_size  # noqa: E402
from tests.hf_folders import VOCAB  # noqa: E402

IMAGE, VIDEO, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
SIDE, PATCH, MERGE = 56, 14, 2
# Qwen2.5-VL's windows (56 pixels here) cut a 112-pixel image into four: its tower attends within each.
WINDOWED = (1, 112 // PATCH, 112 // PATCH)
PATCH_VALUES = 3 * 2 * PATCH * PATCH  # channels, two frames (a still image is repeated), a patch's pixels
TOKENS = (SIDE // PATCH // MERGE) ** 2
NEW_TOKENS = 8
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256}
VISION = {"depth": 2, "hidden_size": 32, "embed_dim": 32, "intermediate_size": 64, "num_heads": 4,
          "out_hidden_size": 32, "patch_size": PATCH, "spatial_merge_size": MERGE, "window_size": 56,
          "fullatt_block_indexes": [1], "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 64}


def qwen_vl(model_type: str) -> torch.nn.Module:
    """A tiny model of ``model_type`` (qwen2_vl, qwen2_5_vl, qwen3_vl, ...): its default config, shrunk."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type)
    text = config.text_config
    for name, value in TEXT.items():
        setattr(text, name, value)
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[: TEXT["num_hidden_layers"]]
    # The rotary halves of a head (4) split over time, height and width.
    text.rope_parameters = {**(text.rope_parameters or {}), "mrope_section": [2, 1, 1]}
    for name, value in VISION.items():
        if hasattr(config.vision_config, name):
            setattr(config.vision_config, name, value)
    config.image_token_id, config.video_token_id = IMAGE, VIDEO
    config.vision_start_token_id, config.vision_end_token_id = START, END
    return transformers.AutoModelForImageTextToText.from_config(config).eval()


def image_prompt(images: int, seed: int = 0, grid: tuple[int, int, int] = (1, SIDE // PATCH, SIDE // PATCH)) -> dict:
    """What the processor makes for a prompt with ``images`` images: each between its start and end tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2] // MERGE**2
    ids = [1, 5]
    for _ in range(images):
        ids += [START] + [IMAGE] * tokens + [END, 9]
    ids = torch.tensor([ids + [7, 8]])
    return {"input_ids": ids, "pixel_values": torch.randn(images * grid[0] * grid[1] * grid[2], PATCH_VALUES,
                                                          generator=generator),
            "image_grid_thw": torch.tensor([grid] * images), "mm_token_type_ids": (ids == IMAGE).int()}


def transformers_tokens(model: torch.nn.Module, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def exported(model: torch.nn.Module, engines: str, folder: Path, side: int = SIDE) -> ExportedModel:
    sample = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 3, side, side)}
    export = aot_hf.AotstackExporter().export_for_generation(
        model, sample, aot_hf.AotstackConfig(engines=engines, max_cache_len=64, check=True))
    export.save_pretrained(folder)
    return ExportedModel.from_pretrained(folder)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_an_images_tokens_are_placed_as_the_models_own_rotary_index_places_them(model_type: str) -> None:
    model = qwen_vl(model_type)
    # A square image, two images of a wider grid (two rows of three tokens), text alone.
    for images, grid in ((1, (1, 4, 4)), (2, (1, 4, 6)), (0, (1, 4, 4))):
        inputs = image_prompt(images, grid=grid)
        ids = inputs["input_ids"]
        want, shift = model.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"] if images else None)
        got = grid_positions(ids[0] == IMAGE, (1, grid[1] // MERGE, grid[2] // MERGE))
        assert torch.equal(got, want)
        assert int(got.max()) + 1 - ids.shape[1] == int(shift)


@pytest.fixture(scope="module")
def qwen2_5_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, ExportedModel]:
    """Qwen2.5-VL (attention within windows in its vision tower, a bias-free 3-D convolution) with ONNX Runtime
    first, for 112-pixel images: four windows of 2x2 tokens each."""
    model = qwen_vl("qwen2_5_vl")
    return model, exported(model, "ort,aoti", tmp_path_factory.mktemp("qwen2_5_vl"), side=112)


@pytest.mark.parametrize("images", [1, 2])
def test_qwen2_5_vl_generates_as_transformers_does(
    qwen2_5_export: tuple[torch.nn.Module, ExportedModel], images: int
) -> None:
    model, loaded = qwen2_5_export
    assert aot_hf.runner_of(loaded).metadata.export_config["image_grid_thw"] == list(WINDOWED)
    inputs = image_prompt(images, seed=images, grid=WINDOWED)
    assert aot_hf.generate(loaded, **inputs, max_new_tokens=NEW_TOKENS, do_sample=False) == transformers_tokens(
        model, inputs)
    # decode adds the shift the images left on the positions (an image of 4x4 tokens spans 4 positions, not 16):
    # its logits after the prompt are the model's own over the prompt and that token.
    program, ids = aot_hf.runner_of(loaded).program, inputs["input_ids"]
    images_prompt_logits(program, ids, PromptImages(inputs["pixel_values"], IMAGE))
    got = program.decode(torch.tensor([[11]]), torch.tensor([ids.shape[1]]))[0]
    longer = torch.cat([ids, torch.tensor([[11]])], dim=1)
    with torch.no_grad():
        want = model(**{**inputs, "input_ids": longer, "mm_token_type_ids": (longer == IMAGE).int()}).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # A prompt of text alone after one with images: prefill sets the shift back to 0.
    text = {"input_ids": inputs["input_ids"][:, :2]}
    assert aot_hf.generate(loaded, **text, max_new_tokens=NEW_TOKENS, do_sample=False) == transformers_tokens(
        model, text)


def test_images_of_another_grid_or_not_whole_are_refused_with_the_size_the_export_takes(
    qwen2_5_export: tuple[torch.nn.Module, ExportedModel],
) -> None:
    _, loaded = qwen2_5_export
    wide = image_prompt(1, grid=(1, 8, 12))
    with pytest.raises(GenerationError, match=r"images of 112x112 pixels only \(grid \[1, 8, 8\]\)"):
        aot_hf.generate(loaded, **wide, max_new_tokens=2)
    cut = image_prompt(1, grid=WINDOWED)
    cut["pixel_values"] = cut["pixel_values"][:-1]
    with pytest.raises(GenerationError, match="not whole images of 64 patches of 1176 values"):
        aot_hf.generate(loaded, cut["input_ids"], pixel_values=cut["pixel_values"], max_new_tokens=2)


def test_qwen3_vls_inner_image_features_reach_its_decoder_with_openvino_first(tmp_path: Path) -> None:
    model = qwen_vl("qwen3_vl")
    layers = len(model.config.vision_config.deepstack_visual_indexes)
    assert layers == 2
    loaded = exported(model, "ov,aoti", tmp_path)
    program = aot_hf.runner_of(loaded).program
    features = program.encode_images(image_prompt(1)["pixel_values"])
    # Each image token's row holds its features and, beside them, those of the tower's inner layers.
    assert features.shape == (TOKENS, 32 * (1 + layers))
    for images in (1, 2):
        inputs = image_prompt(images, seed=images)
        assert aot_hf.generate(loaded, **inputs, max_new_tokens=NEW_TOKENS, do_sample=False) == transformers_tokens(
            model, inputs)
        got = images_prompt_logits(program, inputs["input_ids"], PromptImages(inputs["pixel_values"], IMAGE))[0]
        with torch.no_grad():
            torch.testing.assert_close(got, model(**inputs).logits[0, -1], atol=1e-5, rtol=1e-4)


def test_a_vision_language_model_with_a_recurrent_decoder_is_refused_with_why() -> None:
    sample = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 3, SIDE, SIDE)}
    with pytest.raises(UnsupportedModelError, match="keeps recurrent or convolution states"):
        aot_hf.AotstackExporter().export_for_generation(qwen_vl("qwen3_5"), sample, aot_hf.AotstackConfig())


def test_the_image_size_of_a_grid_processor_is_chosen_within_its_bounds() -> None:
    qwen = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
            "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}}
    assert grid_image_size(qwen, None) == (448, 448)
    assert grid_image_size(qwen, 50) == (56, 56)  # whole tokens of 28 pixels
    assert grid_image_size({**qwen, "size": {"shortest_edge": 3136, "longest_edge": 112 * 112}}, 448) == (112, 112)
    assert grid_image_size({**qwen, "min_pixels": 200 * 200}, 56) == (224, 224)
    clip = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}
    assert grid_image_size(clip, None) is None
    with pytest.raises(ModelFolderError, match="--image-size is for a processor that keeps an image's size"):
        grid_image_size(clip, 336)
    with pytest.raises(ExportError, match="rows of patches: give the processor's image_grid_thw"):
        sample_image_size(qwen_vl("qwen2_vl"), torch.zeros(16, PATCH_VALUES))


def test_a_qwen2_vl_folder_exports_through_the_cli_at_the_size_its_processor_allows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Image = pytest.importorskip("PIL.Image")  # noqa: N806 - the module, named as Pillow's users name it
    import json

    import numpy as np

    from aotstack.cli import main
    from tests.hf_folders import export_hf, tokenizer

    folder = tmp_path / "model"
    model = qwen_vl("qwen2_vl")
    model.save_pretrained(folder)
    tokenizer("<|image_pad|>").save_pretrained(folder)
    # At most 112x112 pixels: the default 448 is brought within the processor's bounds.
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE, max_pixels=112 * 112)
    images.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "aoti", "--max-cache-len", "96")
    settings = json.loads((tmp_path / "out" / "export.json").read_text())["components"]["model"]["metadata"]
    assert settings["export_config"]["image_size"] == [112, 112]
    assert settings["export_config"]["image_grid_thw"] == [1, 8, 8]

    picture = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(picture)
    command = ["generate", str(tmp_path / "out"), "--image", str(picture), "--prompt", "the cat sat", "--greedy",
               "--max-new-tokens", str(NEW_TOKENS)]
    try:
        processor = transformers.AutoProcessor.from_pretrained(folder)
    except ImportError:  # Qwen2-VL's processor builds a video processor, which needs torchvision
        assert main(command) == 1
        assert "needs a library this environment lacks" in capsys.readouterr().err
        return
    # The picture (70x40) is resized to the export's 112x112 before the processor, which keeps that size.
    inputs = processor(images=Image.open(picture).convert("RGB").resize((112, 112), Image.Resampling.BICUBIC),
                       text="<|image_pad|>the cat sat", return_tensors="pt")
    expected = processor.tokenizer.decode(transformers_tokens(model, dict(inputs)), skip_special_tokens=True)
    assert main(command) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
