"""The tiny vision model trains through the full fine-tuning recipe (tiny/vision: images in the batches, the whole
model saved in Mllama's format with `model_type: LLAMA3_VISION`), and the checkpoint it writes loads in transformers
(`MllamaForConditionalGeneration`) with our logits, on text alone and with a picture."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from PIL import Image
from safetensors.torch import load_file

import torchtune_lit
from torchtune_lit.data import Message, padded_collate_tiled_images_and_mask
from torchtune_lit.models.llama3_2_vision import llama3_2_vision_from_hf_config
from torchtune_lit.models.tiny_vision import tiny_llama_vision, tiny_vision_transform
from torchtune_lit.training import FullModelHFCheckpointer

TUNELIT = str(Path(sys.executable).parent / "tunelit")
CONFIG = Path(torchtune_lit.__file__).parent / "recipes" / "configs" / "tiny" / "vision.yaml"


def _hf_inputs(batch: dict) -> dict:
    """transformers' inputs for our one-image, one-tile batch, padded to the model's 2 tiles: pixels, the aspect
    ratio's id (1 + the index of (1, 1)), the real-tile mask, and which tiles each token sees (all: the real one)."""
    images = batch["encoder_input"]["images"]  # [b, 1, 1, 3, 28, 28]
    pixels = torch.cat([images, torch.zeros_like(images)], dim=2)
    b, s, _ = batch["encoder_mask"].shape
    # every token sees the real tile: transformers and we treat a row that sees no tile differently (it drops the
    # mask for that row's attention and zeroes only the MLP branch; torchtune and we zero both branches)
    cross = torch.tensor([1, 0]).expand(b, s, 1, 2)  # [b, s, 1 image, 2 tiles]
    return dict(
        pixel_values=pixels, aspect_ratio_ids=torch.ones(b, 1, dtype=torch.long),
        aspect_ratio_mask=torch.tensor([[[1, 0]]]).expand(b, 1, 2), cross_attention_mask=cross,
    )


def test_vision_recipe_trains_and_checkpoint_loads_in_transformers(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [TUNELIT, "run", "full_finetune_single_device", "--config", str(CONFIG), f"output_dir={out}",
         "progress_bar=false", "epochs=1", "max_steps_per_epoch=12", "validation_dataset=null"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = out / "epoch_0"
    trained, base = load_file(folder / "model.safetensors"), load_file(CONFIG.parent.parent.parent.parent
                                                                          / "assets" / "tiny" / "vision_base"
                                                                          / "model.safetensors")
    assert trained.keys() == base.keys()
    gates = [k for k in trained if k.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate"))]
    assert len(gates) == 4 and all(trained[k].abs().item() > 0 for k in gates), "training opens the gates"
    assert any("vision_model" in k and not torch.equal(trained[k], base[k]) for k in trained), "the encoder trains"

    ours = tiny_llama_vision().eval()
    ours.load_state_dict(FullModelHFCheckpointer(folder, model_type="LLAMA3_VISION").load_checkpoint()["model"])
    theirs = transformers.MllamaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    transform = tiny_vision_transform()
    pictures = [Image.new("RGB", (28, 28), c) for c in ((230, 40, 40), (40, 200, 60))]
    samples = []
    for picture in pictures:
        parts = [{"type": "image", "content": picture}, {"type": "text", "content": "What colour is the shape?"}]
        sample = transform({"messages": [Message("user", parts)]}, inference=True)
        samples.append({**sample, "labels": sample["tokens"]})
    batch = padded_collate_tiled_images_and_mask(samples)
    with torch.no_grad():  # text alone: the same computation in both libraries
        text = batch["tokens"].masked_fill(batch["tokens"] >= 2048, 0)
        torch.testing.assert_close(ours(text), theirs(input_ids=text).logits, atol=1e-4, rtol=1e-4)
        # with the picture: transformers 5.25 keeps the outputs of the layers intermediate_layers_indices names,
        # torchtune (and we) their inputs, so its model is ours built from the indices plus one
        config = json.loads((folder / "config.json").read_text())
        vision = {**config["vision_config"]}
        vision["intermediate_layers_indices"] = [i + 1 for i in vision["intermediate_layers_indices"]]
        shifted = llama3_2_vision_from_hf_config({**config, "vision_config": vision}).eval()
        shifted.load_state_dict(ours.state_dict())
        hf = _hf_inputs(batch)
        expected = theirs(input_ids=batch["tokens"], **hf).logits
        pixels = {"images": hf["pixel_values"], "aspect_ratio": torch.tensor([[[1, 1]]]).expand(2, 1, 2)}
        mask = hf["cross_attention_mask"].repeat_interleave(17, dim=3).flatten(2).bool()
        actual = shifted(batch["tokens"], encoder_input=pixels, encoder_mask=mask)
    assert (expected - theirs(input_ids=batch["tokens"]).logits).abs().max() > 1e-3, "the picture changes the logits"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_vision_two_processes_match_one(tmp_path):
    "FSDP2 shards the decoder's, the CLIP's and the projection head's layers; 2 processes at batch 2 = 1 at batch 4."
    common = ["epochs=1", "max_steps_per_epoch=4", "shuffle=true", "~lr_scheduler", "validation_dataset=null"]
    single = subprocess.run([TUNELIT, "run", "full_finetune_single_device", "--config", str(CONFIG), "batch_size=4",
                             f"output_dir={tmp_path / 'single'}", "progress_bar=false", *common],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", "29587", "full_finetune_distributed",
                            "--config", str(CONFIG), "batch_size=2", f"output_dir={tmp_path / 'multi'}", *common],
                           capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / side / "log.jsonl").read_text().splitlines()]
              for side in ("single", "multi")]
    assert len(losses[0]) == len(losses[1]) == 4
    for x, y in zip(*losses):
        assert abs(x - y) <= 1e-5 * abs(x), losses
    # the gathered model (the fusion layers' renamed keys included) is the one-process model
    a, b = (load_file(tmp_path / side / "epoch_0" / "model.safetensors") for side in ("single", "multi"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-4, rtol=1e-3, msg=key)
