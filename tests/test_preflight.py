"""`tunelit preflight` as a user runs it: a correct config is clean (exit 0); a broken one names each problem (exit 1)."""
import shutil
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


def test_first_loss_warning_fires_for_a_real_config_shaped_run(tmp_path):
    """Real configs say `checkpoint_files: null` (every weight file of the folder): the first-loss check must treat
    that as pretrained weights. An output layer scrambled as a wrong key map would (rows permuted, scaled) gives a
    first loss far above ln(vocab), and the run says so on its first step."""
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    import torchtune_lit

    base = tmp_path / "base"
    shutil.copytree(Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "base", base)
    weights = load_file(base / "model.safetensors")
    head = weights["lm_head.weight"]
    order = torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(0))
    weights["lm_head.weight"] = (head[order].float() * 6).to(head.dtype).contiguous()
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    tunelit = str(Path(sys.executable).parent / "tunelit")
    result = subprocess.run(
        [tunelit, "run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={tmp_path / 'run'}",
         f"checkpointer.checkpoint_dir={base}", "checkpointer.checkpoint_files=null", "epochs=1",
         "max_steps_per_epoch=1", "progress_bar=false", "preflight=false", "run_val_every_n_steps=null"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "WARNING: first loss" in result.stdout and "is far above ln(vocab) = 7.62" in result.stdout
