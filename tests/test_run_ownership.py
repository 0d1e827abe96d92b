"""Probe of issue #39, items 2-4 (library side): a run owns only what it wrote, a folder has one run at a time,
a non-finite validation loss is never best, and a resume is the same run. Each case calls the library on a tmp
folder and asserts the one-line refusal, the file that survived, or the value taken; one case runs a child process
(the lock released by a run that fails)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchtune_lit
from torchtune_lit.training import runs
from torchtune_lit.training.runs import (
    RUN_LOCK,
    RUN_MANIFEST,
    EpochResult,
    EpochTracker,
    check_resume_config,
    claim_output_dir,
    finish_run,
    release_output_dir,
    start_run,
)

def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


@pytest.fixture
def finished_run(tmp_path):
    "A run folder as a recipe leaves it: claimed, written, released."
    folder = claim_output_dir(tmp_path / "run", recipe="full_finetune_single_device")
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "log.jsonl").write_text('{"step": 1}\n')
    (folder / "epoch_0").mkdir()
    (folder / "epoch_0" / "model.safetensors").write_text("weights")
    os.symlink("epoch_0", folder / "best")
    release_output_dir(folder)
    return folder


# ---- item 2: a run owns only what it wrote -------------------------------------------------------------------


def test_a_users_config_yaml_is_not_replaced(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("my own notes\n")
    with pytest.raises(FileExistsError) as e:
        claim_output_dir(folder)
    assert "config.yaml" in one_line(e.value) and "no run" in str(e.value)
    assert (folder / "config.yaml").read_text() == "my own notes\n"


def test_a_users_best_and_step_folders_survive_overwrite(tmp_path):
    folder = tmp_path / "mine"
    for name in ("best", "step_3"):
        (folder / name).mkdir(parents=True)
        (folder / name / "keep.txt").write_text(name)
    with pytest.raises(FileExistsError) as e:
        claim_output_dir(folder, overwrite=True)
    assert "best, step_3" in one_line(e.value)
    assert (folder / "best" / "keep.txt").read_text() == "best"
    assert (folder / "step_3" / "keep.txt").read_text() == "step_3"


def test_overwrite_removes_only_what_the_run_recorded(finished_run):
    (finished_run / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as e:  # a file the run did not write stops it
        claim_output_dir(finished_run, overwrite=True)
    assert "notes.txt" in one_line(e.value)
    assert (finished_run / "epoch_0" / "model.safetensors").exists()
    (finished_run / "notes.txt").unlink()
    claim_output_dir(finished_run, overwrite=True)
    left = sorted(p.name for p in finished_run.iterdir())
    assert left == sorted([RUN_LOCK, RUN_MANIFEST])
    release_output_dir(finished_run)


def test_a_second_run_is_refused_without_overwrite(finished_run):
    with pytest.raises(FileExistsError) as e:
        claim_output_dir(finished_run)
    assert "already holds a run" in one_line(e.value) and "overwrite=true" in str(e.value)


def test_a_run_stopped_before_training_is_reused(tmp_path):
    folder = claim_output_dir(tmp_path / "run")
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "preflight.json").write_text("{}")
    release_output_dir(folder)  # refused at preflight, say: only these two were written
    assert claim_output_dir(folder) == folder
    release_output_dir(folder)


def test_a_run_folder_from_before_manifests_is_adopted(tmp_path, capsys):
    folder = tmp_path / "old"
    (folder / "epoch_0").mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"run_id": "abc", "recipe": "demo", "status": "finished"}))
    (folder / "log.jsonl").write_text("")
    (folder / "loss.png").write_bytes(b"png")              # `tunelit plot`
    (folder / "eval_best").mkdir()                          # make main's evaluation of best/
    (folder / "eval_best" / "eval.json").write_text("{}")
    claim_output_dir(folder, overwrite=True)
    assert "made before runs recorded" in capsys.readouterr().out
    assert not any((folder / n).exists() for n in ("epoch_0", "run.json", "loss.png", "eval_best"))
    release_output_dir(folder)


def test_a_run_folder_inside_the_run_is_a_run(finished_run):
    "An evaluation that claimed run/eval_best is a run's folder: overwrite of the run removes it too."
    inner = claim_output_dir(finished_run / "eval_best", recipe="eval_accuracy")
    (inner / "eval.json").write_text("{}")
    release_output_dir(inner)
    claim_output_dir(finished_run, overwrite=True)
    assert not (finished_run / "eval_best").exists()
    release_output_dir(finished_run)


def test_an_evaluation_written_into_the_run_goes_with_it(finished_run):
    "eval_accuracy writes run/eval_best without claiming it (make main does this): recorded, a rerun is not refused."
    (finished_run / "eval_best").mkdir()
    (finished_run / "eval_best" / "eval.json").write_text("{}")
    with pytest.raises(FileExistsError, match="eval_best, which no run wrote there"):
        claim_output_dir(finished_run, overwrite=True)
    assert runs.record_in_enclosing_run(finished_run / "eval_best")
    assert not runs.record_in_enclosing_run(finished_run.parent / "elsewhere")  # not inside a run: left alone
    claim_output_dir(finished_run, overwrite=True)
    assert not (finished_run / "eval_best").exists()
    release_output_dir(finished_run)


@pytest.mark.parametrize("where", ["root", "home", "package", "assets"])
def test_dangerous_output_dirs_are_refused(tmp_path, monkeypatch, where):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    package = Path(torchtune_lit.__file__).parent
    folder = {"root": Path("/"), "home": tmp_path / "home", "package": package,
              "assets": package / "assets"}[where]
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ValueError) as e:
        claim_output_dir(folder)
    assert "output_dir" in one_line(e.value) and "choose" in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_holding_the_home_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    with pytest.raises(ValueError) as e:
        claim_output_dir(tmp_path)
    assert "home" in one_line(e.value)


def test_the_input_checkpoint_folder_is_refused(finished_run, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_text("weights")
    with pytest.raises(ValueError) as e:
        claim_output_dir(base, input_dirs=[base])
    assert f"the input checkpoint folder {base}" in one_line(e.value)
    # training further from run/best (a link to epoch_0) into the run itself would delete it
    with pytest.raises(ValueError) as e:
        claim_output_dir(finished_run, overwrite=True, input_dirs=[finished_run / "best"])
    assert "holds the input checkpoint folder" in one_line(e.value)
    assert (finished_run / "epoch_0" / "model.safetensors").exists()
    with pytest.raises(ValueError) as e:
        claim_output_dir(base / "out", input_dirs=[str(base)])
    assert "inside the input checkpoint folder" in one_line(e.value)
    assert not (base / "out").exists()


def test_a_live_lock_refuses_a_second_run(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": other.pid, "host": os.uname().nodename, "started": "2026-01-01T00:00:00Z"}
        (folder / RUN_LOCK).write_text(json.dumps(lock))
        with pytest.raises(FileExistsError) as e:
            claim_output_dir(folder)
        assert f"in use by another run (pid {other.pid}" in one_line(e.value)
        assert json.loads((folder / RUN_LOCK).read_text())["pid"] == other.pid  # not taken
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = {"pid": dead.pid, "host": os.uname().nodename, "started": "2026-01-01T00:00:00Z", "existing": []}
    (folder / RUN_LOCK).write_text(json.dumps(lock))
    (folder / RUN_MANIFEST).write_text(json.dumps({"recipe": "demo", "outputs": []}))
    (folder / "step_2").mkdir()  # what the killed run wrote: recorded as its own
    with pytest.raises(FileExistsError) as e:
        claim_output_dir(folder)
    assert "already holds a run (step_2)" in one_line(e.value)
    assert f"pid {dead.pid}" in capsys.readouterr().out
    claim_output_dir(folder, overwrite=True)
    assert not (folder / "step_2").exists()
    assert json.loads((folder / RUN_LOCK).read_text())["pid"] == os.getpid()
    release_output_dir(folder)
    assert not (folder / RUN_LOCK).exists()


def test_the_lock_is_released_when_a_run_fails(tmp_path):
    "A child process claims the folder, writes an epoch and fails: its lock is gone, epoch_0 is recorded."
    folder = tmp_path / "run"
    child = (
        "import sys; from torchtune_lit.training.runs import claim_output_dir\n"
        f"out = claim_output_dir({str(folder)!r}, recipe='demo')\n"
        "(out / 'epoch_0').mkdir()\n"
        "raise SystemExit('failed')\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "failed" in result.stderr
    assert not (folder / RUN_LOCK).exists()
    manifest = json.loads((folder / RUN_MANIFEST).read_text())
    assert manifest["recipe"] == "demo" and manifest["outputs"] == ["epoch_0"]


def test_a_dpo_recipe_does_not_resume_an_sft_run(finished_run):
    with pytest.raises(ValueError) as e:
        claim_output_dir(finished_run, resume=True, recipe="lora_dpo_single_device")
    message = one_line(e.value)
    assert "full_finetune_single_device run" in message and "lora_dpo_single_device" in message


# ---- item 3: a non-finite validation loss is never best -------------------------------------------------------


def tracked(tmp_path, losses):
    folder = claim_output_dir(tmp_path / "run")
    info = start_run(folder, "demo")
    tracker = EpochTracker(folder, info)
    for epoch, val in enumerate(losses):
        (folder / f"epoch_{epoch}").mkdir()
        tracker.epoch_done(EpochResult(epoch, epoch + 1, str(folder / f"epoch_{epoch}"), 1.0, val))
    return folder, info, tracker


def test_a_nan_validation_loss_is_never_best(tmp_path):
    folder, info, tracker = tracked(tmp_path, [math.nan, 0.9, math.inf])
    assert info.best_epoch == 1 and tracker.best().epoch == 1
    assert (folder / "best").resolve() == (folder / "epoch_1").resolve()
    release_output_dir(folder)


def test_all_nan_validation_losses_leave_no_best(tmp_path):
    folder, info, tracker = tracked(tmp_path, [math.nan, math.nan])
    assert info.best_epoch is None and not (folder / "best").exists()
    summary = finish_run(folder, info, [{"step": 1, "loss": 1.0}], 1.0)
    assert "no best/: the validation loss was not finite in any epoch (nan, nan)" in summary
    release_output_dir(folder)


def test_nan_epochs_count_against_patience(tmp_path):
    folder = claim_output_dir(tmp_path / "run")
    tracker = EpochTracker(folder, start_run(folder, "demo"), early_stopping_patience=2)
    stops = []
    for epoch, val in enumerate([0.9, math.nan, math.nan]):
        (folder / f"epoch_{epoch}").mkdir()
        stops.append(tracker.epoch_done(EpochResult(epoch, epoch + 1, str(folder / f"epoch_{epoch}"), 1.0, val)))
    assert stops == [False, False, True]
    release_output_dir(folder)


# ---- item 4: resume means the same run ------------------------------------------------------------------------

SAVED = {
    "model": {"_component_": "torchtune_lit.models.tiny.tiny_lora", "lora_rank": 8},
    "dataset": {"_component_": "torchtune_lit.datasets.instruct_dataset", "data_files": "a.jsonl"},
    "tokenizer": {"path": "tok.json"},
    "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.006, "weight_decay": 0.01},
    "lr_scheduler": {"_component_": "torchtune_lit.training.get_cosine_schedule_with_warmup", "num_warmup_steps": 2},
    "batch_size": 4, "epochs": 2, "seed": 0, "output_dir": "/tmp/run",
}


def changed(**keys):
    new = json.loads(json.dumps(SAVED))
    for dotted, value in keys.items():
        *path, last = dotted.split("__")
        node = new
        for part in path:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return new


@pytest.mark.parametrize("keys, expected", [
    ({"dataset__data_files": "b.jsonl"}, "resume: dataset.data_files was 'a.jsonl', now 'b.jsonl'"),
    ({"model__lora_rank": 16}, "resume: model.lora_rank was 8, now 16"),
    ({"tokenizer__path": "other.json"}, "resume: tokenizer.path was 'tok.json', now 'other.json'"),
    ({"batch_size": 8}, "resume: batch_size was 4, now 8"),
    ({"seed": 1}, "resume: seed was 0, now 1"),
    ({"optimizer__weight_decay": 0.1}, "resume: optimizer.weight_decay was 0.01, now 0.1"),
    ({"lr_scheduler": None}, "resume: lr_scheduler._component_ was"),
])
def test_resume_refuses_a_different_run(keys, expected):
    with pytest.raises(ValueError) as e:
        check_resume_config(SAVED, changed(**keys))
    message = one_line(e.value)
    assert message.startswith(expected) and "start a new run" in message and "back." in message


def test_resume_names_every_refused_key_in_one_line():
    with pytest.raises(ValueError) as e:
        check_resume_config(SAVED, changed(batch_size=8, seed=3, optimizer__lr=0.001))
    message = one_line(e.value)
    assert "batch_size was 4, now 8" in message and "seed was 0, now 3" in message
    assert "optimizer.lr" not in message  # may change: not a reason to refuse


def test_resume_takes_the_new_learning_rate_and_schedule_and_says_so():
    lines = check_resume_config(
        SAVED, changed(optimizer__lr=0.001, lr_scheduler__num_warmup_steps=0, epochs=4,
                       resume_from_checkpoint=True, output_dir="run")
    )
    assert lines == [
        "resume: epochs was 2, now 4: the run continues with the new value",
        "resume: lr_scheduler.num_warmup_steps was 2, now 0: the run continues with the new value",
        "resume: optimizer.lr was 0.006, now 0.001: the run continues with the new value",
    ]
    refused, taken = runs.resume_changes(SAVED, changed(optimizer__lr=0.001, seed=2))
    assert refused == {"seed": (0, 2)} and taken == {"optimizer.lr": (0.006, 0.001)}


# ---- what a run cannot read is named, not guessed -------------------------------------------------------------


def test_a_damaged_manifest_is_named(finished_run):
    (finished_run / RUN_MANIFEST).write_text("{not json")
    with pytest.raises(ValueError) as e:
        claim_output_dir(finished_run, overwrite=True)
    assert f"{finished_run / RUN_MANIFEST} is not a run manifest" in one_line(e.value)
    assert (finished_run / "epoch_0" / "model.safetensors").exists()


def test_a_lock_file_that_is_not_a_runs_is_named(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / RUN_LOCK).write_text("")
    with pytest.raises(FileExistsError) as e:
        claim_output_dir(folder)
    assert f"has a lock file {RUN_LOCK} that is not a run's" in one_line(e.value)


def test_a_reused_pid_does_not_hold_the_lock(tmp_path, capsys):
    "The lock's pid now belongs to another process (it started later): the lock is stale."
    folder = tmp_path / "run"
    folder.mkdir()
    lock = {"pid": os.getppid(), "host": os.uname().nodename, "started": "2026-01-01T00:00:00Z",
            "process_start": "1"}
    (folder / RUN_LOCK).write_text(json.dumps(lock))
    claim_output_dir(folder)
    assert "is gone; taking the folder over" in capsys.readouterr().out
    release_output_dir(folder)
