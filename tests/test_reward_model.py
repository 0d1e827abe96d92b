"""The reward-model recipe end to end through `tunelit`: the held-out pair accuracy beats chance clearly, and the saved
folder is a Hugging Face sequence classifier that ranks the held-out pairs as the recipe reported."""
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
import transformers

import torchtune_lit.config as config
import torchtune_lit.rlhf.preference_parts as preference_parts

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def test_reward_model_ranks_held_out_pairs_and_loads_in_transformers(tmp_path):
    result = subprocess.run([TUNELIT, "run", "reward_model_single_device", "--config", "tiny/reward_model",
                             f"output_dir={tmp_path}", "progress_bar=false"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = map(float, re.search(r"Held-out pair accuracy ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert before == 0.0 and after >= 0.7, result.stdout          # 32 held-out pairs; chance is 0.5
    folder = tmp_path / "epoch_1"
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and saved["num_labels"] == 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    cfg = config.load_config("tiny/reward_model")
    tokenizer = config.instantiate(cfg.tokenizer)
    loader = preference_parts.build_preference_loaders(config.instantiate(cfg.dataset, tokenizer),
                                                       config.instantiate(cfg.validation_dataset, tokenizer),
                                                       cfg.batch_size, cfg.seed)[1]
    correct = pairs = 0
    with torch.no_grad():
        for ids, _ in loader:
            scores = model(ids).logits[:, 0]
            half = len(scores) // 2
            correct += int((scores[:half] > scores[half:]).sum())
            pairs += half
    assert abs(correct / pairs - after) < 1e-6, (correct, pairs, after)


def test_reward_model_killed_run_resumes_exactly(tmp_path):
    "Killed after step 9 (last checkpoint: step 8), the resumed run logs the reference run's losses and accuracies."
    import signal
    import time
    common = ["reward_model_single_device", "--config", "tiny/reward_model", "epochs=2", "max_steps_per_epoch=6",
              "save_every_n_steps=4", "validation_dataset=null", "progress_bar=false"]

    def records(log):
        return [json.loads(line) for line in log.read_text().splitlines()]

    reference = subprocess.run([TUNELIT, "run", *common, f"output_dir={tmp_path / 'reference'}"], capture_output=True,
                               text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = records(tmp_path / "reference" / "log.jsonl")
    assert [r["step"] for r in expected] == list(range(1, 13))
    killed = tmp_path / "killed"
    process = subprocess.Popen([TUNELIT, "run", *common, f"output_dir={killed}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 9):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(log.read_text().splitlines()) < 12, "the run finished before it could be killed"
    resumed = subprocess.run([TUNELIT, "run", *common, f"output_dir={killed}", "resume_from_checkpoint=true"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "Resuming from" in resumed.stdout, resumed.stderr[-3000:]
    got = records(log)
    assert [r["step"] for r in got] == list(range(1, 13))
    for key in ("loss", "accuracy", "rewards/margin"):
        assert [r[key] for r in got] == [r[key] for r in expected], key
