"""Issue #39, the finite-numbers, resume, held-out and data-file cases: each hostile input ends in one line that names
the file, row, tensor or step (through `tunelit` it is the only stderr line, exit != 0, no traceback), and what an
earlier save wrote survives. Fast: most cases call the library; the CLI cases call the console script's main() in this
process and train at most one step."""
import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import torchtune_lit
import torchtune_lit.config as config
from torchtune_lit import training
from torchtune_lit._cli.tunelit import main
from torchtune_lit.datasets import instruct_dataset, load_rows, tiny_tokenizer
from torchtune_lit.models import build_from_hf_config
from torchtune_lit.tokenizers import HuggingFaceBaseTokenizer
from torchtune_lit.training import CheckpointError, FullModelHFCheckpointer, preflight

ASSETS = Path(torchtune_lit.__file__).parent / "assets" / "tiny"
CONFIGS = Path(torchtune_lit.__file__).parent / "recipes" / "configs" / "tiny"
FAST = ["epochs=1", "max_steps_per_epoch=1", "progress_bar=false", "run_val_every_n_steps=null", "preflight=false",
        "validation_dataset=null"]
SMALL_DATA = f"dataset.data_files={ASSETS / 'column_types_val.jsonl'}"   # 48 rows: quick to load
Q_KEY = "model.layers.0.self_attn.q_proj.weight"


def refused(*argv: str) -> str:
    "`tunelit argv...` in this process must fail with exactly one stderr line and no traceback; return the line."
    out, err = io.StringIO(), io.StringIO()
    config.trust_all_components(False)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code != 0, f"{argv} succeeded"
    assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    assert lines[0].startswith(f"tunelit {argv[0]}: "), lines[0]
    return lines[0]


def error_of(f, *args, **kwargs) -> Exception:
    try:
        f(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the case under test
        assert "\n" not in str(e), str(e)
        return e
    raise AssertionError(f"{getattr(f, '__name__', f)} accepted the input")


@pytest.fixture(scope="module")
def nan_base(tmp_path_factory) -> Path:
    "The shipped tiny base with 12 NaN in the first layer's query projection."
    folder = tmp_path_factory.mktemp("nan_base") / "base"
    shutil.copytree(ASSETS / "base", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[Q_KEY].view(-1)[:12] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# -- only finite numbers leave a run ------------------------------------------------------------------------------

def test_nan_in_base_weights_is_named_at_load(nan_base):
    e = error_of(FullModelHFCheckpointer(nan_base).load_checkpoint)
    assert isinstance(e, CheckpointError)
    assert str(e).startswith(f"the checkpoint's own weights contain NaN in {Q_KEY} (12 values)")


def test_nan_in_base_weights_through_a_recipe_is_not_blamed_on_lr(nan_base, tmp_path):
    line = refused("run", "full_finetune_single_device", "--config", "tiny/full", f"output_dir={tmp_path / 'out'}",
                   f"checkpointer.checkpoint_dir={nan_base}", SMALL_DATA, *FAST)
    assert f"the checkpoint's own weights contain NaN in {Q_KEY} (12 values)" in line
    assert "loss is nan" not in line and "Lower optimizer.lr" not in line


def test_nan_in_base_weights_under_fsdp_is_one_line_per_rank(nan_base, tmp_path):
    """Two ranks: rank 0 (which reads the checkpoint) names the tensor, rank 1 says it stopped for it (or is ended by
    the launcher first), the launcher's summary names rank 0 as the first to fail; no traceback, nothing saved."""
    import subprocess
    import sys

    tunelit = str(Path(sys.executable).parent / "tunelit")
    result = subprocess.run([tunelit, "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
                             "tiny/full_distributed", f"output_dir={tmp_path / 'out'}",
                             f"checkpointer.checkpoint_dir={nan_base}", SMALL_DATA, *FAST],
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert 2 <= len(lines) <= 3, lines                      # one line per rank at most, then the summary
    assert lines[0].startswith(f"[rank0] CheckpointError: the checkpoint's own weights contain NaN in {Q_KEY} "
                               "(12 values)"), lines
    assert all(line.startswith("[rank1] stopped: another rank failed") for line in lines[1:-1]), lines
    assert lines[-1].startswith("tunelit run: rank 0 (exit code 1) failed first"), lines
    assert not list((tmp_path / "out").glob("epoch_*")) and not list((tmp_path / "out").glob("step_*"))


def test_diverged_run_saves_nothing(tmp_path):
    # AdamW with eps=0 divides 0 by 0 for every weight whose gradient is 0 (embedding rows of tokens not in the
    # batch): the first loss is finite, the weights after the run's only step are NaN
    out = tmp_path / "out"
    line = refused("run", "full_finetune_single_device", "--config", "tiny/full", f"output_dir={out}",
                   "optimizer.eps=0", SMALL_DATA, *FAST)
    assert "not saving epoch_0 (epoch 0): the weights contain NaN in tok_embeddings.weight" in line
    assert "lower optimizer.lr" in line
    assert not list(out.glob("epoch_*")) and not list(out.glob(".epoch_*"))


def test_step_checkpoint_with_nan_keeps_the_previous_one(tmp_path):
    checkpointer = FullModelHFCheckpointer(ASSETS / "base", output_dir=tmp_path)
    weights = checkpointer.load_checkpoint()["model"]
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    training.save_step_checkpoint(checkpointer, {"model": weights}, optimizer, None, 0, 3, 3, tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_3").iterdir()}
    weights = dict(weights, **{"layers.2.mlp.w1.weight": weights["layers.2.mlp.w1.weight"] * float("inf")})
    e = error_of(training.save_step_checkpoint, checkpointer, {"model": weights}, optimizer, None, 0, 6, 6, tmp_path)
    assert isinstance(e, FloatingPointError)
    assert str(e).startswith("not saving step_6 (epoch 0): the weights contain ")
    assert "in layers.2.mlp.w1.weight (" in str(e) and "clip_grad_norm" in str(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_3").iterdir()} == before


SHARDED_SAVE = """
import os, sys, torch, torch.distributed as dist
from torchtune_lit.training import save_sharded_step, sharding

class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
torch.manual_seed(0)
model = sharding.shard_model(TwoLayers())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
save_sharded_step(model, optimizer, None, out, 0, 1, 1, rank)
if rank == 1:  # this rank's shard only: rank 0 cannot see the NaN in its own
    with torch.no_grad():
        model.layers[0].weight.to_local()[0, 0] = float("nan")
try:
    save_sharded_step(model, optimizer, None, out, 0, 2, 2, rank)
    print(f"rank {rank} saved step_2")
except FloatingPointError as e:
    print(f"rank {rank}: {e}")
dist.destroy_process_group()
"""


def test_sharded_step_checkpoint_with_nan_on_one_rank_is_refused_on_every_rank(tmp_path):
    "Two processes (FSDP2 on Gloo): the NaN is in rank 1's shard; both ranks refuse step_2, naming rank 1."
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", SHARDED_SAVE, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in (0, 1)]
    results = [p.communicate(timeout=240) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [err[-2000:] for _, err in results]
    expected = ("not saving step_2 (epoch 0): the weights contain NaN in layers.0.weight (1 value) in rank 1's "
                "shard, so the run diverged")
    for r, (out, _) in enumerate(results):
        assert out.startswith(f"rank {r}: {expected}"), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]       # step_1 kept, nothing of step_2


def test_nonfinite_adapter_is_refused_too(tmp_path):
    checkpointer = FullModelHFCheckpointer(ASSETS / "base", output_dir=tmp_path)
    adapter = {"layers.0.attn.q_proj.lora_a.weight": torch.tensor([[1.0, float("-inf")]])}
    e = error_of(checkpointer.save_checkpoint, {"adapter": adapter, "adapter_config": {}}, epoch=2, adapter_only=True)
    assert str(e).startswith("not saving epoch_2 (epoch 2): the weights contain Inf in "
                             "layers.0.attn.q_proj.lora_a.weight (1 value)")
    assert not list(tmp_path.iterdir())


# -- resume: the new learning rate; a damaged recipe state -------------------------------------------------------

def _trained(lr: float):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = training.lr_schedulers.get_cosine_schedule_with_warmup(optimizer, 2, 10)
    return param, optimizer, scheduler


def test_resume_takes_the_new_learning_rate():
    param, optimizer, scheduler = _trained(1e-3)
    for _ in range(4):
        param.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    state = training.make_recipe_state(optimizer, scheduler, 0, 4, 4)
    _, new_optimizer, new_scheduler = _trained(5e-3)  # the config's lr, raised
    changed = training.restore_training_state(state, new_optimizer, new_scheduler)
    assert changed == "learning rate 0.001 -> 0.005"
    multiplier = scheduler.lr_lambdas[0](4)
    assert new_optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * multiplier, rel=1e-12)
    assert new_scheduler.base_lrs == [5e-3] and new_optimizer.param_groups[0]["initial_lr"] == 5e-3
    new_scheduler.step()
    assert new_optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * scheduler.lr_lambdas[0](5), rel=1e-12)
    # unchanged: nothing to say; an explicit lr (what a recipe may pass) wins over the built one
    assert training.restore_training_state(state, *_trained(1e-3)[1:]) is None
    _, explicit, explicit_scheduler = _trained(1e-3)
    assert training.resume_position(state, explicit, explicit_scheduler, "/nonexistent/log.jsonl", lr=2e-3).step == 4
    assert explicit_scheduler.base_lrs == [2e-3]


@pytest.mark.parametrize("kind", ["in_backward", "tensor_lr"])
def test_new_learning_rate_reaches_wrapped_and_tensor_rates(kind):
    # the optimizer stepped in backward keeps one inner optimizer per parameter; torchao's optimizers keep lr as a
    # tensor and refuse a float put in its place (a plain AdamW with a tensor lr stands in: torchao's compiles)
    model = torch.nn.Linear(16, 16)

    def build(lr: float):
        if kind == "in_backward":
            optimizer = training.build_optimizer(model, lambda ps: torch.optim.AdamW(ps, lr=lr), in_backward=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr), foreach=False)
        return optimizer, training.lr_schedulers.get_cosine_schedule_with_warmup(optimizer, 1, 10)

    optimizer, scheduler = build(1e-3)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = training.make_recipe_state(optimizer, scheduler, 0, 2, 2)
    optimizer, scheduler = build(4e-3)
    assert training.restore_training_state(state, optimizer, scheduler) == "learning rate 0.001 -> 0.004"
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    scheduler.step()
    if kind == "tensor_lr":
        assert all(isinstance(g[k], torch.Tensor) for g in optimizer.param_groups for k in ("lr", "initial_lr"))
    expected = 4e-3 * scheduler.lr_lambdas[0](3)
    assert all(float(g["lr"]) == pytest.approx(expected, rel=1e-6) for g in optimizer.param_groups)
    if kind == "in_backward":
        inner = [g["lr"] for opt in optimizer.optimizers.values() for g in opt.param_groups]
        assert inner == pytest.approx([expected] * 2, rel=1e-12)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_state"])
def test_damaged_recipe_state_is_named(tmp_path, damage):
    folder = tmp_path / "step_4"
    folder.mkdir()
    path = folder / "recipe_state.pt"
    torch.save({"step": 4, "optimizer": {"big": torch.zeros(4096)}}, path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:700])
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage, not a torch file")
    else:
        torch.save([1, 2, 3], path)
    e = error_of(training.resume_state, tmp_path, torch.nn.Linear(2, 2))
    assert isinstance(e, CheckpointError) and "weights_only" not in str(e)
    assert str(e).startswith(f"{path} is damaged (") and "Delete step_4 to resume from the step checkpoint before" in str(e)


def test_nonfinite_adapter_in_a_step_checkpoint_is_named(tmp_path):
    folder = tmp_path / "step_2"
    folder.mkdir()
    torch.save({"step": 2, "adapter_weights": {"a.lora_a.weight": torch.tensor([float("nan")])}},
               folder / "recipe_state.pt")
    e = error_of(training.resume_state, tmp_path, torch.nn.Linear(2, 2), adapters_only=True)
    assert "adapter weights contain NaN in a.lora_a.weight (1 value)" in str(e)


# -- selection never sees the test split ---------------------------------------------------------------------------

def test_no_tiny_training_config_reads_the_evaluation_split():
    evaluation_only = {"eval.yaml", "eleuther_eval.yaml", "quantize.yaml"}   # they score the held-out split
    assert (ASSETS / "column_types_val.jsonl").is_file()
    readers = sorted(p.name for p in CONFIGS.glob("*.yaml") if "column_types_eval" in p.read_text())
    assert set(readers) <= evaluation_only, readers
    val = (ASSETS / "column_types_val.jsonl").resolve()
    for name in ("full", "full_distributed", "dora", "qlora", "qat", "qat_distributed", "kd", "kd_distributed",
                 "kd_lora"):
        cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
        for key in ("validation_dataset", "kl_eval_dataset"):
            if key in cfg:
                assert Path(cfg[key].data_files).resolve() == val, (name, key)


def test_preflight_warns_when_validation_is_the_evaluation_split(tmp_path):
    same = preflight.held_out_findings(str(ASSETS / "column_types_eval.jsonl"))
    assert [f["level"] for f in same] == ["warn"] and "best/ would be chosen on the test set" in same[0]["message"]
    eval_file = tmp_path / "my_eval.jsonl"
    eval_file.write_text('{"a": 1, "b": 2}\n{"a": 3, "b": 4}\n')
    (tmp_path / "link.jsonl").symlink_to(eval_file)
    assert preflight.held_out_findings([str(tmp_path / "link.jsonl")], [eval_file])[0]["shared_rows"] is None
    val = tmp_path / "val.jsonl"
    val.write_text('{"a": 5, "b": 6}\n{"b": 4, "a": 3}\n')   # one evaluation row, keys in another order
    shared = preflight.held_out_findings({"validation": str(val)}, eval_files=str(eval_file))
    assert [f["shared_rows"] for f in shared] == [1] and str(eval_file) in shared[0]["message"]
    clean = preflight.held_out_findings(str(ASSETS / "column_types_val.jsonl"))
    assert [f["level"] for f in clean] == ["ok"]


def test_a_run_validating_on_the_evaluation_split_is_warned(tmp_path):
    "The recipe's and `tunelit preflight`'s reports carry the held-out check (before: no recipe passed its files)."
    on_eval = "validation_dataset.data_files=${asset:tiny/column_types_eval.jsonl}"
    warning = f"WARN  validation_dataset reads {ASSETS / 'column_types_eval.jsonl'}, the file the evaluation scores"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["preflight", "tiny/lora", on_eval, f"output_dir={tmp_path / 'pf'}"])
    assert code == 0 and warning in out.getvalue(), out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["run", "lora_finetune_single_device", "--config", "tiny/lora", on_eval, SMALL_DATA,
                     f"output_dir={tmp_path / 'run'}", "epochs=1", "max_steps_per_epoch=1", "progress_bar=false",
                     "run_val_every_n_steps=null", "max_validation_batches=1"])
    assert code == 0 and warning in out.getvalue(), out.getvalue()[-3000:]


# -- data files: file and 1-based line ------------------------------------------------------------------------------

GOOD = '{"prompt": "Column: zip\\nValues: 75011", "label": "postal_code"}\n'


@pytest.mark.parametrize("content,expected", [
    (GOOD * 2 + '{"prompt": "a", \n' + GOOD, "line 3 is not valid JSON"),
    (GOOD + '["a", "b"]\n' + GOOD, "line 2 is an array, not an object"),
    (GOOD * 3 + "42\n", "line 4 is a number, not an object"),
    (GOOD + "\n\n" + '"just text"\n', "line 4 is a string, not an object"),
    ((GOOD + "\n").encode() + '{"prompt": "caf\u00e9", "label": "x"}\n'.encode("latin-1"),
     "is not UTF-8 text at line 3 (byte 0xe9)"),
    # U+2028 inside a string is valid JSON and no line break (str.splitlines would count it as one)
    (GOOD.replace("zip", "zip\u2028code") * 2 + "{oops}\n", "line 3 is not valid JSON"),
])
def test_broken_jsonl_names_file_and_line(tmp_path, content, expected):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    e = error_of(load_rows, "json", data_files=str(path))
    assert isinstance(e, ValueError) and str(e).startswith(f"the data file {path}") and expected in str(e), str(e)


def test_empty_columns_are_named_by_file_and_line(tmp_path):
    "check_columns names JSON-lines rows as FILE line N (1-based, blank lines counted), through filter_fn and two files."
    import datasets

    from torchtune_lit.data import ColumnError, InputOutputToMessages
    from torchtune_lit.datasets._builders import check_columns

    transform = InputOutputToMessages(column_map={"input": "prompt", "output": "label"})
    empty = '{"prompt": "Column: x", "label": null}\n'
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(GOOD + "\n" + empty + GOOD)                 # the empty row is on line 3, after a blank one
    second.write_text(empty + GOOD * 3 + GOOD.replace("zip", "dob") * 3 + empty * 5)   # empty: lines 1 and 8-12
    cases = [({"data_files": str(first)}, f"in 1 of 3 rows ({first} line 3)"),
             ({"data_files": [str(first), str(second)]},
              f"in 7 of 15 rows ({first} line 3; {second} lines 1, 8, 9, 10, ...)"),
             # filter_fn drops lines 2-4: the kept rows still point at their own lines
             ({"data_files": str(second), "filter_fn": lambda row: row["label"] is None or "dob" in row["prompt"]},
              f"in 6 of 9 rows ({second} lines 1, 8, 9, 10, 11, ...)")]
    for kwargs, expected in cases:
        e = error_of(check_columns, load_rows("json", **kwargs), transform)
        assert isinstance(e, ColumnError) and expected in str(e), str(e)
    in_memory = datasets.Dataset.from_list([json.loads(GOOD), json.loads(empty)])  # no file: positions from 0
    assert "in 1 of 2 rows (rows 1; counted from 0)" in str(error_of(check_columns, in_memory, transform))


def test_broken_jsonl_through_the_cli_is_one_line(tmp_path, capfd):
    path = tmp_path / "train.jsonl"
    path.write_text(GOOD * 4 + '["zip", "postal_code"]\n')
    line = refused("run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={tmp_path / 'out'}",
                   f"dataset.data_files={path}", *FAST)
    assert f"the data file {path}: line 5 is an array" in line
    assert "Failed to load JSON" not in capfd.readouterr().err     # datasets' own log line stays quiet


def test_a_json_array_document_still_loads(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([json.loads(GOOD)] * 3, indent=2))
    assert len(instruct_dataset(tiny_tokenizer(), source="json", data_files=str(path),
                                column_map={"input": "prompt", "output": "label"})) == 3


@pytest.mark.parametrize("name,content,expected", [
    ("tokenizer.json", "", "is empty"),
    ("tokenizer.json", "<html>502</html>", "is not JSON (Expecting value)"),
    ("tokenizer.json", "[1, 2]", "holds a JSON list"),
    ("tokenizer.json", '{"version": "1.0"}', "is JSON but not a tokenizer"),
    ("tokenizer_config.json", "{bos_token: <s>}", "is not JSON"),
    ("tokenizer_config.json", '"<s>"', "holds a JSON str"),
])
def test_damaged_tokenizer_files_are_named(tmp_path, name, content, expected):
    from tokenizers import Tokenizer, models
    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / name).write_text(content)
    e = error_of(HuggingFaceBaseTokenizer, tmp_path / "tokenizer.json")
    assert str(e).startswith(f"{tmp_path / name} {expected}"), str(e)


def test_config_json_that_is_not_json_is_named(tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(ASSETS / "base", folder)
    (folder / "config.json").write_text('{"model_type": "llama",')
    for load in (FullModelHFCheckpointer, build_from_hf_config):
        assert str(error_of(load, folder)).startswith(f"{folder / 'config.json'} is not JSON (")
    line = refused("run", "full_finetune_single_device", "--config", "tiny/full", f"output_dir={tmp_path / 'out'}",
                   f"checkpointer.checkpoint_dir={folder}", SMALL_DATA, *FAST)
    assert f"{folder / 'config.json'} is not JSON" in line
