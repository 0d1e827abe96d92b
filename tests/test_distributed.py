"""FSDP2 under torchrun on CPU (Gloo): two processes at batch 2 train exactly like one process at batch 4, with
shuffling on (both read the data in DistributedSampler order) — fine-tuning and DPO, LoRA and full weights."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=6", "shuffle=true", "progress_bar=false", "~lr_scheduler",
          "run_val_every_n_steps=3", "max_validation_batches=null"]


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    single = subprocess.run([TUNELIT, "run", "full_finetune_single_device", "--config", "tiny/full", "batch_size=4",
                             f"output_dir={tmp_path / 'single'}", *COMMON], capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29517", "full_finetune_distributed",
                            "--config", "tiny/full_distributed", "batch_size=2", f"output_dir={tmp_path / 'multi'}",
                            *[c for c in COMMON if c != "progress_bar=false"]], capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = losses(tmp_path / "single" / "log.jsonl"), losses(tmp_path / "multi" / "log.jsonl")
    print("single:", [f"{x:.5f}" for x in a]); print("FSDP2 x2:", [f"{x:.5f}" for x in b])
    assert len(a) == len(b) == 6
    val = [[r["val_loss"] for r in map(json.loads, (tmp_path / side / "log.jsonl").read_text().splitlines()) if "val_loss" in r]
           for side in ("single", "multi")]
    assert len(val[0]) == len(val[1]) == 2 and all(abs(x - y) <= 1e-3 * x for x, y in zip(*val)), val
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-3 * abs(x), (a, b)
    # the gathered full state dict was written in Hugging Face format and loads in transformers
    saved = tmp_path / "multi" / "epoch_0"
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    single_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "epoch_0")
    for (name, p), (_, q) in zip(model.named_parameters(), single_model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-4, rtol=1e-3, msg=name)


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("recipe,single_recipe,single_config,port", [
    ("lora_dpo_distributed", "lora_dpo_single_device", "tiny/dpo", "29523"),
    ("full_dpo_distributed", "full_dpo_single_device", "tiny/full_dpo", "29525"),
])
def test_two_processes_match_one_in_dpo(tmp_path, recipe, single_recipe, single_config, port):
    """DPO under FSDP2: two processes at batch 2 log the losses, reward margins and accuracies and the held-out metrics
    of one process at batch 4 (shuffling on), and save the same weights."""
    common = ["max_steps_per_epoch=6", "shuffle=true", "run_val_every_n_steps=3", "max_validation_batches=null"]
    single = subprocess.run([TUNELIT, "run", single_recipe, "--config", single_config, "batch_size=4",
                             "progress_bar=false", f"output_dir={tmp_path / 'single'}", *common],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", port, recipe, "--config",
                            f"tiny/{recipe}", "batch_size=2", f"output_dir={tmp_path / 'multi'}", *common],
                           capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = records(tmp_path / "single" / "log.jsonl"), records(tmp_path / "multi" / "log.jsonl")
    print(recipe, "single:", [f"{r['loss']:.5f}" for r in a]); print(recipe, "FSDP2 x2:", [f"{r['loss']:.5f}" for r in b])
    print(recipe, "held-out accuracy:", [r["val_rewards/accuracy"] for r in b if "val_rewards/accuracy" in r])
    assert len(a) == len(b) == 6 and [r["pairs"] for r in b] == [4] * 6
    for key in ("loss", "rewards/margin", "rewards/chosen", "val_loss"):
        x, y = [r[key] for r in a if key in r], [r[key] for r in b if key in r]
        assert len(x) == len(y) and all(abs(u - v) <= 1e-3 * max(abs(u), 1e-2) for u, v in zip(x, y)), (key, x, y)
    for key in ("rewards/accuracy", "val_rewards/accuracy"):
        assert [r[key] for r in a if key in r] == [r[key] for r in b if key in r], key
    name = "adapter/adapter_model.safetensors" if recipe.startswith("lora") else "model.safetensors"
    ours, theirs = (load_file(tmp_path / side / "epoch_0" / name) for side in ("multi", "single"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)


def descendants(pid: int) -> list[int]:
    "Every process below `pid`, from /proc."
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.parametrize("recipe,config,port", [
    ("full_finetune_distributed", "tiny/full_distributed", "29519"),
    ("lora_dpo_distributed", "tiny/lora_dpo_distributed", "29527"),
    ("knowledge_distillation_distributed", "tiny/kd_distributed", "29537"),
])
def test_killed_distributed_run_resumes_exactly_from_sharded_checkpoint(tmp_path, recipe, config, port):
    import os
    import signal
    import time
    args = ["--config", config, "batch_size=2", "epochs=2", "max_steps_per_epoch=5",
            "save_every_n_steps=3", "keep_last_n_checkpoints=2"]
    launch = [TUNELIT, "run", "--nproc_per_node", "2", "--master_port", port, recipe]
    reference = subprocess.run([*launch, *args, f"output_dir={tmp_path / 'reference'}"], capture_output=True, text=True,
                               timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed = tmp_path / "killed"
    process = subprocess.Popen([*launch, *args, f"output_dir={killed}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    log, deadline = killed / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 7):
        time.sleep(0.05)
    for pid in [*descendants(process.pid), process.pid]:     # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)                         # kill the launcher and both ranks after step 7 (epoch 2)
    process.wait()
    time.sleep(1.0)                                          # nothing may still be writing
    assert len(log.read_text().splitlines()) < 9, "the run went on after the kill or finished before it"
    assert sorted(p.name for p in killed.glob("step_*")) == ["step_3", "step_6"]
    assert sorted(p.name for p in (killed / "step_6" / "dcp").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]                        # one shard file per rank

    resumed = subprocess.run([*launch, *args, f"output_dir={killed}", "resume_from_checkpoint=true"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and "step_6" in resumed.stdout
    expected, got = losses(tmp_path / "reference" / "log.jsonl"), losses(log)
    assert len(got) == len(expected) == 10
    assert got == expected                                   # steps 7..10 recomputed bit for bit


def test_wrong_checkpoint_is_refused_on_every_rank(tmp_path):
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29521", "full_finetune_distributed",
                             "--config", "tiny/full_distributed", "model.vocab_size=1024", f"output_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("CheckpointError: the checkpoint does not fit the model") >= 2, result.stderr[-3000:]
    assert "tok_embeddings.weight: checkpoint (2048, 256) vs model (1024, 256)" in result.stderr


def test_lora_two_processes_match_one(tmp_path):
    common = ["epochs=1", "max_steps_per_epoch=5", "shuffle=false", "~lr_scheduler"]
    single = subprocess.run([TUNELIT, "run", "lora_finetune_single_device", "--config", "tiny/lora", "batch_size=4",
                             f"output_dir={tmp_path / 'single'}", "progress_bar=false", "preflight=false",
                             "~validation_dataset", *common], capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29597", "lora_finetune_distributed",
                            "--config", "tiny/lora_distributed", "batch_size=2", f"output_dir={tmp_path / 'multi'}", *common],
                           capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = losses(tmp_path / "single" / "log.jsonl"), losses(tmp_path / "multi" / "log.jsonl")
    print("single:", [f"{x:.5f}" for x in a]); print("FSDP2 x2:", [f"{x:.5f}" for x in b])
    assert len(a) == len(b) == 5 and a[-1] < a[0]
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-3 * abs(x), (a, b)
    from safetensors.torch import load_file
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / "multi" / "epoch_0" / name), load_file(tmp_path / "single" / "epoch_0" / name)
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)


def test_lora_distributed_resumes_from_sharded_checkpoint(tmp_path):
    launch = [TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29599", "lora_finetune_distributed",
              "--config", "tiny/lora_distributed", "batch_size=2", "epochs=1", "max_steps_per_epoch=6",
              "save_every_n_steps=3", f"output_dir={tmp_path}"]
    first = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted = losses(tmp_path / "log.jsonl")
    assert (tmp_path / "step_3" / "recipe_state.pt").is_file()
    again = subprocess.run([*launch, "resume_from_checkpoint=true"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stdout and "step_3" in again.stdout
    assert losses(tmp_path / "log.jsonl") == uninterrupted      # steps 4-6 recomputed from the shards, bit for bit


@pytest.mark.parametrize("processes,batch,port", [(2, 4, "29571"), (4, 2, "29573")])
def test_tensor_parallel_matches_one_process(tmp_path, processes, batch, port):
    """tensor_parallel_dim=2: two processes splitting every layer (tp 2), and four on a 2-D mesh (dp 2 x tp 2, FSDP2
    over dp), log the single-device losses and held-out losses at batch 4 and save the same model. Gloo has every
    collective this needs (all-reduce, all-gather, reduce-scatter); gradient clipping spans both meshes. The four-process
    run names its plan as torchtune's configs do (`tensor_parallel_plan`); the two-process run takes the default."""
    plan = ["+tensor_parallel_plan._component_=torchtune_lit.models.llama3.base_llama_tp_plan"] if processes == 4 else []
    common = ["epochs=1", "max_steps_per_epoch=4", "shuffle=true", "~lr_scheduler", "run_val_every_n_steps=2",
              "max_validation_batches=null"]
    single = subprocess.run([TUNELIT, "run", "full_finetune_single_device", "--config", "tiny/full", "batch_size=4",
                             f"output_dir={tmp_path / 'single'}", "progress_bar=false", *common],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", str(processes), "--master_port", port,
                            "full_finetune_distributed", "--config", "tiny/full_distributed", f"batch_size={batch}",
                            "tensor_parallel_dim=2", f"output_dir={tmp_path / 'tp'}", *common, *plan],
                           capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = records(tmp_path / "single" / "log.jsonl"), records(tmp_path / "tp" / "log.jsonl")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in x:
                assert abs(x[key] - y[key]) <= 1e-4 * abs(x[key]), (key, a, b)
    ours, theirs = load_file(tmp_path / "tp" / "epoch_0" / "model.safetensors"), load_file(
        tmp_path / "single" / "epoch_0" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)


def test_tensor_parallel_refuses_what_it_cannot_split(tmp_path):
    """A LoRA model, a process count that tensor_parallel_dim does not divide, or QAT (torchao's fake-quantized layers
    take no DTensor plan) stops with the reason."""
    lora = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29575",
                           "lora_finetune_distributed", "--config", "tiny/lora_distributed", "tensor_parallel_dim=2",
                           f"output_dir={tmp_path / 'lora'}", "max_steps_per_epoch=1"],
                          capture_output=True, text=True, timeout=600)
    assert lora.returncode != 0 and "LoRA layers are not split" in lora.stderr
    odd = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29577",
                          "full_finetune_distributed", "--config", "tiny/full_distributed", "tensor_parallel_dim=3",
                          f"output_dir={tmp_path / 'odd'}", "max_steps_per_epoch=1"],
                         capture_output=True, text=True, timeout=600)
    assert odd.returncode != 0 and "tensor_parallel_dim=3 must divide the number of processes (2)" in odd.stderr
    qat = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29579", "qat_distributed",
                          "--config", "tiny/qat_distributed", "tensor_parallel_dim=2", f"output_dir={tmp_path / 'qat'}",
                          "max_steps_per_epoch=1"], capture_output=True, text=True, timeout=600)
    assert qat.returncode != 0 and "does not combine fake quantization with tensor parallelism" in qat.stderr


def test_async_checkpoint_killed_in_flight_resumes_from_the_previous_one(tmp_path):
    """enable_async_checkpointing=true: a step checkpoint is written in the background and finished (renamed into
    place) at the next save or at the end of the run. 12 steps, a save every 4: step_4 is finished when step_8's save
    starts, and step_8's stays in flight until the run ends. A run killed in that window (after step 9 is logged, four
    steps wide) leaves step_4 whole and step_8 only as its hidden temporary folder; the resumed run starts from step_4
    and logs the killed run's steps exactly."""
    import os
    import signal
    import time
    args = [TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29649", "full_finetune_distributed",
            "--config", "tiny/full_distributed", "batch_size=2", "epochs=1", "max_steps_per_epoch=12",
            "save_every_n_steps=4", "enable_async_checkpointing=true", "progress_bar=false", "preflight=false",
            "~validation_dataset", f"output_dir={tmp_path}"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = tmp_path / "log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 9):
        time.sleep(0.05)
    for pid in [*descendants(process.pid), process.pid]:
        os.kill(pid, signal.SIGKILL)
    process.wait()
    time.sleep(1.0)
    killed = losses(log)
    assert 9 <= len(killed) <= 11, killed                         # killed while step_8's save was in flight
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4"]
    assert (tmp_path / "step_4" / "recipe_state.pt").is_file()
    assert (tmp_path / ".step_8.tmp-shared").is_dir()             # started, never finished
    assert not (tmp_path / ".step_8.tmp-shared" / "recipe_state.pt").exists()

    resumed = subprocess.run([*args, "resume_from_checkpoint=true"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and "step_4" in resumed.stdout
    again = losses(log)
    assert len(again) == 12 and again[:len(killed)] == killed     # steps 5 on recomputed bit for bit
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_8"]
    assert not list(tmp_path.glob(".step_*"))                     # the stale temporary folder was cleaned up
