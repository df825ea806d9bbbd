"""Orchestrator overlap: how close does the asynchronous driver get to the ideal speed-up?

On 2 CPU cores real generation and training share the cores, so real overlap cannot show here. Stand-in Ray
actors hold each stage for a set time instead (as GPU stage times would): generation G seconds per batch, training
T seconds per step. The driver under test is the real one (`entropy_openrlhf.pipeline.trainer.Trainer`): its
producer thread, bounded-staleness wait, queue and weight hand-over. Synchronous steps take G + T; asynchronous
ones ideally max(G, T), so the bound on the speed-up is (G + T) / max(G, T).

    .venv/bin/python benchmarks/overlap.py [--steps 8]

Prints a table, then `overlap_efficiency: <min over settings of measured speed-up / bound>` as the last line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray
from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

import entropy_openrlhf  # noqa: F401  (keeps a local Ray on loopback)
from entropy_openrlhf.cluster import init_ray
from entropy_openrlhf.config import from_args
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.samples import PromptItem, Sample
from entropy_openrlhf.sync.object_store import ObjectStoreSync


@ray.remote(num_cpus=0)
class HoldingActor:
    """Holds for a set time per call, like a GPU stage would."""

    def hold(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class StandInRollout:
    restarts = 0  # the trainer logs how many engines Ray restarted
    actors: list = []  # no engine: the object-store sync's loads are empty
    tensor_parallel_size = 1

    def __init__(self, seconds: float):
        self.actor, self.seconds = HoldingActor.remote(), seconds
        self.version = 0

    def generate(self, prompts: list[PromptItem], *, n: int, policy_version: int, **_) -> list[Sample]:
        ray.get(self.actor.hold.remote(self.seconds), timeout=self.seconds + 60)
        return [
            Sample(p.index, p.prompt, [1, 2], f"r{j}", [3, 4], [-1.0, -1.0], p.label, policy_version)
            for p in prompts
            for j in range(n)
        ]

    def shutdown(self) -> None:
        ray.kill(self.actor)


class StandInReward:
    def score(self, samples: list[Sample]):
        for i, s in enumerate(samples):
            s.reward = float(i % 2)
        return samples, {"reward/mean": 0.5}

    def shutdown(self) -> None:
        pass


class StandInPolicy:
    def __init__(self, seconds: float):
        self.actor, self.seconds = HoldingActor.remote(), seconds

    def train_step(
        self, samples, step: int, strength_scale: float = 1.0, entropy_coef: float | None = None
    ) -> dict[str, float]:
        ray.get(self.actor.hold.remote(self.seconds), timeout=self.seconds + 60)
        return {"loss/policy": 0.0}

    def call_all(self, method: str, *args, timeout_s: float | None = None, what: str = "") -> list:
        return [{}]  # the object-store sync's export (its only call here): nothing to move

    def shutdown(self) -> None:
        ray.kill(self.actor)


def measure(gen_s: float, train_s: float, staleness: int, steps: int) -> float:
    """Seconds per step in the steady state: the median step time after the first three. The first cannot
    overlap, and the producer starts up to max_staleness batches ahead, which a mean over a short run would count
    as speed (it measured above the bound that way)."""
    cfg = from_args(["--async.max_staleness", str(staleness), "--train.num_steps", str(steps + 3)])
    items = [PromptItem(i, f"q{i}", "0") for i in range(64)]
    trainer = Trainer(cfg, "", items, [])
    trainer.rollout, trainer.reward, trainer.reference = StandInRollout(gen_s), StandInReward(), None
    trainer.policy = StandInPolicy(train_s)
    # the object-store sync, whose exports and loads are empty here: the producer makes the engines current as in a run
    trainer.sync = ObjectStoreSync(trainer.rollout, trainer.policy)
    try:
        history = trainer.run()
    finally:
        trainer.shutdown_groups()
    return statistics.median(h["time/step"] for h in history[3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steady-state steps timed per setting")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    started = init_ray(num_cpus=4)
    load_before = os.getloadavg()[0]
    rows = []
    try:
        for gen_s, train_s in ((0.7, 0.3), (0.3, 0.7)):
            sync = measure(gen_s, train_s, 0, args.steps)
            asyn = measure(gen_s, train_s, 1, args.steps)
            bound = (gen_s + train_s) / max(gen_s, train_s)
            rows.append((gen_s, train_s, sync, asyn, sync / asyn, bound, (sync / asyn) / bound))
    finally:
        if started:
            ray.shutdown()
    print(
        f"{'G s':>5} {'T s':>5} {'sync s/step':>12} {'async s/step':>13} {'speed-up':>9} {'bound':>6} {'of bound':>9}"
    )
    for g, t, s, a, up, bound, eff in rows:
        print(f"{g:5.2f} {t:5.2f} {s:12.3f} {a:13.3f} {up:9.3f} {bound:6.3f} {eff:9.3f}")
    print(machine_line(load_before))
    if not rows or any(r[3] <= 0 for r in rows):
        print("overlap_efficiency: not measured")
        return 1
    print(f"overlap_efficiency: {min(r[6] for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
