"""The tiny mixture-of-experts model in runs: adapter-only step checkpoints with LoRA on the experts, and FSDP2.

- A LoRA run on `tiny/moe_lora` (LoRA on the attention and on every expert) that writes adapter-only step
  checkpoints: the expert adapters, which PEFT has no form for, are written beside the PEFT file as
  `expert_adapters.safetensors` under our names; merged into the base by the rule in their metadata they give the
  merged model the run saves at the end of epoch 0 (the same step).
- FSDP2 (torchrun, two CPU processes over Gloo, a free port per launch) on the tiny MoE with LoRA on its experts: the
  losses equal one process's at the same global batch within 1e-5 relative (measured: ~1e-7).
"""
import json
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import torchtune_lit

TUNELIT = str(Path(sys.executable).parent / "tunelit")
MOE_BASE = Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "moe_base"


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def free_port() -> str:
    "A port no other process listens on (two launches on one fixed port would collide)."
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_adapter_only_step_checkpoints_write_the_expert_adapters(tmp_path):
    run("lora_finetune_single_device", "--config", "tiny/moe_lora", f"output_dir={tmp_path}", "epochs=2",
        "max_steps_per_epoch=2", "save_every_n_steps=2", "~validation_dataset",
        "progress_bar=false", "batch_size=4")
    adapter = tmp_path / "step_2" / "adapter"
    peft_config = json.loads((adapter / "adapter_config.json").read_text())
    assert "experts" not in peft_config["target_modules"] and "q_proj" in peft_config["target_modules"]
    assert not any("experts" in k for k in load_file(adapter / "adapter_model.safetensors"))
    experts = load_file(adapter / "expert_adapters.safetensors")
    with safe_open(adapter / "expert_adapters.safetensors", "pt") as f:
        meta = f.metadata()
    scale = float(meta["lora_alpha"]) / float(meta["r"])
    assert "layers.0.mlp.experts.lora_gate_a" in experts
    # the documented merge, base + (alpha / r) A @ B per expert, gives epoch 0's merged model (step 2 too)
    base = load_file(MOE_BASE / "model.safetensors")
    merged = load_file(tmp_path / "epoch_0" / "model.safetensors")
    for layer in (0, 1):
        a, b = experts[f"layers.{layer}.mlp.experts.lora_gate_a"], experts[f"layers.{layer}.mlp.experts.lora_gate_b"]
        assert b.abs().max() > 0  # trained
        for e in range(a.shape[0]):
            key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight"  # [out, in]
            expected = base[key] + (scale * a[e] @ b[e]).T
            torch.testing.assert_close(merged[key], expected, atol=1e-5, rtol=1e-5)


def test_fsdp2_two_processes_match_one_on_the_tiny_moe(tmp_path):
    common = ["lora_finetune_distributed", "--config", "tiny/lora_distributed", "epochs=1", "max_steps_per_epoch=3",
              "shuffle=false", "~lr_scheduler", "progress_bar=false", "~validation_dataset",
              "model._component_=torchtune_lit.models.tiny.lora_tiny_moe_llama", "model.apply_lora_to_mlp=true",
              f"checkpointer.checkpoint_dir={MOE_BASE}"]
    run("--nproc_per_node", "1", "--master_port", free_port(), *common, "batch_size=4", f"output_dir={tmp_path / 'one'}")
    run("--nproc_per_node", "2", "--master_port", free_port(), *common, "batch_size=2", f"output_dir={tmp_path / 'two'}")
    one, two = losses(tmp_path / "one" / "log.jsonl"), losses(tmp_path / "two" / "log.jsonl")
    print("one process:", one, "\nFSDP2 x2:", two)
    assert len(one) == len(two) == 3 and one[-1] < one[0]
    for x, y in zip(one, two):
        assert abs(x - y) <= 1e-5 * abs(x), (one, two)
