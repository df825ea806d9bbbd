"""Math verifier throughput: checks per second over the test corpus, in-process and through the reward actor group
with 1 and 2 workers (real local Ray).

    .venv/bin/python benchmarks/verifier_throughput.py [--repeats 5]

Each setup first scores the corpus once (cold: first sight of every expression, sympy's caches empty; shown as
"cold s"), then `--repeats` more passes, timed (warm). The headline is the warm 2-worker rate, printed last as
`name: value`. Exits 1 when it could not measure, or when any check disagrees with the corpus (a fast wrong
verifier is no result).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "math_verifier_cases.jsonl"
HEADLINE = "verifier_warm_checks_per_s_2_workers"


def load_cases() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def make_samples(cases: list[dict], repeats: int):
    from entropy_openrlhf.samples import Sample

    fields = dict(prompt="", prompt_token_ids=[], response_token_ids=[], rollout_log_probs=[], policy_version=0)
    return [
        Sample(prompt_index=i, response=c["response"], label=c["label"], **fields)
        for _ in range(repeats)
        for i, c in enumerate(cases)
    ]


def run_in_process(cases: list[dict], repeats: int) -> tuple[float, float, int]:
    from rewards.math import math_verifier

    def one_pass(times: int) -> tuple[float, int]:
        start, wrong = time.perf_counter(), 0
        for _ in range(times):
            for c in cases:
                wrong += math_verifier(c["response"], c["label"])["acc"] is not c["expected"]
        return time.perf_counter() - start, wrong

    math_verifier("\\boxed{1}", "1")  # module imports are not throughput
    cold, wrong_cold = one_pass(1)
    warm, wrong = one_pass(repeats)
    return cold, warm, wrong_cold + wrong


def run_group(cases: list[dict], repeats: int, workers: int, timeout_s: float) -> tuple[float, float, int]:
    from entropy_openrlhf.actors.reward import RewardGroup

    def one_pass(times: int) -> tuple[float, int]:
        start = time.perf_counter()
        out, _ = group.score(make_samples(cases, times))
        seconds = time.perf_counter() - start
        return seconds, sum(s.acc is not c["expected"] for s, c in zip(out, cases * times))

    group = RewardGroup("math", num_workers=workers, timeout_s=timeout_s)
    try:
        group.score(make_samples([{"response": "\\boxed{1}", "label": "1"}] * 4, 1))  # worker start-up
        cold, wrong_cold = one_pass(1)
        warm, wrong = one_pass(repeats)
    finally:
        group.shutdown()
    return cold, warm, wrong_cold + wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="passes over the corpus per measurement")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)

    cases = load_cases()
    n = len(cases) * args.repeats
    load_before = os.getloadavg()[0]  # other work on the machine skews the figures: record it
    rows = []
    try:
        rows.append(("in-process, main thread", *run_in_process(cases, args.repeats)))

        import ray

        from entropy_openrlhf.cluster import init_ray

        started = init_ray(num_cpus=8)
        try:
            for workers in (1, 2):
                name = f"RewardGroup, {workers} worker{'s' if workers > 1 else ''}"
                rows.append((name, *run_group(cases, args.repeats, workers, args.timeout_s)))
        finally:
            if started:
                ray.shutdown()
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        print(f"error: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

    print(f"{machine_line(load_before)}; Python {sys.version.split()[0]}")
    print(f"corpus: {len(cases)} cases; cold = 1 pass, warm = {args.repeats} passes ({n} checks)")
    print(f"{'setup':<26}{'cold s':>8}{'cold checks/s':>15}{'warm s':>8}{'warm checks/s':>15}{'wrong':>7}")
    for name, cold, warm, wrong in rows:
        print(f"{name:<26}{cold:>8.2f}{len(cases) / cold:>15.0f}{warm:>8.2f}{n / warm:>15.0f}{wrong:>7}")
    if any(wrong for *_, wrong in rows):
        print("error: some checks disagree with the corpus", file=sys.stderr)
        return 1
    print(f"{HEADLINE}: {n / rows[-1][2]:.0f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
