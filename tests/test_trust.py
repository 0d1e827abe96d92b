"""Trust comes from the person, never from the config (issue #39): a config cannot widen the component allowlist
(neither with an `allowed_components` key nor a `+allowed_components=` override), the default allowlist holds
components only (no function that writes, deletes or launches), hyper-parameters are finite, a YAML alias bomb is
refused at once, and the safety refusals of Jinja and `torch.load` reach the user as one line.

Each hostile case asserts the contract of `tunelit`: exit code != 0, exactly one line on stderr, no traceback, and
nothing executed or deleted (a marker file that a gadget would create stays absent, a sentinel file survives).
Most cases call the console script's `main()` in this process (the function the executable runs); the alias bomb
runs the real executable under a timeout, since a regression would hang."""
import contextlib
import io
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchtune_lit
import torchtune_lit.config as config
from torchtune_lit._cli.tunelit import error_line, main

ASSETS = Path(torchtune_lit.__file__).parent / "assets" / "tiny"
LORA_YAML = (Path(torchtune_lit.__file__).parent / "recipes/configs/tiny/lora.yaml").read_text()
TUNELIT = str(Path(sys.executable).parent / "tunelit")
FAST = ["epochs=1", "max_steps_per_epoch=2", "progress_bar=false", "run_val_every_n_steps=null", "preflight=false"]


def _reset_grants() -> None:
    config.trust_all_components(False)
    if hasattr(config, "allow_components"):
        config.allow_components(())


def cli(*argv: str, env: dict | None = None) -> tuple[int, str, str]:
    "`tunelit argv...` through the console script's main(): (exit code, stdout, stderr); grants reset around it."
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    _reset_grants()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        _reset_grants()
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def refused(*argv: str, env: dict | None = None) -> str:
    "Run a command that must fail; return its one stderr line after checking the contract."
    code, _, err = cli(*argv, env=env)
    lines = [line for line in err.splitlines() if line.strip() and "Failed to load" not in line]
    assert code != 0, f"{argv} succeeded"
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"tunelit {argv[0]}: "), lines[0]
    return lines[0]


def gadget_config(tmp_path: Path, marker: Path, allow_line: str = "") -> Path:
    "tiny/lora with a metric_logger that would run `touch marker` through yaml.unsafe_load."
    path = tmp_path / "gadget.yaml"
    stream = f"!!python/object/apply:os.system ['touch {marker}']"
    path.write_text(LORA_YAML + f"\nmetric_logger:\n  _component_: yaml.unsafe_load\n  stream: \"{stream}\"\n"
                    + allow_line)
    return path


def lora_run(config_path, output_dir: Path, *overrides: str) -> list[str]:
    return ["run", "lora_finetune_single_device", "--config", str(config_path), f"output_dir={output_dir}", *FAST,
            *overrides]


# --- 1. trust is widened only by what the person types --------------------------------------------------------------

def test_the_unsafe_load_gadget_is_refused_without_a_grant(tmp_path):
    marker = tmp_path / "ran"
    evil = gadget_config(tmp_path, marker)
    line = refused("validate", evil)
    assert "'yaml.unsafe_load' is not allowed" in line and "--allow-components" in line
    assert not marker.exists()


def test_a_config_key_allowed_components_is_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = gadget_config(tmp_path, marker, "allowed_components: [yaml]\n")
    line = refused("validate", evil)
    assert "allowed_components" in line and "--allow-components" in line, line
    line = refused(*lora_run(evil, tmp_path / "out"))
    assert "allowed_components" in line and "--allow-components" in line, line
    stdlib = tmp_path / "stdlib.yaml"
    stdlib.write_text(LORA_YAML + "\nallowed_components: [subprocess]\n")
    line = refused("validate", stdlib)
    assert "a config cannot allow components itself" in line and "--trust-config" in line, line
    assert "--allow-components" not in line  # the flag would refuse subprocess
    assert not marker.exists()


def test_an_allowed_components_override_is_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = gadget_config(tmp_path, marker)
    for override in ("+allowed_components=[yaml]", "allowed_components=[yaml]"):
        line = refused("validate", evil, override)
        assert "allowed_components" in line and "--allow-components" in line, line
        line = refused(*lora_run(evil, tmp_path / "out", override))
        assert "allowed_components" in line and "--allow-components" in line, line
    assert not marker.exists()


def _other_run(tmp_path: Path) -> Path:
    "A finished run's folder, with a sentinel weight file that overwrite=true would delete."
    other = tmp_path / "other_run"
    (other / "best").mkdir(parents=True)
    (other / "best" / "model.safetensors").write_text("sentinel")
    (other / "log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return other


def test_claim_output_dir_as_a_nested_argument_is_refused(tmp_path):
    other = _other_run(tmp_path)
    gadget = (f"model.lora_rank={{_component_: torchtune_lit.training.runs.claim_output_dir, "
              f"output_dir: {other}, overwrite: true}}")
    line = refused("validate", "tiny/lora", gadget)
    assert "model.lora_rank._component_" in line and "claim_output_dir" in line, line
    line = refused(*lora_run("tiny/lora", tmp_path / "out", gadget))
    assert "claim_output_dir" in line, line
    assert (other / "best" / "model.safetensors").read_text() == "sentinel"
    assert (other / "log.jsonl").exists()


NEVER = [
    "torchtune_lit.training.runs.claim_output_dir",
    "torchtune_lit.training.atomic.atomic_folder",
    "torchtune_lit.training.checkpointing.write_hf_weights",
    "torchtune_lit.training.save_step_checkpoint",
    "torchtune_lit.training.FullModelHFCheckpointer.save_checkpoint",  # a method: reached through its class
    "torchtune_lit.training.metric_logging.JsonlLogger",  # appends to any file it is given
    "torchtune_lit.datasets._tiny_world.build_tiny_world",  # writes files
    "torchtune_lit.rlhf._reward.save_reward_model",
    "torchtune_lit.tabular.save_table_model",
    "torchtune_lit.recipes.full_finetune_single_device.main",
    "torchtune_lit._cli.tunelit.main",
    "torchtune_lit.config.trust_all_components",
    "torchtune_lit.config.allow_components",
    "torch.save",
    "torch.hub.load",
    "torch.nn.init.zeros_",
    "torch.nn.functional.cross_entropy",
    "torch.optim.AdamW.step",
    "torchao.prototype.quantization.codebook_utils.codebook_utils.save_quantized_data",
    "torchtune_lit.training.runs.shutil.rmtree",
]


@pytest.mark.parametrize("path", NEVER)
def test_writers_and_launchers_are_not_components(path):
    with pytest.raises(config.ConfigError) as e:
        config.get_component(path, key="model")
    message = str(e.value)
    assert f"model._component_ = {path!r} is not allowed" in message and len(message.splitlines()) == 1


COMPONENTS = [  # what the shipped configs, the chapters and the tests build
    "torch.optim.AdamW", "torch.optim.SGD", "torch.nn.Linear", "torch.nn.ReLU", "torch.nn.CrossEntropyLoss",
    "torchao.optim.AdamW8bit", "torchao.quantization.Int8WeightOnlyConfig",
    "torchao.quantization.Int8DynamicActivationInt8WeightConfig",
    "torchtune_lit.training.FullModelHFCheckpointer", "torchtune_lit.training.metric_logging.TensorBoardLogger",
    "torchtune_lit.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "torchtune_lit.training.quantization.Int8DynActInt4WeightQATQuantizer",
    "torchtune_lit.models.tiny.lora_tiny_llama", "torchtune_lit.datasets.instruct_dataset",
    "torchtune_lit.rlhf.loss.DPOLoss", "torchtune_lit.rlhf.rewards.FormatReward",
    "torchtune_lit.modules.loss.CEWithChunkedOutputLoss", "torchtune_lit.tokenizers.HuggingFaceModelTokenizer",
    "torchtune_lit.tabular.SyntheticTablePrior",
]


@pytest.mark.parametrize("path", COMPONENTS)
def test_components_stay_reachable(path):
    assert callable(config.get_component(path))


def test_validate_names_what_a_grant_lets_in(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(LORA_YAML + "\nmy_parser:\n  _component_: yaml.safe_load\n  stream: 'a: 1'\n")
    line = refused("validate", mine)
    assert "'yaml.safe_load' is not allowed" in line and "--allow-components yaml" in line, line
    for argv, env in [((mine, "--allow-components", "yaml"), None),
                      ((mine, "--allow-components", "yaml", "batch_size=2"), None),
                      ((mine,), {"TUNELIT_ALLOW_COMPONENTS": "yaml"}),
                      ((mine, "--trust-config"), None)]:
        code, out, err = cli("validate", *argv, env=env)
        assert code == 0, err
        assert "my_parser: yaml.safe_load" in out and "outside the default set" in out, out
        assert "Config is well-formed!" in out and len(out.splitlines()) == 2, out  # only the one outside
    # a grant that would open the standard library or all of torch is refused even from the person
    line = refused("validate", mine, "--allow-components", "os")
    assert "--trust-config" in line


def test_the_python_api_takes_the_grant_as_an_argument():
    node = {"_component_": "yaml.safe_load", "stream": "a: 1"}
    with pytest.raises(config.ConfigError, match="--allow-components"):
        config.instantiate(node)
    assert config.instantiate(node, allowed=("yaml",)) == {"a": 1}
    config.validate({"p": node}, allowed=("yaml",))


def test_no_nested_component_is_built_before_every_one_is_checked(monkeypatch):
    "A granted nested component would run first; a refused sibling later in the tree must stop the build before it."
    import types

    probe = types.ModuleType("probe_pkg")               # a package the person granted, with a visible side effect
    exec("calls = []\ndef side_effect():\n    calls.append(1)\n    return 4\n", probe.__dict__)
    monkeypatch.setitem(sys.modules, "probe_pkg", probe)
    calls = probe.calls
    node = {"_component_": "torch.nn.Linear", "in_features": {"_component_": "probe_pkg.side_effect"},
            "out_features": {"_component_": "yaml.unsafe_load", "stream": "4"}}
    with pytest.raises(config.ConfigError) as e:
        config.instantiate(node, allowed=("probe_pkg",))
    assert "out_features._component_ = 'yaml.unsafe_load' is not allowed" in str(e.value), str(e.value)
    assert calls == []                                       # the granted one did not run either
    assert config.instantiate(dict(node, out_features=2), allowed=("probe_pkg",)).in_features == 4 and calls == [1]


# --- 3. only finite numbers -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,key", [
    ("optimizer.lr=.inf", "optimizer.lr"), ("optimizer.lr=1e999", "optimizer.lr"), ("optimizer.lr=nan", "optimizer.lr"),
    ("optimizer.lr=-.inf", "optimizer.lr"), ("optimizer.weight_decay=.nan", "optimizer.weight_decay"),
    ("lr_scheduler.num_warmup_steps=.inf", "lr_scheduler.num_warmup_steps"), ("clip_grad_norm=1e400", "clip_grad_norm"),
    ("+loss_weights=[1.0, .nan]", "loss_weights[1]"),
])
def test_non_finite_hyper_parameters_are_refused_at_validation(override, key):
    line = refused("validate", "tiny/lora", override)
    assert f"{key} " in line and "finite" in line, line


def test_a_number_beyond_float32_is_refused_at_validation():
    "1e39 is finite for Python but inf in a float32 tensor (torch raised an overflow traceback)."
    line = refused("validate", "tiny/lora", "optimizer.lr=1e39")
    assert line.endswith("optimizer.lr = 1e+39 is beyond what a 32-bit float holds (about 3.4e38), so it would become "
                         "inf in the tensors: give a value in range."), line


def test_a_non_finite_value_in_a_file_is_refused(tmp_path):
    path = tmp_path / "inf.yaml"
    path.write_text(re.sub(r"(\n  lr: )\S+", r"\g<1>.inf", LORA_YAML, count=1))
    assert "\n  lr: .inf\n" in path.read_text()
    line = refused("validate", path)
    assert "optimizer.lr" in line and "finite" in line, line


# --- 7. the smaller cases -------------------------------------------------------------------------------------------

def _alias_bomb() -> str:
    levels = ["&a [x,x,x,x,x,x,x,x,x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "[" + ",".join(levels) + "]"


def test_a_yaml_alias_bomb_override_is_refused_at_once():
    bomb = _alias_bomb()
    start = time.monotonic()
    try:
        result = subprocess.run([TUNELIT, "validate", "tiny/lora", f"+bomb={bomb}"], capture_output=True, text=True,
                                timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the alias bomb hung `tunelit validate` for 60 s")
    assert time.monotonic() - start < 30
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Failed to load" not in line]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "+bomb" in lines[0] and "alias" in lines[0], lines[0]


def test_a_yaml_alias_bomb_in_a_file_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(LORA_YAML + f"\nbomb: {_alias_bomb()}\n")
    start = time.monotonic()
    line = refused("validate", path)
    assert time.monotonic() - start < 10
    assert str(path) in line and "alias" in line, line


def test_a_component_in_a_module_that_does_not_exist_says_so():
    line = refused("validate", "tiny/lora", "model._component_=torchtune_lit.models.nosuch.lora_tiny_llama")
    assert "no module 'torchtune_lit.models.nosuch'" in line, line
    line = refused("validate", "tiny/lora", "model._component_=nosuchpkg_xyz.lora_tiny_llama")
    assert "no module named 'nosuchpkg_xyz'" in line and "not allowed" not in line, line


def _raised(f, *args):
    try:
        f(*args)
    except BaseException as e:  # noqa: BLE001 - the test looks at what the CLI makes of it
        return e
    raise AssertionError("nothing raised")


def test_torch_weights_only_refusal_is_one_line_naming_the_file(tmp_path):
    marker = tmp_path / "owned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    hostile = tmp_path / "recipe_state.pt"
    torch.save({"rng": Payload()}, hostile)
    error = _raised(lambda: torch.load(hostile, map_location="cpu", weights_only=True))
    assert isinstance(error, pickle.UnpicklingError)
    line = error_line(error)
    assert line is not None and len(line.splitlines()) == 1, line
    assert str(hostile) in line and "refused for safety" in line and "weights_only=False" not in line, line
    assert not marker.exists()


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_jinja_sandbox_refusal_is_one_line_naming_the_file(tmp_path, where):
    import json

    from torchtune_lit.tokenizers import HuggingFaceModelTokenizer

    folder = tmp_path / "hostile_tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ASSETS / "base" / name).read_bytes())
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    if where == "chat_template.jinja":
        (folder / where).write_text(escape)
    else:  # the template inside tokenizer_config.json, as most checkpoints ship it
        settings = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps(dict(settings, chat_template=escape)))
    tokenizer = HuggingFaceModelTokenizer(folder / "tokenizer.json")
    error = _raised(tokenizer.render, [{"role": "user", "content": "hi"}])
    assert type(error).__name__ == "SecurityError"
    line = error_line(error)
    assert line is not None and len(line.splitlines()) == 1, line
    assert line.startswith(f"the chat template in {folder / where} was refused for safety: "), line


def test_jinja_sandbox_refusal_in_a_run_is_one_line_naming_the_file(tmp_path):
    "The refusal reaches `tunelit run` from inside the dataset: exit 1, one line naming the template's file."
    folder = tmp_path / "hostile_tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ASSETS / "base" / name).read_bytes())
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    tokenizer = (f"tokenizer={{_component_: torchtune_lit.tokenizers.HuggingFaceModelTokenizer, "
                 f"tokenizer_json_path: {folder / 'tokenizer.json'}, max_seq_len: 256}}")
    line = refused(*lora_run("tiny/lora", tmp_path / "out", tokenizer))
    assert line.startswith(f"tunelit run: the chat template in {folder / 'chat_template.jinja'} was refused for "
                           "safety: access to attribute '__class__'"), line


WRITES = re.compile(r"write_text|write_bytes|open\([^)]*['\"][wax]|torch\.save|save_file|rmtree|unlink|"
                    r"atomic_folder|subprocess|os\.system|write_hf_weights|\.save\(|_write_")


def test_no_component_of_the_default_set_writes_files():
    "Every default component of torchtune_lit, read from its source: none writes (a new writer must be listed)."
    import importlib
    import inspect
    import pkgutil

    found, writers = 0, []
    for package in config.COMPONENT_PACKAGES:
        module = importlib.import_module(package)
        names = [package] + [m.name for m in pkgutil.walk_packages(getattr(module, "__path__", []), package + ".")]
        for name in names:
            for attr, obj in vars(importlib.import_module(name)).items():
                if not config.is_component(obj, f"{name}.{attr}") or obj.__module__ != name:
                    continue
                found += 1
                code = obj.__dict__.get("__init__") if inspect.isclass(obj) else obj
                try:  # a dataclass's generated __init__ has no source, and writes nothing
                    source = inspect.getsource(code) if inspect.isfunction(code) else ""
                except OSError:
                    source = ""
                if WRITES.search(source):
                    writers.append(f"{name}.{attr}")
    assert found > 150, found
    assert writers == [], f"components that write files: {writers}; list them in config.NOT_COMPONENTS"


def test_the_grant_reaches_the_recipe_that_tunelit_run_starts(tmp_path):
    "The recipe re-reads its command line: the flag must travel with it (the run stops at its first value check)."
    mine = "+my_parser={_component_: yaml.safe_load, stream: 'a: 1'}"  # validated by the recipe's own parse
    line = refused(*lora_run("tiny/lora", tmp_path / "out", "epochs=0", mine))
    assert "--allow-components yaml" in line, line
    for flag in (["--allow-components", "yaml"], ["--allow-components=yaml"]):
        line = refused(*lora_run("tiny/lora", tmp_path / "out", "epochs=0", mine, *flag))
        assert "epochs must be a whole number >= 1" in line, line
    # torchrun's workers are fresh processes: the flag itself must be on their command line
    from torchtune_lit._cli.tunelit import _resolve_recipe_args

    try:
        forwarded = _resolve_recipe_args(["--config", "tiny/lora", "--allow-components", "yaml", "epochs=1"])
    finally:
        _reset_grants()
    assert "--allow-components=yaml" in forwarded and "epochs=1" in forwarded
