#!/usr/bin/env bash
# Build the torchtune 0.6.1 peer environment for benchmarks/compare.py --peer torchtune.
# torchtune 0.6.1 imports only with torchao <= 0.15, so it lives in its own virtual environment:
#   bash benchmarks/make_peer_env.sh            # -> benchmarks/.venv-torchtune
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-torchtune"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"                  # the CPU wheel first, as for our own venv
"$venv/bin/python" -m pip install -q "torchao==0.15.0" "torchtune==0.6.1"
"$venv/bin/python" -c "import torchtune, torchao, torch; print('torchtune', torchtune.__version__, 'torchao', torchao.__version__, 'torch', torch.__version__)"
