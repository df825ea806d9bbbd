"""Every relative link in the project's Markdown resolves to a file or folder that exists (README.md, docs/, study/,
and any other tracked .md), so a moved page or figure is caught here, not by a reader."""

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


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) ![fig](missing.png) [web](https://x.org) [anchor](#top)\n```\n[cmd](nope)\n```\n")
    assert relative_links(page) == ["p.md", "missing.png"]
