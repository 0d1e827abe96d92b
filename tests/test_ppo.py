"""PPO through `tunelit run`, from a short SFT and a short reward-model run of the tiny world (made once per module): a
run logs every metric, starts on its reference (KL 0), is reproducible from its config, resumes exactly after a kill,
saves a policy and a value model that transformers loads; settings it cannot honour are refused by name."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from torchtune_lit import config, rlhf

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SMALL = ["batch_size=4", "ppo_batch_size=2", "max_new_tokens=8", "max_steps_per_epoch=3", "run_val_every_n_steps=3",
         "progress_bar=false", "validation_dataset.split=train[:8]"]


def tunelit_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600, check=False)


def run(*args: str) -> subprocess.CompletedProcess:
    result = tunelit_run(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> list[str]:
    "The overrides that point tiny/ppo at a 100-step SFT start and a one-epoch reward model."
    out = tmp_path_factory.mktemp("starts")
    run("lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={out / 'sft'}", "epochs=1",
        "max_steps_per_epoch=100", "progress_bar=false", "validation_dataset=null")
    run("reward_model_single_device", "--config", "tiny/reward_model", f"output_dir={out / 'rm'}", "epochs=1",
        "progress_bar=false", "validation_dataset=null")
    return [f"checkpointer.checkpoint_dir={out / 'sft' / 'epoch_0'}", f"reward_checkpoint_dir={out / 'rm' / 'epoch_0'}"]


def test_ppo_runs_reproducibly_and_saves_policy_and_value_model(tmp_path, starts):
    first = run("ppo_full_finetune_single_device", "--config", "tiny/ppo", *starts, *SMALL, f"output_dir={tmp_path / 'a'}")
    assert "PPO: sample score" in first.stdout and "held-out score" in first.stdout
    history = records(tmp_path / "a" / "log.jsonl")
    assert [r["step"] for r in history] == [1, 2, 3]
    expected = {"loss", "policy_loss", "value_loss", "ratio", "clipfrac", "approx_kl", "score", "kl", "reward",
                "accuracy", "no_eos", "completion_length", "lr"}
    assert expected <= history[0].keys() and {"val_score", "val_accuracy"} <= history[-1].keys()
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] != 0.0   # the policy starts as its reference, then moves
    # the same config gives the same samples and updates
    run("ppo_full_finetune_single_device", "--config", "tiny/ppo", *starts, *SMALL, f"output_dir={tmp_path / 'b'}")
    again = records(tmp_path / "b" / "log.jsonl")
    for key in ("loss", "score", "kl", "val_score"):
        assert [r.get(key) for r in again] == [r.get(key) for r in history], key

    policy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "epoch_0")
    value = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a" / "value_epoch_0").eval()
    assert policy.config.model_type == "llama" and value.config.num_labels == 1
    ours = rlhf.tiny_llama_reward(vocab_size=2048).eval()
    ours.load_state_dict(rlhf.reward_model_state_dict(tmp_path / "a" / "value_epoch_0"))
    rows = torch.tensor([[1, 17, 23, 99, 5, 60], [1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        torch.testing.assert_close(value(rows).logits[:, 0], rlhf.token_values(ours, rows)[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("override, message", [
    ("ppo_batch_size=3", "ppo_batch_size (3) must divide batch_size (4)"),
    ("gradient_accumulation_steps=2", "set ppo_batch_size instead"),
])
def test_ppo_refuses_settings_it_cannot_honour(tmp_path, override, message):
    result = tunelit_run("ppo_full_finetune_single_device", "--config", "tiny/ppo", *SMALL, override,
                         f"output_dir={tmp_path}")
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_ppo_refuses_a_language_model_as_reward_model(tmp_path, starts):
    base = config._asset_path("tiny/base")
    result = tunelit_run("ppo_full_finetune_single_device", "--config", "tiny/ppo", starts[0], f"reward_checkpoint_dir={base}",
                         *SMALL, f"output_dir={tmp_path}")
    assert result.returncode != 0 and "has no score.weight: it is not a reward model" in result.stderr, result.stderr[-2000:]


def test_ppo_killed_run_resumes_exactly(tmp_path, starts):
    "Killed after step 4 (last checkpoint: step 4 or 2), the resumed run logs the reference run's numbers."
    common = ["--config", "tiny/ppo", *starts, *SMALL, "epochs=2", "save_every_n_steps=2", "keep_last_n_checkpoints=2"]
    recipe = "ppo_full_finetune_single_device"
    run(recipe, *common, f"output_dir={tmp_path / 'reference'}")
    expected = records(tmp_path / "reference" / "log.jsonl")
    assert [r["step"] for r in expected] == list(range(1, 7))
    killed = tmp_path / "killed"
    process = subprocess.Popen([TUNELIT, "run", recipe, *common, f"output_dir={killed}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 5):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(log.read_text().splitlines()) < 6, "the run finished before it could be killed"
    resumed = run(recipe, *common, f"output_dir={killed}", "resume_from_checkpoint=true")
    assert "Resuming from" in resumed.stdout
    got = records(log)
    assert [r["step"] for r in got] == list(range(1, 7))
    for key in ("loss", "policy_loss", "value_loss", "score", "kl", "accuracy"):
        assert [r[key] for r in got] == [r[key] for r in expected], key
    assert (killed / "value_epoch_1" / "config.json").is_file()
