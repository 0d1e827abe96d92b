"""`enable_activation_checkpointing` in the recipes: the same losses as without it (recomputation changes memory, not
mathematics), through the installed `tunelit` as a user runs it; and the memory planner's terms for FSDP2 sharding,
QLoRA's NF4 shards and CPU offload against the measured peak of a sharded step."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_lit.training import read_jsonl

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=4", "progress_bar=false", "preflight=false"]


@pytest.mark.parametrize("recipe,config", [("lora_finetune_single_device", "tiny/lora"),
                                           ("full_finetune_single_device", "tiny/full")])
def test_activation_checkpointing_keeps_the_losses(tmp_path, recipe, config):
    losses = {}
    for checkpointing in (False, True):
        out = tmp_path / str(checkpointing)
        result = subprocess.run([TUNELIT, "run", recipe, "--config", config, f"output_dir={out}", *COMMON,
                                 f"enable_activation_checkpointing={str(checkpointing).lower()}"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        losses[checkpointing] = [row["loss"] for row in read_jsonl(out / "log.jsonl")]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


# The memory planner's FSDP2 terms against the measured peak of a sharded step, per rank: a torchrun worker builds
# the tiny model as the distributed recipes do (load_sharded_model / load_sharded_lora_model: FSDP2 over 2 CPU processes,
# QLoRA's NF4 base as 4-bit shards), steps once (AdamW's states), then measures the tensor peak of the second step
# with training.memory.measure_step_peak (the same tracker the memory chapter checks the one-process terms with).
MEMORY_WORKER = '''
import functools, json, sys, tempfile
from pathlib import Path
import torch
import torchtune_lit
from torchtune_lit import training
from torchtune_lit.models.tiny import lora_tiny_llama, qlora_tiny_llama, tiny_llama
from torchtune_lit.modules.peft import get_adapter_params, set_trainable_params
from torchtune_lit.training.memory import estimate_training_memory, measure_step_peak

BASE = Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "base"
rank, world, device = training.init_distributed()
results = []
for case in sys.argv[2:]:
    kind, shape, offload = case.split(":")
    batch, seq = map(int, shape.split("x"))
    offload = offload == "offload"
    lora = dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=8, lora_alpha=16)
    build = {"full": tiny_llama, "qlora": functools.partial(qlora_tiny_llama, **lora)}[kind]
    checkpointer = training.FullModelHFCheckpointer(checkpoint_dir=str(BASE), output_dir=tempfile.mkdtemp())
    torch.manual_seed(0)
    load = training.load_sharded_model if kind == "full" else training.load_sharded_lora_model
    model = load(build, checkpointer, rank, device, torch.float32, cpu_offload=offload)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tokens = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(rank))

    def step():
        logits = model(tokens).float().flatten(0, 1)
        torch.nn.functional.cross_entropy(logits, tokens.flatten(), reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    measured = measure_step_peak(step, model, optimizer)
    with torch.device("meta"):
        plain = build()
    if kind != "full":
        set_trainable_params(plain, get_adapter_params(plain))
    plan = estimate_training_memory(plain, batch, seq, torch.float32, device=torch.device("cpu"),
                                    world_size=world, fsdp_cpu_offload=offload)
    alone = estimate_training_memory(plain, batch, seq, torch.float32, device=torch.device("cpu"))
    results.append(dict(case=case, measured=measured, device=plan.total, host=plan.host, alone=alone.total))
    del model, optimizer
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results))
'''


def test_planner_fsdp_terms_match_a_measured_sharded_step(tmp_path):
    """FSDP2 over 2 processes, full and QLoRA, two shapes (weights-heavy 1 x 64, activation-heavy 4 x 256): the
    planner's per-rank peak (1/2 of the weights, gradients and states; the root group and two layers gathered; an NF4
    base sharded as NF4) is within 20 % of the measured peak and never below it (measured 2026-12-03: +6 % to +16 %;
    the largest gap, QLoRA at 1 x 64, is the second gathered layer, which the planner counts for the layer prefetched
    in backward). With fsdp_cpu_offload on this CPU the host is the device, so only the sum can be measured: device +
    host predicted within 30 % of it, above it (measured +16 %, +22 %), and the device part alone far below the
    unsharded peak."""
    import json

    worker = tmp_path / "worker.py"
    worker.write_text(MEMORY_WORKER)
    cases = ["full:1x64:keep", "qlora:1x64:keep", "full:4x256:keep", "qlora:4x256:keep",
             "full:1x64:offload", "qlora:1x64:offload"]
    out = tmp_path / "peaks.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(worker), str(out), *cases], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())}
    for case, row in rows.items():
        print(f"{case:20} measured {row['measured'] / 2**20:7.2f} MiB  device {row['device'] / 2**20:7.2f}  "
              f"host {row['host'] / 2**20:6.2f}  one process {row['alone'] / 2**20:7.2f}")
    for case in cases[:4]:
        row = rows[case]
        assert row["host"] == 0
        assert 0 <= row["device"] / row["measured"] - 1 < 0.20, (case, row)
    # sharding a full fine-tune's weights, gradients and AdamW states: the weights-heavy step falls by a third
    full = rows["full:1x64:keep"]
    assert full["measured"] < 0.7 * full["alone"] and full["device"] < 0.75 * full["alone"]
    for case in cases[4:]:
        row = rows[case]
        assert 0 <= (row["device"] + row["host"]) / row["measured"] - 1 < 0.30, (case, row)
        assert row["device"] < rows[case.replace("offload", "keep")]["device"]
