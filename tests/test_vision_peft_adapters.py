"""A LoRA run on a whole vision model saves an adapter that PEFT loads onto transformers' model with our logits.

For each whole model the checkpointer reads — Llama 3.2 Vision (the shipped tiny vision base, `MllamaForConditionalGeneration`),
Llama 4 and Gemma 3 (tiny random checkpoints written by transformers: `Llama4ForConditionalGeneration`,
`Gemma3ForConditionalGeneration`) — our LoRA model gets adapters in the decoder, the vision tower and the projection
head, every `lora_b` a random non-zero matrix; the checkpointer saves it (adapter only, and full). transformers loads
the base, `peft.PeftModel.from_pretrained` the `adapter/` folder: PEFT must have put adapters on exactly our modules
(as many LoRA layers as ours), loaded every tensor of the file (none missing, none unexpected), and give our logits
within 1e-4 in fp32, with images and with text alone. What PEFT has no form for — Llama 4's grouped experts, Gemma 3's
projector (a bare matrix in transformers) — is saved beside the PEFT files under our names; merged into the base by
the rule those files carry, the PEFT model is again ours. The full save's merged weights give our logits in
transformers too.
"""
import json
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import torchtune_lit
from torchtune_lit.models.clip import apply_clip_lora
from torchtune_lit.models.gemma3._vision import gemma3_vision_from_hf_config
from torchtune_lit.models.llama3_2_vision import lora_llama3_2_vision_from_hf_config
from torchtune_lit.models.llama4 import (
    llama4_from_hf_config,
    lora_llama4_vision_projection_head,
)
from torchtune_lit.modules.peft import (
    LoRALinear,
    apply_lora,
    get_merged_lora_ckpt,
    lora_checkpoint,
)
from torchtune_lit.training.checkpointing import (
    EXPERT_ADAPTER_FILE,
    NO_PEFT_FORM_FILE,
    FullModelHFCheckpointer,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
for _name in ("torchao", "torch.utils._pytree", "transformers"):
    logging.getLogger(_name).setLevel(logging.ERROR)
transformers.utils.logging.disable_progress_bar()

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
RANK, ALPHA = 4, 8.0


def randomize_lora_b_(model: torch.nn.Module, seed: int) -> None:
    "Every B of a LoRA pair (grouped experts' too) random and non-zero, so that every adapter moves the logits."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_b.weight", "_b")) and ".lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]) + 0.05)


def load_base_into(model: torch.nn.Module, folder: Path, model_type: str) -> None:
    "The checkpoint's weights into our LoRA model: only adapter keys may be missing."
    state = FullModelHFCheckpointer(folder, model_type=model_type).load_checkpoint()["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(".lora_" in k or k.endswith(".magnitude") for k in missing)


def save_both(model: torch.nn.Module, base: Path, out: Path, model_type: str, capsys) -> tuple[Path, Path, str]:
    "The checkpointer's full save (epoch_0) and adapter-only save (epoch_1); what it printed."
    checkpointer = FullModelHFCheckpointer(base, model_type=model_type, output_dir=out)
    state = lora_checkpoint(model)
    full = checkpointer.save_checkpoint(state, epoch=0)
    only = checkpointer.save_checkpoint(state, epoch=1, adapter_only=True)
    assert sorted(p.name for p in only.iterdir()) == ["README.md", "adapter"]
    return full, only, capsys.readouterr().out


def peft_model(hf_class, base: Path, adapter: Path):
    "transformers' base with PEFT's adapter loaded, after checking PEFT took exactly the file's tensors."
    hf = hf_class.from_pretrained(base, dtype=torch.float32)
    with warnings.catch_warnings():  # peft calls an API transformers 5 deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing`")
        loaded = peft.PeftModel.from_pretrained(hf, adapter).eval()
    written = load_file(adapter / "adapter_model.safetensors")
    held = {  # PEFT's in-memory names, as it writes them to a file
        k.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector"): v
        for k, v in loaded.state_dict().items() if ".lora_" in k
    }
    assert held.keys() == written.keys(), (sorted(held.keys() - written.keys())[:3],
                                           sorted(written.keys() - held.keys())[:3])
    assert all(torch.equal(held[k], written[k]) for k in written)
    return loaded


def lora_layer_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())


def ours_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, LoRALinear) for m in model.modules())


def base_with_merged(model: torch.nn.Module, adapter_dir: Path, file: str, base: Path, out: Path,
                     model_type: str) -> Path:
    """A base folder with the adapters of `adapter_dir/file` (those PEFT has no form for) merged into the base
    weights by the rule in the file's metadata: what a PEFT user does with that file."""
    with safe_open(adapter_dir / file, "pt") as f:
        meta = f.metadata()
    extra = load_file(adapter_dir / file)
    base_state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k and not k.endswith(("_a", "_b"))}
    merged = get_merged_lora_ckpt({**base_state, **extra}, rank=int(meta["r"]), alpha=float(meta["lora_alpha"]))
    checkpointer = FullModelHFCheckpointer(base, model_type=model_type, output_dir=out)
    return checkpointer.save_checkpoint({"model": merged}, epoch=9)


# --- Llama 3.2 Vision: the shipped tiny vision base --------------------------------------------------------------

VISION_BASE = Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "vision_base"


def test_llama3_2_vision_adapter_loads_in_peft_with_our_logits(tmp_path, capsys):
    # the base with its gates opened (the shipped one's are closed, so pictures would not matter)
    reader = FullModelHFCheckpointer(VISION_BASE, model_type="LLAMA3_VISION", output_dir=tmp_path / "base")
    state = reader.load_checkpoint()["model"]
    for key in state:
        if key.endswith(("ca_scale.scale", "mlp_scale.scale")):
            state[key] = torch.full_like(state[key], 0.7)
    base = reader.save_checkpoint({"model": state}, epoch=0)
    # ours as transformers 5.25 computes it: the kept encoder layers one later (see the encoder chapter)
    config = json.loads((base / "config.json").read_text())
    vision = dict(config["vision_config"])
    vision["intermediate_layers_indices"] = [i + 1 for i in vision["intermediate_layers_indices"]]
    model = lora_llama3_2_vision_from_hf_config(
        {**config, "vision_config": vision}, ATTN, decoder_trainable="lora", encoder_trainable="lora",
        fusion_trainable="lora", apply_lora_to_mlp=True, apply_lora_to_output=True, lora_rank=RANK, lora_alpha=ALPHA,
    ).eval()
    load_base_into(model, base, "LLAMA3_VISION")
    randomize_lora_b_(model, seed=1)
    full, only, printed = save_both(model, base, tmp_path / "out", "LLAMA3_VISION", capsys)
    assert "No PEFT form" not in printed
    peft_config = json.loads((only / "adapter" / "adapter_config.json").read_text())
    assert "model.language_model.layers.0.self_attn.q_proj" in peft_config["target_modules"]
    assert "model.vision_model.transformer.layers.0.mlp.fc1" in peft_config["target_modules"]
    assert "model.multi_modal_projector" in peft_config["target_modules"] and "lm_head" in peft_config["target_modules"]

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 2048, (2, 12), generator=gen)
    tokens[:, 0] = 2048  # <|image|>
    pixels = torch.randn(2, 1, 1, 3, 28, 28, generator=gen)
    pixels = torch.cat([pixels, torch.zeros_like(pixels)], dim=2)  # one real tile of the model's 2
    sees = torch.tensor([1, 0]).expand(2, 12, 1, 2)  # every token sees the real tile
    hf_images = dict(pixel_values=pixels, aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
                     aspect_ratio_mask=torch.tensor([[[1, 0]]]).expand(2, 1, 2), cross_attention_mask=sees)
    our_images = dict(encoder_input={"images": pixels, "aspect_ratio": torch.tensor([[[1, 1]]]).expand(2, 1, 2)},
                      encoder_mask=sees.repeat_interleave(17, dim=3).flatten(2).bool())
    text = tokens[:, 1:]
    with torch.no_grad():
        ours_image, ours_text = model(tokens, **our_images), model(text)
    for folder in (only, full):
        loaded = peft_model(transformers.MllamaForConditionalGeneration, base, folder / "adapter")
        assert lora_layer_count(loaded) == ours_count(model) == 62
        with torch.no_grad():
            theirs_image = loaded(input_ids=tokens, **hf_images).logits
            theirs_text = loaded(input_ids=text).logits
            with loaded.disable_adapter():
                bare = loaded(input_ids=text).logits
        assert (bare - ours_text).abs().max() > 0.5, "the adapters must move the logits"
        torch.testing.assert_close(theirs_image, ours_image, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(theirs_text, ours_text, atol=1e-4, rtol=1e-4)
    merged = transformers.MllamaForConditionalGeneration.from_pretrained(full, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens, **hf_images).logits, ours_image, atol=1e-4, rtol=1e-4)


def test_llama3_2_vision_dora_adapter_loads_in_peft(tmp_path, capsys):
    "DoRA's magnitudes take the q/k row order of the decoder's self-attention, and PEFT's DoRA gives our logits."
    model = lora_llama3_2_vision_from_hf_config(
        VISION_BASE, ["q_proj", "k_proj"], decoder_trainable="lora", encoder_trainable="frozen",
        fusion_trainable="frozen", lora_rank=RANK, lora_alpha=ALPHA, use_dora=True,
    ).eval()
    load_base_into(model, VISION_BASE, "LLAMA3_VISION")
    for module in model.modules():
        if hasattr(module, "initialize_dora_magnitude"):
            module.initialize_dora_magnitude()
    randomize_lora_b_(model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("magnitude"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    _, only, _ = save_both(model, VISION_BASE, tmp_path / "out", "LLAMA3_VISION", capsys)
    assert json.loads((only / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    loaded = peft_model(transformers.MllamaForConditionalGeneration, VISION_BASE, only / "adapter")
    assert lora_layer_count(loaded) == ours_count(model) == 8  # q and k of 4 text layers
    tokens = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)


# --- Llama 4 -------------------------------------------------------------------------------------------------------

L4_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
               attention_chunk_size=4, floor_scale=4, attn_scale=0.5, num_local_experts=4, num_experts_per_tok=1,
               moe_layers=[1, 2], no_rope_layer_interval=2, use_qk_norm=True,
               rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=16))
L4_VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
                 patch_size=7, projector_input_dim=24, projector_output_dim=24, vision_output_dim=24)
L4_IMAGE = 100


def randomize_(model: torch.nn.Module, seed: int) -> None:
    "Unit-scale random matrices (experts by their input width) and gains far from 1."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            fan_in = p.shape[1] if p.dim() == 3 else p.shape[-1]
            p.copy_(noise / fan_in**0.5 if p.dim() >= 2 else 1.0 + 0.5 * noise)


def test_llama4_adapter_loads_in_peft_with_our_logits(tmp_path, capsys):
    config = transformers.Llama4Config(text_config=L4_TEXT, vision_config=L4_VISION, image_token_index=L4_IMAGE)
    config._attn_implementation = "eager"
    theirs = transformers.Llama4ForConditionalGeneration(config)
    randomize_(theirs, seed=0)
    base = tmp_path / "base"
    theirs.save_pretrained(base)
    model = llama4_from_hf_config(json.loads((base / "config.json").read_text()))
    apply_lora(model.decoder, ATTN, apply_lora_to_mlp=True, apply_lora_to_output=True, lora_rank=RANK,
               lora_alpha=ALPHA)  # attention, dense MLPs, the shared experts, the grouped experts, the head
    encoder = model.encoders["vision"]
    apply_clip_lora(encoder.clip, ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA)
    encoder.projection = lora_llama4_vision_projection_head(
        decoder_embed_dim=32, clip_embed_dim=16, projection_embed_dim=24, apply_lora_to_output=True,
        lora_rank=RANK, lora_alpha=ALPHA)
    model.eval()
    load_base_into(model, base, "LLAMA4")
    randomize_lora_b_(model, seed=1)
    full, only, printed = save_both(model, base, tmp_path / "out", "LLAMA4", capsys)
    # the grouped experts have no PEFT form: named, and kept under our names
    assert "No PEFT form for the adapters of 2 grouped-expert module(s)" in printed
    assert "decoder.layers.1.mlp.experts" in printed and EXPERT_ADAPTER_FILE in printed
    peft_base = base_with_merged(model, only / "adapter", EXPERT_ADAPTER_FILE, base, tmp_path / "merged", "LLAMA4")

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, L4_IMAGE, (2, 14), generator=gen)
    tokens[0, 1:9], tokens[1, 6:10] = L4_IMAGE, L4_IMAGE  # two images, then one: 4 vectors each
    pixels = torch.randn(3, 3, 28, 28, generator=gen)
    text = torch.randint(0, L4_IMAGE, (2, 13), generator=gen)
    with torch.no_grad():
        ours_image = model(tokens, encoder_input={"vision": {"images": pixels}})
        ours_text = model(text)
    for folder in (only, full):
        loaded = peft_model(transformers.Llama4ForConditionalGeneration, peft_base, folder / "adapter")
        # attention 4 x 4, the dense layers' MLPs 2 x 3, the shared experts 2 x 3, the head; CLIP 2 x 6; projection 3
        assert lora_layer_count(loaded) == ours_count(model) == 16 + 6 + 6 + 1 + 12 + 3
        with torch.no_grad():
            theirs_image = loaded(input_ids=tokens, pixel_values=pixels).logits
            theirs_text = loaded(input_ids=text).logits
            with loaded.disable_adapter():
                bare = loaded(input_ids=text).logits
        assert (bare - ours_text).abs().max() > 0.5, "the adapters must move the logits"
        torch.testing.assert_close(theirs_image, ours_image, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(theirs_text, ours_text, atol=1e-4, rtol=1e-4)
    merged = transformers.Llama4ForConditionalGeneration.from_pretrained(full, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens, pixel_values=pixels).logits, ours_image, atol=1e-4,
                                   rtol=1e-4)


# --- Gemma 3 -------------------------------------------------------------------------------------------------------

G3_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
               layer_types=["sliding_attention"] * 2 + ["full_attention"])
G3_VISION = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                 patch_size=7, vision_use_head=False)
G3_IMAGE = 100
G3_IMG = [98, G3_IMAGE, G3_IMAGE, G3_IMAGE, G3_IMAGE, 99]


def test_gemma3_adapter_loads_in_peft_with_our_logits(tmp_path, capsys):
    config = transformers.Gemma3Config(text_config=G3_TEXT, vision_config=G3_VISION, mm_tokens_per_image=4,
                                       image_token_index=G3_IMAGE, boi_token_index=98, eoi_token_index=99,
                                       attn_implementation="eager")
    theirs = transformers.Gemma3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name or "post_layernorm" in name:
                p.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    base = tmp_path / "base"
    theirs.save_pretrained(base)
    model = gemma3_vision_from_hf_config(json.loads((base / "config.json").read_text()))
    apply_lora(model.decoder, ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA)  # tied: no head
    apply_clip_lora(model.encoder.siglip, ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA)
    projection = model.encoder.projection
    projection.output = LoRALinear(24, 32, rank=RANK, alpha=ALPHA, use_bias=False)
    model.eval()
    load_base_into(model, base, "GEMMA3_VISION")
    randomize_lora_b_(model, seed=1)
    full, only, printed = save_both(model, base, tmp_path / "out", "GEMMA3_VISION", capsys)
    # the projector is a bare matrix in transformers: no PEFT form, named with why, kept under our names
    assert "No PEFT form for the adapters of 1 module(s) (encoder.projection.output:" in printed
    assert "mm_input_projection_weight" in printed and NO_PEFT_FORM_FILE in printed
    assert set(load_file(only / "adapter" / NO_PEFT_FORM_FILE)) == {
        "encoder.projection.output.lora_a.weight", "encoder.projection.output.lora_b.weight"}
    peft_base = base_with_merged(model, only / "adapter", NO_PEFT_FORM_FILE, base, tmp_path / "merged",
                                 "GEMMA3_VISION")

    tokens = torch.tensor([[2, 5, 6, *G3_IMG, 7, 8, 9, 10, *G3_IMG, 11, 12], [2, 13, *G3_IMG, *range(14, 27)]])
    images = torch.randn(3, 3, 28, 28, generator=gen)
    text = torch.randint(0, 98, (2, 12), generator=gen)
    with torch.no_grad():
        ours_image = model(tokens, encoder_input={"images": images})
        ours_text = model(text)
    for folder in (only, full):
        loaded = peft_model(transformers.Gemma3ForConditionalGeneration, peft_base, folder / "adapter")
        # decoder 3 x (4 + 3), SigLIP 2 x (4 + 2); the projector's adapter is merged into this base instead
        assert lora_layer_count(loaded) == ours_count(model) - 1 == 21 + 12
        with torch.no_grad():
            theirs_image = loaded(input_ids=tokens, pixel_values=images,
                                  token_type_ids=(tokens == G3_IMAGE).long()).logits
            theirs_text = loaded(input_ids=text).logits
            with loaded.disable_adapter():
                bare = loaded(input_ids=text).logits
        assert (bare - ours_text).abs().max() > 0.5, "the adapters must move the logits"
        torch.testing.assert_close(theirs_image, ours_image, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(theirs_text, ours_text, atol=1e-4, rtol=1e-4)
