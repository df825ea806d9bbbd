"""Whether every weight the policy exports is one the rollout engine can load, checked when an engine starts.

The policy exports `named_parameters()` of its transformers module (PolicyActor.export_weights), and the engines load
them through vLLM's reload in checkpoint format (sync/receiver.py): each name must be one of the checkpoint's, which
is what the engine's model loaded at start-up. For dense models the two agree. transformers 5 builds some families
with modules that fuse checkpoint tensors (the MoE experts of Mixtral and Qwen-MoE become one `experts.gate_up_proj`
per layer) and splits them again only when it saves: their exported names are not the checkpoint's, and the first
weight sync would fail deep inside vLLM's `load_weights`. The engine refuses them at start-up instead, in one line.

`exported_weight_names` builds the policy's model class on the meta device (no memory, no checkpoint read) for the
names; `checkpoint_weight_names` reads the safetensors headers only.

Engine-only: transformers reads its settings (HF_HUB_OFFLINE) when imported, so the engine imports this module in
its own process after `set_cpu_defaults`, through engine_only.py; the driver never does (engine.py's docstring).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

SAFE_INDEX = "model.safetensors.index.json"


class UnloadableWeightError(ValueError):
    """The policy would export a weight the rollout engine's model cannot load."""


def checkpoint_weight_names(model_path: str) -> set[str] | None:
    """The tensor names of the safetensors checkpoint in `model_path` (its index, or each file's header), or None
    when the folder holds no safetensors (a .bin checkpoint: its names would need the whole file loaded)."""
    folder = Path(model_path)
    index = folder / SAFE_INDEX
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as s:  # a header read: no tensor is loaded
            names.update(s.keys())
    return names


def exported_weight_names(model_path: str) -> list[str]:
    """The names PolicyActor.export_weights gives: `named_parameters()` of the model `AutoModelForCausalLM` builds
    from `model_path`'s config (tied weights once, under the name that owns them), in module order."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # the module tree and names only: no memory, no checkpoint read
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, _ in model.named_parameters()]


def first_unloadable(exported: list[str], accepted: set[str]) -> str | None:
    """The first exported name the engine does not accept, or None when it accepts them all."""
    return next((name for name in exported if name not in accepted), None)


def check_weight_names(model_path: str) -> int:
    """Raise UnloadableWeightError, in one line naming the first weight, when the policy would export a weight that
    `model_path`'s checkpoint (what the engine loads) does not name; return the number of names checked, or 0 when
    the checkpoint is not in safetensors (then nothing is checked)."""
    accepted = checkpoint_weight_names(model_path)
    if accepted is None:
        return 0
    exported = exported_weight_names(model_path)
    name = first_unloadable(exported, accepted)
    if name is not None:
        others = sum(n not in accepted for n in exported) - 1
        raise UnloadableWeightError(
            f"the policy would send weight {name!r}, which the rollout engine cannot load: the checkpoint in "
            f"{model_path} has no tensor of that name ({others} more such weight(s)); transformers builds this "
            "model with modules that fuse checkpoint tensors (MoE experts, for one), and the weight sync sends "
            "the module's names. docs/guides/cluster.md lists the model families tested"
        )
    return len(exported)
