"""Every dotted flag (`--section.field`) the README and docs/ name is one the trainer's parser accepts, and so is every
one the code names in an error message or help text: a renamed or removed flag cannot live on where users read it.
Lines and sections about OpenRLHF or verl name those projects' own flags and are not checked; on
docs/guides/openrlhf.md (the OpenRLHF route) the route's `--objective.*` flags are checked against the objectives'
settings (`--objective.FIELD` is some objective's `--loss.<name>.FIELD`)."""

import re
from pathlib import Path

import pytest

from entropy_openrlhf.config import build_parser
from entropy_openrlhf.config.cli import REMOVED

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ROUTE_PAGE = ROOT / "docs" / "guides" / "openrlhf.md"
FLAG = re.compile(r"(?<![\w-])(--[a-z_]+(?:\.[a-z_0-9]+)+)")
FOREIGN = ("openrlhf", "verl")  # lines and sections about these name their flags, not ours
# Flags a page names on purpose although the parser has no such flag
NOT_OURS = {
    "--actor.lrr": "reliability.md shows the error a misspelt flag gets",
    "--loss.reinforce.scale": "extending.md's example of a new objective's setting",
    "--section.field": "the flags' pattern",
    "--prefix.field": "the flags' pattern",
    **dict.fromkeys(REMOVED, "removed: the parser refuses it naming its replacement, and the docs say so"),
}
# Code whose strings name flags to a user; integrations/ speaks OpenRLHF's flags and is left out
SOURCES = [
    path
    for folder in ("entropy_openrlhf", "pipelines", "scripts", "benchmarks", "study")
    for path in sorted((ROOT / folder).rglob("*.py"))
    if "integrations" not in path.parts
]


def our_flags() -> set[str]:
    return {flag for action in build_parser()._actions for flag in action.option_strings}


def unknown_flags(text: str, known: set[str]) -> list[tuple[int, str]]:
    """(line number, flag) for each dotted flag outside OpenRLHF/verl lines and sections that `known` lacks. In a
    table whose header names OpenRLHF or verl (a mapping of their settings to ours), only the last column is ours."""
    found, foreign_section, mapping_table = [], False, False
    for number, line in enumerate(text.splitlines(), 1):
        lower = line.lower()
        if line.startswith("#"):
            foreign_section = any(name in lower for name in FOREIGN)
        is_row = line.startswith("|")
        if is_row and not mapping_table and any(name in lower for name in FOREIGN):
            mapping_table = True  # the header row
            continue
        mapping_table = mapping_table and is_row
        if mapping_table:
            line = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
        elif foreign_section or any(name in lower for name in FOREIGN):
            continue
        found += [(number, flag) for flag in FLAG.findall(line) if flag not in known and flag not in NOT_OURS]
    return found


def route_objective_flags_unknown(text: str, known: set[str]) -> list[str]:
    """The route's `--objective.FIELD` / `--objective.NAME.FIELD` flags that no objective has."""
    fields = {flag.rsplit(".", 1)[1] for flag in known if flag.startswith("--loss.") and flag.count(".") == 2}
    unknown = []
    for flag in sorted(set(FLAG.findall(text))):
        parts = flag.split(".")
        if parts[0] != "--objective":
            continue  # OpenRLHF's own flags, passed through unchanged
        ok = parts[1] in fields if len(parts) == 2 else f"--loss.{'.'.join(parts[1:])}" in known
        if not ok:
            unknown.append(flag)
    return unknown


@pytest.mark.parametrize("page", [p for p in PAGES if p != ROUTE_PAGE], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_page_names_exists(page):
    assert unknown_flags(page.read_text(), our_flags()) == []


def test_every_flag_the_code_names_exists():
    known = our_flags()
    found = [
        f"{path.relative_to(ROOT)}:{n}: {flag}"
        for path in SOURCES
        for n, flag in unknown_flags(path.read_text(), known)
    ]
    assert found == []


def test_the_openrlhf_routes_objective_flags_are_objective_settings():
    assert route_objective_flags_unknown(ROUTE_PAGE.read_text(), our_flags()) == []


def test_the_checks_see_a_flag_that_does_not_exist():
    known = our_flags()
    page = (
        "Use `--loss.kl_cov.ratio 2e-4` and `--actor.learning_rate 1e-6`.\n"
        "OpenRLHF's `--actor.eps_clip` is its own.\n"
        "## Beside verl\n"
        "`--trainer.total_epochs` is verl's.\n"
        "## Back to ours\n"
        "`--train.num_stepz 5`\n"
        "| verl | OpenRLHF | here |\n"
        "|---|---|---|\n"
        "| `actor.optim.lr` | `--actor.adam.lr` | `--actor.lr` |\n"
        "| `ppo_epochs` | `--train.max_epochs` | `--train.ppo_epoch` |\n"
        "\n"
        "| `--train.max_epochs` in a table of ours |\n"
    )
    assert unknown_flags(page, known) == [
        (1, "--actor.learning_rate"), (6, "--train.num_stepz"), (10, "--train.ppo_epoch"), (12, "--train.max_epochs")
    ]  # fmt: skip
    route = "--objective kl_cov --objective.ratio 2e-3 --objective.gamma 1 --objective.high_entropy.top_fraction 0.1"
    assert route_objective_flags_unknown(route, known) == ["--objective.gamma", "--objective.high_entropy.top_fraction"]
