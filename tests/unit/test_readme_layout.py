"""The README's Layout block is a newcomer's map of the package: every file and folder it names exists, and every
module of the package's described rooms is named in it, so a module added, moved or removed shows here first."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "entropy_openrlhf"
# rooms whose every module the block names; the others (data/, models/, integrations/, objectives/) it names as
# folders, described by a rule ("one file per objective") or by their own docstrings
DESCRIBED_ROOMS = ("", "actors", "algorithms", "config", "gpu_check", "pipeline", "rollouts", "sync")


def layout_block(readme: str) -> str:
    found = re.search(r"^## Layout\n\n```\n(.*?)^```", readme, flags=re.M | re.S)
    assert found, "README.md has no '## Layout' section with a code block"
    return found.group(1)


def named(block: str) -> set[str]:
    """The file names (x.py, x.sh, x.md) and folder names (x/) the block mentions."""
    return set(re.findall(r"\b[\w.]+\.(?:py|sh|md)\b", block)) | set(re.findall(r"\b(\w+)/", block))


def existing_names() -> set[str]:
    paths = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and "__pycache__" not in p.parts]
    return {p.name for p in paths}


def unnamed_modules(block: str) -> list[str]:
    mentioned = named(block)
    missing = []
    for room in DESCRIBED_ROOMS:
        folder = PACKAGE / room
        for entry in sorted(folder.iterdir()):
            if entry.name in {"__init__.py", "__pycache__"} or entry.name.startswith("."):
                continue
            name = entry.name if entry.suffix == ".py" else entry.name if entry.is_dir() else None
            if name is not None and name not in mentioned:
                missing.append(str(entry.relative_to(PACKAGE)))
    return missing


def test_every_name_in_the_layout_exists():
    block = layout_block((ROOT / "README.md").read_text())
    stale = sorted(named(block) - existing_names())
    assert not stale, f"README.md's Layout names what the checkout does not hold: {stale}"


def test_every_module_of_the_described_rooms_is_in_the_layout():
    block = layout_block((ROOT / "README.md").read_text())
    missing = unnamed_modules(block)
    assert not missing, f"README.md's Layout does not name these modules of entropy_openrlhf/: {missing}"


def test_the_checks_catch_a_stale_and_a_missing_name():
    block = layout_block((ROOT / "README.md").read_text())
    assert "no_such_module.py" in named(block + "  no_such_module.py\n") - existing_names()
    without_reaper = block.replace("reaper.py", "")
    assert unnamed_modules(without_reaper) == ["actors/reaper.py"]
