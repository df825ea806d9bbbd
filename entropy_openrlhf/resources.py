"""What a config reserves on a Ray cluster: `required_resources(cfg)` in all, `group_resources(cfg)` by actor group.

`python -m entropy_openrlhf.resources [PRESET ...]` prints the table of docs/guides/cluster.md from them.
"""

from __future__ import annotations

import sys

from entropy_openrlhf.config import Config, apply_preset, reference_gpus, set_by_path
from entropy_openrlhf.presets import PIPELINES, PRESETS


def group_resources(cfg: Config) -> dict[str, dict[str, float]]:
    """The Ray actors of each group and the CPUs/GPUs they reserve in all. The groups never share a GPU (each is
    its own placement group or actor), and the driver itself reserves nothing."""
    r, a, w, ref = cfg.rollout, cfg.actor, cfg.reward, cfg.ref
    groups = {
        "rollout": {"actors": r.num_engines, "GPU": r.num_engines * r.num_gpus_per_engine,
                    "CPU": r.num_engines * r.num_cpus_per_engine},
        "policy": {"actors": a.num_workers, "GPU": a.num_workers * a.num_gpus_per_worker,
                   "CPU": a.num_workers * a.num_cpus_per_worker},
        "reward": {"actors": w.num_workers, "GPU": 0.0, "CPU": w.num_workers * w.num_cpus_per_worker},
    }  # fmt: skip
    if cfg.uses_tools:
        t = cfg.tools
        groups["tools"] = {"actors": t.num_workers, "GPU": 0.0, "CPU": t.num_workers * t.num_cpus_per_worker}
    if cfg.starts_reference_group:
        groups["reference"] = {"actors": ref.num_workers, "GPU": ref.num_workers * reference_gpus(cfg),
                               "CPU": ref.num_workers * ref.num_cpus}  # fmt: skip
    return groups


def required_resources(cfg: Config) -> dict[str, float]:
    """{"GPU": n, "CPU": m}: what a run of `cfg` reserves on the Ray cluster, summed over its actor groups."""
    groups = group_resources(cfg).values()
    return {"GPU": sum(g["GPU"] for g in groups), "CPU": sum(g["CPU"] for g in groups)}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def resource_table(names: list[str], pipeline: str = "kl_cov") -> str:
    """A markdown table of what each named preset allocates (docs/guides/cluster.md holds its output)."""
    lines = [
        "| preset | vLLM engines x TP | GPUs per engine | rollout GPUs | trainer ranks x GPUs | trainer GPUs "
        "| reference | GPUs in all | CPUs in all |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cfg = Config()
        for key, value in PIPELINES[pipeline].items():
            set_by_path(cfg, key, value)
        apply_preset(cfg, name)
        g, total = group_resources(cfg), required_resources(cfg)
        ref = f"on, {_num(g['reference']['GPU'])} GPU" if "reference" in g else "off"
        lines.append(
            f"| `{name}` | {cfg.rollout.num_engines} x {cfg.rollout.tensor_parallel_size} "
            f"| {_num(cfg.rollout.num_gpus_per_engine)} | {_num(g['rollout']['GPU'])} "
            f"| {cfg.actor.num_workers} x {_num(cfg.actor.num_gpus_per_worker)} | {_num(g['policy']['GPU'])} "
            f"| {ref} | **{_num(total['GPU'])}** | {_num(total['CPU'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(resource_table(sys.argv[1:] or list(PRESETS)))
