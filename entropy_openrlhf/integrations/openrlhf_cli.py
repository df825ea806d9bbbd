"""The command line of the OpenRLHF route (docs/guides/openrlhf.md):

    python -m entropy_openrlhf.integrations.openrlhf --objective kl_cov --objective.ratio 2e-3 \\
        <any openrlhf.cli.train_ppo_ray flag>

splits our `--objective*` flags from OpenRLHF's, checks them (and the OpenRLHF settings that would defeat the
objective) before Ray starts, then runs `train_ppo_ray` as __main__ with its `ray.init` carrying the setup hook that
installs the objective in every worker (`integrations/openrlhf.py`).

Only the driver imports this module; the Ray workers import `integrations/openrlhf.py` alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import ray

from entropy_openrlhf.algorithms.objectives import OBJECTIVES
from entropy_openrlhf.compat import ensure_flash_attn_importable
from entropy_openrlhf.integrations.openrlhf import (
    SPEC_ENV,
    TRAIN_MODULE,
    OpenRLHFMismatch,
    build_settings,
    check_openrlhf,
    spec_json,
    with_setup_hook,
)
from entropy_openrlhf.integrations.openrlhf_adapter import off_policy_from_openrlhf


@contextlib.contextmanager
def hook_into_ray_init(spec: str) -> Iterator[list[dict[str, Any]]]:
    """While OpenRLHF's train() runs, its `ray.init(runtime_env=...)` also carries our setup hook and spec; the
    yielded list collects the runtime envs it was called with."""
    original = ray.init
    calls: list[dict[str, Any]] = []

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any):
        kwargs["runtime_env"] = with_setup_hook(dict(kwargs.get("runtime_env") or {}), spec)
        calls.append(kwargs["runtime_env"])
        result = original(*args, **kwargs)
        env = ray.get_runtime_context().runtime_env.get("env_vars", {})
        if env.get(SPEC_ENV) != spec:  # e.g. a Ray that was already initialised ignores runtime_env
            raise RuntimeError("Ray started without the objective's setup hook: the workers would train plain PPO")
        return result

    ray.init = init
    try:
        yield calls
    finally:
        ray.init = original


# --------------------------------------------------------------------------- the command line


@dataclasses.dataclass
class ObjectiveArgs:
    name: str | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    objectives: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    help: bool = False


def _typed(name: str, field: str, value: str) -> Any:
    """A flag's text as the type of the objective's field default."""
    if name not in OBJECTIVES:
        return value
    fields = {f.name: f for f in dataclasses.fields(OBJECTIVES[name].config)}
    if field not in fields:
        return value  # build_settings names the unknown field
    default = fields[field].default
    try:
        if isinstance(default, bool):
            low = value.lower()
            if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError
            return low in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        flag = f"--objective.{field}"
        raise ValueError(f"{flag}: expected {type(default).__name__}, got {value!r}") from None
    return value


def split_argv(argv: Sequence[str]) -> tuple[ObjectiveArgs, list[str]]:
    """Our --objective flags, and everything else in its order for train_ppo_ray."""
    ours, rest = ObjectiveArgs(), []
    raw: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            ours.help = True
        if arg == "--objective" or arg.startswith(("--objective=", "--objective.")):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key}: expected a value")
                value = argv[i + 1]
                i += 1
            raw.append((key, value))
        else:
            rest.append(arg)
        i += 1
    for key, value in raw:
        if key == "objective":
            ours.name = value
    for key, value in raw:
        parts = key.split(".")[1:]
        if len(parts) == 1:
            ours.params[parts[0]] = _typed(ours.name or "", parts[0], value)
        elif len(parts) == 2:
            ours.objectives.setdefault(parts[0], {})[parts[1]] = _typed(parts[0], parts[1], value)
        elif parts:
            raise ValueError(f"--{key}: expected --objective.FIELD or --objective.OBJECTIVE.FIELD")
    return ours, rest


def objectives_help() -> str:
    lines = [
        "usage: python -m entropy_openrlhf.integrations.openrlhf --objective NAME [--objective.FIELD VALUE ...] "
        "[train_ppo_ray flags]",
        "",
        "Runs OpenRLHF's train_ppo_ray with its PolicyLoss replaced by one of our objectives "
        "(docs/guides/openrlhf.md).",
        "",
        "objectives and their --objective.FIELD settings:",
    ]
    for name, obj in OBJECTIVES.items():
        lines.append(f"  {name}: {obj.summary}")
        for f in dataclasses.fields(obj.config):
            text = f.metadata.get("help", "").replace("--loss.", "--objective.")  # our trainer's flag names
            lines.append(f"      --objective.{f.name} [{f.default!r}]  {text}")
    lines += [
        "  a `within` target's own settings: --objective.OBJECTIVE.FIELD (e.g. --objective.high_entropy.top_frac 0.1)",
        "",
        "OpenRLHF's train_ppo_ray flags follow.",
        "",
    ]
    return "\n".join(lines)


def _openrlhf_notes(name: str, rest: Sequence[str]) -> list[str]:
    """Warnings about OpenRLHF settings that defeat the objective (the objectives' own notes name our flags)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--actor.policy_loss_type", dest="policy_loss_type", default="ppo")
    p.add_argument("--actor.eps_clip", dest="eps_clip", type=float, default=0.2)
    p.add_argument("--actor.eps_clip_low_high", dest="eps_clip_low_high", type=float, nargs=2, default=None)
    p.add_argument("--train.max_epochs", dest="max_epochs", type=int, default=1)
    p.add_argument("--train.batch_size", dest="train_batch", type=int, default=128)
    p.add_argument("--rollout.batch_size", dest="rollout_batch", type=int, default=1024)
    p.add_argument("--rollout.n_samples_per_prompt", dest="n_samples", type=int, default=1)
    # OpenRLHF's train/rollout correction, whose defaults these are (train_ppo_ray.py)
    p.add_argument("--algo.advantage.is_correction_level", dest="is_level", default="off")
    p.add_argument("--algo.advantage.is_correction_mode", dest="is_mode", default="mask")
    p.add_argument("--algo.advantage.is_correction_gating", dest="is_gating", default="ratio")
    p.add_argument("--algo.advantage.is_correction_threshold", dest="is_threshold", type=float, nargs="+",
                   default=[0.5, 5.0])  # fmt: skip
    try:
        args, _ = p.parse_known_args(list(rest))
    except SystemExit:  # a malformed value: train_ppo_ray's own parser reports it
        return []
    if args.policy_loss_type != "ppo":
        raise ValueError(
            f"--actor.policy_loss_type {args.policy_loss_type}: --objective {name} replaces OpenRLHF's policy loss; "
            "drop the flag (for GSPO use --objective gspo)"
        )
    # refused here, before Ray starts, rather than in every policy actor when the trainer builds its loss
    threshold = ([0.0] if len(args.is_threshold) == 1 else []) + list(args.is_threshold)  # as train_ppo_ray does
    off_policy_from_openrlhf(args.is_level, args.is_mode, args.is_gating, threshold)
    notes = []
    steps = args.max_epochs * args.rollout_batch * args.n_samples // max(args.train_batch, 1)
    if name == "kl_cov" and steps <= 1:
        notes.append(
            "KL-Cov with one optimizer step per rollout batch acts as plain policy gradient (|logp - old_logp| = 0 "
            "on-policy): make --train.batch_size smaller than --rollout.batch_size x --rollout.n_samples_per_prompt "
            "(the paper: 8 steps)"
        )
    clip = tuple(args.eps_clip_low_high or (args.eps_clip, args.eps_clip))
    if name == "clip_cov" and clip != (1.0, 1.0):
        notes.append("the paper's Clip-Cov widens the PPO clip to 1: --actor.eps_clip_low_high 1 1")
    return notes


def main(argv: Sequence[str] | None = None, *, train_module: str = TRAIN_MODULE) -> int:
    """The command line; `train_module` is the module run as __main__ with the remaining flags (tests put a
    stand-in for OpenRLHF's GPU-only train_ppo_ray there)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ours, rest = split_argv(argv)
        if ours.help:
            print(objectives_help())
        else:
            if not ours.name:
                raise ValueError("--objective NAME is required (--help lists the objectives)")
            check_openrlhf()
            build_settings(ours.name, ours.params, ours.objectives)
            for note in _openrlhf_notes(ours.name, rest):
                print(f"note: {note}", file=sys.stderr)
    except (ValueError, OpenRLHFMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ensure_flash_attn_importable()  # --help too imports train_ppo_ray, hence openrlhf.models; no-op with flash-attn
    spec = spec_json(ours.name or "", ours.params, ours.objectives)
    saved_argv = sys.argv
    sys.argv = [train_module, *rest]
    try:
        with hook_into_ray_init(spec) if not ours.help else contextlib.nullcontext():
            runpy.run_module(train_module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # argparse's --help and errors, or a sys.exit in train_ppo_ray
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
    return 0


if __name__ == "__main__":
    # the package's copy of the route (imported above), not a __main__ one: the setup hook and install() share its
    # state
    sys.exit(main())
