"""`option()`: a dataclass field whose help text documents its flag, and whose `choices=` are its legal values.

Every config dataclass of the project (config.py, each objective's settings, the entropy controller) declares its
fields with it, so `--help`, docs and the check of a choice come from one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import Any


def option(
    default: Any,
    help: str,  # noqa: A002 - `help` reads best at the call sites
    *,
    choices: Sequence[str] | None = None,
    **metadata: Any,
) -> Any:
    """A field with `default` (lists and dicts copied per instance) and `help` in its metadata.

    `choices`: the only values the field takes; `{choices}` in `help` becomes them joined by " | ", and
    `choice_errors` refuses any other value.
    """
    if choices is not None:
        choices = tuple(choices)
        help = help.replace("{choices}", " | ".join(choices))  # noqa: A001
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def choice_errors(section: Any, prefix: str) -> list[str]:
    """ "--prefix.field: 'value': a | b | c" for every field of the dataclass `section` outside its choices."""
    errors = []
    for f in dataclasses.fields(section):
        choices = f.metadata.get("choices")
        value = getattr(section, f.name)
        if choices is not None and value not in choices:
            errors.append(f"--{prefix}.{f.name}: {value!r}: {' | '.join(choices)}")
    return errors
