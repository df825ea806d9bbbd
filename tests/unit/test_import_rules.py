"""The rules of the package's rooms (docs/index.md, "The code's rooms"), read from the code's own imports:
`algorithms/` is math with no Ray, DeepSpeed or vLLM, and no chain of imports between the package's modules leads
back to where it started, so every module stands above all it imports."""

import ast
from pathlib import Path

import entropy_openrlhf

PACKAGE = Path(entropy_openrlhf.__file__).parent
NAME = PACKAGE.name
HEAVY = ("ray", "deepspeed", "vllm")  # what the math must not need: it runs in tests and in OpenRLHF's own trainer


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def imported(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports (at its top or inside a function): the package's own by their dotted names
    (`from pkg import mod` names mod when mod is a module, else pkg), anything else by its top-level name. The
    package uses no relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name if a.name.startswith(NAME) else a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import, which this check does not resolve"
            base = node.module or ""
            if not base.startswith(NAME):
                found.add(base.split(".")[0])
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def import_graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: {m for m in imported(path, known) if m in known and m != name} for name, path in modules().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as the list of its modules (the first repeated at the end), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def test_the_math_imports_no_ray_deepspeed_or_vllm():
    known = set(modules())
    offenders = {
        name: sorted(set(HEAVY) & imported(path, known))
        for name, path in modules().items()
        if name.startswith(f"{NAME}.algorithms")
    }
    assert len(offenders) >= 10  # the walk found the algorithms' modules
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_package_s_imports_form_no_cycle():
    graph = import_graph()
    assert sum(len(v) for v in graph.values()) > 100  # the walk found the package's imports
    cycle = find_cycle(graph)
    assert not cycle, "modules that import each other in a loop: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_planted_loop():
    graph = import_graph()
    top = f"{NAME}.pipeline.trainer"
    low = f"{NAME}.algorithms.loss_terms"
    assert low in graph and top in graph
    assert find_cycle({**graph, low: graph[low] | {top}})  # the math importing the driver closes a loop
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_resolve_to_the_modules_they_load(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        f"from {NAME}.actors import reaper\nfrom {NAME}.actors.group import ActorGroup\nimport ray.util\n"
        f"def later():\n    import {NAME}.pipeline.trainer\n    from deepspeed import comm\n"
    )
    found = imported(source, set(modules()))
    assert found == {f"{NAME}.actors.reaper", f"{NAME}.actors.group", "ray", f"{NAME}.pipeline.trainer", "deepspeed"}
