"""FSDP2 on an early-fusion model (Llama 4 whole: text decoder + vision tower + projection head), chapter 73.

`shard_model` shards every member of a `layers` ModuleList (`fsdp_units`): for `EarlyFusionModel` the decoder's layers
and the vision tower's (`encoders.vision.clip.layers`), the rest with the root. Two CPU processes (torchrun, Gloo)
each take two of four rows, each row holding one image's 4 placeholder tokens and its image; one full fine-tuning step
(everything trains, the tower too: its sharded layers get gradients) with the recipes' summed cross-entropy scaled by
world size / global tokens, then SGD. The reference is one process without FSDP on all four rows from the same
initial weights. Tolerances as chapter 73's 2-vs-1 check: the loss and every updated weight within 1e-5 absolute
(measured: loss 5e-7, weights 1.2e-7).
"""
import json
import os
import socket
import subprocess
import sys

import torch

# the tiny model and batch, executed here and in the torchrun script alike
SETUP = r'''
import torch
from torchtune_lit.models.llama4 import llama4_decoder, llama4_vision_encoder
from torchtune_lit.modules.model_fusion import EarlyFusionModel
from torchtune_lit.training import scale_grads, shift_labels, summed_cross_entropy

IMAGE, PER_IMAGE, LR = 100, 4, 0.5  # placeholder id; (28 // 7)**2 patches -> 4 vectors


def tiny_llama4():
    "A tiny Llama 4 whole: MoE and dense, chunked-RoPE and NoPE layers; a 2-layer tower."
    torch.manual_seed(0)
    decoder = llama4_decoder(
        vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, hidden_dim=24,
        mlp_hidden_dim=40, max_seq_len=64, num_experts=4, moe_layers=[1], skip_rope_interval=2,
        attention_chunk_size=4)
    tower = llama4_vision_encoder(
        patch_size=7, num_heads=2, clip_embed_dim=16, clip_num_layers=2, projection_embed_dim=24,
        decoder_embed_dim=32, tile_size=28)
    return EarlyFusionModel(decoder, {"vision": tower}, {"vision": IMAGE}, decoder_trainable=True,
                            encoders_trainable=True, fusion_trainable=True)


def batch():
    "4 rows of 16 tokens, each with one image's placeholders at positions 2-5, and the 4 images."
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, IMAGE, (4, 16), generator=gen)
    tokens[:, 2:2 + PER_IMAGE] = IMAGE
    return tokens, torch.randn(4, 3, 28, 28, generator=gen)


def summed_loss(model, tokens, images):
    "The recipes' summed token cross-entropy of `tokens` with their images, and its token count."
    labels = shift_labels(tokens)
    logits = model(tokens, encoder_input={"vision": {"images": images}})
    return summed_cross_entropy(logits, labels), int((labels != -100).sum())
'''

SCRIPT = SETUP + r'''
import sys
import torch.distributed as dist
from torchtune_lit.training import all_reduce_sum
from torchtune_lit.training import sharding as fsdp

rank, world_size, device = fsdp.init_distributed()
model = tiny_llama4()
units = [n for n, m in model.named_modules() if any(m is u for u in fsdp.fsdp_units(model))]
fsdp.shard_model(model)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
tokens, images = batch()
rows = slice(2 * rank, 2 * rank + 2)  # this rank's rows and their images
loss, count = summed_loss(model, tokens[rows], images[rows])
loss.backward()
n = all_reduce_sum(count, device)
scale_grads(model, world_size / n)
optimizer.step()
mean_loss = all_reduce_sum(loss.item(), device) / n
weights = fsdp.gather_full_state_dict(model)
if rank == 0:
    torch.save({"loss": mean_loss, "weights": weights, "units": units}, sys.argv[1])
dist.destroy_process_group()
'''


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_two_processes_equal_one_on_a_tiny_llama4_whole(tmp_path):
    script, out = tmp_path / "fsdp_early_fusion.py", tmp_path / "result.pt"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
         str(script), str(out)], capture_output=True, text=True, timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(out, weights_only=True)
    # the units: the decoder's two layers and the tower's two, nothing else
    assert result["units"] == ["decoder.layers.0", "decoder.layers.1", "encoders.vision.clip.layers.0",
                               "encoders.vision.clip.layers.1"]

    scope = {}
    exec(SETUP, scope)
    model = scope["tiny_llama4"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=scope["LR"])
    tokens, images = scope["batch"]()
    loss, count = scope["summed_loss"](model, tokens, images)
    loss.backward()
    for p in model.parameters():
        p.grad /= count
    optimizer.step()
    expected = model.state_dict()

    print(json.dumps({"loss one process": loss.item() / count, "loss FSDP2 x 2": result["loss"],
                      "largest weight difference": max((result["weights"][k] - v).abs().max().item()
                                                       for k, v in expected.items())}))
    assert abs(result["loss"] - loss.item() / count) <= 1e-5
    assert result["weights"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    # the step moved the tower's sharded layers and the projection head, not only the decoder
    for name in ("encoders.vision.clip.layers.1.attn.q_proj.weight", "encoders.vision.projection.output.0.weight",
                 "decoder.layers.1.mlp.experts.gate_proj"):
        assert (expected[name] - before[name]).abs().max() > 1e-4, name
