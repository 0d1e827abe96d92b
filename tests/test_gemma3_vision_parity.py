"""Gemma 3 with its vision tower against transformers' `Gemma3ForConditionalGeneration` (issue #41).

A tiny random checkpoint written by transformers (`save_pretrained`, fp32, eager attention: a SigLIP of width 24 with
two layers over 28-pixel images in 7-pixel patches, pooled to four tokens per image; a Gemma 3 decoder of width 32
whose first two layers are windowed to 4 positions), read back from its files through our conversion: the tower +
projector output, the logits with images (two in one row, `token_type_ids` given to transformers) and text alone,
all within 1e-4; KV-cache decoding with an image equal to the full forward; the conversion both ways bit for bit
(either naming of the tower) and the written names reloaded by transformers; the parameter counts of the 4B, 12B and
27B builders against transformers' model of the published configs on the meta device; and the refusals.
"""
import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtune_lit.models.convert_weights import CheckpointConversionError
from torchtune_lit.models.gemma3 import gemma3_4b, gemma3_12b, gemma3_27b
from torchtune_lit.models.gemma3._vision import (
    Gemma3EarlyFusionModel,
    gemma3_conversion_args,
    gemma3_image_mask,
    gemma3_vision_4b,
    gemma3_vision_12b,
    gemma3_vision_27b,
    gemma3_vision_config,
    gemma3_vision_encoder,
    gemma3_vision_from_hf_config,
    gemma3_vision_hf_to_tune,
    gemma3_vision_tune_to_hf,
)
from torchtune_lit.modules.model_fusion import get_fusion_params
from torchtune_lit.training import checkpointing

transformers = pytest.importorskip("transformers")
for _name in ("torchao", "torch.utils._pytree", "transformers"):
    logging.getLogger(_name).setLevel(logging.ERROR)

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention"] * 2 + ["full_attention"])
VISION = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=7, vision_use_head=False)
IMAGE_ID = 100
TEXT_BUILDERS = {"gemma3_4b": gemma3_4b, "gemma3_12b": gemma3_12b, "gemma3_27b": gemma3_27b}
IMG = [98, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 99]  # <start_of_image>, four image tokens, <end_of_image>
TOKENS = torch.tensor([[2, 5, 6, *IMG, 7, 8, 9, 10, *IMG, 11, 12], [2, 13, *IMG, *range(14, 27)]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "(transformers' model, its files, its config.json, our model loaded from the files, three images)."
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                       image_token_index=IMAGE_ID, boi_token_index=98, eoi_token_index=99,
                                       attn_implementation="eager")
    torch.manual_seed(0)
    theirs = transformers.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name or "post_layernorm" in name:  # LayerNorm gains near 1, biases
                p.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.3 * noise)
            elif p.dim() == 1:  # Gemma's 1 + w gains (far from their zero start), biases
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    folder = tmp_path_factory.mktemp("gemma3_vision")
    theirs.save_pretrained(folder)
    files = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    ours = gemma3_vision_from_hf_config(cfg).eval()
    ours.load_state_dict(gemma3_vision_hf_to_tune(files, **gemma3_conversion_args(cfg)), strict=True)
    images = torch.randn(3, 3, 28, 28, generator=gen)
    return theirs, files, cfg, ours, images


def _theirs_logits(theirs, images):
    with torch.no_grad():
        return theirs(input_ids=TOKENS, pixel_values=images, token_type_ids=(TOKENS == IMAGE_ID).long()).logits


def test_tower_and_projector_match_transformers(tiny):
    theirs, _, _, ours, images = tiny
    with torch.no_grad():
        expected = theirs.model.get_image_features(images).pooler_output
        actual = ours.encoder(images)
    assert actual.shape == (3, 4, 32) and expected.abs().max() > 1.0
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_logits_with_images_match_transformers(tiny):
    theirs, _, _, ours, images = tiny
    expected = _theirs_logits(theirs, images)
    with torch.no_grad():
        actual = ours(TOKENS, encoder_input={"images": images})
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_the_bidirectional_block_changes_the_logits(tiny):
    "The check above can fail: a causal mask alone (transformers without token_type_ids too) moves the logits."
    theirs, _, _, ours, images = tiny
    expected = _theirs_logits(theirs, images)
    causal = torch.ones(21, 21, dtype=torch.bool).tril().expand(2, 21, 21)
    with torch.no_grad():
        ours_causal = ours(TOKENS, encoder_input={"images": images}, mask=causal)
        theirs_causal = theirs(input_ids=TOKENS, pixel_values=images).logits
    assert (ours_causal - expected).abs().max() > 0.5
    torch.testing.assert_close(ours_causal, theirs_causal, atol=1e-4, rtol=0)


def test_text_only_logits_match_transformers(tiny):
    theirs, _, _, ours, _ = tiny
    text = torch.randint(0, 98, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(text), theirs(input_ids=text).logits, atol=1e-4, rtol=0)


def test_kv_cache_decoding_with_an_image_matches_the_full_forward(tiny):
    _, _, _, ours, images = tiny
    more = torch.tensor([[30, 31], [32, 33]])
    full_tokens = torch.cat([TOKENS, more], dim=1)
    with torch.no_grad():
        full = ours(full_tokens, encoder_input={"images": images})
        ours.setup_caches(2, torch.float32, decoder_max_seq_len=32)
        try:
            steps = [ours(TOKENS, encoder_input={"images": images}, input_pos=torch.arange(21).expand(2, 21))]
            for i in range(2):
                steps.append(ours(more[:, i : i + 1], input_pos=torch.full((2, 1), 21 + i)))
        finally:
            ours.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_conversion_round_trips_exactly(tiny):
    "transformers 5 writes `vision_tower.`, the Hub `vision_tower.vision_model.`: both read, the Hub's written."
    _, files, cfg, ours, _ = tiny
    args = gemma3_conversion_args(cfg)
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in files.items()}
    state = gemma3_vision_hf_to_tune(files, **args)
    from_hub = gemma3_vision_hf_to_tune(hub, **args)
    assert state.keys() == from_hub.keys() == ours.state_dict().keys()
    assert all(torch.equal(state[k], from_hub[k]) for k in state)
    back = gemma3_vision_tune_to_hf(state, **args)
    assert back.keys() == hub.keys()
    assert all(torch.equal(back[k], hub[k]) for k in back)


def test_written_names_load_in_transformers(tiny, tmp_path):
    theirs, _, cfg, ours, images = tiny
    back = gemma3_vision_tune_to_hf(ours.state_dict(), **gemma3_conversion_args(cfg))
    save_file(back, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    for name, value in theirs.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    torch.testing.assert_close(_theirs_logits(reloaded.eval(), images), _theirs_logits(theirs, images),
                               atol=0, rtol=0)


@pytest.mark.parametrize("size, builder", [("gemma3_4b", gemma3_vision_4b), ("gemma3_12b", gemma3_vision_12b),
                                           ("gemma3_27b", gemma3_vision_27b)])
def test_parameter_counts_equal_transformers(size, builder):
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        ours = builder()
        theirs = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(**gemma3_vision_config(size)))
    assert count(ours.encoder) == count(theirs.model.vision_tower) + count(theirs.model.multi_modal_projector)
    assert count(ours) == count(theirs)
    assert ours.image_token_id == theirs.config.image_token_id == 262_144
    with torch.device("meta"):  # the config's text part is the text chapter's builder
        assert count(ours.decoder) == count(TEXT_BUILDERS[size]())
    if size == "gemma3_4b":
        assert count(ours.encoder) == 419_816_304 and count(ours) == 4_300_079_472


def test_mask_by_hand():
    row = torch.tensor([[5, 98, IMAGE_ID, IMAGE_ID, 99, 6, IMAGE_ID, IMAGE_ID]])
    expected = torch.ones(8, 8, dtype=torch.bool).tril()
    expected[2, 3] = expected[6, 7] = True
    assert torch.equal(gemma3_image_mask(row, IMAGE_ID)[0], expected)


def test_refusals(tiny):
    _, files, cfg, ours, images = tiny
    with pytest.raises(ValueError, match="vision_use_head"):
        gemma3_vision_from_hf_config({**cfg, "vision_config": {**cfg["vision_config"], "vision_use_head": True}})
    with pytest.raises(ValueError, match="lacks"):
        gemma3_vision_from_hf_config({**cfg, "vision_config": {"vision_use_head": False}})
    with pytest.raises(ValueError, match="must be a square"):
        gemma3_vision_encoder(decoder_dim=32, tokens_per_image=200)
    with pytest.raises(ValueError, match="11 image placeholders"):
        ours(TOKENS.masked_fill(torch.arange(21) > 16, 7), encoder_input={"images": images[:2]})
    with pytest.raises(ValueError, match="28x28"):
        ours.encoder(torch.zeros(1, 3, 32, 32))
    with pytest.raises(CheckpointConversionError, match="head.probe"):
        gemma3_vision_hf_to_tune({**files, "vision_tower.head.probe": torch.zeros(1, 1, 24)},
                                 **gemma3_conversion_args(cfg))
    with pytest.raises(CheckpointConversionError, match="encoder.extra"):
        gemma3_vision_tune_to_hf({"encoder.extra.weight": torch.zeros(1)}, **gemma3_conversion_args(cfg))


def test_checkpointer_reads_and_writes_the_whole_model(tiny, tmp_path):
    """The checkpointer's real entry WHOLE_MODEL_TYPES["GEMMA3_VISION"] is this module's conversion, and through
    FullModelHFCheckpointer's whole-model path the written folder loads in transformers with every tensor unchanged."""
    theirs, _, _, _, _ = tiny
    entry = ("gemma3", gemma3_vision_hf_to_tune, gemma3_vision_tune_to_hf, gemma3_conversion_args)
    assert checkpointing.WHOLE_MODEL_TYPES["GEMMA3_VISION"] == entry
    theirs.save_pretrained(tmp_path / "in")
    checkpointer = checkpointing.FullModelHFCheckpointer(
        tmp_path / "in", checkpoint_files=None, model_type="GEMMA3_VISION", output_dir=tmp_path / "out")
    state = checkpointer.load_checkpoint()["model"]
    model = gemma3_vision_from_hf_config(json.loads((tmp_path / "in" / "config.json").read_text()))
    checkpointing.load_model_state_dict(model, state)
    written = checkpointer.save_checkpoint({"model": model.state_dict()}, epoch=0)
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(written)
    for name, value in theirs.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def _trains(model):
    "part -> the set of requires_grad values of its parameters."
    parts = {"decoder": "decoder.", "tower": "encoder.siglip.", "proj": "encoder.projection."}
    return {part: {p.requires_grad for n, p in model.named_parameters() if n.startswith(pre)}
            for part, pre in parts.items()}


def test_trainable_switches_set_requires_grad(tiny):
    """EarlyFusionModel's switches and defaults on the class (the projector alone trains); the builders train the
    decoder too, the SigLIP tower frozen; each switch moves its own part; the 4B's frozen count is the tower's."""
    _, _, cfg, _, _ = tiny
    yes, no = {True}, {False}
    model = gemma3_vision_from_hf_config(cfg)
    assert _trains(model) == dict(decoder=yes, tower=no, proj=yes)
    assert set(get_fusion_params(model)) == {"encoder.projection.norm.scale", "encoder.projection.output.weight"}
    flipped = gemma3_vision_from_hf_config(cfg, decoder_trainable=False, encoder_trainable=True,
                                           fusion_trainable=False)
    assert _trains(flipped) == dict(decoder=no, tower=yes, proj=no)
    assert _trains(Gemma3EarlyFusionModel(model.decoder, model.encoder, IMAGE_ID)) == dict(decoder=no, tower=no,
                                                                                          proj=yes)
    with torch.device("meta"):
        frozen_4b = gemma3_vision_4b()
        tower_4b = gemma3_vision_4b(encoder_trainable=True, decoder_trainable=False, fusion_trainable=False)
    assert sum(p.numel() for p in frozen_4b.parameters() if not p.requires_grad) == 419_816_304 - 1152 * 2561
    assert sum(p.numel() for p in tower_4b.parameters() if p.requires_grad) == 419_816_304 - 1152 * 2561


def test_an_image_cut_between_cached_calls_is_refused(tiny):
    "Tokens already in the cache cannot see later keys: a call starting inside an image's run is refused."
    _, _, _, ours, images = tiny
    row = torch.tensor([[5, 98, IMAGE_ID, IMAGE_ID, 99, 6, IMAGE_ID, IMAGE_ID]])
    with pytest.raises(ValueError, match="at position 3"):
        gemma3_image_mask(row[:, 3:], IMAGE_ID, torch.arange(3, 8)[None], kv_len=8)
    with torch.no_grad():
        ours.setup_caches(2, torch.float32, decoder_max_seq_len=32)
        try:
            ours(TOKENS[:, :3], input_pos=torch.arange(3).expand(2, 3))
            with pytest.raises(ValueError, match="image token .* at position 3"):  # row 1 starts on an image token
                ours(TOKENS[:, 3:9], input_pos=torch.arange(3, 9).expand(2, 6), encoder_input={"images": images[:2]})
        finally:
            ours.remove_caches()
