#!/usr/bin/env bash
# The small-scale reproduction (docs/results.md): GRPO, clip-higher, Clip-Cov and KL-Cov on the built-in arithmetic
# task with SmolLM2-135M-Instruct, the same seed, data and budget, several optimizer steps per rollout batch (the
# paper's recipe shape), held-out accuracy every few steps. Then the plots and the results table.
#
#   bash scripts/reproduce.sh                         # all four methods, one after the other
#   METHODS="grpo kl_cov" bash scripts/reproduce.sh   # a subset
#   bash scripts/reproduce.sh --train.num_steps 10    # any pipeline flag applies to every run
#   METHODS="kl_cov_target kl_cov_target_ratio" bash scripts/reproduce.sh   # KL-Cov under entropy control
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

# Runs that are not a pipeline of their own: the pipeline they run and their own flags.
# kl_cov_target: KL-Cov whose coefficient the entropy controller moves to keep entropy/seq_mean in [0.5, 0.8], about
# where every method starts on this task (0.68 at step 0) and where the fixed-ratio KL-Cov run swung through.
CTL_BAND=0.5,0.8
# kl_cov_target_ratio: the same, the controller scaling KL-Cov's ratio of tokens instead of its coefficient.
declare -A PIPELINE=([kl_cov_target]=kl_cov [kl_cov_target_ratio]=kl_cov)
declare -A EXTRA=([kl_cov_target]="--entropy.target $CTL_BAND"
    [kl_cov_target_ratio]="--entropy.target $CTL_BAND --entropy.knob ratio")

mkdir -p "$OUT"
for method in $METHODS; do
    if [[ -d "$OUT/$method/final" && -z "${REPRO_FORCE:-}" ]]; then
        echo "== $method: finished earlier in $OUT/$method, skipped"
        continue
    fi
    rm -rf "${OUT:?}/$method"
    echo "== $method: $(date -u +%H:%M:%S)"
    start=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA holds several flags
    .venv/bin/python "pipelines/${PIPELINE[$method]:-$method}.py" --train.output_dir "$OUT/$method" \
        --logger.run_name "repro-$method" "${COMMON[@]}" ${EXTRA[$method]:-} "$@" 2>&1 | tee "$OUT/$method.log" | grep --line-buffered '^\[entropy-openrlhf\]\|^error'
    echo "== $method took $(( $(date +%s) - start )) s"
    # the per-step metrics, kept beside the plots so they can be redrawn once outputs/ is gone
    mkdir -p "$PLOTS/runs/$method"
    cp "$OUT/$method"/wandb/offline-run-*/files/metrics.jsonl "$PLOTS/runs/$method/metrics.jsonl"
done

# Every method measured so far, not just this call's: the runs can be spread over several sittings.
plot() {  # plot PREFIX "FLAGS" METHOD...: the plots and table of those runs that exist
    local prefix=$1 flags=$2 specs=() method
    shift 2
    for method in "$@"; do
        if [[ -f "$PLOTS/runs/$method/metrics.jsonl" ]]; then specs+=("$method=$PLOTS/runs/$method"); fi
    done
    # shellcheck disable=SC2086  # flags holds several words
    .venv/bin/python scripts/plot_runs.py "${specs[@]}" --out "$PLOTS" --prefix "$prefix" $flags
}
plot arith_ "" grpo clip_higher clip_cov kl_cov | tee "$OUT/results.txt"
# entropy control against its two baselines (docs/results.md, "Entropy control"), its band shaded and scored
if [[ -f "$PLOTS/runs/kl_cov_target/metrics.jsonl" ]]; then
    plot ctl_ "--band $CTL_BAND" grpo kl_cov kl_cov_target kl_cov_target_ratio | tee "$OUT/results_control.txt"
fi
