"""Mixture-of-experts families against transformers, on checkpoints transformers itself writes.

Mixtral and Qwen 3 MoE: a small model with large random weights is written with `save_pretrained` (per-expert
tensors, as the published checkpoints hold them), loaded through `FullModelHFCheckpointer` into the model
`build_from_hf_config` builds, and must give transformers' logits within 1e-4 in fp32 — a full forward and token by
token with the KV cache — and the same load-balancing loss; our checkpointer writes it back so that transformers
reads the same logits, and the keys convert both ways exactly. Each size builder's parameter count equals
transformers' model of the published config, both built on the meta device.
"""
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file

from torchtune_lit.models import build_from_hf_config
from torchtune_lit.models.convert_weights import (
    CheckpointConversionError,
    hf_conversion_dims,
    hf_to_tune,
    tune_to_hf,
)
from torchtune_lit.models.mixtral import mixtral_8x7b, mixtral_8x22b
from torchtune_lit.models.qwen3_moe import qwen3_moe_30b_a3b, qwen3_moe_235b_a22b
from torchtune_lit.modules.moe import MoE, collect_router_logits, load_balancing_loss
from torchtune_lit.training import FullModelHFCheckpointer, load_model_state_dict

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
FAMILIES = {
    "mixtral_window": (transformers.MixtralConfig, "MIXTRAL",
                       dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe_norm_topk_dense_layer": (transformers.Qwen3MoeConfig, "QWEN3_MOE",
                       dict(intermediate_size=40, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=True, mlp_only_layers=[1], head_dim=16,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe_sparse_step_no_norm": (transformers.Qwen3MoeConfig, "QWEN3_MOE",
                       dict(intermediate_size=40, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                            norm_topk_prob=False, decoder_sparse_step=2, head_dim=8)),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    "Large random weights: unit-scale matrices and experts, norm gains far from 1."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / math.sqrt(p.shape[-1]) * 1.5 if p.dim() >= 2 else 1.0 + 0.5 * noise)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    "(ours, transformers' model, checkpoint folder) for one case, loaded through our checkpointer."
    config_cls, model_type, extra = FAMILIES[request.param]
    config = config_cls(**{**SMALL, **extra}, attn_implementation="eager")
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize_(hf_model)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    state = FullModelHFCheckpointer(folder, model_type=model_type).load_checkpoint()["model"]
    ours = build_from_hf_config(folder).eval()
    load_model_state_dict(ours, state)
    return ours, hf_model, folder


def test_full_forward_logits_match_transformers(family):
    ours, hf_model, _ = family
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    assert expected.abs().max() > 1.0, "weights too small for a meaningful comparison"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_kv_cache_decoding_matches_transformers_token_by_token(family):
    ours, hf_model, _ = family
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        ours.setup_caches(batch_size=2, dtype=torch.float32)
        try:
            steps = [ours(tokens[:, :3])] + [ours(tokens[:, t:t + 1]) for t in range(3, 12)]
        finally:
            ours.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=1e-4)


def test_load_balancing_loss_matches_transformers_aux_loss(family):
    ours, hf_model, _ = family
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0  # right padding (causal: the other tokens do not see it), left out of the loss
    config = hf_model.config
    with torch.no_grad():
        expected = hf_model(tokens, attention_mask=mask, output_router_logits=True).aux_loss
        ours(tokens)
    router_logits = collect_router_logits(ours)
    assert len(router_logits) == sum(isinstance(layer.mlp, MoE) for layer in ours.layers)
    actual = load_balancing_loss(router_logits, config.num_local_experts, config.num_experts_per_tok, mask)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def test_keys_convert_both_ways_exactly(family):
    ours, hf_model, folder = family
    files = load_file(folder / "model.safetensors")
    dims = hf_conversion_dims(hf_model.config.to_dict())
    converted = hf_to_tune(files, **dims)
    assert converted.keys() == ours.state_dict().keys()
    back = tune_to_hf(converted, **dims)
    assert back.keys() == files.keys()
    assert all(torch.equal(back[k], files[k]) for k in files)


def test_saved_checkpoint_loads_back_in_transformers_with_equal_logits(family, tmp_path):
    "Our checkpointer writes the experts back, one tensor per expert, as transformers reads them."
    ours, hf_model, folder = family
    checkpointer = FullModelHFCheckpointer(folder, output_dir=tmp_path / "out")
    saved = checkpointer.save_checkpoint({"model": ours.state_dict()}, epoch=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=1e-5)


PUBLISHED = {  # builder -> transformers' config of the published checkpoint
    mixtral_8x7b: transformers.MixtralConfig(
        vocab_size=32_000, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32_768),
    mixtral_8x22b: transformers.MixtralConfig(
        vocab_size=32_768, hidden_size=6144, intermediate_size=16_384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65_536),
    qwen3_moe_30b_a3b: transformers.Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40_960),
    qwen3_moe_235b_a22b: transformers.Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40_960),
}


@pytest.mark.parametrize("builder", list(PUBLISHED), ids=lambda b: b.__name__)
def test_size_builders_have_transformers_parameter_count(builder):
    with torch.device("meta"):
        ours = builder()
        theirs = transformers.AutoModelForCausalLM.from_config(PUBLISHED[builder])
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(ours) == count(theirs)


def test_a_checkpoint_missing_an_expert_is_refused_by_name(family, tmp_path):
    "A shard lost from a MoE checkpoint leaves a layer's experts incomplete: refused, naming the tensor."
    _, hf_model, folder = family
    files = load_file(folder / "model.safetensors")
    dims = hf_conversion_dims(hf_model.config.to_dict())
    layer = min(int(k.split(".")[2]) for k in files if ".experts.1." in k)   # the first layer with experts
    broken = {k: v for k, v in files.items() if f".layers.{layer}." not in k or ".experts.1." not in k}
    with pytest.raises(CheckpointConversionError, match=rf"layers\.{layer}\.mlp\.experts\.\w+_proj: the checkpoint "
                                                         r"holds experts \[0, 2"):
        hf_to_tune(broken, **dims)


@pytest.mark.parametrize("bad, message", [
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=8), "config.json num_experts_per_tok=8 must be between 1 and num_experts=4"),
])
def test_unsupported_moe_configs_are_refused_by_name(bad, message):
    config = {**SMALL, "intermediate_size": 48, "moe_intermediate_size": 16, **bad}
    with pytest.raises((NotImplementedError, ValueError), match=message):
        build_from_hf_config(config)
