"""torchtune's `utils` names, as a torchtune recipe calls them (`from torchtune_lit import utils`): the logger is the
recipes' logger at the level asked for, `log_rank_zero`/`log_once` log once per run, `deprecated` warns once with
its name and message, `get_device` picks the device and this process's GPU index, `batch_to_device` moves nested
dicts and lists in place, and `torch_version_ge` compares versions as numbers. Fast: no model, no process group."""
import contextlib
import io
import logging
import os
import warnings
from unittest import mock

import pytest
import torch

from torchtune_lit import utils
from torchtune_lit.training.metric_logging import LOGGER_NAME

@pytest.fixture
def package_logger():
    "The package logger's level, handlers and propagation, restored after the test."
    logger = logging.getLogger(LOGGER_NAME)
    saved = logger.level, list(logger.handlers), logger.propagate
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_get_logger_sets_the_level_and_writes_bare_lines_to_stdout(package_logger):
    log = utils.get_logger("debug")
    assert log is package_logger and log.level == logging.DEBUG
    assert sum(type(h).__name__ == "_CurrentStdout" for h in log.handlers) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        log.debug("a debug line")
        logging.getLogger(f"{LOGGER_NAME}.config").info("from a child logger")
    assert out.getvalue() == "a debug line\nfrom a child logger\n"
    assert utils.get_logger("WARNING").level == logging.WARNING
    assert utils.get_logger() is log and log.level == logging.WARNING  # no level: left alone
    assert len(utils.get_logger("INFO").handlers) == len(log.handlers)  # no second handler
    with pytest.raises(ValueError, match="log_level must be"):
        utils.get_logger("LOUD")


def test_log_rank_zero_and_log_once(package_logger):
    log = utils.get_logger("INFO")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for _ in range(3):
            utils.log_once(log, "logged once per process, test_tt_utils")
        utils.log_once(log, "logged once per process, test_tt_utils", logging.WARNING)
        utils.log_rank_zero(log, "rank 0 speaks")
        utils.log_rank_zero(log, "below the level", level=logging.DEBUG)
        with mock.patch.object(torch.distributed, "is_initialized", return_value=True), \
                mock.patch.object(torch.distributed, "get_rank", return_value=2):
            utils.log_rank_zero(log, "rank 2 is quiet")
            utils.log_once(log, "rank 2 is quiet too")
    assert out.getvalue().splitlines() == [
        "logged once per process, test_tt_utils",
        "logged once per process, test_tt_utils",  # another level is another message
        "rank 0 speaks",
    ]


def test_log_rank_zero_names_the_callers_line(package_logger):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    utils.log_rank_zero(package_logger, "where")
    assert records[0].funcName == "test_log_rank_zero_names_the_callers_line"
    assert records[0].pathname == __file__


def test_deprecated_warns_once_with_name_and_message():
    @utils.deprecated(msg="Use `new_thing` instead.")
    def old_thing(x):
        return x + 1

    @utils.deprecated()
    class OldClass:
        def __init__(self, value):
            self.value = value

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert old_thing(1) == 2 and old_thing(2) == 3
        obj = OldClass(7)
        OldClass(8)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "old_thing is deprecated and will be removed in future versions. Use `new_thing` instead."),
        (FutureWarning, "OldClass is deprecated and will be removed in future versions."),
    ]
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not the decorator's
    assert isinstance(obj, OldClass) and obj.value == 7 and old_thing.__name__ == "old_thing"


def test_deprecated_is_quiet_off_rank_zero():
    @utils.deprecated("gone soon")
    def f():
        return 1

    with warnings.catch_warnings(record=True) as caught, \
            mock.patch.object(torch.distributed, "is_initialized", return_value=True), \
            mock.patch.object(torch.distributed, "get_rank", return_value=1):
        warnings.simplefilter("always")
        assert f() == 1
    assert caught == []


def test_deprecate_parameter_warns_only_when_passed():
    @utils.deprecate_parameter("scale", "Pass `factor`.")
    def resize(x, scale=None, factor=1):
        return x * (scale or factor)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resize(2, factor=3) == 6
        assert caught == []
        assert resize(2, 5) == 10  # by position
        resize(2, scale=5)
    assert [str(w.message) for w in caught] == [
        "scale is deprecated for resize and will be removed in future versions. Pass `factor`."]


def test_world_size_and_rank_without_a_process_group():
    assert utils.get_world_size_and_rank() == (1, 0)
    with mock.patch.object(torch.distributed, "is_initialized", return_value=True), \
            mock.patch.object(torch.distributed, "get_world_size", return_value=4), \
            mock.patch.object(torch.distributed, "get_rank", return_value=3):
        assert utils.get_world_size_and_rank() == (4, 3)


def test_get_device_on_this_machine():
    assert utils.get_device("cpu") == torch.device("cpu")
    assert utils.get_device("meta") == torch.device("meta")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert utils.get_device().type == expected
    assert utils.get_device_support().device_type == expected
    assert utils.DeviceSupport.from_type("cuda").communication_backend == "nccl"
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        utils.DeviceSupport.from_type("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_get_device_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        utils.get_device("cuda")


def test_get_device_takes_the_gpu_index_from_local_rank():
    "With two pretend GPUs, process LOCAL_RANK=1 gets cuda:1; an index past the GPUs or against LOCAL_RANK is refused."
    chosen = []
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=2), \
            mock.patch.object(torch.cuda, "set_device", side_effect=chosen.append), \
            mock.patch.dict(os.environ, {"LOCAL_RANK": "1"}):
        assert utils.get_device("cuda") == torch.device("cuda", 1)
        assert chosen == [torch.device("cuda", 1)]
        with pytest.raises(RuntimeError, match="LOCAL_RANK=1"):
            utils.get_device("cuda:0")
        os.environ["LOCAL_RANK"] = "5"
        with pytest.raises(RuntimeError, match="this machine has 2 cuda device"):
            utils.get_device("cuda")
    assert chosen == [torch.device("cuda", 1)]


def test_batch_to_device_moves_nested_dicts_and_lists_in_place():
    batch = {
        "tokens": torch.arange(6).view(2, 3),
        "encoder_input": {"images": [torch.ones(2), torch.zeros(1)], "mask": {"m": torch.ones(1)}},
    }
    inner = batch["encoder_input"]
    assert utils.batch_to_device(batch, torch.device("meta")) is None
    assert batch["tokens"].device.type == "meta" and batch["tokens"].shape == (2, 3)
    assert batch["encoder_input"] is inner  # in place
    assert [t.device.type for t in inner["images"]] == ["meta", "meta"]
    assert inner["mask"]["m"].device.type == "meta"


def test_batch_to_device_names_what_it_cannot_move_and_moves_nothing():
    batch = {"tokens": torch.ones(2), "meta_info": {"ids": [torch.ones(1), "a caption"]}}
    with pytest.raises(ValueError, match=r"batch\['meta_info'\]\['ids'\]\[1\] is a str"):
        utils.batch_to_device(batch, torch.device("meta"))
    assert batch["tokens"].device.type == "cpu"  # checked before anything moved


@pytest.mark.parametrize("installed, asked, expected", [
    ("2.13.0+cpu", "2.4", True),  # as text "2.13.0+cpu" >= "2.4" is False
    ("2.13.0+cpu", "2.13", True),
    ("2.13.0+cpu", "2.13.1", False),
    ("2.10.0", "2.9.1", True),
    ("2.5.1", "2.6.0", False),
    ("2.6.0.dev20241112+cpu", "2.6.0", True),  # a nightly of the release counts
    ("2.6.0.dev20241112+cpu", "2.6.0.dev20241117", False),
    ("2.6.0.dev20241120", "2.6.0.dev20241117", True),
    ("2.6.0rc1", "2.6.0.dev20241117", True),
    ("2.6.0", "2.6.0.dev20241117", True),
])
def test_torch_version_ge(installed, asked, expected):
    with mock.patch.object(torch, "__version__", installed):
        assert utils.torch_version_ge(asked) is expected


def test_torch_version_ge_on_the_installed_torch():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert utils.torch_version_ge(f"{major}.{minor}")
    assert not utils.torch_version_ge(f"{major}.{minor + 1}")
    assert utils.torch_version_ge("2.6")  # the package needs torch>=2.6
    with pytest.raises(ValueError, match="is not a version"):
        utils.torch_version_ge("latest")


def test_logger_speaks_again_after_a_library_configured_logging():
    "mlflow and lm-eval call logging.config.dictConfig, which disables existing loggers; the run's level re-enables it."
    import logging.config

    log = utils.get_logger("INFO")
    child = logging.getLogger(f"{LOGGER_NAME}.config")  # the config's messages
    logging.config.dictConfig({"version": 1})  # what such a library does
    assert log.disabled and child.disabled
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        utils.get_logger("INFO").info("step 1")
    assert out.getvalue() == "step 1\n"
    assert not child.disabled  # its children speak again too
