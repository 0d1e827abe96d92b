"""torchtune's config keys in our recipes (#38): a key used only for `${interpolation}`, torchtune's DiskLogger and
profiler section, the keys this package does another way (refused or explained in one line), and one tiny LoRA run
driven by torchtune's keys: log_every_n_steps, log_level, log_peak_memory_stats, profiler, dataset_val /
batch_size_val and save_adapter_weights_only."""
import json
import logging
import warnings

import pytest

from torchtune_lit import config
from torchtune_lit.recipes import lora_finetune_single_device
from torchtune_lit.training import metric_logging, read_jsonl
from torchtune_lit.training.profiler import DummyProfiler, build_profiler

CONFIG = """
checkpoint_dir: ${asset:tiny/base}
output_dir: OUT
checkpointer:
  _component_: torchtune_lit.training.FullModelHFCheckpointer
  checkpoint_dir: ${checkpoint_dir}
  checkpoint_files: [model.safetensors]
  output_dir: ${output_dir}
  model_type: LLAMA3
"""


def test_interpolation_only_key_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "run")))
    cfg = config.load_config(path)  # `checkpoint_dir` is one typo from `checkpointer`: not refused
    assert cfg.checkpointer.checkpoint_dir == cfg.checkpoint_dir
    assert config.interpolated_keys(cfg) == {"checkpoint_dir", "output_dir"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not warned as unread either
        assert config.warn_unread_keys(cfg, {"output_dir": None, "checkpointer": None}) == []
    path.write_text("checkpoint_dirr: /x\n")  # a typo nobody refers to is still refused
    with pytest.raises(config.ConfigError, match="Did you mean"):
        config.load_config(path)


def test_torchtune_components_and_paths(tmp_path):
    logger = config.instantiate({"_component_": "torchtune.training.metric_logging.DiskLogger",
                                 "log_dir": str(tmp_path), "filename": "log.txt"})
    logger.log_dict({"loss": 1.5}, step=3)
    logger.close()
    assert (tmp_path / "log.txt").read_text() == "Step 3 | loss:1.5 \n"
    profiler, used = config.instantiate({"_component_": "torchtune_lit.training.profiler.setup_torch_profiler",
                                         "enabled": False})
    assert isinstance(profiler, DummyProfiler) and dict(used) == {"enabled": False}
    assert isinstance(build_profiler({"enabled": False}, tmp_path), DummyProfiler)


def test_keys_done_another_way(caplog):
    base = config.load_config("tiny/lora")
    with pytest.raises(ValueError, match=r"^low_cpu_ram=.*this package does not implement it"):
        config.check_run_values(config.apply_overrides(base.copy(), ["+low_cpu_ram=true"]))
    offload = config.apply_overrides(base.copy(), ["+fsdp_cpu_offload=true"])
    with pytest.raises(ValueError, match=r"^fsdp_cpu_offload=true: this recipe does not implement it \(the dis"):
        config.check_run_values(offload)  # a one-device recipe
    config.check_run_values(offload, supported=("fsdp_cpu_offload",))  # the distributed ones
    for key in ("fsdp_cpu_offload=false", "low_cpu_ram=false", "data_parallel_shard_dim=-1",
                "data_parallel_replicate_dim=1"):  # as torchtune's configs write them: what this package does
        config.check_run_values(config.apply_overrides(base.copy(), [f"+{key}"]))
    with pytest.raises(ValueError, match="^data_parallel_replicate_dim=2: in torchtune it replicates"):
        config.check_run_values(config.apply_overrides(base.copy(), ["+data_parallel_replicate_dim=2"]))
    with caplog.at_level(logging.INFO, logger="torchtune_lit.config"):
        config.check_run_values(config.apply_overrides(base.copy(), ["+custom_sharded_layers=[output]"]))
    assert "custom_sharded_layers: in torchtune it makes the named modules" in caplog.text


def test_full_dpo_reference_checkpointer():
    from torchtune_lit.recipes import full_dpo_single_device
    cfg = config.load_config("tiny/full_dpo", ["+ref_checkpointer={checkpoint_dir: /elsewhere}"])
    with pytest.raises(ValueError, match="^ref_checkpointer names other weights than checkpointer"):
        full_dpo_single_device.train(cfg)


def test_log_level_and_step_lines(capsys):
    metric_logging.set_log_level("WARNING")
    logging.getLogger("torchtune_lit.x").info("hidden")
    metric_logging.set_log_level("debug")
    logging.getLogger("torchtune_lit.x").debug("shown")
    assert capsys.readouterr().out == "shown\n"
    with pytest.raises(ValueError, match="log_level must be DEBUG"):
        metric_logging.set_log_level("LOUD")
    metric_logging.set_log_level("INFO")


# the tiny held-out set under torchtune's key
VAL = ("{_component_: torchtune_lit.datasets.instruct_dataset, source: json, train_on_input: false,"
       " data_files: '${asset:tiny/column_types_val.jsonl}', column_map: {input: prompt, output: label}}")


def test_lora_run_with_torchtune_keys(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = config.load_config("tiny/lora", [
        f"output_dir={out}", "epochs=1", "max_steps_per_epoch=3", "batch_size=2", "preflight=false",
        "validation_dataset=null", f"+dataset_val={VAL}", "+batch_size_val=4",
        "+log_every_n_steps=2", "+log_level=INFO", "+log_peak_memory_stats=false",
        "+save_adapter_weights_only=true",
        "+profiler={enabled: true, cuda: false, xpu: false, wait_steps: 0, warmup_steps: 1, active_steps: 1,"
        " num_cycles: 1}",
    ])
    lora_finetune_single_device.train(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/3", "step 3/3"]  # every 2nd step, and the last
    rows = read_jsonl(out / "log.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and not any("peak_rss_gib" in r for r in rows)
    trace = out / "profiler_output" / "iteration_2" / "rank0.pt.trace.json"
    assert "ProfilerStep#1" in {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    run = json.loads((out / "run.json").read_text())
    assert run["epochs"][0]["val_loss"] is not None  # dataset_val was the validation set
    best = out / "best"  # the one epoch, the best
    assert (best / "adapter" / "adapter_model.safetensors").exists()
    assert not list(best.glob("model*.safetensors"))  # save_adapter_weights_only: no merged model


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    "tunelit plot on a machine without matplotlib: one line naming the [plot] extra."
    import sys

    from torchtune_lit.training.runs import plot_run

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r"torchtune_lit\[plot\]"):
        plot_run(tmp_path)


def test_bitsandbytes_optimizers_are_components_and_nothing_else_there(monkeypatch):
    "torchtune's low-memory configs name bitsandbytes' paged AdamW: an optimizer class is allowed, other objects not."
    import sys
    import types

    import torch

    module = types.ModuleType("bitsandbytes.optim")

    class PagedAdamW(torch.optim.AdamW):
        pass

    def write_something(path):  # a function there is not an optimizer
        raise AssertionError("never called")

    PagedAdamW.__module__ = write_something.__module__ = "bitsandbytes.optim"
    PagedAdamW.__qualname__ = "PagedAdamW"
    module.PagedAdamW, module.write_something = PagedAdamW, write_something
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", module)
    sys.modules["bitsandbytes"].optim = module
    config.validate({"optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW", "lr": 1e-3}})
    with pytest.raises(config.ConfigError, match="not a component"):
        config.validate({"optimizer": {"_component_": "bitsandbytes.optim.write_something", "path": "x"}})
