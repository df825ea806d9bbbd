"""The model folder a benchmark's --model names: the built-in ones are made on the spot."""

from __future__ import annotations

from pathlib import Path

from entropy_openrlhf.models.smollm2 import ensure_smollm2
from entropy_openrlhf.models.tiny import make_tiny_model


def model_folder(name: str, scratch: str | Path) -> str:
    """The HF model folder that a benchmark's --model names: 'smollm2' (converted once, then cached), 'tiny' (a random
    model written into `scratch`, which the caller removes), or any other value as a folder path, unchanged."""
    if name == "smollm2":
        return ensure_smollm2()
    if name == "tiny":
        return str(make_tiny_model(Path(scratch) / "tiny_model"))
    return name
