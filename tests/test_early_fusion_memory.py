"""The memory planner on early-fusion models (chapter 76): Gemma 3 whole (`Gemma3EarlyFusionModel`) and Llama 4
Scout whole (`EarlyFusionModel`), built on the meta device.

An early-fusion model is its decoder over the sequence (image tokens among its positions) plus each encoder that
trains; a frozen encoder keeps nothing. So with the encoder frozen the planner's activations and loss equal those of
the decoder alone, exactly, and the weights are the decoder's plus the encoder's. Gemma 3's default (the projector
trains, the tower frozen) adds only the projector's terms over the 256 pooled tokens of each image; an encoder of a
kind the planner does not model is refused with a ValueError naming it. The FSDP2 terms shard over `shard_model`'s
units.
"""
import pytest
import torch

from torchtune_lit.models.gemma3 import gemma3_vision_4b
from torchtune_lit.models.llama4 import lora_llama4_scout_17b_16e
from torchtune_lit.modules.common_utils import fsdp_units
from torchtune_lit.training.memory import estimate_training_memory

def _lora_only(model):
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


@pytest.mark.parametrize("build", ["gemma3_4b", "llama4_scout"])
def test_frozen_encoder_adds_only_its_weights(build):
    with torch.device("meta"):
        if build == "gemma3_4b":
            model = gemma3_vision_4b(decoder_trainable=True, encoder_trainable=False, fusion_trainable=False)
            encoder = model.encoder
        else:
            model = _lora_only(lora_llama4_scout_17b_16e(["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                                                         lora_rank=16, lora_alpha=32))
            encoder = model.encoders["vision"]
    assert not any(p.requires_grad for p in encoder.parameters())
    for checkpointing in (False, True):
        whole = estimate_training_memory(model, 2, 1024, activation_checkpointing=checkpointing,
                                         images_per_sample=2, device=torch.device("cuda"))
        alone = estimate_training_memory(model.decoder, 2, 1024, activation_checkpointing=checkpointing,
                                         device=torch.device("cuda"))
        assert (whole.activations, whole.loss, whole.recomputed) == (alone.activations, alone.loss, alone.recomputed)
        encoder_bytes = 2 * sum(p.numel() for p in encoder.parameters())
        assert whole.weights == alone.weights + encoder_bytes
    sharded = estimate_training_memory(model, 2, 1024, world_size=8, device=torch.device("cuda"))
    assert sharded.total < whole.total
    assert len(fsdp_units(model)) == len(model.decoder.layers) + len(encoder.clip.layers if build != "gemma3_4b"
                                                                     else encoder.siglip.layers)


def test_gemma3_projector_adds_its_pooled_tokens_only():
    """The projector trains, the tower is frozen: autograd records from the projector's RMSNorm on, so per pooled
    token (256 an image) the norm keeps its fp32 input and normalised value (4 + 4 bytes x 1,152) and the linear
    its bf16 input (2 x 1,152): 256 x 11,520 bytes an image more than with the projector frozen."""
    with torch.device("meta"):
        projector = gemma3_vision_4b(decoder_trainable=True, encoder_trainable=False, fusion_trainable=True)
        frozen = gemma3_vision_4b(decoder_trainable=True, encoder_trainable=False, fusion_trainable=False)
    args = dict(images_per_sample=1, device=torch.device("cuda"))
    with_projector = estimate_training_memory(projector, 2, 1024, **args)
    without = estimate_training_memory(frozen, 2, 1024, **args)
    assert with_projector.activations - without.activations == 2 * 256 * (8 + 2) * 1152


def test_encoder_of_unknown_kind_is_refused_by_name():
    with torch.device("meta"):
        model = gemma3_vision_4b()
        model.encoder = torch.nn.Linear(8, 8)  # trains, and has neither `clip` nor `siglip`
    with pytest.raises(ValueError, match="Linear trains"):
        estimate_training_memory(model, 1, 512)


def test_preflight_reads_llama4_whole_as_a_vision_model():
    """The preflight's memory finding on Llama 4 Scout whole (which has `encoders`, not `encoder`): the vision wording
    with context parallelism off, and a warning instead of the planner's ValueError with it on."""
    from torchtune_lit.training.preflight import RunPlan, memory_findings

    with torch.device("meta"):
        model = _lora_only(lora_llama4_scout_17b_16e(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16))
    plan = RunPlan(batch_size=1, dtype=torch.bfloat16, device=torch.device("cpu"))
    (finding,) = memory_findings(plan, model, max_tokens_per_sample=512)
    assert "one image a sample" in finding["message"]
    plan.context_parallel_dim = 2
    (finding,) = memory_findings(plan, model, max_tokens_per_sample=512)
    assert finding["level"] == "warn" and "no memory prediction" in finding["message"]
