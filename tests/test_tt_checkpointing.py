"""torchtune's checkpointer names (chapter 70): Meta's consolidated.00.pth read as transformers' own model, the
torchtune .pt format round trip, FormattedCheckpointFiles, the folder helpers, and where a saved folder says its
base model came from (the Hub id) in its adapter config and model card."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune_lit.models import build_from_hf_config  # noqa: E402
from torchtune_lit.training.checkpointing import (  # noqa: E402
    FormattedCheckpointFiles,
    FullModelHFCheckpointer,
    FullModelMetaCheckpointer,
    FullModelTorchTuneCheckpointer,
    ModelType,
    check_outdir_not_in_ckptdir,
    get_all_checkpoints_in_dir,
    hub_repo_id,
    meta_to_tune,
    prune_surplus_checkpoints,
    safe_torch_load,
    tune_to_meta,
    write_repo_id,
)

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)


@pytest.fixture
def hf_folder(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():  # large weights, so a wrong key or row order would show
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def test_meta_checkpoint_gives_transformers_logits(hf_folder, tmp_path):
    """Meta's keys are a renaming of ours: a consolidated.00.pth made from the HF model's weights loads into our model
    and gives the HF model's logits; saving writes Meta's keys back."""
    folder, hf_model = hf_folder
    ours = FullModelHFCheckpointer(folder).load_checkpoint()["model"]
    meta = tune_to_meta(ours)
    assert "layers.1.attention.wq.weight" in meta and "layers.0.feed_forward.w2.weight" in meta
    (tmp_path / "original").mkdir()
    torch.save({**meta, "rope.freqs": torch.ones(4)}, tmp_path / "original" / "consolidated.00.pth")
    checkpointer = FullModelMetaCheckpointer(
        tmp_path / "original", ["consolidated.00.pth"], "LLAMA2", output_dir=tmp_path / "out"
    )
    loaded = checkpointer.load_checkpoint()["model"]
    model = build_from_hf_config(folder)
    model.load_state_dict(loaded)
    tokens = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, atol=1e-4, rtol=1e-4)
    saved = checkpointer.save_checkpoint({"model": loaded}, epoch=0)
    assert safe_torch_load(saved / "consolidated.00.pth").keys() == meta.keys()
    with pytest.raises(ValueError, match="not a key of Meta's Llama checkpoints"):
        meta_to_tune({"model.embed_tokens.weight": torch.ones(1)})


def test_torchtune_checkpoint_round_trip_with_formatted_files(tmp_path):
    state = {"tok_embeddings.weight": torch.randn(8, 4), "norm.scale": torch.ones(4)}
    torch.save({"tok_embeddings.weight": state["tok_embeddings.weight"]}, tmp_path / "m_01_of_02.pt")
    torch.save({"norm.scale": state["norm.scale"]}, tmp_path / "m_02_of_02.pt")
    files = {"filename_format": "m_{}_of_{}.pt", "max_filename": "02"}
    checkpointer = FullModelTorchTuneCheckpointer(
        tmp_path, files, ModelType.LLAMA3, output_dir=tmp_path / "out"
    )
    loaded = checkpointer.load_checkpoint()["model"]
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    saved = checkpointer.save_checkpoint(
        {"model": loaded, "adapter": {"a": torch.ones(1)}, "seed": 3}, epoch=1, intermediate_checkpoint=True
    )
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_model.pt", "model.pt", "recipe_state.pt"]
    assert safe_torch_load(saved / "recipe_state.pt") == {"seed": 3}
    with pytest.raises(ValueError, match="must be a string"):
        FormattedCheckpointFiles.from_dict({"filename_format": "m_{}_of_{}.pt", "max_filename": 2})


def test_folder_helpers(tmp_path):
    for name in ("epoch_2", "epoch_10", "epoch_9", "step_1"):
        (tmp_path / name).mkdir()
    (tmp_path / "epoch_3").touch()  # a file, not a checkpoint
    found = get_all_checkpoints_in_dir(tmp_path)
    assert sorted(p.name for p in found) == ["epoch_10", "epoch_2", "epoch_9"]
    prune_surplus_checkpoints(found, 2)  # by number: epoch_2 goes, not epoch_10
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["epoch_10", "epoch_9", "step_1"]
    check_outdir_not_in_ckptdir(tmp_path / "ckpt", tmp_path / "out")
    with pytest.raises(ValueError, match="cannot be the same as or a subdirectory"):
        check_outdir_not_in_ckptdir(tmp_path / "ckpt", tmp_path / "ckpt" / "a" / "b")
    with pytest.raises(ValueError, match="Unable to load checkpoint from"):
        safe_torch_load(tmp_path / "missing.pt")


def test_saved_adapter_and_card_name_the_hub_model(hf_folder, tmp_path):
    """A folder tunelit download recorded (original_repo_id.json) or one in the HF cache gives the Hub id as the
    adapter's base_model_name_or_path and the card's base_model; a local folder gives its path and no base_model."""
    folder, _ = hf_folder
    cache = tmp_path / "models--my-org--my-model" / "snapshots" / "abc"
    assert hub_repo_id(cache) == "my-org/my-model"
    assert hub_repo_id(folder) is None
    write_repo_id(folder, "my-org/tiny")
    checkpointer = FullModelHFCheckpointer(folder, output_dir=tmp_path / "out")
    adapter = {"layers.0.attn.q_proj.lora_a.weight": torch.zeros(2, 32),
               "layers.0.attn.q_proj.lora_b.weight": torch.zeros(32, 2)}
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    saved = checkpointer.save_checkpoint({"adapter": adapter, "adapter_config": config}, 0, adapter_only=True)
    peft_config = json.loads((saved / "adapter" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == "my-org/tiny"
    card = (saved / "README.md").read_text()
    assert card.startswith("---\nbase_model: my-org/tiny\nlibrary_name: peft\n")
    with pytest.raises(ValueError, match="Adapter checkpoint not found in state_dict"):
        checkpointer.save_checkpoint({"model": {}}, 1, adapter_only=True)
