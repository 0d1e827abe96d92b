"""The GPU check script runs its whole table on CPU with --dry-run (the tiny Llama, no compile), so it cannot rot
between the sessions that have a GPU."""
import subprocess
import sys
from pathlib import Path

def test_gpu_check_dry_run_prints_its_table():
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("tiny Llama, bf16, batch 2 x 64 tokens, cpu")
    assert [line.split()[0] for line in lines[2:5]] == ["lora", "qlora", "lora"] and "offload" in lines[4], lines
    for line in lines[2:5]:
        peak, planned = (float(x) for x in line.split()[-4:-2])
        assert 0.8 < planned / peak < 1.25, line      # the planner against the measured peak (MiB)
    assert "ours vs torchao max |difference| 0.00e+00" in lines[5], lines[5]
