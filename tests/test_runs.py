"""A run owns its output folder; every epoch is kept (or the last few), best/ follows the validation loss, early
stopping obeys its patience — through the real `tunelit` command, on short runs of the tiny LoRA config."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SHORT = ["max_steps_per_epoch=3", "progress_bar=false", "preflight=false", "run_val_every_n_steps=null"]


def tunelit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELIT, *args], capture_output=True, text=True, timeout=600)


def lora(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return tunelit("run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={output_dir}",
                   *SHORT, *overrides)


def fingerprint(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_is_refused_and_loses_nothing(tmp_path):
    run = tmp_path / "run"
    first = lora(run, "epochs=1")
    assert first.returncode == 0, first.stderr[-2000:]
    before = fingerprint(run)
    second = lora(run, "epochs=1")
    assert second.returncode != 0
    assert f"output_dir {run} already holds a run" in second.stderr
    assert "overwrite=true" in second.stderr and "Traceback" not in second.stderr
    assert fingerprint(run) == before  # byte for byte
    (run / "my_notes.txt").write_text("mine")  # a file no run wrote stops even overwrite=true
    third = lora(run, "epochs=1", "overwrite=true", "seed=1")
    assert third.returncode != 0 and "Traceback" not in third.stderr
    assert f"output_dir {run} holds my_notes.txt, which no run wrote there" in third.stderr
    assert fingerprint(run) == {**before, "my_notes.txt": hashlib.sha256(b"mine").hexdigest()}
    (run / "my_notes.txt").unlink()  # moved out: now overwrite=true replaces the run
    third = lora(run, "epochs=1", "overwrite=true", "seed=1")
    assert third.returncode == 0, third.stderr[-2000:]
    assert not (run / ".tunelit-lock").exists()
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and len({r["run_id"] for r in log}) == 1


def test_resume_refuses_a_changed_model(tmp_path):
    run = tmp_path / "run"
    assert lora(run, "epochs=1", "save_every_n_steps=2").returncode == 0
    info = json.loads((run / "run.json").read_text())  # as a run killed after step 2 leaves it
    (run / "run.json").write_text(json.dumps(dict(info, status="running", finished=None)))
    changed = lora(run, "epochs=1", "save_every_n_steps=2", "resume_from_checkpoint=true", "model.lora_rank=4")
    assert changed.returncode != 0 and "Traceback" not in changed.stderr
    assert "resume: model.lora_rank was 8, now 4; that is a different run" in changed.stderr


def test_a_users_config_yaml_stops_the_run(tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "config.yaml").write_text("my settings\n")
    result = lora(run, "epochs=1")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"output_dir {run} holds config.yaml, which no run wrote there" in result.stderr
    assert [p.name for p in run.iterdir()] == ["config.yaml"]
    assert (run / "config.yaml").read_text() == "my settings\n"


def test_epochs_best_and_early_stopping_follow_the_validation_loss(tmp_path):
    run = tmp_path / "run"
    result = lora(run, "epochs=5", "keep_last_n_epochs=1", "early_stopping_patience=1", "optimizer.lr=0.03")
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads((run / "run.json").read_text())
    vals = [e["val_loss"] for e in info["epochs"]]
    best = min(range(len(vals)), key=lambda i: (vals[i], i))
    assert info["best_epoch"] == best and (run / "best").resolve() == (run / f"epoch_{best}").resolve()
    # it stops after the first epoch that does not improve on the best, and not before
    improved = [i == 0 or vals[i] < min(vals[:i]) for i in range(len(vals))]
    assert all(improved[:-1]) and (len(vals) == 5 or not improved[-1])
    assert info["stopped_early"] == (len(vals) < 5)
    # only the last epoch and the best are kept
    kept = sorted(p.name for p in run.glob("epoch_*"))
    assert kept == sorted({f"epoch_{len(vals) - 1}", f"epoch_{best}"})
    assert f"best epoch: {best}, in {run / 'best'}" in result.stdout


def test_early_stopping_without_validation_is_refused(tmp_path):
    result = lora(tmp_path / "run", "early_stopping_patience=1", "validation_dataset=null")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "early_stopping_patience needs a validation_dataset" in result.stderr
