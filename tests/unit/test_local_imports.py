"""Imports go at the top of a module. The few that must stay inside a function (an actor-only dependency that the
driver must not load, a library that reads settings an actor sets first, what `--help` must not wait for) are
at most a dozen in the package, and each says why in a `#` comment, on the line above it or on its own line."""

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import entropy_openrlhf

PACKAGE = Path(entropy_openrlhf.__file__).parent
MOST = 12


@dataclass(frozen=True)
class LocalImport:
    path: Path
    function: str
    line: int
    statement: str
    commented: bool

    def __str__(self) -> str:
        where = self.path.relative_to(PACKAGE.parent) if self.path.is_relative_to(PACKAGE.parent) else self.path
        return f"{where}:{self.line} in {self.function}(): {self.statement}"


def local_imports(path: Path) -> list[LocalImport]:
    """The import statements inside a function (or a method) of the module at `path`, each once (under the innermost
    function that holds it), in line order. An `if __name__ == "__main__":` block is not a function: its imports do
    not count."""
    source = path.read_text()
    comments = {tok.start[0]: tok.line for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}  # fmt: skip
    found: dict[int, LocalImport] = {}
    for node in ast.walk(ast.parse(source)):  # outer functions first: an inner one's imports are then renamed to it
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                above = comments.get(sub.lineno - 1, "").lstrip().startswith("#")  # a comment line right above
                own = any(line in comments for line in range(sub.lineno, sub.end_lineno + 1))
                statement = " ".join(ast.unparse(sub).split())
                found[sub.lineno] = LocalImport(path, node.name, sub.lineno, statement, above or own)
    return [found[line] for line in sorted(found)]


def package_local_imports() -> list[LocalImport]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in local_imports(path)]


def test_at_most_a_dozen_imports_inside_functions():
    found = package_local_imports()
    listing = "\n".join(map(str, found))
    assert len(found) <= MOST, f"{len(found)} imports inside functions (at most {MOST}); move some up:\n{listing}"


def test_every_import_inside_a_function_says_why():
    silent = "\n".join(str(imp) for imp in package_local_imports() if not imp.commented)
    assert not silent, f"imports inside functions without a comment saying why they are not at the top:\n{silent}"


def test_the_scan_finds_what_it_must_and_only_that(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(
        '"""Docstring # not a comment."""\n'
        "import os\n"
        "\n"
        "\n"
        "def silent():\n"
        "    import json\n"  # 6: no comment
        "\n"
        "    def inner():\n"
        "        # the inner function's own reason\n"
        "        from pathlib import Path\n"  # 10: commented above; counted once, though two functions hold it
        "\n"
        "        return Path\n"
        "\n"
        "    return json, inner\n"
        "\n"
        "\n"
        "class Actor:\n"
        "    async def method(self):\n"
        "        import shutil  # why, on its own line\n"  # 19
        "        s = '# a string, not a comment'\n"
        "        import sys\n"  # 21: the line above holds no comment, only a string with a hash
        "        return shutil, s, sys\n"
        "\n"
        "\n"
        'if __name__ == "__main__":\n'
        "    import argparse\n"  # not a function
    )
    found = local_imports(module)
    assert [(imp.function, imp.line, imp.statement, imp.commented) for imp in found] == [
        ("silent", 6, "import json", False),
        ("inner", 10, "from pathlib import Path", True),
        ("method", 19, "import shutil", True),
        ("method", 21, "import sys", False),
    ]
