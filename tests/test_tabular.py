"""The table model's pre-training recipes: two FSDP2 processes at 4 tasks each log the losses and validation numbers
that one process at 8 tasks logs, a sharded step checkpoint resumes to the same losses and learning rates, and the
single-device recipe writes eval.json in the shape `{table: {model: accuracy}}` from the command line."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

from torchtune_lit.training import runs

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SHORT = ["epochs=1", "max_steps_per_epoch=6", "eval_tables=null", "lr_scheduler.num_warmup_steps=2",
         "validation_dataset.num_tasks=16", "run_val_every_n_steps=3"]


def run(*args: str) -> str:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def losses(folder: Path) -> list[float]:
    return [row["loss"] for row in log(folder)]


def test_two_processes_match_one_and_resume(tmp_path):
    run("tabular_pretrain_single_device", "--config", "tiny/tabular", f"output_dir={tmp_path / 'one'}",
        "progress_bar=false", *SHORT)
    run("--nproc_per_node", "2", "--master_port", "29541", "tabular_pretrain_distributed", "--config",
        "tiny/tabular_distributed", f"output_dir={tmp_path / 'two'}", "save_every_n_steps=3", *SHORT)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    print("one process, 8 tasks:", one, "two processes, 4 tasks each:", two)
    assert len(one) == len(two) == 6
    # the same 8 tasks per step; only the order in which two processes add the gradients differs
    assert abs(one[0] - two[0]) <= 1e-5 * one[0]
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(one, two)), (one, two)
    # the held-out tasks, split between the processes, give the one-process validation numbers
    val_one = [(r["val_loss"], r["val_accuracy"]) for r in log(tmp_path / "one") if "val_loss" in r]
    val_two = [(r["val_loss"], r["val_accuracy"]) for r in log(tmp_path / "two") if "val_loss" in r]
    assert len(val_one) == len(val_two) == 2
    assert all(abs(a[0] - b[0]) <= 1e-3 * a[0] and abs(a[1] - b[1]) <= 0.01 for a, b in zip(val_one, val_two)), (
        val_one, val_two)
    # a run stopped after its sharded step_3 checkpoint, resumed: the same steps 4-6
    # (made as a run makes it: claimed, step_3 written, let go, so step_3 is the run's own)
    stopped = runs.claim_output_dir(tmp_path / "stopped", recipe="tabular_pretrain_distributed")
    shutil.copytree(tmp_path / "two" / "step_3", stopped / "step_3")
    runs.release_output_dir(stopped)
    out = run("--nproc_per_node", "2", "--master_port", "29543", "tabular_pretrain_distributed", "--config",
              "tiny/tabular_distributed", f"output_dir={stopped}", "resume_from_checkpoint=true", *SHORT)
    assert "Resuming from" in out
    resumed = losses(stopped)
    assert len(resumed) == 3 and all(abs(a - b) <= 1e-6 * a for a, b in zip(resumed, two[3:])), (resumed, two)
    # the learning-rate schedule was restored: the same (decaying) rates as the uninterrupted run
    rates = [row["lr"] for row in log(tmp_path / "two")]
    assert [row["lr"] for row in log(stopped)] == rates[3:] and rates[3] > rates[5]


def test_single_device_cli_writes_eval_json(tmp_path):
    out = run("tabular_pretrain_single_device", "--config", "tiny/tabular", f"output_dir={tmp_path}",
              "progress_bar=false", "max_steps_per_epoch=5", "run_val_every_n_steps=5", "eval_splits=1",
              "eval_ensemble=1")
    assert "check: breast_cancer: 569 rows, 30 features, 2 classes" in out
    results = json.loads((tmp_path / "eval.json").read_text())
    assert set(results) == {"iris", "wine", "breast_cancer"}
    for table, row in results.items():
        assert set(row) == {"table_transformer", "logistic_regression", "knn"}
        assert all(0.0 <= v <= 1.0 for v in row.values())
        assert row["logistic_regression"] > 0.9, (table, row)  # a sanity check of the baselines' splits
    assert (tmp_path / "epoch_0" / "model.safetensors").is_file()
