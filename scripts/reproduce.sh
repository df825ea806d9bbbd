#!/usr/bin/env bash
# The small-scale reproduction (docs/results.md): GRPO, clip-higher, Clip-Cov and KL-Cov on the built-in arithmetic
# task with SmolLM2-135M-Instruct, the same seed, data and budget, several optimizer steps per rollout batch (the
# paper's recipe shape), held-out accuracy every few steps. Then the plots and the results table.
#
#   bash scripts/reproduce.sh                         # all four methods, one after the other
#   METHODS="grpo kl_cov" bash scripts/reproduce.sh   # a subset
#   bash scripts/reproduce.sh --train.num_steps 10    # any pipeline flag applies to every run
#
# Each run is a local-mode pipeline (its own Ray on 127.0.0.1, stopped when it ends) writing outputs/repro/<method>.
# A method whose run finished (its final model exists) is skipped, so the four hours can be spread over several
# sittings; an unfinished run is started again from scratch. REPRO_FORCE=1 reruns finished ones too.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${REPRO_OUT:-outputs/repro}
PLOTS=${REPRO_PLOTS:-docs}  # where the PNGs go
METHODS=${METHODS:-grpo clip_higher clip_cov kl_cov}
# Same budget for every method: 25 steps of 4 prompts x 4 samples in 4 optimizer mini-batches, held-out accuracy
# on 64 test prompts every 5 steps. The demo's 4x4 step takes ~128 s on 2 cores, so a run is about an hour.
COMMON=(--train.seed 1 --train.num_steps 25 --rollout.batch_size 4 --train.mini_batches 4
    --eval.every 5 --eval.max_samples 64 --async.max_staleness 1 --logger.sample_table_every 0)

mkdir -p "$OUT"
for method in $METHODS; do
    if [[ -d "$OUT/$method/final" && -z "${REPRO_FORCE:-}" ]]; then
        echo "== $method: finished earlier in $OUT/$method, skipped"
        continue
    fi
    rm -rf "${OUT:?}/$method"
    echo "== $method: $(date -u +%H:%M:%S)"
    start=$(date +%s)
    .venv/bin/python "pipelines/$method.py" --train.output_dir "$OUT/$method" --logger.run_name "repro-$method" \
        "${COMMON[@]}" "$@" 2>&1 | tee "$OUT/$method.log" | grep --line-buffered '^\[entropy-openrlhf\]\|^error'
    echo "== $method took $(( $(date +%s) - start )) s"
    # the per-step metrics, kept beside the plots so they can be redrawn once outputs/ is gone
    mkdir -p "$PLOTS/runs/$method"
    cp "$OUT/$method"/wandb/offline-run-*/files/metrics.jsonl "$PLOTS/runs/$method/metrics.jsonl"
done

# Every method measured so far, not just this call's: the runs can be spread over several sittings.
specs=()
for method in $(printf "%s\n" grpo clip_higher clip_cov kl_cov $METHODS | awk '!seen[$0]++'); do
    if [[ -f "$PLOTS/runs/$method/metrics.jsonl" ]]; then specs+=("$method=$PLOTS/runs/$method"); fi
done
.venv/bin/python scripts/plot_runs.py "${specs[@]}" --out "$PLOTS" --prefix arith_ | tee "$OUT/results.txt"
