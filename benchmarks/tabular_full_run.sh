#!/usr/bin/env bash
# The full tiny/tabular pre-training run that chapter 98 quotes: wall time, peak memory, eval.json and the held-out
# validation metrics, recorded in benchmarks/tabular_full_run.json. About 7 minutes on 2 CPU cores.
#
#   bash benchmarks/tabular_full_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
/usr/bin/time -v .venv/bin/tunelit run tabular_pretrain_single_device --config tiny/tabular \
    "output_dir=$out/run" progress_bar=false > "$out/stdout" 2> "$out/time"
cat "$out/stdout"
.venv/bin/python - "$out" <<'PY'
import json, os, platform, re, sys
from pathlib import Path
import torch
out = Path(sys.argv[1])
timing = (out / "time").read_text()
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", timing).group(1)
peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing).group(1))
rows = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
record = {
    "command": "tunelit run tabular_pretrain_single_device --config tiny/tabular",
    "wall_clock": wall,
    "peak_rss_mib": round(peak_kib / 1024),
    "cpu_count": os.cpu_count(),
    "torch": torch.__version__,
    "machine": platform.machine(),
    "steps": len(rows),
    "validation": [
        {"step": r["step"], "val_loss": round(r["val_loss"], 4), "val_accuracy": round(r["val_accuracy"], 4)}
        for r in rows if "val_loss" in r
    ],
    "eval": json.loads((out / "run" / "eval.json").read_text()),
}
Path("benchmarks/tabular_full_run.json").write_text(json.dumps(record, indent=2) + "\n")
print(json.dumps({k: record[k] for k in ("wall_clock", "peak_rss_mib", "eval")}))
PY
