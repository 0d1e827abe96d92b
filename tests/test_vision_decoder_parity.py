"""Llama 3.2 Vision's decoder against transformers' `MllamaForConditionalGeneration` (issue #41).

A tiny random Mllama checkpoint written by transformers (`save_pretrained`), read back from its files through our
conversion: logits within 1e-4 in fp32 for a text-only batch and for a batch with image tokens (the same random
encoder output fed to both as `cross_attention_states` / `encoder_input`, Hugging Face's tile mask converted to ours),
KV-cache decoding equal to the full forward, the conversion both ways, the whole model with an image (the encoder of
chapter 35a), and the parameter counts of the 11B and 90B builders against transformers' model of the published
configs, built on the meta device.
"""
import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from torchtune_lit.models import build_from_hf_config
from torchtune_lit.models.convert_weights import CheckpointConversionError
from torchtune_lit.models.llama3_2_vision import (
    llama3_2_vision_11b,
    llama3_2_vision_90b,
    llama3_2_vision_config,
    llama3_2_vision_decoder,
    llama3_2_vision_decoder_from_hf_config,
    llama3_vision_hf_to_tune,
    llama3_vision_tune_to_hf,
    lora_llama3_2_vision_decoder,
    vision_decoder_hf_to_tune,
    vision_decoder_tune_to_hf,
)
from torchtune_lit.modules.model_fusion import DeepFusionModel

transformers = pytest.importorskip("transformers")
for _name in ("torchao", "torch.utils._pytree", "transformers"):
    logging.getLogger(_name).setLevel(logging.ERROR)

TEXT = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=6, cross_attention_layers=[1, 4], num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, pad_token_id=299, bos_token_id=1,
    eos_token_id=2, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# a tiny vision side (28x28 tiles of 14x14 patches: 4 patches + CLS = 5 tokens per tile)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=128,
              image_size=28, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[0, 1], vision_output_dim=96)
DIMS = dict(num_heads=4, num_kv_heads=2, dim=64, cross_attention_layers=[1, 4])
TOKENS_PER_TILE = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A random MllamaForConditionalGeneration (gates open, weights large enough to matter), saved by transformers."
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    config = MllamaConfig(text_config=TEXT, vision_config=VISION)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name:
                p.uniform_(0.5, 1.0)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
        # the tile tables as a real checkpoint has them: each aspect ratio's row read from one grid of tile positions
        ratios, tiles = config.vision_config.supported_aspect_ratios, VISION["max_num_tiles"]
        vision = model.model.vision_model
        for table in (vision.pre_tile_positional_embedding.embedding, vision.post_tile_positional_embedding.embedding,
                      vision.gated_positional_embedding.tile_embedding):
            grid = torch.randn(tiles, tiles, table.weight.shape[1] // tiles) * 0.5
            table.weight.zero_()
            for k, (h, w) in enumerate(ratios, start=1):
                table.weight[k, : h * w * grid.shape[-1]] = grid[:h, :w].reshape(-1)
    folder = tmp_path_factory.mktemp("mllama")
    model.save_pretrained(folder)
    config_json = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    model.config._attn_implementation = "eager"
    return model, config_json, state


@pytest.fixture(scope="module")
def decoder(checkpoint):
    "Our decoder built from the saved config.json's text_config, loaded from the saved weights (strict)."
    _, config_json, state = checkpoint
    model = llama3_2_vision_decoder_from_hf_config(config_json["text_config"]).eval()
    model.load_state_dict(vision_decoder_hf_to_tune(state, vocab_size=300, **DIMS))
    return model


def encoder_mask_from_hf(cross_attention_mask: torch.Tensor, tokens_per_tile: int) -> torch.Tensor:
    "Hugging Face's [b, s, images, tiles] 0/1 mask -> ours, [b, s, images * tiles * tokens_per_tile] bool."
    b, s = cross_attention_mask.shape[:2]
    return cross_attention_mask.repeat_interleave(tokens_per_tile, dim=3).reshape(b, s, -1).bool()


def image_inputs(seed: int = 1):
    "Tokens, a random encoder output (2 images x 4 tiles x 5 tokens) and a tile mask where each token sees a tile."
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 300, (2, 11), generator=g)
    tiles = torch.randint(0, 2, (2, 11, 2, 4), generator=g)
    tiles[:, :, 0, 0] = 1
    states = torch.randn(2, 2 * 4 * TOKENS_PER_TILE, 64, generator=g)
    return tokens, tiles, states


def test_saved_checkpoint_uses_the_hub_names(checkpoint):
    "transformers 5 saves the Hub's names (language_model.model.*), which differ from its state_dict()'s."
    hf_model, _, state = checkpoint
    assert "language_model.lm_head.weight" in state and "language_model.model.norm.weight" in state
    assert "lm_head.weight" in hf_model.state_dict()


def test_text_only_logits(checkpoint, decoder):
    "(a) No image: transformers skips its cross-attention layers, and so do we."
    hf_model, _, _ = checkpoint
    tokens = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = hf_model(input_ids=tokens).logits, decoder(tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_logits_with_image_tokens(checkpoint, decoder):
    "(b) The same encoder output as cross_attention_states (HF) and encoder_input (ours), masks converted."
    hf_model, _, _ = checkpoint
    tokens, tiles, states = image_inputs()
    with torch.no_grad():
        expected = hf_model(input_ids=tokens, cross_attention_states=states, cross_attention_mask=tiles).logits
        actual = decoder(tokens, encoder_input=states, encoder_mask=encoder_mask_from_hf(tiles, TOKENS_PER_TILE))
        text_only = decoder(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert (actual - text_only).abs().max() > 1e-2  # the image changes the logits


def test_kv_cache_decoding_equals_full_forward(decoder):
    "Prompt with the image, then one token at a time without it: cached image keys, same logits."
    tokens, tiles, states = image_inputs(seed=2)
    mask = encoder_mask_from_hf(tiles, TOKENS_PER_TILE)
    causal = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 11, 11)
    with torch.no_grad():
        full = decoder(tokens, encoder_input=states, encoder_mask=mask)
        decoder.setup_caches(2, torch.float32, encoder_max_seq_len=64, decoder_max_seq_len=16)
        try:
            steps = [decoder(tokens[:, :3], mask=causal[:, :3], encoder_input=states, encoder_mask=mask[:, :3],
                             input_pos=torch.arange(3))]
            for t in range(3, 11):
                steps.append(decoder(tokens[:, t:t + 1], mask=causal[:, t:t + 1], encoder_mask=mask[:, t:t + 1],
                                     input_pos=torch.tensor([t])))
            assert decoder.caches_are_enabled()
            cross_caches = [m.kv_cache.size for n, m in decoder.named_modules() if n.endswith("fusion_layer.attn")]
            assert cross_caches == [40, 40]  # the image's keys, stored once
        finally:
            decoder.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_conversion_round_trip_and_hub_names(checkpoint):
    "tune_to_hf writes exactly what save_pretrained wrote; transformers 5's in-memory names convert the same."
    hf_model, _, state = checkpoint
    text = {k: v for k, v in state.items() if k.startswith("language_model.")}
    ours = vision_decoder_hf_to_tune(state, vocab_size=300, **DIMS)
    back = vision_decoder_tune_to_hf(ours, **DIMS)
    assert back.keys() == text.keys() and all(torch.equal(back[k], text[k]) for k in text)
    in_memory = vision_decoder_hf_to_tune(hf_model.state_dict(), vocab_size=300, **DIMS)
    assert in_memory.keys() == ours.keys() and all(torch.equal(in_memory[k], ours[k]) for k in ours)


def test_torchtune_builder_is_the_same_model(checkpoint, decoder):
    "llama3_2_vision_decoder(num_layers=4, fusion_interval=2) takes the converted weights and gives the same logits."
    _, _, state = checkpoint
    built = llama3_2_vision_decoder(vocab_size=300, num_layers=4, fusion_interval=2, num_special_tokens=8, num_heads=4,
                                    num_kv_heads=2, embed_dim=64, max_seq_len=256, encoder_max_seq_len=40,
                                    intermediate_dim=128).eval()
    built.load_state_dict(vision_decoder_hf_to_tune(state, vocab_size=300, **DIMS))
    tokens, tiles, states = image_inputs(seed=3)
    mask = encoder_mask_from_hf(tiles, TOKENS_PER_TILE)
    with torch.no_grad():
        torch.testing.assert_close(built(tokens, encoder_input=states, encoder_mask=mask),
                                   decoder(tokens, encoder_input=states, encoder_mask=mask), atol=1e-5, rtol=1e-5)


def test_bad_inputs():
    "A cross-attention layer with no text layer after it, and a key the model does not have, are refused by name."
    with pytest.raises(NotImplementedError, match="layer 3 is not followed"):
        llama3_2_vision_decoder_from_hf_config({**TEXT, "num_hidden_layers": 4, "cross_attention_layers": [1, 3]})
    with pytest.raises(CheckpointConversionError, match="model.language_model.layers.0.self_attn.extra.weight"):
        vision_decoder_hf_to_tune({"model.language_model.layers.0.self_attn.extra.weight": torch.zeros(1)},
                                  vocab_size=300, **DIMS)
    with pytest.raises(ValueError, match=r"size='llama3_2_vision_3b'.*\['llama3_2_vision_11b', 'llama3_2_vision_90b'\]"):
        llama3_2_vision_config("llama3_2_vision_3b")


# the published text_config of each size (meta-llama/Llama-3.2-11B-Vision and -90B-Vision config.json)
PUBLISHED_TEXT = {
    "11b": dict(vocab_size=128_256, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14_336, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38]),
    "90b": dict(vocab_size=128_256, hidden_size=8192, num_hidden_layers=100, num_attention_heads=64,
                num_key_value_heads=8, intermediate_size=28_672, cross_attention_layers=list(range(3, 100, 5))),
}
TUNE_SIZES = {
    "11b": dict(num_layers=32, num_heads=32, embed_dim=4096, intermediate_dim=14_336),
    "90b": dict(num_layers=80, num_heads=64, embed_dim=8192, intermediate_dim=28_672),
}


@pytest.mark.parametrize("size", ["11b", "90b"])
def test_decoder_parameter_count(size):
    "The decoder of torchtune's sizes has exactly the parameters of transformers' text model (with lm_head)."
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    numbers = dict(PUBLISHED_TEXT[size], max_position_embeddings=131_072, pad_token_id=128_004, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with torch.device("meta"):
        hf_model = MllamaForConditionalGeneration(MllamaConfig(text_config=numbers))
        ours = llama3_2_vision_decoder(vocab_size=128_256, fusion_interval=4, num_special_tokens=8, num_kv_heads=8,
                                       max_seq_len=131_072, encoder_max_seq_len=128_080, rope_base=500_000,
                                       **TUNE_SIZES[size])
    expected = sum(p.numel() for n, p in hf_model.named_parameters() if "language_model" in n or "lm_head" in n)
    assert sum(p.numel() for p in ours.parameters()) == expected


def test_whole_model_with_an_image(checkpoint):
    """(c) The whole model: pixels, aspect ratios and the tile mask through transformers and our DeepFusionModel.

    transformers 5.25's vision encoder keeps the *outputs* of the layers `intermediate_layers_indices` names, where
    Meta's reference code, transformers 4 and torchtune keep their *inputs* (see the encoder chapter, 35a): to compare
    with transformers 5.25 our model is built with those indices plus one. The weights are the same."""
    hf_model, config_json, state = checkpoint
    ratios = [tuple(r) for r in config_json["vision_config"]["supported_aspect_ratios"]]
    vision = dict(config_json["vision_config"])
    vision["intermediate_layers_indices"] = [i + 1 for i in vision["intermediate_layers_indices"]]
    # built through the public entry point, which sends model_type "mllama" to llama3_2_vision_from_hf_config
    model = build_from_hf_config({**config_json, "vision_config": vision}).eval()
    assert isinstance(model, DeepFusionModel)
    ours = llama3_vision_hf_to_tune(state, vocab_size=300, supported_aspect_ratios=ratios, **DIMS)
    model.load_state_dict(ours)
    back = llama3_vision_tune_to_hf(ours, supported_aspect_ratios=ratios, **DIMS)  # the file's names and weights
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 300, (2, 9), generator=g)
    pixels = torch.randn(2, 1, 4, 3, 28, 28, generator=g)  # one image of up to 4 tiles per sample
    ratio_ids = torch.tensor([[6], [2]])  # (2, 2) and (1, 2) tiles: ids are 1 + their index in `ratios`
    grids = torch.tensor([[ratios[i - 1]] for i in ratio_ids[:, 0].tolist()])
    tile_mask = torch.zeros(2, 1, 4, dtype=torch.long)
    tile_mask[0, 0, :4], tile_mask[1, 0, :2] = 1, 1
    tiles = tile_mask[:, None].expand(2, 9, 1, 4).clone()  # every token sees the image's real tiles
    with torch.no_grad():
        expected = hf_model(input_ids=tokens, pixel_values=pixels, aspect_ratio_ids=ratio_ids,
                            aspect_ratio_mask=tile_mask, cross_attention_mask=tiles).logits
        actual = model(tokens, encoder_input={"images": pixels, "aspect_ratio": grids},
                       encoder_mask=encoder_mask_from_hf(tiles, TOKENS_PER_TILE))
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


PUBLISHED_VISION = dict(hidden_size=1280, num_hidden_layers=32, num_global_layers=8, attention_heads=16,
                        intermediate_size=5120, vision_output_dim=7680, image_size=560, patch_size=14, max_num_tiles=4,
                        intermediate_layers_indices=[3, 7, 15, 23, 30])


@pytest.mark.parametrize("size", ["11b", "90b"])
def test_whole_model_parameter_count(size):
    """The whole model against transformers' of the published config. The only difference is by design: transformers
    stores the three tile tables with one row of 4 tiles per aspect ratio (9 rows, 36 tile entries) where torchtune
    (and we) store a 4 x 4 grid of tile positions (16 entries): the difference is derived below."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    numbers = dict(PUBLISHED_TEXT[size], max_position_embeddings=131_072, pad_token_id=128_004)
    with torch.device("meta"):
        hf_model = MllamaForConditionalGeneration(MllamaConfig(text_config=numbers, vision_config=PUBLISHED_VISION))
        ours = {"11b": llama3_2_vision_11b, "90b": llama3_2_vision_90b}[size]()
    tiles, width, tokens = 4, 1280, (560 // 14) ** 2 + 1
    per_tile = tokens * width + 2 * width  # a tile's entries in the token table and the pre- and post-tile tables
    rows_hf = len(hf_model.config.vision_config.supported_aspect_ratios) + 1  # 9 rows of 4 tiles each
    expected = sum(p.numel() for p in hf_model.parameters()) - rows_hf * tiles * per_tile + tiles * tiles * per_tile
    assert sum(p.numel() for p in ours.parameters()) == expected


def test_lora_decoder_starts_as_the_base(checkpoint, decoder):
    "torchtune's lora_llama3_2_vision_decoder: adapters in both kinds of layer, the base model's logits at the start."
    _, _, state = checkpoint
    lora = lora_llama3_2_vision_decoder(
        decoder_lora=True, fusion_lora=True, lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True,
        apply_lora_to_output=True, vocab_size=300, num_layers=4, fusion_interval=2,
        num_special_tokens=8, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256, encoder_max_seq_len=40,
        intermediate_dim=128).eval()
    missing, unexpected = lora.load_state_dict(vision_decoder_hf_to_tune(state, vocab_size=300, **DIMS), strict=False)
    assert not unexpected and missing and all("lora_" in k for k in missing)
    adapted = {k.rsplit(".lora_a", 1)[0] for k in missing if ".lora_a" in k}
    assert "layers.1.fusion_layer.attn.q_proj" in adapted and "layers.1.layer.attn.v_proj" in adapted
    assert "layers.0.mlp.w3" in adapted and "output" in adapted and "layers.0.attn.k_proj" not in adapted
    tokens, tiles, states = image_inputs(seed=5)
    mask = encoder_mask_from_hf(tiles, TOKENS_PER_TILE)
    with torch.no_grad():
        expected = decoder(tokens, encoder_input=states, encoder_mask=mask)
        actual = lora(tokens, encoder_input=states, encoder_mask=mask)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
