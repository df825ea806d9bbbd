"""The `--offpolicy.*` flags: the correction between the policy that sampled a response (vLLM's log-probs) and the
trainer's pi_old, and bypass mode. The fields are those of `algorithms.off_policy.OffPolicyConfig`, whose
`__post_init__` holds the rules; this section adds `--offpolicy.preset` and the default of a run that sets none of
them (docs/algorithms/off_policy.md, "Flags").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from entropy_openrlhf.algorithms.off_policy import (
    IS_LEVELS,
    PRESETS,
    REJECT_MODES,
    OffPolicyConfig,
    default_for,
    preset,
)
from entropy_openrlhf.config.base import Section
from entropy_openrlhf.options import option as _f  # short: every field below uses it

# the defaults of the fields shared with OffPolicyConfig: a field at its default leaves the preset's value
_DEFAULTS = OffPolicyConfig()
FIELDS = tuple(f.name for f in dataclasses.fields(OffPolicyConfig))


@dataclass
class OffPolicySection(Section):
    preset: str = _f(
        "",
        "named setting that fills the fields below: " + " | ".join(PRESETS) + "; a field given a value other than "
        "its default overrides the preset. Empty with every field at its default: token_tis (capped at 2) on "
        "async runs, none on synchronous ones",
    )
    is_level: str = _f(
        _DEFAULTS.is_level,
        "importance weight pi_old / pi_rollout per token or per response, truncated to [is_min, is_max]: {choices}",
        choices=IS_LEVELS,
    )
    is_min: float = _f(_DEFAULTS.is_min, "lower truncation of the importance weight (0 = none)")
    is_max: float = _f(_DEFAULTS.is_max, "upper truncation of the importance weight (>= 1)")
    reject: str = _f(
        _DEFAULTS.reject,
        "drop what a ratio outside [reject_min, reject_max] condemns: a token, a response by its geometric-mean "
        "ratio (sequence_geo) or by its product (sequence); rejected tokens stay in the loss normaliser: {choices}",
        choices=REJECT_MODES,
    )
    reject_min: float = _f(_DEFAULTS.reject_min, "lower end of the rejection band (<= 1)")
    reject_max: float = _f(_DEFAULTS.reject_max, "upper end of the rejection band (>= 1)")
    bypass: bool = _f(
        _DEFAULTS.bypass,
        "pi_old is the rollout's log-probs: no old-log-prob forward, PPO's ratio is pi_theta / pi_rollout "
        "(combinations refused: docs/algorithms/off_policy.md)",
    )

    def explicit(self) -> dict[str, object]:
        """The fields given a value other than their default: what overrides a preset."""
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) != getattr(_DEFAULTS, name)}

    def is_default(self) -> bool:
        """No preset and every field at its default: the run's default applies (default_for)."""
        return not self.preset and not self.explicit()

    def resolve(self, is_async: bool) -> OffPolicyConfig:
        """The correction the trainer applies: the preset with the fields given over it, or, with neither, the
        default for an asynchronous or a synchronous run. Raises OffPolicyConfig's ValueError
        ("offpolicy.<field>: why") for a setting that cannot work."""
        if self.is_default():
            return default_for(is_async)
        base = preset(self.preset) if self.preset else _DEFAULTS
        return dataclasses.replace(base, **self.explicit())

    def uses_bypass(self) -> bool:
        """Whether bypass is asked for, by the flag or the preset, without resolving (or validating) the rest."""
        return self.bypass or (self.preset in PRESETS and PRESETS[self.preset].bypass)

    def checks(self) -> list[str]:
        try:  # the defaults are valid configs: only a preset and the fields given can fail
            self.resolve(False)
        except ValueError as e:
            return [f"--{e}"]  # OffPolicyConfig's and preset()'s messages start with "offpolicy.<field>: "
        return []
