"""Peak memory of each actor group and of the whole cluster during a short real run of the demo.

The pipeline runs in this process exactly as `pipelines/kl_cov.py` does (`entropy_openrlhf.pipeline.main.main`:
SmolLM2-135M-Instruct on the built-in task, the demo's settings, a local Ray on 127.0.0.1, W&B offline), for
`--steps` steps. Ray's processes (GCS, raylet with the object store, agents) and every worker are descendants of
this process, so a background thread samples all of them every `--interval` seconds with psutil and sorts each into
a group by its title (`ray::RolloutEngine`, `ray::PolicyActor`, `ray::ReferenceActor`, `ray::VerifierWorker`, other
`ray::` workers, Ray's own processes, this driver). Per group and for the cluster it keeps the peak over samples of
- RSS, summed: pages shared between processes (torch's libraries, the object store's shared memory) count once per
  process, so this overstates what the group occupies;
- PSS, summed: each shared page split among its users, so the cluster's sum is the RAM the run really holds;
and the kernel's RSS high-water mark (VmHWM) of each process, summed per group: it also catches spikes between
samples, but adds peaks that did not happen at the same time.

    .venv/bin/python benchmarks/memory.py                               # the demo: SmolLM2, 2 steps
    .venv/bin/python benchmarks/memory.py --steps 1 --preset smoke      # a tiny model: a quick check
    (any other flag goes to the pipeline, e.g. --rollout.batch_size 4)

Prints the table, then `peak_cluster_gib: <peak of the cluster's summed PSS, GiB>` as the last line (the issue's
limit: under 16 GiB on the 24 GiB machine); exits non-zero when the run failed or nothing was sampled.

`measure` (one sampled run and its per-step metrics, as a value) is what `benchmarks/lora.py` runs for each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
LIMIT_GIB = 16.0
# (group, prefixes of the process title); the first match wins
GROUPS = [
    ("rollout engines", ("ray::RolloutEngine", "ray::RolloutActor")),
    ("policy (DeepSpeed)", ("ray::PolicyActor",)),
    ("reference", ("ray::ReferenceActor",)),
    ("reward workers", ("ray::VerifierWorker",)),
    ("other Ray workers", ("ray::",)),
]
DRIVER, WANDB, RAY_SYSTEM = "driver (this process)", "W&B service", "Ray system (GCS, raylet, agents)"


def classify(title: str, is_driver: bool) -> str:
    if is_driver:
        return DRIVER
    for group, prefixes in GROUPS:
        if title.startswith(prefixes):
            return group
    return WANDB if "wandb" in title else RAY_SYSTEM


@dataclass
class Peaks:
    rss: float = 0.0  # bytes, peak over samples of the group's summed RSS
    pss: float = 0.0
    processes: int = 0  # most processes seen in the group at once
    hwm: dict[int, float] = field(default_factory=dict)  # pid -> kernel high-water mark of RSS


class Sampler(threading.Thread):
    """Samples this process and all its descendants until stopped."""

    def __init__(self, interval: float):
        super().__init__(name="memory-sampler", daemon=True)
        self.interval, self.stop = interval, threading.Event()
        self.groups: dict[str, Peaks] = {}
        self.cluster = Peaks()
        self.samples = 0
        self.error: BaseException | None = None  # what ended the sampling early, if anything did

    def run(self) -> None:
        try:
            self._sample_until_stopped()
        except BaseException as e:  # noqa: BLE001 - main() reports it and prints no figure
            self.error = e

    def _sample_until_stopped(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.is_set():
            sums: dict[str, list[float]] = {}
            for proc in [me, *me.children(recursive=True)]:
                try:
                    title = " ".join(proc.cmdline()) or proc.name()
                    mem = proc.memory_full_info()  # rss, and pss from /proc/<pid>/smaps_rollup
                    hwm = _vm_hwm(proc.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
                    continue  # it exited between the listing and the reads: it is in no sum of this sample
                group = classify(title, proc.pid == me.pid)
                s = sums.setdefault(group, [0.0, 0.0, 0])
                s[0] += mem.rss
                s[1] += getattr(mem, "pss", mem.rss)
                s[2] += 1
                self.groups.setdefault(group, Peaks()).hwm[proc.pid] = hwm
                self.cluster.hwm[proc.pid] = hwm
            for group, (rss, pss, count) in sums.items():
                p = self.groups[group]
                p.rss, p.pss, p.processes = max(p.rss, rss), max(p.pss, pss), max(p.processes, count)
            c = self.cluster
            c.rss = max(c.rss, sum(s[0] for s in sums.values()))
            c.pss = max(c.pss, sum(s[1] for s in sums.values()))
            c.processes = max(c.processes, sum(s[2] for s in sums.values()))
            self.samples += 1
            self.stop.wait(self.interval)


def _vm_hwm(pid: int) -> float:
    """The kernel's peak RSS of a process (VmHWM), in bytes. Raises ProcessLookupError if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    return 0.0


def row(name: str, p: Peaks) -> str:
    return f"{name:<34}{p.processes:>10}{p.rss / GIB:>14.2f}{p.pss / GIB:>14.2f}{sum(p.hwm.values()) / GIB:>15.2f}"


class CouldNotMeasure(RuntimeError):
    """The run failed, or the sampler did not see it to the end: there is no figure to print."""


@dataclass
class Measurement:
    sampler: Sampler  # its groups' and the cluster's peaks
    seconds: float  # the run's wall time
    load_before: float  # 1-minute load average before the run
    metrics: list[dict[str, float]]  # the run's logged metrics, one merged dict per step in step order


def measure(steps: int, pipeline_flags: list[str], pipeline: str = "kl_cov", interval: float = 0.5) -> Measurement:
    """Run the pipeline in this process for `steps` steps, sampling every process of the run, and read back its
    per-step metrics (the output folder's `metrics.jsonl`) before its temporary output folder goes. Raises
    CouldNotMeasure, saying why, when the run failed or was not sampled to its end. Ray is shut down when it returns
    (the run owns the local Ray it starts), so it can be called again in the same process."""
    os.environ.setdefault("TQDM_DISABLE", "1")

    from entropy_openrlhf.pipeline.main import main as pipeline_main

    load_before = os.getloadavg()[0]
    sampler = Sampler(interval)
    tmp = tempfile.TemporaryDirectory(prefix="memory_")
    wandb_dir = os.environ.pop("WANDB_DIR", None)  # the run's W&B folder goes under its output dir, removed with it
    sampler.start()
    t0 = time.time()
    try:
        flags = ["--train.num_steps", str(steps), "--train.output_dir", tmp.name, *pipeline_flags]
        code = pipeline_main(flags, pipeline)
        metrics = read_metrics(Path(tmp.name))
    except Exception as e:  # noqa: BLE001 - report and fail, never print a number we did not measure
        raise CouldNotMeasure(f"the run failed: {type(e).__name__}: {e}") from e
    finally:
        sampled_to_the_end = sampler.is_alive()
        sampler.stop.set()
        sampler.join(timeout=30)  # it checks `stop` every interval
        tmp.cleanup()
        if wandb_dir is not None:
            os.environ["WANDB_DIR"] = wandb_dir
    if sampler.error is not None or not sampled_to_the_end:
        raise CouldNotMeasure(f"the memory sampler stopped during the run: {sampler.error!r}")
    seconds = time.time() - t0
    if code != 0:
        raise CouldNotMeasure(f"the run exited with {code}")
    if sampler.samples < 2:
        raise CouldNotMeasure("fewer than 2 memory samples")
    return Measurement(sampler, seconds, load_before, metrics)


def read_metrics(output_dir: Path) -> list[dict[str, float]]:
    """The per-step metrics of the run in `output_dir`: the lines of its `metrics.jsonl` merged by step (a step may
    log more than one line), in step order; [] when the run wrote none."""
    steps: dict[int, dict[str, float]] = {}
    path = output_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps.setdefault(int(record["step"]), {}).update(record)
    return [steps[s] for s in sorted(steps)]


def group_order(group: str) -> int:
    return ([g for g, _ in GROUPS] + [RAY_SYSTEM, WANDB, DRIVER]).index(group)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="RL steps of the run")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--pipeline", default="kl_cov", help="grpo | clip_higher | clip_cov | kl_cov (the demo: kl_cov)")
    args, pipeline_flags = ap.parse_known_args(argv)
    try:
        m = measure(args.steps, pipeline_flags, args.pipeline, args.interval)
    except CouldNotMeasure as e:
        print(f"error: could not measure: {e}", file=sys.stderr)
        return 1

    sampler = m.sampler
    print(
        f"\n{args.pipeline} run, {args.steps} steps, flags {' '.join(pipeline_flags) or '(the demo defaults)'}: "
        f"{m.seconds:.0f} s, {sampler.samples} samples every {args.interval} s"
    )
    print(machine_line(m.load_before))
    print(f"{'group':<34}{'processes':>10}{'peak RSS GiB':>14}{'peak PSS GiB':>14}{'sum VmHWM GiB':>15}")
    for group in sorted(sampler.groups, key=group_order):
        p = sampler.groups[group]
        print(row(group, p))
    c = sampler.cluster
    print(row("whole cluster", c))
    verdict = "under" if c.pss / GIB < LIMIT_GIB else "OVER"
    print(f"the cluster's peak (summed PSS) is {verdict} the {LIMIT_GIB:.0f} GiB limit")
    print(f"peak_cluster_gib: {c.pss / GIB:.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    sys.exit(main())
