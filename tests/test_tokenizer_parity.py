"""Our tokenizers against transformers on the same tokenizer files.

Small real tokenizers are trained here with Hugging Face `tokenizers` (byte-level BPE on the shipped corpus) and given
each family's special tokens; the chat templates are the models' own template texts (Qwen 2.5's and Qwen 3's without
their tool-calling branches, which these conversations do not use). transformers renders and tokenises; we tokenise
messages; the ids must be identical.
"""
import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtune_lit.config import _asset_path
from torchtune_lit.data._messages import Message
from torchtune_lit.tokenizers._base import HuggingFaceBaseTokenizer
from torchtune_lit.tokenizers._chat import (
    LLAMA3_SPECIAL_TOKENS,
    gemma_tokenizer,
    llama3_tokenizer,
    mistral_tokenizer,
    qwen2_5_tokenizer,
)
from torchtune_lit.tokenizers._hf_template import HuggingFaceModelTokenizer

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN2_5_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + message.role + '\n' + message.content + "
    "'<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
    "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + "
    "role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}")

MISTRAL_V03_TEMPLATE = (  # the user/assistant rendering of Mistral-7B-Instruct-v0.3's template (no tools, no system)
    "{{- bos_token }}{%- for message in messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content']|trim + eos_token }}{%- endif %}{%- endfor %}")

FAMILIES = {
    "llama3": (LLAMA3_SPECIAL_TOKENS[:11], "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE, llama3_tokenizer),
    "qwen2_5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", QWEN2_5_TEMPLATE, qwen2_5_tokenizer),
    "gemma2": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", GEMMA2_TEMPLATE, gemma_tokenizer),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", MISTRAL_V03_TEMPLATE, mistral_tokenizer),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What type is the column 'dob' with values 03/04/1987, 25/12/1990?"},
     {"role": "assistant", "content": "date_of_birth"}],
    [{"role": "system", "content": "You name column types.\nAnswer with one label."},
     {"role": "user", "content": "  zip: 75011, 10115  \n"},
     {"role": "assistant", "content": "postal_code"},
     {"role": "user", "content": "amount: 1.234,50 EUR — $1,234.50"},
     {"role": "assistant", "content": " currency_amount\n"}],
]


def save_small_bpe(path, specials: list[str]) -> None:
    "A byte-level BPE of 600 tokens trained on the shipped corpus, with `specials` as its special tokens."
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([_asset_path("tiny/corpus.txt")], trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(str(path))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    specials, bos, eos, template, builder = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_small_bpe(folder / "tokenizer.json", specials)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos,
                                                     eos_token=eos)
    reference.chat_template = template
    reference.folder = folder  # for the checkpoint-template tokenizer
    return request.param, builder(folder / "tokenizer.json"), reference


def reference_ids(reference, conversation, add_generation_prompt):
    out = reference.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, (dict, transformers.BatchEncoding)) else out)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_format_ids_equal_apply_chat_template(family, index, generation_prompt):
    name, ours, reference = family
    conversation = CONVERSATIONS[index]
    if name in ("gemma2", "mistral") and conversation[0]["role"] == "system":
        pytest.skip("this template has no system role (ours refuses it too, tested below)")
    if generation_prompt and name == "mistral":
        pytest.skip("Mistral's template has no generation prompt: the prompt ends with [/INST]")
    if generation_prompt:
        conversation = conversation[:-1]
    messages = [Message(m["role"], m["content"]) for m in conversation]
    tokens, mask = ours.tokenize_messages(messages, add_end_tokens=False, add_generation_prompt=generation_prompt)
    assert tokens == reference_ids(reference, conversation, generation_prompt)
    assert len(mask) == len(tokens)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_checkpoint_template_tokenizer_equals_apply_chat_template(family, index, generation_prompt):
    """The tokenizer that renders the checkpoint's own template gives transformers' ids, and trains exactly the
    assistant answers (with the template's end-of-turn text)."""
    name, _, reference = family
    conversation = CONVERSATIONS[index][:-1] if generation_prompt else CONVERSATIONS[index]
    ours = HuggingFaceModelTokenizer(reference.folder / "tokenizer.json", chat_template=reference.chat_template)
    messages = [Message(m["role"], m["content"], masked=m["role"] != "assistant") for m in conversation]
    if name in ("gemma2", "mistral") and conversation[0]["role"] == "system":
        with pytest.raises(Exception, match="(?i)system|alternate"):   # the template's own raise_exception
            reference_ids(reference, conversation, generation_prompt)
        with pytest.raises(Exception, match="(?i)system|alternate"):
            ours.tokenize_messages(messages, add_generation_prompt=generation_prompt)
        return
    tokens, mask = ours.tokenize_messages(messages, add_generation_prompt=generation_prompt)
    assert tokens == reference_ids(reference, conversation, generation_prompt)
    trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    answers = [m["content"].strip() for m in conversation if m["role"] == "assistant"]
    for answer in answers:
        assert answer in trained, (trained, answer)
    for m in conversation:
        if m["role"] != "assistant":
            assert m["content"].strip() not in trained


def test_formats_without_system_turn_refuse_one(family):
    name, ours, _ = family
    if name not in ("gemma2", "mistral"):
        pytest.skip("Gemma and Mistral only")
    with pytest.raises(ValueError, match="no system turn"):
        ours.tokenize_messages([Message(**m) for m in CONVERSATIONS[1]])


@pytest.mark.parametrize("text", ["plain text", "  leading and trailing  ", "emoji 🙂 and ünïcödé", "line\n\nbreaks\n"])
def test_base_tokenizer_ids_equal_transformers(family, text):
    _, ours, reference = family
    base = ours.base
    assert isinstance(base, HuggingFaceBaseTokenizer)
    assert base.encode(text, add_bos=False, add_eos=False) == reference(text, add_special_tokens=False)["input_ids"]
    if base.bos_id is not None:
        assert base.encode(text, add_bos=True, add_eos=True) == (
            [reference.bos_token_id] + reference(text, add_special_tokens=False)["input_ids"] + [reference.eos_token_id])
    assert base.decode(base.encode(text, False, False)) == text


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_level_table():
    "GPT-2's printable-character -> byte table, as ByteLevel writes BPE tokens."
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.mark.parametrize("text", ["plain text", "  leading and trailing  ", "emoji 🙂 and ünïcödé", "dob: 1987-03-04\n"])
def test_tiktoken_base_tokenizer_equals_transformers_on_the_same_bpe(tmp_path, text):
    "A tiktoken rank file written from a byte-level BPE's vocabulary tokenises like transformers does with the BPE."
    import base64

    from torchtune_lit.tokenizers._base import TikTokenBaseTokenizer
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([_asset_path("tiny/corpus.txt")], trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                                    show_progress=False))
    bpe.save(str(tmp_path / "tokenizer.json"))
    to_byte = _byte_level_table()
    with open(tmp_path / "ranks.tiktoken", "w") as f:
        for token, rank in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(bytes(to_byte[c] for c in token)).decode() + f" {rank}\n")
    n = bpe.get_vocab_size()
    ours = TikTokenBaseTokenizer(tmp_path / "ranks.tiktoken", name="t", pattern=GPT2_PATTERN, bos_id=n, eos_id=n + 1,
                                 special_tokens={"<|begin|>": n, "<|end|>": n + 1})
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert ours.encode(text, add_bos=False, add_eos=False) == reference(text, add_special_tokens=False)["input_ids"]


# Templates checked only through the checkpoint-template tokenizer (no hand-written format renders them exactly), as
# published in each checkpoint's tokenizer_config.json, tool-calling branches left out: Gemma 3's, which folds a system
# message into the first user turn; Qwen 3's, whose answers after the last user message carry a <think> block and whose
# generation prompt, with enable_thinking=false, ends with an empty one; Llama 3.3's (Llama 3.1's), whose system header
# always carries the dates; Mistral NeMo's, which puts the system message into the last user message only (so a
# finished conversation drops it); Phi-4's ChatML with <|im_sep|>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set "
    "loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) -%}{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\")"
    " }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}{%- set role = "
    "message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}")

QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}{%- if ns.multi_step_tool and message.role == \"user\" and "
    "message.content is string and not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = "
    "index %}{%- endif %}{%- endfor %}{%- for message in messages %}{%- if message.content is string %}{%- set content = "
    "message.content %}{%- else %}{%- set content = '' %}{%- endif %}{%- if (message.role == \"user\") or (message.role == "
    "\"system\" and not loop.first) %}{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}{%- elif "
    "message.role == \"assistant\" %}{%- set reasoning_content = '' %}{%- if message.reasoning_content is string %}{%- set "
    "reasoning_content = message.reasoning_content %}{%- else %}{%- if '</think>' in content %}{%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}{%- set content = "
    "content.split('</think>')[-1].lstrip('\n') %}{%- endif %}{%- endif %}{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}{{- '<|im_start|>' + message.role + '\n<think>\n' + "
    "reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}{%- else %}{{- '<|im_start|>' + "
    "message.role + '\n' + content }}{%- endif %}{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}"
    "{%- endif %}{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")

LLAMA3_3_TEMPLATE = (  # Llama 3.1 / 3.3 Instruct: a system header with the knowledge and today's date, always
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = "
    "messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\n\n\" }}{{- \"Cutting Knowledge Date: December 2023\n\" }}"
    "{{- \"Today Date: \" + date_string + \"\n\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}"
    "{%- for message in messages %}{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in "
    "message) %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")

MISTRAL_NEMO_TEMPLATE = (  # Mistral-Nemo-Instruct-2407: the system message joins the *last* user message only
    "{%- if messages[0][\"role\"] == \"system\" %}{%- set system_message = messages[0][\"content\"] %}{%- set "
    "loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}{%- set ns = namespace() %}"
    "{%- set ns.index = 0 %}{%- for message in loop_messages %}{%- if (message[\"role\"] == \"user\") != (ns.index % 2 == "
    "0) %}{{- raise_exception(\"After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endfor %}{{- bos_token }}"
    "{%- for message in loop_messages %}{%- if message[\"role\"] == \"user\" %}{%- if loop.last and system_message is "
    "defined %}{{- \"[INST]\" + system_message + \"\n\n\" + message[\"content\"] + \"[/INST]\" }}{%- else %}"
    "{{- \"[INST]\" + message[\"content\"] + \"[/INST]\" }}{%- endif %}{%- elif message[\"role\"] == \"assistant\" %}"
    "{{- message[\"content\"] + eos_token}}{%- else %}{{- raise_exception(\"Only user and assistant roles are "
    "supported\") }}{%- endif %}{%- endfor %}")

PHI4_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}")

TEMPLATE_ONLY = {
    "llama3_3": (LLAMA3_SPECIAL_TOKENS[:11], "<|begin_of_text|>", "<|eot_id|>", LLAMA3_3_TEMPLATE, {}),
    "mistral_nemo": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", MISTRAL_NEMO_TEMPLATE, {}),
    "phi4": (["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"], None, "<|im_end|>", PHI4_TEMPLATE, {}),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", GEMMA3_TEMPLATE, {}),
    "qwen3_thinking": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
                       QWEN3_TEMPLATE, {}),
    "qwen3_no_thinking": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
                          QWEN3_TEMPLATE, {"enable_thinking": False}),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATE_ONLY))
def template_only(request, tmp_path_factory):
    specials, bos, eos, template, kwargs = TEMPLATE_ONLY[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_small_bpe(folder / "tokenizer.json", specials)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos, "chat_template": template}))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos,
                                                     eos_token=eos)
    reference.chat_template = template
    ours = HuggingFaceModelTokenizer(folder / "tokenizer.json", template_kwargs=kwargs)
    ours.folder = folder  # for the template-file test
    return request.param, ours, reference, kwargs


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_gemma3_and_qwen3_templates_equal_apply_chat_template(template_only, index, generation_prompt):
    name, ours, reference, kwargs = template_only
    conversation = CONVERSATIONS[index][:-1] if generation_prompt else CONVERSATIONS[index]
    messages = [Message(m["role"], m["content"], masked=m["role"] != "assistant") for m in conversation]
    tokens, mask = ours.tokenize_messages(messages, add_generation_prompt=generation_prompt)
    out = reference.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt, **kwargs)
    assert tokens == list(out["input_ids"] if isinstance(out, (dict, transformers.BatchEncoding)) else out)
    trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    for m in conversation:
        if m["role"] == "assistant":
            assert m["content"].strip() in trained, (trained, m["content"])
        else:
            assert m["content"].strip() not in trained


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json"])
def test_template_beside_tokenizer_config_is_read(template_only, tmp_path, where):
    "Newer checkpoints keep the template in its own file; the tokenizer reads it when tokenizer_config.json has none."
    import shutil
    _, ours, _, kwargs = template_only
    shutil.copy(ours.folder / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((ours.folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / where).write_text(template if where.endswith("jinja") else json.dumps({"chat_template": template}))
    beside = HuggingFaceModelTokenizer(tmp_path / "tokenizer.json", template_kwargs=kwargs)
    messages = [Message(m["role"], m["content"]) for m in CONVERSATIONS[0]]
    assert beside.tokenize_messages(messages) == ours.tokenize_messages(messages)
    (tmp_path / where).unlink()
    with pytest.raises(ValueError, match="has no chat_template"):
        HuggingFaceModelTokenizer(tmp_path / "tokenizer.json")


def _byte_bpe_files(folder):
    "A vocab.json + merges.txt pair: a byte-level BPE of 300 tokens trained on the shipped corpus."
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([_asset_path("tiny/corpus.txt")], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.model.save(str(folder))
    return folder / "vocab.json", folder / "merges.txt"


@pytest.mark.parametrize("text", ["The tiny model reads 2025 stories.\n\n  Ünïcode: é, 🙂!", "a\tb  c<|im_end|>d"])
def test_qwen_vocab_and_merges_equal_transformers_qwen2_tokenizer(tmp_path, text):
    from torchtune_lit.models.qwen2 import qwen2_tokenizer

    vocab, merges = _byte_bpe_files(tmp_path)
    ours = qwen2_tokenizer(vocab, merges_file=merges)
    reference = transformers.Qwen2Tokenizer(vocab=str(vocab), merges=str(merges))
    reference.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    ids, ref = ours.encode(text, add_eos=False), reference.encode(text)
    specials = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
    assert [specials.get(i, i) for i in ids] == [  # same ids; the specials at Qwen's fixed ids
        reference.convert_ids_to_tokens(i) if i >= 300 else i for i in ref]
    assert ours.decode(ids) == text


def test_gpt2_base_tokenizer_drops_merges_a_cropped_vocab_lacks(tmp_path):
    from torchtune_lit.tokenizers import GPT2BaseTokenizer

    vocab, merges = _byte_bpe_files(tmp_path)
    table = json.loads(vocab.read_text())
    a, b = merges.read_text().splitlines()[-1].split()
    del table[a + b]
    vocab.write_text(json.dumps(table))
    tok = GPT2BaseTokenizer(vocab, merges, 0, 0, 0, 0)
    word = bytes(_byte_of(c) for c in a + b).decode()
    assert tok.decode(tok.encode(word, add_bos=False, add_eos=False)) == [a, b]


def _byte_of(char):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: byte for byte, c in bytes_to_unicode().items()}[char]


def test_llama3_tiktoken_specials_have_fixed_ids(tmp_path):
    import base64

    (tmp_path / "bytes.tiktoken").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    tok = llama3_tokenizer(tmp_path / "bytes.tiktoken")
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.vocab_size) == (128000, 128001, 128009, 128257)
    assert (tok.pad_id, tok.step_id, tok.eom_id, tok.python_tag, tok.image_id) == (128004, 128005, 128008, 128010, 128256)
