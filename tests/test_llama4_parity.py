"""Llama 4's text decoder against transformers' `Llama4ForCausalLM`, on checkpoints transformers itself writes.

Small configs in which chunked RoPE layers, global NoPE layers (with the query temperature), dense layers and MoE
layers all appear, and the sequence is longer than `attention_chunk_size`: random unit-scale weights written by
`save_pretrained`, loaded through `FullModelHFCheckpointer` into the model `build_from_hf_config` builds, must give
transformers' logits within 1e-4 in fp32 (measured ~3e-6), in one forward pass and token by token with our KV cache
(equal to our full forward within 1e-5), and `generate` picks transformers' greedy tokens; the keys convert
both ways exactly; our checkpointer writes a folder transformers reads with the same logits. The multimodal form
(`Llama4ForConditionalGeneration`, `model_type` llama4) loads its text decoder. Scout's and Maverick's text decoders
have transformers' parameter counts (meta device, configs from the published numbers; nothing downloads).
"""
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torchao.quantization import Int8WeightOnlyConfig

from torchtune_lit.generation import generate
from torchtune_lit.models import build_from_hf_config
from torchtune_lit.models.convert_weights import (
    hf_conversion_dims,
    hf_to_tune,
    tune_to_hf,
)
from torchtune_lit.models.llama4 import (
    llama4_maverick_17b_128e_text,
    llama4_scout_17b_16e_text,
)
from torchtune_lit.modules.moe import MoE
from torchtune_lit.recipes.quantize import (
    load_quantized,
    quantize_model,
    save_quantized,
)
from torchtune_lit.training import (
    FullModelHFCheckpointer,
    load_model_for_eval,
    load_model_state_dict,
)

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             attention_chunk_size=4, floor_scale=4, attn_scale=0.5)
CASES = {
    # Scout-like: scaled RoPE, q/k norm, one expert per token; dense and MoE layers mixed by moe_layers
    "scout_like": dict(num_local_experts=4, num_experts_per_tok=1, moe_layers=[1, 2], no_rope_layer_interval=2,
                       use_qk_norm=True,
                       rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=16)),
    # Maverick-like: every other layer MoE, no q/k norm, plain RoPE; two experts per token
    "maverick_like": dict(num_local_experts=6, num_experts_per_tok=2, interleave_moe_layer_step=2,
                          no_rope_layers=[1, 1, 0, 0], use_qk_norm=False,
                          rope_parameters=dict(rope_type="default", rope_theta=10_000.0)),
}
SEQ = 13  # > attention_chunk_size, and past several temperature steps (floor_scale 4)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    "Unit-scale random matrices (experts by their input width) and norm gains far from 1."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            fan_in = p.shape[1] if p.dim() == 3 else p.shape[-1]
            p.copy_(noise / fan_in**0.5 if p.dim() >= 2 else 1.0 + 0.5 * noise)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    "(ours, transformers' model, checkpoint folder), loaded through our checkpointer."
    config = transformers.Llama4TextConfig(**SMALL, **CASES[request.param], attn_implementation="eager")
    hf_model = transformers.Llama4ForCausalLM(config).eval()
    randomize_(hf_model)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    state = FullModelHFCheckpointer(folder, model_type="LLAMA4").load_checkpoint()["model"]
    ours = build_from_hf_config(folder).eval()
    load_model_state_dict(ours, state)
    return ours, hf_model, folder


def test_every_kind_of_layer_appears(case):
    ours, hf_model, _ = case
    config = hf_model.config
    kinds = {(isinstance(layer.mlp, MoE), layer.attn.attention_chunk_size is not None) for layer in ours.layers}
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}
    for i, layer in enumerate(ours.layers):
        assert isinstance(layer.mlp, MoE) == (i in config.moe_layers)
        assert (layer.attn.pos_embeddings is not None) == bool(config.no_rope_layers[i])
        assert layer.attn.attn_temperature_tuning == (not config.no_rope_layers[i])


def test_full_forward_logits_match_transformers(case):
    ours, hf_model, _ = case
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = hf_model(tokens).logits, ours(tokens)
    assert expected.abs().max() > 1.0, "weights too small for a meaningful comparison"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_kv_cache_decoding_matches_the_full_forward_and_transformers(case):
    ours, hf_model, _ = case
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        full = ours(tokens)
        ours.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=32)
        try:
            steps = [ours(tokens[:, :3])] + [ours(tokens[:, t:t + 1]) for t in range(3, SEQ)]
        finally:
            ours.remove_caches()
    incremental = torch.cat(steps, dim=1)
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(incremental, expected, atol=1e-4, rtol=1e-4)


def test_keys_convert_both_ways_exactly(case):
    ours, hf_model, folder = case
    files = load_file(folder / "model.safetensors")
    dims = hf_conversion_dims(hf_model.config.to_dict())
    converted = hf_to_tune(files, **dims)
    assert converted.keys() == ours.state_dict().keys()
    back = tune_to_hf(converted, **dims)
    assert back.keys() == files.keys()
    assert all(torch.equal(back[k], files[k]) for k in files)


def test_saved_checkpoint_loads_back_in_transformers_with_equal_logits(case, tmp_path):
    ours, hf_model, folder = case
    checkpointer = FullModelHFCheckpointer(folder, output_dir=tmp_path / "out")
    saved = checkpointer.save_checkpoint({"model": ours.state_dict()}, epoch=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=1e-5)


def test_multimodal_checkpoint_loads_its_text_decoder(tmp_path, capsys):
    """Llama4ForConditionalGeneration: torchtune's LLAMA4 reads it whole; LLAMA4_TEXT reads `language_model.` weights
    and leaves the vision side out; `build_from_hf_config` refuses the multimodal config unless asked for the text decoder alone."""
    text = transformers.Llama4TextConfig(**SMALL, **CASES["scout_like"])
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32)
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision)
    theirs = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize_(theirs)
    theirs.save_pretrained(tmp_path / "multimodal")
    whole = build_from_hf_config(tmp_path / "multimodal")  # vision encoder included
    assert type(whole).__name__ == "EarlyFusionModel" and "vision" in whole.encoders
    whole_state = FullModelHFCheckpointer(tmp_path / "multimodal", model_type="LLAMA4").load_checkpoint()["model"]
    assert whole_state.keys() == whole.state_dict().keys()  # torchtune's LLAMA4: the whole model
    checkpointer = FullModelHFCheckpointer(tmp_path / "multimodal", model_type="LLAMA4_TEXT")
    assert checkpointer.config["model_type"] == "llama4_text"
    state = checkpointer.load_checkpoint()["model"]
    assert "tensors of the vision tower and projector were left out" in capsys.readouterr().out
    ours = build_from_hf_config(tmp_path / "multimodal", text_only=True).eval()
    load_model_state_dict(ours, state)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=1e-4)



def test_multimodal_folder_loads_for_eval_and_quantize(tmp_path):
    """A published-style multimodal Llama 4 folder (model_type llama4) through what eval, generate and quantize use:
    `load_model_for_eval` builds the text decoder from the checkpointer's (text) config and gives the logits of
    transformers' Llama4ForConditionalGeneration (atol/rtol 1e-4); the quantize recipe's save and `load_quantized`
    reload the quantized text decoder with the same logits as the quantized model in memory (exact)."""
    text = transformers.Llama4TextConfig(**SMALL, **CASES["scout_like"])
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32)
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision)
    theirs = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize_(theirs)
    theirs.save_pretrained(tmp_path / "multimodal")
    checkpointer = FullModelHFCheckpointer(tmp_path / "multimodal", model_type="LLAMA4_TEXT")
    ours = load_model_for_eval(checkpointer, torch.device("cpu"), torch.float32)
    assert not ours.training
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = theirs(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=1e-4)
        quantize_model(ours, Int8WeightOnlyConfig())
        path = save_quantized(ours, tmp_path / "multimodal", tmp_path / "q", "int8")
        reloaded = load_quantized(path, Int8WeightOnlyConfig())
        torch.testing.assert_close(reloaded(tokens), ours(tokens), atol=0, rtol=0)

PUBLISHED_TEXT = dict(vocab_size=202_048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16_384,
                      num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      attention_chunk_size=8192)
PUBLISHED = {  # text builder -> the text_config of the published checkpoint's config.json
    llama4_scout_17b_16e_text: dict(
        num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True, max_position_embeddings=10_485_760,
        rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=16.0, low_freq_factor=1.0,
                             high_freq_factor=1.0, original_max_position_embeddings=8192)),
    llama4_maverick_17b_128e_text: dict(
        num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, max_position_embeddings=1_048_576,
        rope_parameters=dict(rope_type="default", rope_theta=500_000.0)),
}


@pytest.mark.parametrize("builder", list(PUBLISHED), ids=lambda b: b.__name__)
def test_size_builders_have_transformers_parameter_count(builder):
    config = transformers.Llama4TextConfig(**PUBLISHED_TEXT, **PUBLISHED[builder])
    with torch.device("meta"):
        ours, theirs = builder(), transformers.Llama4ForCausalLM(config)
        dims = hf_conversion_dims(config.to_dict())
        converted = tune_to_hf(ours.state_dict(), **dims)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(ours) == count(theirs)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(v.shape) for k, v in theirs.state_dict().items()
    }


def test_greedy_generation_matches_transformers(case):
    "Our `generate` (KV cache, its own masks and positions) picks transformers' greedy tokens, past several chunks."
    ours, hf_model, _ = case
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, 5:].tolist()
        actual = generate(ours, prompt, max_new_tokens=12, temperature=0.0, stop_tokens=None)[0]
    assert actual == expected
