#!/usr/bin/env bash
# Start or stop a Ray head on 127.0.0.1 that lives in its own temp dir, so it can be stopped alone.
#   scripts/ray_head.sh start TMPDIR DASHBOARD_PORT GCS_PORT
# It gives Ray 2 logical CPUs (RAY_HEAD_NUM_CPUS), Ray's own default on a 2-core laptop: a run that reserves more
# has its CPU reservations scaled to fit (entropy_openrlhf/cluster_fit.py).
#   scripts/ray_head.sh check TMPDIR   # exit 1, naming each, if a process of the head listens beyond loopback
#   scripts/ray_head.sh stop TMPDIR
# `ray stop` is never used: it ends every Ray process on the machine, other users' included.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=$1 tmp=$2

head_pids() {  # the head's processes, comma-separated: the head's own processes name its temp dir (or its GCS
    # port) on their command lines; its workers and agents rename themselves ray::..., so they are found as
    # descendants. The patterns never match this script.
    local gcs roots
    gcs=$(cat "$tmp/gcs_port" 2>/dev/null || echo none)
    roots=$(pgrep -f -- "(temp[-_]dir=|session_dir=|log[-_]dir=|logs-dir=)$tmp|$tmp/session_|client.server --address=127.0.0.1:$gcs " || true)
    ps -eo pid=,ppid= | awk -v roots="$roots" '
        BEGIN { n = split(roots, r); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2 }
        END { do { grown = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grown = 1 } } while (grown)
              for (p in keep) if (p in parent) print p }' | paste -sd, -
}

loopback_check() {  # exit 1 naming each socket of the head that listens beyond loopback; else say what was seen
    .venv/bin/python - "$(head_pids)" <<'PY'
import sys

import psutil

from entropy_openrlhf.cluster import exposed_listeners

processes = []
for pid in filter(None, sys.argv[1].split(",")):
    try:
        processes.append(psutil.Process(int(pid)))
    except psutil.NoSuchProcess:
        pass  # a worker that ended meanwhile listens nowhere
exposed = exposed_listeners(processes)
if exposed:
    sys.exit("\n".join(exposed))
pids = {p.pid for p in processes}
listening = [c for c in psutil.net_connections(kind="tcp") if c.pid in pids and c.status == psutil.CONN_LISTEN]
print(f"{len(processes)} processes, {len(listening)} listening TCP sockets, all on loopback")
PY
}

case $cmd in
start)
    dash=${3:-8265} gcs=${4:-6390}
    # Loopback only: the network settings of a one-machine cluster. Nothing else: each actor sets the CPU settings
    # it needs itself (entropy_openrlhf.cluster.set_cpu_defaults), as on anyone's cluster.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo
    unset MASTER_ADDR DS_ACCELERATOR VLLM_CPU_KVCACHE_SPACE VLLM_ENABLE_V1_MULTIPROCESSING VLLM_CPU_OMP_THREADS_BIND
    export PATH="$PWD/.venv/bin:$PATH"  # a job's `python` is the venv's
    mkdir -p "$tmp"
    # The dashboard agent gets a free port (0): the default 52365 is taken by any other Ray on the machine, and an
    # agent without its port leaves `ray job submit` failing with "No available agent to submit job".
    .venv/bin/ray start --head --node-ip-address=127.0.0.1 --port="$gcs" --dashboard-host=127.0.0.1 \
        --dashboard-port="$dash" --dashboard-agent-listen-port=0 --ray-client-server-port=$((gcs + 1)) \
        --min-worker-port=20000 --max-worker-port=29999 \
        --num-cpus="${RAY_HEAD_NUM_CPUS:-2}" --object-store-memory=1000000000 --temp-dir="$tmp" --disable-usage-stats >"$tmp/start.log" 2>&1 \
        || { cat "$tmp/start.log"; exit 1; }
    echo "$gcs" >"$tmp/gcs_port"
    # Authentication is off, which is safe only while nothing can be reached from another machine.
    if ! loopback_check >/dev/null; then
        echo "ray_head.sh: the head above listens beyond loopback with authentication off, so it was stopped" >&2
        bash scripts/ray_head.sh stop "$tmp"
        exit 1
    fi
    echo "Ray head on 127.0.0.1:$gcs, dashboard http://127.0.0.1:$dash"
    ;;
check)
    summary=$(loopback_check)  # set -e: exits here, the exposed sockets on stderr, when the check fails
    echo "the head in $tmp: $summary"
    ;;
stop)
    pids=$(head_pids)
    if [ -n "$pids" ]; then
        kill ${pids//,/ } 2>/dev/null || true
        for _ in $(seq 20); do ps -p "$pids" >/dev/null || break; sleep 0.5; done
        kill -9 ${pids//,/ } 2>/dev/null || true
    fi
    rm -rf "$tmp"
    ;;
*) echo "usage: $0 start|check|stop TMPDIR [DASHBOARD_PORT GCS_PORT]" >&2; exit 2 ;;
esac
