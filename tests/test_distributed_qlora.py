"""QLoRA and CPU offload under FSDP2 (torchrun, two CPU processes over Gloo), each against one process.

Tolerances. Two processes at batch 2 add the same fp32 numbers as one process at batch 4 in another order (two half
batches, a reduce-scatter mean, then the W / tokens scaling), so they agree to fp32 rounding, not bit for bit. The NF4
base adds nothing to that: both runs quantise the same checkpoint with the same deterministic torchao code and every
rank holds exactly rank 0's 4-bit codes (nothing is re-quantised), so the dequantised weights each layer computes with
are identical. Per-step losses: relative 1e-5 (measured 7e-8 for QLoRA, 5e-7 for the offloaded full fine-tune).
Saved weights: atol 2e-4, rtol 1e-3, the dense LoRA test's tolerance in test_distributed.py (measured: adapters 1.4e-5,
merged model 3.7e-6; AdamW's normalised updates turn rounding-level gradient differences into ~lr * 1e-3 weight
differences)."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TUNELIT = str(Path(sys.executable).parent / "tunelit")
QLORA = "model._component_=torchtune_lit.models.tiny.qlora_tiny_llama"


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def free_port() -> str:
    """A port no other process listens on: under pytest-xdist this module's fixture can run on both workers at once,
    and two launches on one fixed port would collide."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def close_losses(a: list[float], b: list[float], steps: int) -> None:
    assert len(a) == len(b) == steps, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


QLORA_RUN = ["epochs=1", "max_steps_per_epoch=3", "shuffle=false", "~lr_scheduler", "progress_bar=false",
             "~validation_dataset", QLORA]


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory):
    """The single-device QLoRA run at batch 4 and the two-process one at batch 2 (with a sharded step_2), once for
    the tests below; returns their folder and the two-process launch arguments."""
    root = tmp_path_factory.mktemp("qlora")
    run("lora_finetune_single_device", "--config", "tiny/lora", "batch_size=4", "preflight=false",
        f"output_dir={root / 'single'}", *QLORA_RUN)
    launch = ["--nproc_per_node", "2", "--master_port", free_port(), "lora_finetune_distributed", "--config",
              "tiny/lora_distributed", "batch_size=2", f"output_dir={root / 'multi'}", "save_every_n_steps=2",
              *QLORA_RUN]
    run(*launch)
    return root, launch


def test_qlora_two_processes_match_one(qlora_runs):
    """QLoRA sharded by FSDP2: two processes log the single-device QLoRA losses and save the same adapter and a merged
    model that is the dequantised NF4 base plus the adapter (checked with torchao and peft)."""
    root, _ = qlora_runs
    a, b = losses(root / "single" / "log.jsonl"), losses(root / "multi" / "log.jsonl")
    print("single:", a, "\nFSDP2 x2:", b)
    close_losses(a, b, 3)
    assert a[-1] < a[0]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = (load_file(root / side / "epoch_0" / name) for side in ("multi", "single"))
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key].dtype == torch.float32, key    # plain weights: the NF4 base was dequantised
            torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)

    # the merged model is the dequantised base with the adapter merged: torchao's NF4 of the base, then peft's merge
    import transformers
    from peft import PeftModel
    from torchao.quantization import to_nf4

    import torchtune_lit
    base_dir = Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "base"
    checkpoint = load_file(base_dir / "model.safetensors")            # bf16
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("_proj.weight"):       # the projections a qlora_ builder stores in NF4
                nf4 = to_nf4(torch.zeros_like(p))    # an fp32 NF4 weight (dtype=fp32) loading the bf16 checkpoint
                nf4.copy_(checkpoint[name])
                p.copy_(nf4.get_original_weight())
    merged = PeftModel.from_pretrained(base, root / "multi" / "epoch_0" / "adapter").merge_and_unload()
    ours = load_file(root / "multi" / "epoch_0" / "model.safetensors")
    expected = merged.state_dict()
    assert ours.keys() <= expected.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], expected[key], atol=1e-6, rtol=1e-5, msg=key)  # 7e-9 measured


def test_qlora_resumes_from_sharded_checkpoint(qlora_runs):
    """The sharded step checkpoint of a QLoRA run (NF4 shards included) resumes: step 3 is redone bit for bit."""
    root, launch = qlora_runs
    uninterrupted = losses(root / "multi" / "log.jsonl")
    resumed = run(*launch, "resume_from_checkpoint=true")
    assert "Resuming from" in resumed.stdout and "step_2" in resumed.stdout
    assert losses(root / "multi" / "log.jsonl") == uninterrupted


def test_cpu_offload_two_processes_match_one(tmp_path):
    """fsdp_cpu_offload=true (FSDP2's CPUOffloadPolicy: shards, gradients and AdamW states in host memory): on a CPU
    machine it moves nothing, but the run takes the policy's path, and it trains like one process."""
    common = ["epochs=1", "max_steps_per_epoch=4", "shuffle=true", "~lr_scheduler", "progress_bar=false",
              "preflight=false", "~validation_dataset"]
    run("full_finetune_single_device", "--config", "tiny/full", "batch_size=4", f"output_dir={tmp_path / 'single'}",
        *common)
    run("--nproc_per_node", "2", "--master_port", "29643", "full_finetune_distributed", "--config",
        "tiny/full_distributed", "batch_size=2", "fsdp_cpu_offload=true", f"output_dir={tmp_path / 'offload'}", *common)
    a, b = losses(tmp_path / "single" / "log.jsonl"), losses(tmp_path / "offload" / "log.jsonl")
    print("single:", a, "\nFSDP2 x2, CPU offload:", b)
    close_losses(a, b, 4)
    config = (tmp_path / "offload" / "config.yaml").read_text()
    assert "fsdp_cpu_offload: true" in config                     # the run recorded the switch it ran with
    ours, theirs = (load_file(tmp_path / side / "epoch_0" / "model.safetensors") for side in ("offload", "single"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=2e-4, rtol=1e-3, msg=key)

