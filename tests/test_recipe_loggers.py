"""Every training recipe honours `metric_logger` (#39): two steps of each single-device recipe's tiny config with the
real TensorBoardLogger, read back with TensorBoard's own reader — the loss of each step equals log.jsonl's, and the
HParams plugin holds the run's resolved config without its secrets. One distributed recipe (LoRA DPO, the issue's
case) runs on two processes through the CLI: one event file, written by rank 0 alone."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_lit import config
from torchtune_lit.training import read_jsonl

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData  # noqa: E402

TUNELIT = str(Path(sys.executable).parent / "tunelit")
LOGGER = ["metric_logger._component_=torchtune_lit.training.metric_logging.TensorBoardLogger"]
# two steps, no validation set, no preflight: the cheapest run that still logs every step
SHORT = ["epochs=1", "max_steps_per_epoch=2", "batch_size=2", "progress_bar=false", "preflight=false",
         "validation_dataset=null"]
RECIPES = [  # (recipe, tiny config, overrides of its own)
    ("full_finetune_single_device", "tiny/full", []),
    ("lora_finetune_single_device", "tiny/lora", []),
    ("lora_dpo_single_device", "tiny/dpo", []),
    ("full_dpo_single_device", "tiny/full_dpo", []),
    ("knowledge_distillation_single_device", "tiny/kd", []),
    ("reward_model_single_device", "tiny/reward_model", []),
    ("qat_single_device", "tiny/qat", []),
    ("tabular_pretrain_single_device", "tiny/tabular", ["eval_tables=null"]),
    # GRPO and PPO start from the shipped base (not the SFT run their configs name)
    ("grpo_full_finetune_single_device", "tiny/grpo",
     ["checkpointer.checkpoint_dir=${asset:tiny/base}", "group_size=2", "max_new_tokens=4"]),
    ("ppo_full_finetune_single_device", "tiny/ppo",
     ["checkpointer.checkpoint_dir=${asset:tiny/base}", "ppo_batch_size=2", "ppo_epochs=1", "max_new_tokens=4"]),
]
SECRET = "hf_" + "s" * 34   # a token a user pasted into the config: it must not reach the dashboard


def train(recipe: str, name: str, out: Path, extra: list[str]) -> None:
    overrides = [f"output_dir={out}", *SHORT, *LOGGER, f"metric_logger.log_dir={out}/tb", f"+hf_token={SECRET}"]
    importlib.import_module(f"torchtune_lit.recipes.{recipe}").train(config.load_config(name, [*overrides, *extra]))


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory) -> Path:
    "The reward model's run, made once: its own case reads it, and PPO scores with its model."
    out = tmp_path_factory.mktemp("reward")
    train("reward_model_single_device", "tiny/reward_model", out, [])
    return out


def events_of(folder: Path) -> EventAccumulator:
    files = list(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, f"{folder}: {files}"      # one run: the hyper-parameters are not a second run
    events = EventAccumulator(str(folder))
    events.Reload()
    return events


@pytest.mark.parametrize("recipe,name,extra", RECIPES, ids=[r for r, _, _ in RECIPES])
def test_recipe_feeds_metric_logger(recipe, name, extra, tmp_path, request):
    if recipe == "reward_model_single_device":
        tmp_path = request.getfixturevalue("reward_run")
    else:
        if recipe == "ppo_full_finetune_single_device":
            extra = [*extra, f"reward_checkpoint_dir={request.getfixturevalue('reward_run') / 'epoch_0'}"]
        train(recipe, name, tmp_path, extra)
    events = events_of(tmp_path / "tb")
    logged = {row["step"]: row["loss"] for row in read_jsonl(tmp_path / "log.jsonl")}
    assert sorted(logged) == [1, 2]
    shown = {e.step: e.value for e in events.Scalars("loss")}
    assert shown == pytest.approx(logged, rel=1e-6)          # every step, the loss log.jsonl has
    plugin = events.PluginTagToContent("hparams")
    hparams = HParamsPluginData.FromString(plugin["_hparams_/session_start_info"]).session_start_info.hparams
    assert hparams["output_dir"].string_value == str(tmp_path)
    assert hparams["max_steps_per_epoch"].number_value == 2
    assert "hf_token" not in hparams and SECRET not in str(hparams)


def test_distributed_dpo_rank0_logs(tmp_path):
    """The issue's case: LoRA DPO with a TensorBoard logger, on two processes."""
    out = tmp_path / "run"
    result = subprocess.run(
        [TUNELIT, "run", "--nproc_per_node", "2", "lora_dpo_distributed", "--config", "tiny/lora_dpo_distributed",
         f"output_dir={out}", *SHORT, *LOGGER, f"metric_logger.log_dir={out}/tb"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    events = events_of(out / "tb")                            # one event file: rank 0's
    logged = {row["step"]: row["loss"] for row in read_jsonl(out / "log.jsonl")}
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(logged, rel=1e-6)
    assert sorted(logged) == [1, 2]
    assert "rewards/margin" in events.Tags()["scalars"]


def test_wandb_gets_the_resolved_config_and_every_step(tmp_path, monkeypatch):
    """W&B through a recipe, with a stand-in `wandb` module (the package is not a dependency): the run is opened with
    the config's project, its config is the resolved config without secrets, every step's loss is the one log.jsonl
    has, and the run is finished."""
    import types

    calls: dict[str, list] = {"init": [], "config": [], "log": [], "finish": []}

    class Run:
        config = types.SimpleNamespace(update=lambda values, **kw: calls["config"].append((values, kw)))

        def log(self, payload, step=None):
            calls["log"].append((step, dict(payload)))

        def finish(self):
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(__name__="wandb", init=init))
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", *SHORT, f"+hf_token={SECRET}",
                 "metric_logger._component_=torchtune_lit.training.metric_logging.WandBLogger",
                 "metric_logger.project=tiny-demo", "+metric_logger.name=first",
                 "dataset.data_files=${asset:tiny/column_types_val.jsonl}"]
    from torchtune_lit.recipes import lora_finetune_single_device

    lora_finetune_single_device.train(config.load_config("tiny/lora", overrides))
    assert calls["init"] == [{"project": "tiny-demo", "name": "first"}]
    [(sent, options)] = calls["config"]
    assert options == {"allow_val_change": True}
    assert sent["output_dir"] == str(out) and sent["max_steps_per_epoch"] == 2 and sent["batch_size"] == 2
    assert sent["optimizer"]["lr"] == config.load_config("tiny/lora", []).optimizer.lr   # nested, as W&B shows it
    assert sent["dataset"]["data_files"].endswith("assets/tiny/column_types_val.jsonl")   # ${asset:} resolved
    assert "hf_token" not in sent and SECRET not in str(sent)
    logged = {row["step"]: row["loss"] for row in read_jsonl(out / "log.jsonl")}
    assert {step: payload["loss"] for step, payload in calls["log"] if "loss" in payload} == pytest.approx(logged)
    assert sorted(logged) == [1, 2] and calls["finish"] == [True]
