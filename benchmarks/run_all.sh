#!/usr/bin/env bash
# Every table of benchmarks/README.md in one go (~40 min on 2 cores) (needs benchmarks/.venv-torchtune: bash benchmarks/make_peer_env.sh).
# On a CPU without bf16 instructions (AVX2 only), where PyTorch emulates bf16 matmuls tens of times slower than fp32,
# the bf16 rows (and the scaling run, which is bf16) are skipped with the measured ratio: they would take hours and
# measure the emulation, the same ATen kernel for every library. The compiled rows then run in fp32 instead.
set -euo pipefail
cd "$(dirname "$0")"
PY=../.venv/bin/python
run() { echo "=== $*"; $PY compare.py "$@" | tail -3; }
slowdown=$($PY -c "from torchtune_lit.training import cpu_bf16_slowdown; print(f'{cpu_bf16_slowdown():.1f}')" 2>/dev/null | tail -1)
if $PY -c "import sys; from torchtune_lit.training import SLOW_CPU_BF16; sys.exit(float('$slowdown') > SLOW_CPU_BF16)" 2>/dev/null; then
  run --peer torchtune --mode lora --dtype bf16 --pairs 5
  run --peer hf --mode lora --dtype bf16 --pairs 5
  run --peer torchtune --mode full --dtype bf16 --pairs 5
  run --peer hf --mode full --dtype bf16 --pairs 5
  run --peer torchtune --mode qlora --dtype bf16 --pairs 5
  bf16=yes
else
  echo "=== bf16 rows skipped: a bf16 matmul takes ${slowdown}x the fp32 time on this CPU (no bf16 instructions)"
  bf16=no
fi
run --peer torchtune --mode lora --dtype fp32 --pairs 3
run --peer hf --mode lora --dtype fp32 --pairs 3
run --peer torchtune --mode full --dtype fp32 --pairs 3
run --peer hf --mode full --dtype fp32 --pairs 3
if [ "$bf16" = yes ]; then
  run --peer torchtune --mode lora --dtype bf16 --compile --pairs 3
  run --peer hf --mode lora --dtype bf16 --compile --pairs 3
  echo "=== extras"; $PY extras.py all
  echo "=== scaling"; $PY scaling.py | tail -13
else
  run --peer torchtune --mode lora --dtype fp32 --compile --pairs 3
  run --peer hf --mode lora --dtype fp32 --compile --pairs 3
  echo "=== extras (generation, fp32)"; $PY extras.py generation; $PY extras.py generation_batch8; $PY extras.py nf4_time
fi
