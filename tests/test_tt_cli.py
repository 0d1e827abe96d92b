"""A torchtune user's habits at the `tunelit` command line: torchtune's config names with torchtune's meaning (and the
old names as aliases that say what they mean), `cp -n`, `cat --sort`, torchrun's options before the recipe name,
`tune download`'s options, and `generate` with the prompt as one string. Fast: argument parsing, and the commands
that read configs, in a subprocess or in this process."""
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchtune_lit._cli import tunelit as cli
from torchtune_lit._recipe_registry import (
    find_alias,
    find_config,
    get_aliases,
    resolve_config_path,
)

TUNELIT = str(Path(sys.executable).parent / "tunelit")

# (config name, the recipe torchtune registers it to) for the families both ship
TORCHTUNE_NAMES = [
    ("llama3_2/1B_full_single_device", "full_finetune_single_device"),
    ("llama3_2/1B_full", "full_finetune_distributed"),
    ("llama3_1/8B_full", "full_finetune_distributed"),
    ("llama3_2/1B_lora_single_device", "lora_finetune_single_device"),
    ("llama3_2/1B_lora", "lora_finetune_distributed"),
    ("llama3_2/3B_lora_single_device", "lora_finetune_single_device"),
    ("llama3_2/3B_lora", "lora_finetune_distributed"),
    ("llama3_1/8B_lora_single_device", "lora_finetune_single_device"),
    ("llama3_1/8B_lora", "lora_finetune_distributed"),
    ("llama3_2/1B_qlora_single_device", "lora_finetune_single_device"),
    ("llama3_1/8B_qlora_single_device", "lora_finetune_single_device"),
    ("llama3_3/70B_qlora_single_device", "lora_finetune_single_device"),
    ("qwen2_5/0.5B_lora_single_device", "lora_finetune_single_device"),
    ("qwen2_5/7B_lora", "lora_finetune_distributed"),
    ("qwen3/8B_lora_single_device", "lora_finetune_single_device"),
    ("qwen3/0.6B_lora", "lora_finetune_distributed"),
    ("gemma2/2B_lora_single_device", "lora_finetune_single_device"),
    ("gemma2/2B_lora", "lora_finetune_distributed"),
    ("mistral/7B_lora_single_device", "lora_finetune_single_device"),
    ("mistral/7B_lora", "lora_finetune_distributed"),
    ("phi4/14B_qlora_single_device", "lora_finetune_single_device"),
    ("llama3_1/8B_lora_dpo_single_device", "lora_dpo_single_device"),
    ("llama3_1/8B_lora_dpo", "lora_dpo_distributed"),
    ("llama3_1/8B_full_dpo", "full_dpo_distributed"),
    ("llama3_2/3B_full_single_device", "full_finetune_single_device"),
    ("llama3_2/3B_full", "full_finetune_distributed"),
    ("llama3_2/3B_qlora_single_device", "lora_finetune_single_device"),
    ("qwen2_5/0.5B_full_single_device", "full_finetune_single_device"),
    ("qwen2_5/1.5B_full", "full_finetune_distributed"),
    ("qwen3/4B_full_single_device", "full_finetune_single_device"),
    ("qwen3/8B_full", "full_finetune_distributed"),
    ("gemma2/2B_full", "full_finetune_distributed"),
    ("gemma2/2B_qlora_single_device", "lora_finetune_single_device"),
    ("mistral/7B_full", "full_finetune_distributed"),
    ("mistral/7B_qlora_single_device", "lora_finetune_single_device"),
]


def tunelit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELIT, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def in_process(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name,recipe", TORCHTUNE_NAMES)
def test_config_names_mean_what_they_mean_in_torchtune(name, recipe):
    found = find_config(name)
    assert found is not None, f"{name} is not registered"
    assert found[1].name == recipe and found[0].path.name == name.split("/")[1] + ".yaml"


def test_old_names_are_aliases_that_say_what_they_mean(caplog, monkeypatch):
    # the package logger as a fresh process has it (another test may have given it a stdout handler)
    package_logger = logging.getLogger("torchtune_lit")
    monkeypatch.setattr(package_logger, "handlers", [])
    monkeypatch.setattr(package_logger, "propagate", True)
    monkeypatch.setattr(package_logger, "disabled", False)
    # a renamed one-device config: the old name means the new one everywhere, with one line on stderr
    note = "config 'llama3_2/1B_qlora' is now called 'llama3_2/1B_qlora_single_device' (torchtune's name); using it."
    cat = tunelit("cat", "llama3_2/1B_qlora")
    assert cat.returncode == 0 and "qlora_llama3_2_1b" in cat.stdout and cat.stderr == note + "\n"
    assert cat.stdout == tunelit("cat", "llama3_2/1B_qlora_single_device").stdout
    code, out, _ = in_process("validate", "llama3_2/1B_qlora")
    assert code == 0 and out == "Config is well-formed!\n" and caplog.messages == [note]
    # a name that is now torchtune's distributed config: itself in cat/validate, its twin for the one-device recipe
    assert find_alias("llama3_2/1B_lora") is None
    assert resolve_config_path("llama3_2/1B_lora").name == "1B_lora.yaml"
    args = cli._resolve_recipe_args(["--config", "llama3_2/1B_lora", "batch_size=1"], "lora_finetune_single_device")
    assert args == ["--config", str(resolve_config_path("llama3_2/1B_lora_single_device")), "batch_size=1"]
    args = cli._resolve_recipe_args(["--config", "llama3_2/1B_lora"], "lora_finetune_distributed")
    assert args[1] == str(resolve_config_path("llama3_2/1B_lora"))


def test_ls_shows_the_aliases():
    result = tunelit("ls")
    table, old_names = result.stdout.split("\n\n")
    assert result.returncode == 0 and "llama3_2/1B_lora_single_device" in table
    rows = [line.split() for line in old_names.splitlines()]
    assert rows[0] == ["ALIAS", "MEANS"] and len(rows) == 1 + len(get_aliases())
    assert ["llama3_2/1B_qlora", "llama3_2/1B_qlora_single_device"] in rows
    assert ["llama3_2/1B_lora", "llama3_2/1B_lora_single_device", "(run", "by", "lora_finetune_single_device)"] in rows


def test_cp_no_clobber_and_make_parents(tmp_path):
    dest = tmp_path / "mine.yaml"
    dest.write_text("my edits")
    for flag in ("-n", "--no-clobber"):
        code, out, err = in_process("cp", flag, "tiny/lora", str(dest))
        assert (code, err) == (0, "") and out == f"{dest} already exists; not overwriting it (--no-clobber).\n"
        assert dest.read_text() == "my edits"
    code, _, err = in_process("cp", "tiny/lora", str(dest))             # without -n: refused, as before
    assert code == 1 and "already exists; pass --force" in err
    nested = tmp_path / "a" / "b" / "c.yaml"
    code, out, _ = in_process("cp", "llama3_2/1B_lora_single_device", str(nested), "--make-parents")
    assert code == 0 and nested.read_bytes() == resolve_config_path("llama3_2/1B_lora_single_device").read_bytes()
    code, out, _ = in_process("cp", "-n", "tiny/lora", str(tmp_path / "fresh.yaml"))   # -n copies a new file
    assert code == 0 and out.startswith("Copied tiny/lora to ")


def test_cat_sort():
    result = tunelit("cat", "tiny/lora", "--sort")
    assert result.returncode == 0, result.stderr

    def keys_sorted(node):
        if isinstance(node, dict):
            assert list(node) == sorted(node), list(node)
            for value in node.values():
                keys_sorted(value)

    printed = yaml.safe_load(result.stdout)
    keys_sorted(printed)
    assert list(printed)[:2] == ["batch_size", "checkpointer"]
    unsorted = yaml.safe_load(tunelit("cat", "tiny/lora").stdout)
    assert printed == unsorted and list(unsorted) != sorted(unsorted)   # same config, only the order differs
    recipe = tunelit("cat", "lora_finetune_single_device")
    assert recipe.returncode == 1 and recipe.stderr == (
        "tunelit cat: 'lora_finetune_single_device' is a recipe, not a config: name one of its configs "
        "(see 'tunelit ls').\n")


@pytest.mark.parametrize("launcher", [
    ["--nproc_per_node", "2"],
    ["--nproc-per-node=2", "--nnodes", "1"],
    ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d", "--rdzv_endpoint", "host:29400",
     "--rdzv_id", "job1"],
    ["--nnodes=2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29500", "--nproc_per_node", "4"],
    ["--standalone", "--nproc_per_node", "2", "--max_restarts", "0"],
])
def test_run_takes_torchrun_options_as_torchtune_passes_them(launcher):
    got = cli.split_run_args([*launcher, "lora_finetune_distributed", "--config", "tiny/lora_distributed", "a=1"])
    assert got == (launcher, "lora_finetune_distributed", ["--config", "tiny/lora_distributed", "a=1"])


def test_run_rendezvous_and_bad_torchrun_options():
    # no rendezvous given: a free local port (two runs on one machine do not collide), as torchtune does
    assert cli.with_rendezvous(["--nproc_per_node", "2"]) == ["--standalone", "--nproc_per_node", "2"]
    for given in (["--master_port", "29581"], ["--rdzv_endpoint", "h:1"], ["--nnodes=2"], ["--standalone"]):
        assert cli.with_rendezvous(given) == given
    code, _, err = in_process("run", "--nproc_per_nod", "2", "lora_finetune_distributed", "--config", "tiny/lora")
    assert code == 1 and len(err.splitlines()) == 1 and "Did you mean '--nproc_per_node'?" in err
    code, _, err = in_process("run", "-m", "lora_finetune_distributed", "--config", "tiny/lora")
    assert code == 1 and "-m changes what torchrun starts" in err
    code, _, err = in_process("run", "--nproc_per_node", "2", "lora_finetune_single_device", "--config", "tiny/lora")
    assert code == 1 and err.strip().endswith("Use 'lora_finetune_distributed'.")


def test_download_takes_tune_download_options(tmp_path, monkeypatch):
    parser = cli.build_parser()
    args = parser.parse_args(["download", "meta-llama/Llama-3.2-1B-Instruct", "--output-dir", "/tmp/x",
                              "--ignore-patterns", "original/consolidated.00.pth", "--hf-token", "hf_x",
                              "--source", "huggingface"])
    assert (args.output_dir, args.ignore_patterns, args.hf_token, args.source) == (
        "/tmp/x", ["original/consolidated.00.pth"], "hf_x", "huggingface")
    args = parser.parse_args(["download", "google/gemma/pyTorch/2b", "--source", "kaggle", "--kaggle-username", "u",
                              "--kaggle-api-key", "k"])
    assert (args.source, args.kaggle_username, args.kaggle_api_key) == ("kaggle", "u", "k")
    # what snapshot_download is asked for, and the original_repo_id.json written next to the files (no network)
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        Path(kwargs["local_dir"]).mkdir(parents=True)
        return str(kwargs["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    code, out, err = in_process("download", "org/model", "--output-dir", str(tmp_path / "m"), "--hf-token",
                                "hf_secret", "--ignore-patterns", "*.pth")
    assert code == 0, err
    assert calls == [("org/model", {"local_dir": tmp_path / "m", "allow_patterns": None,
                                    "ignore_patterns": ["*.pth"], "token": "hf_secret"})]
    assert json.loads((tmp_path / "m" / "original_repo_id.json").read_text()) == {"repo_id": "org/model"}
    assert "hf_secret" not in out + err and out == f"Downloaded org/model to {tmp_path / 'm'}\n"


def test_download_failures_are_one_line_and_never_show_the_token(tmp_path):
    result = tunelit("download", "meta-llama/Llama-3.2-1B", "--output-dir", str(tmp_path / "m"), "--hf-token",
                     "hf_secret_never_printed", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and result.stderr == (
        "tunelit download: cannot reach the Hugging Face Hub (HF_HUB_OFFLINE is set), so meta-llama/Llama-3.2-1B "
        "was not downloaded.\n")
    assert "hf_secret_never_printed" not in result.stdout + result.stderr
    bad_source = tunelit("download", "org/m", "--source", "modelscope")
    assert bad_source.returncode == 2 and "invalid choice: 'modelscope'" in bad_source.stderr
    try:
        import kagglehub  # noqa: F401
    except ImportError:
        kaggle = tunelit("download", "google/gemma/pyTorch/2b", "--source", "kaggle", "--kaggle-api-key", "k_secret")
        assert kaggle.returncode == 1 and kaggle.stderr == (
            "tunelit download: --source kaggle needs the kagglehub package: pip install kagglehub.\n")


def test_generate_takes_the_prompt_as_one_string(tmp_path):
    "torchtune's `prompt=\"...\"`: the user's turn, the same tokens as `prompt.user=` without a system message."
    from torchtune_lit import config
    from torchtune_lit.recipes.generate import prompt_tokens

    common = ["max_new_tokens=3", "temperature=0"]
    code, out, err = in_process("run", "generate", "--config", "tiny/generate", "prompt=Tell me a joke.",
                                f"output_dir={tmp_path / 'string'}", *common)
    assert code == 0, err
    written = json.loads((tmp_path / "string" / "generation.json").read_text())
    assert out.splitlines()[0] == written["text"] and len(written["new_tokens"]) <= 3
    string = config.load_config("tiny/generate", ["prompt=Tell me a joke."])
    chat = config.load_config("tiny/generate", ["~prompt.system", "prompt.user=Tell me a joke."])
    tokenizer = config.instantiate(string.tokenizer)
    assert prompt_tokens(string, tokenizer) == prompt_tokens(chat, tokenizer)
    assert written["prompt_tokens"] == len(prompt_tokens(chat, tokenizer))
    # and the chat form with a system message still works
    both = config.load_config("tiny/generate", ["prompt.system=Be brief.", "prompt.user=Tell me a joke."])
    assert len(prompt_tokens(both, tokenizer)) > len(prompt_tokens(chat, tokenizer))
