"""Exact resume under a real kill: a run killed with SIGKILL after step k and resumed logs, from step k+1, exactly the
losses of an uninterrupted run (same data order, optimizer moments, learning rates and random states)."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=2", "max_steps_per_epoch=8", "progress_bar=false", "save_every_n_steps=3", "keep_last_n_checkpoints=2"]


def run(recipe: str, config: str, *overrides: str) -> None:
    result = subprocess.run([TUNELIT, "run", recipe, "--config", config, *overrides], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.mark.parametrize("recipe,config,extra", [
    ("lora_finetune_single_device", "tiny/lora", ["model.lora_dropout=0.1"]),   # dropout: the RNG state matters
    ("full_finetune_single_device", "tiny/full", []),
    ("lora_dpo_single_device", "tiny/dpo", []),
    ("full_dpo_single_device", "tiny/full_dpo", []),
    ("knowledge_distillation_single_device", "tiny/kd", []),
    ("qat_single_device", "tiny/qat", []),
    # the optimizer stepped in backward (per-parameter states by name), and torchao's 8-bit AdamW (quantized states)
    ("full_finetune_single_device", "tiny/full", ["optimizer_in_bwd=true", "clip_grad_norm=null"]),
    ("full_finetune_single_device", "tiny/full", ["optimizer._component_=torchao.optim.AdamW8bit"]),
    ("lora_finetune_single_device", "tiny/lora", ["optimizer._component_=torchao.optim.AdamW8bit", "optimizer_in_bwd=true",
                                                  "clip_grad_norm=null"]),
])
def test_killed_run_resumes_exactly(tmp_path, recipe, config, extra):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run(recipe, config, f"output_dir={reference}", *COMMON, *extra)

    process = subprocess.Popen([TUNELIT, "run", recipe, "--config", config, f"output_dir={killed}", *COMMON, *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 11):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)                      # after step 11, mid-epoch 2; last checkpoint: step 9
    process.wait()
    assert len(log.read_text().splitlines()) < 16, "the run finished before it could be killed"
    assert sorted(p.name for p in killed.glob("step_*")) == ["step_6", "step_9"]   # keep_last_n_checkpoints=2

    run(recipe, config, f"output_dir={killed}", *COMMON, *extra, "resume_from_checkpoint=true")
    expected, got = losses(reference / "log.jsonl"), losses(log)
    assert sorted(got) == list(range(1, 17)) == sorted(expected)
    assert all(got[s] == expected[s] for s in range(10, 17)), {s: (got[s], expected[s]) for s in range(10, 17)}


def test_resume_with_a_new_learning_rate_continues_with_it(tmp_path):
    """A killed run resumed with optimizer.lr doubled: the optimizer and schedule state come back from the checkpoint,
    but every step after it runs at twice the rate the killed run logged for that step (the schedule's position kept),
    not at the saved rate (issue #39)."""
    killed = tmp_path / "killed"
    overrides = [f"output_dir={killed}", *COMMON, "validation_dataset=null", "preflight=false"]
    process = subprocess.Popen([TUNELIT, "run", "full_finetune_single_device", "--config", "tiny/full", *overrides],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 11):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)                      # after step 11; last checkpoint: step 9
    process.wait()
    before = {r["step"]: r["lr"] for r in map(json.loads, log.read_text().splitlines())}
    assert 11 in before and 16 not in before, "the run was not killed after step 11"
    saved_lr = OmegaConf.load(killed / "config.yaml").optimizer.lr
    run("full_finetune_single_device", "tiny/full", *overrides, "resume_from_checkpoint=true",
        f"optimizer.lr={2 * saved_lr}")
    after = {r["step"]: r["lr"] for r in map(json.loads, log.read_text().splitlines())}
    assert sorted(after) == list(range(1, 17))
    assert all(after[s] == before[s] for s in range(1, 10))                  # trained before the checkpoint
    assert all(abs(after[s] - 2 * before[s]) <= 1e-12 for s in (10, 11)), {s: (before[s], after[s]) for s in (10, 11)}
