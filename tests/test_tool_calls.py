"""Tool calls: messages with `tool_calls` and tool results, rendered through real chat templates.

The templates are the models' own, as TRL ships them in `trl/chat_templates/` (Qwen 2.5, Qwen 3, Llama 3.1): our
`HuggingFaceModelTokenizer` must render each conversation (with `tools=`) to exactly the text and ids of transformers'
`apply_chat_template`, and train only the assistant's own text, tool calls included. Small byte-level BPE tokenizers
with each family's special tokens are trained here; Llama 3.1's template runs on the tiny world's tokenizer.json.
"""
import json
from pathlib import Path

import pytest
import transformers
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtune_lit.config import _asset_path
from torchtune_lit.data import OpenAIToMessages
from torchtune_lit.tokenizers._hf_template import HuggingFaceModelTokenizer

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
TINY_BASE = Path(_asset_path("tiny/base"))

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "weather", "description": "Today's weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


ONE_CALL = [
    {"role": "system", "content": "You answer with the tools."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3})]},
    {"role": "tool", "content": '{"sum": 5}'},
    {"role": "assistant", "content": "2 + 3 = 5."},
]
TWO_EXCHANGES = [  # no system message; a second question after the first answer, and arguments as JSON text
    {"role": "user", "content": "Weather in Lagos?"},
    {"role": "assistant", "content": "", "tool_calls": [call("weather", {"city": "Lagos"})]},
    {"role": "tool", "content": '{"celsius": 31}'},
    {"role": "assistant", "content": "31 degrees in Lagos."},
    {"role": "user", "content": "And 40 + 2?"},
    {"role": "assistant", "content": "", "tool_calls": [call("add", '{"a": 40, "b": 2}')]},
    {"role": "tool", "content": '{"sum": 42}'},
    {"role": "assistant", "content": "42."},
]
PARALLEL = [  # two calls in one message, two tool results in a row (Qwen only: Llama 3.1 takes one call at a time)
    {"role": "user", "content": "1 + 2 and 3 + 4?"},
    {"role": "assistant", "content": "Two sums.",
     "tool_calls": [call("add", {"a": 1, "b": 2}), call("add", {"a": 3, "b": 4})]},
    {"role": "tool", "content": '{"sum": 3}'},
    {"role": "tool", "content": '{"sum": 7}'},
    {"role": "assistant", "content": "3 and 7."},
]
CONVERSATIONS = {"one_call": ONE_CALL, "two_exchanges": TWO_EXCHANGES, "parallel": PARALLEL}

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>"]
# name: (template file, special tokens or None for the tiny world's tokenizer, extra template variables)
TEMPLATES = {
    "qwen2_5": ("qwen2_5.jinja", QWEN_SPECIALS, {}),
    "qwen3_thinking": ("qwen3.jinja", QWEN_SPECIALS, {}),
    "qwen3_no_thinking": ("qwen3.jinja", QWEN_SPECIALS, {"enable_thinking": False}),
    "llama3_1": ("llama3_1.jinja", None, {}),
}


def save_small_bpe(path: Path, specials: list[str]) -> None:
    "A byte-level BPE of 600 tokens trained on the shipped corpus, with `specials` as its special tokens."
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train([_asset_path("tiny/corpus.txt")], trainer)
    bpe.save(str(path))


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template(request, tmp_path_factory):
    "(name, template text, our tokenizer (no default tools), transformers' tokenizer, template variables)"
    filename, specials, kwargs = TEMPLATES[request.param]
    text = (TRL_TEMPLATES / filename).read_text()
    if specials is None:
        folder = TINY_BASE
    else:
        folder = tmp_path_factory.mktemp(request.param)
        save_small_bpe(folder / "tokenizer.json", specials)
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    reference = transformers.AutoTokenizer.from_pretrained(folder) if specials is None else \
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    ours = HuggingFaceModelTokenizer(folder / "tokenizer.json", chat_template=text, template_kwargs=kwargs)
    return request.param, text, ours, reference, kwargs


def as_messages(conversation):
    return OpenAIToMessages()({"messages": conversation})["messages"]


def reference_ids(reference, conversation, text, tools, prompt, kwargs):
    out = reference.apply_chat_template(conversation, tools=tools, chat_template=text, tokenize=True,
                                        add_generation_prompt=prompt, **kwargs)
    return list(out["input_ids"] if isinstance(out, (dict, transformers.BatchEncoding)) else out)


def cases(name):
    for key, conversation in CONVERSATIONS.items():
        if key == "parallel" and name == "llama3_1":
            continue
        yield key, conversation, False
        yield key, conversation[:-1], True  # the prompt that asks for the last answer (after a tool result)


@pytest.mark.parametrize("with_tools", [True, False])
def test_text_and_ids_equal_apply_chat_template(template, with_tools):
    name, text, ours, reference, kwargs = template
    tools = TOOLS if with_tools else None
    for key, conversation, prompt in cases(name):
        expected = reference.apply_chat_template(conversation, tools=tools, chat_template=text, tokenize=False,
                                                 add_generation_prompt=prompt, **kwargs)
        messages = as_messages(conversation)
        turns = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in conversation]
        assert ours.render(turns, prompt, tools=tools) == expected, (key, prompt)
        tokens, mask = ours.tokenize_messages(messages, add_generation_prompt=prompt, tools=tools)
        assert tokens == reference_ids(reference, conversation, text, tools, prompt, kwargs), (key, prompt)
        assert len(mask) == len(tokens)


def test_only_the_assistant_is_trained(template):
    """The trained text holds every call's name and arguments and every answer, and nothing of the tool results, the
    user's questions, the system message or the tool schemas."""
    name, text, ours, _, _ = template
    for key, conversation, prompt in cases(name):
        tokens, mask = ours.tokenize_messages(as_messages(conversation), add_generation_prompt=prompt, tools=TOOLS)
        trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
        for m in conversation:
            if m["role"] == "assistant":
                assert m["content"] in trained
                for c in m.get("tool_calls", []):
                    arguments = c["function"]["arguments"]
                    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                    assert f'"{c["function"]["name"]}"' in trained, (key, trained)
                    assert all(str(v) in trained for v in arguments.values()), (key, trained)
            elif m["content"]:
                assert m["content"] not in trained, (key, m, trained)
        assert "Add two integers" not in trained and "tool_response" not in trained


def test_tool_results_in_qwen_template_are_masked_by_hand(template):
    """Qwen 2.5, one call: the trained text is exactly the call block and the answer, each with its <|im_end|> and
    newline (the text between the generation prompt and the end of the turn); the tool result is a user turn."""
    name, _, ours, _, _ = template
    if name != "qwen2_5":
        pytest.skip("the hand-written expectation is Qwen 2.5's")
    tokens, mask = ours.tokenize_messages(as_messages(ONE_CALL), tools=TOOLS)
    trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
                       "2 + 3 = 5.<|im_end|>\n")


def test_trained_tokens_counted_by_hand_llama3_1():
    """Llama 3.1's template on the tiny tokenizer, one call: the trained tokens are the call's JSON (as the template
    writes it: "parameters", not "arguments") and its <|eot_id|>, then the answer and its <|eot_id|> — counted by
    encoding those texts alone."""
    text = (TRL_TEMPLATES / "llama3_1.jinja").read_text()
    ours = HuggingFaceModelTokenizer(TINY_BASE / "tokenizer.json", chat_template=text, tools=TOOLS)
    tokens, mask = ours.tokenize_messages(as_messages(ONE_CALL))
    call_text = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    encode = lambda s: ours.encode(s, add_bos=False, add_eos=False)  # noqa: E731
    expected = encode(call_text) + [ours.eot_id] + encode("2 + 3 = 5.") + [ours.eot_id]
    assert [t for t, m in zip(tokens, mask) if not m] == expected
    assert sum(not m for m in mask) == len(encode(call_text)) + len(encode("2 + 3 = 5.")) + 2


def test_sample_tools_column_and_ipython_role():
    """A sample's own `tools` are rendered (over the tokenizer's default); torchtune's role name `ipython` renders as
    `tool` does."""
    text = (TRL_TEMPLATES / "llama3_1.jinja").read_text()
    ours = HuggingFaceModelTokenizer(TINY_BASE / "tokenizer.json", chat_template=text)
    as_ipython = [dict(m, role="ipython") if m["role"] == "tool" else m for m in ONE_CALL]
    row = ours({"messages": as_messages(as_ipython), "tools": TOOLS[:1]})
    assert row["tokens"] == ours.tokenize_messages(as_messages(ONE_CALL), tools=TOOLS[:1])[0]
    assert "Add two integers" in ours.decode(row["tokens"])
    assert "weather" not in ours.decode(row["tokens"])


def read_jsonl(name):
    return [json.loads(line) for line in open(_asset_path(f"tiny/{name}"), encoding="utf-8")]


def test_tiny_tool_task_rows():
    """The shipped tool task: 480 training and 48 held-out conversations with no expression in both; each row's call
    is the calculator on the question's numbers, and the tool's result is what the calculator returns."""
    from torchtune_lit.datasets._tiny_world import calculator, make_tool_examples
    train, held_out = read_jsonl("tool_calls_train.jsonl"), read_jsonl("tool_calls_eval.jsonl")
    assert (len(train), len(held_out)) == (480, 48)
    assert not {r["expression"] for r in train} & {r["expression"] for r in held_out}
    assert make_tool_examples(480, 48, seed=0) == {"train": train, "eval": held_out}  # rebuilt from the seed
    for row in train + held_out:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        arguments = row["messages"][2]["tool_calls"][0]["function"]["arguments"]
        a, op, b = row["expression"].split()
        assert arguments == {"a": int(a), "op": op, "b": int(b)} and row["expression"] in row["messages"][1]["content"]
        assert row["messages"][3]["content"] == row["answer"] == calculator(**arguments) == str(eval(row["expression"]))


def test_chat_dataset_of_the_tool_task_trains_calls_not_results():
    """The config's dataset (chat_dataset, OpenAI style, through `datasets`' JSON loader) gives the tokens of the
    messages read directly, and its labels train the call and the answer only."""
    from torchtune_lit.datasets import chat_dataset
    from torchtune_lit.tokenizers._chat import tiny_tokenizer
    tok = tiny_tokenizer(max_seq_len=256)
    ds = chat_dataset(tok, source="json", data_files=_asset_path("tiny/tool_calls_eval.jsonl"),
                      conversation_column="messages", conversation_style="openai", split="train")
    rows = read_jsonl("tool_calls_eval.jsonl")
    assert len(ds) == len(rows)
    for i in (0, 7, 47):
        tokens, mask = tok.tokenize_messages(OpenAIToMessages()(rows[i])["messages"])
        sample = ds[i]
        assert list(sample["tokens"]) == tokens
        trained = tok.decode([t for t in sample["labels"] if t != -100])
        assert rows[i]["messages"][3]["content"] + "<|start_header_id|>" not in trained  # the result is not trained
        arguments = json.dumps(rows[i]["messages"][2]["tool_calls"][0]["function"]["arguments"])
        assert f'{{"name": "calculator", "parameters": {arguments}}}<|eot_id|>' in trained
        assert trained.endswith(rows[i]["answer"] + "<|eot_id|>")


WITH_IDS = [  # OpenAI's full shape: the call has an id, the tool result names it and its tool
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [dict(call("add", {"a": 2, "b": 3}), id="call_0")]},
    {"role": "tool", "content": '{"sum": 5}', "tool_call_id": "call_0", "name": "add"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]
MUSE_SPECIALS = ["<|start|>", "<|message|>", "<|eot|>", "<|eom|>", "<|patch|>", "<|video|>"]


@pytest.mark.parametrize("keys", [("tool_call_id", "name"), ("tool_call_id",), ("name",)])
def test_tool_call_id_and_name_reach_the_template(tmp_path, keys):
    """A template that reads a tool result's `name`, else finds the tool by `tool_call_id` among the calls
    (muse_glimmer.jinja, as TRL ships it): our rendering and ids equal transformers' with both keys, with either one,
    and the tool's name is in the text each time (without the keys the template would write no name)."""
    text = (TRL_TEMPLATES / "muse_glimmer.jinja").read_text()
    save_small_bpe(tmp_path / "tokenizer.json", MUSE_SPECIALS)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                     eos_token="<|eot|>")
    ours = HuggingFaceModelTokenizer(tmp_path / "tokenizer.json", chat_template=text)
    conversation = [{k: v for k, v in m.items() if k in keys or k not in ("tool_call_id", "name")} for m in WITH_IDS]
    messages = as_messages(conversation)
    assert (messages[2].tool_call_id, messages[2].name) == tuple(conversation[2].get(k) for k in ("tool_call_id",
                                                                                                 "name"))
    for prompt, turns in ((False, conversation), (True, conversation[:-1])):
        expected = reference.apply_chat_template(turns, tools=TOOLS, chat_template=text, tokenize=False,
                                                 add_generation_prompt=prompt)
        assert '<tool_output name="add">' in expected
        tokens, mask = ours.tokenize_messages(as_messages(turns), add_generation_prompt=prompt, tools=TOOLS)
        assert ours.decode(tokens, skip_special_tokens=False) == expected
        assert tokens == reference_ids(reference, turns, text, TOOLS, prompt, {})
        trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
        assert '{"sum": 5}' not in trained and "tool_output" not in trained


def test_ids_pass_through_every_checked_template(template):
    """The conversation with ids renders as transformers renders it under Qwen 2.5, Qwen 3 and Llama 3.1 too."""
    name, text, ours, reference, kwargs = template
    for prompt, turns in ((False, WITH_IDS), (True, WITH_IDS[:-1])):
        expected = reference.apply_chat_template(turns, tools=TOOLS, chat_template=text, tokenize=False,
                                                 add_generation_prompt=prompt, **kwargs)
        tokens, _ = ours.tokenize_messages(as_messages(turns), add_generation_prompt=prompt, tools=TOOLS)
        assert tokens == reference_ids(reference, turns, text, TOOLS, prompt, kwargs), (name, prompt)
        assert ours.render(turns, prompt, tools=TOOLS) == expected


def test_llama3_format_ends_a_tool_result_as_llama3_1_does():
    """The tiny model's Llama3Format against Llama 3.1's own template on the same tokenizer: from the call on, the
    text is the template's — the call, `<|eot_id|>`, the result under `ipython` ended by `<|eot_id|>` (the template
    writes a text result as JSON, so its quotes are taken off), the answer. The tool message has eot=False, as
    OpenAIToMessages sets it (torchtune's advice), and its turn still ends."""
    from torchtune_lit.tokenizers._chat import tiny_tokenizer
    row = read_jsonl("tool_calls_eval.jsonl")[0]
    text = (TRL_TEMPLATES / "llama3_1.jinja").read_text()
    reference = transformers.AutoTokenizer.from_pretrained(TINY_BASE)
    rendered = reference.apply_chat_template(row["messages"], chat_template=text, tokenize=False)
    result = row["messages"][3]["content"]
    rendered = rendered.replace(f'ipython<|end_header_id|>\n\n"{result}"', f"ipython<|end_header_id|>\n\n{result}")
    tiny = tiny_tokenizer()
    messages = as_messages(row["messages"])
    assert messages[3].role == "tool" and messages[3].eot is False
    ours = tiny.decode(tiny.tokenize_messages(messages)[0])
    tail = ours[ours.index('{"name"'):]
    assert rendered.endswith(tail) and f"ipython<|end_header_id|>\n\n{result}<|eot_id|>" in tail
