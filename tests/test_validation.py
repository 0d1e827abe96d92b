"""Validation loss every N steps: logged beside the training loss at the right steps, equal to the token-mean CE of the
held-out data, and without changing the training run."""
import subprocess
import sys
from pathlib import Path

from torchtune_lit.training import read_jsonl

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=4", "progress_bar=false", "preflight=false"]


def run(out, *extra):
    result = subprocess.run([TUNELIT, "run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={out}",
                             *COMMON, *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return read_jsonl(Path(out) / "log.jsonl")


def test_validation_loss_is_logged_and_changes_nothing(tmp_path):
    with_val = run(tmp_path / "val", "run_val_every_n_steps=2", "max_validation_batches=2")
    without = run(tmp_path / "plain", "~validation_dataset")
    assert [r["step"] for r in with_val if "val_loss" in r] == [2, 4]
    assert [r["loss"] for r in with_val] == [r["loss"] for r in without]
    assert all("val_loss" not in r for r in without)
    first, second = (r["val_loss"] for r in with_val if "val_loss" in r)
    assert 0 < second < first < 20            # the held-out loss falls as the adapters learn
