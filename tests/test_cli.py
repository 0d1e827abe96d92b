"""The `tunelit` console script, as a user runs it: a real subprocess, real files, real exit codes. Only the check of
every built-in config calls the script's `main()` in this process, the function the executable runs: 66 fresh
interpreters there would cost ~4 s each, most of it importing PyTorch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from torchtune_lit._cli.tunelit import main
from torchtune_lit._recipe_registry import get_all_recipes, resolve_config_path

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def tunelit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELIT, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, one_line: bool = True) -> None:
    "Exit code 1, no traceback, one line on stderr (a list for `validate`) containing every fragment."
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip() and "Failed to load" not in l]
    assert len(lines) == 1 or not one_line, result.stderr
    for fragment in fragments:
        assert fragment in "\n".join(lines), (fragment, lines)


def test_ls_lists_every_recipe_and_config():
    result = tunelit("ls")
    assert result.returncode == 0
    for recipe in get_all_recipes():
        assert recipe.name in result.stdout
        for config in recipe.configs:
            assert config.name in result.stdout


@pytest.mark.parametrize("config", [c.name for r in get_all_recipes() for c in r.configs])
def test_every_builtin_config_validates(config, capsys):
    code = main(["validate", "--config", config])
    printed = capsys.readouterr()
    assert code == 0 and "Config is well-formed!" in printed.out, printed.err


def test_run_trains_and_writes_log_and_model(tmp_path):
    out = tmp_path / "run"
    result = tunelit("run", "full_finetune_single_device", "--config", "tiny/full", "epochs=1", "max_steps_per_epoch=6",
                     f"output_dir={out}", "progress_bar=false")
    assert result.returncode == 0, result.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))
    assert {"step", "loss", "lr", "tokens_per_second", "tokens"} <= set(log[0])
    assert log[-1]["loss"] < log[0]["loss"]
    state = load_file(out / "epoch_0" / "model.safetensors")            # Hugging Face keys
    assert "model.layers.0.self_attn.q_proj.weight" in state and len(state) == 2 + 4 * 9 + 1


def test_copied_recipe_and_config_run_as_user_files(tmp_path):
    assert tunelit("cp", "lora_finetune_single_device", str(tmp_path / "my_recipe.py")).returncode == 0
    assert tunelit("cp", "tiny/lora", str(tmp_path / "my.yaml")).returncode == 0
    assert (tmp_path / "my.yaml").read_bytes() == resolve_config_path("tiny/lora").read_bytes()
    result = tunelit("run", str(tmp_path / "my_recipe.py"), "--config", str(tmp_path / "my.yaml"),
                     "max_steps_per_epoch=1", "epochs=1", f"output_dir={tmp_path / 'out'}", "progress_bar=false",
                     "+my_note=hello")
    assert result.returncode == 0, result.stderr
    # a key the copy does not declare in its CONFIG_KEYS is named, since setting it changes nothing
    assert "my_recipe does not read 'my_note'" in result.stderr
    assert len((tmp_path / "out" / "log.jsonl").read_text().splitlines()) == 1
    help_ = tunelit("run", str(tmp_path / "my_recipe.py"), "--help")  # read from the copy, not run
    assert help_.returncode == 0 and any(l.startswith("  batch_size ") for l in help_.stdout.splitlines())
    assert (tmp_path / "out" / "epoch_0" / "adapter" / "adapter_model.safetensors").is_file()


def test_cp_refuses_to_overwrite(tmp_path):
    (tmp_path / "x.yaml").write_text("keep me")
    assert_one_line_error(tunelit("cp", "tiny/full", str(tmp_path / "x.yaml")), "already exists", "--force")
    assert (tmp_path / "x.yaml").read_text() == "keep me"


def test_cat_applies_overrides():
    result = tunelit("cat", "--config", "tiny/full", "batch_size=2", "optimizer.lr=5e-4", "~clip_grad_norm")
    assert result.returncode == 0
    assert "batch_size: 2" in result.stdout and "lr: 0.0005" in result.stdout
    assert "clip_grad_norm" not in result.stdout


def test_unknown_recipe():
    assert_one_line_error(tunelit("run", "full_finetune_singel_device", "--config", "tiny/full"),
                          "Unknown recipe", "'full_finetune_single_device'")


def test_missing_config(tmp_path):
    assert_one_line_error(tunelit("run", "full_finetune_single_device", "--config", str(tmp_path / "nope.yaml")),
                          "does not exist")
    assert_one_line_error(tunelit("validate", "--config", "tiny/fll"), "Unknown config", "'tiny/full'")


def test_bad_override():
    assert_one_line_error(tunelit("run", "full_finetune_single_device", "--config", "tiny/full", "epochs"),
                          "Bad override 'epochs'", "no '='")
    assert_one_line_error(tunelit("validate", "--config", "tiny/full", "~nothing_here"), "no key 'nothing_here'")


def test_unknown_component(tmp_path):
    result = tunelit("run", "full_finetune_single_device", "--config", "tiny/full", f"output_dir={tmp_path}",
                     "model._component_=torchtune_lit.models.tiny.tiny_lama")
    assert_one_line_error(result, "model._component_", "'tiny_llama'")
    assert_one_line_error(tunelit("validate", "--config", "tiny/full", "optimizer.lr_rate=1"),
                          "optimizer: torch.optim.AdamW has no argument 'lr_rate'", "Its arguments are: params, lr,")
    both = tunelit("validate", "--config", "tiny/full", "optimizer.lr_rate=1", "model._component_=torch.nn.Lineer")
    assert both.returncode == 1 and both.stderr.startswith("tunelit validate: 2 problems in the config:")
    assert len(both.stderr.splitlines()) == 3  # one line per problem


def test_accumulation_beyond_the_data_is_refused(tmp_path):
    "tiny/lora has 150 batches an epoch: accumulating 1000 of them would run no optimizer step and save the base model."
    from torchtune_lit.config import _asset_path

    batches = len(Path(_asset_path("tiny/column_types_train.jsonl")).read_text().splitlines()) // 8
    result = tunelit("run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={tmp_path}",
                     "gradient_accumulation_steps=1000")
    assert_one_line_error(result, "no optimizer step per epoch", f"{batches} batches",
                          "Lower gradient_accumulation_steps")
    assert not list(tmp_path.glob("epoch_*"))                 # nothing saved


def test_single_device_recipe_refuses_torchrun():
    assert_one_line_error(tunelit("run", "--nproc_per_node", "2", "full_finetune_single_device", "--config", "tiny/full"),
                          "single device")


def test_download_without_hub_is_one_line(tmp_path):
    result = tunelit("download", "meta-llama/Llama-3.2-1B", "--output-dir", str(tmp_path / "m"),
                     env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(result, "cannot reach the Hugging Face Hub")
    result = tunelit("download", "meta-llama/Llama-3.2-1B", "--output-dir", str(tmp_path / "m"),
                     env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_secret_never_printed"})
    assert_one_line_error(result, "cannot reach the Hugging Face Hub")
    assert "hf_secret_never_printed" not in result.stderr + result.stdout


def test_sanity_flag_reports_whether_the_pipeline_can_learn(tmp_path):
    temp = {"TMPDIR": str(tmp_path)}  # the throwaway run's folder must be gone afterwards
    result = tunelit("run", "lora_finetune_single_device", "--config", "tiny/lora", "--sanity", env=temp)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the pipeline can learn" in result.stdout
    frozen = tunelit("run", "lora_finetune_single_device", "--config", "tiny/lora", "--sanity", "optimizer.lr=0.0",
                     env=temp)
    assert frozen.returncode == 1 and "did NOT go near zero" in frozen.stdout
    assert not list(tmp_path.glob("tunelit_sanity_*")), list(tmp_path.iterdir())


def test_torchtune_forms_of_the_commands():
    "As torchtune's `tune`: the config first for validate and cat, and `run RECIPE --help` for the keys it reads."
    assert tunelit("validate", "tiny/lora", "batch_size=4").stdout.strip() == "Config is well-formed!"
    cat = tunelit("cat", "tiny/lora", "batch_size=4")
    assert cat.returncode == 0 and "\nbatch_size: 4\n" in cat.stdout
    help_ = tunelit("run", "lora_finetune_single_device", "--help")
    assert help_.returncode == 0, help_.stderr
    lines = help_.stdout.splitlines()
    assert lines[0] == "usage: tunelit run lora_finetune_single_device --config CONFIG [key=value ...]"
    model_line = [l for l in lines if l.startswith("  model ")][0]
    # the recipe's declared default, then tiny/lora.yaml's component
    assert model_line.split()[1:3] == ["required", "torchtune_lit.models.tiny.lora_tiny_llama"]
    assert [l for l in lines if l.startswith("  batch_size ")][0].endswith("samples per micro-batch (per process)")
    accumulation = [l for l in lines if l.startswith("  gradient_accumulation_steps ")][0]
    assert accumulation.split()[1] == "1"  # the default the recipe's code uses when a config omits the key


def test_lora_without_torchao_import():
    "Building and loading a LoRA model, and validating a config, need no torchao (importing it costs about a second)."
    code = ("import sys, torchtune_lit.config as c, torchtune_lit.training as t;"
            "cfg = c.load_config('tiny/lora'); c.validate(cfg);"
            "m = c.instantiate(cfg.model); s = c.instantiate(cfg.checkpointer).load_checkpoint()['model'];"
            "t.load_model_state_dict(m, s, allowed_missing=[k for k in m.state_dict() if 'lora' in k]);"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'torchao'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]
