"""GRPO with a tool in the loop and DAPO's dynamic sampling: the episode's tokens are exactly what the tokenizer
writes for the whole conversation (when the policy writes what SFT taught), only the policy's own tokens are in the
loss mask, a bad call is answered with an error, and the single-device recipe runs with `tools`, `scale_rewards`
and `dynamic_sampling` from its config. Scripted generations stand in for a trained model, so each case is exact."""
import json
from copy import deepcopy

import pytest
import torch

import torchtune_lit.generation as generation
import torchtune_lit.recipes.grpo_full_finetune_single_device as grpo_recipe
import torchtune_lit.rlhf as rlhf
from torchtune_lit import config
from torchtune_lit.config import _asset_path
from torchtune_lit.data import Message, OpenAIToMessages
from torchtune_lit.models import build_from_hf_config
from torchtune_lit.rlhf import grpo_parts
from torchtune_lit.rlhf.loss import GRPOLoss
from torchtune_lit.rlhf.rewards import (
    AnswerMatchReward,
    CopiedResultReward,
    ToolResultReward,
    conversation_prompt_dataset,
    padded_collate_prompts,
)
from torchtune_lit.tokenizers import parse_llama3_tool_call
from torchtune_lit.tokenizers._chat import tiny_tokenizer
from torchtune_lit.training import FullModelHFCheckpointer, load_model_state_dict

TOOL_GRPO = config._asset_path("tiny/base").replace("assets/tiny/base", "recipes/configs/tiny/tool_grpo.yaml")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(max_seq_len=256)


@pytest.fixture(scope="module")
def model():
    folder = _asset_path("tiny/base")
    m = build_from_hf_config(folder)
    load_model_state_dict(m, FullModelHFCheckpointer(folder).load_checkpoint()["model"])
    return m.eval()


def rows():
    return [json.loads(line) for line in open(_asset_path("tiny/tool_calls_eval.jsonl"))]


def scripted(monkeypatch, tok, turns):
    """Replace generation by a script: call k returns turns[k] (one text per prompt), encoded with <|eot_id|>."""
    calls = []

    def fake_generate(model, prompts, max_new_tokens, **kwargs):
        texts = turns[len(calls)]
        calls.append([list(p) for p in prompts])
        return [tok.encode(t, add_bos=False, add_eos=False) + [tok.eot_id] for t in texts[: len(prompts)]]

    monkeypatch.setattr(generation, "generate", fake_generate)
    return calls


def call_text(row):
    arguments = row["messages"][2]["tool_calls"][0]["function"]["arguments"]
    return f'{{"name": "calculator", "parameters": {json.dumps(arguments)}}}'


def test_episode_is_the_conversation_the_tokenizer_writes(monkeypatch, tok, model):
    """The SFT conversation, played: the call, the calculator's result, the answer. The episode's tokens equal the
    tokenizer's tokens of the whole conversation; the policy wrote exactly the call, the answer and their ends."""
    row = rows()[0]
    prompt = OpenAIToMessages()(row)["messages"][:2]
    scripted(monkeypatch, tok, [[call_text(row)], [row["answer"]]])
    tools = grpo_parts.resolve_tools("calculator")
    (episode,) = grpo_parts.tool_episodes(model, tok, [prompt], tools, parse_llama3_tool_call, 64, max_tool_turns=2)
    whole, _ = tok.tokenize_messages(OpenAIToMessages()(row)["messages"], add_end_tokens=False)
    assert episode["tokens"] == whole
    written = [t for t, p in zip(episode["tokens"], episode["policy"]) if p]
    assert tok.decode(written) == f"{call_text(row)}<|eot_id|>{row['answer']}<|eot_id|>"
    assert (episode["answer"], episode["calls"], episode["errors"]) == (row["answer"], 1, 0)


def test_turn_limit_and_errors(monkeypatch, tok, model):
    """max_tool_turns=1: a second call is the final answer (and scores nothing); a call with arguments the calculator
    refuses comes back as an error result, which the policy reads."""
    row = rows()[0]
    prompt = OpenAIToMessages()(row)["messages"][:2]
    bad = '{"name": "calculator", "parameters": {"a": 1, "b": 2, "op": "*"}}'
    calls = scripted(monkeypatch, tok, [[bad], [call_text(row)]])
    tools = grpo_parts.resolve_tools(["calculator"])
    (episode,) = grpo_parts.tool_episodes(model, tok, [prompt], tools, parse_llama3_tool_call, 64, max_tool_turns=1)
    assert len(calls) == 2 and episode["calls"] == 1 and episode["errors"] == 1
    assert episode["answer"] == call_text(row)  # the call past the limit is the answer
    assert "error: calculator got" in tok.decode(calls[1][0])
    assert grpo_parts.run_tool_call({"function": {"name": "search", "arguments": {}}}, tools).startswith(
        "error: no tool 'search'")
    with pytest.raises(ValueError, match="neither a known tool"):
        grpo_parts.resolve_tools("calculatr")


def test_tool_rollout_masks_the_tool_and_scores_the_answer(monkeypatch, tok, model):
    """Two prompts, groups of two: per group one right and one wrong answer. The loss mask is True exactly where the
    next token is the policy's; the advantages are +-1/std as group_advantages gives; the tool's tokens get no
    gradient from GRPOLoss."""
    data = conversation_prompt_dataset(tok, source="json", data_files=_asset_path("tiny/tool_calls_eval.jsonl"))
    batch = padded_collate_prompts([data[0], data[1]])
    r = rows()
    first = [call_text(r[0]), call_text(r[0]), call_text(r[1]), call_text(r[1])]
    second = [r[0]["answer"], "7", "0", r[1]["answer"]]
    scripted(monkeypatch, tok, [first, second])
    reference = deepcopy(model)
    sample = grpo_parts.tool_rollout(
        model, reference, tok, [AnswerMatchReward()], batch, 2, 64, torch.Generator(),
        grpo_parts.resolve_tools("calculator"), parse_llama3_tool_call, max_tool_turns=2)
    assert sample["reward"].tolist() == [1.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(sample["advantages"], rlhf.group_advantages(sample["reward"], 2))
    assert sample["tool_calls"].tolist() == [1, 1, 1, 1]
    roll = sample["rollout"]
    for i in range(4):
        written = tok.decode(roll.tokens[i, 1:][roll.mask[i]].tolist())
        assert written == f"{first[i]}<|eot_id|>{second[i]}<|eot_id|>"
    logps = rlhf.completion_log_probs(model, roll.tokens).detach().requires_grad_()
    losses, _ = GRPOLoss()(logps, logps.detach(), sample["ref_logps"], sample["advantages"], roll.mask)
    losses.sum().backward()
    assert (logps.grad[~roll.mask] == 0).all() and (logps.grad[roll.mask] != 0).any()


def test_episode_rewards_see_the_calls(monkeypatch, tok, model):
    """Partial credit: one prompt, a group of four — the right call copied, the right call not copied, a wrong call
    (a + 1) copied faithfully, no call and a wrong answer. By hand: 1 + 0.5 + 0.5, 0.5, 0.5, 0. The same rewards
    in the greedy validation see the episodes too; in a rollout without tools they refuse."""
    data = conversation_prompt_dataset(tok, source="json", data_files=_asset_path("tiny/tool_calls_eval.jsonl"))
    batch = padded_collate_prompts([data[0]])
    row = rows()[0]
    arguments = row["messages"][2]["tool_calls"][0]["function"]["arguments"]
    wrong = call_text(row).replace(f'"a": {arguments["a"]}', f'"a": {arguments["a"] + 1}')
    wrong_result = str(int(row["answer"]) + 1)  # (a + 1) op b
    first = [call_text(row), call_text(row), wrong, "12345"]
    second = [row["answer"], "12345", wrong_result]
    scripted(monkeypatch, tok, [first, second])
    episode_rewards = [AnswerMatchReward(), ToolResultReward(), CopiedResultReward()]
    tools = grpo_parts.resolve_tools("calculator")
    sample = grpo_parts.tool_rollout(
        model, deepcopy(model), tok, episode_rewards, batch, 4, 64, torch.Generator(), tools,
        parse_llama3_tool_call, max_tool_turns=2)
    assert sample["reward"].tolist() == [2.0, 0.5, 0.5, 0.0]
    assert sample["scores"]["right_call"].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert sample["scores"]["copied"].tolist() == [0.5, 0.0, 0.5, 0.0]
    scripted(monkeypatch, tok, [[call_text(row)], [row["answer"]]])
    val = grpo_parts.grpo_validation(model, tok, episode_rewards, [batch], 64, tools=tools,
                                     parse_call=parse_llama3_tool_call, max_tool_turns=2)
    assert val == {"val_accuracy": 1.0, "val_reward": 2.0}
    with pytest.raises(ValueError, match="'right_call' reads the episodes"):
        grpo_parts.score_rollout(model, None, sample["rollout"], second + ["0"], [row["answer"]] * 4,
                                 episode_rewards)


def test_dynamic_sampling_parts():
    "informative_groups / fill_groups on hand-made rewards: all-equal groups are dropped, the rest kept in order."
    def sample(values):
        n = len(values)
        tokens = torch.arange(n).view(n, 1).repeat(1, 2)
        reward = torch.tensor(values)
        return {"rollout": rlhf.Rollout(tokens, torch.ones(n, 1, dtype=torch.bool), tokens.tolist(), 2),
                "reward": reward, "scores": {}, "correct": reward > 0, "advantages": reward,
                "ref_logps": torch.zeros(n, 1), "old_logps": None}
    kept = grpo_parts.fill_groups([sample([0.0, 0.0, 1.0, 0.0]), sample([1.0, 0.0, 1.0, 1.0])], wanted=2)
    assert [s["reward"].tolist() for s in kept] == [[1.0, 0.0], [1.0, 0.0]]
    assert [s["rollout"].tokens[:, 0].tolist() for s in kept] == [[2, 3], [0, 1]]


def test_recipe_runs_with_tools_and_dynamic_sampling(tmp_path):
    """The recipe from the tiny base (which never calls the tool: every reward 0, every group uninformative):
    with dynamic sampling each micro-batch draws its batch and 3 extra rounds and, none informative, trains on the
    first, so a quarter of the sampled groups is kept; scale_rewards=none runs; the validation is tool episodes."""
    cfg = config.load_config(TOOL_GRPO, [
        f"output_dir={tmp_path}", f"checkpointer.checkpoint_dir={_asset_path('tiny/base')}", "progress_bar=false",
        "batch_size=2", "group_size=2", "max_new_tokens=6", "epochs=1", "max_steps_per_epoch=2", "run_val_every_n_steps=2",
        "dynamic_sampling=true", "max_resample_rounds=3", "scale_rewards=none"])
    cfg.validation_dataset.split = "train[:4]"
    history = grpo_recipe.train(cfg)
    assert len(history) == 2
    for h in history:
        assert h["kept_groups"] == 0.25 and h["reward"] == 0.0 and h["tool_calls"] == 0.0
    assert history[-1]["val_accuracy"] == 0.0


def test_tool_turn_tokens_under_a_checkpoint_template():
    """Llama 3.1's own template (HuggingFaceModelTokenizer): the tool turn's tokens are the template's text for the
    result and the next generation prompt — transformers' rendering of the longer conversation minus the shorter."""
    from pathlib import Path

    import transformers
    import trl

    from torchtune_lit.tokenizers import HuggingFaceModelTokenizer
    text = (Path(trl.__file__).parent / "chat_templates/llama3_1.jinja").read_text()
    folder = Path(_asset_path("tiny/base"))
    ours = HuggingFaceModelTokenizer(folder / "tokenizer.json", chat_template=text)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    row = rows()[0]
    conversation = OpenAIToMessages()(row)["messages"][:3]
    result = Message("tool", row["answer"], masked=True, eot=False)
    turn = grpo_parts.tool_turn_tokens(ours, conversation, result)
    short = theirs.apply_chat_template(row["messages"][:3], chat_template=text, tokenize=False)
    long = theirs.apply_chat_template(row["messages"][:4], chat_template=text, tokenize=False,
                                      add_generation_prompt=True)
    assert long.startswith(short)
    assert ours.decode(turn) == long[len(short):]
    assert long[len(short):] == f'<|start_header_id|>ipython<|end_header_id|>\n\n"{row["answer"]}"<|eot_id|>' \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_tool_splits_are_dealt_by_the_generator_and_disjoint():
    """The validation split (tool_calls_val) and the second held-out set (tool_calls_test) are the generator's next
    rows after the training and held-out ones, which stay as shipped; no question is in two files, and tiny/tool_grpo
    validates on the validation split, never on a held-out file."""
    from torchtune_lit.datasets._tiny_world import make_tool_examples

    dealt = make_tool_examples(n_train=480 + 96 + 192, n_eval=48, seed=0)
    splits = {"train": dealt["train"][:480], "eval": dealt["eval"], "val": dealt["train"][480:576],
              "test": dealt["train"][576:]}
    seen = set()
    for name, expected in splits.items():
        shipped = [json.loads(line) for line in open(_asset_path(f"tiny/tool_calls_{name}.jsonl"))]
        assert shipped == expected, name
        questions = {r["expression"] for r in shipped}
        assert len(questions) == len(shipped) and not questions & seen, name
        seen |= questions
    cfg = config.load_config(TOOL_GRPO, [])
    assert cfg.validation_dataset.data_files.endswith("tiny/tool_calls_val.jsonl")
    assert cfg.dataset.data_files.endswith("tiny/tool_calls_train.jsonl") and cfg.dataset.split == "train[384:]"
