"""Vision data parts against transformers' Mllama processor, on more pictures than the chapters use
(40d_vision_transforms, 40e_clip_image_transform, 40f_vision_mask, 45_collate, 43c_multimodal_datasets,
46b_tiny_vision), and their errors."""

import json

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from torchtune_lit.data import ColumnError
from torchtune_lit.data._collate import padded_collate_tiled_images_and_mask
from torchtune_lit.datasets._tiny_vision import (
    draw_shape,
    held_out_pairs,
    majority_answer_baseline,
    make_shapes_split,
    tiny_shapes_vqa_dataset,
)
from torchtune_lit.datasets.multimodal import (
    ImageFileError,
    TheCauldronToMessages,
    _check_image_files,
    llava_instruct_dataset,
    multimodal_chat_dataset,
    vqa_dataset,
)
from torchtune_lit.models.clip._transform import CLIPImageTransform
from torchtune_lit.modules.transforms._vision_mask import VisionCrossAttentionMask
from torchtune_lit.modules.transforms.vision_utils import (
    find_supported_resolutions,
    get_canvas_best_fit,
    pad_dim_to_size,
    resize_with_pad,
    tile_crop,
)

mllama = pytest.importorskip("transformers.models.mllama.image_processing_pil_mllama")
processing = pytest.importorskip("transformers.models.mllama.processing_mllama")


def _picture(h: int, w: int, mode: str, seed: int) -> Image.Image:
    "A smooth random picture (blurred noise), opaque, converted to `mode`."
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(1, 4, h // 4 + 2, w // 4 + 2, generator=g)
    smooth = F.interpolate(noise, size=(h, w), mode="bicubic").clamp(0, 1)[0]
    rgba = (smooth.permute(1, 2, 0) * 255).to(torch.uint8).numpy().copy()
    rgba[..., 3] = 255
    return Image.fromarray(rgba, "RGBA").convert(mode)


@pytest.mark.parametrize("max_tiles", [1, 2, 4, 6])
def test_canvas_matches_mllama(max_tiles):
    options = torch.tensor(find_supported_resolutions(max_tiles, 32))
    assert sorted((h // 32, w // 32) for h, w in options.tolist()) == sorted(
        mllama.get_all_supported_aspect_ratios(max_tiles)
    )
    for h in range(5, 300, 13):
        for w in range(5, 300, 17):
            ours = get_canvas_best_fit(torch.zeros(h, w), options, False)
            theirs = mllama.get_optimal_tiled_canvas(h, w, max_tiles, 32)
            assert ours == tuple(int(v) for v in theirs), (h, w)


@pytest.mark.parametrize(
    "h, w, mode",
    [
        (20, 20, "RGB"),
        (33, 120, "RGB"),
        (150, 47, "L"),
        (64, 64, "RGBA"),
        (90, 200, "RGB"),
        (230, 230, "RGB"),
        (31, 97, "L"),
    ],
)
def test_clip_transform_matches_mllama_processor(h, w, mode):
    tile = 32
    processor = mllama.MllamaImageProcessorPil(
        size={"height": tile, "width": tile}, max_image_tiles=4
    )
    ours = CLIPImageTransform(
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        tile_size=tile,
        max_num_tiles=4,
        dtype=torch.float32,
    )
    image = _picture(h, w, mode, seed=h * w)
    ref = processor(images=[[image]], return_tensors="pt")
    out = ours({"image": image})
    n = ref["num_tiles"][0][0]
    assert out["image"].shape == (n, 3, tile, tile)
    ratios = mllama.get_all_supported_aspect_ratios(4)
    assert (
        ratios.index(tuple(out["aspect_ratio"].tolist())) + 1
        == ref["aspect_ratio_ids"][0, 0]
    )
    # one grey level is 2/255 after (x - 0.5) / 0.5: Pillow rounds its uint8 resize, we do not
    torch.testing.assert_close(
        out["image"], ref["pixel_values"][0, 0, :n], atol=0.01, rtol=0
    )


def test_clip_transform_bf16_default_and_errors():
    out = CLIPImageTransform(tile_size=16)({"image": _picture(20, 40, "RGB", 0)})
    assert out["image"].dtype == torch.bfloat16 and out["aspect_ratio"].tolist() == [
        1,
        2,
    ]
    with pytest.raises(ValueError, match="both"):
        CLIPImageTransform(image_mean=[0.5] * 3)
    with pytest.raises(ValueError, match="max_num_tiles"):
        CLIPImageTransform(max_num_tiles=None)
    with pytest.raises(TypeError, match="PIL image"):
        CLIPImageTransform()({"image": np.zeros((4, 4, 3))})


def test_resize_and_tile_errors():
    with pytest.raises(ValueError, match="not a whole number of 3-pixel tiles"):
        tile_crop(torch.zeros(3, 4, 4), 3)
    with pytest.raises(ValueError, match="resample"):
        resize_with_pad(torch.zeros(3, 4, 4), (8, 8), "area")


def test_vision_mask_matches_mllama_on_random_sequences():
    g = torch.Generator().manual_seed(1)
    masker = VisionCrossAttentionMask(tile_size=8, patch_size=4, image_token_id=3)
    for _ in range(300):
        n = int(torch.randint(1, 25, (1,), generator=g))
        ids = torch.randint(4, 20, (n,), generator=g)
        ids[torch.rand(n, generator=g) < 0.25] = 3
        ids = ids.tolist()
        tiles = torch.randint(1, 5, (ids.count(3),), generator=g).tolist()
        images = [torch.zeros(t, 3, 8, 8) for t in tiles]
        masks = masker({"tokens": ids, "encoder_input": {"images": images}})[
            "encoder_mask"
        ]
        if not tiles:
            assert masks == []
            continue
        sparse = [processing.get_cross_attention_token_mask(ids, 3)]
        dense = processing.convert_sparse_cross_attention_mask_to_dense(
            sparse, [tiles], 4, n
        )
        for i, (mask, t) in enumerate(zip(masks, tiles)):
            expected = (
                torch.from_numpy(dense[0, :, i, :t]).bool().repeat_interleave(5, dim=1)
            )
            assert torch.equal(mask, expected)
    with pytest.raises(ValueError, match="does not match"):
        masker({"tokens": [3, 5], "encoder_input": {"images": []}})


def test_collate_nested_vision_and_pad_max_images():
    sample = {
        "tokens": [1, 2, 3],
        "labels": [1, 2, 3],
        "encoder_input": {
            "vision": {
                "images": [torch.ones(2, 1, 1, 1)],
                "aspect_ratio": [torch.tensor([1, 2])],
            }
        },
        "encoder_mask": [torch.ones(3, 2 * 4, dtype=torch.bool)],
    }
    out = padded_collate_tiled_images_and_mask(
        [sample], pad_max_images=3, pad_max_tiles=4
    )
    assert out["encoder_input"]["vision"]["images"].shape == (1, 1, 4, 1, 1, 1)
    assert out["encoder_mask"].shape == (1, 3, 3 * 4 * 4)
    assert out["encoder_mask"][0, 0].tolist() == [True] * 8 + [False] * 40
    text_only = [
        {
            "tokens": [1],
            "labels": [1],
            "encoder_input": {"images": [], "aspect_ratio": []},
        }
    ]
    assert set(padded_collate_tiled_images_and_mask(text_only)) == {"tokens", "labels"}


class _Transform:
    "Stand-in vision model transform: one id per image, text by characters."

    def __init__(self):
        self.clip = CLIPImageTransform(tile_size=16, dtype=torch.float32)
        self.masker = VisionCrossAttentionMask(16, 8, image_token_id=999)

    def __call__(self, sample):
        tokens, mask, images, ratios = [], [], [], []
        for m in sample["messages"]:
            for part in m.parts:
                if part["type"] == "image":
                    tiled = self.clip({"image": part["content"]})
                    images.append(tiled["image"])
                    ratios.append(tiled["aspect_ratio"])
                    ids = [999]
                else:
                    ids = [ord(c) for c in part["content"]]
                tokens += ids
                mask += [m.masked] * len(ids)
        return self.masker(
            {
                "tokens": tokens,
                "mask": mask,
                "encoder_input": {"images": images, "aspect_ratio": ratios},
            }
        )


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (20, 10), (255, 0, 0)).save(tmp_path / "img" / "a.png")
    Image.new("RGB", (10, 30), (0, 0, 255)).save(tmp_path / "img" / "b.png")
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "<image>\nQ"},
                {"from": "gpt", "value": "A"},
            ],
            "image": name,
        }
        for name in ("a.png", "b.png")
    ]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    (tmp_path / "vqa.jsonl").write_text(
        json.dumps({"input": "Q", "output": "A", "image": "a.png"})
        + "\n"
        + json.dumps({"input": "Q", "output": "B", "image": "missing.png"})
        + "\n"
    )
    return tmp_path


def test_multimodal_datasets_keep_encoder_keys(folder):
    ds = llava_instruct_dataset(
        _Transform(),
        source="json",
        data_files=str(folder / "chat.json"),
        image_dir=str(folder / "img"),
    )
    sample = ds[1]
    assert sample["tokens"] == [999, ord("\n"), ord("Q"), ord("A")]
    assert sample["labels"] == [-100, -100, -100, ord("A")]
    assert sample["encoder_input"]["aspect_ratio"][0].tolist() == [2, 1]
    assert sample["encoder_mask"][0].shape == (4, 2 * 5)
    same = multimodal_chat_dataset(
        _Transform(),
        source="json",
        data_files=str(folder / "chat.json"),
        image_dir=str(folder / "img"),
        image_tag="<image>",
    )
    assert same[1]["tokens"] == sample["tokens"]


def test_vqa_puts_the_picture_before_the_question(folder):
    (folder / "one.jsonl").write_text(
        json.dumps({"input": "Q", "output": "A", "image": "a.png"}) + "\n"
    )
    ds = vqa_dataset(
        _Transform(),
        source="json",
        data_files=str(folder / "one.jsonl"),
        image_dir=str(folder / "img"),
    )
    assert ds[0]["tokens"] == [999, ord("Q"), ord("A")]
    assert ds[0]["encoder_mask"][0].all()  # every text token sees the picture


def test_multimodal_dataset_errors(folder):
    with pytest.raises(ImageFileError, match="missing.png"):
        vqa_dataset(
            _Transform(),
            source="json",
            data_files=str(folder / "vqa.jsonl"),
            image_dir=str(folder / "img"),
        )
    with pytest.raises(ColumnError, match="photo"):
        multimodal_chat_dataset(
            _Transform(),
            source="json",
            data_files=str(folder / "chat.json"),
            image_dir=str(folder / "img"),
            column_map={"image": "photo"},
        )
    with pytest.raises(ValueError, match="packing"):
        vqa_dataset(_Transform(), source="json", packed=True)


def test_tiny_vision_splits_and_baseline():
    train, evaluation = make_shapes_split("train"), make_shapes_split("evaluation")
    assert {(r["shape"], r["colour"]) for r in evaluation} == set(held_out_pairs())
    assert not {(r["shape"], r["colour"]) for r in train} & set(held_out_pairs())
    again = make_shapes_split("train", num_samples=30)
    assert all(
        np.array_equal(np.array(a["image"]), np.array(b["image"]))
        for a, b in zip(again, train[:30])
    )
    scores = majority_answer_baseline(train, evaluation)
    assert abs(scores["overall"] - 5 / 18) < 1e-12
    ds = tiny_shapes_vqa_dataset(_Transform(), split="validation", num_samples=6)
    assert len(ds) == 6 and ds[0]["tokens"][0] == 999
    with pytest.raises(ValueError, match="split"):
        make_shapes_split("test")


def test_image_feature_columns_are_not_decoded_by_the_file_check():
    """`_check_image_files` reads only columns of paths: a `datasets.Image` column (The Cauldron's) is skipped, so
    no picture is decoded (decoding this one would raise, its file does not exist); a string column is checked."""
    features = datasets.Features({"image": datasets.Image(), "images": datasets.List(datasets.Image()),
                                  "path": datasets.Value("string"), "paths": datasets.List(datasets.Value("string"))})
    rows = datasets.Dataset.from_dict({"image": ["gone.png"], "images": [["gone.png"]], "path": ["gone.png"],
                                       "paths": [["gone2.png"]]}, features=features)
    _check_image_files(rows, "image", None)
    _check_image_files(rows, "images", None)
    with pytest.raises(ImageFileError, match="gone.png"):
        _check_image_files(rows, "path", None)
    with pytest.raises(ImageFileError, match="gone2.png"):
        _check_image_files(rows, "paths", None)


def test_more_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="add 'texts': '<your column>'"):
        TheCauldronToMessages(column_map={"images": "pictures"})
    with pytest.raises(ValueError, match="pass a size >= 3"):
        pad_dim_to_size(torch.zeros(2, 3), 2, dim=1)
    with pytest.raises(ValueError, match="colour 'purple': use one of"):
        draw_shape(ImageDraw.Draw(Image.new("RGB", (8, 8))), "circle", "purple", 4, 4, 2)
