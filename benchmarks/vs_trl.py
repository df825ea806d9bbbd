"""A peer: TRL's GRPOTrainer against our trainer, samples per second on the same CPU and the same work.

Same model (SmolLM2-135M-Instruct, the local converted folder), same prompts (the built-in arithmetic task's
training split, chat template applied by each side's tokenizer), same GRPO shape: `--prompts` prompts x `--n`
samples per step, at most `--max-new-tokens` new tokens at T=1, top-p 1, micro-batches of `--micro-batch`
sequences and `--mini-batches` optimizer steps per rollout batch, lr 1e-5, no reference model (TRL's beta=0; our
--ref.enabled false), no gradient checkpointing, same dtype, seed 42.

- TRL runs in its own venv (benchmarks/.venv-trl, made by benchmarks/setup_trl_env.sh: its transformers and
  accelerate pins clash with ours) as a subprocess, generating with transformers' `generate` (`use_vllm=False`;
  TRL's vLLM mode needs CUDA or patches, docs/guides/cpu.md). Its reward is a plain last-\\boxed{} number match.
- Ours runs in this process as the pipelines do (real local Ray: vLLM engine, math-verify workers, DeepSpeed),
  synchronous (`--async.max_staleness 0`) and asynchronous (1).
- Order: TRL, ours sync, ours async, TRL again (the machine's speed drifts; the two TRL runs show by how much).
- Each side's first step (start-up, warm-up) is left out: samples/s = samples of steps 2..N / their wall time.
- The reward column shows that each side trains on the task; it does not compare them. The two sides draw
  different prompts (TRL's RepeatSampler shuffles with torch, our PromptStream with `random`, both seed 42), and a
  default run scores 64 samples a side; TRL's reward function and our verifier agree on TRL's completions
  (docs/guides/benchmarks.md, "The reward column is not a comparison").

    bash benchmarks/setup_trl_env.sh                   # once
    .venv/bin/python benchmarks/vs_trl.py               # SmolLM2, 4 prompts x 4 samples x 64 tokens, 4 steps
    .venv/bin/python benchmarks/vs_trl.py --model tiny --steps 3     # a quick check of the whole path

Prints a table, then `ours_async_over_trl: <our async samples/s / TRL's mean samples/s>` as the last line; exits
non-zero when either side could not be measured (TRL missing or failing included, with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"
HEADLINE = "ours_async_over_trl"
RESULT_TAG = "TRL_RESULT "
TRL_RUN_TIMEOUT_S = 3 * 3600.0  # the whole TRL run; a few minutes on two cores at the defaults


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | an HF model folder")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, else the checkpoint's) | bf16 | fp32")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run; the first is left out of the rate")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per rollout batch")
    ap.add_argument("--trl-runs", type=int, default=2, help="TRL runs: 1 = before ours, 2 = before and after")
    ap.add_argument("--trl-python", default=str(TRL_PYTHON), help="python of the TRL venv")
    # internal: the TRL side, run by the TRL venv's python
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default="", help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- TRL side (runs in .venv-trl)


def boxed_number_reward(completions, label, **_) -> list[float]:
    """1 when the last \\boxed{...} holds the label's number, else 0 (math-verify is not in TRL's venv)."""
    rewards = []
    for completion, gold in zip(completions, label):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = re.findall(r"\\boxed\{([^{}]*)\}", text)
        try:
            rewards.append(float(bool(found) and float(found[-1].replace(",", "").strip()) == float(gold)))
        except ValueError:
            rewards.append(0.0)
    return rewards


def trl_worker(args: argparse.Namespace) -> int:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    class Clock(TrainerCallback):
        """Wall time at the end of every optimizer step, and the logged completion lengths."""

        def __init__(self):
            self.ends, self.lengths, self.rewards = [], [], []

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    completions_per_step = args.prompts * args.n
    micro_per_mini = completions_per_step // args.mini_batches // args.micro_batch
    bf16 = args.dtype == "bf16"
    config = GRPOConfig(
        output_dir=args.out_dir,
        use_cpu=True,
        bf16=bf16,
        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=micro_per_mini,  # one optimizer step = one of our mini-batches
        steps_per_generation=micro_per_mini * args.mini_batches,  # one generation = one of our rollout batches
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-5,
        activation_checkpointing=False,  # TRL turns it on by default; ours is off
        use_vllm=False,
        max_steps=args.steps * args.mini_batches,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=42,
    )
    clock = Clock()
    trainer = GRPOTrainer(
        model=args.model_path,
        reward_funcs=boxed_number_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[clock],
    )
    trainer.train()
    ends = clock.ends[args.mini_batches - 1 :: args.mini_batches]  # the end of each rollout batch's last step
    if len(ends) != args.steps:
        print(f"TRL ran {len(clock.ends)} optimizer steps, expected {args.steps * args.mini_batches}", file=sys.stderr)
        return 1
    result = {
        "samples": completions_per_step * (args.steps - 1),
        "seconds": ends[-1] - ends[0],
        # logged once per generation; the first left out, as for the time
        "mean_len": statistics.mean(clock.lengths[1:] or [float("nan")]),
        "reward": statistics.mean(clock.rewards or [float("nan")]),
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__},
    }
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def run_trl(args: argparse.Namespace, model_path: str, data: str, dtype: str, tmp: str) -> dict:
    python = Path(args.trl_python)
    if not python.exists():
        raise RuntimeError(f"TRL's venv is missing ({python}): run `bash benchmarks/setup_trl_env.sh` first")
    cmd = [
        str(python), __file__, "--trl-worker", "--model-path", model_path, "--data", data, "--dtype", dtype,
        "--out-dir", tempfile.mkdtemp(dir=tmp), "--steps", str(args.steps), "--prompts", str(args.prompts),
        "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--micro-batch", str(args.micro_batch),
        "--mini-batches", str(args.mini_batches),
    ]  # fmt: skip
    # TRL's venv must not see ours (PYTHONPATH from `make`, say); offline like the rest of the project
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=TRL_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"TRL's GRPOTrainer did not finish {args.steps} steps within {TRL_RUN_TIMEOUT_S:.0f} s"
        ) from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"TRL's GRPOTrainer failed (exit {proc.returncode}): {tail}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


# --------------------------------------------------------------------------- our side (this venv)


def run_ours(
    args: argparse.Namespace, model_path: str, data: tuple[str, str], dtype: str, staleness: int, tmp: str
) -> dict:
    from entropy_openrlhf.config import from_args
    from entropy_openrlhf.pipeline.main import prepare
    from entropy_openrlhf.pipeline.trainer import Trainer
    from entropy_openrlhf.presets import PIPELINES

    cfg = from_args(
        [
            "--model.pretrain", model_path, "--model.dtype", dtype, "--data.train", data[0],
            "--data.test", data[1],  # not evaluated (eval.every 0); prepare() needs a non-empty test set
            "--rollout.batch_size", str(args.prompts), "--rollout.n_samples_per_prompt", str(args.n),
            "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.temperature", "1.0",
            "--rollout.top_p", "1.0", "--actor.micro_batch_size", str(args.micro_batch),
            "--train.mini_batches", str(args.mini_batches), "--train.num_steps", str(args.steps),
            "--async.max_staleness", str(staleness), "--ref.enabled", "false", "--actor.lr", "1e-5",
            "--train.seed", "42", "--eval.every", "0", "--train.output_dir", tempfile.mkdtemp(dir=tmp),
        ],
        PIPELINES["grpo"],
    )  # fmt: skip
    model_path, train_items, _ = prepare(cfg)
    trainer = Trainer(cfg, model_path, train_items, [])
    try:
        trainer.start_groups()
        history = trainer.run()
    finally:
        trainer.shutdown_groups()
    later = history[1:]
    return {
        "samples": int(sum(h["rollout/samples"] for h in later)),
        "seconds": sum(h["time/step"] for h in later),
        "mean_len": statistics.mean(h["rollout/response_len"] for h in later),
        "reward": statistics.mean(h.get("reward/mean", float("nan")) for h in history),
    }


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        return trl_worker(args)
    if args.steps < 2:
        print("error: --steps must be at least 2 (the first step is left out)", file=sys.stderr)
        return 2
    if (args.prompts * args.n) % (args.mini_batches * args.micro_batch):
        print("error: --prompts x --n must split into --mini-batches x --micro-batch", file=sys.stderr)
        return 2
    os.environ.setdefault("TQDM_DISABLE", "1")
    load_before = os.getloadavg()[0]
    rows: list[tuple[str, dict]] = []
    tmp = tempfile.TemporaryDirectory(prefix="vs_trl_")
    try:
        import ray

        from entropy_openrlhf.cluster import init_ray
        from entropy_openrlhf.data.arith_task import write_builtin_task
        from entropy_openrlhf.models.builtin import model_folder
        from entropy_openrlhf.models.dtype import resolve_dtype

        model_path = model_folder(args.model, tmp.name)
        dtype = args.dtype if args.dtype != "auto" else str(resolve_dtype("auto", model_path)).split(".")[-1]
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        data = write_builtin_task(Path(tmp.name) / "data", seed=42)
        train = data[0]

        rows.append(("TRL GRPOTrainer (HF generate), before", run_trl(args, model_path, train, dtype, tmp.name)))
        started = init_ray()
        try:
            rows.append(("ours, sync (max_staleness 0)", run_ours(args, model_path, data, dtype, 0, tmp.name)))
            rows.append(("ours, async (max_staleness 1)", run_ours(args, model_path, data, dtype, 1, tmp.name)))
        finally:
            if started:
                ray.shutdown()
        if args.trl_runs > 1:
            rows.append(("TRL GRPOTrainer (HF generate), after", run_trl(args, model_path, train, dtype, tmp.name)))
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.cleanup()

    trl_rates = [r["samples"] / r["seconds"] for name, r in rows if name.startswith("TRL")]
    trl_rate = statistics.mean(trl_rates)
    versions = next(r["versions"] for name, r in rows if name.startswith("TRL"))
    print(
        f"model {args.model} ({dtype}); {args.prompts} prompts x {args.n} samples x <= {args.max_new_tokens} tokens "
        f"per step, micro-batch {args.micro_batch}, {args.mini_batches} optimizer steps per batch; steps "
        f"2..{args.steps} timed; TRL {versions['trl']} (transformers {versions['transformers']})"
    )
    print(machine_line(load_before))
    print(f"{'run':<40}{'samples':>8}{'seconds':>9}{'samples/s':>11}{'mean len':>10}{'reward':>8}{'vs TRL':>8}")
    for name, r in rows:
        rate = r["samples"] / r["seconds"]
        print(
            f"{name:<40}{r['samples']:>8}{r['seconds']:>9.1f}{rate:>11.3f}{r['mean_len']:>10.1f}{r['reward']:>8.3f}"
            f"{rate / trl_rate:>8.2f}"
        )
    ours_async = rows[2][1]
    if min(r["seconds"] for _, r in rows) <= 0:
        print("error: could not measure: a run took no time", file=sys.stderr)
        return 1
    print(f"{HEADLINE}: {ours_async['samples'] / ours_async['seconds'] / trl_rate:.2f}")
    return 0


if __name__ == "__main__":
    if "--trl-worker" not in sys.argv:
        sys.path.insert(0, str(ROOT))  # ours: run as a script from anywhere
    sys.exit(main())
