"""The command line: `build_parser` (one `--section.field` flag per leaf of `Config`, typed by its default),
`from_args` (dataclass defaults, then the pipeline's defaults, then `--preset`, then explicit flags), `apply_preset`
and `set_by_path` (a leaf set by its dotted name).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import re
import sys
from typing import Any

from entropy_openrlhf.config.paths import _fields
from entropy_openrlhf.config.schema import Config
from entropy_openrlhf.presets import PRESETS


def set_by_path(cfg: Config, key: str, value: Any) -> None:
    """Set the leaf that the dotted flag name `key` names (`async.*` is the field `async_`)."""
    *parents, leaf = key.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, {"async": "async_"}.get(part, part))
    setattr(obj, leaf, value)


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_json_object(text: str) -> dict:
    example = """'{"node_a": 1}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as {example}, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as {example}, got {text!r}")
    return value


def _converter(default):
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if isinstance(default, list):
        return lambda s: [float(x) for x in s.split(",")]
    if isinstance(default, dict):
        return _parse_json_object
    return str


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-5" for a flag (its negative-number pattern has no exponent): accept it as a value
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):
        """One line naming the flag; argparse's default prints the usage of every flag first, burying it."""
        hint = " (--help lists every flag)"
        if message.startswith("unrecognized arguments:"):
            flags = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
            close = difflib.get_close_matches(flags[0], list(self._option_string_actions), n=1) if flags else []
            hint = f"; did you mean {close[0]}?" if close else hint
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def build_parser(description: str = "", shown: Config | None = None) -> argparse.ArgumentParser:
    """One flag per leaf of `Config`, typed by its dataclass default and grouped by section. `shown`: the config
    whose values `--help` gives in brackets, the pipeline's and the preset's defaults applied (from_args builds it);
    None shows the dataclass defaults."""
    p = _Parser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        usage="%(prog)s [--preset NAME] [--<section>.<field> VALUE ...]",  # all ~150 flags would fill a screen
    )
    values = {key: value for key, _, value in _fields(shown)} if shown is not None else {}
    groups = {"": p.add_argument_group("the run")}  # --preset first: it sets the values shown below
    for key, f, default in _fields(Config()):
        section = key.split(".")[0] if "." in key else ""
        if section not in groups:
            groups[section] = p.add_argument_group(f"--{section}.*")
        flags = [f"--{key}"] + (["--pretrain"] if key == "model.pretrain" else [])
        value = values.get(key, default)
        shown_value = ",".join(str(x) for x in value) if isinstance(value, list) else value
        shown_value = json.dumps(shown_value) if isinstance(shown_value, dict) else shown_value
        groups[section].add_argument(
            *flags,
            dest=key,
            type=_converter(default),
            default=None,
            metavar={bool: "BOOL", int: "INT", float: "FLOAT", list: "A,B", dict: "JSON"}.get(type(default), "STR"),
            help=f"{f.metadata['help']} [{shown_value}]".replace("%", "%%"),
        )
    return p


# Flags that were removed, with what replaces each: named in the error rather than argparse's "unrecognized"
REMOVED = {
    "--async.is_correction": "use --offpolicy.preset token_tis (on) or --offpolicy.preset none (off); with no "
    "--offpolicy.* flag a run gets what auto gave, token TIS capped at 2 when asynchronous",
    "--async.is_cap": "use --offpolicy.preset token_tis --offpolicy.is_max CAP",
}


def from_args(argv: list[str] | None, defaults: dict[str, Any] | None = None, description: str = "") -> Config:
    """Config = dataclass defaults, then the pipeline's `defaults`, then `--preset`, then explicit flags. `--help`
    shows the values before the explicit flags: what this pipeline with this preset runs."""
    removed = [a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.split("=", 1)[0] in REMOVED]
    if removed:  # exits 2 with the usage line, as any other flag error
        build_parser(description).error(
            "; ".join(f"{flag} was removed (docs/algorithms/off_policy.md): {REMOVED[flag]}" for flag in removed)
        )
    cfg = Config()
    for key, value in (defaults or {}).items():
        set_by_path(cfg, key, value)
    # The preset is looked up first, so that --help shows its values. The full parse below reports any flag error
    # (a missing value included) as before; an unknown preset is reported after it, also as before.
    preset = _preset_in(argv) or cfg.preset
    shown = cfg
    if preset in PRESETS:
        shown = copy.deepcopy(cfg)
        apply_preset(shown, preset)
        shown.preset = preset
    args = build_parser(description, shown=shown).parse_args(argv)
    preset = args.preset or cfg.preset
    if preset:
        apply_preset(cfg, preset)
        cfg.preset = preset
    for key, value in vars(args).items():
        if value is not None:
            set_by_path(cfg, key, value)
    return cfg


def _preset_in(argv: list[str] | None) -> str | None:
    """The value of `--preset NAME` or `--preset=NAME` in argv, if any (the last, as argparse takes it)."""
    argv = sys.argv[1:] if argv is None else argv
    found = None
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--preset="):
            found = arg.split("=", 1)[1]
    return found


def apply_preset(cfg: Config, name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        set_by_path(cfg, key, value)
