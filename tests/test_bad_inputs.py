"""A hostile user's inputs, through the `tunelit` command: each one ends with exit code != 0, exactly one line on
stderr that names the problem (no traceback), and nothing an earlier run wrote is changed.

Most cases call the console script's `main()` in this process (the same function `tunelit` runs; a few seconds
each instead of a fresh interpreter per case); Ctrl-C and the trusted-config path run the real executable."""
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchtune_lit
import torchtune_lit.config as config
from torchtune_lit._cli.tunelit import main

ASSETS = Path(torchtune_lit.__file__).parent / "assets" / "tiny"
TUNELIT = str(Path(sys.executable).parent / "tunelit")
FAST = ["epochs=1", "max_steps_per_epoch=2", "progress_bar=false", "run_val_every_n_steps=null"]


def run_cli(*argv: str) -> tuple[int, str, str]:
    "`tunelit argv...` through the console script's main(): (exit code, stdout, stderr)."
    out, err = io.StringIO(), io.StringIO()
    config.trust_all_components(False)
    config.allow_components(())
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    config.trust_all_components(False)
    config.allow_components(())
    return code, out.getvalue(), err.getvalue()


def refused(*argv: str) -> str:
    "Run a command that must fail; return its one stderr line after checking the contract."
    code, _, err = run_cli(*argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, f"{argv} succeeded"
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"tunelit {argv[0]}: "), lines[0]
    return lines[0]


def lora(output_dir: Path, *overrides: str) -> list[str]:
    return ["run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={output_dir}", *FAST,
            *overrides]


def generate(tmp: Path, *overrides: str) -> list[str]:
    return ["run", "generate", "--config", "tiny/generate", f"output_dir={tmp / 'gen'}", "max_new_tokens=4",
            *overrides]


def fingerprint(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    "Data files, broken checkpoints and one finished run, shared by the cases."
    tmp = tmp_path_factory.mktemp("hostile")
    rows = [json.loads(line) for line in (ASSETS / "column_types_train.jsonl").read_text().splitlines()[:24]]
    write_rows(tmp / "null.jsonl", [dict(r, label=None) if i % 5 == 0 else r for i, r in enumerate(rows)])
    write_rows(tmp / "missing_some.jsonl",
               [{k: v for k, v in r.items() if k != "label" or i % 5} for i, r in enumerate(rows)])
    write_rows(tmp / "missing_all.jsonl", [{k: v for k, v in r.items() if k != "label"} for r in rows])
    write_rows(tmp / "empty_answers.jsonl", [dict(r, label="") for r in rows])
    (tmp / "empty.jsonl").write_text("")
    truncated = tmp / "truncated"
    shutil.copytree(ASSETS / "base", truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    other_vocab = tmp / "other_vocab"
    shutil.copytree(ASSETS / "base", other_vocab)
    hf_config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps(dict(hf_config, vocab_size=4096)))
    code, _, err = run_cli(*lora(tmp / "finished", "save_every_n_steps=1", "max_steps_per_epoch=3"))
    assert code == 0, err[-3000:]
    return tmp


CASES = {
    # silent wrong results before: each must now stop with the key and the fix
    "null label in some rows": (lambda t: lora(t / "o", f"dataset.data_files={t / 'null.jsonl'}"),
                                "column 'label' is empty (null or missing) in 5 of 24 rows "),
    "label missing in some rows": (lambda t: lora(t / "o", f"dataset.data_files={t / 'missing_some.jsonl'}"),
                                   "column 'label' is empty (null or missing) in 5 of 24 rows"),
    "epochs=0": (lambda t: lora(t / "o", "epochs=0"), "epochs must be a whole number >= 1, got 0."),
    "epochs=-1": (lambda t: lora(t / "o", "epochs=-1"), "epochs must be a whole number >= 1, got -1."),
    "max_steps_per_epoch=0": (lambda t: lora(t / "o", "max_steps_per_epoch=0"),
                              "max_steps_per_epoch must be a whole number >= 1, or null"),
    "clip_grad_norm=-0.5": (lambda t: lora(t / "o", "clip_grad_norm=-0.5"),
                            "clip_grad_norm must be a positive number, or null for no clipping, got -0.5"),
    "temperature=-1": (lambda t: generate(t, "temperature=-1"), "temperature must be >= 0 (0: greedy), got -1"),
    "misspelt key in a run": (lambda t: lora(t / "o", "batchsize=2"),
                              "the config has no key 'batchsize' and no recipe reads one. Did you mean 'batch_size'?"),
    "misspelt key in validate": (lambda t: ["validate", "tiny/lora", "batchsize=2"],
                                 "Did you mean 'batch_size'? To add a key of your own, write '+batchsize=2'."),
    "config.json disagrees with the weights": (
        lambda t: lora(t / "o", f"checkpointer.checkpoint_dir={t / 'other_vocab'}"),
        "config.json says vocab_size 4096 and hidden_size 256, but the weights' model.embed_tokens.weight is "
        "(2048, 256)"),
    "every answer empty": (lambda t: lora(t / "o", f"dataset.data_files={t / 'empty_answers.jsonl'}"),
                           "preflight found 1 error(s), so training did not start: 24 of 24 samples have an empty "
                           "answer"),
    "lr=0": (lambda t: lora(t / "o", "optimizer.lr=0"), "optimizer.lr is 0, so no weight will change"),
    "lr negative": (lambda t: lora(t / "o", "optimizer.lr=-1"), "optimizer.lr must be >= 0, got -1"),
    # tracebacks before: one line now
    "lr=abc": (lambda t: lora(t / "o", "optimizer.lr=abc"), "optimizer.lr must be a number such as 3e-4, got 'abc'."),
    "~epochs": (lambda t: lora(t / "o", "~epochs"), "the config has no epochs: add it"),
    "empty data file": (lambda t: lora(t / "o", f"dataset.data_files={t / 'empty.jsonl'}"),
                        "is empty; add rows to it."),
    "column missing in every row": (lambda t: lora(t / "o", f"dataset.data_files={t / 'missing_all.jsonl'}"),
                                    "dataset has no column 'label' (expected for 'output'); its columns are "
                                    "['header', 'prompt']"),
    "column_map names no column": (lambda t: lora(t / "o", "dataset.column_map.output=labl"),
                                   "dataset has no column 'labl' (expected for 'output')"),
    "truncated safetensors": (lambda t: lora(t / "o", f"checkpointer.checkpoint_dir={t / 'truncated'}"),
                              "model.safetensors could not be read (Error while deserializing header"),
    "missing checkpoint folder": (lambda t: lora(t / "o", f"checkpointer.checkpoint_dir={t / 'nowhere'}"),
                                  "/nowhere does not exist. Download the model first"),
    "top_k=0": (lambda t: generate(t, "top_k=0"), "top_k must be >= 1 or null (all tokens), got 0."),
    "top_k=-3": (lambda t: generate(t, "top_k=-3"), "top_k must be >= 1 or null (all tokens), got -3."),
    "top_p=0": (lambda t: generate(t, "top_p=0"), "top_p must be in (0, 1] or null (no nucleus cut), got 0."),
    "max_new_tokens=-5": (lambda t: generate(t, "max_new_tokens=-5"), "max_new_tokens must be >= 1, got -5."),
    "override value with ': '": (lambda t: lora(t / "o", "dataset.new_system_prompt=Answer: one label"),
                                 "YAML reads 'Answer: one label' as a mapping because of the ': '. For text, "
                                 "quote it"),
    "max_seq_len=0": (lambda t: lora(t / "o", "tokenizer.max_seq_len=0"),
                      "max_seq_len must be a whole number >= 1, or null for no limit, got 0."),
    "device asked for but absent": (lambda t: lora(t / "o", "device=cuda"),
                                    "device=cuda was asked for, but CUDA is not available"),
    "missing optional logger package": (
        lambda t: lora(t / "o", "metric_logger._component_=torchtune_lit.training.metric_logging.WandBLogger",
                       "metric_logger.project=demo"),
        "needs the 'wandb' package, which is not installed: pip install wandb"),
    "hub dataset without a network": (lambda t: lora(t / "o", "dataset.source=tatsu-lab/alpaca",
                                                     "~dataset.data_files"),
                                      "is on the Hugging Face Hub, which cannot be reached (127.0.0.1:"),
    "cp of a file path": (lambda t: ["cp", str(ASSETS.parent.parent / "recipes/configs/tiny/lora.yaml"), str(t)],
                          "is a file, not a built-in recipe or config"),
    "cp onto an existing file": (lambda t: ["cp", "tiny/lora", str(t / "null.jsonl")],
                                 "already exists; pass --force to overwrite it."),
    # vision: the whole-model checkpointer on a text checkpoint; pictures given to a text-only tokenizer
    "LLAMA3_VISION on a text checkpoint": (lambda t: lora(t / "o", "checkpointer.model_type=LLAMA3_VISION"),
                                           "model_type LLAMA3_VISION reads a 'mllama' checkpoint, but"),
    "pictures for a text tokenizer": (
        lambda t: ["run", "full_finetune_single_device", "--config", "tiny/vision", f"output_dir={t / 'o'}", *FAST,
                   "tokenizer._component_=torchtune_lit.datasets.tiny_tokenizer", "~tokenizer.max_seq_len"],
        "message 0 holds an image, but this tokenizer writes no images"),
    # folders a run must not own (#39)
    "output_dir=/": (lambda t: lora(Path("/")), "output_dir=/ is the root folder; a run writes there and "
                                                "overwrite=true deletes there"),
    "output_dir is the input checkpoint": (
        lambda t: lora(t / "other_vocab", f"checkpointer.checkpoint_dir={t / 'other_vocab'}", "overwrite=true"),
        "is the input checkpoint folder"),
    # configs cannot run code
    "os.system as a component": (lambda t: lora(t / "o", "checkpointer._component_=os.system",
                                                f"+checkpointer.command=touch {t / 'pwned'}"),
                                 "checkpointer._component_ = 'os.system' is not allowed"),
    "a path that walks out of the allowlist": (
        lambda t: ["validate", "tiny/lora", "optimizer._component_=torchtune_lit.training.runs.shutil.rmtree"],
        "'torchtune_lit.training.runs.shutil.rmtree' is not allowed: it writes, deletes or launches"),
    "${asset:} outside the assets folder": (lambda t: lora(t / "o", "dataset.data_files=${asset:../../config.py}"),
                                           "points outside the package's assets folder"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(world, name, monkeypatch):
    import huggingface_hub.constants

    # the Hub must be unreachable whatever the machine: a closed local port stands in for it
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://127.0.0.1:9")
    argv, expected = CASES[name]
    shutil.rmtree(world / "o", ignore_errors=True)
    line = refused(*argv(world))
    assert expected in line, line
    assert not (world / "pwned").exists()


def test_rows_with_an_empty_column_are_named_by_their_lines(world):
    "The rows of a JSON-lines file are named by the lines an editor shows (from 1), not by 0-based positions."
    line = refused(*lora(world / "o", f"dataset.data_files={world / 'null.jsonl'}"))
    assert (f"column 'label' is empty (null or missing) in 5 of 24 rows ({world / 'null.jsonl'} lines 1, 6, 11, 16, "
            "21); fill or drop those rows") in line, line


def test_a_finished_run_is_neither_overwritten_nor_resumed(world):
    before = fingerprint(world / "finished")
    assert "already holds a run" in refused(*lora(world / "finished"))
    line = refused(*lora(world / "finished", "resume_from_checkpoint=true"))
    assert "finished (3 steps" in line and "nothing to resume" in line
    assert fingerprint(world / "finished") == before


def test_resume_with_changed_shapes_is_refused_by_name(world, tmp_path):
    # a run killed after step 2 leaves run.json 'running' and its step checkpoints
    killed = tmp_path / "killed"
    shutil.copytree(world / "finished", killed, symlinks=True)
    info = json.loads((killed / "run.json").read_text())
    (killed / "run.json").write_text(json.dumps(dict(info, status="running", finished=None)))
    before = fingerprint(killed)
    line = refused(*lora(killed, "resume_from_checkpoint=true", "model.lora_rank=4", "max_steps_per_epoch=3"))
    assert "resume: model.lora_rank was 8, now 4; that is a different run" in line
    assert fingerprint(killed) == before


def test_a_dpo_run_does_not_resume_an_sft_folder(world, tmp_path):
    "Before: 19 warnings, then DPO trained on from the SFT run's step checkpoint (exit 0)."
    killed = tmp_path / "killed"
    shutil.copytree(world / "finished", killed, symlinks=True)
    info = json.loads((killed / "run.json").read_text())
    (killed / "run.json").write_text(json.dumps(dict(info, status="running", finished=None)))
    before = fingerprint(killed)
    line = refused("run", "lora_dpo_single_device", "--config", "tiny/dpo", f"output_dir={killed}", *FAST,
                   "resume_from_checkpoint=true")
    assert "lora_finetune_single_device run" in line and "lora_dpo_single_device" in line, line
    assert fingerprint(killed) == before


def test_a_config_file_that_runs_a_command_is_refused(world, tmp_path):
    marker = tmp_path / "ran"
    text = (ASSETS.parent.parent / "recipes/configs/tiny/lora.yaml").read_text()
    evil = tmp_path / "evil.yaml"
    evil.write_text(text + f"\nmetric_logger:\n  _component_: subprocess.run\n  args: [touch, {marker}]\n")
    assert "'subprocess.run' is not allowed" in refused("validate", evil)
    assert "'subprocess.run' is not allowed" in refused(*lora(tmp_path / "o"), "--config", evil)
    allowing = tmp_path / "allowing.yaml"
    allowing.write_text(text + "\nallowed_components: [subprocess]\n")
    assert "a config cannot allow components itself" in refused("validate", allowing)
    assert not marker.exists()


def test_trust_config_lifts_the_allowlist_for_a_config_one_trusts(tmp_path):
    text = (ASSETS.parent.parent / "recipes/configs/tiny/lora.yaml").read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text(text + "\nmetric_logger:\n  _component_: os.getcwd\n")
    plain = subprocess.run([TUNELIT, "validate", str(mine)], capture_output=True, text=True)
    assert plain.returncode == 1 and "'os.getcwd' is not allowed" in plain.stderr
    trusted = subprocess.run([TUNELIT, "validate", str(mine), "--trust-config"], capture_output=True, text=True)
    assert trusted.returncode == 0 and trusted.stdout.strip().endswith("Config is well-formed!"), trusted.stderr
    assert "metric_logger: os.getcwd (outside the default set; allowed by --trust-config)" in trusted.stdout


def test_a_pickle_that_would_run_code_is_not_loaded(tmp_path):
    marker = tmp_path / "owned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "hostile"
    shutil.copytree(ASSETS / "base", folder)
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    line = refused(*lora(tmp_path / "o", f"checkpointer.checkpoint_dir={folder}",
                         "checkpointer.checkpoint_files=[pytorch_model.bin]"))
    assert "refuses to load (unpickling them could run code)" in line
    assert not marker.exists()


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_is_named_and_loses_nothing(tmp_path):
    disk = tmp_path / "small_disk"
    if not _mount_tmpfs(disk, "size=3m"):
        pytest.skip("mounting a small RAM disk needs root (the chapter checks the message with a simulated ENOSPC)")
    try:
        line = refused(*lora(disk / "run"))
        assert f"no space left on {disk / 'run'} while writing epoch_0" in line, line
        assert not list((disk / "run").glob(".epoch_0.tmp-*"))  # the partial folder was removed
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_read_only_output_folder_is_refused_before_training(tmp_path):
    disk = tmp_path / "read_only"
    if not _mount_tmpfs(disk, "ro,size=1m"):
        pytest.skip("mounting a read-only RAM disk needs root")
    try:
        line = refused(*lora(disk))
        assert f"output_dir {disk} is not writable (Read-only file system)" in line
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_ctrl_c_exits_cleanly_and_names_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [TUNELIT, "run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={run}",
         "progress_bar=false", "preflight=false", "save_every_n_steps=1", "run_val_every_n_steps=null"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # a suite started in the background (`make test &`) ignores SIGINT, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    # any step checkpoint (they are pruned to the newest two, so a given step_N may be gone before it is seen)
    while not any(run.glob("step_*/recipe_state.pt")) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("tunelit run: interrupted (Ctrl-C); the newest checkpoint is ")
    newest = Path(lines[0].split("the newest checkpoint is ")[1].split(": continue")[0])
    assert newest.parent == run and newest.name.startswith("step_")
    assert lines[0].endswith("continue with resume_from_checkpoint=true.")
    resumed = subprocess.run([TUNELIT, "run", "lora_finetune_single_device", "--config", "tiny/lora",
                              f"output_dir={run}", "progress_bar=false", "preflight=false",
                              "save_every_n_steps=1", "run_val_every_n_steps=null", "resume_from_checkpoint=true",
                              "max_steps_per_epoch=" + str(int(newest.name[5:]) + 1), "epochs=1"],
                             capture_output=True, text=True)
    assert resumed.returncode == 0 and f"Resuming from {newest}" in resumed.stdout, resumed.stderr[-3000:]


def test_a_failed_distributed_run_ends_in_one_line_per_rank(tmp_path):
    "Before: 88 lines (a traceback per rank, then torchrun's own traceback and failure report)."
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29617",
                             "full_finetune_distributed", "--config", "tiny/full_distributed",
                             f"output_dir={tmp_path / 'o'}", f"checkpointer.checkpoint_dir={tmp_path / 'missing'}"],
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) <= 3, lines  # one per rank at most, then the summary
    assert sorted(line[:7] for line in lines[:-1]) == ["[rank0]", "[rank1]"][: len(lines) - 1], lines
    assert all("CheckpointError: checkpoint_dir" in line and "does not exist" in line for line in lines[:-1])
    assert lines[-1].startswith("tunelit run: rank ") and "failed first" in lines[-1], lines


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    "The pid of the recipe process with RANK=`rank` below `launcher_pid`, from /proc."
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo = [launcher_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"full_finetune_distributed.py" in command:
                return pid
    return None


def test_a_killed_rank_ends_in_one_line_per_rank(tmp_path):
    "Rank 1 SIGKILLed mid-run (what the out-of-memory killer does): no traceback, the summary names it and the signal."
    out = tmp_path / "o"
    process = subprocess.Popen([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29641",
                                "full_finetune_distributed", "--config", "tiny/full_distributed", f"output_dir={out}",
                                f"dataset.data_files={ASSETS / 'column_types_val.jsonl'}",  # 48 rows: quick to load
                                "epochs=40", "batch_size=2", "progress_bar=false", "preflight=false",
                                "validation_dataset=null"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log, deadline = out / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and log.read_text().strip()):
        time.sleep(0.05)
    victim = _rank_pid(process.pid, 1)
    assert victim is not None, "rank 1 was not found"
    os.kill(victim, signal.SIGKILL)
    _, err = process.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert len(lines) <= 2, lines                                    # rank 1 prints nothing: it was killed
    assert all(line.startswith("[rank0] stopped: another rank failed (") and ".cc:" not in line
               for line in lines[:-1]), lines
    assert lines[-1].startswith("tunelit run: rank 1 (killed by SIGKILL) failed first"), lines
    assert "ran out of memory" in lines[-1] and "batch_size" in lines[-1], lines
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))                   # the log is whole: every line one step
    # the folder is free for a resume: a lock the launcher's SIGTERM left behind names a dead process
    from torchtune_lit.training.runs import claim_output_dir, release_output_dir

    claim_output_dir(out, resume=True, recipe="full_finetune_distributed")
    release_output_dir(out)


@pytest.mark.parametrize("switch", ["quantize_base", "use_dora"])
def test_lora_on_experts_refuses_what_experts_cannot_take(switch):
    "NF4 (no grouped-expert form) and DoRA on a mixture of experts: one line naming the key, the layer and the fix."
    from torchtune_lit.models.tiny import lora_tiny_moe_llama

    with pytest.raises(ValueError, match=rf"^{switch}: layers\.0\.mlp is a mixture of experts") as refusal:
        lora_tiny_moe_llama(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4,
                            lora_alpha=8, **{switch: True})
    assert f"set {switch}=False" in str(refusal.value)
