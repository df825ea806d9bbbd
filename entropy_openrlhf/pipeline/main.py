"""Entry point shared by the pipelines in pipelines/: parse the flags, then hand the run to run.py.

Ray, W&B, transformers and the modules that load them (the trainer, the actor groups, the preflight) are imported
after the flags are parsed ("after-flags imports"): this module imports the config alone, and run.py, which imports
the rest at its top, once the flags are read (`_after_flags`). `--help` and a mistyped flag answer without them.
Measured on a 2-core machine: ~3.5 s of CPU and ~170 MB (transformers' tokenizer 2.6 s, W&B and Ray 0.4 s each),
over twice the 1.4 s of everything this module imports at the top (the config, with torch).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from entropy_openrlhf.config import Config, from_args
from entropy_openrlhf.presets import PIPELINES


def _after_flags() -> ModuleType:
    """run.py, the rest of the run, imported once the flags are parsed."""
    # Local: run.py imports Ray, W&B and transformers, which --help and a mistyped flag must not wait for (module
    # docstring)
    from entropy_openrlhf.pipeline import run

    return run


def prepare(cfg: Config, need_train: bool = True, shared_model: bool = False):
    """The input checks and loading of a run (run.prepare), for callers that import this module before their flags
    are parsed, as scripts/evaluate.py does."""
    return _after_flags().prepare(cfg, need_train, shared_model)


def main(argv: list[str] | None = None, pipeline: str = "kl_cov", description: str = "") -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = from_args(argv, PIPELINES[pipeline], description)  # --help and flag errors exit here
    except ValueError as e:  # an unknown --preset
        print(f"error: {e}", file=sys.stderr)
        return 2

    return _after_flags().run(cfg, pipeline, argv)


def pipeline_main(pipeline: str, doc: str) -> None:
    """What each pipelines/<name>.py runs."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    sys.exit(main(sys.argv[1:], pipeline, doc))
