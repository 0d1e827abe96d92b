"""`enable_activation_checkpointing` in the recipes: the same losses as without it (recomputation changes memory, not
mathematics), through the installed `tunelit` as a user runs it."""
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_lit.training import read_jsonl

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=4", "progress_bar=false", "preflight=false"]


@pytest.mark.parametrize("recipe,config", [("lora_finetune_single_device", "tiny/lora"),
                                           ("full_finetune_single_device", "tiny/full")])
def test_activation_checkpointing_keeps_the_losses(tmp_path, recipe, config):
    losses = {}
    for checkpointing in (False, True):
        out = tmp_path / str(checkpointing)
        result = subprocess.run([TUNELIT, "run", recipe, "--config", config, f"output_dir={out}", *COMMON,
                                 f"enable_activation_checkpointing={str(checkpointing).lower()}"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        losses[checkpointing] = [row["loss"] for row in read_jsonl(out / "log.jsonl")]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
