"""A recipe is the loop: copy one with `tunelit cp`, edit a line of its loop as plain text, run the copy with
`tunelit run ./my_recipe.py`, and the edit takes effect — on one device and under `torchrun` with two processes.

The edit adds a constant of 1000 per trained token to the summed loss of each micro-batch. Its gradient is zero, so
the run trains exactly as before while every logged loss (a mean per trained token) grows by exactly 1000: the edit
is visible in the log, and nothing else moved."""
import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")
LOSS_LINE = "loss, tokens = training.summed_loss(loss_fn, logits, labels)\n"
EDIT = "loss = loss + 1000.0 * tokens  # my edit: a constant 1000 per trained token\n"


def tunelit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def copy_and_edit(recipe: str, folder: Path) -> str:
    "`tunelit cp RECIPE my_recipe.py`, then add the constant after the loss line (which must appear exactly once)."
    tunelit("cp", recipe, "my_recipe.py", cwd=folder)
    path = folder / "my_recipe.py"
    lines = path.read_text().splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip() + "\n" == LOSS_LINE]
    assert len(found) == 1, f"{recipe}: the loss line to edit is not in the copy exactly once"
    indent = lines[found[0]][: len(lines[found[0]]) - len(lines[found[0]].lstrip())]
    lines.insert(found[0] + 1, indent + EDIT)  # right after it, at its indentation
    path.write_text("".join(lines))
    return "./my_recipe.py"


def losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "log.jsonl").read_text().splitlines()]


def test_edited_single_device_copy_runs_its_own_loop(tmp_path):
    common = ["--config", "tiny/lora", "epochs=1", "max_steps_per_epoch=3", "progress_bar=false", "preflight=false",
              "~validation_dataset"]
    tunelit("run", "lora_finetune_single_device", *common, f"output_dir={tmp_path / 'builtin'}", cwd=tmp_path)
    recipe = copy_and_edit("lora_finetune_single_device", tmp_path)
    tunelit("run", recipe, *common, f"output_dir={tmp_path / 'edited'}", cwd=tmp_path)
    builtin, edited = losses(tmp_path / "builtin"), losses(tmp_path / "edited")
    assert len(builtin) == len(edited) == 3
    for theirs, ours in zip(builtin, edited):
        assert abs(ours - (theirs + 1000.0)) < 1e-3, (builtin, edited)
    # a zero gradient: the adapters trained by the copy are the built-in recipe's
    adapter = "epoch_0/adapter/adapter_model.safetensors"
    before, after = load_file(tmp_path / "builtin" / adapter), load_file(tmp_path / "edited" / adapter)
    assert before.keys() == after.keys()
    for key in before:
        assert (before[key] - after[key]).abs().max() < 1e-6, key


def test_edited_distributed_copy_runs_its_own_loop_on_two_processes(tmp_path):
    recipe = copy_and_edit("full_finetune_distributed", tmp_path)
    tunelit("run", "--nproc_per_node", "2", "--master_port", "29581", recipe, "--config", "tiny/full_distributed",
            "epochs=1", "max_steps_per_epoch=2", "progress_bar=false", "preflight=false", "~validation_dataset",
            f"output_dir={tmp_path / 'edited'}", cwd=tmp_path)
    edited = losses(tmp_path / "edited")
    # the tiny base's cross-entropy on its task is ~11 nats at the start; the copy's loss carries the 1000
    assert len(edited) == 2 and all(1000.0 < loss < 1000.0 + 20.0 for loss in edited), edited
    assert (tmp_path / "edited" / "epoch_0" / "model.safetensors").is_file()
