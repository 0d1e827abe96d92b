"""torchtune's public data / tokenizer API: the arguments and return types a torchtune user's code relies on.

References: PyTorch's own `pad_sequence` (left padding), sentencepiece and transformers' GPT-2 tokenizer on tiny
tokenizer files trained here (no downloads); other values are derived by hand in the test."""
import json

import pytest
import torch

from torchtune_lit.data import (
    AlpacaToMessages,
    ChosenRejectedToMessages,
    InputOutputToMessages,
    MaskingStrategy,
    Message,
    OpenAIToMessages,
    PromptTemplate,
    ShareGPTToMessages,
    SummarizeTemplate,
    left_pad_sequence,
    mask_messages,
    padded_collate,
    padded_collate_dpo,
    padded_collate_packed,
    padded_collate_sft,
    truncate,
)
from torchtune_lit.datasets import PackedDataset
from torchtune_lit.modules.transforms import Transform
from torchtune_lit.modules.transforms import tokenizers as tt_tokenizers
from torchtune_lit.tokenizers import (
    GPT2BaseTokenizer,
    TikTokenBaseTokenizer,
    llama2_tokenizer,
    tiny_tokenizer,
    tokenize_messages_no_special_tokens,
)

def test_message_content_forms():
    text = Message.from_dict({"role": "assistant", "content": "hi", "ipython": True})
    assert text.ipython and text.text_content == "hi" and text.get_media() == []
    assert text.parts == [{"type": "text", "content": "hi"}]
    image = object()
    mixed = Message("user", [{"type": "text", "content": "a"}, {"type": "image", "content": image},
                             {"type": "text", "content": "b"}])
    assert mixed.text_content == "ab" and mixed.get_media() == [image] and mixed.contains_media
    assert repr(Message("user", "x")) == "Message(role='user', content=['x'])"
    with pytest.raises(ValueError, match="Only assistant messages can be tool calls"):
        Message("user", "x", ipython=True)


@pytest.mark.parametrize("transform, row, key", [
    (InputOutputToMessages, {"input": "q", "output": "a"}, "messages"),
    (OpenAIToMessages, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "messages"),
    (ShareGPTToMessages, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "messages"),
    (ChosenRejectedToMessages, {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                "rejected": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "b"}]}, "chosen"),
])
def test_masking_strategy_and_train_on_input(transform, row, key):
    masks = lambda **kw: [m.masked for m in transform(**kw)(row)[key]]  # noqa: E731
    assert masks() == [True, False]
    assert masks(masking_strategy="train_on_all") == [False, False]
    assert masks(masking_strategy=MaskingStrategy.TRAIN_ON_LAST) == [True, False]
    assert masks(train_on_input=True, masking_strategy="train_on_assistant") == [False, False]  # the old flag wins
    with pytest.raises(ValueError, match="not a valid MaskingStrategy"):
        transform(masking_strategy="train_on_nothing")


def test_column_map_typo_is_refused_at_construction():
    with pytest.raises(ValueError, match="Expected a key of 'input'"):
        InputOutputToMessages(column_map={"inptu": "q", "output": "a"})
    InputOutputToMessages(column_map={"output": "a"})  # a partial map of known keys still works


def test_alpaca_and_tool_messages():
    user, answer = AlpacaToMessages()({"instruction": "Name it.", "input": "", "output": "x"})["messages"]
    assert "### Input" not in user.text_content and user.text_content.endswith("### Response:\n") and not user.masked
    msgs = OpenAIToMessages()({"messages": [
        {"role": "user", "content": "w?"}, {"role": "assistant", "content": "call()"},
        {"role": "tool", "content": "31"}, {"role": "assistant", "content": "31."}]})["messages"]
    assert [(m.masked, m.eot) for m in msgs] == [(True, True), (False, True), (True, False), (False, True)]


def test_mask_messages_train_on_last():
    msgs = [Message("user", "a"), Message("assistant", "b"), Message("user", "c"), Message("assistant", "d")]
    mask_messages(msgs, "train_on_last")
    assert [m.masked for m in msgs] == [True, True, True, False]


def test_prompt_template_and_truncate():
    out = SummarizeTemplate()([Message("user", "A: hi", masked=True), Message("assistant", "x")])
    assert out[0].text_content == "Summarize this dialogue:\nA: hi\n---\nSummary:\n" and out[0].masked
    custom = PromptTemplate({"assistant": ("<", ">")})([Message("user", "u"), Message("assistant", "a")])
    assert [m.text_content for m in custom] == ["u", "<a>"]
    masks = [True, True, False, True, False]
    assert truncate(masks, 4, eos_id=False) == [True, True, False, False]
    assert truncate(masks, 4, eos_id=False, truncation_type="left") == [True, False, True, False]


def test_collate_functions_take_torchtunes_arguments():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    for batch_first in (True, False):
        reference = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=batch_first, padding_side="left",
                                                    padding_value=-1)
        assert torch.equal(left_pad_sequence(seqs, padding_value=-1, batch_first=batch_first), reference)
    sft = padded_collate_sft([{"tokens": [1, 2, 3], "labels": [1, 2, 3]}], pad_to_multiple_of=4)
    assert sft["tokens"].tolist() == [[1, 2, 3, 0]] and sft["labels"].tolist() == [[1, 2, 3, -100]]
    ids, labels = padded_collate_dpo([{"chosen_input_ids": [1], "chosen_labels": [1], "rejected_input_ids": [2, 3],
                                       "rejected_labels": [2, 3]}], pad_to_multiple_of=3)
    assert ids.tolist() == [[1, 0, 0], [2, 3, 0]] and labels.tolist() == [[1, -100, -100], [2, 3, -100]]
    out = padded_collate([{"tokens": [1], "label": 5}, {"tokens": [2, 3], "label": 6}], pad_direction="left",
                         keys_to_pad=["tokens"], padding_idx={"tokens": 9})
    assert out["tokens"].tolist() == [[9, 1], [2, 3]] and out["label"].tolist() == [5, 6]
    with pytest.raises(ValueError, match="pad_direction"):
        padded_collate([{"tokens": [1]}], pad_direction="up", keys_to_pad=["tokens"], padding_idx=0)


def test_packed_dataset_items_are_tensors():
    samples = [{"tokens": [1, 2, 3], "labels": [1, 2, 3]}, {"tokens": [4, 5], "labels": [4, 5]}]
    packed = PackedDataset(samples, max_seq_len=4)
    first = packed[0]
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.long for v in first.values())
    assert first["seq_lens"].tolist() == [3, 1] and first["input_pos"].tolist() == [0, 1, 2, 3]
    assert packed[1]["input_pos"].tolist() == [0, 1, 2, 3]  # padding carries on from the sample
    batch = padded_collate_packed([packed[0], packed[1]])
    assert batch["mask"].shape == (2, 4, 4) and batch["tokens"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    with pytest.raises(ValueError, match="Dataset sample is too long"):
        PackedDataset(samples, max_seq_len=2)
    split = PackedDataset([{"tokens": list(range(7)), "labels": list(range(7))}], max_seq_len=3,
                          split_across_pack=True, max_packs=2)
    assert len(split) == 2 and split[1]["input_pos"].tolist() == [0, 1, 2]  # 3, 4, 5 modulo 3


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    from torchtune_lit.config import _asset_path
    folder = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(input=_asset_path("tiny/corpus.txt"), model_prefix=str(folder / "m"),
                                   vocab_size=600, model_type="bpe", minloglevel=2, byte_fallback=True)
    return folder / "m.model"


def test_llama2_tokenizer_against_sentencepiece(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    chat = [Message("system", "Be brief.", masked=True), Message("user", "dob: 1987", masked=True),
            Message("assistant", "date of birth")]
    tokens, mask = llama2_tokenizer(sp_model).tokenize_messages(chat)
    prompt = sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\ndob: 1987 [/INST] ")
    answer = sp.encode("\ndate of birth")[len(sp.encode("\n")):]
    assert tokens == [sp.bos_id(), *prompt, *answer, sp.eos_id()]
    assert mask == [True] * (1 + len(prompt)) + [False] * (len(answer) + 1)
    short, _ = llama2_tokenizer(sp_model, max_seq_len=5).tokenize_messages(chat)
    assert len(short) == 5 and short[-1] == sp.eos_id()


def test_tokenize_messages_no_special_tokens_layout():
    base = tiny_tokenizer().base
    msgs = [Message("user", "a b", masked=True), Message("assistant", "c"),
            Message("user", "d", masked=True), Message("assistant", "e")]
    tokens, mask = tokenize_messages_no_special_tokens(base, msgs, bos_id=-1, eos_id=-2)
    assert tokens.count(-1) == 2 and tokens.count(-2) == 2 and tokens[0] == -1 and tokens[-1] == -2
    assert len(tokens) == len(mask) and mask[0] is True and mask[-1] is False


def test_prompt_template_argument_of_llama3_tokenizer():
    tok = tiny_tokenizer()
    plain, _ = tok.tokenize_messages([Message("user", "Q: 2+2?\nA:"), Message("assistant", "4")])
    from torchtune_lit.tokenizers import ModelTokenizer, llama3_tokenizer
    templated = ModelTokenizer(tok.base, tok.chat_format, prompt_template={"user": ["Q: ", "\nA:"]})
    assert templated.tokenize_messages([Message("user", "2+2?"), Message("assistant", "4")])[0] == plain
    assert "prompt_template" in llama3_tokenizer.__code__.co_varnames


def test_gpt2_base_tokenizer_against_transformers(tmp_path):
    import tokenizers
    import transformers

    from torchtune_lit.config import _asset_path
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train([_asset_path("tiny/corpus.txt")], vocab_size=350, min_frequency=2, show_progress=False)
    bpe.save_model(str(tmp_path))
    ours = GPT2BaseTokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt", 0, 1, 2, 3)
    ref = transformers.GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    text = "Column dob: 1987-03-04, zip 75011 — ok?"
    assert ours.encode(text) == [1, *ref.encode(text), 2]
    assert ours.decode(ref.encode(text)) == ref.convert_ids_to_tokens(ref.encode(text))


def test_tiktoken_long_runs_and_vocab_sizes(tmp_path):
    import base64

    import tiktoken
    ranks = {bytes([b]): b for b in range(256)}
    (tmp_path / "t.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    pattern = r"\S+|\s+"
    ours = TikTokenBaseTokenizer(tmp_path / "t.model", "t", pattern, 256, 257, {"<s>": 256, "</s>": 257})
    assert (ours.base_vocab_size, ours.vocab_size) == (256, 258)
    ref = tiktoken.Encoding("r", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<s>": 256, "</s>": 257})
    text = "a  b" + " " * 30_000 + "c"  # one run longer than the 25,000 limit
    assert ours.encode(text, add_bos=False, add_eos=False) == ref.encode(text)  # bytes: the cut changes nothing
    assert [len(p) for p in ours._split_long_repetitions("ab" * 4, 3)] == [3, 3, 2]


def test_torchtune_import_paths(tmp_path):
    from torchtune_lit.data import InputOutputToMessages as IO
    assert isinstance(IO(), Transform) and isinstance(tiny_tokenizer(), Transform)
    assert tt_tokenizers.GPT2BaseTokenizer is GPT2BaseTokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|end|>"}]}))
    assert tt_tokenizers.parse_hf_tokenizer_json(tmp_path / "tokenizer.json") == {"<|end|>": 7}


def test_phi3_mini_tokenizer_against_sentencepiece(sp_model, tmp_path):
    import sentencepiece as spm

    from torchtune_lit.tokenizers import phi3_mini_tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    chat = [Message("system", "Be brief.", masked=True), Message("user", "dob", masked=True),
            Message("assistant", "date")]
    tokens, mask = phi3_mini_tokenizer(sp_model).tokenize_messages(chat)
    nl = sp.encode("\n")
    expected = [sp.bos_id(), 32006, *sp.encode("\nBe brief."), 32007, *nl, 32010, *sp.encode("\ndob"), 32007, *nl,
                32001, *sp.encode("\ndate"), 32007, *nl, 32000]
    assert tokens == expected and mask[-1] is False and mask[0] is True
    # special tokens from a tokenizer.json: its ids, not the defaults
    added = [{"id": 900 + i, "content": t} for i, t in enumerate(
        ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"])]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    custom = phi3_mini_tokenizer(sp_model, special_tokens_path=tmp_path / "tokenizer.json")
    assert custom.tokenize_messages(chat[1:])[0][1] == 904 and custom.vocab_size == 905
