"""Knowledge distillation beyond one full-weight student: the distributed recipe under torchrun (two Gloo processes at
batch 2 train like one process at batch 4) and a LoRA student distilled from a fine-tuned teacher (tiny/kd_lora)."""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_two_processes_match_one_in_kd(tmp_path):
    common = ["epochs=1", "max_steps_per_epoch=6", "shuffle=true", "progress_bar=false", "run_val_every_n_steps=3",
              "max_validation_batches=null"]
    run("knowledge_distillation_single_device", "--config", "tiny/kd", "batch_size=4",
        f"output_dir={tmp_path / 'single'}", *common)
    run("--nproc_per_node", "2", "--master_port", "29535", "knowledge_distillation_distributed", "--config",
        "tiny/kd_distributed", "batch_size=2", f"output_dir={tmp_path / 'multi'}", *common)
    single, multi = (records(tmp_path / side / "log.jsonl") for side in ("single", "multi"))
    assert len(single) == len(multi) == 6
    for key in ("loss", "ce_loss", "kd_loss"):
        for a, b in zip(single, multi):
            assert abs(a[key] - b[key]) <= 1e-3 * abs(a[key]), (key, a[key], b[key])
    val = [[r["val_loss"] for r in side if "val_loss" in r] for side in (single, multi)]
    assert len(val[0]) == 2 and all(abs(x - y) <= 1e-3 * x for x, y in zip(*val)), val
    kl_single, kl_multi = (json.loads((tmp_path / side / "kl_to_teacher.json").read_text())
                           for side in ("single", "multi"))
    assert abs(kl_single["before"] - kl_multi["before"]) <= 1e-4 * kl_single["before"]
    assert abs(kl_single["after"] - kl_multi["after"]) <= 1e-3 * kl_single["after"]
    assert kl_multi["after"] < kl_multi["before"]
    ours, theirs = (load_file(tmp_path / side / "epoch_0" / "model.safetensors") for side in ("multi", "single"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)


def test_lora_student_distils_from_a_fine_tuned_teacher(tmp_path):
    teacher = tmp_path / "teacher"
    run("lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={teacher}", "epochs=1",
        "max_steps_per_epoch=60", "progress_bar=false", "validation_dataset=null")
    out = tmp_path / "kd_lora"
    result = run("knowledge_distillation_single_device", "--config", "tiny/kd_lora", f"output_dir={out}",
                 f"teacher_checkpointer.checkpoint_dir={teacher / 'epoch_0'}", "max_steps_per_epoch=20",
                 "progress_bar=false")
    assert "Saved the student" in result.stdout
    kl = json.loads((out / "kl_to_teacher.json").read_text())
    assert kl["after"] < 0.5 * kl["before"], kl                 # the student moved toward the teacher
    assert (out / "epoch_0" / "adapter" / "adapter_config.json").is_file()
    base = load_file(Path(__file__).resolve().parents[1] / "torchtune_lit" / "assets" / "tiny" / "base" /
                     "model.safetensors")
    merged = load_file(out / "epoch_0" / "model.safetensors")
    moved = [k for k in base if not torch.equal(base[k], merged[k])]
    assert moved and all("proj" in k for k in moved), moved     # only the adapted projections changed
