"""The README's main job, end to end: LoRA-fine-tune the shipped tiny base on the column-type task and measure the
held-out accuracy before and after, through the installed `tunelit` command (about a minute on two cores)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def run(*args: str) -> str:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_lora_main_job_beats_the_base_and_writes_loadable_outputs(tmp_path):
    run("eval_accuracy", "--config", "tiny/eval", f"output_dir={tmp_path / 'before'}")
    run("lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={tmp_path / 'lora'}", "progress_bar=false")
    folder = tmp_path / "lora" / "epoch_3"
    run("eval_accuracy", "--config", "tiny/eval", f"checkpointer.checkpoint_dir={folder}", f"output_dir={tmp_path / 'after'}")
    before = json.loads((tmp_path / "before" / "eval.json").read_text())["accuracy"]
    after = json.loads((tmp_path / "after" / "eval.json").read_text())["accuracy"]
    print(f"held-out accuracy: base {before:.1%}, after LoRA {after:.1%}")
    assert before <= 0.05 and after >= 0.35, (before, after)

    log = [json.loads(l) for l in (tmp_path / "lora" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 240 and log[-1]["loss"] < 0.5 * log[0]["loss"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder)
    from torchtune_lit.config import _asset_path
    base = transformers.AutoModelForCausalLM.from_pretrained(_asset_path("tiny/base"))
    with_adapter = peft.PeftModel.from_pretrained(base, folder / "adapter")
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(tokens).logits, merged(tokens).logits, atol=1e-4, rtol=1e-4)
