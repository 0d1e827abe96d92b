"""`enable_activation_offloading` and `optimizer_in_bwd` in the distributed fine-tunes (chapters 82 and 83): the same
config run by two processes under torchrun (Gloo, batch 2 each) logs the losses of one process (batch 4), as
tests/test_distributed.py checks without them. Five short runs in all (about 80 s on 2 cores): the full fine-tune with
optimizer_in_bwd, 1 and 2 processes, then the 2-process run resumed; LoRA with both switches, 1 and 2 processes.
(Context parallelism with activation checkpointing is tests/test_context_parallel.py's.)

Tolerances. Both sides run the same recipe on the same rows; two processes add the same fp32 numbers in another order
(each rank's token sums, FSDP2's reduce-scatter), so they agree to fp32 rounding, not bit for bit: per-step losses
relative 1e-5 (as tests/test_context_parallel.py's recipe runs; measured ~1e-7), saved weights absolute 2e-4 and
relative 1e-3 (as tests/test_distributed.py's; measured below 1e-6). A run resumed from its own sharded checkpoint
recomputes the rest bit for bit (losses and weights exactly equal)."""
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=3", "shuffle=true", "progress_bar=false", "preflight=false",
          "~validation_dataset"]
IN_BWD = ["optimizer_in_bwd=true", "clip_grad_norm=null"]   # clipping needs every gradient at once: refused with it


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def run(nproc: int, recipe: str, config: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    "The recipe under torchrun with `nproc` processes; batch 4 in all (2 per process with two)."
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", str(nproc), "--master_port", free_port(), recipe,
                             "--config", config, f"batch_size={4 // nproc}", f"output_dir={out}", *COMMON, *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_two_equal_one(tmp_path: Path, files: tuple[str, ...]) -> None:
    a, b = losses(tmp_path / "one" / "log.jsonl"), losses(tmp_path / "two" / "log.jsonl")
    print("1 process:", a, "\n2 processes:", b)
    assert len(a) == len(b) == 3 and a[-1] < a[0]
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
    for name in files:
        ours, theirs = (load_file(tmp_path / side / "epoch_0" / name) for side in ("two", "one"))
        assert ours.keys() == theirs.keys()
        worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
        print(f"{name}: largest difference {worst:.1e}")
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)


def test_optimizer_in_bwd_two_processes_equal_one_and_resume(tmp_path):
    """One AdamW per parameter shard, stepped by FSDP2's post-accumulate-grad hook: 2 processes log 1 process's losses
    and save its weights. The two-process run saved a sharded step_2 (per-parameter AdamW states and the warm-up
    schedule's position); resumed from it, it recomputes step 3 to the same loss and the same final weights, bit for
    bit — which needs the restored moments and rate, since step 3's update is the last thing the weights saw."""
    run(1, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "one", *IN_BWD)
    run(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "two", *IN_BWD, "save_every_n_steps=2")
    assert_two_equal_one(tmp_path, ("model.safetensors",))
    two = tmp_path / "two"
    uninterrupted = losses(two / "log.jsonl")
    shutil.copy(two / "epoch_0" / "model.safetensors", tmp_path / "uninterrupted.safetensors")
    assert sorted(p.name for p in two.glob("step_*")) == ["step_2"]
    resumed = run(2, "full_finetune_distributed", "tiny/full_distributed", two, *IN_BWD, "save_every_n_steps=2",
                  "resume_from_checkpoint=true")
    assert "Resuming from" in resumed.stdout and "step_2" in resumed.stdout
    assert losses(two / "log.jsonl") == uninterrupted
    again, before = load_file(two / "epoch_0" / "model.safetensors"), load_file(tmp_path / "uninterrupted.safetensors")
    assert again.keys() == before.keys() and all(torch.equal(again[k], before[k]) for k in again)


def test_lora_optimizer_in_bwd_and_activation_offloading_two_processes_equal_one(tmp_path):
    """LoRA: only the adapters get an optimizer (and a hook); activation offloading wraps each forward pass (on a CPU
    it moves nothing and says so, so the numbers must not change). 2 processes log 1 process's losses and save its
    adapter and merged model."""
    for nproc, side in ((1, "one"), (2, "two")):
        result = run(nproc, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / side, *IN_BWD,
                     "enable_activation_offloading=true")
        assert result.stderr.count("activation offloading moves activations from GPU to CPU memory") == nproc
    assert_two_equal_one(tmp_path, ("model.safetensors", "adapter/adapter_model.safetensors"))
