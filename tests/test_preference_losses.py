"""KTO and ORPO through the DPO recipe, by the real `tunelit` command on the tiny preference pairs: each trains
(the loss falls) and generalises to the 32 held-out pairs (KTO's held-out reward accuracy is above chance; ORPO's
held-out loss, its SFT term included, is below the untrained first step's). Their values against TRL's code are
checked in nbs/64_kto_orpo.ipynb."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def run_dpo_recipe(output_dir: Path, loss: str) -> list[dict]:
    result = subprocess.run(
        [TUNELIT, "run", "lora_dpo_single_device", "--config", "tiny/dpo", f"output_dir={output_dir}",
         f"loss._component_=torchtune_lit.rlhf.loss.{loss}", "loss.beta=0.1", "progress_bar=false", "preflight=false"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{loss}: loss" in result.stdout
    return [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", ["KTOLoss", "ORPOLoss"])
def test_kto_and_orpo_train_in_the_dpo_recipe(tmp_path, loss):
    log = run_dpo_recipe(tmp_path / loss, loss)
    assert len(log) == 20  # 160 pairs, batch 8, one epoch
    last_four = sum(r["loss"] for r in log[-4:]) / 4
    assert last_four < 0.95 * log[0]["loss"], [r["loss"] for r in log]
    validated = [r for r in log if "val_loss" in r]
    assert [r["step"] for r in validated] == [12]
    if loss == "KTOLoss":
        assert log[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0) per answer
        assert validated[0]["val_rewards/accuracy"] > 0.5
    else:
        assert validated[0]["val_loss"] < 0.9 * log[0]["loss"]
