#!/usr/bin/env bash
# Every table of benchmarks/README.md in one go (~40 min on 2 cores) (needs benchmarks/.venv-torchtune: bash benchmarks/make_peer_env.sh).
set -euo pipefail
cd "$(dirname "$0")"
PY=../.venv/bin/python
run() { echo "=== $*"; $PY compare.py "$@" | tail -3; }
run --peer torchtune --mode lora --dtype bf16 --pairs 5
run --peer hf --mode lora --dtype bf16 --pairs 5
run --peer torchtune --mode full --dtype bf16 --pairs 5
run --peer hf --mode full --dtype bf16 --pairs 5
run --peer torchtune --mode qlora --dtype bf16 --pairs 5
run --peer torchtune --mode lora --dtype fp32 --pairs 3
run --peer hf --mode lora --dtype fp32 --pairs 3
run --peer torchtune --mode full --dtype fp32 --pairs 3
run --peer hf --mode full --dtype fp32 --pairs 3
run --peer torchtune --mode lora --dtype bf16 --compile --pairs 3
run --peer hf --mode lora --dtype bf16 --compile --pairs 3
echo "=== extras"; $PY extras.py all
echo "=== scaling"; $PY scaling.py | tail -13
