"""Checks against the Ray cluster, run by the driver after it joins Ray and before any actor starts.

1. `fit_cluster`: what the run reserves (each group's actors x their Ray resources) against what the cluster has
   free. On a CPU-only cluster the CPU amounts are logical (the actors share the real cores anyway), so they are
   scaled down to fit, with one log line; anything else that does not fit (GPUs, custom resources, CPUs on a GPU
   cluster, a bundle no single node can hold) fails in one line naming the shortfall and the flags that set it.
   Without this check a run that does not fit waits for its placement group forever, silently.
2. `check_nodes`: a small task on every node that could hold an actor checks what that actor will read or write
   there: the model folder (`--pretrain`) for engines, policy ranks and the reference, and for policy ranks the
   output folder, which must be writable and be the same filesystem the driver sees (a token file written by the
   driver must be readable there). A cluster whose nodes do not share the output folder would otherwise write each
   rank's checkpoint shards to a different disk and never be able to resume.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from entropy_openrlhf.config import Config, ConfigError, reference_gpus

NODE_CHECK_TIMEOUT_S = 60.0  # a node check is a few file operations; a node that cannot run it in a minute is sick
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class ClusterFitError(ConfigError):
    """The run needs more of a Ray resource than the cluster has; the message names the flags that set it."""


@dataclass
class GroupNeed:
    """What one actor group reserves: `actors` actors of `bundle` each, and the flags that set them."""

    name: str
    actors: int
    bundle: dict[str, float]
    flags: dict[str, str]  # resource -> the flags that set it, for error messages
    reads_model: bool
    writes_output: bool


def group_needs(cfg: Config) -> list[GroupNeed]:
    r, a, w, ref = cfg.rollout, cfg.actor, cfg.reward, cfg.ref
    groups = [
        GroupNeed(
            "rollout", r.num_engines,
            {"CPU": r.num_cpus_per_engine, "GPU": r.num_gpus_per_engine, **r.custom_resources},
            {"CPU": "--rollout.num_engines x --rollout.num_cpus_per_engine",
             "GPU": "--rollout.num_engines x --rollout.num_gpus_per_engine",
             "*": "--rollout.num_engines x --rollout.custom_resources"},
            reads_model=True, writes_output=False,
        ),
        GroupNeed(
            "policy", a.num_workers,
            {"CPU": a.num_cpus_per_worker, "GPU": a.num_gpus_per_worker, **a.custom_resources},
            {"CPU": "--actor.num_workers x --actor.num_cpus_per_worker",
             "GPU": "--actor.num_workers x --actor.num_gpus_per_worker",
             "*": "--actor.num_workers x --actor.custom_resources"},
            reads_model=True, writes_output=True,
        ),
        GroupNeed(
            "reward", w.num_workers, {"CPU": w.num_cpus_per_worker, "GPU": 0.0, **w.custom_resources},
            {"CPU": "--reward.num_workers x --reward.num_cpus_per_worker",
             "*": "--reward.num_workers x --reward.custom_resources"},
            reads_model=False, writes_output=False,
        ),
    ]  # fmt: skip
    if cfg.uses_tools:
        t = cfg.tools
        groups.append(
            GroupNeed(
                "tools", t.num_workers, {"CPU": t.num_cpus_per_worker, "GPU": 0.0, **t.custom_resources},
                {"CPU": "--tools.num_workers x --tools.num_cpus_per_worker",
                 "*": "--tools.num_workers x --tools.custom_resources"},
                reads_model=False, writes_output=False,
            )
        )  # fmt: skip
    if cfg.starts_reference_group:
        groups.append(
            GroupNeed(
                "reference", ref.num_workers, {"CPU": ref.num_cpus, "GPU": reference_gpus(cfg), **ref.custom_resources},
                {"CPU": "--ref.num_workers x --ref.num_cpus", "GPU": "--ref.num_workers x --ref.num_gpus",
                 "*": "--ref.num_workers x --ref.custom_resources"},
                reads_model=True, writes_output=False,
            )
        )  # fmt: skip
    return groups


def _num(x: float) -> str:
    return f"{x:g}"


def _scaled(amount: float, factor: float) -> float:
    """A CPU amount times `factor`, in a form Ray accepts (a fraction <= 1 or a whole number), never rounded up."""
    x = amount * factor
    if x >= 1:
        return float(math.floor(x))
    return max(math.floor(x * 1000) / 1000, 0.001)  # Ray keeps 4 decimals; 0.001 is the smallest we reserve


def _set_cpu(cfg: Config, group: str, value: float) -> None:
    if group == "rollout":
        cfg.rollout.num_cpus_per_engine = value
    elif group == "policy":
        cfg.actor.num_cpus_per_worker = value
    elif group == "reward":
        cfg.reward.num_cpus_per_worker = value
    elif group == "tools":
        cfg.tools.num_cpus_per_worker = value
    else:
        cfg.ref.num_cpus = value


def fit_cluster(cfg: Config, available: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Check that the run fits `available` (Ray's free resources) and that every actor fits on one of `nodes` (each
    node's total resources). On a cluster without GPUs, CPU reservations that do not fit are scaled down in `cfg`;
    the returned line says so (None when nothing changed). Raises ClusterFitError otherwise."""
    groups = group_needs(cfg)
    gpu_cluster = sum(n.get("GPU", 0.0) for n in nodes) > 0
    keys = sorted({k for g in groups for k, v in g.bundle.items() if v > 0})
    problems = []
    for key in keys:
        parts = [(g, g.actors * g.bundle.get(key, 0.0)) for g in groups if g.bundle.get(key, 0.0) > 0]
        need, have = sum(x for _, x in parts), available.get(key, 0.0)
        if need <= have + 1e-9 or (key == "CPU" and not gpu_cluster):
            continue
        unit = {"CPU": " CPUs", "GPU": " GPUs"}.get(key, f" of resource {key!r}")
        detail = ", ".join(f"{g.name} {_num(x)} ({g.flags.get(key, g.flags['*'])})" for g, x in parts)
        problems.append(f"needs {_num(need)}{unit}, the cluster has {_num(have)} free: {detail}")
    # every actor is one bundle, and a bundle lives on one node (checked once the totals fit, or it says it twice)
    for g in groups if not problems else []:
        bundle = {k: v for k, v in g.bundle.items() if v > 0 and not (k == "CPU" and not gpu_cluster)}
        if bundle and not any(all(n.get(k, 0.0) >= v for k, v in bundle.items()) for n in nodes):
            wanted = ", ".join(f"{_num(v)} {k}" for k, v in bundle.items())
            problems.append(f"one {g.name} actor needs {wanted} on a single node, and no node has that")
    if problems:
        raise ClusterFitError("the run does not fit the Ray cluster: " + "; ".join(problems))

    need_cpu = sum(g.actors * g.bundle["CPU"] for g in groups)
    have_cpu = available.get("CPU", 0.0)
    largest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    factor = min(have_cpu / need_cpu if need_cpu else 1.0, largest / max(g.bundle["CPU"] for g in groups))
    if factor >= 1 or gpu_cluster:
        return None
    if have_cpu <= 0:
        raise ClusterFitError("the run does not fit the Ray cluster: it has no free CPU (ray status shows why)")
    for g in groups:
        _set_cpu(cfg, g.name, _scaled(g.bundle["CPU"], factor))
    scaled = ", ".join(f"{g.name} {_num(g.bundle['CPU'])} -> {_num(_scaled(g.bundle['CPU'], factor))}" for g in groups)
    return (
        f"the run reserves {_num(need_cpu)} CPUs and this CPU-only cluster has {_num(have_cpu)} free: CPU "
        f"reservations per actor scaled to fit ({scaled}); they are Ray's logical counts, the actors share the cores"
    )


def cluster_snapshot() -> tuple[dict[str, float], list[dict[str, float]]]:
    """(free resources, each alive node's total resources) of the Ray cluster this process is connected to."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return ray.available_resources(), nodes


# --------------------------------------------------------------------------- files on every node


@ray.remote(num_cpus=0)
def _check_node(model_path: str | None, output_dir: str | None, token_name: str, token: str) -> list[str]:
    """Runs on one node: what is wrong there with the files its actors will use (empty when all is well)."""
    problems = []
    if model_path is not None:
        folder = Path(model_path)
        if not (folder / "config.json").is_file():
            problems.append(f"--pretrain {model_path}: no HF model there (no config.json)")
        elif not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
            problems.append(f"--pretrain {model_path}: config.json but no weights (.safetensors or .bin)")
    if output_dir is not None:
        try:
            os.makedirs(output_dir, exist_ok=True)
            probe = Path(output_dir) / f".write-probe-{uuid.uuid4().hex}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            problems.append(f"--train.output_dir {output_dir} is not writable ({e.strerror})")
        else:
            seen = Path(output_dir) / token_name
            if not seen.is_file() or seen.read_text() != token:
                problems.append(
                    f"--train.output_dir {output_dir} is not the folder the driver writes to (its token file is not "
                    "there): use an absolute path on a filesystem every node mounts"
                )
    return problems


def _fits(node: dict[str, float], bundle: dict[str, float], gpu_cluster: bool) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in bundle.items() if v > 0 and (k != "CPU" or gpu_cluster))


def check_nodes(cfg: Config, model_path: str, timeout_s: float = NODE_CHECK_TIMEOUT_S) -> None:
    """On every alive node that could hold an engine, a policy rank or the reference (it has the resources their
    bundles ask for), check the model folder; on every node that could hold a policy rank, check the output folder.
    Raises ConfigError with one line per node at fault, naming the node's address."""
    groups = group_needs(cfg)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpu_cluster = sum(n["Resources"].get("GPU", 0.0) for n in nodes) > 0
    output_dir = cfg.train.output_dir
    os.makedirs(output_dir, exist_ok=True)
    token_name, token = f".node-check-{uuid.uuid4().hex}", uuid.uuid4().hex
    token_file = Path(output_dir) / token_name
    token_file.write_text(token)
    try:
        checks = {}
        for node in nodes:
            hosts = [g for g in groups if _fits(node["Resources"], g.bundle, gpu_cluster)]
            needs_model = any(g.reads_model for g in hosts)
            needs_output = any(g.writes_output for g in hosts)
            if not (needs_model or needs_output):
                continue
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ref = _check_node.options(scheduling_strategy=strategy).remote(
                model_path if needs_model else None, output_dir if needs_output else None, token_name, token
            )
            checks[ref] = node["NodeManagerAddress"]
        ready, pending = ray.wait(list(checks), num_returns=len(checks), timeout=timeout_s)
        problems = [f"node {checks[ref]}: {p}" for ref in ready for p in ray.get(ref)]
        problems += [f"node {checks[ref]}: its file check did not finish within {timeout_s:.0f} s" for ref in pending]
    finally:
        token_file.unlink(missing_ok=True)
    if problems:
        raise ConfigError("\n".join(problems))
