"""`tunelit preflight` as a user runs it: a correct config is clean (exit 0); a broken one names each problem (exit 1)."""
import subprocess
import sys
from pathlib import Path

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def preflight(*args):
    return subprocess.run([TUNELIT, "preflight", "--config", *args], capture_output=True, text=True, timeout=300)


def test_main_job_config_is_clean(tmp_path):
    result = preflight("tiny/lora", f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Nothing suspicious found." in result.stdout and "155,648 of 4,352,256 parameters trainable" in result.stdout
    assert (tmp_path / "preflight.json").is_file()


def test_broken_config_names_each_problem(tmp_path):
    result = preflight("tiny/lora", f"output_dir={tmp_path}", "tokenizer.max_seq_len=40", "model.vocab_size=1024")
    assert result.returncode == 1
    out = result.stdout
    from torchtune_lit.config import _asset_path

    rows = len(Path(_asset_path("tiny/column_types_train.jsonl")).read_text().splitlines())
    assert f"{rows} samples (100.0%) are longer than max_seq_len=40" in out
    assert "samples have no token to train on" in out
    assert "the tokenizer has 2048 tokens but the model's embedding has 1024 rows" in out
    assert "shape-mismatched checkpoint keys" in out


def test_recipe_prints_and_saves_the_report(tmp_path):
    result = subprocess.run([TUNELIT, "run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={tmp_path}",
                             "max_steps_per_epoch=1", "epochs=1", "progress_bar=false"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Preflight report" in result.stdout and (tmp_path / "preflight.json").is_file()
