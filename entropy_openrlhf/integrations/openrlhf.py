"""Our objectives in OpenRLHF's own trainer: `train_ppo_ray` unchanged, its `PolicyLoss` replaced
(docs/guides/openrlhf.md).

    python -m entropy_openrlhf.integrations.openrlhf --objective kl_cov --objective.ratio 2e-3 \\
        <any openrlhf.cli.train_ppo_ray flag>

runs OpenRLHF's `train_ppo_ray` as it is, with the objective installed in every Ray worker by a
`worker_process_setup_hook` added to the runtime env OpenRLHF starts Ray with (merged with a `ray job submit`
job's own). The command line itself is `openrlhf_cli.py`; this module holds what the workers need: the version
guard, the settings, `install()` and the setup hook. Users with their own launcher call `install(name, **params)`
in the process that builds the trainer, or pass `runtime_env(name, **params)` to their own `ray.init`.

This module is imported by every Ray worker of such a job (the setup hook lives here), so it imports nothing heavy
at module level: OpenRLHF is imported once its version is checked (`check_openrlhf`), torch and the objectives with
openrlhf_adapter.py on first use (`_adapter`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

from entropy_openrlhf.compat import ensure_flash_attn_importable

SUPPORTED_OPENRLHF = "0.11.2"
PPO_ACTOR = "openrlhf.trainer.ray.ppo_actor"
TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"
# The objective a job's workers install, as JSON: {"objective", "params", "objectives", "seed"}
SPEC_ENV = "ENTROPY_OPENRLHF_OBJECTIVE"
# Ray imports it by name in each worker (a module path, not a pickled function: nothing to upload, same on every node)
SETUP_HOOK = "entropy_openrlhf.integrations.openrlhf.setup_worker"

# What the adapter was written against: the parameters of OpenRLHF 0.11.2's PolicyLoss and of the trainer method
# that calls it. A release that renames or adds one fails the guard instead of being patched blindly.
EXPECTED_SIGNATURES = {
    "PolicyLoss.__init__": (
        "self", "clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
        "is_correction_level", "is_correction_mode", "is_correction_gating", "is_correction_threshold",
    ),
    "PolicyLoss.forward": (
        "self", "log_probs", "old_log_probs", "advantages", "action_mask", "rollout_log_probs", "dp_size",
        "batch_num_tokens", "global_batch_size",
    ),
    "ActorPPOTrainer.training_step": ("self", "experience", "kl_ctl", "step", "loss_batch_info"),
}  # fmt: skip


class OpenRLHFMismatch(RuntimeError):
    """The installed OpenRLHF is not the one the adapter was written for."""


# --------------------------------------------------------------------------- the guard


def check_openrlhf() -> ModuleType:
    """Fail in one line unless OpenRLHF is the version, and has the call signatures, the adapter was written for.
    Returns `openrlhf.trainer.ray.ppo_actor`."""
    try:
        version = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        raise OpenRLHFMismatch(f"OpenRLHF is not installed; this route needs openrlhf=={SUPPORTED_OPENRLHF}") from None
    if version != SUPPORTED_OPENRLHF:
        raise OpenRLHFMismatch(
            f"OpenRLHF {version} is installed; the adapter was written for {SUPPORTED_OPENRLHF} "
            f"(pip install openrlhf=={SUPPORTED_OPENRLHF}, or see docs/guides/openrlhf.md on porting it)"
        )
    ensure_flash_attn_importable()  # a no-op where flash-attn is installed; on CPU, OpenRLHF cannot import without it
    # Local: OpenRLHF only once its version is checked and the flash-attn stand-in is in place (module docstring)
    import openrlhf.models.loss as loss_module

    ppo_actor = importlib.import_module(PPO_ACTOR)
    trainer = ppo_actor.ActorPPOTrainer
    step = getattr(trainer.training_step, "__entropy_openrlhf_wrapped__", trainer.training_step)
    found = {
        "PolicyLoss.__init__": loss_module.PolicyLoss.__init__,
        "PolicyLoss.forward": loss_module.PolicyLoss.forward,
        "ActorPPOTrainer.training_step": step,
    }
    for name, fn in found.items():
        params = tuple(inspect.signature(fn).parameters)
        if params != EXPECTED_SIGNATURES[name]:
            raise OpenRLHFMismatch(
                f"OpenRLHF {version}'s {name} takes ({', '.join(params)}); the adapter was written for "
                f"({', '.join(EXPECTED_SIGNATURES[name])})"
            )
    # the patch point: ActorPPOTrainer.__init__ must look PolicyLoss up in its module, and training_step must call
    # the loss it built through self.actor_loss_fn
    if "PolicyLoss" not in trainer.__init__.__code__.co_names or "actor_loss_fn" not in step.__code__.co_names:
        raise OpenRLHFMismatch(
            f"OpenRLHF {version}'s ActorPPOTrainer no longer builds {PPO_ACTOR}.PolicyLoss as actor_loss_fn"
        )
    return ppo_actor


# --------------------------------------------------------------------------- settings


def build_settings(
    name: str, params: Mapping[str, Any] | None = None, objectives: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[Any, SimpleNamespace]:
    """The objective's config instance and the settings of every objective (for the one its `within` points to),
    validated; errors are ValueErrors in one line naming the flag (openrlhf_adapter.build_settings)."""
    return _adapter().build_settings(name, params, objectives)


def _adapter() -> ModuleType:
    """openrlhf_adapter.py, on first use: the objectives' settings and the class that stands in for PolicyLoss."""
    # Local: it imports torch and the objectives, which this module, imported by every Ray worker of the job, must
    # not load (module docstring)
    from entropy_openrlhf.integrations import openrlhf_adapter

    return openrlhf_adapter


# --------------------------------------------------------------------------- install


_ORIGINALS: dict[str, Any] = {}


def install(
    name: str,
    *,
    objectives: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int | None = None,
    **params: Any,
) -> type:
    """Replace OpenRLHF's PolicyLoss by objective `name` in this process; returns the class installed.

    `params` are the objective's own settings (its config dataclass fields, e.g. `ratio=2e-3`); `objectives` the
    settings of another objective its `within` points to (`{"high_entropy": {"top_frac": 0.1}}`); `seed` fixes
    Clip-Cov's draw (default: the seed OpenRLHF gave torch, i.e. --train.seed). Patches
    `openrlhf.trainer.ray.ppo_actor.PolicyLoss` (read when ActorPPOTrainer is built, so call this first) and wraps
    `ActorPPOTrainer.training_step` so that the objective's metrics reach OpenRLHF's logs. Calling it again
    replaces the objective.
    """
    ppo_actor = check_openrlhf()
    adapter = _adapter()
    config, loss_cfg = adapter.build_settings(name, params, objectives)
    cls = adapter.make_policy_loss(name, config, loss_cfg, seed)
    trainer = ppo_actor.ActorPPOTrainer
    _ORIGINALS.setdefault("PolicyLoss", ppo_actor.PolicyLoss)
    if not hasattr(trainer.training_step, "__entropy_openrlhf_wrapped__"):
        _ORIGINALS["training_step"] = trainer.training_step
        trainer.training_step = adapter.wrap_training_step(trainer.training_step)
    ppo_actor.PolicyLoss = cls
    return cls


def uninstall() -> None:
    """Put OpenRLHF's own PolicyLoss and training_step back (tests; a process that wants plain PPO again)."""
    ppo_actor = sys.modules.get(PPO_ACTOR)
    if ppo_actor is None:
        return
    if "PolicyLoss" in _ORIGINALS:
        ppo_actor.PolicyLoss = _ORIGINALS.pop("PolicyLoss")
    if "training_step" in _ORIGINALS:
        ppo_actor.ActorPPOTrainer.training_step = _ORIGINALS.pop("training_step")


# --------------------------------------------------------------------------- Ray: the worker setup hook


def spec_json(
    name: str,
    params: Mapping[str, Any] | None = None,
    objectives: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int | None = None,
) -> str:
    return json.dumps(
        {"objective": name, "params": dict(params or {}), "objectives": dict(objectives or {}), "seed": seed},
        sort_keys=True,
    )


def runtime_env(
    name: str,
    *,
    objectives: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int | None = None,
    base: Mapping[str, Any] | None = None,
    **params: Any,
) -> dict[str, Any]:
    """A Ray runtime env (`base` plus our two entries) whose workers install objective `name`: for a launcher of
    your own, `ray.init(runtime_env=runtime_env("kl_cov", ratio=2e-3))`. Settings are validated here, in the
    driver, so a typo fails before any worker starts."""
    build_settings(name, params, objectives)
    return with_setup_hook(dict(base or {}), spec_json(name, params, objectives, seed))


def with_setup_hook(env: dict[str, Any], spec: str) -> dict[str, Any]:
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"the runtime env already has a worker_process_setup_hook ({hook!r}); Ray runs one per job, and this "
            f"route needs {SETUP_HOOK}"
        )
    return {**env, "worker_process_setup_hook": SETUP_HOOK, "env_vars": {**env.get("env_vars", {}), SPEC_ENV: spec}}


class _InstallAfterExec(importlib.abc.Loader):
    """Loader of ppo_actor that runs the real one, then install(): the module is patched before anyone can read
    its PolicyLoss."""

    def __init__(self, loader: importlib.abc.Loader, spec: dict[str, Any]) -> None:
        self._loader = loader
        self._spec = spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # the module is in sys.modules already (the import system put it there before exec), which install() needs
        _install_spec(self._spec)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: inspect and linecache use them
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Waits for OpenRLHF's own import of ppo_actor, then patches it (see setup_worker)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != PPO_ACTOR:
            return None
        sys.meta_path.remove(self)  # once: the real finders locate the module below, and a reload is not ours
        found = importlib.util.find_spec(fullname)
        if found is None or found.loader is None:
            return found
        found.loader = _InstallAfterExec(found.loader, self.spec)
        return found


def _install_spec(spec: Mapping[str, Any]) -> type:
    return install(spec["objective"], objectives=spec.get("objectives"), seed=spec.get("seed"), **spec["params"])


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: in every worker process of the job, install the objective named by
    $ENTROPY_OPENRLHF_OBJECTIVE once OpenRLHF imports ppo_actor.

    Not before: importing ppo_actor here would import DeepSpeed (and, through openrlhf.trainer.ray, vLLM) into
    every worker, vLLM's engines included, which OpenRLHF keeps apart on purpose ("no implicit imports of deepspeed
    here to avoid vllm environment gets contaminated"). The policy actors import it when Ray loads their class,
    and that import finds the module already patched.
    """
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        return
    spec = json.loads(raw)
    ensure_flash_attn_importable()  # no-op with flash-attn installed; lets OpenRLHF import on CPU workers
    if PPO_ACTOR in sys.modules:
        _install_spec(spec)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(spec))


if __name__ == "__main__":
    # `python -m entropy_openrlhf.integrations.openrlhf` stays the documented command: it runs the command line,
    # openrlhf_cli, as __main__ (run, not imported, so this module, which it imports, does not import it back)
    runpy.run_module("entropy_openrlhf.integrations.openrlhf_cli", run_name="__main__", alter_sys=True)
