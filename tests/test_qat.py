"""Quantization-aware training recipes: the fake quantization is really in the forward pass (the losses differ from
the plain recipes'), two FSDP2 processes at batch 2 train like one at batch 4, and the quantize recipe turns the saved
float checkpoint into the int4 model with the numbers training saw."""
import json
import subprocess
import sys
from pathlib import Path

import torch

TUNELIT = str(Path(sys.executable).parent / "tunelit")
COMMON = ["epochs=1", "max_steps_per_epoch=4", "shuffle=true", "~lr_scheduler", "~validation_dataset", "preflight=false"]


def run(*args: str) -> None:
    result = subprocess.run([TUNELIT, "run", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "log.jsonl").read_text().splitlines()]


def test_qat_distributed_matches_qat_single_device_and_differs_from_plain_training(tmp_path):
    run("qat_single_device", "--config", "tiny/qat", "batch_size=4", f"output_dir={tmp_path / 'single'}",
        "progress_bar=false", *COMMON)
    run("--nproc_per_node", "2", "--master_port", "29591", "qat_distributed", "--config", "tiny/qat_distributed",
        "batch_size=2", f"output_dir={tmp_path / 'multi'}", *COMMON)
    run("full_finetune_single_device", "--config", "tiny/full", "batch_size=4", f"output_dir={tmp_path / 'plain'}",
        "progress_bar=false", *COMMON)
    single, multi, plain = (losses(tmp_path / n) for n in ("single", "multi", "plain"))
    print("QAT:", single, "QAT FSDP2 x2:", multi, "plain:", plain)
    assert len(single) == len(multi) == 4
    # Step 1 sees the same weights; after that the gradients' reduction order differs between one process and two,
    # and a weight that lands within float rounding of a grid midpoint rounds the other way, so the runs may drift by
    # a little more than the 1e-3 of plain training: step 2 within 1e-3, every step within 1e-2.
    assert abs(single[0] - multi[0]) <= 1e-6 * single[0] and abs(single[1] - multi[1]) <= 1e-3 * single[1]
    assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(single, multi)), (single, multi)
    # 8da4w rounding changes the very first forward pass
    assert all(abs(a - b) > 1e-4 for a, b in zip(single, plain)), (single, plain)


def test_qat_lora_distributed_matches_one_process_and_converts(tmp_path):
    lora_common = [*COMMON, "shuffle=false"]
    run("--nproc_per_node", "2", "--master_port", "29533", "qat_lora_finetune_distributed", "--config",
        "tiny/qat_lora_distributed", "batch_size=2", f"output_dir={tmp_path / 'multi'}", *lora_common)
    run("--nproc_per_node", "1", "--master_port", "29593", "qat_lora_finetune_distributed", "--config",
        "tiny/qat_lora_distributed", "batch_size=4", f"output_dir={tmp_path / 'one'}", *lora_common)
    run("--nproc_per_node", "1", "--master_port", "29595", "lora_finetune_distributed", "--config",
        "tiny/lora_distributed", "batch_size=4", f"output_dir={tmp_path / 'plain'}", *lora_common)
    multi, one, plain = (losses(tmp_path / n) for n in ("multi", "one", "plain"))
    print("QAT LoRA x2:", multi, "x1:", one, "plain LoRA:", plain)
    assert abs(one[0] - multi[0]) <= 1e-6 * one[0]        # as above: rounding makes the later steps drift a little
    assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(one, multi)), (one, multi)
    assert all(abs(a - b) > 1e-4 for a, b in zip(one, plain)), (one, plain)
    # the merged float model converts to 8da4w, and the file reloads to the same perplexity
    saved = tmp_path / "multi" / "epoch_0"
    assert (saved / "adapter" / "adapter_model.safetensors").is_file()
    run("quantize", "--config", "tiny/quantize", f"checkpointer.checkpoint_dir={saved}",
        f"output_dir={tmp_path / 'int4'}", "max_eval_batches=2",
        "quantizer._component_=torchtune_lit.training.quantization.Int8DynActInt4WeightQATQuantizer")
    result = json.loads((tmp_path / "int4" / "quantize.json").read_text())
    assert result["perplexity_quantized_reloaded"] == result["perplexity_quantized_in_memory"]
    assert abs(result["perplexity_quantized_reloaded"] / result["perplexity_original"] - 1) < 0.05, result
    import torchao.quantization  # noqa: F401  (registers its tensor types as safe for weights_only loading)

    state = torch.load(result["quantized_file"], weights_only=True)
    assert type(state["layers.0.attn.q_proj.weight"]).__name__ == "IntxUnpackedToInt8Tensor"
