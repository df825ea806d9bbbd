"""Policy objectives, registered by name: one file per objective in this folder.

A file holds an objective's math (its plain loss and selector functions over (B, L) tensors, built from
algorithms/loss_terms.py) and registers it with `@register_objective(name, Config, select=..., knobs=...)` over a
loss function `(TokenBatch, Config, LossContext) -> LossOutput`; every module here but base.py is imported below, so
a new file is all a new objective needs (docs/guides/extending.md, "Add an objective"). `run_objective` is how the
trainer and the OpenRLHF adapter call one. `--loss.type NAME` picks one; its config's fields are the
`--loss.NAME.FIELD` flags.
"""

from __future__ import annotations

import importlib
import pkgutil

from entropy_openrlhf.algorithms.objectives.base import (
    OBJECTIVES,
    Knob,
    LossContext,
    Objective,
    TokenBatch,
    get_objective,
    objective_needs_entropy,
    register_objective,
    run_objective,
    select_tokens,
    unknown_objective,
    within_chain,
)

# Registration happens on import; sorted so that the registry (and --help) lists them in a stable order.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "OBJECTIVES",
    "Knob",
    "LossContext",
    "Objective",
    "TokenBatch",
    "get_objective",
    "objective_needs_entropy",
    "register_objective",
    "run_objective",
    "select_tokens",
    "unknown_objective",
    "within_chain",
]
