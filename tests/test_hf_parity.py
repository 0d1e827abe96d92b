"""Our models against transformers on checkpoints that transformers itself writes.

For each family: a small model with *large random* weights (transformers' default initialisation is near zero,
which would hide a swapped norm or a missing RoPE permutation) is written with `save_pretrained`, loaded through
`FullModelHFCheckpointer` into the model `build_from_hf_config` builds, and must give transformers' logits within
1e-4 in fp32 — for a full forward, and token by token with the KV cache. The size builders are checked against
transformers models built from the published configs on the meta device (no weights, no memory).
"""
import math

import pytest
import torch
import transformers

from torchtune_lit.models import build_from_hf_config
from torchtune_lit.models.convert_weights import hf_to_tune, split_fused
from torchtune_lit.training import FullModelHFCheckpointer, load_model_state_dict

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama3": (transformers.LlamaConfig, "LLAMA3",
               dict(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, rms_norm_eps=1e-5)),
    "llama3_2_scaled_rope_tied": (transformers.LlamaConfig, "LLAMA3_2",
               dict(tie_word_embeddings=True, head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})),
    "qwen2_5_bias_tied": (transformers.Qwen2Config, "QWEN2",
               dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                    rms_norm_eps=1e-6)),
    "qwen3_qk_norm_tied": (transformers.Qwen3Config, "QWEN3",
               dict(tie_word_embeddings=True, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                    rms_norm_eps=1e-6)),
    "qwen3_qk_norm_untied": (transformers.Qwen3Config, "QWEN3",
               dict(tie_word_embeddings=False, head_dim=12, num_attention_heads=8, num_key_value_heads=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mistral_window_head_dim": (transformers.MistralConfig, "MISTRAL",
               dict(sliding_window=4, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "gemma2_softcap_window": (transformers.Gemma2Config, "GEMMA2",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "phi3_fused_window": (transformers.Phi3Config, "PHI4",
               dict(sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 250_000.0})),
    # Phi-4-mini's RoPE: 6 of 8 channels rotated, LongRoPE with random factors, tied output. With an original
    # context of 64 every call uses the short factors; with 2, every call (even the 3-token prefill) the long ones.
    **{f"phi4_mini_partial_longrope_{kind}": (transformers.Phi3Config, "PHI4", dict(
        tie_word_embeddings=True, partial_rotary_factor=0.75, original_max_position_embeddings=original,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.7, 0.9], "long_factor": [1.0, 4.0, 19.0]}))
       for kind, original in (("short", 64), ("long", 2))},
    "llama2_mha": (transformers.LlamaConfig, "LLAMA2",
               dict(num_key_value_heads=4, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "gemma_mqa_wide_heads": (transformers.GemmaConfig, "GEMMA",
               dict(head_dim=16, num_key_value_heads=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "gemma3_qk_norm_two_ropes": (transformers.Gemma3TextConfig, "GEMMA3",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    "Large random weights: unit-scale matrices, biases, and norm gains far from their initial value."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                gemma = isinstance(model, (transformers.GemmaForCausalLM, transformers.Gemma2ForCausalLM,
                                              transformers.Gemma3ForCausalLM))
                p.copy_(0.5 * noise if gemma else 1.0 + 0.5 * noise)   # Gemma's gain is 1 + w
            elif p.dim() == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) * (1.0 if "embed" in name else 1.5))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    "(our model, transformers model, name) for one family, loaded through our checkpointer."
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
    return ours, hf_model, request.param


def test_full_forward_logits_match_transformers(family):
    ours, hf_model, name = family
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    assert expected.abs().max() > 1.0, "weights too small for a meaningful comparison"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_kv_cache_decoding_matches_transformers_token_by_token(family):
    ours, hf_model, name = family
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        ours.setup_caches(batch_size=2, dtype=torch.float32)
        try:
            steps = [ours(tokens[:, :3])] + [ours(tokens[:, t:t + 1]) for t in range(3, 12)]
        finally:
            ours.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=1e-4)


def test_saved_checkpoint_loads_back_in_transformers_with_equal_logits(family, tmp_path):
    "Our checkpointer writes the model back (row order, fused matrices, tied output) as transformers reads it."
    ours, hf_model, name = family
    hf_model.save_pretrained(tmp_path / "in")
    checkpointer = FullModelHFCheckpointer(tmp_path / "in", output_dir=tmp_path / "out")
    folder = checkpointer.save_checkpoint({"model": ours.state_dict()}, epoch=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=1e-5)


def test_a_missing_permutation_would_be_caught(family):
    "The test weights are strong enough that skipping the q/k row permutation changes the logits visibly."
    ours, hf_model, name = family
    attn = ours.layers[0].attn   # Phi-3's fused qkv_proj split into q, k, v (a no-op for the other families)
    raw = split_fused(dict(hf_model.state_dict()), hf_model.config.model_type, attn.num_heads, attn.num_kv_heads,
                      attn.head_dim)
    wrong = {}
    for k, v in ours.state_dict().items():
        wrong[k] = v.clone()
    q_key = "model.layers.0.self_attn.q_proj.weight"
    wrong["layers.0.attn.q_proj.weight"] = raw[q_key].clone()       # HF row order: not permuted
    original = {k: v.clone() for k, v in ours.state_dict().items()}
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    try:
        ours.load_state_dict(wrong)
        with torch.no_grad():
            diff = (ours(tokens) - hf_model(tokens).logits).abs().max()
    finally:
        ours.load_state_dict(original)
    assert diff > 1e-2, diff


# Published config.json numbers of each size builder's checkpoint (the fields that shape the weights).
PUBLISHED = {
    "llama3.llama3_8b": (transformers.LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)),
    "llama3_1.llama3_1_8b": (transformers.LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)),
    "llama3_2.llama3_2_1b": (transformers.LlamaConfig, dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
    "llama3_2.llama3_2_3b": (transformers.LlamaConfig, dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                             num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen2_5.qwen2_5_0_5b": (transformers.Qwen2Config, dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_5.qwen2_5_1_5b": (transformers.Qwen2Config, dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                             num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_5.qwen2_5_3b": (transformers.Qwen2Config, dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                           num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_5.qwen2_5_7b": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                           num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3_3.llama3_3_70b": (transformers.LlamaConfig, dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)),
    "qwen3.qwen3_0_6b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=True)),
    "qwen3.qwen3_1_7b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=True)),
    "qwen3.qwen3_4b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                           num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=True)),
    "qwen3.qwen3_8b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                           num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=False)),
    "qwen3.qwen3_14b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                           num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=False)),
    "qwen3.qwen3_32b": (transformers.Qwen3Config, dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                           num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=False)),
    "mistral.mistral_7b": (transformers.MistralConfig, dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)),
    "mistral.mistral_7b_v0_3": (transformers.MistralConfig, dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                sliding_window=None, rope_theta=1e6)),
    "mistral.mistral_nemo_12b": (transformers.MistralConfig, dict(vocab_size=131072, hidden_size=5120, intermediate_size=14336,
                                 num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 sliding_window=None, rope_theta=1e6)),
    "mistral.mistral_small_24b": (transformers.MistralConfig, dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                                  num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  sliding_window=None, rope_theta=1e8)),
    "gemma2.gemma2_2b": (transformers.Gemma2Config, dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                         num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256)),
    "gemma2.gemma2_9b": (transformers.Gemma2Config, dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                         num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256)),
    "phi3.phi3_mini": (transformers.Phi3Config, dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, sliding_window=2047)),
    "phi4.phi4_14b": (transformers.Phi3Config, dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                      max_position_embeddings=16384, rope_theta=250000.0)),
    "phi4.phi4_mini": (transformers.Phi3Config, dict(vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       partial_rotary_factor=0.75, pad_token_id=199999)),
    "llama2.llama2_7b": (transformers.LlamaConfig, dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)),
    "llama2.llama2_13b": (transformers.LlamaConfig, dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                          num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40)),
    "llama2.llama2_70b": (transformers.LlamaConfig, dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)),
    "code_llama2.code_llama2_7b": (transformers.LlamaConfig, dict(vocab_size=32016, hidden_size=4096,
                                   intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=32)),
    "code_llama2.code_llama2_70b": (transformers.LlamaConfig, dict(vocab_size=32016, hidden_size=8192,
                                    intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                    num_key_value_heads=8)),
    "gemma.gemma_2b": (transformers.GemmaConfig, dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384,
                       num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256)),
    "gemma.gemma_7b": (transformers.GemmaConfig, dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16, head_dim=256)),
    "qwen2.qwen2_7b": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2_5.qwen2_5_32b_base": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=5120,
                                 intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                                 num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen2_5.qwen2_5_72b_instruct": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=8192,
                                     intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                                     num_key_value_heads=8, tie_word_embeddings=False)),
    "gemma3.gemma3_1b": (transformers.Gemma3TextConfig, dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=512)),
    "gemma3.gemma3_4b": (transformers.Gemma3TextConfig, dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                         num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256)),
    "gemma3.gemma3_12b": (transformers.Gemma3TextConfig, dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                          num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256)),
    "gemma3.gemma3_27b": (transformers.Gemma3TextConfig, dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                          num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                          query_pre_attn_scalar=168)),
}


@pytest.mark.parametrize("builder", sorted(PUBLISHED))
def test_size_builders_have_the_published_shapes(builder):
    import importlib
    module_name, fn_name = builder.rsplit(".", 1)
    config_cls, numbers = PUBLISHED[builder]
    config = config_cls(**numbers)
    with torch.device("meta"):
        ours = getattr(importlib.import_module(f"torchtune_lit.models.{module_name}"), fn_name)()
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    converted = hf_to_tune(theirs.state_dict(), num_heads=config.num_attention_heads,
                           num_kv_heads=config.num_key_value_heads, dim=config.hidden_size,
                           head_dim=getattr(config, "head_dim", None), model_type=config.model_type,
                           tie_word_embeddings=config.tie_word_embeddings)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


def test_gemma3_multimodal_checkpoint_loads_its_text_decoder_and_saves_a_text_model(tmp_path, capsys):
    """Gemma 3 4B+ on the Hub is multimodal: the checkpointer reads the text decoder (config completed by transformers'
    defaults, weights renamed), says how many vision tensors it left out, and saves a Gemma3ForCausalLM folder that
    transformers loads with the same logits."""
    text = dict(SMALL, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, vocab_size=300)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=297, eoi_token_index=298, image_token_index=299)
    torch.manual_seed(0)
    theirs = transformers.Gemma3ForConditionalGeneration(config).eval()
    for p in theirs.parameters():
        p.data = torch.randn(p.shape) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
    theirs.save_pretrained(tmp_path / "multimodal")
    checkpointer = FullModelHFCheckpointer(tmp_path / "multimodal", model_type="GEMMA3", output_dir=tmp_path / "out")
    assert checkpointer.config["model_type"] == "gemma3_text" and checkpointer.config["num_attention_heads"] == 4
    state = checkpointer.load_checkpoint()["model"]
    assert "tensors of the vision tower and projector were left out" in capsys.readouterr().out
    ours = build_from_hf_config(checkpointer.config).eval()
    load_model_state_dict(ours, state)
    tokens = torch.randint(0, 297, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=1e-4)
    folder = checkpointer.save_checkpoint({"model": ours.state_dict()}, epoch=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-4, rtol=1e-4)
