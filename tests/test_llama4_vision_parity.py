"""Llama 4's vision encoder and the whole early-fusion model against transformers' `Llama4ForConditionalGeneration`.

A tiny multimodal config written by transformers' `save_pretrained` (fp32, random unit-scale weights): a text side
with MoE and dense, chunked-RoPE and NoPE layers; a vision side of two layers of width 16 on 28 x 28 images in patches
of 7 (a 4 x 4 grid, 4 vectors per image after the pixel shuffle). Our encoder equals transformers' `vision_model` +
`multi_modal_projector` within 1e-4 (measured ~6e-7); the whole model's logits equal transformers' with images in
the sequence and with text alone within 1e-4 (measured ~3e-6); the KV-cache decoding after an image prompt equals the
full forward; the keys convert both ways exactly (either naming of the text side); the checkpointer, given the three
conversion functions as a whole-model type, loads the folder and saves one transformers reads back with the same
logits (torchtune's LLAMA4 and our older LLAMA4_VISION); the published vision encoder (Scout's and Maverick's, the
same) and the whole models of torchtune's size builders (Scout, Maverick) have transformers' parameter counts and
tensor shapes on the meta device (nothing downloads); the LoRA Scout builder puts adapters where its switches say.
"""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.llama4 import modeling_llama4 as hf_llama4

from torchtune_lit.models.convert_weights import CheckpointConversionError
from torchtune_lit.models.llama4 import (
    LLAMA4_PATCH_TOKEN,
    llama4_conversion_args,
    llama4_from_hf_config,
    llama4_hf_to_tune,
    llama4_maverick_17b_128e,
    llama4_scout_17b_16e,
    llama4_tune_to_hf,
    llama4_vision_encoder,
    llama4_vision_encoder_from_hf_config,
    lora_llama4_scout_17b_16e,
)
from torchtune_lit.training import checkpointing
from torchtune_lit.training.checkpointing import FullModelHFCheckpointer

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
            attention_chunk_size=4, floor_scale=4, attn_scale=0.5, num_local_experts=4, num_experts_per_tok=1,
            moe_layers=[1, 2], no_rope_layer_interval=2, use_qk_norm=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16))
VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
              patch_size=7, projector_input_dim=24, projector_output_dim=24, vision_output_dim=24)
IMAGE = 100  # the placeholder id in this tiny vocabulary
PER_IMAGE = 4  # (28 // 7) ** 2 patches, 2 x 2 pixel shuffle


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    "Unit-scale random matrices (experts by their input width) and norm gains far from 1."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            fan_in = p.shape[1] if p.dim() == 3 else p.shape[-1]
            p.copy_(noise / fan_in**0.5 if p.dim() >= 2 else 1.0 + 0.5 * noise)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    "(ours, transformers' model, the checkpoint's tensors, its config.json dict, its folder)."
    config = transformers.Llama4Config(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE)
    config._attn_implementation = "eager"
    theirs = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize_(theirs)
    folder = tmp_path_factory.mktemp("llama4_vision")
    theirs.save_pretrained(folder)
    files = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    ours = llama4_from_hf_config(cfg).eval()
    ours.load_state_dict(llama4_hf_to_tune(files, **llama4_conversion_args(cfg)))  # strict
    return ours, theirs, files, cfg, folder


def images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


def tokens_with_images(seed: int) -> torch.Tensor:
    "Two sequences of 14 ids: two images in the first (at 1..8), one in the second (at 6..9)."
    tokens = torch.randint(0, IMAGE, (2, 14), generator=torch.Generator().manual_seed(seed))
    tokens[0, 1:1 + 2 * PER_IMAGE], tokens[1, 6:6 + PER_IMAGE] = IMAGE, IMAGE
    return tokens


def test_encoder_matches_vision_model_and_projector(case):
    ours, theirs, *_ = case
    pixels = images(5, seed=1)
    with torch.no_grad():
        expected = theirs.get_image_features(pixel_values=pixels).pooler_output
        actual = ours.encoders["vision"](pixels)
    assert actual.shape == (5, PER_IMAGE, TEXT["hidden_size"])
    assert expected.abs().max() > 0.5, "weights too small for a meaningful comparison"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_logits_with_images_match_transformers(case):
    ours, theirs, *_ = case
    tokens, pixels = tokens_with_images(seed=2), images(3, seed=3)
    with torch.no_grad():
        expected = theirs(input_ids=tokens, pixel_values=pixels).logits
        actual = ours(tokens, encoder_input={"vision": {"images": pixels}})
        moved = ours(tokens, encoder_input={"vision": {"images": images(3, seed=4)}})
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert (moved - actual)[:, 10:].abs().max() > 0.1, "the pixels must reach the logits"


def test_text_only_logits_match_transformers(case):
    ours, theirs, *_ = case
    tokens = torch.randint(0, IMAGE, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, actual = theirs(input_ids=tokens).logits, ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_kv_cache_decoding_after_an_image_prompt_matches_the_full_forward(case):
    ours, *_ = case
    tokens, pixels = tokens_with_images(seed=6), images(3, seed=7)
    with torch.no_grad():
        full = ours(tokens, encoder_input={"vision": {"images": pixels}})
        ours.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        try:
            steps = [ours(tokens[:, :10], encoder_input={"vision": {"images": pixels}})]
            steps += [ours(tokens[:, t:t + 1]) for t in range(10, 14)]
        finally:
            ours.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_placeholders_without_their_images_are_refused(case):
    "Before, the placeholder positions kept uninitialised memory (no error)."
    ours, *_ = case
    with pytest.raises(ValueError, match=r"tokens hold 12 placeholders \(id 100\) but encoder_input has no 'vision'"):
        ours(tokens_with_images(seed=10))


@pytest.mark.parametrize("n_images", [2, 4])
def test_image_vectors_must_match_the_placeholders(case, n_images):
    "Too few or too many images for the 12 placeholders: both refused, naming both counts (transformers raises too)."
    ours, theirs, *_ = case
    tokens, pixels = tokens_with_images(seed=11), images(n_images, seed=12)
    with pytest.raises(ValueError, match=f"returned {n_images * PER_IMAGE} vectors for 12 placeholder tokens"):
        ours(tokens, encoder_input={"vision": {"images": pixels}})
    with pytest.raises(ValueError):
        theirs(input_ids=tokens, pixel_values=pixels)


@pytest.mark.parametrize("size", [21, 32])
def test_images_that_are_not_one_tile_are_refused(case, size):
    "A 32 x 32 image passed the tile-28 tower silently, a 21 x 21 one failed with a bare RuntimeError."
    ours, *_ = case
    pixels = torch.randn(1, 3, size, size)
    with pytest.raises(ValueError, match=f"images are {size}x{size} pixels, the tower takes 28x28 tiles"):
        ours.encoders["vision"](pixels)
    tower = ours.encoders["vision"]  # built without tile_size, the tile size comes from the tower's patch grid
    assert type(tower)(tower.clip, tower.projection).tile_size == tower.tile_size == 28


def test_keys_convert_both_ways_exactly(case):
    ours, _, files, cfg, _ = case
    args = llama4_conversion_args(cfg)
    converted = llama4_hf_to_tune(files, **args)
    assert converted.keys() == ours.state_dict().keys()
    back = llama4_tune_to_hf(converted, **args)
    assert back.keys() == files.keys()
    assert all(torch.equal(back[k], files[k]) for k in files)


def test_newer_names_convert_to_the_same_state_dict(case):
    "transformers' in-memory names (model.language_model., model.vision_model., lm_head.) read as the saved ones."
    _, _, files, cfg, _ = case
    args = llama4_conversion_args(cfg)
    renamed = {}
    for key, value in files.items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key == "language_model.lm_head.weight":
            key = "lm_head.weight"
        else:
            key = "model." + key
        renamed[key] = value
    expected, actual = llama4_hf_to_tune(files, **args), llama4_hf_to_tune(renamed, **args)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def test_unknown_keys_are_named(case):
    _, _, files, cfg, _ = case
    args = llama4_conversion_args(cfg)
    with pytest.raises(CheckpointConversionError, match="vision_model.mystery"):
        llama4_hf_to_tune({**files, "vision_model.mystery.weight": torch.zeros(1)}, **args)
    with pytest.raises(CheckpointConversionError, match="encoders.audio"):
        llama4_tune_to_hf({"encoders.audio.w": torch.zeros(1)}, **args)


def test_configs_the_builder_cannot_express_are_refused(case):
    *_, cfg, _ = case
    odd = {**cfg, "vision_config": {**cfg["vision_config"], "intermediate_size": 48}}
    with pytest.raises(NotImplementedError, match="intermediate_size"):
        llama4_vision_encoder_from_hf_config(odd)
    with pytest.raises(ValueError, match="model_type 'llama4'"):
        llama4_from_hf_config({**cfg, "model_type": "llama4_text"})


def test_trainable_parts_follow_torchtune(case):
    *_, cfg, _ = case
    model = llama4_from_hf_config(cfg)  # decoder and projection head train, the tower is frozen
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("encoders.vision.clip.")}
    assert model.encoder_tokens == {"vision": IMAGE}
    cfg_without_token = {k: v for k, v in cfg.items() if k != "image_token_index"}
    assert llama4_from_hf_config(cfg_without_token).encoder_tokens == {"vision": LLAMA4_PATCH_TOKEN}


@pytest.mark.parametrize("model_type", ["LLAMA4", "LLAMA4_VISION"])
def test_checkpointer_reads_and_writes_the_whole_model(case, tmp_path, model_type):
    """torchtune's LLAMA4 (and our older LLAMA4_VISION) on a multimodal folder: the three functions; the checkpointer
    round-trips through transformers."""
    ours, theirs, _, cfg, folder = case
    assert checkpointing.WHOLE_MODEL_TYPES[model_type] == (
        "llama4", llama4_hf_to_tune, llama4_tune_to_hf, llama4_conversion_args)
    checkpointer = FullModelHFCheckpointer(folder, model_type=model_type, output_dir=tmp_path / "out")
    state = checkpointer.load_checkpoint()["model"]
    assert state.keys() == ours.state_dict().keys() and all(torch.equal(state[k], v)
                                                             for k, v in ours.state_dict().items())
    saved = checkpointer.save_checkpoint({"model": ours.state_dict()}, epoch=0)
    reloaded = transformers.Llama4ForConditionalGeneration.from_pretrained(saved, attn_implementation="eager").eval()
    tokens, pixels = tokens_with_images(seed=8), images(3, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens, pixel_values=pixels).logits,
                                   theirs(input_ids=tokens, pixel_values=pixels).logits, atol=1e-5, rtol=1e-5)


# the vision_config of meta-llama/Llama-4-Scout-17B-16E's and -Maverick-17B-128E's config.json (the same in both)
PUBLISHED_VISION = dict(hidden_size=1408, num_hidden_layers=34, num_attention_heads=16, intermediate_size=5632,
                        image_size=336, patch_size=14, projector_input_dim=4096, projector_output_dim=4096,
                        vision_output_dim=4096, pixel_shuffle_ratio=0.5)
SCOUT_TEXT = dict(vocab_size=202_048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16_384,
                  num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                  attention_chunk_size=8192, num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
                  max_position_embeddings=10_485_760,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=16.0, low_freq_factor=1.0,
                                       high_freq_factor=1.0, original_max_position_embeddings=8192))
count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731


def test_published_vision_encoder_has_transformers_parameters():
    config = transformers.Llama4Config(vision_config=PUBLISHED_VISION, text_config=dict(hidden_size=5120))
    with torch.device("meta"):
        ours = llama4_vision_encoder(patch_size=14, num_heads=16, clip_embed_dim=1408, clip_num_layers=34,
                                     projection_embed_dim=4096, decoder_embed_dim=5120, tile_size=336,
                                     max_num_tiles=16)
        vision, projector = hf_llama4.Llama4VisionModel(config.vision_config), hf_llama4.Llama4MultiModalProjector(config)
        converted = llama4_tune_to_hf({f"encoders.vision.{k}": v for k, v in ours.state_dict().items()},
                                      **llama4_conversion_args(config.to_dict()))
    theirs = {**{f"vision_model.{k}": v for k, v in vision.state_dict().items()},
              **{f"multi_modal_projector.{k}": v for k, v in projector.state_dict().items()}}
    assert count(ours) == count(vision) + count(projector)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def test_scout_whole_model_has_transformers_parameter_count():
    config = transformers.Llama4Config(vision_config=PUBLISHED_VISION, text_config=SCOUT_TEXT,
                                       image_token_index=LLAMA4_PATCH_TOKEN)
    with torch.device("meta"):
        ours = llama4_from_hf_config(config.to_dict())
        theirs = transformers.Llama4ForConditionalGeneration(config)
    assert count(ours) == count(theirs)


MAVERICK_TEXT = dict(SCOUT_TEXT, num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False,
                     max_position_embeddings=1_048_576, rope_parameters=dict(rope_type="default", rope_theta=500_000.0))


@pytest.mark.parametrize("builder, text", [(llama4_scout_17b_16e, SCOUT_TEXT), (llama4_maverick_17b_128e, MAVERICK_TEXT)],
                         ids=["scout", "maverick"])
def test_size_builders_are_the_whole_model_with_transformers_parameters(builder, text):
    """torchtune's size builders return the whole model: its parameter count and, converted, its tensor names and
    shapes are those of transformers' Llama4ForConditionalGeneration of the published config (meta device)."""
    config = transformers.Llama4Config(vision_config=PUBLISHED_VISION, text_config=text,
                                       image_token_index=LLAMA4_PATCH_TOKEN)
    with torch.device("meta"):
        ours, theirs = builder(), transformers.Llama4ForConditionalGeneration(config)
        converted = llama4_tune_to_hf(ours.state_dict(), **llama4_conversion_args(config.to_dict()))
    assert count(ours) == count(theirs)
    # (the save_pretrained names of the text side differ from the module names: compare the tensors' shapes)
    assert sorted(tuple(v.shape) for v in converted.values()) == sorted(
        tuple(v.shape) for v in theirs.state_dict().values())
    assert ours.encoder_tokens == {"vision": LLAMA4_PATCH_TOKEN}
    trains = {n.split(".")[0] + (".clip" if ".clip." in n else "") for n, p in ours.named_parameters() if p.requires_grad}
    assert trains == {"decoder", "encoders"}  # torchtune's defaults: the decoder and the head, the tower frozen


def test_lora_scout_takes_torchtunes_arguments():
    """lora_llama4_scout_17b_16e: the plain model's keys plus adapters, where each part's switch puts them; 'full'
    and unknown kinds are refused, naming the argument."""
    with torch.device("meta"):
        plain = llama4_scout_17b_16e(image_size=112)
        default = lora_llama4_scout_17b_16e(["q_proj"], apply_lora_to_output=True, image_size=112)
        tower = lora_llama4_scout_17b_16e(["q_proj"], decoder_trainable="frozen", encoder_trainable="lora",
                                          fusion_trainable="frozen", image_size=112)
    for model in (default, tower):
        adapters = {k for k in model.state_dict() if ".lora_" in k}
        assert model.state_dict().keys() - adapters == plain.state_dict().keys()
    parts = lambda m: {k.split(".lora_")[0].split(".")[2] if k.startswith("encoders") else "decoder"  # noqa: E731
                       for k in m.state_dict() if ".lora_" in k}
    assert parts(default) == {"decoder", "projection"} and parts(tower) == {"clip"}
    frozen = {n for n, p in tower.named_parameters() if not p.requires_grad}  # fusion "frozen": the head too
    assert frozen == {n for n, _ in tower.named_parameters() if n.startswith(("decoder.", "encoders.vision.projection."))}
    with pytest.raises(ValueError, match="decoder_trainable='full'"):
        lora_llama4_scout_17b_16e(["q_proj"], decoder_trainable="full")
    with pytest.raises(ValueError, match="fusion_trainable='adapters'"):
        lora_llama4_scout_17b_16e(["q_proj"], fusion_trainable="adapters")
