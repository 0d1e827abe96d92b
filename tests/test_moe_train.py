"""The tiny mixture-of-experts model trains with LoRA through the `tunelit` command (tiny/moe_lora), and the merged
checkpoint it writes loads in transformers (`MixtralForCausalLM`) with our logits."""

import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

import torchtune_lit
from torchtune_lit.models.tiny import tiny_moe_llama
from torchtune_lit.training import FullModelHFCheckpointer, load_model_state_dict

TUNELIT = str(Path(sys.executable).parent / "tunelit")
CONFIG = Path(torchtune_lit.__file__).parent / "recipes" / "configs" / "tiny" / "moe_lora.yaml"
BASE = Path(torchtune_lit.__file__).parent / "assets" / "tiny" / "moe_base"


def test_moe_lora_recipe_runs_and_merged_checkpoint_loads_in_transformers(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [TUNELIT, "run", "lora_finetune_single_device", "--config", str(CONFIG), f"output_dir={out}",
         "progress_bar=false", "epochs=1", "max_steps_per_epoch=10", "validation_dataset=null"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = out / "epoch_0"
    # the attention's adapters in PEFT form; the experts' pairs (no PEFT form) under our names beside them
    assert (folder / "model.safetensors").is_file() and (folder / "adapter" / "adapter_model.safetensors").is_file()
    assert (folder / "adapter" / "expert_adapters.safetensors").is_file()
    # the adapters were merged into the experts: every layer's experts moved off the upcycled base
    trained, base = load_file(folder / "model.safetensors"), load_file(BASE / "model.safetensors")
    assert trained.keys() == base.keys()
    moved = [k for k in base if ".experts." in k and not torch.equal(trained[k].float(), base[k].float())]
    assert len(moved) == 4 * 4 * 3, "every expert matrix of every layer carries its merged adapter"
    ours = tiny_moe_llama().eval()
    load_model_state_dict(ours, FullModelHFCheckpointer(folder, model_type="MIXTRAL").load_checkpoint()["model"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = theirs(tokens).logits.float(), ours.float()(tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
