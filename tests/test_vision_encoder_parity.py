"""Llama 3.2 Vision's image encoder against transformers' Mllama on the same weights.

A tiny `MllamaForConditionalGeneration` gets random vision weights (gates included, which start at zero and would
hide the tile tables) with tile tables laid out as Meta's checkpoints are (one entry per tile position, copied into
each aspect ratio's row). Its vision weights are loaded into `llama3_2_vision_encoder` through
`vision_encoder_hf_to_tune`; the encoder's output must equal `vision_model` + `multi_modal_projector` (reshaped as
`MllamaModel` does) within 1e-5 in fp32, with padded tiles in the batch. The conversions must round-trip exactly,
and the 11B / 90B encoders' parameter counts must equal transformers' up to the tile tables' two layouts.
"""
import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

from transformers.models.mllama.modeling_mllama import MllamaVisionModel  # noqa: E402

from torchtune_lit.models.llama3_2_vision._encoder import (  # noqa: E402
    llama3_2_vision_encoder,
    supported_aspect_ratios,
    vision_encoder_hf_to_tune,
    vision_encoder_tune_to_hf,
)

VISION = dict(hidden_size=32, num_hidden_layers=3, num_global_layers=2, attention_heads=4, intermediate_size=128,
              image_size=28, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[0, 2],
              vision_output_dim=96, norm_eps=1e-5)
TEXT = dict(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf_model(attn: str) -> "transformers.MllamaForConditionalGeneration":
    config = transformers.MllamaConfig(vision_config=VISION, text_config=TEXT)
    config.vision_config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    vision, gen = model.model.vision_model, torch.Generator().manual_seed(1)
    ratios = [tuple(r) for r in config.vision_config.supported_aspect_ratios]
    d, n = VISION["hidden_size"], 5
    with torch.no_grad():
        for name, p in vision.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + ("norm" in name and name.endswith("weight")))
        for name, width in [("pre_tile_positional_embedding.embedding.weight", d),
                            ("post_tile_positional_embedding.embedding.weight", d),
                            ("gated_positional_embedding.tile_embedding.weight", n * d)]:
            per_position = 0.3 * torch.randn(4, 4, width, generator=gen)
            rows = torch.zeros(len(ratios) + 1, 4, width)
            for k, (h, w) in enumerate(ratios, start=1):
                for tile in range(h * w):
                    rows[k, tile] = per_position[tile // w, tile % w]
            vision.get_parameter(name).copy_(rows.flatten(1))
    return model


def _ours(**changes):
    settings = dict(patch_size=14, num_heads=4, clip_embed_dim=32, clip_num_layers=3,
                    # transformers 5.25 records layer outputs; torchtune's indices name layer inputs
                    clip_hidden_states=[i + 1 for i in VISION["intermediate_layers_indices"]],
                    num_layers_projection=2, decoder_embed_dim=48, tile_size=28, max_num_tiles=4)
    return llama3_2_vision_encoder(**{**settings, **changes}).eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_encoder_matches_transformers(attn):
    hf = _hf_model(attn)
    ratios = [tuple(r) for r in hf.config.vision_config.supported_aspect_ratios]
    ours = _ours()
    ours.load_state_dict(vision_encoder_hf_to_tune(hf.state_dict(), prefix=""))
    gen = torch.Generator().manual_seed(2)
    pixels = torch.randn(2, 2, 4, 3, 28, 28, generator=gen)  # 2 samples x 2 images x 4 tile slots
    grids = [[(1, 2), (2, 2)], [(4, 1), (1, 1)]]
    aspect_ratio = torch.tensor(grids)
    ids = torch.tensor([[ratios.index(g) + 1 for g in row] for row in grids])
    tile_mask = (torch.arange(4) < aspect_ratio.prod(-1)[..., None]).long()
    with torch.no_grad():
        states = hf.model.vision_model(pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=tile_mask)
        theirs = hf.model.multi_modal_projector(states.last_hidden_state).reshape(2, -1, TEXT["hidden_size"])
        mine = ours(pixels, aspect_ratio)
    assert mine.shape == (2, 2 * 4 * 5, 48)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_conversions_round_trip_exactly():
    hf = _hf_model("eager")
    hf_vision = {k: v for k, v in hf.state_dict().items()
                 if k.startswith(("model.vision_model.", "model.multi_modal_projector."))}
    back = vision_encoder_tune_to_hf(vision_encoder_hf_to_tune(hf.state_dict()))
    assert back.keys() == hf_vision.keys() and all(torch.equal(back[k], hf_vision[k]) for k in hf_vision)
    # the hub files' names (no leading "model.") convert to the same tensors
    hub = {k.removeprefix("model."): v for k, v in hf_vision.items()}
    ours = vision_encoder_hf_to_tune(hf_vision)
    assert all(torch.equal(vision_encoder_hf_to_tune(hub)[k], v) for k, v in ours.items())
    encoder = _ours()
    encoder.load_state_dict(vision_encoder_hf_to_tune(hf_vision, prefix=""))
    sd = encoder.state_dict()
    again = vision_encoder_hf_to_tune(vision_encoder_tune_to_hf(sd, prefix=""), prefix="")
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


def test_inconsistent_tile_table_and_unknown_key_are_refused():
    sd = dict(_hf_model("eager").state_dict())
    key = "model.vision_model.post_tile_positional_embedding.embedding.weight"
    sd[key] = torch.randn(sd[key].shape)
    with pytest.raises(ValueError, match="post_tile_pos_embed"):
        vision_encoder_hf_to_tune(sd)
    with pytest.raises(ValueError, match="unknown key"):
        vision_encoder_hf_to_tune({"model.vision_model.transformer.layers.0.extra.weight": torch.zeros(1)})


@pytest.mark.parametrize("decoder_dim", [4096, 8192])  # 11B, 90B
def test_real_sizes_match_transformers(decoder_dim):
    real = transformers.MllamaVisionConfig(
        hidden_size=1280, num_hidden_layers=32, num_global_layers=8, attention_heads=16, intermediate_size=5120,
        image_size=560, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[3, 7, 15, 23, 30],
        vision_output_dim=7680)

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        theirs = count(MllamaVisionModel(real)) + count(nn.Linear(7680, decoder_dim))
        ours = count(llama3_2_vision_encoder(
            patch_size=14, num_heads=16, clip_embed_dim=1280, clip_num_layers=32,
            clip_hidden_states=[3, 7, 15, 23, 30], num_layers_projection=8, decoder_embed_dim=decoder_dim,
            tile_size=560, max_num_tiles=4))
    rows = len(supported_aspect_ratios(4)) + 1
    theirs_tables = 2 * rows * 4 * 1280 + rows * 4 * 1601 * 1280
    ours_tables = 2 * 16 * 1280 + 16 * 1601 * 1280
    assert ours == theirs - theirs_tables + ours_tables


def _tiny_encoder() -> nn.Module:
    return llama3_2_vision_encoder(
        patch_size=14, num_heads=4, clip_embed_dim=32, clip_num_layers=2, clip_hidden_states=[1],
        num_layers_projection=1, decoder_embed_dim=48, tile_size=28, max_num_tiles=4,
    ).eval()


def test_bad_tile_grids_are_refused():
    """A tiled tower without `aspect_ratio`, a grid with more tiles than the images hold, or a side above
    max_num_tiles: one-line ValueErrors instead of an AttributeError or a silent crop by F.pad."""
    encoder, images = _tiny_encoder(), torch.randn(1, 1, 4, 3, 28, 28)
    with pytest.raises(ValueError, match="pass aspect_ratio"):
        encoder(images)
    with pytest.raises(ValueError, match=r"\(3, 2\) needs 6 tiles but the images hold 4"):
        encoder(images, aspect_ratio=torch.tensor([[[3, 2]]]))
    with pytest.raises(ValueError, match="max_num_tiles >= 5"):
        encoder(torch.randn(1, 1, 5, 3, 28, 28), aspect_ratio=torch.tensor([[[1, 5]]]))
    with pytest.raises(ValueError, match=r"\(1, -1\)"):
        encoder(images, aspect_ratio=torch.tensor([[[1, -1]]]))
    with pytest.raises(ValueError) as error:
        encoder(images)
    assert "\n" not in str(error.value)  # one line


def test_padding_mask_is_built_on_the_images_device():
    """The padding mask follows the images' device: on the meta device (no data), the mask the projection head
    receives is a meta tensor, and so is the encoder's output (a CPU mask would fail or be copied each step)."""
    with torch.device("meta"):
        encoder = _tiny_encoder()
    seen = []
    encoder.projection.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["mask"]), with_kwargs=True)
    out = encoder(torch.empty(2, 1, 4, 3, 28, 28, device="meta"), aspect_ratio=torch.tensor([[[1, 2]], [[2, 2]]]))
    assert seen[0].device.type == "meta" and seen[0].shape == (2, 4 * 8, 4 * 8)
    assert out.device.type == "meta" and out.shape == (2, 4 * 5, 48)
    meta_grid = torch.tensor([[1, 2], [2, 2]], device="meta")
    assert encoder.clip.attention_mask(meta_grid, 2, 4, device=torch.device("meta")).device.type == "meta"
