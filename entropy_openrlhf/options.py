"""`option()`: a dataclass field whose help text documents its flag.

Every config dataclass of the project (config.py, each objective's settings, the entropy controller) declares its
fields with it, so `--help` and docs come from one place.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, **metadata: Any) -> Any:  # noqa: A002 - `help` reads best at the call sites
    """A field with `default` (lists and dicts copied per instance) and `help` in its metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})
