"""Dataset builders on the shipped tiny world through `datasets`: filters, system prompts, packing, preference pairs."""
import json

import pytest

from torchtune_lit.config import _asset_path
from torchtune_lit.datasets import (
    instruct_dataset,
    preference_dataset,
    text_completion_dataset,
    tiny_tokenizer,
)

def test_filter_fn_and_new_system_prompt():
    tok = tiny_tokenizer()
    ds = instruct_dataset(tok, source="json", data_files=_asset_path("tiny/column_types_train.jsonl"),
                          column_map={"input": "prompt", "output": "label"}, filter_fn=lambda row: row["label"] == "url",
                          new_system_prompt="Answer with one label.")
    rows = [json.loads(line) for line in open(_asset_path("tiny/column_types_train.jsonl"))]
    assert len(ds) == sum(row["label"] == "url" for row in rows) > 0
    text = tok.decode(ds[0]["tokens"])
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nAnswer with one label.<|eot_id|>")
    trained = tok.decode([t for t, l in zip(ds[0]["tokens"], ds[0]["labels"]) if l != -100])
    assert "url" in trained and "Column:" not in trained        # the prompt is masked, the answer trained


def test_packed_text_completion_fills_rows_exactly():
    tok = tiny_tokenizer(max_seq_len=128)
    packed = text_completion_dataset(tok, source="json", data_files=_asset_path("tiny/pretrain.jsonl"), packed=True)
    assert len(packed) > 10 and all(len(packed[i]["tokens"]) == 128 for i in range(len(packed)))
    assert all(sum(packed[i]["seq_lens"]) == 128 for i in range(len(packed)))


def test_preference_pairs_share_their_masked_prompt():
    tok = tiny_tokenizer()
    pair = preference_dataset(tok, source="json", data_files=_asset_path("tiny/preference.jsonl"))[0]
    n = sum(l == -100 for l in pair["chosen_labels"])
    assert pair["chosen_input_ids"][:n] == pair["rejected_input_ids"][:n]
    assert pair["chosen_input_ids"] != pair["rejected_input_ids"]


def test_missing_data_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_files"):
        instruct_dataset(tiny_tokenizer(), source="json", data_files=str(tmp_path / "absent.jsonl"))


def test_a_list_of_datasets_trains_on_their_concatenation(tmp_path):
    """`dataset:` as a list (torchtune's ConcatDataset form) runs through the LoRA recipe, preflight included: one
    epoch covers both datasets; a list mixing packed and unpacked datasets is refused, naming the key."""
    import subprocess
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    import torchtune_lit.config as config

    # output_dir set before resolving: the checkpointer's ${output_dir} must follow it (resolved first, the saves
    # went to the config's default folder, /tmp/torchtune_lit/tiny_lora, the main job's)
    loaded = config.load_config("tiny/lora", [f"output_dir={tmp_path / 'out'}"])
    cfg = OmegaConf.to_container(loaded, resolve=True)
    single = dict(cfg["dataset"])
    cfg["dataset"] = [{**single, "data_files": _asset_path(f"tiny/column_types_{split}.jsonl")}
                      for split in ("val", "eval")]        # 48 + 96 rows
    cfg.update(epochs=1, max_steps_per_epoch=None, progress_bar=False, validation_dataset=None, batch_size=16)
    assert cfg["checkpointer"]["output_dir"] == str(tmp_path / "out")
    path = tmp_path / "two.yaml"
    OmegaConf.save(OmegaConf.create(cfg), path)
    tunelit = str(Path(sys.executable).parent / "tunelit")
    result = subprocess.run([tunelit, "run", "lora_finetune_single_device", "--config", str(path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert len(steps) == (48 + 96) // 16                    # both files
    cfg["dataset"][1]["packed"] = True
    OmegaConf.save(OmegaConf.create(cfg), path)
    refused = subprocess.run([tunelit, "run", "lora_finetune_single_device", "--config", str(path), "overwrite=true"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "disagree on packed" in refused.stderr, refused.stderr[-2000:]
