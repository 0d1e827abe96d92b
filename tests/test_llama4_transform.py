"""Llama 4's tokenizer and transform (chapter 35e): token ids derived by hand on a
byte-level vocabulary, the image token layout equal to transformers' Llama4Processor,
the tile grid equal to its image processor's choice, the thumbnail equal to
torchtune's test expectation."""

import ast
import base64
import math
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import regex
import torch
import transformers.models.llama4 as hf_llama4
from PIL import Image
from transformers import Llama4Config
from transformers.image_utils import SizeDict
from transformers.models.llama4.processing_llama4 import Llama4Processor

from torchtune_lit.data import Message
from torchtune_lit.models.llama3 import CL100K_PATTERN
from torchtune_lit.models.llama4 import (
    LLAMA4_SPECIAL_TOKENS,
    Llama4Tokenizer,
    Llama4Transform,
    llama4_tokenizer,
    llama4_transform,
    llama4_vision_encoder,
)
from torchtune_lit.models.llama4._transform import LLAMA4_PATTERN, Llama4Thumbnail
from torchtune_lit.models.llama4._vision import LLAMA4_PATCH_TOKEN

S = LLAMA4_SPECIAL_TOKENS


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    "A tiktoken file of the 256 single bytes: each ASCII character is its byte."
    path = tmp_path_factory.mktemp("llama4") / "bytes.tiktoken"
    lines = (f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    path.write_text("".join(lines))
    return path


def turn(role: str, text: str, end: str = "<|eot|>") -> list[int]:
    head = [S["<|header_start|>"], *role.encode(), S["<|header_end|>"], 10, 10]
    return [*head, *text.encode(), S[end]]


def hf_image_ids(tiles: torch.Tensor, grid: list[int]) -> list[int]:
    "transformers' Llama4Processor's prompt string for one image, as ids."
    processor = Llama4Processor.__new__(Llama4Processor)
    processor.patch_size, processor.downsample_ratio = 14, 4
    inputs = {"pixel_values": [tiles], "aspect_ratios": [grid]}
    text = processor.replace_image_token(inputs, 0)
    assert re.sub(r"<\|[a-z_]+\|>", "", text) == ""
    return [S[t] for t in re.findall(r"<\|[a-z_]+\|>", text)]


@pytest.fixture(scope="module")
def hf_grid():
    "transformers' own get_best_fit / find_supported_resolutions (16 tiles of 336)."
    path = Path(hf_llama4.__file__).parent / "image_processing_llama4.py"
    wanted = {"get_factors", "find_supported_resolutions", "get_best_fit"}
    tree = [
        n for n in ast.parse(path.read_text()).body if getattr(n, "name", "") in wanted
    ]
    ns = dict(math=math, torch=torch, defaultdict=defaultdict, lru_cache=lru_cache)
    ns["SizeDict"] = SizeDict
    exec(compile(ast.Module(tree, []), str(path), "exec"), ns)
    canvases = torch.tensor(
        ns["find_supported_resolutions"](16, SizeDict(height=336, width=336))
    )
    return lambda h, w: (ns["get_best_fit"]((h, w), canvases) // 336).tolist()


def test_special_tokens_match_transformers_config():
    config = Llama4Config()
    assert sorted(S.values()) == list(range(200_000, 202_048))
    assert S["<|image_start|>"] == config.boi_token_index
    assert S["<|image_end|>"] == config.eoi_token_index
    assert S["<|patch|>"] == config.image_token_index == LLAMA4_PATCH_TOKEN
    # torchtune/models/llama4/_tokenizer.py's table
    named = ("<|header_start|>", "<|eom|>", "<|eot|>", "<|reasoning_thinking_start|>")
    assert [S[t] for t in named] == [200005, 200007, 200008, 201142]


def test_split_pattern_differs_from_llama3():
    text = "helloWorld it's"
    assert regex.findall(LLAMA4_PATTERN, text) == ["hello", "World", " it's"]
    assert regex.findall(CL100K_PATTERN, text) == ["helloWorld", " it", "'s"]


def test_conversation_by_hand(bpe_file):
    tok = llama4_tokenizer(bpe_file)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (200000, 200001, 200018)
    assert tok.stop_tokens == [200001, 200008, 200007]
    messages = [
        Message("user", " Hi there ", masked=True),
        Message("assistant", "Hello", eot=False),
        Message("ipython", "42", masked=True),
        Message("assistant", "It is 42."),
    ]
    parts = [
        turn("user", "Hi there"),
        turn("assistant", "Hello", "<|eom|>"),
        turn("ipython", "42"),
        turn("assistant", "It is 42."),
    ]
    tokens, mask = tok.tokenize_messages(messages)
    assert tokens == [S["<|begin_of_text|>"], *sum(parts, []), S["<|end_of_text|>"]]
    flags = [True, False, True, False]
    assert mask == [True, *(f for p, f in zip(parts, flags) for _ in p), True]
    assert tok.decode(tokens) == "Hi thereHello42It is 42."
    open_, _ = tok.tokenize_messages(messages, add_end_tokens=False)
    assert open_ == tokens[:-2]
    gen, gmask = tok.tokenize_messages(messages[:1], add_generation_prompt=True)
    assert gen == [S["<|begin_of_text|>"], *parts[0], *turn("assistant", "")[:-1]]
    sample = tok({"messages": messages, "id": 3})
    assert sample["tokens"] == tokens and "messages" not in sample and sample["id"] == 3


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation(bpe_file, side):
    messages = [Message("user", "abcdef", masked=True), Message("assistant", "xyz")]
    full, _ = Llama4Tokenizer(bpe_file).tokenize_messages(messages)
    short = Llama4Tokenizer(bpe_file, max_seq_len=9, truncation_type=side)
    tokens, mask = short.tokenize_messages(messages)
    kept = full[:9] if side == "right" else full[-9:]
    assert tokens == kept[:-1] + [S["<|end_of_text|>"]] and len(mask) == 9
    with pytest.raises(ValueError, match="truncation_type"):
        Llama4Tokenizer(bpe_file, truncation_type="middle")


def test_bad_inputs_refused(bpe_file):
    with pytest.raises(ValueError, match="begin_of_text"):
        Llama4Tokenizer(bpe_file, special_tokens={"<|end_of_text|>": 1})
    tok = Llama4Tokenizer(bpe_file)
    image = Message("user", [{"type": "image", "content": Image.new("RGB", (4, 4))}])
    with pytest.raises(ValueError, match="aspect_ratio"):
        tok.tokenize_messages([image])
    with pytest.raises(ValueError, match="tile_size"):
        Llama4Transform(bpe_file, tile_size=30, patch_size=14)


@pytest.mark.parametrize("grid", [[1, 1], [1, 4], [3, 1], [2, 3], [4, 4]])
def test_tile_grid_equals_llama4_processor(bpe_file, grid):
    tok = Llama4Tokenizer(bpe_file)
    ours = tok._get_tile_grid_tokens(144, torch.tensor(grid))
    assert ours == hf_image_ids(torch.zeros(3, 336, 336), grid)


def test_transform_equals_transformers_layout(bpe_file, hf_grid):
    transform = llama4_transform(bpe_file, dtype=torch.float32)
    assert transform.patch_tokens_per_tile == 144
    assert transform.image_seq_len == 16 * 576
    sizes = [(900, 300), (200, 700), (300, 300), (1000, 1000)]  # width, height
    content = [{"type": "image", "content": Image.new("RGB", s)} for s in sizes]
    sample = {
        "messages": [Message("user", [*content, {"type": "text", "content": "?"}])]
    }
    out = transform(sample, inference=True)
    assert "aspect_ratio" not in sample["messages"][0].parts[0]
    tokens, end = out["tokens"], 0
    images = out["encoder_input"]["vision"]["images"]
    assert len(images) == len(sizes)
    for (w, h), tiles in zip(sizes, images):
        rows, cols = grid = hf_grid(h, w)
        assert tiles.shape == (rows * cols + (rows * cols > 1), 3, 336, 336)
        start = tokens.index(S["<|image_start|>"], end)
        end = tokens.index(S["<|image_end|>"], start) + 1
        assert tokens[start:end] == hf_image_ids(tiles[0], grid)
    assert tokens[end:] == [*b"?"]  # inference: the turn left open


def test_thumbnail_equals_torchtune_expectation():
    "torchtune's test: seed 16, 4x4 noise to bytes, 16-pixel thumbnail sums -123.3412."
    torch.manual_seed(16)
    noise = torch.randn(3, 4, 4).clamp(0, 1)
    image = Image.fromarray((noise * 255).byte().permute(1, 2, 0).numpy())
    thumb = Llama4Thumbnail(16, [0.5] * 3, [0.5] * 3, torch.float32)(image)
    assert thumb.shape == (3, 16, 16)
    torch.testing.assert_close(thumb.sum(), torch.tensor(-123.3412), atol=1e-4, rtol=0)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # uint8 tensor
    as_tensor = Llama4Thumbnail(16, [0.5] * 3, [0.5] * 3, torch.float32)(pixels)
    torch.testing.assert_close(as_tensor, thumb, atol=0, rtol=0)


def test_patch_tokens_equal_encoder_features(bpe_file):
    "The promise: one <|patch|> per feature the encoder of the same sizes gives."
    transform = Llama4Transform(
        bpe_file, tile_size=28, patch_size=7, max_num_tiles=4, dtype=torch.float32
    )
    torch.manual_seed(0)
    wide = (torch.rand(3, 28, 100) * 255).byte()
    content = [{"type": "image", "content": wide}, {"type": "text", "content": "?"}]
    out = transform({"messages": [Message("user", content)]})
    tiles = torch.cat(out["encoder_input"]["vision"]["images"])
    assert tiles.shape[0] > 1  # several tiles plus the thumbnail
    encoder = llama4_vision_encoder(
        patch_size=7,
        num_heads=2,
        clip_embed_dim=8,
        clip_num_layers=1,
        projection_embed_dim=16,
        decoder_embed_dim=12,
        tile_size=28,
    )
    features = encoder(tiles)
    n_patch = (torch.tensor(out["tokens"]) == LLAMA4_PATCH_TOKEN).sum()
    assert n_patch == features.shape[:2].numel()


def test_published_counts(bpe_file):
    assert llama4_transform(bpe_file, image_size=448).patch_tokens_per_tile == 256
    tok = Llama4Tokenizer(bpe_file)
    call = Message("assistant", "f()", ipython=True, eot=False)
    assert tok.tokenize_message(call)[-1] == S["<|eom|>"]
    assert tok.tokenize_message(Message("assistant", "ok"))[-1] == S["<|eot|>"]


@pytest.mark.parametrize("factor", [0.3, 0.0, 2.0, 1 / 3])
def test_bad_pixel_shuffle_refused(bpe_file, factor):
    "28-pixel tiles of 7-pixel patches: a 4 x 4 grid, which 1/3 does not divide."
    with pytest.raises(ValueError, match="pixel_shuffle_scaling_factor"):
        Llama4Transform(
            bpe_file, tile_size=28, patch_size=7, pixel_shuffle_scaling_factor=factor
        )


@pytest.mark.parametrize(
    "image, said",
    [
        (torch.rand(3, 60, 200), "torch.float32 tensor of shape (3, 60, 200)"),
        (torch.zeros(60, 200, 3, dtype=torch.uint8), "shape (60, 200, 3)"),
        (np.zeros((60, 200, 3), dtype=np.uint8), "a ndarray"),
    ],
)
def test_bad_image_refused(bpe_file, image, said):
    transform = Llama4Transform(bpe_file, tile_size=28, patch_size=7)
    content = [{"type": "image", "content": image}]
    with pytest.raises(ValueError, match=re.escape(said)):
        transform({"messages": [Message("user", content)]})
    ok = (torch.rand(3, 60, 200) * 255).byte()  # uint8 [3, H, W]: several tiles
    out = transform({"messages": [Message("user", [{"type": "image", "content": ok}])]})
    assert out["encoder_input"]["vision"]["images"][0].shape[0] > 1
