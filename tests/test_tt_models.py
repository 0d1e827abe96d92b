"""torchtune's model-builder API on our package: the names its configs and tests import, with its arguments.

Values are checked against transformers (tests/test_hf_parity.py holds the logit parity and the published sizes);
here: that the names exist where torchtune users look for them, take torchtune's arguments, and build the
architecture those arguments describe.
"""
import importlib
import inspect

import pytest
import torch

from torchtune_lit.models import get_family
from torchtune_lit.models.llama2 import (
    llama2,
    llama2_classifier,
    lora_llama2,
    lora_llama2_mlp,
    lora_llama2_self_attention,
    scale_hidden_dim_for_mlp,
)

# builder names that torchtune's configs and docs use, by module of torchtune_lit.models
TORCHTUNE_BUILDERS = {
    "llama2": ["llama2_7b", "llama2_13b", "llama2_70b", "lora_llama2_7b", "lora_llama2_13b", "lora_llama2_70b",
               "qlora_llama2_7b", "qlora_llama2_13b", "qlora_llama2_70b", "llama2_reward_7b",
               "lora_llama2_reward_7b", "qlora_llama2_reward_7b", "lora_llama2_classifier", "llama2_tokenizer"],
    "code_llama2": ["code_llama2_7b", "code_llama2_13b", "code_llama2_70b", "lora_code_llama2_7b",
                    "qlora_code_llama2_7b"],
    "gemma": ["gemma", "gemma_2b", "gemma_7b", "lora_gemma", "lora_gemma_2b", "lora_gemma_7b", "qlora_gemma_2b",
              "qlora_gemma_7b", "gemma_tokenizer"],
    "qwen2": ["qwen2_0_5b", "qwen2_1_5b", "qwen2_7b", "lora_qwen2_0_5b", "lora_qwen2_1_5b", "lora_qwen2_7b"],
    "qwen2_5": [f"{lora}qwen2_5_{size}_{kind}" for lora in ("", "lora_") for size in ("1_5b", "7b", "14b", "32b", "72b")
                for kind in ("base", "instruct")],
    "qwen3": [f"{lora}qwen3_{size}_{kind}" for lora in ("", "lora_") for size in ("0_6b", "1_7b", "4b", "8b", "14b")
              for kind in ("base", "instruct")],
    "mistral": ["mistral_classifier", "mistral_reward_7b", "lora_mistral_classifier", "lora_mistral_reward_7b",
                "qlora_mistral_reward_7b"],
    "llama3_1": ["Llama3ScaledRoPE"],
}


@pytest.mark.parametrize("module", sorted(TORCHTUNE_BUILDERS))
def test_torchtune_builder_names_exist(module):
    package = importlib.import_module(f"torchtune_lit.models.{module}")
    missing = [name for name in TORCHTUNE_BUILDERS[module] if not callable(getattr(package, name, None))]
    assert not missing, f"torchtune_lit.models.{module} lacks {missing}"


def test_llama2_takes_torchtune_arguments_in_torchtune_order():
    "A positional call as torchtune's tests write it reaches the same parameters."
    names = list(inspect.signature(llama2).parameters)
    assert names[:9] == ["vocab_size", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "max_seq_len",
                         "attn_dropout", "intermediate_dim", "norm_eps"]
    model = llama2(50, 2, 4, 2, 64, 32)
    attn = model.layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 16)
    assert model.layers[0].mlp.w1.out_features == scale_hidden_dim_for_mlp(64) == 256
    assert attn.pos_embeddings.base == 10_000


def test_lora_llama2_names_and_frozen_shapes():
    model = lora_llama2(["q_proj", "v_proj"], apply_lora_to_mlp=True, vocab_size=50, num_layers=2, num_heads=4,
                        num_kv_heads=2, embed_dim=64, max_seq_len=32, lora_rank=4, lora_alpha=8.0)
    names = set(model.state_dict())
    assert {"layers.0.attn.q_proj.weight", "layers.0.attn.q_proj.lora_a.weight", "layers.1.mlp.w2.lora_b.weight",
            "tok_embeddings.weight", "output.weight", "norm.scale"} <= names
    assert "layers.0.attn.k_proj.lora_a.weight" not in names
    # the base weights are llama2's: the same names and shapes once the adapters are left out
    base = llama2(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32)
    assert {k: v.shape for k, v in model.state_dict().items() if "lora_" not in k} == \
        {k: v.shape for k, v in base.state_dict().items()}


def test_lora_llama2_parts_refuse_an_empty_module_list_and_count_adapters():
    with pytest.raises(ValueError, match="Must pass one or more of"):
        lora_llama2_self_attention([], embed_dim=64, num_heads=4, num_kv_heads=2, max_seq_len=32, lora_rank=4,
                                   lora_alpha=8.0)
    attn = lora_llama2_self_attention(["k_proj"], embed_dim=64, num_heads=4, num_kv_heads=2, max_seq_len=32,
                                      lora_rank=4, lora_alpha=8.0)
    assert sum(p.numel() for n, p in attn.named_parameters() if "lora_" in n) == 4 * (64 + 32)
    mlp = lora_llama2_mlp(dim=64, hidden_dim=128, lora_rank=2, lora_alpha=4.0)
    assert sum(p.numel() for n, p in mlp.named_parameters() if "lora_" in n) == 3 * 2 * (64 + 128)


def test_llama2_classifier_is_the_body_with_a_score_head():
    torch.manual_seed(0)
    kwargs = dict(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=32, max_seq_len=16)
    classifier, lm = llama2_classifier(num_classes=2, **kwargs).eval(), llama2(**kwargs).eval()
    body = {k: v for k, v in classifier.state_dict().items() if not k.startswith("output.")}
    lm.load_state_dict(body, strict=False)
    tokens = torch.randint(0, 50, (1, 8))
    lm.output = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(classifier(tokens), lm(tokens) @ classifier.output.weight.T)


def test_base_and_instruct_builders_differ_only_in_context():
    from torchtune_lit.models.qwen2_5 import qwen2_5_14b_base, qwen2_5_14b_instruct
    from torchtune_lit.models.qwen3 import qwen3_4b_base, qwen3_4b_instruct
    with torch.device("meta"):
        pairs = [(qwen2_5_14b_base(), qwen2_5_14b_instruct(), 131_072, 32_768),
                 (qwen3_4b_base(), qwen3_4b_instruct(), 32_768, 40_960)]
    for base, instruct, base_len, instruct_len in pairs:
        assert {k: v.shape for k, v in base.state_dict().items()} == \
            {k: v.shape for k, v in instruct.state_dict().items()}
        assert (base.max_seq_len, instruct.max_seq_len) == (base_len, instruct_len)


def test_checkpointer_model_types_of_the_new_families():
    "torchtune's LLAMA2 and GEMMA checkpoints are read with the llama and gemma key maps."
    assert get_family("LLAMA2").hf_model_type == "llama"
    assert get_family("GEMMA").hf_model_type == "gemma"
    assert get_family("GEMMA").tied_by_default


# --- Mistral's [INST] markers, and the one-block LoRA builders of Qwen 2 and Phi-3 (issue #38) ---

def test_mistral_chat_template_wraps_user_turns_as_text_and_refuses_a_system_turn():
    "The model card's layout `[INST] Instruction [/INST] Model answer`: the user turn wrapped, the answer untouched."
    from torchtune_lit.data import Message
    from torchtune_lit.models.mistral import MistralChatTemplate
    out = MistralChatTemplate()([Message("user", "Name the column.", masked=True), Message("assistant", "dob")])
    assert [(m.role, m.text_content, m.masked) for m in out] == [
        ("user", "[INST] Name the column. [/INST] ", True), ("assistant", "dob", False)]
    with pytest.raises(ValueError, match="System prompts are not supported in MistralChatTemplate"):
        MistralChatTemplate()([Message("system", "Be brief."), Message("user", "hi")])


def test_mistral_tokenizer_writes_inst_as_text_when_the_vocabulary_lacks_it():
    from torchtune_lit.config import _asset_path
    from torchtune_lit.data import Message
    from torchtune_lit.models.mistral import MistralTokenizer, mistral_tokenizer
    tokenizer = mistral_tokenizer(_asset_path("tiny/tokenizer.model"))  # SentencePiece, no [INST] piece
    assert isinstance(tokenizer, MistralTokenizer) and tokenizer.stop_tokens == [tokenizer.eos_id]
    chat = [Message("user", "Which column holds dates?", masked=True), Message("assistant", "The second.")]
    tokens, mask = tokenizer.tokenize_messages(chat)
    assert tokenizer.decode(tokens) == "[INST] Which column holds dates? [/INST] The second."
    assert (tokens[0], tokens[-1]) == (tokenizer.bos_id, tokenizer.eos_id)
    prompt, _ = tokenizer.tokenize_messages(chat[:1])
    assert mask == [True] * len(prompt) + [False] * (len(tokens) - len(prompt))
    assert tokenizer.tokenize_messages(chat, add_eos=False)[0] == tokens[:-1]
    with pytest.raises(ValueError, match="truncation_type"):
        mistral_tokenizer(_asset_path("tiny/tokenizer.model"), truncation_type="left")


def test_mistral_tokenizer_uses_the_control_tokens_when_the_vocabulary_has_them(tmp_path):
    "On a v0.3-like tokenizer.json the ids equal transformers' chat template; the default template adds no text."
    import transformers
    from test_tokenizer_parity import MISTRAL_V03_TEMPLATE, save_small_bpe

    from torchtune_lit.data import Message
    from torchtune_lit.models.mistral import MistralChatTemplate, mistral_tokenizer
    save_small_bpe(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"])
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                     bos_token="<s>", eos_token="</s>")
    reference.chat_template = MISTRAL_V03_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    conversation = [{"role": "user", "content": "zip: 75011, 10115"}, {"role": "assistant", "content": "postal_code"},
                    {"role": "user", "content": "amount: 1.234,50 EUR"}, {"role": "assistant", "content": "currency"}]
    expected = list(reference.apply_chat_template(conversation, tokenize=True)["input_ids"])
    messages = [Message(m["role"], m["content"]) for m in conversation]
    for template in ("torchtune_lit.models.mistral.MistralChatTemplate", MistralChatTemplate(), None):
        tokenizer = mistral_tokenizer(tmp_path / "tokenizer.json", prompt_template=template)
        assert tokenizer.tokenize_messages(messages, add_end_tokens=False)[0] == expected


def test_mistral_tokenizer_refuses_a_tokenizer_json_without_inst(tmp_path):
    from test_tokenizer_parity import save_small_bpe

    from torchtune_lit.models.mistral import mistral_tokenizer
    save_small_bpe(tmp_path / "tokenizer.json", ["<unk>", "<s>", "</s>"])
    with pytest.raises(ValueError, match=r"no \[INST\] control token.*tokenizer.model"):
        mistral_tokenizer(tmp_path / "tokenizer.json")


# torchtune's keyword arguments of the one-block builders (its _component_builders signatures)
QWEN2_BLOCK_ARGS = ["embed_dim", "num_heads", "num_kv_heads", "max_seq_len", "head_dim", "attn_dropout", "norm_eps",
                    "rope_base", "q_proj_bias", "k_proj_bias", "v_proj_bias", "q_norm", "k_norm", "lora_rank",
                    "lora_alpha", "lora_dropout", "use_dora", "quantize_base"]
PHI3_BLOCK_ARGS = ["embed_dim", "num_heads", "num_kv_heads", "max_seq_len", "attn_dropout", "rope_base", "lora_rank",
                   "lora_alpha", "lora_dropout", "use_dora", "quantize_base"]


def _same_block_output(block, attn) -> None:
    "`block` loads `attn`'s weights (only adapter keys missing) and, adapters at zero, gives `attn`'s output."
    missing, unexpected = block.load_state_dict(attn.state_dict(), strict=False)
    assert not unexpected and missing and all("lora_" in k for k in missing)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(block(x, x), attn(x, x), atol=1e-6, rtol=1e-6)


def test_lora_qwen2_self_attention_is_layer0_of_qwen2_or_qwen3():
    from torchtune_lit.models.qwen2 import lora_qwen2_self_attention, qwen2
    from torchtune_lit.models.qwen3 import qwen3
    assert set(QWEN2_BLOCK_ARGS) <= set(inspect.signature(lora_qwen2_self_attention).parameters)
    torch.manual_seed(0)
    sizes = dict(num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32)
    model_sizes = dict(vocab_size=10, num_layers=1, intermediate_dim=32, norm_eps=1e-5, **sizes)
    qwen2_block = lora_qwen2_self_attention(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0, **sizes)
    assert qwen2_block.q_proj.bias is not None and qwen2_block.q_norm is None
    _same_block_output(qwen2_block, qwen2(**model_sizes).layers[0].attn)
    qwen3_block = lora_qwen2_self_attention(["k_proj"], lora_rank=4, lora_alpha=8.0, q_proj_bias=False,
                                            k_proj_bias=False, v_proj_bias=False, q_norm=True, k_norm=True, **sizes)
    with torch.no_grad():  # norm gains away from 1, so a missing q/k norm would show
        qwen3_reference = qwen3(**model_sizes).layers[0].attn
        qwen3_reference.q_norm.scale.uniform_(0.5, 1.5)
        qwen3_reference.k_norm.scale.uniform_(0.5, 1.5)
    _same_block_output(qwen3_block, qwen3_reference)
    with pytest.raises(ValueError, match="Must pass one or more of"):
        lora_qwen2_self_attention([], lora_rank=4, lora_alpha=8.0, **sizes)
    with pytest.raises(ValueError, match="Qwen 2.*Qwen 3"):
        lora_qwen2_self_attention(["q_proj"], lora_rank=4, lora_alpha=8.0, q_norm=True, **sizes)


def test_lora_phi3_self_attention_is_layer0_of_phi3():
    from torchtune_lit.models.phi3 import lora_phi3_self_attention, phi3
    assert set(PHI3_BLOCK_ARGS) <= set(inspect.signature(lora_phi3_self_attention).parameters)
    torch.manual_seed(0)
    sizes = dict(num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32, sliding_window=4)
    block = lora_phi3_self_attention(["q_proj", "k_proj", "v_proj", "output_proj"], lora_rank=4, lora_alpha=8.0,
                                     **sizes)
    assert block.sliding_window == 4 and block.q_proj.bias is None
    _same_block_output(block, phi3(vocab_size=10, num_layers=1, intermediate_dim=32, **sizes).layers[0].attn)
    with pytest.raises(ValueError, match="Must pass one or more of"):
        lora_phi3_self_attention([], lora_rank=4, lora_alpha=8.0, **sizes)
