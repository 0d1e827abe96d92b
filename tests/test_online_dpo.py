"""Online DPO (`online_dpo_single_device`) on the tiny world, from 20 steps of SFT of the tiny base (made once per
module; its answers earn the format reward sometimes, so some pairs are not ties): through `tunelit run`, until its
first pair the policy equals its reference (margin and KL 0, each pair's loss log 2; IPO's 25), every prompt is a
pair or a tie, the weights move and are saved; IPO runs through the config; a config without a judge is refused
before anything loads. The loss against TRL's `OnlineDPOTrainer`: tests/test_online_dpo_trl.py."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchtune_lit.recipes.online_dpo_single_device as online_dpo_recipe
import torchtune_lit.rlhf.grpo_parts as grpo_parts
from torchtune_lit import config, rlhf

TUNELIT = str(Path(sys.executable).parent / "tunelit")
RECIPE = online_dpo_recipe.__file__  # by path until the registry lists it
CONFIG = str(Path(config.__file__).parent / "recipes" / "configs" / "tiny" / "online_dpo.yaml")
SMALL = ["batch_size=8", "max_new_tokens=6", "progress_bar=false", "validation_dataset=null", "optimizer.lr=1e-3"]


def run(recipe: str, config: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", recipe, "--config", config, *args], capture_output=True, text=True,
                            timeout=300)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


def online_dpo(start: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    return run(RECIPE, CONFIG, f"checkpointer.checkpoint_dir={start}", *SMALL, *args, ok=ok)


@pytest.fixture(scope="module")
def sft_start(tmp_path_factory) -> Path:
    "20 steps of tiny/lora: answers that are sometimes one snake_case label (the format reward)."
    out = tmp_path_factory.mktemp("sft")
    run("lora_finetune_single_device", "tiny/lora", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=20",
        "progress_bar=false", "validation_dataset=null")
    return out / "epoch_0"


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_online_dpo_trains_on_its_own_pairs(tmp_path, sft_start):
    out = tmp_path / "online_dpo"
    result = online_dpo(sft_start, "max_steps_per_epoch=3", f"output_dir={out}")
    assert "Online DPO: mean reward" in result.stdout + result.stderr
    history = records(out / "log.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["pairs"] + h["ties"] == 8 for h in history)  # every prompt: a pair or a tie
    assert sum(h["pairs"] for h in history) > 0, history
    assert history[0]["margin"] == 0.0 and history[0]["kl"] == 0.0
    # a step without pairs makes no update: at the first step with pairs the policy is still its reference
    first = next(h for h in history if h["pairs"])
    assert first["margin"] == 0.0 and abs(first["loss"] - math.log(2)) < 1e-6, first
    assert any(h.get("grad_norm", 0) > 0 for h in history)
    saved, start = load_file(out / "epoch_0" / "model.safetensors"), load_file(sft_start / "model.safetensors")
    assert saved.keys() == start.keys() and any(not torch.equal(saved[k], start[k]) for k in start)


def test_ipo_through_the_config(tmp_path, sft_start):
    out = tmp_path / "ipo"
    online_dpo(sft_start, "max_steps_per_epoch=3", f"output_dir={out}",
               "loss._component_=torchtune_lit.rlhf.loss.IPOLoss", "~loss.beta", "loss.tau=0.1")
    # a step without pairs makes no update: at the first step with pairs the policy is still its reference, each
    # margin 0, and IPO's loss (0 - 1 / (2 tau))^2 = 25
    first = next(h for h in records(out / "log.jsonl") if h["pairs"])
    assert abs(first["loss"] - 25.0) < 1e-4, first


def test_no_judge_is_refused(tmp_path):
    "Refused before anything loads (the CLI prints a ValueError in one line)."
    cfg = config.load_config(CONFIG, [*SMALL, "reward_functions=[]", f"output_dir={tmp_path / 'none'}"],
                             known_keys=online_dpo_recipe.CONFIG_KEYS)
    with pytest.raises(ValueError, match="no reward_functions"):
        online_dpo_recipe.train(cfg)
    assert not (tmp_path / "rm").exists()  # refused before anything loads
    assert not (tmp_path / "none").exists()


def test_a_reward_model_judges(tmp_path, sft_start, monkeypatch):
    """A reward model named in the config judges the pairs instead of the reward functions: with a random score
    head, two answers tie only when they are the same tokens (the reward functions' verdicts also tie on different
    answers that are both wrong)."""
    torch.manual_seed(0)
    scorer = rlhf.tiny_llama_reward(vocab_size=2048)
    torch.nn.init.normal_(scorer.output.weight)
    base_config = json.loads((sft_start / "config.json").read_text())
    judge = rlhf.save_reward_model(scorer.state_dict(), base_config, tmp_path / "reward_model")
    samples, rollout = [], grpo_parts.rollout
    monkeypatch.setattr(grpo_parts, "rollout", lambda *a, **k: samples.append(rollout(*a, **k)) or samples[-1])
    cfg = config.load_config(CONFIG, [
        f"checkpointer.checkpoint_dir={sft_start}", *SMALL, "max_steps_per_epoch=2", f"output_dir={tmp_path / 'out'}",
        f"reward_checkpoint_dir={judge}", "reward_model._component_=torchtune_lit.rlhf.tiny_llama_reward",
        "reward_model.vocab_size=2048"], known_keys=online_dpo_recipe.CONFIG_KEYS)
    history = online_dpo_recipe.train(cfg)
    functions_tie = 0
    for h, sample in zip(history, samples):
        answers = sample["rollout"].completions
        same = sum(answers[2 * i] == answers[2 * i + 1] for i in range(len(answers) // 2))
        assert h["ties"] == same and "judge_score" in h, (h, same)
        first, second = sample["reward"].view(-1, 2).unbind(dim=1)
        functions_tie += (first == second).sum().item()
    assert functions_tie > sum(h["ties"] for h in history)  # the judge is not the reward functions


def test_a_reward_model_needs_its_folder(tmp_path):
    "Refused before anything loads, naming the key to set."
    cfg = config.load_config(CONFIG, [*SMALL, f"output_dir={tmp_path / 'rm'}", "checkpointer.checkpoint_dir=unused",
                                      "reward_model._component_=torchtune_lit.rlhf.tiny_llama_reward"],
                             known_keys=online_dpo_recipe.CONFIG_KEYS)
    with pytest.raises(ValueError, match="reward_checkpoint_dir is not"):
        online_dpo_recipe.train(cfg)
    assert not (tmp_path / "rm").exists()  # refused before anything loads
