"""Whole demo runs side by side, one per arm: LoRA against full fine-tuning, and the reference model only when used.

Each arm is a short real run of the demo (SmolLM2-135M-Instruct on the built-in task, KL-Cov, a local Ray on
127.0.0.1, W&B offline) through `memory.py`'s `measure`: every process of the run sampled with psutil, the run's
per-step metrics read back from its `metrics.jsonl`. The arms run back to back in this one process, so they
share the machine and its load; each run starts and stops its own Ray.

- `full`: full fine-tuning, the default (`--sync.method auto`: the collective sync of the whole model);
- `lora`: `--actor.lora_rank 32`; `auto` then syncs the adapter alone, which vLLM serves on the base model;
- `lora_merged`: `--actor.lora_rank 32 --sync.method collective`: the merged weights, as full fine-tuning sends;
- `ref_auto`: `--ref.enabled auto` (the default: the demo has no KL term, so no reference group starts);
- `ref_on`: `--ref.enabled true`: a reference group starts and computes reference log-probs every step.
- `zero0`: `--actor.zero_stage 0`, against `full`'s ZeRO-2 (on the demo's one policy rank ZeRO-2 partitions nothing).

Per arm: the peak over the run of the whole cluster's summed PSS and of the policy's, the engines' and (where one
starts) the reference's; the mean over steps 2..N of `time/step`, `time/train_actor`, `time/rollout`,
`time/reference`, `time/sync`, `time/export_weights` and `sync/mb` (the first step holds the warm-up); the last
step's `entropy/seq_mean` and `reward/mean`. Each figure comes with its ratio to the first arm's.

    .venv/bin/python benchmarks/lora.py --arms full,lora,lora_merged --steps 3    # LoRA against full fine-tuning
    .venv/bin/python benchmarks/lora.py --arms ref_auto,ref_on --steps 3          # the reference only when used
    (any other flag goes to every arm's run, e.g. --rollout.batch_size 4; --preset smoke for a quick check)

Prints each arm's memory table and per-step timings, then the machine, the comparison table, and
`<last arm>_over_<first arm>_step: <ratio of the mean time/step>` as the last line; exits non-zero when an arm could
not be measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path
from memory import (  # benchmarks/memory.py: the run and its sampler
    DRIVER,
    GIB,
    WANDB,
    CouldNotMeasure,
    Measurement,
    classify,
    group_order,
    measure,
    row,
)

ROOT = Path(__file__).resolve().parents[1]
ARMS: dict[str, list[str]] = {
    "full": [],
    "lora": ["--actor.lora_rank", "32"],
    "lora_merged": ["--actor.lora_rank", "32", "--sync.method", "collective"],
    "ref_auto": ["--ref.enabled", "auto"],
    "ref_on": ["--ref.enabled", "true"],
    "zero0": ["--actor.zero_stage", "0"],  # one rank: ZeRO-2's flat copies against none (benchmarks.md)
}
# (row label, where the figure comes from, what): "peak" a memory group's peak PSS ("cluster": the whole run's),
# "mean" a metric's mean over the steps after the first, "last" the last step's value. A row no arm has is left out.
ROWS: list[tuple[str, str, str]] = [
    ("peak PSS, whole cluster (GiB)", "peak", "cluster"),
    ("peak PSS, policy (GiB)", "peak", "policy (DeepSpeed)"),
    ("peak PSS, rollout engines (GiB)", "peak", "rollout engines"),
    ("peak PSS, reference (GiB)", "peak", "reference"),
    ("run wall time, start-up included (s)", "run", "seconds"),
    ("time/step (s)", "mean", "time/step"),
    ("time/train_actor (s)", "mean", "time/train_actor"),
    ("time/rollout (s)", "mean", "time/rollout"),
    ("time/reference (s)", "mean", "time/reference"),
    ("time/sync (s)", "mean", "time/sync"),
    ("time/export_weights (s)", "mean", "time/export_weights"),
    ("sync/mb (MiB per sync)", "mean", "sync/mb"),
    ("entropy/seq_mean, last step", "last", "entropy/seq_mean"),
    ("reward/mean, last step", "last", "reward/mean"),
]


@dataclass
class ArmResult:
    name: str
    values: dict[str, float | None]  # row label -> figure, None where the arm has none (no reference group)
    steps: int  # steps the run logged


def summarize(name: str, m: Measurement) -> ArmResult:
    """One arm's figures (ROWS) from its measurement."""
    later = m.metrics[1:]  # the first step holds the warm-up
    values: dict[str, float | None] = {}
    for label, kind, key in ROWS:
        if kind == "peak":
            peaks = m.sampler.cluster if key == "cluster" else m.sampler.groups.get(key)
            values[label] = peaks.pss / GIB if peaks is not None else None
        elif kind == "run":
            values[label] = m.seconds
        elif kind == "mean":
            seen = [s[key] for s in later if key in s]
            values[label] = sum(seen) / len(seen) if seen else None
        else:
            values[label] = m.metrics[-1].get(key) if m.metrics else None
    return ArmResult(name, values, len(m.metrics))


def cell(value: float | None, base: float | None, first: bool) -> str:
    if value is None:
        return "-"
    text = f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    if first:
        return text
    return f"{text} ({value / base:.2f}x)" if base else f"{text} (-)"


def table(results: list[ArmResult]) -> list[str]:
    """The markdown table: one row per figure that some arm has, one column per arm, each figure after the first
    arm's with its ratio to the first arm's."""
    base = results[0]
    lines = [
        "| figure | " + " | ".join(r.name for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for label, _, _ in ROWS:
        if all(r.values.get(label) is None for r in results):
            continue
        cells = [cell(r.values.get(label), base.values.get(label), r is base) for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def headline(results: list[ArmResult]) -> str:
    """`<last arm>_over_<first arm>_step: <ratio of the mean time/step>`."""
    first, last = results[0].values.get("time/step (s)"), results[-1].values.get("time/step (s)")
    ratio = last / first if first and last is not None else float("nan")
    return f"{results[-1].name}_over_{results[0].name}_step: {ratio:.3f}"


def wait_for_ray_to_exit(give_up_s: float = 60.0) -> int:
    """Wait until the last run's processes are gone (W&B's service stays for the process's life), so that none is
    sampled into the next arm; returns how many were left when it gave up (0: all gone)."""
    me = psutil.Process()
    deadline = time.monotonic() + give_up_s
    while True:
        left = []
        for proc in me.children(recursive=True):
            try:
                title = " ".join(proc.cmdline()) or proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if classify(title, False) not in (WANDB, DRIVER):
                left.append(proc)
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(1.0)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="full,lora,lora_merged", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per arm (>= 2: the means skip the first)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    args, pipeline_flags = ap.parse_known_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        ap.error(f"--arms: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ARMS)}")
    if args.steps < 2:
        ap.error("--steps must be >= 2: the step means leave out the first step")
    return args, pipeline_flags


def main(argv: list[str] | None = None) -> int:
    args, pipeline_flags = parse_args(argv)
    load_before = os.getloadavg()[0]
    results: list[ArmResult] = []
    for name in args.arms:
        flags = [*pipeline_flags, *ARMS[name]]
        print(f"arm {name}: flags {' '.join(flags) or '(the demo defaults)'}", file=sys.stderr, flush=True)
        try:
            m = measure(args.steps, flags, interval=args.interval)
        except CouldNotMeasure as e:
            print(f"error: could not measure arm {name}: {e}", file=sys.stderr)
            return 1
        left = wait_for_ray_to_exit()
        if left:
            print(f"note: {left} processes of arm {name}'s run were still alive 60 s after it", file=sys.stderr)
        if len(m.metrics) < args.steps:
            print(f"error: could not measure arm {name}: {len(m.metrics)} steps logged of {args.steps}")
            return 1
        results.append(summarize(name, m))
        print(f"\narm {name}: {m.seconds:.0f} s, {m.sampler.samples} samples every {args.interval} s")
        print(f"{'group':<34}{'processes':>10}{'peak RSS GiB':>14}{'peak PSS GiB':>14}{'sum VmHWM GiB':>15}")
        for group in sorted(m.sampler.groups, key=group_order):
            print(row(group, m.sampler.groups[group]))
        print(row("whole cluster", m.sampler.cluster))
        for _, kind, key in ROWS:
            if kind == "mean" and any(key in s for s in m.metrics):
                print(f"  per step, {key}: " + ", ".join(f"{s[key]:.3f}" if key in s else "-" for s in m.metrics))
        sys.stdout.flush()

    print("\n" + machine_line(load_before))
    print(
        f"kl_cov demo, {args.steps} steps per arm, flags {' '.join(pipeline_flags) or '(the demo defaults)'}; "
        f"means over steps 2..{args.steps}; ratios to {results[0].name}\n"
    )
    print("\n".join(table(results)))
    print()
    print(headline(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
