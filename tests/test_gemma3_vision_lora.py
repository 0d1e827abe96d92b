"""LoRA on the whole Gemma 3 (`lora_gemma3_vision_from_hf_config`, `lora_gemma3_vision_4b`) against PEFT.

The tiny random `Gemma3ForConditionalGeneration` of test_gemma3_vision_parity (SigLIP of width 24 over 28-pixel
images, a Gemma 3 decoder of width 32) gets adapters in the parts each case names; the same modules of transformers'
model get adapters through `peft.get_peft_model`, our adapter values are converted to PEFT's names and row order, and
then, in fp32: equal trainable-parameter counts and equal logits (with images) within 1e-4. Also: the projector's
adapter has no PEFT form (a bare parameter in transformers), 'full' is refused, and the 4B's LoRA builder on the meta
device has the 4B's base parameters and the adapter count derived by hand.
"""
import copy
from pathlib import Path

import pytest
import torch
from test_gemma3_vision_parity import IMAGE_ID, TOKENS, tiny  # noqa: F401  (the fixture)

import torchtune_lit
from torchtune_lit.models.convert_weights import tune_to_peft_whole_adapter_weights
from torchtune_lit.models.gemma3 import (
    gemma3_conversion_args,
    gemma3_module_name,
    gemma3_vision_4b,
    gemma3_vision_hf_to_tune,
    gemma3_vision_tune_to_hf,
    lora_gemma3_vision_4b,
    lora_gemma3_vision_from_hf_config,
)
from torchtune_lit.modules.peft import DoRALinear, get_adapter_state_dict

peft = pytest.importorskip("peft")
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
PEFT_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj|out_proj"}
# (decoder, encoder, attention modules, MLP, DoRA)
CASES = {
    "decoder_and_tower_all": ("lora", "lora", ATTN, True, False),
    "decoder_qv": ("lora", "frozen", ["q_proj", "v_proj"], False, False),
    "tower_only_mlp": ("frozen", "lora", ["k_proj"], True, False),
    "decoder_dora": ("lora", "frozen", ["q_proj", "output_proj"], True, True),
}


def _theirs_logits(model, images):
    "transformers' (or PEFT's) logits of the two rows, the image tokens marked as its processor marks them."
    with torch.no_grad():
        return model(input_ids=TOKENS, pixel_values=images, token_type_ids=(TOKENS == IMAGE_ID).long()).logits


def _trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _peft_pattern(parts, attn, mlp):
    names = [PEFT_NAMES[a] for a in attn]
    prefixes = []
    if parts[0] == "lora":
        prefixes.append("language_model")
        names += ["gate_proj", "up_proj", "down_proj"] if mlp else []
    if parts[1] == "lora":
        prefixes.append("vision_tower")
        names += ["fc1", "fc2"] if mlp else []
    return rf"model\.({'|'.join(prefixes)})\..*\.({'|'.join(dict.fromkeys(names))})"


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_matches_peft(tiny, case):  # noqa: F811
    theirs, files, cfg, _, images = tiny
    decoder, encoder, attn, mlp, dora = CASES[case]
    ours = lora_gemma3_vision_from_hf_config(cfg, attn, decoder, encoder, "frozen", apply_lora_to_mlp=mlp,
                                             lora_rank=4, lora_alpha=8, use_dora=dora).eval()
    ours.load_state_dict(gemma3_vision_hf_to_tune(files, **gemma3_conversion_args(cfg)), strict=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in ours.modules():
            if isinstance(module, DoRALinear):
                module.initialize_dora_magnitude()
                module.magnitude.mul_(1 + 0.3 * torch.rand(module.magnitude.shape, generator=gen))
            if hasattr(module, "lora_b"):
                module.lora_b.weight.copy_(0.3 * torch.randn(module.lora_b.weight.shape, generator=gen))
    to_hf = lambda sd: gemma3_vision_tune_to_hf(sd, **gemma3_conversion_args(cfg))  # noqa: E731
    weights, no_form = tune_to_peft_whole_adapter_weights(get_adapter_state_dict(ours.state_dict()), to_hf,
                                                          gemma3_module_name)
    assert not no_form
    config = peft.LoraConfig(r=4, lora_alpha=8, use_dora=dora, target_modules=_peft_pattern((decoder, encoder), attn, mlp))
    peft_model = peft.get_peft_model(copy.deepcopy(theirs), config).eval()
    result = peft.set_peft_model_state_dict(peft_model, weights)
    assert not result.unexpected_keys
    assert _trainable(ours) == _trainable(peft_model) > 0
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == set(get_adapter_state_dict(ours.state_dict()))
    expected = _theirs_logits(peft_model, images)
    with torch.no_grad():
        actual = ours(TOKENS, encoder_input={"images": images})
        assert (actual - _theirs_logits(theirs, images)).abs().max() > 0.1  # the adapters matter
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_projector_adapter_has_no_peft_form_and_full_is_refused(tiny):  # noqa: F811
    _, _, cfg, _, _ = tiny
    model = lora_gemma3_vision_from_hf_config(cfg, ["q_proj", "v_proj"])  # decoder + projector by default
    to_hf = lambda sd: gemma3_vision_tune_to_hf(sd, **gemma3_conversion_args(cfg))  # noqa: E731
    _, no_form = tune_to_peft_whole_adapter_weights(get_adapter_state_dict(model.state_dict()), to_hf,
                                                    gemma3_module_name)
    assert list(no_form) == ["encoder.projection.output"]
    assert not any(p.requires_grad for p in model.encoder.siglip.parameters())
    for part in ("decoder", "encoder", "fusion"):
        with pytest.raises(ValueError, match="gemma3_vision_from_hf_config"):
            lora_gemma3_vision_from_hf_config(cfg, ["q_proj"], **{f"{part}_trainable": "full"})


def test_4b_lora_counts():
    with torch.device("meta"):
        lora, base = lora_gemma3_vision_4b(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=8), gemma3_vision_4b()
    assert sum(p.numel() for n, p in lora.named_parameters() if ".lora_" not in n) == sum(p.numel() for p in base.parameters())
    per_layer = 8 * (2560 + 2048) + 8 * (2560 + 1024) + 3 * 8 * (2560 + 10_240)
    assert _trainable(lora) == 34 * per_layer + 8 * (1152 + 2560)


def test_lora_recipe_on_tiny_gemma3_saves_what_transformers_and_peft_read(tmp_path):
    """The LoRA recipe on the tiny Gemma 3 (decoder adapters, a few steps): the merged folder in transformers equals
    PEFT's model over the base with adapter/; with the projector adapted too, its adapter is written apart."""
    import warnings

    import transformers

    import torchtune_lit.recipes.lora_finetune_single_device as recipe
    from torchtune_lit import config
    from torchtune_lit.data import Message
    from torchtune_lit.datasets._tiny_vision import make_shapes_split
    from torchtune_lit.models.tiny_gemma3 import (
        TINY_GEMMA3_IMAGE_TOKEN,
        tiny_gemma3_transform,
    )
    from torchtune_lit.training.checkpointing import NO_PEFT_FORM_FILE

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")
    yaml = Path(torchtune_lit.__file__).parent / "recipes" / "configs" / "tiny" / "vision_gemma3.yaml"
    base_dir = config.load_config(yaml).checkpointer.checkpoint_dir
    folders = {}
    for fusion in ("frozen", "lora"):
        cfg = config.load_config(yaml, [
            f"output_dir={tmp_path / fusion}", "epochs=1", "max_steps_per_epoch=3", "validation_dataset=null",
            "progress_bar=false", "optimizer.lr=1e-2", "model._component_=torchtune_lit.models.tiny_gemma3.lora_tiny_gemma3",
            "~model.decoder_trainable", "~model.encoder_trainable", f"model.fusion_trainable={fusion}",
            "+model.lora_attn_modules=[q_proj,v_proj,output_proj]", "+model.apply_lora_to_mlp=true"])
        recipe.train(cfg)
        folders[fusion] = tmp_path / fusion / "epoch_0"
    assert (folders["lora"] / "adapter" / NO_PEFT_FORM_FILE).is_file()
    assert not (folders["frozen"] / "adapter" / NO_PEFT_FORM_FILE).exists()
    transform = tiny_gemma3_transform()
    row = make_shapes_split("evaluation")[0]
    parts = [{"type": "image", "content": row["image"]}, {"type": "text", "content": row["question"]}]
    sample = transform({"messages": [Message("user", parts, masked=True), Message("assistant", row["answer"])]})
    inputs = dict(input_ids=torch.tensor([sample["tokens"]]), pixel_values=sample["encoder_input"]["images"])
    inputs["token_type_ids"] = (inputs["input_ids"] == TINY_GEMMA3_IMAGE_TOKEN).long()
    load = lambda folder: transformers.Gemma3ForConditionalGeneration.from_pretrained(  # noqa: E731
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        untouched = load(base_dir)(**inputs).logits
        merged = load(folders["frozen"])(**inputs).logits
        adapted = peft.PeftModel.from_pretrained(load(base_dir), folders["frozen"] / "adapter").eval()(**inputs).logits
    assert (merged - untouched).abs().max() > 0.1  # the adapters trained
    torch.testing.assert_close(adapted, merged, atol=1e-4, rtol=0)
