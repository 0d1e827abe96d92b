"""Messages with images through a multimodal checkpoint's own chat template.

`HuggingFaceModelTokenizer` passes a conversation with images to the template as transformers' processors take it
(every content a list of `{'type': 'image'}` / `{'type': 'text', 'text': ...}` parts), so each image part becomes
the template's image placeholder. Checked against transformers' `apply_chat_template` on the same template string
and conversation: the same text, character for character, and the same ids. The templates are the models' own as
TRL ships them in `trl/chat_templates/` (Qwen 2.5 VL, Qwen 3 VL, Gemma 3, LLaVA-NeXT, Idefics 3, SmolVLM) and one
written here in the shape of Llama 3.2 Vision's. Each runs on the tiny world's tokenizer.json with the template's
special tokens added; nothing is downloaded.
"""
import json
from pathlib import Path

import pytest
import transformers
import trl
from tokenizers import Tokenizer

from torchtune_lit.config import _asset_path
from torchtune_lit.data import Message
from torchtune_lit.tokenizers._hf_template import HuggingFaceModelTokenizer, _as_turns

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
TINY_BASE = Path(_asset_path("tiny/base"))

LLAMA_VISION_LIKE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# name -> (template text, special tokens it writes, its image placeholder, end text trained after an answer)
TEMPLATES = {
    "llama3_2_vision_like": (LLAMA_VISION_LIKE, ["<|image|>"], "<|image|>", "<|eot_id|>"),
    "qwen2_5_vl": ("qwen2_5_vl.jinja", ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                                        "<|vision_end|>", "<|video_pad|>"],
                   "<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>"),
    "qwen3_vl": ("qwen3_vl.jinja", ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                                    "<|vision_end|>", "<|video_pad|>"],
                 "<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>"),
    "gemma3": ("gemma3.jinja", ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"], "<start_of_image>",
               "<end_of_turn>"),
    "llava_next": ("llava_next.jinja", ["<image>", "</s>"], "<image>", "</s>"),
    "idefics3": ("idefics3.jinja", ["<image>", "<end_of_utterance>"], "<image>", "<end_of_utterance>"),
    "smolvlm": ("smolvlm.jinja", ["<|im_start|>", "<image>", "<end_of_utterance>"], "<image>",
                "<end_of_utterance>"),
}


def _template_text(name):
    text = TEMPLATES[name][0]
    return (TRL_TEMPLATES / text).read_text() if text.endswith(".jinja") else text


def _folder(tmp_path, name):
    "The tiny tokenizer with the template's special tokens, and the template in a processor's chat_template.json."
    folder = tmp_path / name
    folder.mkdir()
    tok = Tokenizer.from_file(str(TINY_BASE / "tokenizer.json"))
    tok.add_special_tokens(TEMPLATES[name][1])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((TINY_BASE / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": _template_text(name)}))
    return folder


IMAGE = {"type": "image", "content": None}  # a placeholder part: the template only reads the type


def _text(s):
    return {"type": "text", "content": s}


def _conversations():
    "(messages, add_generation_prompt) cases each template accepts."
    one = [
        Message("system", "Answer in one word.", masked=True),
        Message("user", [IMAGE, _text("What is this?")], masked=True),
        Message("assistant", "Cats."),
    ]
    two = one + [
        Message("user", [_text("And here? "), IMAGE, _text(" Or here?"), IMAGE], masked=True),
        Message("assistant", "Dogs."),
    ]
    prompt = two[:-1]
    return [(one, False), (two, False), (prompt, True)]


def _as_hf(messages):
    "The same conversation as a transformers user writes it for a processor: every content a list of parts."
    out = []
    for m in messages:
        parts = [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["content"]}
                 for p in m.content]
        out.append({"role": m.role, "content": parts})
    return out


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_images_render_as_transformers_renders_them(tmp_path, name):
    folder = _folder(tmp_path, name)
    ours = HuggingFaceModelTokenizer(folder / "tokenizer.json", max_seq_len=1024)
    assert Path(ours.template_source).name == "chat_template.json"
    assert ours.eot_id == ours.special_tokens[TEMPLATES[name][3]]  # found by the probe, strings or parts
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    template, placeholder = _template_text(name), TEMPLATES[name][2]
    for messages, prompt in _conversations():
        hf = _as_hf(messages)
        expected = theirs.apply_chat_template(hf, chat_template=template, tokenize=False,
                                              add_generation_prompt=prompt)
        assert ours.render(_as_turns(messages), prompt) == expected
        images = sum(p["type"] == "image" for m in messages for p in m.content)
        assert expected.count(placeholder) == images
        tokens, mask = ours.tokenize_messages(messages, add_generation_prompt=prompt)
        reference = theirs.apply_chat_template(hf, chat_template=template, tokenize=True,
                                               add_generation_prompt=prompt)
        assert tokens == _ids(reference)
        placeholder_ids = [ours.special_tokens[t] for t in TEMPLATES[name][1] if t in placeholder]
        assert sum(t in placeholder_ids for t in tokens) == images * len(placeholder_ids)
        trained = ours.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
        answers = [m.text_content for m in messages if m.role == "assistant"]
        end = TEMPLATES[name][3]
        assert trained.replace(end, " ").split() == answers, trained  # the answers, nothing of the prompts
        assert all(m for t, m in zip(tokens, mask) if t in placeholder_ids)  # images are never trained


def test_text_only_conversation_stays_strings(tmp_path):
    "Without images the contents are strings, as text-only templates read them; the VL template accepts both."
    folder = _folder(tmp_path, "qwen2_5_vl")
    ours = HuggingFaceModelTokenizer(folder / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [Message("user", "hi", masked=True), Message("assistant", "hello")]
    assert _as_turns(messages) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    hf = [{"role": m.role, "content": m.text_content} for m in messages]
    tokens, _ = ours.tokenize_messages(messages)
    assert tokens == _ids(theirs.apply_chat_template(hf, chat_template=_template_text("qwen2_5_vl"), tokenize=True))


def test_every_content_is_parts_once_one_message_has_an_image():
    messages = [
        Message("system", "s"),
        Message("user", [_text("look "), IMAGE, _text(" here")]),
        Message("assistant", "ok"),
    ]
    assert _as_turns(messages) == [
        {"role": "system", "content": [{"type": "text", "text": "s"}]},
        {"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image"},
                                     {"type": "text", "text": " here"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
