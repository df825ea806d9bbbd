#!/usr/bin/env bash
# make demo: a Ray head on 127.0.0.1, `ray job submit` of pipelines/kl_cov.py on the embedded default (SmolLM2-135M-
# Instruct, the built-in arithmetic task), its log followed, then that head (and only it) stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
TMP=$(mktemp -d /tmp/eor_demo_XXXX)
DASH_PORT=${DEMO_DASHBOARD_PORT:-8265}
trap 'bash scripts/ray_head.sh stop "$TMP"' EXIT

# converted once, outside the job, so the job's log shows training rather than the conversion
.venv/bin/python -c "from entropy_openrlhf.models.smollm2 import ensure_smollm2; print('model:', ensure_smollm2())"
bash scripts/ray_head.sh start "$TMP" "$DASH_PORT" "${DEMO_GCS_PORT:-6390}"

# Short: 6 steps of 4 prompts x 4 samples (README: about 5 minutes on a quiet 2-vCPU machine; prompts are ~360
# tokens with their worked examples). Flags given to `make demo ARGS=...` come later and win.
DEMO_FLAGS=(--rollout.batch_size 4 --train.num_steps 6)

start=$(date +%s)
PATH="$PWD/.venv/bin:$PATH" .venv/bin/ray job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . \
    --runtime-env-json '{"excludes": [".venv*", "outputs", "wandb", ".git"]}' -- \
    python pipelines/kl_cov.py --train.output_dir "$PWD/outputs/demo" "${DEMO_FLAGS[@]}" "$@"
echo "demo finished in $(( $(date +%s) - start )) s"
# every step's metrics, whichever --logger.backends were given (a rerun moves the earlier run's rows aside)
metrics="$PWD/outputs/demo/metrics.jsonl"
if [[ -f $metrics ]]; then echo "per-step metrics: $metrics ($(wc -l < "$metrics") rows)"; fi
