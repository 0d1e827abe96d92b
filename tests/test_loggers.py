"""Each metric logger's output, read back with the tool that owns the format: TensorBoard's event reader, MLflow's
tracking client, the JSON-lines log, stdout."""
import pytest

from torchtune_lit.training import JsonlLogger, read_jsonl
from torchtune_lit.training.metric_logging import (
    MLFlowLogger,
    StdoutLogger,
    TensorBoardLogger,
)

STEPS = [{"loss": 2.5, "lr": 1e-3, "tokens_per_second": 1200.0, "note": "not a number"},
         {"loss": 2.25, "lr": 9e-4, "tokens_per_second": 1300.0},
         {"loss": 2.0, "lr": 8e-4, "tokens_per_second": 1250.0}]


def write(logger) -> None:
    for step, payload in enumerate(STEPS, start=1):
        logger.log_dict(payload, step)
    logger.close()


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    write(TensorBoardLogger(str(tmp_path)))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr", "tokens_per_second"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.25), (3, 2.0)]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([1e-3, 9e-4, 8e-4])


def test_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # a local folder store: no server, no database driver
    uri = (tmp_path / "mlruns").as_uri()
    write(MLFlowLogger(experiment_name="tiny", tracking_uri=uri))
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])[0]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 2.5), (2, 2.25), (3, 2.0)]
    assert run.info.status == "FINISHED"


def test_jsonl_and_stdout(tmp_path, capsys):
    logger = JsonlLogger(tmp_path)
    for step, payload in enumerate(STEPS, start=1):
        logger.log(step=step, **payload)
    logger.close()
    assert [row["loss"] for row in read_jsonl(tmp_path / "log.jsonl")] == [2.5, 2.25, 2.0]
    write(StdoutLogger())
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "step 2" in out[1] and "loss" in out[1] and "2.25" in out[1]


CONFIG = {"output_dir": "/tmp/run", "HF_TOKEN": "hf_secret", "seed": 7,
          "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-4},
          "tracker": {"api_key": "k", "client_secret": "s", "host": "h"},
          "notes": "hf_" + "a" * 34, "long": "x" * 7000, "stop": [1, 2], "lr_scheduler": None}
PUBLIC = {"output_dir", "seed", "optimizer._component_", "optimizer.lr", "tracker.host", "long", "stop",
          "lr_scheduler"}


def test_tensorboard_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    logger = TensorBoardLogger(str(tmp_path))
    logger.log_config(CONFIG)
    write(logger)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    data = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(data["_hparams_/session_start_info"]).session_start_info
    assert set(start.hparams) == PUBLIC          # no token, key or secret, keys flattened
    assert start.hparams["optimizer.lr"].number_value == pytest.approx(3e-4)
    experiment = HParamsPluginData.FromString(data["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["loss", "val_loss"]
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr", "tokens_per_second"]   # the same run


def test_mlflow_params(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLFlowLogger(experiment_name="tiny", tracking_uri=uri)
    logger.log_config(CONFIG)
    write(logger)
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])[0]
    params = run.data.params
    assert set(params) == PUBLIC
    assert params["optimizer.lr"] == "0.0003" and params["stop"] == "[1, 2]"
    assert params["long"] == "x" * MAX_PARAM_VAL_LENGTH      # cut to MLflow's limit, not refused


def test_secrets_never_leave():
    from torchtune_lit.training.metric_logging import public_config
    nested = {"model": {"tokenizer": "t", "max_new_tokens": 8, "auth_token": "x", "apiKey": "y"},
              "list": [{"password": "p", "ok": 1}, "hf_" + "b" * 31], "wandb_api_key": "z"}
    assert public_config(nested) == {"model": {"tokenizer": "t", "max_new_tokens": 8}, "list": [{"ok": 1}]}
