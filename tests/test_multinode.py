"""Several nodes on one machine: two torchrun launchers (`--nnodes 2 --node_rank 0/1`, one process each) meeting
through the rendezvous at 127.0.0.1 train exactly as one launcher with two processes; the shipped SLURM script's
command line runs (srun and scontrol replaced by stubs: SLURM itself is not installed here); a launch whose port is
taken says so in one line; and QLoRA's refusals under FSDP2 and QAT are one line each.

Tolerance: none. Both runs have the same two ranks (rank = node_rank x nproc_per_node + local_rank gives 0 and 1 in
both), each reading the same half of every batch, one thread each (OMP_NUM_THREADS=1 in the environment both launches
get: torchrun sets it by itself only when nproc_per_node > 1), joined by the
same Gloo all-reduce of two tensors; only how the processes found each other differs, so every number is the same
bit for bit (measured: losses and every saved tensor equal)."""
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchtune_lit

TUNELIT = str(Path(sys.executable).parent / "tunelit")
SLURM_SCRIPT = Path(torchtune_lit.__file__).parent / "assets" / "slurm" / "multinode.slurm"
SHORT = ["epochs=1", "max_steps_per_epoch=3", "progress_bar=false", "preflight=false", "~validation_dataset",
         "~lr_scheduler"]
QLORA = "model._component_=torchtune_lit.models.tiny.qlora_tiny_llama"


def free_port() -> str:
    "A port nothing listens on: a fixed one can collide with a launch of another test running beside this one."
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "log.jsonl").read_text().splitlines()]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def two_nodes(output_dir: Path, *overrides: str) -> list[subprocess.CompletedProcess]:
    "Two launchers at once, as two machines would start them, meeting at 127.0.0.1 on a free port."
    port = free_port()
    launches = [
        subprocess.Popen([TUNELIT, "run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                          "--master_addr", "127.0.0.1", "--master_port", port, "lora_finetune_distributed",
                          "--config", "tiny/lora_distributed", f"output_dir={output_dir}", *SHORT, *overrides],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        for node in (0, 1)
    ]
    results = []
    for launch in launches:
        out, err = launch.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(launch.args, launch.returncode, out, err))
    return results


def one_node(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", free_port(),
                           "lora_finetune_distributed", "--config", "tiny/lora_distributed",
                           f"output_dir={output_dir}", *SHORT, *overrides],
                          capture_output=True, text=True, timeout=600, env=env())


def assert_same_run(a: Path, b: Path) -> None:
    "The same losses and the same saved adapter and merged model, bit for bit."
    assert losses(a) == losses(b) and len(losses(a)) == 3, (losses(a), losses(b))
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        ours, theirs = load_file(a / "epoch_0" / name), load_file(b / "epoch_0" / name)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (name, key)


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory) -> Path:
    "The reference: one launcher, two processes (shared by the tests that compare with it)."
    folder = tmp_path_factory.mktemp("one_node") / "run"
    single = one_node(folder)
    assert single.returncode == 0, single.stderr[-3000:]
    return folder


def test_two_nodes_equal_one_node(tmp_path, one_node_run):
    for result in two_nodes(tmp_path / "two_nodes"):
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "two_nodes", one_node_run)
    first = losses(one_node_run)
    assert first[-1] < first[0]  # it trains


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_command_runs(tmp_path, one_node_run):
    """The shipped SLURM script, with `scontrol` and `srun` replaced by stubs that play a two-node allocation on this
    machine: srun starts the script's one command per "node" (SLURM_NODEID 0 and 1) and waits for both. The c10d
    rendezvous at the first node's address (here localhost) makes the two launchers one job; it trains as one launcher
    with two processes does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", 'echo localhost\necho otherhost\n')           # `scontrol show hostnames` order
    _stub(bin_dir, "srun", 'while [[ "$1" == -* ]]; do shift; done\n'         # drop srun's options
                           'SLURM_NODEID=0 "$@" & a=$!\nSLURM_NODEID=1 "$@" & b=$!\n'
                           'wait $a; ra=$?; wait $b; rb=$?; exit $((ra || rb))\n')
    slurm_env = {**env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                 "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
                 "GPUS_PER_NODE": "1", "MASTER_PORT": free_port(),
                 "RECIPE": "lora_finetune_distributed", "CONFIG": "tiny/lora_distributed"}
    out = tmp_path / "slurm"
    result = subprocess.run(["bash", str(SLURM_SCRIPT), f"output_dir={out}", *SHORT], capture_output=True, text=True,
                            timeout=600, env=slurm_env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "MASTER_ADDR=localhost" in result.stdout
    assert_same_run(out, one_node_run)


def test_busy_port_is_named_in_one_line(tmp_path):
    "A rendezvous port held by another process: one line naming it and the option that fixes it (was: exit 1, silent)."
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", str(port),
                                 "lora_finetune_distributed", "--config", "tiny/lora_distributed",
                                 f"output_dir={tmp_path / 'o'}", *SHORT],
                                capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"tunelit run: the rendezvous port {port} is already in use"), result.stderr[-2000:]
    assert "--master_port" in lines[-1] and "Traceback" not in result.stderr


def test_default_port_busy_picks_a_free_one(tmp_path):
    "No port given, torchrun's default (29500) taken: tunelit picks a free port, says so, and the run succeeds."
    held = socket.socket()
    try:
        held.bind(("", 29500))
        held.listen()
    except OSError:
        pass  # something else holds it: busy all the same
    try:
        result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                                 "lora_finetune_distributed", "--config", "tiny/lora_distributed",
                                 f"output_dir={tmp_path / 'o'}", "max_steps_per_epoch=1", *SHORT[:1], *SHORT[2:]],
                                capture_output=True, text=True, timeout=300, env=env())
    finally:
        held.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith("tunelit run: torchrun's default port 29500 is in use; using free port ")


# QLoRA's refusals: each a ValueError in one line that names the reason and the fix.

def test_qat_refuses_an_nf4_base():
    from torchtune_lit.models.tiny import qlora_tiny_llama
    from torchtune_lit.training.quantization import Int8DynActInt4WeightQATQuantizer

    with pytest.raises(ValueError, match=r"has an NF4 base \(QLoRA\).*lora_\.\.\., not qlora_") as caught:
        Int8DynActInt4WeightQATQuantizer().prepare(qlora_tiny_llama(lora_attn_modules=["q_proj", "v_proj"]))
    assert "\n" not in str(caught.value)


def test_qlora_under_fsdp_refuses_one_process_and_an_unsplittable_base():
    from torchtune_lit.models.tiny import qlora_tiny_llama
    from torchtune_lit.training.sharding import nf4_layout, restore_nf4

    layout = nf4_layout(qlora_tiny_llama(lora_attn_modules=["q_proj", "v_proj"]))
    with torch.device("meta"):
        model = qlora_tiny_llama(lora_attn_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="needs 2 or more processes.*lora_finetune_single_device"):
        restore_nf4(model, layout, world_size=1)
    # a 256 x 256 projection: 256 rows do not split over 3 ranks
    with pytest.raises(ValueError, match=r"cannot be split into 3 NF4 shards.*whole blocks of 16384 values"):
        restore_nf4(model, layout, world_size=3)
    restore_nf4(model, layout, world_size=2)  # 128 rows and 2 blocks each: accepted


def test_qlora_refusals_through_the_cli(tmp_path):
    "The same refusals as a user meets them: one line per rank, then the launcher's line naming the rank."
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "1", "--master_port", free_port(),
                             "lora_finetune_distributed", "--config", "tiny/lora_distributed", QLORA,
                             f"output_dir={tmp_path / 'one'}", *SHORT],
                            capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 1
    assert "[rank0] ValueError: QLoRA (an NF4 base) under FSDP2 needs 2 or more processes" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run([TUNELIT, "run", "--nproc_per_node", "2", "--master_port", free_port(),
                             "qat_lora_finetune_distributed", "--config", "tiny/qat_lora_distributed", QLORA,
                             f"output_dir={tmp_path / 'qat'}", *SHORT],
                            capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 1
    assert "[rank0] ValueError: QAT's fake quantization needs dense base weights" in result.stderr
    assert "Traceback" not in result.stderr
