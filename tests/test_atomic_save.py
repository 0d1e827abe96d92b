"""Atomic checkpoint writes under a real kill: a process SIGKILLed while it writes a checkpoint leaves the previous
checkpoint byte-for-byte intact and loadable; the next save cleans up the half-written folder."""
import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from torchtune_lit.datasets._tiny_world import TINY_ASSETS
from torchtune_lit.training import FullModelHFCheckpointer

SAVER = """
import sys, time
from pathlib import Path
import torchtune_lit.training.checkpointing as checkpointing
out, mode = Path(sys.argv[1]), sys.argv[2]
checkpointer = checkpointing.FullModelHFCheckpointer(sys.argv[3], output_dir=out)
state = checkpointer.load_checkpoint()
if mode == "slow":
    state["model"] = {k: v * 0 for k, v in state["model"].items()}    # a different model, so a partial write would show
    write = checkpointing.write_hf_weights
    def write_then_hang(*args, **kwargs):
        write(*args, **kwargs)                 # the weights are on disk in the temporary folder ...
        (out / "writing").write_text("now")    # ... tell the test, and wait to be killed before the folder is renamed
        time.sleep(120)
    checkpointing.write_hf_weights = write_then_hang
checkpointer.save_checkpoint(state, epoch=0)
"""


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    base = TINY_ASSETS / "base"
    saver = [sys.executable, "-c", SAVER]
    subprocess.run([*saver, str(tmp_path), "normal", str(base)], check=True, timeout=120)
    before = digest(tmp_path / "epoch_0")

    process = subprocess.Popen([*saver, str(tmp_path), "slow", str(base)])
    deadline = time.time() + 120
    while not (tmp_path / "writing").exists():
        assert process.poll() is None and time.time() < deadline, "the saver ended before it could be killed"
        time.sleep(0.05)
    assert list(tmp_path.glob(".epoch_0.tmp-*")), "the new checkpoint should be half-written in a temporary folder"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)

    assert digest(tmp_path / "epoch_0") == before                     # the previous checkpoint is untouched ...
    reloaded = FullModelHFCheckpointer(tmp_path / "epoch_0").load_checkpoint()["model"]
    original = FullModelHFCheckpointer(base).load_checkpoint()["model"]
    assert all(torch.equal(reloaded[k], original[k]) for k in original)  # ... and loads as the original model

    subprocess.run([*saver, str(tmp_path), "normal", str(base)], check=True, timeout=120)
    assert not list(tmp_path.glob(".epoch_0.tmp-*"))                  # the next save removed the half-written folder
    assert digest(tmp_path / "epoch_0") == before
