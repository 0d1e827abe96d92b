"""The real-model configs: each names the folder its `tunelit download` comment writes, builds its model on the meta
device (no weights, no memory) with the parameter count of transformers' model of the published config, and fits the
planner's budget."""
import re

import pytest
import torch

import torchtune_lit.config as config
from torchtune_lit._recipe_registry import get_all_recipes
from torchtune_lit.training.memory import estimate_training_memory

REAL = [c for r in get_all_recipes() for c in r.configs if not c.name.startswith("tiny/")]
DISTRIBUTED = {c.name for r in get_all_recipes() if r.supports_distributed for c in r.configs}
# the published configs (test_hf_parity.PUBLISHED) of each config's model: the reference parameter count is that of
# the transformers model built from it on the meta device
REFERENCE = {"llama3_2/1B": "llama3_2.llama3_2_1b", "llama3_2/3B": "llama3_2.llama3_2_3b", "llama3_1/8B": "llama3_1.llama3_1_8b",
             "qwen2_5/0.5B": "qwen2_5.qwen2_5_0_5b", "qwen2_5/1.5B": "qwen2_5.qwen2_5_1_5b", "qwen2_5/7B": "qwen2_5.qwen2_5_7b",
             "gemma2/2B": "gemma2.gemma2_2b", "qwen3/0.6B": "qwen3.qwen3_0_6b", "mistral/7B": "mistral.mistral_7b_v0_3",
             "qwen3/1.7B": "qwen3.qwen3_1_7b", "qwen3/4B": "qwen3.qwen3_4b", "qwen3/8B": "qwen3.qwen3_8b",
             "llama3_3/70B": "llama3_3.llama3_3_70b", "gemma3/1B": "gemma3.gemma3_1b", "gemma3/4B": "gemma3.gemma3_4b",
             "mistral/nemo_12B": "mistral.mistral_nemo_12b", "phi4/14B": "phi4.phi4_14b"}
# the families whose published configs live beside their parity tests (not AutoModelForCausalLM's plain decoders:
# mixtures of experts, Llama 4's text model, the fused Llama 3.2 Vision), and their planner checks per process
MOE_REFERENCE = {"mixtral/8x7B": "mixtral_8x7b", "qwen3_moe/30B": "qwen3_moe_30b_a3b"}
NEW_FAMILIES = ("llama3_2_vision/", "mixtral/", "qwen3_moe/", "llama4/")


def _mllama_parameters(size: str) -> int:
    """MllamaForConditionalGeneration of the published config, with its tile tables laid out as ours: transformers
    stores one row of 4 tiles per aspect ratio (9 rows), torchtune and we a 4 x 4 grid of tile positions (16) — the
    41,036,800-parameter difference test_vision_decoder_parity.test_whole_model_parameter_count derives."""
    from test_vision_decoder_parity import PUBLISHED_TEXT, PUBLISHED_VISION
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    numbers = dict(PUBLISHED_TEXT[size], max_position_embeddings=131_072, pad_token_id=128_004)
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(MllamaConfig(text_config=numbers, vision_config=PUBLISHED_VISION))
    tiles, width, tokens = 4, 1280, (560 // 14) ** 2 + 1
    per_tile = tokens * width + 2 * width  # a tile's entries in the token table and the pre- and post-tile tables
    rows = len(model.config.vision_config.supported_aspect_ratios) + 1
    return sum(p.numel() for p in model.parameters()) - rows * tiles * per_tile + tiles * tiles * per_tile


def reference_parameters(size: str) -> int:
    import transformers
    from test_hf_parity import PUBLISHED
    if size == "llama3_2_vision/11B":
        return _mllama_parameters("11b")
    if size in MOE_REFERENCE:
        import test_moe_parity
        config = {b.__name__: c for b, c in test_moe_parity.PUBLISHED.items()}[MOE_REFERENCE[size]]
        with torch.device("meta"):
            return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size == "llama4/scout_17B":  # the whole model (text decoder, vision tower, projector), as torchtune's config
        from test_llama4_vision_parity import PUBLISHED_VISION, SCOUT_TEXT

        from torchtune_lit.models.llama4 import LLAMA4_PATCH_TOKEN
        config = transformers.Llama4Config(vision_config=PUBLISHED_VISION, text_config=SCOUT_TEXT,
                                           image_token_index=LLAMA4_PATCH_TOKEN)
        with torch.device("meta"):
            model = transformers.Llama4ForConditionalGeneration(config)
        return sum(p.numel() for p in model.parameters())
    if size == "gemma3/4B_vision":  # the whole Gemma3ForConditionalGeneration (decoder, SigLIP, projector)
        from torchtune_lit.models.gemma3 import gemma3_vision_config
        with torch.device("meta"):
            model = transformers.Gemma3ForConditionalGeneration(
                transformers.Gemma3Config(**gemma3_vision_config("gemma3_4b")))
        return sum(p.numel() for p in model.parameters())
    config_cls, numbers = PUBLISHED[REFERENCE[size]]
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config_cls(**numbers)).parameters())


def test_every_family_has_its_configs():
    "torchtune's names: `_single_device` for one device, the plain name for the distributed config."
    names = {c.name for c in REAL}
    single = {"llama3_2/1B_full", "llama3_2/1B_lora", "llama3_2/1B_qlora", "llama3_2/3B_lora", "llama3_1/8B_lora",
              "llama3_1/8B_qlora", "qwen2_5/0.5B_lora", "qwen2_5/1.5B_lora", "qwen2_5/7B_lora", "gemma2/2B_lora",
              "mistral/7B_lora", "qwen3/0.6B_lora", "qwen3/1.7B_lora", "qwen3/4B_lora", "qwen3/8B_lora", "qwen3/8B_qlora",
              "llama3_3/70B_qlora", "gemma3/1B_lora", "gemma3/4B_lora", "mistral/nemo_12B_lora", "phi4/14B_qlora",
              "llama3_1/8B_lora_dpo", "llama3_2/3B_full", "llama3_2/3B_qlora", "qwen2_5/0.5B_full", "qwen2_5/1.5B_full",
              "qwen3/0.6B_full", "qwen3/1.7B_full", "qwen3/4B_full", "gemma2/2B_qlora", "mistral/7B_qlora",
              "llama3_2_vision/11B_lora", "llama3_2_vision/11B_qlora", "gemma3/4B_vision_lora"}
    distributed = {"llama3_2/1B_full", "llama3_2/1B_lora", "llama3_2/3B_lora", "llama3_1/8B_lora", "llama3_1/8B_full",
                   "qwen2_5/0.5B_lora", "qwen2_5/1.5B_lora", "qwen2_5/7B_lora", "qwen3/0.6B_lora", "qwen3/1.7B_lora",
                   "qwen3/4B_lora", "qwen3/8B_lora", "gemma2/2B_lora", "mistral/7B_lora",
                   "llama3_1/8B_lora_dpo", "llama3_1/8B_full_dpo", "llama3_2/3B_full", "qwen2_5/0.5B_full",
                   "qwen2_5/1.5B_full", "qwen3/0.6B_full", "qwen3/1.7B_full", "qwen3/4B_full", "qwen3/8B_full",
                   "gemma2/2B_full", "mistral/7B_full", "llama3_2_vision/11B_lora", "llama3_2_vision/11B_full",
                   "mixtral/8x7B_lora", "qwen3_moe/30B_A3B_lora", "llama4/scout_17B_16E_lora"}
    assert {f"{n}_single_device" for n in single} | distributed <= names
    recipes = {c.name: r for r in get_all_recipes() for c in r.configs}
    assert all(recipes[n].supports_distributed for n in distributed)
    assert not any(recipes[f"{n}_single_device"].supports_distributed for n in single)


@pytest.mark.parametrize("entry", REAL, ids=lambda c: c.name)
def test_real_config(entry):
    text = entry.path.read_text()
    download = re.search(r"#\s+tunelit download (\S+) --output-dir (\S+)", text)
    assert download, f"{entry.name} has no 'tunelit download' comment"
    cfg = config.load_config(entry.name)
    config.validate(cfg)
    assert cfg.checkpointer.checkpoint_dir == download.group(2)
    tokenizer_file = (cfg.tokenizer.get("path") or cfg.tokenizer.get("tokenizer_json_path")
                      or cfg.tokenizer.get("tokenizer"))  # gemma3_transform's tokenizer.json
    assert tokenizer_file.startswith(download.group(2) + "/")
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    frozen_or_full = {n: p.numel() for n, p in model.named_parameters() if ".lora_" not in n}
    size = re.match(r"[^/]+/(?:[a-z]+_)?[\dx.]+B(?:_vision)?", entry.name).group(0)   # llama3_2/1B, mistral/nemo_12B, mixtral/8x7B
    assert sum(frozen_or_full.values()) == reference_parameters(size), entry.name
    if ".lora_" in "".join(n for n, _ in model.named_parameters()):
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
    if entry.name.startswith(NEW_FAMILIES):  # per process: the planner shards over the header's N processes
        _check_per_process_prediction(entry, cfg, model, text)
        return
    estimate = estimate_training_memory(model, cfg.batch_size, cfg.tokenizer.max_seq_len, torch.bfloat16,
                                        activation_checkpointing=cfg.enable_activation_checkpointing)
    # one 80 GB GPU (per rank for FSDP: / 8; a 70B QLoRA) or a 40 GB card
    budget_gib = 80 if "full" in entry.name or "70B" in entry.name else 40
    if "full" in entry.name and entry.name in DISTRIBUTED:  # FSDP over the header's N GPUs: a rank holds 1/N
        ranks = int(re.search(r"tunelit run --nproc_per_node (\d+) ", text).group(1))
        estimate.weights, estimate.gradients, estimate.optimizer_states = (
            estimate.weights / ranks, estimate.gradients / ranks, estimate.optimizer_states / ranks)
    assert estimate.total / 2**30 < budget_gib, (entry.name, estimate.summary())
    if entry.name.startswith(("qwen3/", "llama3_3/", "gemma3/", "mistral/nemo", "phi4/")):   # the header states the planner's prediction
        assert f"batch {cfg.batch_size} x {cfg.tokenizer.max_seq_len} tokens): {estimate.total / 2**30:.1f} GiB" in text


def _check_per_process_prediction(entry, cfg, model, text):
    """The planner's peak per process (FSDP2 over the header's N processes; a fused vision model with one image of 4
    tiles a sample) is what the header states, and fits a 40 GB card (Llama 4 Scout: an 80 GB one)."""
    ranks = re.search(r"tunelit run --nproc_per_node (\d+) ", text)
    ranks = int(ranks.group(1)) if ranks else 1
    assert (ranks > 1) == (entry.name in DISTRIBUTED), entry.name
    estimate = estimate_training_memory(model, cfg.batch_size, cfg.tokenizer.max_seq_len, torch.bfloat16,
                                        activation_checkpointing=cfg.enable_activation_checkpointing, world_size=ranks)
    budget_gib = 80 if entry.name.startswith("llama4/") else 40
    assert estimate.total / 2**30 < budget_gib, (entry.name, estimate.summary())
    per_process = " per process" if ranks > 1 else ""
    images = ", one image of 4 tiles a sample" if hasattr(model, "encoder") else ""
    assert (f"Predicted peak{per_process} (tunelit's memory planner, bf16, batch {cfg.batch_size} x "
            f"{cfg.tokenizer.max_seq_len} tokens{images}): {estimate.total / 2**30:.1f} GiB." in text), entry.name


PREFERENCE = {"lora_dpo_single_device", "full_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed"}
TRAINING = {"full_finetune_single_device", "full_finetune_distributed", "lora_finetune_single_device",
            "lora_finetune_distributed", "knowledge_distillation_single_device", *PREFERENCE}
TRAINING_CONFIGS = [c for r in get_all_recipes() if r.name in TRAINING for c in r.configs]
PREFERENCE_CONFIGS = {c.name for r in get_all_recipes() if r.name in PREFERENCE for c in r.configs}


@pytest.mark.parametrize("entry", TRAINING_CONFIGS, ids=lambda c: c.name)
def test_every_training_config_names_its_loss(entry):
    """Each training recipe takes its loss from the config. The fine-tunes (and KD's cross-entropy term) use the
    chunked cross-entropy that the memory planner assumes; DPO names its preference loss."""
    cfg = config.load_config(entry.name)
    assert cfg.get("loss"), f"{entry.name} has no loss"
    loss = config.instantiate(cfg.loss)
    if entry.name in PREFERENCE_CONFIGS:
        assert type(loss).__name__ == "DPOLoss"
        return
    assert type(loss).__name__ == "CEWithChunkedOutputLoss" and loss.num_output_chunks == 8, entry.name
    if cfg.get("kd_loss"):  # both terms read the same student logits, in the same chunks
        assert config.instantiate(cfg.kd_loss).num_output_chunks == loss.num_output_chunks
