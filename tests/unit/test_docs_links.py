"""Every relative link in the project's Markdown resolves to a file or folder that exists (README.md, docs/, study/,
and any other tracked .md), and every `#anchor` to a heading of its page, so a moved page, section or figure is
caught here, not by a reader."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / line for line in listed.stdout.splitlines() if line]
    # pages added but not committed yet count too (the test runs before the commit)
    return sorted({*files, *ROOT.glob("docs/**/*.md"), *ROOT.glob("study/*.md"), ROOT / "README.md"})


def without_code(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links or headings


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(without_code(page)) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """The page's heading anchors as GitHub makes them: lower case, punctuation other than - and _ dropped, spaces
    as -, and -1, -2, ... after a repeated one."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", without_code(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_anchors(page: Path) -> list[str]:
    """Links of `page` to `#anchor` (on itself) or `other.md#anchor` whose page has no such heading."""
    broken = []
    for target in LINK.findall(without_code(page)):
        if re.match(r"^[a-z]+:", target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        linked = page.parent / path if path else page
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) ![fig](missing.png) [web](https://x.org) [anchor](#top)\n```\n[cmd](nope)\n```\n")
    assert relative_links(page) == ["p.md", "missing.png"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_names_a_heading(page):
    assert not broken_anchors(page), f"{page.relative_to(ROOT)}: anchors to no heading: {broken_anchors(page)}"


def test_the_checker_sees_a_broken_anchor(tmp_path):
    other = tmp_path / "other.md"
    other.write_text("# Start here: the one-GPU check\n## W&B\n## W&B\n```\n# not a heading\n```\n")
    page = tmp_path / "p.md"
    page.write_text(
        "## Top `flag` (x)\n[a](#top-flag-x) [b](other.md#start-here-the-one-gpu-check) [c](other.md#wb-1) "
        "[d](#missing) [e](other.md#not-a-heading) [f](other.md#wb-2)\n"
    )
    assert broken_anchors(page) == ["#missing", "other.md#not-a-heading", "other.md#wb-2"]
