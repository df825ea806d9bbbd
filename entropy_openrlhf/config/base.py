"""What every config section shares: `Section` (a `--<section>.*` flag group that validates itself), `_failed` (the
"--flag: why" errors of the rules that do not hold), and the checks of Ray amounts and custom resources that the
sections reserving Ray resources (rollout, reward, actor, ref) run on their own fields.
"""

from __future__ import annotations

from typing import Any

from entropy_openrlhf.options import choice_errors


class Section:
    """A config section (`--<section>.<field>` flags) that validates itself: the choices its fields declare, and the
    rules of `checks()` over its own fields. Rules across sections are `validate()`'s."""

    def checks(self) -> list[str]:
        """Errors "--flag: why" of this section's own rules."""
        return []

    def validate(self, prefix: str) -> list[str]:
        errors = self.checks()
        # one error per flag: a section's own message for a choice (loss.type's) is the more specific one
        reported = {e.partition(": ")[0] for e in errors}
        return errors + [e for e in choice_errors(self, prefix) if e.partition(": ")[0] not in reported]


def _failed(*rules: tuple[bool, str, str]) -> list[str]:
    """The errors "--flag: why" of the (ok, flag, why) rules that do not hold."""
    return [f"--{flag}: {why}" for ok, flag, why in rules if not ok]


def _ray_amount_errors(section: Any, prefix: str, *keys: str) -> list[str]:
    """Ray takes CPUs and GPUs as a fraction up to 1 or a whole number."""
    errors = []
    for key in keys:
        n = getattr(section, key)
        errors += _failed((n >= 0 and (n <= 1 or float(n).is_integer()), f"{prefix}.{key}",
                           f"{n:g}: Ray takes a fraction <= 1 or a whole number"))  # fmt: skip
    return errors


def _custom_resource_errors(resources: dict, prefix: str) -> list[str]:
    errors, flag = [], f"{prefix}.custom_resources"
    for key, amount in resources.items():
        ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0
        errors += _failed(
            (key not in ("CPU", "GPU", "memory"), flag, f"{key!r}: set CPUs and GPUs with their own flags"),
            (ok and (amount <= 1 or float(amount).is_integer()), flag,
             f"{key!r}: {amount!r} must be a number > 0, a fraction <= 1 or a whole number"),
        )  # fmt: skip
    return errors


_CUSTOM_HELP = (
    "extra Ray resources each {what} reserves, as JSON, e.g. {example} to place it on the nodes started with "
    "`ray start --resources '{example}'` (CPU/GPU have their own flags)"
)
