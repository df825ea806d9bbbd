#!/usr/bin/env bash
# make demo: a Ray head on 127.0.0.1, `ray job submit` of pipelines/kl_cov.py, its log followed, then that head
# (and only it) stopped. `ray stop` is never used: it would end every Ray process on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=.venv/bin/ray
TMP=$(mktemp -d /tmp/eor_demo_XXXX)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1 MASTER_ADDR=127.0.0.1 \
    GLOO_SOCKET_IFNAME=lo DS_ACCELERATOR=cpu WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PATH="$PWD/.venv/bin:$PATH"  # the job's `python` is the venv's
DASH_PORT=${DEMO_DASHBOARD_PORT:-8265}
GCS_PORT=${DEMO_GCS_PORT:-6390}

stop_head() {
    # every process of this head carries its temp dir on its command line
    pkill -f "$TMP" 2>/dev/null || true
    sleep 2
    pkill -9 -f "$TMP" 2>/dev/null || true
    rm -rf "$TMP"
}
trap stop_head EXIT

# the default model is converted once, outside the job, so the job's log shows training, not the conversion
.venv/bin/python -c "from entropy_openrlhf.models.smollm2 import ensure_smollm2; print('model:', ensure_smollm2())"

$RAY start --head --node-ip-address=127.0.0.1 --port="$GCS_PORT" --dashboard-host=127.0.0.1 \
    --dashboard-port="$DASH_PORT" --ray-client-server-port=10001 --min-worker-port=20000 --max-worker-port=20999 \
    --num-cpus=16 --object-store-memory=1000000000 --temp-dir="$TMP" --disable-usage-stats >/dev/null
echo "Ray head on 127.0.0.1:$GCS_PORT (dashboard http://127.0.0.1:$DASH_PORT)"

start=$(date +%s)
$RAY job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . \
    --runtime-env-json '{"excludes": [".venv", "outputs", "wandb", ".git"]}' -- \
    python pipelines/kl_cov.py --train.output_dir "$PWD/outputs/demo" "$@"
echo "demo finished in $(( $(date +%s) - start )) s"
