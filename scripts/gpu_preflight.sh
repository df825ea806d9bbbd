#!/usr/bin/env bash
# The GPU preflight: run it first on a new GPU node (or cluster). It trains 2 steps of --preset gpu-smoke and
# resumes once, then prints PASS or FAIL for each GPU path: engine start, the NCCL sync group, a weight sync with
# the trainer-vs-engine log-prob check, a train step, checkpoint, resume, W&B (entropy_openrlhf/pipeline/gpu_preflight.py).
#   scripts/gpu_preflight.sh --pretrain /shared/models/Qwen2.5-0.5B-Instruct [--output-dir DIR] [pipeline flags]
#   scripts/gpu_preflight.sh --cpu      # its CPU twin (tiny model, gloo), which CI runs
# With RAY_ADDRESS set it joins that cluster; otherwise it starts Ray on this machine. Each line is PASS, FAIL or
# INCONCLUSIVE (the runs could not have shown a fault). Exit 0 when all pass, 1 when one fails, 3 when none fails
# but one is inconclusive.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python
if [[ -z ${VIRTUAL_ENV:-} && -x .venv/bin/python ]]; then PY=.venv/bin/python; fi
exec "$PY" -m entropy_openrlhf.pipeline.gpu_preflight "$@"
