"""Gemma 3's image transform against transformers' `Gemma3ImageProcessorPil` and `Gemma3Processor` (issue #41).

Pixels: equal, bit for bit, to the slow (PIL) image processor's with Gemma 3's settings (896 pixels, mean and
deviation 0.5), for pictures of several shapes, a transparent one and a uint8 tensor, with and without pan and scan;
the pan-and-scan crops equal to transformers' `pan_and_scan` over many shapes and settings. Tokens: equal to
`Gemma3Processor`'s input_ids for the same conversations (the template rendered by the processor, then the processor
on that text and the pictures), on the tiny world's tokenizer.json with Gemma 3's special tokens added and Gemma 3's
chat template as TRL ships it; nothing is downloaded. The mask trains the answers only. End to end: our tiny
`Gemma3EarlyFusionModel` fed this transform's output equals transformers' `Gemma3ForConditionalGeneration` fed the
processor's output within 1e-4.
"""
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import trl
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Tokenizer

from torchtune_lit.config import _asset_path
from torchtune_lit.data import Message
from torchtune_lit.models.gemma3._transform import (
    GEMMA3_BOI_TOKEN,
    GEMMA3_EOI_TOKEN,
    GEMMA3_IMAGE_SOFT_TOKEN,
    Gemma3ImageTransform,
    Gemma3Transform,
    gemma3_image_text,
    gemma3_transform,
    pan_and_scan_boxes,
)
from torchtune_lit.models.gemma3._vision import (
    gemma3_conversion_args,
    gemma3_vision_from_hf_config,
    gemma3_vision_hf_to_tune,
)
from torchtune_lit.tokenizers import HuggingFaceModelTokenizer

transformers = pytest.importorskip("transformers")
for _name in ("torchao", "torch.utils._pytree", "transformers"):
    logging.getLogger(_name).setLevel(logging.ERROR)

TINY_BASE = Path(_asset_path("tiny/base"))
TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "gemma3.jinja").read_text()
MEAN_STD = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
PAS = dict(pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)


def _image(seed, height, width, mode="RGB"):
    channels = 4 if mode == "RGBA" else 3
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


WIDE, SQUARE, TALL = _image(0, 40, 90), _image(1, 33, 31), _image(2, 100, 20)


def _pixel_processor(size):
    return transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size}, **MEAN_STD)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    "The tiny tokenizer with Gemma 3's turn and image tokens, its config naming them, Gemma 3's template."
    folder = tmp_path_factory.mktemp("gemma3_tokenizer")
    vocab = Tokenizer.from_file(str(TINY_BASE / "tokenizer.json"))
    vocab.add_special_tokens(["<start_of_turn>", "<end_of_turn>", GEMMA3_BOI_TOKEN, GEMMA3_EOI_TOKEN,
                              GEMMA3_IMAGE_SOFT_TOKEN])
    vocab.save(str(folder / "tokenizer.json"))
    config = json.loads((TINY_BASE / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["extra_special_tokens"] = {"boi_token": GEMMA3_BOI_TOKEN, "eoi_token": GEMMA3_EOI_TOKEN,
                                      "image_token": GEMMA3_IMAGE_SOFT_TOKEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def processor(folder):
    "transformers' Gemma3Processor on the tiny tokenizer: 28-pixel pictures, 4 tokens each."
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.Gemma3Processor(_pixel_processor(28), tokenizer, TEMPLATE, image_seq_length=4)


def _picture(image):
    return {"type": "image", "content": image}


def _words(text):
    return {"type": "text", "content": text}


def _conversations():
    "(messages, images, inference) cases."
    one = [Message("system", "Answer in one word.", masked=True),
           Message("user", [_picture(WIDE), _words("What is this?")], masked=True),
           Message("assistant", "Cats.")]
    two = one + [Message("user", [_words("And here? "), _picture(SQUARE), _words(" Or here?"), _picture(TALL)],
                         masked=True),
                 Message("assistant", "Dogs.")]
    return [(one, [WIDE], False), (two, [WIDE, SQUARE, TALL], False), (two[:-1], [WIDE, SQUARE, TALL], True)]


def _as_hf(messages):
    return [{"role": m.role, "content": [{"type": "image"} if p["type"] == "image"
                                         else {"type": "text", "text": p["content"]} for p in m.parts]}
            for m in messages]


def _reference(processor, messages, images, inference, pas):
    text = processor.apply_chat_template(_as_hf(messages), tokenize=False, add_generation_prompt=inference)
    return processor(text=text, images=images, add_special_tokens=False, return_tensors="pt",
                     do_pan_and_scan=pas, **PAS)


@pytest.mark.parametrize("size", [28, 896])
@pytest.mark.parametrize("pas", [False, True])
def test_pixels_equal_the_pil_processor(size, pas):
    pictures = [WIDE, SQUARE, TALL, _image(3, 50, 60, "RGBA"), _image(4, 600, 900), _image(5, 7, 200), _image(6, 20, 200)]
    settings = dict(do_pan_and_scan=pas, **PAS)
    expected = _pixel_processor(size)(pictures, return_tensors="pt", **settings)
    ours = Gemma3ImageTransform(size, **settings)
    actual = torch.cat([ours(p) for p in pictures])
    assert actual.dtype == torch.float32 and actual.shape == expected["pixel_values"].shape
    assert torch.equal(actual, expected["pixel_values"])  # tolerance 0
    assert [len(ours.views(p)) - 1 for p in pictures] == expected["num_crops"].tolist()
    if pas:
        assert expected["num_crops"].tolist() == [2, 0, 4, 2, 2, 0, 4]  # 7-pixel crops < 8: none


def test_tensor_input_equals_its_pil_image():
    tensor = torch.from_numpy(np.array(WIDE)).permute(2, 0, 1)
    ours = Gemma3ImageTransform(28)
    assert torch.equal(ours(tensor), ours(WIDE))
    gray = torch.from_numpy(np.array(WIDE.convert("L")))[None]
    assert torch.equal(ours(gray), _pixel_processor(28)(WIDE.convert("L"), return_tensors="pt")["pixel_values"])


def test_bfloat16_is_the_float32_values_rounded():
    ours, half = Gemma3ImageTransform(28), Gemma3ImageTransform(28, dtype=torch.bfloat16)
    assert torch.equal(half(WIDE), ours(WIDE).bfloat16())


def test_pan_and_scan_boxes_equal_transformers():
    processor = transformers.Gemma3ImageProcessorPil()
    cases = 0
    for width, height in [(90, 40), (40, 90), (33, 31), (101, 20), (13, 70), (64, 64), (47, 23), (300, 299)]:
        picture = _image(width * height, height, width)
        chw = np.array(picture).transpose(2, 0, 1)
        for crop, most, ratio in [(8, 4, 1.2), (16, 3, 1.2), (4, 8, 1.0), (30, 4, 1.5), (1, 2, 1.0)]:
            theirs = processor.pan_and_scan(chw, crop, most, ratio)
            boxes = pan_and_scan_boxes(width, height, crop, most, ratio)
            assert len(boxes) == len(theirs), (width, height, crop, most, ratio)
            for box, expected in zip(boxes, theirs):
                assert np.array_equal(np.array(picture.crop(box)).transpose(2, 0, 1), expected)
            cases += bool(boxes)
    assert cases > 15  # most settings crop


def test_pan_and_scan_by_hand():
    assert pan_and_scan_boxes(900, 600) == [(0, 0, 450, 600), (450, 0, 900, 600)]
    assert pan_and_scan_boxes(600, 1800) == [(0, 0, 600, 600), (0, 600, 600, 1200), (0, 1200, 600, 1800)]
    assert pan_and_scan_boxes(1000, 100) == []  # crops of 100 < 256
    assert pan_and_scan_boxes(700, 640) == []  # ratio under 1.2


def test_image_text_equals_the_processors(processor):
    assert gemma3_image_text(4) == processor.full_image_sequence
    assert gemma3_image_text(4, 3) == processor.replace_image_token({"num_crops": [3]}, 0)
    published = transformers.Gemma3Processor(_pixel_processor(896), processor.tokenizer, TEMPLATE)
    assert gemma3_image_text() == published.full_image_sequence
    assert gemma3_image_text().count(GEMMA3_IMAGE_SOFT_TOKEN) == 256


@pytest.mark.parametrize("pas", [False, True])
@pytest.mark.parametrize("case", range(3))
def test_tokens_equal_the_processors(folder, processor, pas, case):
    messages, images, inference = _conversations()[case]
    tokenizer = HuggingFaceModelTokenizer(folder / "tokenizer.json")
    transform = gemma3_transform(tokenizer, image_size=28, tokens_per_image=4, do_pan_and_scan=pas,
                                 pan_and_scan_min_crop_size=8)
    out = transform({"messages": messages, "extra": 1}, inference=inference)
    expected = _reference(processor, messages, images, inference, pas)
    assert out["tokens"] == expected["input_ids"][0].tolist()
    assert torch.equal(out["encoder_input"]["images"], expected["pixel_values"])
    assert out["extra"] == 1 and "messages" not in out
    image_ids = {transform.boi_id, transform.eoi_id, transform.image_token_id}
    soft = [t == transform.image_token_id for t in out["tokens"]]
    assert soft == [bool(x) for x in expected["token_type_ids"][0].tolist()]  # what transformers marks
    assert all(m for t, m in zip(out["tokens"], out["mask"]) if t in image_ids)
    trained = tokenizer.decode([t for t, m in zip(out["tokens"], out["mask"]) if not m], skip_special_tokens=False)
    answers = [m.text_content for m in messages if m.role == "assistant"]
    assert trained.replace("<end_of_turn>", " ").split() == answers
    assert "render" not in vars(tokenizer)  # the tokenizer given is left as it was


def test_expanding_ids_instead_of_text_would_differ(folder, processor):
    "Why the text is expanded: the blank line merges with the text before it ('?' and a newline are one piece)."
    messages = [Message("user", [_words("What is this?"), _picture(WIDE)], masked=True), Message("assistant", "A")]
    tokenizer = HuggingFaceModelTokenizer(folder / "tokenizer.json")
    transform = gemma3_transform(tokenizer, image_size=28, tokens_per_image=4)
    plain, _ = tokenizer.tokenize_messages(messages)
    block = tokenizer.base.tokenizer.encode(gemma3_image_text(4), add_special_tokens=False).ids
    naive = [x for t in plain for x in (block if t == transform.boi_id else [t])]
    out = transform({"messages": messages})["tokens"]
    assert naive != out and len(naive) == len(out) + 1
    assert out == _reference(processor, messages, [WIDE], False, False)["input_ids"][0].tolist()


def test_image_in_an_answer_is_not_trained(folder):
    transform = gemma3_transform(folder / "tokenizer.json", image_size=28, tokens_per_image=4)
    out = transform({"messages": [Message("user", "Draw.", masked=True),
                                  Message("assistant", [_words("Here:"), _picture(SQUARE)])]})
    image_ids = {transform.boi_id, transform.eoi_id, transform.image_token_id}
    assert all(m for t, m in zip(out["tokens"], out["mask"]) if t in image_ids)
    assert not all(out["mask"])


def test_text_only_has_no_encoder_input(folder):
    transform = gemma3_transform(folder / "tokenizer.json")
    out = transform({"messages": [Message("user", "hi", masked=True), Message("assistant", "hello")]})
    assert "encoder_input" not in out and GEMMA3_BOI_TOKEN not in transform.decode(out["tokens"],
                                                                                    skip_special_tokens=False)


def test_defaults_are_gemma3s(folder):
    transform = gemma3_transform(folder / "tokenizer.json", max_seq_len=4096)
    assert isinstance(transform, Gemma3Transform)
    assert transform.image_transform.image_size == 896 and transform.tokens_per_image == 256
    assert transform.max_seq_len == 4096 and not transform.image_transform.do_pan_and_scan
    assert transform.eot_id == transform.special_tokens["<end_of_turn>"] == transform.tokenizer.eot_id
    out = transform({"messages": _conversations()[0][0]})
    assert out["encoder_input"]["images"].shape == (1, 3, 896, 896)
    assert out["tokens"].count(transform.image_token_id) == 256


def _tiny_pair(folder, tmp_path):
    """(transform, transformers' tiny Gemma3ForConditionalGeneration, ours with its weights): the tiny Gemma 3 of
    tests/test_gemma3_vision_parity.py, its vocabulary and image ids the tokenizer's."""
    tokenizer = HuggingFaceModelTokenizer(folder / "tokenizer.json")
    transform = gemma3_transform(tokenizer, image_size=28, tokens_per_image=4, do_pan_and_scan=True,
                                 pan_and_scan_min_crop_size=8)
    vision = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=7, vision_use_head=False)
    text = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=4, layer_types=["sliding_attention"] * 2 + ["full_attention"])
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=transform.image_token_id, boi_token_index=transform.boi_id,
                                       eoi_token_index=transform.eoi_id, attn_implementation="eager")
    torch.manual_seed(0)
    theirs = transformers.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name or "post_layernorm" in name:
                p.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.3 * noise)
            else:
                p.copy_(0.5 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[-1]))
    theirs.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ours = gemma3_vision_from_hf_config(cfg).eval()
    ours.load_state_dict(gemma3_vision_hf_to_tune(load_file(tmp_path / "model.safetensors"),
                                                  **gemma3_conversion_args(cfg)), strict=True)
    return transform, theirs, ours


def test_logits_equal_transformers(folder, processor, tmp_path):
    "The transform's output in our tiny Gemma 3 equals the processor's in transformers'."
    messages, images, _ = _conversations()[1]
    transform, theirs, ours = _tiny_pair(folder, tmp_path)
    out = transform({"messages": messages})
    expected = _reference(processor, messages, images, False, True)
    assert out["encoder_input"]["images"].shape[0] == 9  # three pictures, six crops
    with torch.no_grad():
        actual = ours(torch.tensor([out["tokens"]]), encoder_input=out["encoder_input"])
        reference = theirs(input_ids=expected["input_ids"], pixel_values=expected["pixel_values"],
                           token_type_ids=expected["token_type_ids"]).logits
    assert reference.abs().max() > 1.0
    torch.testing.assert_close(actual, reference, atol=1e-4, rtol=0)


def test_a_batch_equals_its_samples(folder, tmp_path):
    "Samples of 1 and 3 pictures (9 views) through the collate the recipes pick: each row's logits equal its own run's."
    from torchtune_lit.data import padded_collate_early_fusion
    from torchtune_lit.training.data_loading import _collate_for

    transform, _, ours = _tiny_pair(folder, tmp_path)
    samples = [transform({"messages": m}) for m, _, _ in _conversations()[:2]]
    for sample in samples:
        sample["labels"] = sample["tokens"]
    batch = _collate_for(samples)(samples)  # what the recipes' data loading builds
    early = padded_collate_early_fusion(samples)
    assert torch.equal(batch["encoder_input"]["images"], early["encoder_input"]["images"])
    assert batch["encoder_input"]["images"].shape[0] == sum(len(x["encoder_input"]["images"]) for x in samples)
    with torch.no_grad():
        together = ours(batch["tokens"], encoder_input=batch["encoder_input"])
        for row, sample in enumerate(samples):
            alone = ours(torch.tensor([sample["tokens"]]), encoder_input=sample["encoder_input"])
            torch.testing.assert_close(together[row, : alone.shape[1]], alone[0], atol=1e-5, rtol=0)


def test_refusals(folder):
    with pytest.raises(ValueError, match="no <start_of_image>, <end_of_image>, <image_soft_token>"):
        gemma3_transform(TINY_BASE / "tokenizer.json")
    with pytest.raises(ValueError, match="give a PIL image"):
        Gemma3ImageTransform()(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 4, 4\)"):
        Gemma3ImageTransform()(torch.zeros(2, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="three values"):
        Gemma3ImageTransform(image_mean=[0.5], image_std=[0.5])
    with pytest.raises(ValueError, match="at least 2 crops"):
        Gemma3ImageTransform(pan_and_scan_max_num_crops=1)
    messages = _conversations()[0][0]
    short = gemma3_transform(folder / "tokenizer.json", max_seq_len=20, image_size=28, tokens_per_image=4)
    with pytest.raises(ValueError, match="raise max_seq_len=20"):
        short({"messages": messages})
    tokenizer = HuggingFaceModelTokenizer(folder / "tokenizer.json", max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len=32 but the tokenizer's is 64"):
        gemma3_transform(tokenizer, max_seq_len=32)
    sneaky = [Message("user", [_picture(WIDE), _words("a <start_of_image> b")], masked=True),
              Message("assistant", "c")]
    with pytest.raises(ValueError, match="2 <start_of_image> for 1 images"):
        gemma3_transform(tokenizer, image_size=28, tokens_per_image=4)({"messages": sneaky})
