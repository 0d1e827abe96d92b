"""GRPO through `tunelit run`, from a short SFT of the tiny world (made once per module): a killed run resumes with
bit-identical losses and rewards (the samples are fixed by seed and step), a LoRA policy trains through the model
builder and saves a PEFT adapter, and the distributed recipe runs on two Gloo processes and logs every metric."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SMALL = ["batch_size=2", "group_size=4", "max_new_tokens=8", "progress_bar=false", "run_val_every_n_steps=4"]


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_start(tmp_path_factory) -> Path:
    "100 steps of tiny/lora: a start that answers some held-out prompts right (about a third)."
    out = tmp_path_factory.mktemp("sft")
    run("lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={out}", "epochs=1",
        "max_steps_per_epoch=100", "progress_bar=false", "validation_dataset=null")
    return out / "epoch_0"


def test_grpo_killed_run_resumes_exactly(tmp_path, sft_start):
    common = ["--config", "tiny/grpo", f"checkpointer.checkpoint_dir={sft_start}", *SMALL, "epochs=2",
              "max_steps_per_epoch=6", "save_every_n_steps=3", "keep_last_n_checkpoints=2"]
    recipe = "grpo_full_finetune_single_device"
    run(recipe, *common, f"output_dir={tmp_path / 'reference'}")
    expected = records(tmp_path / "reference" / "log.jsonl")
    assert len(expected) == 12
    # on-policy: the ratio is exactly 1; the policy starts equal to its reference: KL 0
    assert all(r["ratio"] == 1.0 and r["clipfrac"] == 0.0 for r in expected)
    assert expected[0]["kl"] == 0.0 and expected[-1]["kl"] > 0.0
    assert any(r["accuracy"] > 0 for r in expected) and "val_accuracy" in expected[3]

    killed = tmp_path / "killed"
    process = subprocess.Popen([TUNELIT, "run", recipe, *common, f"output_dir={killed}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 8):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)                      # after step 8 (epoch 2); last checkpoint: step 6
    process.wait()
    assert len(log.read_text().splitlines()) < 12, "the run finished before it could be killed"
    run(recipe, *common, f"output_dir={killed}", "resume_from_checkpoint=true")
    got = records(log)
    assert [r["step"] for r in got] == list(range(1, 13))
    for key in ("loss", "reward", "kl", "accuracy"):
        assert [r[key] for r in got[6:]] == [r[key] for r in expected[6:]], key


def test_lora_grpo_trains_adapters_only(tmp_path, sft_start):
    out = tmp_path / "lora"
    result = run("grpo_full_finetune_single_device", "--config", "tiny/grpo", f"checkpointer.checkpoint_dir={sft_start}",
                 *SMALL, "max_steps_per_epoch=4", f"output_dir={out}", "model._component_=torchtune_lit.models.tiny.lora_tiny_llama",
                 "model.lora_attn_modules=[q_proj,v_proj]", "optimizer.lr=1e-3")
    assert "GRPO: mean reward" in result.stdout and "validation accuracy" in result.stdout
    history = records(out / "log.jsonl")
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 0.0   # the reference: the policy with adapters off
    assert (out / "epoch_0" / "adapter" / "adapter_config.json").is_file()
    merged, start = load_file(out / "epoch_0" / "model.safetensors"), load_file(sft_start / "model.safetensors")
    moved = [k for k in start if not torch.equal(merged[k], start[k])]
    assert moved and all("proj" in k for k in moved), moved   # only the adapted projections changed


def test_grpo_distributed_on_two_processes(tmp_path, sft_start):
    out = tmp_path / "multi"
    result = run("--nproc_per_node", "2", "--master_port", "29531", "grpo_full_finetune_distributed", "--config",
                 "tiny/grpo_distributed", f"checkpointer.checkpoint_dir={sft_start}", *SMALL, "max_steps_per_epoch=4",
                 f"output_dir={out}", "dynamic_sampling=true", "scale_rewards=none")
    assert "GRPO: mean reward" in result.stdout
    history = records(out / "log.jsonl")
    assert len(history) == 4 and history[0]["kl"] == 0.0 and history[0]["ratio"] == 1.0
    assert {"reward", "rewards/correct", "rewards/format", "accuracy", "val_accuracy"} <= set(history[3])
    # DAPO's dynamic sampling across ranks: the share of the sampled groups each step trains on
    assert all(0 < h["kept_groups"] <= 1 for h in history), history
    saved = load_file(out / "epoch_0" / "model.safetensors")
    start = load_file(sft_start / "model.safetensors")
    assert saved.keys() == start.keys() and any(not torch.equal(saved[k], start[k]) for k in start)
