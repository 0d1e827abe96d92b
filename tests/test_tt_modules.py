"""torchtune's public modules / PEFT / generation API, as a torchtune user calls it (issue #38).

Each check compares with a reference: PyTorch's own optimizer and slicing, torchao's NF4 tensors, or our
`generate`, which tests/test_hf_parity.py and the generation chapter hold equal to transformers' greedy decoding.
"""

import copy

import pytest
import torch
from torch import nn

from torchtune_lit.generation import generate, generate_next_token, sample
from torchtune_lit.models.llama3_2 import llama3_2
from torchtune_lit.modules import (
    classifier_model,
    delete_kv_caches,
    disable_kv_cache,
    local_kv_cache,
    reparametrize_as_dtype_state_dict_post_hook,
)
from torchtune_lit.modules.common_utils import slice_str_to_array
from torchtune_lit.modules.embedding_utils import resize_token_embeddings
from torchtune_lit.modules.layer_dropout import (
    LayerDropout,
    ScaleType,
    get_scale,
    prepare_layer_dropout,
)
from torchtune_lit.modules.low_precision.nf4 import FrozenNF4Linear, to_nf4
from torchtune_lit.modules.optim import OptimizerInBackward
from torchtune_lit.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_state_dict,
    validate_missing_and_unexpected_for_lora,
)

def tiny(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    options = dict(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=48
    )
    return llama3_2(**{**options, **kwargs}).eval()


@pytest.mark.parametrize(
    "text", ["3", "1:4", "::2", "1::3", ":5", "2:7:2", ":", "0,2,5"]
)
def test_slice_str_to_array_selects_what_python_slicing_selects(text):
    length = 8
    if "," in text:
        expected = {int(i) for i in text.split(",")}
    elif ":" not in text:
        expected = {int(text)}
    else:
        parts = [int(p) if p else None for p in text.split(":")]
        expected = set(range(length)[slice(*parts)])
    assert slice_str_to_array(text, length) == [i in expected for i in range(length)]


def test_kv_cache_context_managers_keep_logits_and_leave_no_cache():
    model = tiny()
    tokens = torch.randint(0, 64, (2, 9))
    mask = torch.ones(9, 48, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    positions = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        plain = model(tokens)
        with local_kv_cache(model, batch_size=2, device="cpu", dtype=torch.float32):
            torch.testing.assert_close(model(tokens, mask=mask, input_pos=positions), plain)
        assert not model.caches_are_setup()
        model.setup_caches(batch_size=2, dtype=torch.float32)
        with disable_kv_cache(model):
            assert not model.caches_are_enabled()
            torch.testing.assert_close(model(tokens), plain)
        assert model.caches_are_enabled()
    delete_kv_caches(model)
    with pytest.raises(ValueError, match="not set up"):
        delete_kv_caches(model)


def test_optimizer_in_backward_matches_adamw_under_a_schedule():
    torch.manual_seed(0)
    net_a = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1))
    net_b = copy.deepcopy(net_a)
    opt_a = torch.optim.AdamW(net_a.parameters(), lr=0.05, weight_decay=0.1)
    opt_b = OptimizerInBackward(net_b.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.7)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.7)
    x, y = torch.randn(12, 5), torch.randn(12, 1)
    for _ in range(4):
        nn.functional.mse_loss(net_a(x), y).backward()
        opt_a.step()
        opt_a.zero_grad()
        sched_a.step()
        nn.functional.mse_loss(net_b(x), y).backward()
        opt_b.step()
        sched_b.step()
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(pa, pb)
    # the state dict round-trips into a fresh wrapper
    fresh = OptimizerInBackward(net_b.parameters(), torch.optim.AdamW, lr=0.05)
    fresh.load_state_dict(opt_b.state_dict())
    assert fresh.state_dict()["optimizers"].keys() == opt_b.state_dict()["optimizers"].keys()
    with pytest.raises(RuntimeError, match="no closure"):
        opt_b.step(lambda: 0.0)


def test_sample_with_noise_draws_from_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    draws = 20_000
    q = -torch.log(torch.rand(draws, 4))
    picks = sample(logits.expand(draws, -1), q=q)[:, 0]
    freq = torch.bincount(picks, minlength=4).float() / draws
    torch.testing.assert_close(freq, logits.softmax(-1), atol=0.015, rtol=0)
    one_hot = torch.zeros(100)
    one_hot[42] = 1.0
    assert sample(one_hot, top_k=1, q=torch.ones(100)).item() == 42


def test_torchtune_generate_greedy_equals_ours_and_cache_padding_change_nothing():
    model = tiny()
    prompt = torch.arange(3, 11)
    tokens, logits = generate(model, prompt=prompt, max_generated_tokens=5, top_k=1)
    assert tokens.shape == (1, 13) and logits.shape == (1, 5, 64)
    assert tokens[0, :8].tolist() == prompt.tolist()
    assert tokens[0, 8:].tolist() == generate(model, [prompt.tolist()], 5)[0]
    # the last step's logits are the model's at the last position
    torch.testing.assert_close(logits[0, -1], model(tokens[:, :-1])[0, -1])

    def sampled(prompt):
        torch.manual_seed(7)
        return generate(model, prompt=prompt, max_generated_tokens=5, temperature=0.7, top_k=10)

    plain_tokens, plain_logits = sampled(prompt)
    model.setup_caches(batch_size=2, dtype=torch.float32)
    padded = torch.cat([torch.zeros(3, dtype=torch.long), prompt]).repeat(2, 1)
    cached_tokens, cached_logits = sampled(padded)
    model.remove_caches()
    assert torch.equal(cached_tokens[:, 3:], plain_tokens.repeat(2, 1))
    torch.testing.assert_close(cached_logits, plain_logits.repeat(2, 1, 1), atol=1e-4, rtol=1e-5)


def test_torchtune_generate_pads_after_a_stop_token():
    model = tiny()
    prompt = torch.arange(3, 11).repeat(2, 1)
    torch.manual_seed(3)
    free, _ = generate(model, prompt=prompt, max_generated_tokens=4, temperature=0.9)
    stop = int(free[0, 8])
    torch.manual_seed(3)
    out, logits = generate(
        model, prompt=prompt, max_generated_tokens=4, temperature=0.9,
        stop_tokens=[stop], pad_id=-1,
    )  # fmt: skip
    row0 = out[0, 8:].tolist()
    assert row0[0] == stop and set(row0[1:]) <= {-1}
    assert (logits[0, 1:] == 0).all()


def test_generate_next_token_returns_token_and_last_logits():
    model = tiny()
    x = torch.arange(2, 8)[None]
    token, logits = generate_next_token(model, torch.arange(6)[None], x, top_k=1)
    torch.testing.assert_close(logits[:, 0], model(x)[:, -1])
    assert token.item() == model(x)[0, -1].argmax().item()


def test_validate_missing_and_unexpected_for_lora_in_torchtune_form():
    keys = ["q_proj.weight", "q_proj.lora_a.weight", "q_proj.lora_b.weight", "k_proj.weight"]
    # the expected splits: base load misses adapter keys only, adapter load base keys only
    validate_missing_and_unexpected_for_lora(
        None, None, None, keys, ["q_proj.lora_a.weight", "q_proj.lora_b.weight"], [],
        ["q_proj.weight", "k_proj.weight"], [],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="Missing non-LoRA keys.*k_proj.weight"):
        validate_missing_and_unexpected_for_lora(state_dict_keys=keys, base_missing=["k_proj.weight"])
    with pytest.raises(RuntimeError, match="Missing LoRA key"):
        validate_missing_and_unexpected_for_lora(
            ["q_proj"], False, False, lora_missing=["q_proj.lora_a.weight"]
        )
    with pytest.raises(RuntimeError, match="loading adapter"):
        validate_missing_and_unexpected_for_lora(state_dict_keys=keys, lora_unexpected=["x"])


def test_lora_and_dora_arguments_as_in_torchtune():
    with pytest.raises(ValueError, match="quantize_base`` is False"):
        LoRALinear(64, 32, rank=4, alpha=8, block_size=32)
    qlora = LoRALinear(512, 64, rank=4, alpha=8, quantize_base=True, block_size=32)
    assert qlora.weight.block_size == 32
    with torch.device("meta"):
        dora = DoRALinear(16, 8, rank=2, alpha=4)
    with pytest.raises(RuntimeError, match="Cannot initialize DoRA magnitude"):
        dora.initialize_dora_magnitude()
    state = {"a.lora_a.weight": torch.ones(1), "a.weight": torch.ones(1), "a.magnitude": torch.ones(1)}
    assert set(get_adapter_state_dict(state, device="cpu")) == {"a.lora_a.weight", "a.magnitude"}


def test_frozen_nf4_linear_bias_and_state_dict_hook_match_torchao():
    torch.manual_seed(0)
    layer = FrozenNF4Linear(256, 64, bias=True, dtype=torch.bfloat16)
    dense = torch.randn(64, 256, dtype=torch.bfloat16)
    layer.load_state_dict({"weight": dense, "bias": torch.full((64,), 0.5, dtype=torch.bfloat16)})
    reference = to_nf4(dense).get_original_weight()  # torchao's dequantised weight
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), x @ reference.T + 0.5)
    layer._register_state_dict_hook(reparametrize_as_dtype_state_dict_post_hook)
    saved = layer.state_dict()
    assert saved["weight"].dtype == torch.bfloat16 and torch.equal(saved["weight"], reference)


def test_classifier_model_from_a_torchtune_path():
    model = classifier_model(
        num_classes=3, base_model_path="torchtune.models.llama3_2.llama3_2",
        vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=16,
    )  # fmt: skip
    assert model(torch.randint(0, 64, (2, 5))).shape == (2, 5, 3)
    with pytest.raises(ValueError, match="names no builder"):
        classifier_model(num_classes=1, base_model_path="torchtune_lit.models.nope.nope")


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_new_rows_are_the_mean(tied):
    model = tiny(tie_word_embeddings=tied)
    old = model.tok_embeddings.weight.detach().clone()
    resize_token_embeddings(model, 70)
    new = model.tok_embeddings.weight
    torch.testing.assert_close(new[:64], old)
    torch.testing.assert_close(new[64:], old.mean(0, keepdim=True).expand(6, -1))
    assert model.output.weight.shape == (70, 32)


def test_layer_dropout_curves_and_wrapping():
    period = 4
    expected = {
        ScaleType.LINEAR: 0.5,
        ScaleType.EXP: 2**0.5 - 1,
        ScaleType.SIN: 2**-0.5,
        ScaleType.SIGMOID: 0.5,
        ScaleType.UNIFORM: 1.0,
    }
    for kind, value in expected.items():
        assert get_scale(kind, period, 2) == pytest.approx(value)
        assert get_scale(kind, period, period) == 1.0
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(5)])
    plain = {k: v.clone() for k, v in layers.state_dict().items()}
    prepare_layer_dropout(layers, prob_max=0.4, prob_layer_scale="linear", layers_str="1:")
    assert [layer.dropout.prob for layer in layers] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert set(layers.state_dict()) == set(plain)  # no `module.` in the keys
    layers.load_state_dict(plain)
    x = torch.randn(6, 4)
    assert torch.equal(LayerDropout(prob=1.0)(torch.sin, x), x)
