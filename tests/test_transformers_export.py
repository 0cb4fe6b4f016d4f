"""aotstack as a ``transformers.exporters`` backend, and ``aotstack export-hf`` / ``generate`` on model folders.

Tiny random models saved with ``save_pretrained``, with a word-level tokenizer built offline; each
folder is exported once per module and shared by its tests. Most lower with AOTInductor alone
(``aoti``); one export measures engines (``auto``).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers.exporters")

import transformers  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402
from transformers.exporters.auto import get_exporter_class  # noqa: E402

import aotstack  # noqa: E402
from aotstack.cli import main  # noqa: E402
from aotstack.errors import ModelFolderError, UnsupportedModelError  # noqa: E402
from aotstack.integrations import transformers as aotstack_hf  # noqa: E402
from aotstack.integrations.hf_folder import export_folder, generate_text  # noqa: E402
from tests.hf_folders import NEW_TOKENS, PROMPT, TEXT, VOCAB, export_hf, greedy_reference, saved, tokenizer  # noqa: E402


def decoder_lm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT, num_key_value_heads=2))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=8))
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**TEXT, num_key_value_heads=2))


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0))


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**TEXT))


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))


@pytest.fixture(scope="module", params=["llama", "qwen3", "phi3"])
def decoder_export(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = decoder_lm(request.param)
    root = tmp_path_factory.mktemp(request.param)
    folder = saved(model, root / "model")
    export_hf(str(folder), "-o", str(root / "out"), "--engines", "aoti", "--max-cache-len", "32")
    return model.eval(), root / "out"


def test_export_hf_then_generate_gives_transformers_greedy_text(decoder_export, capsys):
    model, out = decoder_export
    assert sorted(path.name for path in out.iterdir()) == [
        "config.json", "export.json", "generation_config.json", "model.pt2", "tokenizer.json", "tokenizer_config.json"]
    ids = tokenizer()(PROMPT)["input_ids"]
    expected = greedy_reference(model, ids)

    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    assert "tokens/s" in printed.err

    # The same file through transformers' own loader: one component, both stages in it.
    exported = ExportedModel.from_pretrained(out)
    assert list(exported.components) == ["model"]
    assert set(exported.runners["model"].methods) == {"prefill", "decode"}
    assert aotstack_hf.generate(exported, ids, NEW_TOKENS) == expected


def test_one_new_token_is_reported_without_a_rate(decoder_export, capsys):
    out = decoder_export[1]
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "1", "--greedy"]) == 0
    err = capsys.readouterr().err
    assert "1 token after a " in err and "first token" in err
    assert "tokens/s" not in err, "one token has no decoding rate"


def test_prefill_and_decode_share_each_weight_in_one_file(decoder_export):
    from aotstack.format.archive import read_manifest

    manifest = read_manifest(decoder_export[1] / "model.pt2")
    assert set(manifest.methods) == {"prefill", "decode"}
    blob_of: dict[str, set[str]] = {}
    readers: dict[str, set[str]] = {}
    for name, method in manifest.methods.items():
        named = dict(method.weights.items())
        named.update({local.removeprefix("weight:"): key for delegate in method.delegates
                      for local, key in delegate.named_data.items() if local.startswith("weight:")})
        for fqn, weight in named.items():
            blob_of.setdefault(fqn, set()).add(getattr(weight, "blob", weight))
            readers.setdefault(fqn, set()).add(name)
    assert any(readers[fqn] == {"prefill", "decode"} for fqn in readers), "both methods read the same weights"
    assert all(len(keys) == 1 for keys in blob_of.values()), "a weight both methods read is one blob"


def test_a_prompt_too_long_for_the_cache_is_refused(decoder_export):
    exported = ExportedModel.from_pretrained(decoder_export[1])
    with pytest.raises(aotstack.AotstackError, match="needs 40 cache slots; this export has 32"):
        aotstack_hf.generate(exported, list(range(4, 12)), 32)


def test_encoder_decoder_folder_generates_transformers_greedy_text(tmp_path, capsys):
    model = t5()
    folder = saved(model, tmp_path / "t5")
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "aoti", "--max-cache-len", "32")
    assert "text2text-generation" in capsys.readouterr().out  # inferred from the config
    ids = tokenizer()(PROMPT)["input_ids"]
    expected = greedy_reference(model.eval(), ids)

    assert main(["generate", str(tmp_path / "out"), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    assert aotstack_hf.generate(ExportedModel.from_pretrained(tmp_path / "out"), ids, NEW_TOKENS) == expected

    # A config without a decoder start token (mBART's) starts the decoder from bos, as model.generate does.
    runner = ExportedModel.from_pretrained(tmp_path / "out").runners["model"]
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = NEW_TOKENS, False
    from_seven = list(runner.stream(ids, config, decoder_prompt=[7]))
    config.decoder_start_token_id, config.bos_token_id = None, 7
    assert list(runner.stream(ids, config)) == from_seven != expected


def test_round_trip_through_the_registered_backend_matches_eager(tmp_path):
    model = bert().eval()
    ids = torch.randint(4, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    exporter = get_exporter_class("aotstack")(progress=False)
    assert isinstance(exporter, aotstack_hf.AotstackExporter)
    config = aotstack_hf.AotstackConfig(engines="aoti", dynamic=True)
    exported = exporter.export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, config)
    exported.save_pretrained(tmp_path / "bert")
    assert json.loads((tmp_path / "bert" / "export.json").read_text())["export_format"] == "aotstack"

    loaded = ExportedModel.from_pretrained(tmp_path / "bert")
    other = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    for batch in (ids, other):
        mask = torch.ones_like(batch)
        mask[1, -2:] = 0
        got = loaded(input_ids=batch, attention_mask=mask)
        with torch.no_grad():
            want = model(input_ids=batch, attention_mask=mask)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("architecture", ["llama", "t5"])
def test_auto_times_a_generation_exports_decode_halfway_into_its_cache(architecture, monkeypatch):
    """Exported at position 0, decode reads one cached key in an attention that reads only those filled so far."""
    from aotstack.compile import auto as auto_module

    handed: dict[str, object] = {}

    class Handed(Exception):
        pass

    def lower(program, partitioners, **kwargs):
        handed.update(program=program, plan=partitioners)
        raise Handed

    monkeypatch.setattr(aotstack, "lower", lower)
    exporter = get_exporter_class("aotstack")(progress=False)
    model = t5() if architecture == "t5" else decoder_lm(architecture)
    with pytest.raises(Handed):
        exporter.export_for_generation(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                                       aotstack_hf.AotstackConfig(engines="auto", max_cache_len=32))

    plan = handed["plan"]
    assert isinstance(plan, aotstack.Auto)
    # The example's token (and an encoder-decoder's encoded source), at position 16 rather than 0.
    (*others, position), keywords = plan.inputs["decode"]
    (*example_others, example_position), _ = handed["program"].methods["decode"].example_inputs
    assert position.tolist() == [16] and example_position.tolist() == [0] and keywords == {}
    assert len(others) == len(example_others) and all(a is b for a, b in zip(others, example_others))
    # What auto will time each method on: decode on those inputs, which fit it; the other method on its example.
    timing = auto_module.timing_inputs(handed["program"].methods, plan)
    assert timing["decode"].given and sum(t.given for t in timing.values()) == 1


def test_feature_extraction_folder_with_auto_engines(tmp_path, capsys):
    model = bert().eval()
    export_hf(str(saved(model, tmp_path / "bert")), "-o", str(tmp_path / "out"))  # --engines auto
    assert "feature-extraction" in capsys.readouterr().out
    report = aotstack.file_report(tmp_path / "out" / "model.pt2").to_json()
    assert report["methods"], "the file reports what auto kept"
    ids = torch.randint(4, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    got = ExportedModel.from_pretrained(tmp_path / "out")(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                            token_type_ids=torch.zeros_like(ids))
    with torch.no_grad():
        want = model(input_ids=ids)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_image_classification_folder_matches_eager(tmp_path, capsys):
    model = vit().eval()
    processor = {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32},
                 "do_resize": True, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    export_hf(str(saved(model, tmp_path / "vit", processor)), "-o", str(tmp_path / "out"), "--engines", "aoti")
    assert "image-classification" in capsys.readouterr().out
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    got = ExportedModel.from_pretrained(tmp_path / "out")(pixel_values=pixels)
    with torch.no_grad():
        torch.testing.assert_close(got.logits, model(pixel_values=pixels).logits, rtol=1e-4, atol=1e-5)


def test_a_compile_error_choice_other_than_raise_or_fallback_is_refused_before_any_export():
    with pytest.raises(ValueError, match=r"AotstackConfig.on_compile_error must be one of 'raise', 'fallback', "
                                         r"got 'ignore'"):
        aotstack_hf.AotstackConfig(on_compile_error="ignore")


def test_a_part_an_engine_cannot_compile_is_left_to_the_next_when_asked_and_the_folder_matches_eager(tmp_path, caplog):
    """DeBERTa's disentangled attention: Inductor cannot compile its relative positions over the length (plain
    AOTInductor fails on it too, "Could not guard on data-dependent expression Max(1, u2) >= u2"); with
    --on-compile-error fallback that part runs as plain ATen, at any length."""
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        pytest.skip("torch 2.11's torch.export cannot trace DeBERTa's relative positions (\"Could not extract "
                    "specialized integer from data-dependent expression u0\"); 2.13's can")
    torch.manual_seed(0)
    model = transformers.DebertaModel(transformers.DebertaConfig(
        **TEXT, relative_attention=True, max_relative_positions=4, pos_att_type=["c2p", "p2c"])).eval()
    export_hf(str(saved(model, tmp_path / "deberta")), "-o", str(tmp_path / "out"), "--engines", "aoti",
              "--on-compile-error", "fallback")
    assert "aoti_cpu failed to compile partition" in caplog.text, "the part left to ATen is reported"
    report = aotstack.file_report(tmp_path / "out" / "model.pt2").to_json()
    assert any(share["engine"] == "aten" and share["ops"] for method in report["methods"]
               for share in method["engines"]), report["methods"]
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    for batch, length in ((2, 3), (1, 13)):
        ids = torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))
        got = exported(input_ids=ids, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)


def bert_with_head(task: str) -> torch.nn.Module:
    """A BERT with ``task``'s head, every weight drawn anew: a head that starts near zero would hide an error."""
    from aotstack.integrations.hf_folder import auto_class

    torch.manual_seed(0)
    model = auto_class(task).from_config(transformers.BertConfig(**TEXT)).eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.2)
    return model


@pytest.mark.parametrize(("task", "engines"), [
    ("text-classification", "ort"), ("token-classification", "ov"), ("question-answering", "ort"), ("fill-mask", "ov"),
])
def test_a_fine_tuned_heads_task_is_read_from_its_config_and_its_outputs_match_eager(tmp_path, capsys, task, engines):
    """A sentiment classifier, a tagger, an extractive reader, a masked LM: each keeps its head, at any batch and
    length, padding included (its mask is the tokenizer's)."""
    model = bert_with_head(task)
    export_hf(str(saved(model, tmp_path / "model")), "-o", str(tmp_path / "out"), "--engines", engines)
    assert f"({task}: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    for batch, length in ((3, 5), (1, 11)):
        ids = torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        got = exported(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask)
        names = [name for name, value in want.items() if isinstance(value, torch.Tensor)]
        assert names and names == [name for name in got.keys() if name in names]
        for name in names:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)


def test_a_multiple_choice_head_scores_each_answer_for_any_count_of_questions_answers_and_tokens(tmp_path, capsys):
    """A question paired with each of its answers, ``[batch, choices, length]``, all three dynamic (one answer
    included): a score per answer, padding included."""
    model = bert_with_head("multiple-choice")
    export_hf(str(saved(model, tmp_path / "model")), "-o", str(tmp_path / "out"), "--engines", "ort")
    assert "(multiple-choice: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    for batch, choices, length in ((2, 4, 5), (1, 2, 9), (3, 1, 3)):
        ids = torch.randint(4, VOCAB, (batch, choices, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, -1, -2:] = 0
        got = exported(input_ids=ids, attention_mask=mask).logits
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits
        assert got.shape == (batch, choices)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_head_no_task_covers_is_refused_rather_than_dropped(tmp_path, capsys):
    """A BERT that predicts whether one sentence follows another is not taken for its base model; asked for
    features, it gives them."""
    model = bert_with_head("text-classification")
    folder = saved(transformers.BertForNextSentencePrediction(model.config).eval(), tmp_path / "model")
    with pytest.raises(UnsupportedModelError, match="no task here exports the head of BertForNextSentencePrediction .*"
                                                    "pass --task feature-extraction"):
        export_folder(folder, tmp_path / "out", engines="ort")
    assert_nothing_written(tmp_path)
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "ort", "--task", "feature-extraction")
    ids = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    got = ExportedModel.from_pretrained(tmp_path / "out")(input_ids=ids, attention_mask=torch.ones_like(ids))
    base = transformers.BertModel.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(got.last_hidden_state, base(input_ids=ids).last_hidden_state, rtol=1e-4, atol=1e-4)


def vision_head(task: str) -> torch.nn.Module:
    """A SegFormer that segments, a DETR that detects (on a ResNet of its own, no timm), a GLPN that estimates depth, a
    VideoMAE that classifies videos of 4 frames, a Mask2Former (on a Swin of its own) that finds masks."""
    from aotstack.integrations.hf_folder import auto_class

    stages = {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32],
              "num_attention_heads": [1, 2], "strides": [4, 2], "patch_sizes": [7, 3], "mlp_ratios": [2, 2]}
    config = {
        "semantic-segmentation": lambda: transformers.SegformerConfig(**stages, decoder_hidden_size=32, num_labels=3),
        "depth-estimation": lambda: transformers.GLPNConfig(**stages, decoder_hidden_size=16),
        "object-detection": lambda: transformers.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=transformers.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage1", "stage2"]),
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3),
        "video-classification": lambda: transformers.VideoMAEConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=(48, 40),
            patch_size=8, num_frames=4, tubelet_size=2, num_labels=3),
        "image-segmentation": lambda: transformers.Mask2FormerConfig(
            backbone_config=transformers.SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                                                    window_size=4, out_features=["stage1", "stage2", "stage3",
                                                                                 "stage4"]),
            feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=64, dim_feedforward=64,
            encoder_layers=1, decoder_layers=2, num_attention_heads=4, num_queries=5, num_labels=3,
            use_timm_backbone=False),
    }[task]()
    torch.manual_seed(0)
    model = auto_class(task).from_config(config).eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.1)
    return model


@pytest.mark.parametrize(("task", "engines"), [
    ("semantic-segmentation", "ort"), ("object-detection", "ov"), ("depth-estimation", "ort"),
    ("video-classification", "ov"), ("image-segmentation", "ov"),
])
def test_a_vision_heads_task_is_read_from_its_config_at_its_processors_image_size(tmp_path, capsys, task, engines):
    """Exported at the size the processor makes (48 by 40 here; none of these configs names one), every output
    of the head as the model gives it."""
    model = vision_head(task)
    processor = {"image_processor_type": "ViTImageProcessor", "size": {"height": 48, "width": 40}}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", engines)
    assert f"({task}: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    frames = (model.config.num_frames,) if task == "video-classification" else ()
    pixels = torch.randn(2, *frames, 3, 48, 40, generator=torch.Generator().manual_seed(2))
    got = exported(pixel_values=pixels)
    with torch.no_grad():
        want = model(pixel_values=pixels)
    names = [name for name, value in want.items() if isinstance(value, torch.Tensor)]
    assert names and all(name in got for name in names)
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)


def test_a_super_resolution_model_takes_images_of_any_sides_its_processor_pads_to(tmp_path, capsys):
    """Swin2SR (``image-to-image``): its processor pads each image's sides to multiples of 8 (saved by transformers 4
    as ``pad_size``), so the sides stay dynamic in those steps. Its window count, a product of the sides' steps, is
    read off the image's windows: AOTInductor failed to compile the second of the two parts that read cut the method
    into while that count stood as a size of its own, where plain AOTInductor compiles the model. Read off the image
    (``compile/input_sizes.py``), it leaves one part; a side of one step, 8 pixels, runs as in plain AOTInductor."""
    torch.manual_seed(0)
    config = transformers.Swin2SRConfig(image_size=32, patch_size=1, embed_dim=16, depths=[2], num_heads=[2],
                                        window_size=4, upscale=2, upsampler="pixelshuffle", mlp_ratio=2.0)
    model = transformers.Swin2SRForImageSuperResolution(config).eval()
    processor = {"image_processor_type": "Swin2SRImageProcessor", "do_pad": True, "pad_size": 8,
                 "do_rescale": True, "rescale_factor": 1 / 255}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", "aoti")
    assert "(image-to-image: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    generator = torch.Generator().manual_seed(3)
    [file] = (tmp_path / "out").glob("*.pt2")
    assert [delegate.id for delegate in aotstack.file_report(file).methods[0].delegates] == ["forward.0"]
    for images, height, width in ((2, 32, 32), (1, 16, 40), (3, 48, 24), (1, 8, 16)):
        pixels = torch.rand(images, 3, height, width, generator=generator)
        got = exported(pixel_values=pixels)["reconstruction"]
        with torch.no_grad():
            want = model(pixel_values=pixels).reconstruction
        assert got.shape == (images, 3, 2 * height, 2 * width)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(aotstack.InputError, match="dimension 2 is 30"):
        exported(pixel_values=torch.rand(1, 3, 30, 32))


def test_a_mask_generator_takes_any_number_of_prompts_of_any_number_of_points_per_image(tmp_path, capsys):
    """SAM: each image with its prompts of points and their labels (one of each included), as its processor makes
    them for images padded to 128 pixels; masks and their scores as the model gives them. Through ONNX Runtime, whose
    exporter and optimizer each got a part of it wrong before."""
    torch.manual_seed(0)
    config = transformers.SamConfig(
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                       "image_size": 128, "patch_size": 16, "output_channels": 32, "window_size": 4,
                       "global_attn_indexes": [1], "mlp_dim": 64, "num_pos_feats": 16},
        prompt_encoder_config={"hidden_size": 32, "image_size": 128, "patch_size": 16, "mask_input_channels": 4},
        mask_decoder_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_dim": 64,
                             "iou_head_hidden_dim": 32},
    )
    model = transformers.SamModel(config).eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.1)
    processor = {"image_processor_type": "SamImageProcessor", "size": {"longest_edge": 128}, "do_pad": True,
                 "pad_size": {"height": 128, "width": 128}}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", "ort")
    assert "(mask-generation: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    generator = torch.Generator().manual_seed(3)
    for images, prompts, points in ((2, 5, 3), (1, 1, 1), (3, 2, 1)):
        pixels = torch.randn(images, 3, 128, 128, generator=generator)
        where = torch.rand(images, prompts, points, 2, generator=generator) * 128
        labels = torch.randint(0, 2, (images, prompts, points), generator=generator)
        labels[0, 0, -1] = -1 if points > 1 else 1  # a padding point
        got = exported(pixel_values=pixels, input_points=where, input_labels=labels)
        with torch.no_grad():
            want = model(pixel_values=pixels, input_points=where, input_labels=labels)
        for name in ("iou_scores", "pred_masks"):
            assert got[name].shape[:2] == (images, prompts)
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)


def test_a_pose_estimator_with_an_expert_per_dataset_reads_each_images_dataset(tmp_path, capsys):
    """ViTPose++: a heatmap per keypoint of each image, its backbone's MLP chosen per image by the dataset its
    keypoints are read for (``dataset_index``), which the export takes beside the images, batch dynamic."""
    torch.manual_seed(0)
    backbone = transformers.VitPoseBackboneConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                  intermediate_size=64, image_size=[64, 48], patch_size=[8, 8],
                                                  num_experts=2, part_features=8)
    model = transformers.VitPoseForPoseEstimation(transformers.VitPoseConfig(backbone_config=backbone,
                                                                             num_labels=5)).eval()
    processor = {"image_processor_type": "VitPoseImageProcessor", "size": {"height": 64, "width": 48}}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", "ort")
    assert "(pose-estimation: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    generator = torch.Generator().manual_seed(3)
    for images, datasets in ((2, [0, 1]), (1, [1]), (3, [1, 0, 1])):
        pixels, chosen = torch.randn(images, 3, 64, 48, generator=generator), torch.tensor(datasets)
        got = exported(pixel_values=pixels, dataset_index=chosen)
        with torch.no_grad():
            want = model(pixel_values=pixels, dataset_index=chosen)
        torch.testing.assert_close(got["heatmaps"], want.heatmaps, rtol=1e-4, atol=1e-5)


def test_a_matting_model_takes_images_of_their_own_size_padded_to_its_multiple(tmp_path, capsys):
    """ViTMatte: each image with its trimap as a fourth channel, at its own size, which its processor pads to a
    multiple of 32 (not one size for all): height and width stay dynamic, multiples of 32, and another size is
    refused by name."""
    torch.manual_seed(0)
    backbone = transformers.VitDetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                         image_size=64, patch_size=16, num_channels=4, out_features=["stage2"],
                                         pretrain_image_size=64)
    model = transformers.VitMatteForImageMatting(transformers.VitMatteConfig(
        backbone_config=backbone, hidden_size=32, convstream_hidden_sizes=[8, 16, 32],
        fusion_hidden_sizes=[32, 16, 8, 8])).eval()
    for weight in model.parameters():  # alphas far from a flat 0.5, so a wrong one shows
        torch.nn.init.normal_(weight, std=1.0 if weight.dim() > 1 else 0.1)
    processor = {"image_processor_type": "VitMatteImageProcessor", "do_pad": True, "size_divisor": 32}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", "ort")
    assert "(image-matting: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    generator = torch.Generator().manual_seed(3)
    for shape in ((2, 4, 64, 64), (1, 4, 96, 64), (3, 4, 64, 128)):
        pixels = torch.randn(*shape, generator=generator)
        got = exported(pixel_values=pixels)
        with torch.no_grad():
            want = model(pixel_values=pixels)
        assert got["alphas"].shape == (shape[0], 1, *shape[2:])
        torch.testing.assert_close(got["alphas"], want.alphas, rtol=1e-4, atol=1e-5)
    with pytest.raises(aotstack.InputError, match="32"):
        exported(pixel_values=torch.randn(1, 4, 48, 64))


def test_a_keypoint_detector_that_loops_over_its_images_is_exported_for_one_at_a_time(tmp_path, capsys):
    """SuperPoint's forward takes its images one by one (torch.export refuses its batch as dynamic): exported for one
    image, said so, each image's keypoints as many as it has; a batch of two refused by name."""
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        pytest.skip("torch 2.11's torch.export cannot trace SuperPoint's keypoints, as many as each image has "
                    "(\"Could not guard on data-dependent expression Eq(u4, u1)\"); 2.13's can")
    torch.manual_seed(0)
    config = transformers.SuperPointConfig(encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=32,
                                           keypoint_decoder_dim=65, descriptor_decoder_dim=32,
                                           keypoint_threshold=0.016)
    model = transformers.SuperPointForKeypointDetection(config).eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.1)
    processor = {"image_processor_type": "SuperPointImageProcessor", "size": {"height": 64, "width": 96}}
    export_hf(str(saved(model, tmp_path / "model", processor)), "-o", str(tmp_path / "out"), "--engines", "ort")
    assert "cannot take a batch of any size" in capsys.readouterr().err
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    counts = set()
    for seed in range(3):
        pixels = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(seed))
        got = exported(pixel_values=pixels)
        with torch.no_grad():
            want = model(pixel_values=pixels)
        for name in ("keypoints", "scores", "descriptors", "mask"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
        counts.add(want.keypoints.shape[1])
    assert len(counts) > 1, "the count of keypoints follows each image"
    with pytest.raises(aotstack.InputError):
        exported(pixel_values=torch.randn(2, 3, 64, 96))


def time_series_head(task: str) -> torch.nn.Module:
    """A PatchTST or PatchTSMixer head on 3 channels of 32 steps, cut into patches of 8; weights large enough that
    its outputs differ from row to row."""
    patches = {"num_input_channels": 3, "context_length": 32, "patch_length": 8, "patch_stride": 8, "d_model": 16}
    model = {
        "time-series-classification": lambda: transformers.PatchTSTForClassification(transformers.PatchTSTConfig(
            **patches, num_attention_heads=2, num_hidden_layers=2, ffn_dim=32, num_targets=4)),
        "time-series-regression": lambda: transformers.PatchTSMixerForRegression(transformers.PatchTSMixerConfig(
            **patches, num_layers=2, num_targets=2)),
        "time-series-forecasting": lambda: transformers.PatchTSMixerForPrediction(transformers.PatchTSMixerConfig(
            **patches, num_layers=2, prediction_length=12)),
    }[task]().eval()
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.5)
    return model


@pytest.mark.parametrize(("task", "engines"), [
    ("time-series-classification", "ort"), ("time-series-regression", "ov"), ("time-series-forecasting", "ov"),
])
def test_a_time_series_head_is_read_from_its_config_and_takes_any_batch_of_windows(tmp_path, capsys, task, engines):
    """Heads transformers has no auto class for (PatchTST's, PatchTSMixer's), loaded by the class its mapping names;
    a folder with no processor; ``past_values`` ``[batch, context_length, channels]``, batch dynamic."""
    torch.manual_seed(0)
    model = time_series_head(task)
    model.save_pretrained(tmp_path / "model")
    export_hf(str(tmp_path / "model"), "-o", str(tmp_path / "out"), "--engines", engines)
    assert f"({task}: forward;" in capsys.readouterr().out
    exported = ExportedModel.from_pretrained(tmp_path / "out")
    generator = torch.Generator().manual_seed(3)
    for batch in (2, 1, 5):
        series = torch.randn(batch, 32, 3, generator=generator)
        got = exported(past_values=series)
        with torch.no_grad():
            want = model(past_values=series)
        names = [name for name, value in want.items() if isinstance(value, torch.Tensor)]
        assert names and all(got[name].shape[0] == batch for name in names)
        for name in names:  # values of about 1 to 10, through float32 in another engine's order
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4)


# A text encoder's and a vision tower's small configs, for models that read both.
TEXT_ENCODER = {name: TEXT[name] for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "max_position_embeddings", "pad_token_id")}
VISION_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "image_size": 32, "patch_size": 8}


def exported_text_and_images(model: torch.nn.Module, processor: dict, task: str, tmp_path: Path, capsys) -> Any:
    """``model`` saved with a tokenizer and ``processor``, exported with ``export-hf`` (its task read from its
    config), and loaded; the folder keeps both."""
    folder = saved(model, tmp_path / "model", processor)
    tokenizer().save_pretrained(folder)
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "aoti")
    assert f"({task}: forward;" in capsys.readouterr().out
    assert {"tokenizer.json", "preprocessor_config.json"} <= {path.name for path in (tmp_path / "out").iterdir()}
    return ExportedModel.from_pretrained(tmp_path / "out")


def test_a_zero_shot_image_classifier_scores_any_number_of_images_against_any_number_of_texts(tmp_path, capsys):
    """CLIP, a text encoder beside an image encoder: its texts and images counted apart, each image scored against
    each text as the model does."""
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config={**TEXT_ENCODER, "eos_token_id": 3}, vision_config=VISION_TOWER,
                                     projection_dim=16)
    model = transformers.CLIPModel(config).eval()
    processor = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
                 "crop_size": {"height": 32, "width": 32}, "do_center_crop": True}
    exported = exported_text_and_images(model, processor, "zero-shot-image-classification", tmp_path, capsys)
    generator = torch.Generator().manual_seed(1)
    for texts, length, images in [(3, 6, 2), (1, 9, 4)]:
        ids = torch.randint(4, VOCAB, (texts, length), generator=generator)
        ids[:, length - 2] = 3  # each text's end, where CLIP pools it; the last row padded after it
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0
        pixels = torch.randn(images, 3, 32, 32, generator=generator)
        got = exported(input_ids=ids, attention_mask=mask, pixel_values=pixels)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
        assert got["logits_per_image"].shape == (images, texts)
        for name in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)


def test_a_zero_shot_detector_finds_boxes_in_an_image_for_any_number_of_texts(tmp_path, capsys):
    """OWL-ViT: one image at the processor's size, and one or more texts, each scored against each box."""
    torch.manual_seed(0)
    config = transformers.OwlViTConfig(text_config={**TEXT_ENCODER, "max_position_embeddings": 16},
                                       vision_config=VISION_TOWER, projection_dim=32)
    model = transformers.OwlViTForObjectDetection(config).eval()
    processor = {"image_processor_type": "OwlViTImageProcessor", "size": {"height": 32, "width": 32}}
    exported = exported_text_and_images(model, processor, "zero-shot-object-detection", tmp_path, capsys)
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(1, 3, 32, 32, generator=generator)
    for texts, length in [(3, 6), (1, 16)]:
        ids = torch.randint(4, VOCAB, (texts, length), generator=generator)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
        got = exported(**inputs)
        with torch.no_grad():
            want = model(**inputs)
        assert got["logits"].shape == (1, 16, texts)  # a box per patch, a score per text
        for name in ("logits", "pred_boxes"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)


# Errors: each names what is wrong and what is expected, and leaves nothing in or beside the output.


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    return saved(decoder_lm("llama"), tmp_path_factory.mktemp("small") / "llama")


def copy_without(folder: Path, tmp_path: Path, *names: str) -> Path:
    target = tmp_path / "model"
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns(*names))
    return target


def assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".out")]


@pytest.mark.parametrize(("missing", "message"), [
    ("config.json", "has no config.json"),
    ("model.safetensors", "has no weights: expected model.safetensors"),
    ("tokenizer*", "has no tokenizer (tokenizer.json or tokenizer_config.json), which task text-generation needs"),
])
def test_a_folder_missing_a_file_is_refused_by_name(small_folder, tmp_path, missing, message):
    folder = copy_without(small_folder, tmp_path, missing)
    with pytest.raises(ModelFolderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_folder(folder, tmp_path / "out", engines="aoti")
    assert_nothing_written(tmp_path)


def test_pickled_weights_and_remote_code_are_refused(small_folder, tmp_path):
    folder = copy_without(small_folder, tmp_path, "model.safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelFolderError, match="pytorch_model.bin, a pickle, which aotstack does not load"):
        export_folder(folder, tmp_path / "out")
    config = json.loads((small_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "mine.Model"}}))
    with pytest.raises(ModelFolderError, match="names code of its own"):
        export_folder(folder, tmp_path / "out")
    assert_nothing_written(tmp_path)


def test_unknown_task_and_unloadable_architecture_are_refused(small_folder, tmp_path, capsys):
    with pytest.raises(UnsupportedModelError,
                       match="unknown task 'translation'; supported tasks: image-text-to-text, text-generation"):
        export_folder(small_folder, tmp_path / "out", task="translation")
    with pytest.raises(UnsupportedModelError, match="task image-classification cannot load model type 'llama'"):
        export_folder(small_folder, tmp_path / "out", task="image-classification")
    folder = copy_without(small_folder, tmp_path, "config.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(UnsupportedModelError, match="transformers cannot read .* 'no-such-model'"):
        export_folder(folder, tmp_path / "out")
    assert_nothing_written(tmp_path)
    # The command line says the same, as an error line rather than a traceback.
    assert main(["export-hf", str(small_folder), "-o", str(tmp_path / "out"), "--task", "translation"]) == 1
    assert "aotstack: error: unknown task 'translation'" in capsys.readouterr().err


def test_an_output_that_is_not_an_export_is_left_alone(small_folder, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ModelFolderError, match="exists and is not an aotstack export folder"):
        export_folder(small_folder, tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    with pytest.raises(ModelFolderError, match="holds no aotstack export"):
        generate_text(tmp_path / "out", "the cat")


def test_export_hf_quantizes_under_executorch_names(tmp_path, capsys):
    """``--qlinear 8da4w --qembedding 4w``: the file generates what the eager quantized model does."""
    model = decoder_lm("llama").eval()
    folder = saved(model, tmp_path / "model")
    export_hf(str(folder), "-o", str(tmp_path / "out"), "--engines", "ov,aoti", "--max-cache-len", "32",
              "--qlinear", "8da4w", "--qembedding", "4w", "--qgroup-size", "16")
    ids = tokenizer()(PROMPT)["input_ids"]
    expected = greedy_reference(aotstack.quantize(model, linear="8da4w", embedding="4w", group_size=16), ids)

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "out"), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    report = aotstack.file_report(tmp_path / "out" / "model.pt2")
    labels = {label for method in report.methods for d in method.delegates for label in d.quantized}
    assert labels == {"linear 8da4w, group 16", "embedding 4w, group 16"}


def test_exporter_config_quantizes_a_copy_and_refuses_a_transformers_quantizer(tmp_path):
    model = bert().eval()
    ids = torch.randint(4, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exporter = get_exporter_class("aotstack")(progress=False)
    exported = exporter.export(model, dict(inputs), aotstack_hf.AotstackConfig(engines="ov", qlinear="8w"))
    assert type(model.encoder.layer[0].attention.self.query.weight) is torch.nn.Parameter, "the caller's model"
    exported.save_pretrained(tmp_path / "bert")
    got = ExportedModel.from_pretrained(tmp_path / "bert")(**inputs)
    with torch.no_grad():
        want = aotstack.quantize(model, linear="8w")(**inputs)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-5)

    with pytest.raises(aotstack.ExportError, match="quantize with qlinear= and qembedding="):
        exporter.export(model, dict(inputs), aotstack_hf.AotstackConfig(engines="ov", quantizer=object()))
    with pytest.raises(aotstack.QuantizationError, match="unknown linear quantization 'int4'"):
        aotstack_hf.AotstackConfig(engines="ov", qlinear="int4")


def test_a_torchao_checkpoint_saved_by_transformers_generates_its_greedy_text(tmp_path, capsys):
    """A folder as torchao-quantized checkpoints ship: ``from_pretrained(quantization_config=TorchAoConfig(...))``,
    then ``save_pretrained``. Its weights load as parameters asking for gradients, which export could not unwrap."""
    torchao = pytest.importorskip("torchao.quantization")

    model = decoder_lm("llama").eval()
    saved(model, tmp_path / "float")
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=transformers.TorchAoConfig(torchao.Int8WeightOnlyConfig()))
    saved(quantized, tmp_path / "quantized")
    export_hf(str(tmp_path / "quantized"), "-o", str(tmp_path / "out"), "--engines", "aoti", "--max-cache-len", "32")
    assert "its checkpoint is quantized already: torchao Int8WeightOnlyConfig" in capsys.readouterr().err

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "quantized").eval()
    assert type(loaded.model.layers[0].mlp.up_proj.weight) is not torch.nn.Parameter, "torchao's weights"
    expected = greedy_reference(loaded, tokenizer()(PROMPT)["input_ids"])
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "out"), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer().decode(expected, skip_special_tokens=True)
    report = aotstack.file_report(tmp_path / "out" / "model.pt2")
    assert {label for method in report.methods for d in method.delegates for label in d.quantized} == {
        "linear 8w, per channel"}
