"""FSDP2 under torchrun on CPU (Gloo): two processes at batch 2 train exactly like one process at batch 4."""
import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=6", "shuffle=false", "progress_bar=false", "~lr_scheduler"]


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    single = subprocess.run([TUNELIT, "run", "full_finetune_single_device", "--config", "tiny/full", "batch_size=4",
                             f"output_dir={tmp_path / 'single'}", *COMMON], capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29517", "full_finetune_distributed",
                            "--config", "tiny/full_distributed", "batch_size=2", f"output_dir={tmp_path / 'multi'}",
                            *[c for c in COMMON if c != "progress_bar=false"]], capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = losses(tmp_path / "single" / "log.jsonl"), losses(tmp_path / "multi" / "log.jsonl")
    print("single:", [f"{x:.5f}" for x in a]); print("FSDP2 x2:", [f"{x:.5f}" for x in b])
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-3 * abs(x), (a, b)
    # the gathered full state dict was written in Hugging Face format and loads in transformers
    saved = tmp_path / "multi" / "epoch_0"
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    single_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "epoch_0")
    for (name, p), (_, q) in zip(model.named_parameters(), single_model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-4, rtol=1e-3, msg=name)
