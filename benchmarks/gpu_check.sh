#!/usr/bin/env bash
# The GPU check (see benchmarks/gpu_check.py): one table of bf16 LoRA / QLoRA steps of a 1B-shaped model, eager and
# compiled, offloading on and off, peak memory against the planner, tokens/s and MFU, and NF4 on the GPU.
#   bash benchmarks/gpu_check.sh              # on a CUDA machine, under 8 minutes
#   bash benchmarks/gpu_check.sh --dry-run    # anywhere, on CPU, in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
