"""The table model's pre-training recipes: two FSDP2 processes at 4 tasks each log what one process at 8 tasks logs,
a sharded step checkpoint resumes to the same losses, and the single-device recipe writes eval.json in the shape
`{table: {model: accuracy}}` from the command line."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SHORT = ["epochs=1", "max_steps_per_epoch=6", "eval_tables=null"]


def run(*args: str) -> str:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "log.jsonl").read_text().splitlines()]


def test_two_processes_match_one_and_resume(tmp_path):
    run("tabular_pretrain_single_device", "--config", "tiny/tabular", f"output_dir={tmp_path / 'one'}",
        "progress_bar=false", "~validation_dataset", *SHORT)
    run("--nproc_per_node", "2", "--master_port", "29541", "tabular_pretrain_distributed", "--config",
        "tiny/tabular_distributed", f"output_dir={tmp_path / 'two'}", "save_every_n_steps=3", *SHORT)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    print("one process, 8 tasks:", one, "two processes, 4 tasks each:", two)
    assert len(one) == len(two) == 6
    # the same 8 tasks per step; only the order in which two processes add the gradients differs
    assert abs(one[0] - two[0]) <= 1e-5 * one[0]
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(one, two)), (one, two)
    # a run stopped after its sharded step_3 checkpoint, resumed: the same steps 4-6
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "two" / "step_3", stopped / "step_3")
    out = run("--nproc_per_node", "2", "--master_port", "29543", "tabular_pretrain_distributed", "--config",
              "tiny/tabular_distributed", f"output_dir={stopped}", "resume_from_checkpoint=true", *SHORT)
    assert "Resuming from" in out
    resumed = losses(stopped)
    assert len(resumed) == 3 and all(abs(a - b) <= 1e-6 * a for a, b in zip(resumed, two[3:])), (resumed, two)


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
        assert row["logistic_regression"] > 0.9, (table, row)  # scikit-learn's baseline on these easy tables
    assert (tmp_path / "epoch_0" / "model.safetensors").is_file()
