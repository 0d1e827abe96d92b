"""RLOO through `tunelit run`, from 20 steps of SFT of the tiny base (made once per module; its answers earn the format
reward sometimes, so the advantages are not all zero): on-policy, every step's loss is minus the mean of leave-one-out
advantages, which sum to zero in each group, while the gradient is not zero; the first step's policy equals its
reference (ratio 1, KL 0); the weights move and are saved; a second pass over the same samples (`ppo_epochs=2`) is
off-policy; a group of one answer is refused before anything loads."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchtune_lit.recipes.rloo_full_finetune_single_device as rloo_recipe
from torchtune_lit import config

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SMALL = ["batch_size=2", "group_size=4", "max_new_tokens=6",
         "progress_bar=false", "validation_dataset=null", "optimizer.lr=1e-3"]


def run(recipe: str, config: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", recipe, "--config", config, *args], capture_output=True, text=True,
                            timeout=300)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


def rloo(start: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    return run("rloo_full_finetune_single_device", "tiny/rloo", f"checkpointer.checkpoint_dir={start}", *SMALL, *args,
               ok=ok)


@pytest.fixture(scope="module")
def sft_start(tmp_path_factory) -> Path:
    "20 steps of tiny/lora: answers that are sometimes one snake_case label (the format reward)."
    out = tmp_path_factory.mktemp("sft")
    run("lora_finetune_single_device", "tiny/lora", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=20",
        "progress_bar=false", "validation_dataset=null")
    return out / "epoch_0"


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_rloo_trains_on_policy(tmp_path, sft_start):
    out = tmp_path / "rloo"
    result = rloo(sft_start, "max_steps_per_epoch=3", f"output_dir={out}")
    assert "RLOO: mean reward" in result.stdout + result.stderr
    history = records(out / "log.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[0]["ratio"] == 1.0 and history[0]["clipfrac"] == 0.0 and history[0]["kl"] == 0.0
    assert all(abs(h["loss"]) < 1e-5 for h in history)              # advantages sum to 0 in each group
    assert any(h["reward"] > 0 for h in history) and history[-1]["kl"] != 0.0
    # ... but the gradient is not (a step whose samples all scored alike, before any KL, has none)
    assert any(h["grad_norm"] > 0 for h in history)
    saved, start = load_file(out / "epoch_0" / "model.safetensors"), load_file(sft_start / "model.safetensors")
    assert saved.keys() == start.keys() and any(not torch.equal(saved[k], start[k]) for k in start)


def test_second_pass_is_off_policy(tmp_path, sft_start):
    out = tmp_path / "two_passes"
    rloo(sft_start, "max_steps_per_epoch=3", "ppo_epochs=2", f"output_dir={out}")
    logged = records(out / "log.jsonl")  # each step's last pass, after one update on its samples
    # (a step whose samples all scored alike has no gradient, so its second pass is still on-policy)
    assert any(r["ratio"] != 1.0 and abs(r["loss"]) > 1e-6 for r in logged), logged


def test_a_group_of_one_is_refused(tmp_path):
    "Refused before anything loads (the CLI prints a ValueError in one line)."
    cfg = config.load_config("tiny/rloo", [*SMALL, "group_size=1", f"output_dir={tmp_path / 'one'}"])
    with pytest.raises(ValueError, match="group_size must be a whole number >= 2 for RLOO"):
        rloo_recipe.train(cfg)
    assert not (tmp_path / "one").exists()
