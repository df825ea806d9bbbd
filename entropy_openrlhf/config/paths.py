"""Dotted flag names: a field's `--section.field` name, and the walks over every leaf of a `Config` that `flatten()`
and the parser take their flags from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any


def _name(f: dataclasses.Field) -> str:
    return f.metadata.get("name", f.name)


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) for every leaf."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{_name(f)}"
        if dataclasses.is_dataclass(value):
            yield from _walk(value, key + ".")
        else:
            yield key, value


def _fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted name, field, value) for every leaf."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{_name(f)}"
        if dataclasses.is_dataclass(value):
            yield from _fields(value, key + ".")
        else:
            yield key, f, value
