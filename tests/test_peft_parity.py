"""LoRA / DoRA output that the ecosystem loads: the merged folder in transformers, the adapter in peft.

A small Llama (and a Qwen 2 with biases and tied embeddings, a Phi-3 whose checkpoint fuses q/k/v and gate/up, and a
Gemma 3) with large random weights is written by transformers;
we load it through our checkpointer into our LoRA model, give the adapters random non-zero values, save with
`FullModelHFCheckpointer.save_checkpoint`, and require, in fp32 within 1e-4:
  - merged weights == base + adapter (our own models),
  - transformers.AutoModelForCausalLM.from_pretrained(saved folder) == our LoRA model,
  - peft.PeftModel.from_pretrained(transformers base, saved adapter folder) == our LoRA model (no PEFT folder for
    Phi-3: an adapter on part of a fused matrix has no PEFT form, and the checkpointer says so).
"""
import json

import peft
import pytest
import torch
import transformers
from test_hf_parity import SMALL, randomize_

from torchtune_lit.models import build_from_hf_config
from torchtune_lit.modules.peft import (
    DoRALinear,
    apply_lora,
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
)
from torchtune_lit.training import FullModelHFCheckpointer, load_model_state_dict

CASES = {
    "llama_lora_all_layers": (transformers.LlamaConfig, dict(), ["q_proj", "k_proj", "v_proj", "output_proj"], True, True, False),
    "llama_dora": (transformers.LlamaConfig, dict(), ["q_proj", "k_proj", "v_proj"], True, False, True),
    "qwen2_lora_bias_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True), ["q_proj", "k_proj", "v_proj"], False, False, False),
    # Phi-3's checkpoint fuses q/k/v and gate/up: the merged model is written fused, no PEFT adapter (said so)
    "phi3_lora_fused": (transformers.Phi3Config, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                        ["q_proj", "v_proj"], True, False, False),
    "gemma3_lora": (transformers.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=4),
                    ["q_proj", "k_proj", "v_proj", "output_proj"], True, False, False),
}
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    config_cls, extra, attn_modules, mlp, output, dora = CASES[request.param]
    config = config_cls(**{**SMALL, **extra})
    torch.manual_seed(0)
    hf_base = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_(hf_base)
    base_dir = tmp_path_factory.mktemp("base")
    hf_base.save_pretrained(base_dir)

    checkpointer = FullModelHFCheckpointer(base_dir, output_dir=tmp_path_factory.mktemp("out"))
    model = apply_lora(build_from_hf_config(base_dir), attn_modules, mlp, output, lora_rank=RANK, lora_alpha=ALPHA,
                       use_dora=dora).eval()
    adapter_keys = set(get_adapter_params(model))
    load_model_state_dict(model, checkpointer.load_checkpoint()["model"], allowed_missing=adapter_keys)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DoRALinear):
                module.initialize_dora_magnitude()
                module.magnitude.mul_(1 + 0.3 * torch.rand(module.magnitude.shape, generator=gen))
            if hasattr(module, "lora_b"):
                module.lora_b.weight.copy_(torch.randn(module.lora_b.weight.shape, generator=gen) * 0.3)
    state = model.state_dict()
    folder = checkpointer.save_checkpoint({
        "model": get_merged_lora_ckpt(state, rank=RANK, alpha=ALPHA),
        "adapter": get_adapter_state_dict(state),
        "adapter_config": {"r": RANK, "lora_alpha": ALPHA, "use_dora": dora,
                           "target_modules": get_lora_module_names(attn_modules, mlp, output)}}, epoch=0)
    return model, hf_base, base_dir, folder


def tokens():
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))


def test_merged_checkpoint_loads_in_transformers_with_equal_logits(saved):
    model, hf_base, _, folder = saved
    assert not (folder / "adapter_config.json").exists(), "an adapter beside merged weights would be applied twice"
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ours = model(tokens())
        assert (ours - hf_base(tokens()).logits).abs().max() > 1e-2, "the adapters must change the model"
        torch.testing.assert_close(merged(tokens()).logits, ours, atol=1e-4, rtol=1e-4)


def test_adapter_loads_in_peft_with_equal_logits(saved):
    model, hf_base, _, folder = saved
    if hf_base.config.model_type == "phi3":
        assert not (folder / "adapter").exists()   # no PEFT form for an adapter on part of a fused qkv_proj
        pytest.skip("Phi-3 fuses q/k/v: the merged model is the output (checked above)")
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    peft_model = peft.PeftModel.from_pretrained(hf_base, folder / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens()).logits, model(tokens()), atol=1e-4, rtol=1e-4)
        with peft_model.disable_adapter():                       # and the adapter is not a no-op
            assert (peft_model(tokens()).logits - model(tokens())).abs().max() > 1e-2
    peft_model.unload()


def test_merged_equals_base_plus_adapter_in_our_own_models(saved):
    model, _, _, _ = saved
    plain = build_from_hf_config(saved[2]).eval()
    plain.load_state_dict(get_merged_lora_ckpt(model.state_dict(), rank=RANK, alpha=ALPHA))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens()), model(tokens()), atol=1e-4, rtol=1e-4)
