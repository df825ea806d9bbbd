#!/usr/bin/env bash
# The small-scale reproduction (study/notebook.md) on the built-in arithmetic task with SmolLM2-135M-Instruct, the same
# data and budget for every method, several optimizer steps per rollout batch (the paper's recipe shape), held-out
# accuracy every few steps. Then the plots and the results table.
#
#   bash study/reproduce.sh --seeds 3               # the study: grpo clip_cov kl_cov kl_cov_band, seeds 1-3
#   METHODS="grpo kl_cov" bash study/reproduce.sh --seeds 3       # a subset of the study
#   METHODS=kl_cov_band_b05 bash study/reproduce.sh --seeds 2-2    # one seed of an arm
#   bash study/reproduce.sh                         # the single-seed comparison: grpo clip_higher clip_cov kl_cov
#   METHODS="kl_cov_target kl_cov_target_ratio" bash study/reproduce.sh   # KL-Cov under entropy control
#   bash study/reproduce.sh --train.num_steps 10    # any pipeline flag applies to every run
#   METHODS=async bash study/reproduce.sh --seeds 27   # the asynchrony experiment's four arms (below), seed by seed
#
# Each run is a local-mode pipeline (its own Ray on 127.0.0.1, stopped when it ends) writing outputs/repro/<run>,
# where <run> is the method, or <method>_seed<N> in the study. The study evaluates pass@k with 16 samples per
# held-out prompt at the start, at step 13 and on the final weights, and checkpoints every 5 steps: a run stopped part-way
# continues from its newest checkpoint (--train.resume true) when the script is started again. A run whose final
# model exists is skipped; REPRO_FORCE=1 reruns it. Per-step metrics are copied to study/runs/<run>/metrics.jsonl.
# REPRO_DRY_RUN=1 prints each run's command instead of running it (and writes nothing): what a run would be given.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${REPRO_OUT:-outputs/repro}
STUDY=${REPRO_STUDY:-study}  # the study folder: its runs/ (per-step metrics) and figures/ (the PNGs)
RUNS=$STUDY/runs
FIGURES=$STUDY/figures
SEEDS=0  # 0: the single-seed comparison (seed 1, runs named by method)
FIRST_SEED=1
if [[ ${1:-} == --seeds ]]; then
    # N: seeds 1 to N; A-B: seeds A to B (--seeds 2-2 runs seed 2 alone)
    if [[ $2 =~ ^([0-9]+)-([0-9]+)$ ]]; then
        FIRST_SEED=${BASH_REMATCH[1]} SEEDS=${BASH_REMATCH[2]}
    elif [[ $2 =~ ^[0-9]+$ ]]; then
        SEEDS=$2
    else
        echo "error: --seeds $2: give N (seeds 1 to N) or A-B (seeds A to B)" >&2
        exit 2
    fi
    shift 2
fi
if (( SEEDS > 0 )); then
    METHODS=${METHODS:-grpo clip_cov kl_cov kl_cov_band}
else
    METHODS=${METHODS:-grpo clip_higher clip_cov kl_cov}
fi
# Same budget for every method: 25 steps of 4 prompts x 4 samples in 4 optimizer mini-batches, held-out accuracy
# on 64 test prompts every 5 steps. The demo's 4x4 step takes ~128 s on 2 cores, so a run is about an hour.
COMMON=(--train.seed 1 --train.num_steps 25 --rollout.batch_size 4 --train.mini_batches 4
    --eval.every 5 --eval.max_samples 64 --async.max_staleness 1 --logger.sample_table_every 0)

# The study's extra budget: pass@k over 16 samples per held-out prompt, midway and at the end, and checkpoints.
# Three evaluations (versions 0, 13 and the final 25): 64 prompts x 16 samples take minutes on two cores.
STUDY=(--eval.n_samples 16 --eval.every 13 --train.save_every 5 --train.keep_checkpoints 1)
# The study's Clip-Cov arm is the first setting that gave it room at this size (docs/algorithms/losses.md, "At small scale"):
# bounds in covariance std, ratio 0.05. clip_cov_wide is today's --preset clip-cov-small.
declare -A STUDY_EXTRA=([clip_cov]="--loss.clip_cov.bounds_unit std --loss.clip_cov.ratio 0.05")

# The exploration experiment (study/notebook.md, "The exploration experiment"), fixed in advance: GRPO and KL-Cov on
# levels 3 and 4 of the built-in task, 4 prompts x 8 samples, 50 steps, every run evaluated on one shared held-out
# set (96 prompts, study/runs/explore_base/heldout.jsonl) with 64 samples per prompt at T = 1.0 at step 25 and on the
# final weights; the base model is evaluated once on the same set (study/runs/explore_base/metrics.json).
#   METHODS="explore_grpo explore_kl_cov" bash study/reproduce.sh --seeds 7
EXPLORE_HELDOUT=study/runs/explore_base/heldout.jsonl
EXPLORE_EVAL=(--data.test "$EXPLORE_HELDOUT" --eval.max_samples 0 --eval.n_samples 64 --eval.temperature 1.0)
EXPLORE=(--data.builtin_levels 3,4 --rollout.n_samples_per_prompt 8 --train.num_steps 50 "${EXPLORE_EVAL[@]}"
    --eval.every 25 --eval.initial false)
STUDY_EXTRA[explore_grpo]="${EXPLORE[*]}"
STUDY_EXTRA[explore_kl_cov]="${EXPLORE[*]}"

# Runs that are not a pipeline of their own: the pipeline they run and their own flags.
# kl_cov_target: KL-Cov whose coefficient the entropy controller moves to keep entropy/seq_mean in [0.5, 0.8], about
# where every method starts on this task (0.68 at step 0) and where the fixed-ratio KL-Cov run swung through.
CTL_BAND=0.5,0.8
# kl_cov_target_ratio: the same, the controller scaling KL-Cov's ratio of tokens instead of its coefficient.
# kl_cov_band (the study): KL-Cov under the controller, holding the same band.
# grpo_band: GRPO under the controller, which has only the entropy bonus to move (`--seeds 1`, METHODS=grpo_band).
# clip_cov_wide: Clip-Cov detaching more than the study's arm, --preset clip-cov-small: bounds from 0.5 std (more
# candidates) and a ratio of 0.1 (1-3% of tokens detached); the study's clip_cov selected 0.8-1.2% of tokens.
# clip_cov_global: clip_cov_wide drawing once over each optimizer mini-batch (--loss.scope global). At this shape a
# mini-batch (4 samples) is one micro-batch, so it is the same run: its seed 1 logged what clip_cov_wide's did.
# clip_cov_all: the preset with a ratio of 1, so the quota never binds and every token inside the bounds is detached
# (in the preset's runs the candidates often outnumbered its 10% quota). It let entropy run away in seed 1.
# clip_cov_r03: the preset with a ratio of 0.3, between 0.1 (no measurable effect over seven seeds) and 1 (a
# runaway); seven seeds against GRPO's, fixed in advance: entropy above GRPO's in every seed but train accuracy
# significantly lower, entropy running away in four seeds (study/notebook.md, "Ratio 0.3").
# kl_cov_band_b05: kl_cov_band with a bonus ceiling five times the default (--entropy.max_bonus 0.05): in the study's
# seed 2 both knobs reached their bounds and entropy still fell below the band (docs/algorithms/entropy_control.md).
# kl_cov_clip: an ablation, KL-Cov's penalty on GRPO's clipped loss (`METHODS=kl_cov_clip ... --seeds 3`): KL-Cov
# minus GRPO mixes the penalty with the clip KL-Cov drops; kl_cov_clip minus GRPO is the penalty alone.
# async_{grpo,kl_cov}_{sync,partial}: the asynchrony experiment (study/notebook.md, "KL-Cov under asynchrony, fixed in
# advance"), GRPO and KL-Cov at the seven-seed study's settings under two more schedules beside the committed one step
# off (grpo_seed<N>, kl_cov_seed<N>: batch mode, staleness 1): synchronous (batch mode, staleness 0) and partial
# rollouts (staleness 2, the KV cache kept across an in-flight update). The modes are stated, not left to defaults
# that may change. METHODS=async names the four arms; their runs are never resumed (run_one).
ASYNC_SYNC="--rollout.mode batch --async.max_staleness 0"
ASYNC_PARTIAL="--rollout.mode partial --async.max_staleness 2 --rollout.partial_kv keep"
declare -A PIPELINE=([kl_cov_target]=kl_cov [kl_cov_target_ratio]=kl_cov [kl_cov_band]=kl_cov [grpo_band]=grpo
    [kl_cov_clip]=kl_cov [kl_cov_band_b05]=kl_cov [clip_cov_wide]=clip_cov [clip_cov_global]=clip_cov
    [clip_cov_all]=clip_cov [clip_cov_r03]=clip_cov [explore_grpo]=grpo [explore_kl_cov]=kl_cov
    [async_grpo_sync]=grpo [async_kl_cov_sync]=kl_cov [async_grpo_partial]=grpo [async_kl_cov_partial]=kl_cov)
declare -A EXTRA=([kl_cov_target]="--entropy.target $CTL_BAND"
    [kl_cov_target_ratio]="--entropy.target $CTL_BAND --entropy.knob ratio"
    [kl_cov_band]="--entropy.target $CTL_BAND" [grpo_band]="--entropy.target $CTL_BAND"
    [kl_cov_clip]="--loss.kl_cov.ppo_clip true" [kl_cov_band_b05]="--entropy.target $CTL_BAND --entropy.max_bonus 0.05"
    [clip_cov_wide]="--preset clip-cov-small" [clip_cov_global]="--preset clip-cov-small --loss.scope global"
    [clip_cov_all]="--preset clip-cov-small --loss.clip_cov.ratio 1"
    [clip_cov_r03]="--preset clip-cov-small --loss.clip_cov.ratio 0.3"
    [async_grpo_sync]="$ASYNC_SYNC" [async_kl_cov_sync]="$ASYNC_SYNC"
    [async_grpo_partial]="$ASYNC_PARTIAL" [async_kl_cov_partial]="$ASYNC_PARTIAL")
ASYNC_ARMS=(async_grpo_sync async_kl_cov_sync async_grpo_partial async_kl_cov_partial)  # a seed's four runs, in order
expanded=()
for method in $METHODS; do  # METHODS=async: the four arms of the asynchrony experiment
    if [[ $method == async ]]; then expanded+=("${ASYNC_ARMS[@]}"); else expanded+=("$method"); fi
done
METHODS=${expanded[*]}
# The order the study's table lists its arms in, the baseline first. An arm declared above but missing here is
# still plotted, after these: a new arm never drops out of the table unnoticed.
STUDY_ORDER=(grpo clip_cov kl_cov kl_cov_band grpo_band kl_cov_clip kl_cov_band_b05 clip_cov_wide clip_cov_global
    clip_cov_all clip_cov_r03)

merge_metrics() {  # merge_metrics RUN_DIR OUT_FILE: the run's metrics.jsonl (resumes append to it), or for a run
    # from before it moved there, every W&B run folder's (one per resume), in order; a step logged again after a
    # resume replaces the earlier row. A step's row of an older evaluation alone (docs/guides/metrics.md) is kept
    # beside its training row, before it.
    .venv/bin/python - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
rows, run = {}, Path(sys.argv[1])
files = [run / "metrics.jsonl"] if (run / "metrics.jsonl").exists() else []
for f in files or sorted(run.glob("wandb/offline-run-*/files/metrics.jsonl")):
    for line in f.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            alone = "loss/policy" not in row and "eval/policy_version" in row
            rows[(row["step"], 0, row["eval/policy_version"]) if alone else (row["step"], 1, 0)] = row
Path(sys.argv[2]).write_text("".join(json.dumps(rows[key]) + "\n" for key in sorted(rows)))
PY
}

run_one() {  # run_one RUN METHOD FLAGS...: one pipeline run into $OUT/RUN, resumed when it has a checkpoint
    local run=$1 method=$2 resume=()
    shift 2
    if [[ -d "$OUT/$run/final" && -z "${REPRO_FORCE:-}" ]]; then
        echo "== $run: finished earlier in $OUT/$run, skipped"
        return
    fi
    # a study run committed by an earlier sitting (its outputs/ gone with that machine) is not run again
    if [[ $run == *_seed* && -f "$RUNS/$run/metrics.jsonl" && -z "${REPRO_FORCE:-}" ]]; then
        echo "== $run: its metrics are in $RUNS/$run, skipped"
        return
    fi
    if [[ -z "${REPRO_FORCE:-}" ]] && compgen -G "$OUT/$run/checkpoints/step*" >/dev/null; then
        if [[ $run == async_* ]]; then
            # the asynchrony experiment's runs are unbroken: a resumed streaming run rolls the prompts that were in
            # flight out again from the checkpoint's weights (docs/guides/streaming.md), so it is not the run an
            # unbroken one would have been, and every arm of the experiment is treated alike
            echo "== $run: stopped part-way earlier; the asynchrony experiment's runs start again from step 0"
        else
            resume=(--train.resume true)
        fi
    fi
    # shellcheck disable=SC2086  # EXTRA holds several flags
    local cmd=(.venv/bin/python "pipelines/${PIPELINE[$method]:-$method}.py" --train.output_dir "$OUT/$run"
        --logger.run_name "repro-$run" "${COMMON[@]}" ${EXTRA[$method]:-} "$@" "${resume[@]}")
    if [[ -n "${REPRO_DRY_RUN:-}" ]]; then
        echo "== $run: ${cmd[*]}"
        return
    fi
    if (( ${#resume[@]} )); then
        echo "== $run: continuing from its newest checkpoint, $(date -u +%H:%M:%S)"
    else
        rm -rf "${OUT:?}/$run"
        echo "== $run: $(date -u +%H:%M:%S)"
    fi
    local start
    start=$(date +%s)
    "${cmd[@]}" 2>&1 | tee -a "$OUT/$run.log" | grep --line-buffered '^\[entropy-openrlhf\]\|^error'
    echo "== $run took $(( $(date +%s) - start )) s"
    # the per-step metrics, kept beside the plots so they can be redrawn once outputs/ is gone
    mkdir -p "$RUNS/$run"
    merge_metrics "$OUT/$run" "$RUNS/$run/metrics.jsonl"
}

if [[ -z "${REPRO_DRY_RUN:-}" ]]; then mkdir -p "$OUT"; fi
explore_base() {  # the base model on the exploration's held-out set, once: what every exploration run starts from
    local out=study/runs/explore_base/metrics.json
    local cmd=(.venv/bin/python scripts/evaluate.py --data.test "$EXPLORE_HELDOUT" --eval.max_samples 0
        --eval.n_samples 64 --eval.temperature 1.0 --train.seed 1 --train.output_dir "$OUT/explore_base"
        --eval.output_json "$out")
    if [[ -n "${REPRO_DRY_RUN:-}" ]]; then
        echo "== explore_base: ${cmd[*]}"
    elif [[ -f $out && -z "${REPRO_FORCE:-}" ]]; then
        echo "== explore_base: its metrics are in $out, skipped"
    else
        echo "== explore_base: $(date -u +%H:%M:%S)"
        "${cmd[@]}" 2>&1 | tee "$OUT/explore_base.log" | tail -n 20
    fi
}
if [[ " $METHODS " == *" explore_"* ]]; then explore_base; fi
if (( SEEDS > 0 )); then
    for seed in $(seq "$FIRST_SEED" "$SEEDS"); do  # every method's seed 1 first: a partial study still compares them all
        for method in $METHODS; do
            # shellcheck disable=SC2086  # STUDY_EXTRA holds several flags
            run_one "${method}_seed$seed" "$method" --train.seed "$seed" "${STUDY[@]}" ${STUDY_EXTRA[$method]:-} "$@"
        done
    done
else
    for method in $METHODS; do
        run_one "$method" "$method" "$@"
    done
fi

if [[ -n "${REPRO_DRY_RUN:-}" ]]; then exit 0; fi  # the commands were printed; nothing ran, nothing to plot
if [[ " $METHODS " == *" explore_"* ]]; then
    # the exploration experiment's analysis, fixed before its runs (an error while fewer than two pairs are in)
    .venv/bin/python -m study.explore --runs "$RUNS" | tee "$OUT/results_explore.txt" || true
fi
if [[ " $METHODS " == *" async_"* ]]; then
    # the asynchrony experiment's analysis, fixed before its runs (an error naming the runs still missing)
    .venv/bin/python -m study.asynchrony --runs "$RUNS" | tee "$OUT/results_async.txt" || true
fi
if (( SEEDS > 0 )); then
    # every seed of every study method measured so far: several runs under one label are one method's seeds
    specs=()
    arms=("${STUDY_ORDER[@]}")
    for method in $(printf '%s\n' "${!PIPELINE[@]}" | sort); do
        # the exploration runs are another task (levels 3-4, 50 steps) and the asynchrony runs other schedules:
        # tabulated apart, not beside the study's
        if [[ " ${arms[*]} " != *" $method "* && $method != explore_* && $method != async_* ]]; then
            arms+=("$method")
        fi
    done
    for method in "${arms[@]}"; do
        for dir in "$RUNS"/"${method}"_seed*/; do
            if [[ -f "$dir/metrics.jsonl" ]]; then specs+=("$method=${dir%/}"); fi
        done
    done
    .venv/bin/python -m study.plot_runs "${specs[@]}" --out "$FIGURES" --prefix study_ --band "$CTL_BAND" \
        | tee "$OUT/results_study.txt"
    exit 0
fi

# Every method measured so far, not just this call's: the runs can be spread over several sittings.
plot() {  # plot PREFIX "FLAGS" METHOD...: the plots and table of those runs that exist
    local prefix=$1 flags=$2 specs=() method
    shift 2
    for method in "$@"; do
        if [[ -f "$RUNS/$method/metrics.jsonl" ]]; then specs+=("$method=$RUNS/$method"); fi
    done
    # shellcheck disable=SC2086  # flags holds several words
    .venv/bin/python -m study.plot_runs "${specs[@]}" --out "$FIGURES" --prefix "$prefix" $flags
}
plot arith_ "" grpo clip_higher clip_cov kl_cov | tee "$OUT/results.txt"
# entropy control against its two baselines (study/notebook.md, "Entropy control"), its band shaded and scored
if [[ -f "$RUNS/kl_cov_target/metrics.jsonl" ]]; then
    plot ctl_ "--band $CTL_BAND" grpo kl_cov kl_cov_target kl_cov_target_ratio | tee "$OUT/results_control.txt"
fi
