"""Context parallelism (`context_parallel_dim`, chapter 78d_context_parallel): ring attention across torchrun processes.

Tolerances. The ring adds the same fp32 numbers as one process in another order (softmax in blocks merged by their
log-sum-exps, each rank's partial gradients summed), so they agree to fp32 rounding, not bit for bit: loss relative
1e-5, each parameter's gradient relative 1e-5 as a norm (measured 7.5e-7 at 512 tokens). Memory: the forward pass's
measured tensor peak (activations and loss) per rank against the planner's `activations + loss` with
`context_parallel_dim=2`, within 10 % (the planner's tolerance in 76_memory is 15 %). The recipes: per-step losses
relative 1e-5 (measured 3e-8), also with activation checkpointing on in the ring (each layer recomputed in backward
inside the same ring; measured 5e-8) against one process without it."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtune_lit.models.tiny import tiny_llama
from torchtune_lit.modules.loss import CEWithChunkedOutputLoss
from torchtune_lit.training.context_parallel import (
    check_context_parallel,
    load_balanced_positions,
    shard_batch,
)
from torchtune_lit.training.memory import estimate_training_memory
from torchtune_lit.training.steps import prepare_loss, summed_loss

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SEQ_LEN = 1024
QLORA = "model._component_=torchtune_lit.models.tiny.qlora_tiny_llama"  # NF4 base: nothing changes for attention


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def torchrun(script: Path, *args: str, nproc: int = 2) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", free_port(),
         str(script), *args], capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


MODEL_SCRIPT = r'''
import json, sys
import torch, torch.distributed as dist
import torchtune_lit.training.context_parallel as cp
from torchtune_lit.models.tiny import tiny_llama
from torchtune_lit.modules.loss import CEWithChunkedOutputLoss
from torchtune_lit.training.memory import PeakMemory
from torchtune_lit.training.steps import prepare_loss, summed_loss

dist.init_process_group("gloo")
out, seq_len = sys.argv[1], int(sys.argv[2])
group = cp.context_parallel_group(2)
torch.manual_seed(0)
model = tiny_llama(vocab_size=2048, max_seq_len=seq_len)
loss_fn = prepare_loss(CEWithChunkedOutputLoss(num_output_chunks=8), model)
batch = torch.load(out + "/batch.pt")
tokens, labels, extra = cp.shard_batch(batch, group)
with cp.context_parallel_attention(group), PeakMemory() as forward_peak:
    loss, n = summed_loss(loss_fn, model(tokens, **extra), labels)
with cp.context_parallel_attention(group):
    loss.backward()
summed = torch.stack([loss.detach(), torch.tensor(float(n))])
dist.all_reduce(summed)
grads = {k: p.grad for k, p in model.named_parameters()}
for g in grads.values():
    dist.all_reduce(g)
rank = dist.get_rank()
json.dump({"loss_sum": float(summed[0]), "tokens": int(summed[1]), "forward_peak": forward_peak.peak},
          open(out + f"/rank{rank}.json", "w"))
if rank == 0:
    torch.save(grads, out + "/grads.pt")
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def long_sequence(tmp_path_factory):
    """Two processes with context_parallel_dim=2 on the tiny Llama, 2 rows of SEQ_LEN - 5 = 1019 tokens (one with a
    masked prompt), which shard_batch pads by 1 position to 1020, a multiple of 4."""
    root = tmp_path_factory.mktemp("cp")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (2, SEQ_LEN - 5), generator=g)
    labels = tokens.clone()
    labels[0, :100] = -100
    labels[1, -30:] = -100
    batch = {"tokens": tokens, "labels": labels}
    torch.save(batch, root / "batch.pt")
    (root / "script.py").write_text(MODEL_SCRIPT)
    torchrun(root / "script.py", str(root), str(SEQ_LEN))
    records = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return batch, records, torch.load(root / "grads.pt")


def test_two_processes_equal_one_at_1024_tokens(long_sequence):
    batch, records, grads = long_sequence
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=2048, max_seq_len=SEQ_LEN)
    loss_fn = prepare_loss(CEWithChunkedOutputLoss(num_output_chunks=8), model)
    tokens, labels, _ = shard_batch(batch, None)
    loss, n = summed_loss(loss_fn, model(tokens), labels)
    loss.backward()
    assert records[0]["tokens"] == n == 2 * (SEQ_LEN - 6) - 99 - 30
    assert abs(records[0]["loss_sum"] / n - loss.item() / n) <= 1e-5 * loss.item() / n
    worst = 0.0
    for name, p in model.named_parameters():
        error = float((grads[name] - p.grad).norm() / p.grad.norm())
        worst = max(worst, error)
        assert error <= 1e-5, (name, error)
    print(f"loss {loss.item() / n:.6f}; worst gradient error {worst:.1e}")


def test_activation_memory_per_rank_falls_as_planned(long_sequence):
    batch, records, _ = long_sequence
    model = tiny_llama(vocab_size=2048, max_seq_len=SEQ_LEN)
    loss_fn = prepare_loss(CEWithChunkedOutputLoss(num_output_chunks=8), model)
    planned = {cp: estimate_training_memory(model, 2, SEQ_LEN, torch.float32, loss_fn=loss_fn,
                                            context_parallel_dim=cp) for cp in (1, 2)}
    one, ring = (planned[cp].activations + planned[cp].loss for cp in (1, 2))
    assert abs(ring - one / 2) <= 1e-6 * one                 # the planner: half per rank
    for record in records:
        print(f"planned {ring / 2**20:.1f} MiB per rank (one process {one / 2**20:.1f}), "
              f"measured {record['forward_peak'] / 2**20:.1f}")
        assert abs(record["forward_peak"] - ring) <= 0.10 * ring, (record["forward_peak"], ring)


ATTENTION_SCRIPT = r'''
import sys
import torch, torch.distributed as dist, torch.nn.functional as F
import torchtune_lit.training.context_parallel as cp

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
q, k, v = (torch.randn(2, h, 48, 8, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
w = torch.randn_like(ref)
(ref * w).sum().backward()
pos = cp.load_balanced_positions(48, n, rank)
local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
with cp.context_parallel_attention(dist.new_group(list(range(n)))):
    out = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=True)
(out * w[:, :, pos]).sum().backward()
torch.testing.assert_close(out, ref[:, :, pos], rtol=1e-12, atol=1e-12)
for mine, full in zip(local, (q, k, v)):
    torch.testing.assert_close(mine.grad, full.grad[:, :, pos], rtol=1e-12, atol=1e-12)
dist.destroy_process_group()
'''


def test_ring_of_four_matches_sdpa(tmp_path):
    """Four ranks (a ring of 4 steps forward and back, grouped kv heads) against SDPA on the whole sequence, fp64."""
    script = tmp_path / "attention.py"
    script.write_text(ATTENTION_SCRIPT)
    torchrun(script, nproc=4)


def test_split_and_refusals():
    assert load_balanced_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    batch = {"tokens": torch.arange(6)[None], "labels": torch.arange(6)[None]}
    tokens, labels, extra = shard_batch(batch, None)
    assert labels.tolist() == [[1, 2, 3, 4, 5, -100]] and not extra
    for kwargs, expected in [
        (dict(context_parallel_dim=3, world_size=2), "context_parallel_dim=3 must divide the number of processes (2)"),
        (dict(context_parallel_dim=2, world_size=2, packed=True), "packed with context_parallel_dim=2"),
        (dict(context_parallel_dim=2, world_size=2, compile=True), "compile with context_parallel_dim=2"),
        (dict(context_parallel_dim=2, world_size=4, tensor_parallel_dim=2), "tensor_parallel_dim with context_par"),
        (dict(context_parallel_dim=2, world_size=2, model=torch.nn.Sequential(Windowed())), "0 uses a sliding window"),
    ]:
        with pytest.raises(ValueError, match=re.escape(expected)):
            check_context_parallel(**kwargs)
    check_context_parallel(2, 4, model=tiny_llama(vocab_size=2048))   # two groups of two; plain causal attention


class Windowed(torch.nn.Module):
    "An attention that looks back only 8 positions: the ring computes full causal attention, so it is refused."
    sliding_window = 8


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


COMMON = ["epochs=1", "max_steps_per_epoch=3", "shuffle=false", "~lr_scheduler", "progress_bar=false",
          "~validation_dataset", "preflight=false", "batch_size=4"]


@pytest.mark.parametrize("one, recipe, config, extra", [
    (["--nproc_per_node", "1", "full_finetune_distributed", "--config", "tiny/full_distributed"],
     "full_finetune_distributed", "tiny/full_distributed", []),
    # (QLoRA under FSDP2 needs 2 processes: its one-process run is the single-device recipe, as in
    # test_distributed_qlora.py)
    (["lora_finetune_single_device", "--config", "tiny/lora", QLORA],
     "lora_finetune_distributed", "tiny/lora_distributed", [QLORA]),
])
def test_recipe_two_processes_equal_one(tmp_path, one, recipe, config, extra):
    """From the CLI: 2 processes with context_parallel_dim=2 (one data-parallel group) log the per-step losses of one
    process on the same batches: the full fine-tune, and LoRA with an NF4 base (QLoRA)."""
    run(*one, f"output_dir={tmp_path / 'one'}", *COMMON)
    run("--nproc_per_node", "2", "--master_port", free_port(), recipe, "--config", config,
        "context_parallel_dim=2", f"output_dir={tmp_path / 'ring'}", *COMMON, *extra)
    a, b = losses(tmp_path / "one" / "log.jsonl"), losses(tmp_path / "ring" / "log.jsonl")
    print(recipe, a, b)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def test_validation_through_the_ring_equals_one_process(tmp_path):
    """Validation on with context_parallel_dim=2: each rank forwards its chunks of each held-out row through the ring
    (shard_batch + context_parallel_attention, as in training), and val_loss equals one process's, relative 1e-5. The
    ring side also checkpoints every layer (enable_activation_checkpointing=true; the one process does not): each
    layer is recomputed in backward inside the same ring (recompute_in_ring), so the training losses are still the one
    process's, relative 1e-5."""
    val = [c for c in COMMON if c != "~validation_dataset"]
    val += ["run_val_every_n_steps=3", "max_validation_batches=2"]
    run("--nproc_per_node", "1", "full_finetune_distributed", "--config", "tiny/full_distributed",
        f"output_dir={tmp_path / 'one'}", *val)
    run("--nproc_per_node", "2", "--master_port", free_port(), "full_finetune_distributed", "--config",
        "tiny/full_distributed", "context_parallel_dim=2", "enable_activation_checkpointing=true",
        f"output_dir={tmp_path / 'ring'}", *val)
    logs = [[json.loads(line) for line in (tmp_path / run_dir / "log.jsonl").read_text().splitlines()]
            for run_dir in ("one", "ring")]
    a, b = ([row["val_loss"] for row in log if "val_loss" in row] for log in logs)
    print(a, b)
    assert len(a) == len(b) == 1
    assert abs(a[0] - b[0]) <= 1e-5 * abs(a[0]), (a, b)
    a, b = ([row["loss"] for row in log] for log in logs)
    print("one process:", a, "\nring, checkpointed:", b,
          f"\nlargest relative difference {max(abs(x - y) / abs(x) for x, y in zip(a, b)):.1e}")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def test_refused_in_one_line(tmp_path):
    """A split that does not divide the processes, from the CLI; a recipe without context parallelism."""
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", free_port(),
                             "full_finetune_distributed", "--config", "tiny/full_distributed", "context_parallel_dim=3",
                             f"output_dir={tmp_path / 'a'}"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "context_parallel_dim=3 must divide the number of processes (2)" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    result = subprocess.run([TUNELIT, "run", "full_finetune_single_device", "--config", "tiny/full",
                             "+context_parallel_dim=2", f"output_dir={tmp_path / 'b'}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "context_parallel_dim=2: this recipe does not implement it" in result.stderr, result.stderr[-3000:]
