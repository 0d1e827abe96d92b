"""On-policy distillation (GKD) through `tunelit run`: a 2-layer student from its initialisation learns from the shipped
4-layer base; with lmbda=0.5 the steps mix the student's own sampled answers and the dataset's (the coin's extremes
are checked in the chapter); the held-out KL to the teacher falls; a run resumed from its step-2 checkpoint repeats
the same coin flips and samples (the same losses); a bad lmbda or a chunked loss is refused before anything loads."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import torchtune_lit.recipes.on_policy_distillation_single_device as gkd_recipe
from torchtune_lit import config

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SMALL = ["batch_size=4", "max_new_tokens=6", "progress_bar=false", "kl_eval_batches=1"]


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", "on_policy_distillation_single_device", "--config", "tiny/gkd", *SMALL,
                             *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_on_policy_run_learns_and_resumes_exactly(tmp_path):
    out = tmp_path / "gkd"
    result = run("max_steps_per_epoch=4", "save_every_n_steps=2", f"output_dir={out}")
    assert "GKD: KL(teacher || student)" in result.stdout + result.stderr
    history = records(out / "log.jsonl")
    assert [h["on_policy"] for h in history] == [1.0, 0.0, 0.0, 1.0]   # lmbda 0.5, fixed by seed and step
    kl = json.loads((out / "kl_to_teacher.json").read_text())
    assert kl["after"] < kl["before"]
    assert (out / "epoch_0" / "model.safetensors").is_file()
    # resume from step 2: steps 3 and 4 repeat (the same coins and samples), bit for bit
    (out / "log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history[:2]))
    run("max_steps_per_epoch=4", "save_every_n_steps=2", f"output_dir={out}", "resume_from_checkpoint=true")
    again = records(out / "log.jsonl")
    assert [h["loss"] for h in again[2:]] == [h["loss"] for h in history[2:]]


@pytest.mark.parametrize("overrides, words", [
    (["lmbda=1.5"], "lmbda must be in [0, 1]"),
    (["loss._component_=torchtune_lit.modules.loss.kd_losses.GeneralizedJSDWithChunkedOutputLoss"], "not chunked"),
])
def test_bad_settings_are_refused(tmp_path, overrides, words):
    cfg = config.load_config("tiny/gkd", [*SMALL, *overrides, f"output_dir={tmp_path / 'bad'}"])
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        gkd_recipe.train(cfg)
