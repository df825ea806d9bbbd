#!/usr/bin/env bash
# Start or stop a Ray head on 127.0.0.1 that lives in its own temp dir, so it can be stopped alone.
#   scripts/ray_head.sh start TMPDIR DASHBOARD_PORT GCS_PORT
#   scripts/ray_head.sh stop TMPDIR
# `ray stop` is never used: it ends every Ray process on the machine, other users' included.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=$1 tmp=$2
case $cmd in
start)
    dash=${3:-8265} gcs=${4:-6390}
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1 MASTER_ADDR=127.0.0.1 \
        GLOO_SOCKET_IFNAME=lo DS_ACCELERATOR=cpu WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=1 \
        VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
    export PATH="$PWD/.venv/bin:$PATH"  # a job's `python` is the venv's
    mkdir -p "$tmp"
    .venv/bin/ray start --head --node-ip-address=127.0.0.1 --port="$gcs" --dashboard-host=127.0.0.1 \
        --dashboard-port="$dash" --ray-client-server-port=$((gcs + 1)) --min-worker-port=20000 --max-worker-port=29999 \
        --num-cpus=16 --object-store-memory=1000000000 --temp-dir="$tmp" --disable-usage-stats >"$tmp/start.log" 2>&1 \
        || { cat "$tmp/start.log"; exit 1; }
    echo "Ray head on 127.0.0.1:$gcs, dashboard http://127.0.0.1:$dash"
    ;;
stop)
    # every process of this head carries its temp dir on its command line
    pkill -f -- "$tmp" 2>/dev/null || true
    for _ in 1 2 3 4 5; do pgrep -f -- "$tmp" >/dev/null || break; sleep 1; done
    pkill -9 -f -- "$tmp" 2>/dev/null || true
    rm -rf "$tmp"
    ;;
*) echo "usage: $0 start|stop TMPDIR [DASHBOARD_PORT GCS_PORT]" >&2; exit 2 ;;
esac
